//! The optional bearer token and its constant-time check.

use std::fmt;

use subtle::ConstantTimeEq;

/// A bearer token a scrape must present as `Authorization: Bearer <token>`.
///
/// Its `Debug` output never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Box<[u8]>);

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

impl BearerToken {
    /// Wraps `token`, or returns `None` when it is empty or all whitespace
    /// (an empty token would let a bare `Bearer ` through).
    pub fn new(token: impl Into<String>) -> Option<Self> {
        let token = token.into();
        let trimmed = token.trim();
        if trimmed.is_empty() {
            return None;
        }
        Some(Self(trimmed.as_bytes().into()))
    }

    /// Whether `authorization`, the value of a request's `Authorization`
    /// header, carries this token.
    ///
    /// The scheme is matched case-insensitively; the token bytes are compared
    /// in constant time (`subtle`), so response timing does not reveal how
    /// much of a guess was right. Only the token's length can leak.
    pub fn authorize(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization else {
            return false;
        };
        let Some((scheme, presented)) = split_scheme(value) else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(b"bearer") {
            return false;
        }
        bool::from(self.0.as_ref().ct_eq(trim_ascii(presented)))
    }
}

/// Splits `Bearer abc` at its first space.
fn split_scheme(value: &[u8]) -> Option<(&[u8], &[u8])> {
    let space = value.iter().position(|b| *b == b' ')?;
    Some((&value[..space], &value[space + 1..]))
}

fn trim_ascii(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |i| i + 1);
    bytes.get(start..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_under_the_bearer_scheme_passes() {
        let token = BearerToken::new("s3cret-token").expect("non-empty");
        assert!(token.authorize(Some(b"Bearer s3cret-token")));
        assert!(token.authorize(Some(b"bearer s3cret-token")));
        assert!(token.authorize(Some(b"Bearer  s3cret-token ")));
        for wrong in [
            &b"Bearer s3cret-toke"[..],
            b"Bearer s3cret-token2",
            b"Bearer S3cret-token",
            b"Basic s3cret-token",
            b"Bearer",
            b"Bearer ",
            b"s3cret-token",
            b"",
        ] {
            assert!(
                !token.authorize(Some(wrong)),
                "{:?}",
                String::from_utf8_lossy(wrong)
            );
        }
        assert!(!token.authorize(None));
    }

    #[test]
    fn an_empty_token_is_no_token_and_debug_hides_it() {
        assert!(BearerToken::new("").is_none());
        assert!(BearerToken::new(" \t").is_none());
        let token = BearerToken::new("s3cret-token").expect("non-empty");
        assert!(!format!("{token:?}").contains("s3cret"));
    }
}
