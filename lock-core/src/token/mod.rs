//! Owner tokens: the unguessable identity of one lease.

use std::fmt;

use crate::Error;

mod rng;

/// 128 random bits that identify one acquisition of one lock.
///
/// Every acquire draws a fresh token from a cryptographically secure
/// generator (ChaCha12) that each thread seeds from the operating system's
/// random source, so a token is unpredictable and never reused. Renew and
/// release compare on it, which is what stops a stale holder from extending
/// or deleting a successor's lock. A token is a capability: anyone who knows
/// it can release the lease, so its `Display` and `Debug` forms show only a
/// prefix, and metrics never carry it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken([u8; 16]);

impl OwnerToken {
    /// Draws a new token: 128 bits from this thread's generator, which is
    /// seeded from the operating system's random source on the thread's first
    /// token and again every few thousand tokens, so drawing one is not a
    /// system call.
    ///
    /// # Errors
    ///
    /// [`Error::Entropy`] if the operating system cannot supply the seed.
    pub fn generate() -> Result<Self, Error> {
        rng::draw().map(Self)
    }

    /// Rebuilds a token from its bytes, for backends that store it in binary form.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The token's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The token as 32 lowercase hexadecimal characters, the form backends store.
    pub fn to_hex(&self) -> String {
        // Hex digits are ASCII, so this copies the bytes as they are; a
        // string built char by char costs about ten times as much, on every
        // acquire and release of the Redis and etcd backends.
        String::from_utf8_lossy(&self.to_hex_bytes()).into_owned()
    }

    /// The ASCII bytes of [`OwnerToken::to_hex`], without allocating: for
    /// comparing a stored value with this token on hot paths such as a
    /// renewal sweep over thousands of leases.
    pub fn to_hex_bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (pair, b) in out.chunks_exact_mut(2).zip(self.0) {
            pair[0] = hex_digit(b >> 4);
            pair[1] = hex_digit(b & 0x0f);
        }
        out
    }

    /// Parses the form produced by [`OwnerToken::to_hex`]; `None` if it is not
    /// exactly 32 hexadecimal characters.
    pub fn from_hex(text: &str) -> Option<Self> {
        let raw = text.as_bytes();
        if raw.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, pair) in raw.chunks_exact(2).enumerate() {
            bytes[i] = (hex_value(pair[0])? << 4) | hex_value(pair[1])?;
        }
        Some(Self(bytes))
    }
}

fn hex_digit(nibble: u8) -> u8 {
    b"0123456789abcdef"[usize::from(nibble & 0x0f)]
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Shows an 8-character prefix (enough to tell tokens apart in logs), never
/// the whole capability; [`OwnerToken::to_hex`] is the full form.
impl fmt::Display for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}…", &self.to_hex()[..8])
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({}…)", &self.to_hex()[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn hex_round_trips_and_rejects_garbage() -> Result<(), Error> {
        let token = OwnerToken::generate()?;
        assert_eq!(OwnerToken::from_hex(&token.to_hex()), Some(token));
        assert_eq!(OwnerToken::from_hex("xyz"), None);
        assert_eq!(OwnerToken::from_hex(&"g".repeat(32)), None);
        assert_eq!(token.to_hex().as_bytes(), &token.to_hex_bytes());
        let known = OwnerToken::from_bytes([
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xf0, 0x0f, 0x10, 0x01, 0xfe, 0xdc,
            0xba, 0x98,
        ]);
        assert_eq!(known.to_hex(), "0123456789abcdeff00f1001fedcba98");
        for shown in [format!("{token:?}"), format!("{token}"), token.to_string()] {
            assert!(!shown.contains(&token.to_hex()[..9]), "{shown}");
            assert!(shown.contains(&token.to_hex()[..8]), "{shown}");
        }
        Ok(())
    }

    #[test]
    fn tokens_do_not_repeat_across_threads() {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..25_000)
                        .map(|_| OwnerToken::generate().map(|t| *t.as_bytes()))
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        let mut seen = HashSet::new();
        for handle in handles {
            let tokens = handle
                .join()
                .expect("token thread panicked")
                .expect("random source failed");
            for t in tokens {
                assert!(seen.insert(t), "duplicate owner token");
            }
        }
        assert_eq!(seen.len(), 100_000);
    }
}
