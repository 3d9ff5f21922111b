//! Validated lock names.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

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
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

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
}
