//! Validated lock names.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::Error;

/// The longest accepted lock name, in bytes.
pub const MAX_NAME_LEN: usize = 200;

/// A validated lock name: 1 to [`MAX_NAME_LEN`] bytes of `[A-Za-z0-9._:/-]`.
///
/// The character set is deliberately narrow so that every backend can use the
/// name verbatim inside its own key space (a Redis key, an etcd key, the input
/// of the Postgres key hash) without escaping, and so that a name can never
/// smuggle a glob pattern (`*`, `?`, `[`), a hash tag (`{}`) or a NUL byte.
/// Cloning is cheap (the text is reference counted).
///
/// # Examples
///
/// ```
/// use lock_core::LockName;
///
/// let name = LockName::new("billing/nightly-report").unwrap();
/// assert_eq!(name.as_str(), "billing/nightly-report");
/// assert!(LockName::new("has space").is_err());
/// ```
#[derive(Clone, Eq, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// Validates `name` and wraps it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] when the name is empty, longer than
    /// [`MAX_NAME_LEN`] bytes, or contains a character outside `[A-Za-z0-9._:/-]`.
    pub fn new(name: impl AsRef<str>) -> Result<Self, Error> {
        let text = name.as_ref();
        validate(text)?;
        Ok(Self(Arc::from(text)))
    }

    /// A lock name for `key` under `prefix`, for names built from arbitrary
    /// input (user ids, e-mail addresses, URLs, file paths) that the name
    /// rules may refuse.
    ///
    /// The name is `prefix/key` when `key` is made of name characters, fits,
    /// and does not itself start with `sha256:`; otherwise it is
    /// `prefix/sha256:` and the first 32 hex digits of the key's SHA-256. The
    /// same key gives the same name in every process and version. Two keys
    /// share a name only by a 128-bit hash collision, which cannot be crafted,
    /// and would only make them share one lock.
    ///
    /// Keep per-entity names out of metric labels (one series per entity):
    /// give their options a fixed label with
    /// [`LockOptions::with_metric_label`](crate::LockOptions::with_metric_label).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] when `prefix` is not a valid name or leaves no
    /// room for a hashed key (it may be at most `MAX_NAME_LEN - 40` bytes).
    ///
    /// # Examples
    ///
    /// ```
    /// use lock_core::LockName;
    ///
    /// let plain = LockName::for_key("invoice", "2026-0042")?;
    /// assert_eq!(plain.as_str(), "invoice/2026-0042");
    /// let hashed = LockName::for_key("user", "Zoë <zoe@example.com>")?;
    /// assert!(hashed.as_str().starts_with("user/sha256:"));
    /// assert_eq!(hashed, LockName::for_key("user", "Zoë <zoe@example.com>")?);
    /// # Ok::<(), lock_core::Error>(())
    /// ```
    pub fn for_key(prefix: &str, key: impl AsRef<[u8]>) -> Result<Self, Error> {
        validate(prefix)?;
        if prefix.len() + 1 + HASHED_KEY_LEN > MAX_NAME_LEN {
            return Err(Error::InvalidName {
                name: truncate_for_message(prefix),
                reason: format!(
                    "a key prefix is at most {} bytes, so that a hashed key fits in {MAX_NAME_LEN}",
                    MAX_NAME_LEN - 1 - HASHED_KEY_LEN
                ),
            });
        }
        let key = key.as_ref();
        if let Ok(text) = std::str::from_utf8(key) {
            let plain = format!("{prefix}/{text}");
            if !text.is_empty() && !text.starts_with(HASH_MARK) && validate(&plain).is_ok() {
                return Ok(Self(Arc::from(plain)));
            }
        }
        let digest = Sha256::digest(key);
        let mut name = format!("{prefix}/{HASH_MARK}");
        for byte in &digest[..HASHED_KEY_LEN.saturating_sub(HASH_MARK.len()) / 2] {
            name.push_str(&format!("{byte:02x}"));
        }
        Ok(Self(Arc::from(name)))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What marks a hashed key, and the length of `sha256:` plus 32 hex digits.
const HASH_MARK: &str = "sha256:";
const HASHED_KEY_LEN: usize = 39;

fn validate(text: &str) -> Result<(), Error> {
    let invalid = |reason: String| Error::InvalidName {
        name: truncate_for_message(text),
        reason,
    };
    if text.is_empty() {
        return Err(invalid("a lock name must not be empty".into()));
    }
    if text.len() > MAX_NAME_LEN {
        return Err(invalid(format!(
            "a lock name is at most {MAX_NAME_LEN} bytes, this one has {}",
            text.len()
        )));
    }
    if let Some(bad) = text.chars().find(|c| !is_name_char(*c)) {
        return Err(invalid(format!(
            "character {bad:?} is not allowed; use only A-Z a-z 0-9 . _ : / -"
        )));
    }
    Ok(())
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '/' | '-')
}

/// Keeps error messages readable when someone passes a megabyte of text.
fn truncate_for_message(text: &str) -> String {
    const SHOWN: usize = 64;
    match text.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// Equal texts are equal names. Clones of one name share their text, and
/// the in-process guard and the backends' tables compare a name with a
/// clone of itself on every acquire and release: the pointer is compared
/// first, the text only if the pointers differ (std's `Arc` does that only
/// for sized types, not for `str`).
impl PartialEq for LockName {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || *self.0 == *other.0
    }
}

/// Hashes the text alone, as equality compares it.
impl std::hash::Hash for LockName {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl AsRef<str> for LockName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for LockName {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<&str> for LockName {
    type Error = Error;

    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl TryFrom<String> for LockName {
    type Error = Error;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        let all = "AZaz09._:/-";
        assert_eq!(
            LockName::new(all).map(|n| n.to_string()).ok(),
            Some(all.to_owned())
        );
        assert!(LockName::new("x".repeat(MAX_NAME_LEN)).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_foreign_characters() {
        for bad in ["", " ", "a b", "a*", "{tag}", "a\0b", "ä", "a?b", "a[b]"] {
            assert!(
                matches!(LockName::new(bad), Err(Error::InvalidName { .. })),
                "{bad:?} must be rejected"
            );
        }
        let long = "x".repeat(MAX_NAME_LEN + 1);
        match LockName::new(&long) {
            Err(Error::InvalidName { name, reason }) => {
                assert!(name.len() < 100, "message must not echo 201 bytes");
                assert!(reason.contains("201"), "{reason}");
            }
            other => panic!("expected InvalidName, got {other:?}"),
        }
    }

    #[test]
    fn keys_are_used_as_is_or_hashed_stably() -> Result<(), Error> {
        assert_eq!(
            LockName::for_key("invoice", "2026-0042")?.as_str(),
            "invoice/2026-0042"
        );
        // SHA-256 of the empty string starts e3b0c442...: the form is fixed
        // across versions, since every replica must derive the same name.
        assert_eq!(
            LockName::for_key("p", "")?.as_str(),
            "p/sha256:e3b0c44298fc1c149afbf4c8996fb924"
        );
        let long = "k".repeat(MAX_NAME_LEN);
        for key in [
            "a b".as_bytes(),
            "Zoë".as_bytes(),
            "{tag}*".as_bytes(),
            long.as_bytes(),
            b"\xff\xfe not utf-8",
        ] {
            let name = LockName::for_key("user", key)?;
            assert!(name.as_str().starts_with("user/sha256:"), "{name}");
            assert_eq!(name.as_str().len(), "user/".len() + HASHED_KEY_LEN);
            assert_eq!(name, LockName::for_key("user", key)?);
        }
        // A key that looks hashed is hashed too, so it cannot take the name
        // of the key whose hash it spells.
        let hashed = LockName::for_key("p", "")?;
        let lookalike = hashed.as_str().trim_start_matches("p/");
        assert_ne!(LockName::for_key("p", lookalike)?, hashed);
        assert_ne!(
            LockName::for_key("p", "a b")?,
            LockName::for_key("p", "a c")?
        );
        Ok(())
    }

    #[test]
    fn key_prefixes_are_checked() {
        assert!(matches!(
            LockName::for_key("bad prefix", "k"),
            Err(Error::InvalidName { .. })
        ));
        let longest = "p".repeat(MAX_NAME_LEN - 1 - HASHED_KEY_LEN);
        let name = LockName::for_key(&longest, "a b").expect("fits exactly");
        assert_eq!(name.as_str().len(), MAX_NAME_LEN);
        assert!(matches!(
            LockName::for_key(&format!("{longest}p"), "k"),
            Err(Error::InvalidName { reason, .. }) if reason.contains("key prefix")
        ));
    }
}
