//! Who holds a lock: the holder's identity stored with each lease, what an
//! inspection answers, and what a forced release did.
//!
//! Everything here is a snapshot: a lock described as free may be taken the
//! moment the answer returns, and a holder may lose its lease just after it
//! was listed. Use these for operators and admin pages, never to decide
//! whether to write.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use crate::{Error, LockName, OwnerToken};

/// The longest accepted holder identity, in bytes.
pub const MAX_IDENTITY_LEN: usize = 128;

/// The most holders one [`LockBackend::list`](crate::LockBackend::list) call
/// returns; larger page sizes are lowered to it.
pub const MAX_LIST_PAGE: usize = 1_000;

/// A holder's name as stored with every lock it takes, for people: which
/// host, process and instance holds a lock.
///
/// 1 to [`MAX_IDENTITY_LEN`] bytes of printable ASCII without spaces at the
/// ends. Never put a secret in it: anyone who can read the lock's key can
/// read it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Identity(Arc<str>);

impl Identity {
    /// Validates `text` and wraps it.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the text is empty, longer than
    /// [`MAX_IDENTITY_LEN`] bytes, has spaces at either end, or holds a
    /// character outside printable ASCII.
    pub fn new(text: impl AsRef<str>) -> Result<Self, Error> {
        let text = text.as_ref();
        if text.is_empty() || text.len() > MAX_IDENTITY_LEN {
            return Err(Error::Config(format!(
                "a holder identity must be 1 to {MAX_IDENTITY_LEN} bytes long, not {}",
                text.len()
            )));
        }
        if text.trim() != text || !text.bytes().all(|b| (b' '..=b'~').contains(&b)) {
            return Err(Error::Config(format!(
                "a holder identity must be printable ASCII without spaces at its ends: {:?}",
                text.escape_debug().to_string()
            )));
        }
        Ok(Self(Arc::from(text)))
    }

    /// This process's default identity, `host/pid/instance`: the host name,
    /// the process id and 8 random hex digits drawn once per process (so two
    /// runs of one program on one host, or a recycled pid, tell apart).
    pub fn for_process() -> Self {
        static DEFAULT: OnceLock<Identity> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                let host = host_name();
                let instance = OwnerToken::generate()
                    .map(|t| t.to_hex()[..8].to_owned())
                    .unwrap_or_else(|_| "00000000".to_owned());
                let text = format!("{host}/{}/{instance}", std::process::id());
                Self::new(&text).unwrap_or_else(|_| Self(Arc::from("unnamed-process")))
            })
            .clone()
    }

    /// The identity's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The host name, shortened and stripped to characters an identity accepts;
/// `unknown-host` when the system does not say.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let clean: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(64)
        .collect();
    if clean.is_empty() {
        "unknown-host".to_owned()
    } else {
        clean
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who holds one lock, as its backend recorded it.
///
/// Times are by the server's clock where the backend's answers carry one
/// (Redis, Postgres); etcd's answers carry none, so there the acquire time
/// is the holder's clock and the expiry is now plus the lease's remaining
/// TTL (whole seconds). A backend that has no clock of its own (memory)
/// uses this process's. A field the backend cannot know is
/// `None`; a lock taken by a program that writes no holder data (a stock
/// client, an older version of this library) has no `identity`, and is still
/// reported as held.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The lock.
    pub name: LockName,
    /// Who took it; `None` for a holder that wrote no identity.
    pub identity: Option<Identity>,
    /// The lease's fencing token, where the backend issues them: the token
    /// [`LockBackend::force_release`](crate::LockBackend::force_release) expects.
    pub fencing_token: Option<u64>,
    /// When the lease was taken.
    pub acquired_at: Option<SystemTime>,
    /// When it was last renewed (or taken, if never renewed).
    pub renewed_at: Option<SystemTime>,
    /// When the server forgets it unless renewed; `None` for a lease that
    /// lives as long as its holder's session (Postgres).
    pub expires_at: Option<SystemTime>,
}

impl Holder {
    /// A holder of `name` about which nothing else is known.
    pub fn unknown(name: LockName) -> Self {
        Self {
            name,
            identity: None,
            fencing_token: None,
            acquired_at: None,
            renewed_at: None,
            expires_at: None,
        }
    }

    /// The same, naming who holds it.
    #[must_use]
    pub fn with_identity(mut self, identity: Option<Identity>) -> Self {
        self.identity = identity;
        self
    }

    /// The same, with the lease's fencing token.
    #[must_use]
    pub fn with_fencing_token(mut self, token: Option<u64>) -> Self {
        self.fencing_token = token;
        self
    }

    /// The same, with when it was taken and last renewed.
    #[must_use]
    pub fn with_times(
        mut self,
        acquired_at: Option<SystemTime>,
        renewed_at: Option<SystemTime>,
    ) -> Self {
        self.acquired_at = acquired_at;
        self.renewed_at = renewed_at;
        self
    }

    /// The same, with when the server forgets it.
    #[must_use]
    pub fn with_expires_at(mut self, at: Option<SystemTime>) -> Self {
        self.expires_at = at;
        self
    }
}

/// One page of [`LockBackend::list`](crate::LockBackend::list).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HolderPage {
    /// The held locks found on this page, in no promised order.
    pub holders: Vec<Holder>,
    /// Where the next page starts; `None` when this was the last. Opaque:
    /// pass it back as it is.
    pub next: Option<String>,
}

impl HolderPage {
    /// A page of `holders`, followed by the page at `next` if any.
    pub fn new(holders: Vec<Holder>, next: Option<String>) -> Self {
        Self { holders, next }
    }
}

/// What a forced release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForceOutcome {
    /// The lease with the expected token was freed; its holder will see
    /// [`LossReason::Forced`](crate::LossReason::Forced).
    Released,
    /// Nobody holds the lock; nothing was changed.
    NotHeld,
    /// Another lease holds the lock (a successor, or a holder without a
    /// token); nothing was changed.
    TokenMismatch {
        /// The token of the lease that holds it, when it has one.
        held: Option<u64>,
    },
}

/// Checks a [`LockBackend::list`](crate::LockBackend::list) prefix: empty
/// (every lock), or the start of a lock name.
///
/// # Errors
///
/// [`Error::InvalidName`] for a prefix longer than a name or with a character
/// a name cannot hold (so no glob characters or control characters reach a
/// backend's pattern syntax).
pub fn validate_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.is_empty() {
        return Ok(());
    }
    // A prefix is a name's start: the same rules, one character at a time.
    let invalid = |reason: String| Error::InvalidName {
        name: prefix.escape_debug().to_string(),
        reason,
    };
    if prefix.len() > crate::MAX_NAME_LEN {
        return Err(invalid(format!(
            "a prefix is at most {} bytes",
            crate::MAX_NAME_LEN
        )));
    }
    match prefix
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '/' | '-')))
    {
        Some(c) => Err(invalid(format!(
            "{:?} cannot appear in a lock name, so no name starts with this prefix (names use [A-Za-z0-9._:/-]; no wildcards)",
            c
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_bounded_printable_text() {
        assert!(Identity::new("web-1/4242/0a1b2c3d").is_ok());
        assert!(Identity::new("").is_err());
        assert!(Identity::new(" padded").is_err());
        assert!(Identity::new("tab\there").is_err());
        assert!(Identity::new("é").is_err());
        assert!(Identity::new("x".repeat(MAX_IDENTITY_LEN)).is_ok());
        assert!(Identity::new("x".repeat(MAX_IDENTITY_LEN + 1)).is_err());
    }

    #[test]
    fn the_process_identity_names_host_pid_and_instance() {
        let id = Identity::for_process();
        let parts: Vec<&str> = id.as_str().rsplitn(3, '/').collect();
        assert_eq!(parts.len(), 3, "{id}");
        assert_eq!(parts[1], std::process::id().to_string());
        assert_eq!(parts[0].len(), 8);
        assert_eq!(id, Identity::for_process(), "drawn once per process");
    }

    #[test]
    fn prefixes_refuse_wildcards_and_control_characters() {
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("jobs/").is_ok());
        for bad in ["jobs*", "a?b", "[x]", "a\nb", "{tag}", "sp ace"] {
            let err = validate_prefix(bad).expect_err(bad).to_string();
            assert!(err.contains("prefix"), "{err}");
        }
        assert!(validate_prefix(&"a".repeat(crate::MAX_NAME_LEN + 1)).is_err());
    }
}
