//! What a lock key's value says, and the mark a forced release leaves.
//!
//! The value is the owner token's 32 hex digits. A holder that names itself
//! (every acquire through a `Locker`) appends a space, the acquire time in
//! Unix milliseconds by the holder's own clock, a space and its identity:
//! `3f…c1 1765069200123 web-1/4242/0a1b2c3d`. Everything that decides who
//! holds a key compares on the token alone, so a key written with an
//! identity and one written without (`try_acquire`, an older version of this
//! library) behave the same; an inspection reads the rest, and a value that
//! is not in this form (a stock client's) is a holder with no identity.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Compare, CompareOp};
use lock_core::{Identity, OwnerToken};

/// Where the marks of forced releases live, after the backend's prefix:
/// `<prefix>#forced/<name>`. Lock names cannot hold a `#`, so no lock key
/// is ever one.
pub(crate) const MARKS: &str = "#forced/";

/// Length of an owner token in hex.
const TOKEN_LEN: usize = 32;

/// The byte after the token in a value that carries more.
const SEPARATOR: u8 = b' ';

/// The value an acquire by `owner` writes: the token, then, if the holder
/// named itself, when (by this process's clock) and who.
pub(crate) fn value_for(owner: &OwnerToken, holder: Option<&Identity>, at: SystemTime) -> String {
    let mut value = owner.to_hex();
    if let Some(identity) = holder {
        let millis = at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        value.push(char::from(SEPARATOR));
        value.push_str(&millis.to_string());
        value.push(char::from(SEPARATOR));
        value.push_str(identity.as_str());
    }
    value
}

/// Whether `value` is a key of `owner`'s: its token, alone or followed by
/// the holder's data.
pub(crate) fn owned_by(value: &[u8], owner: &OwnerToken) -> bool {
    value.len() >= TOKEN_LEN
        && value[..TOKEN_LEN] == owner.to_hex_bytes()
        && (value.len() == TOKEN_LEN || value[TOKEN_LEN] == SEPARATOR)
}

/// Compares that hold in a transaction exactly when `key`'s value is one
/// [`owned_by`] `owner` accepts (and the key exists): etcd compares values
/// only whole, so the value must lie between two bounds. Above: the token
/// followed by `!`, the byte after the separator. Below: the token with its
/// last digit lowered by one and followed by a `0xff` byte, which no UTF-8
/// text holds; between that and the token lie only values that start with
/// that lowered token and a `0xff` byte, which nothing writes.
pub(crate) fn owner_compares(key: &str, owner: &OwnerToken) -> [Compare; 2] {
    let (below, above) = owner_bounds(owner);
    [
        Compare::value(key, CompareOp::Greater, below),
        Compare::value(key, CompareOp::Less, above),
    ]
}

/// The bounds of [`owner_compares`], exclusive.
fn owner_bounds(owner: &OwnerToken) -> (Vec<u8>, Vec<u8>) {
    let token = owner.to_hex_bytes();
    let mut below = token.to_vec();
    // Hex digits are never the byte 0, so lowering the last one cannot wrap.
    below[TOKEN_LEN - 1] = token[TOKEN_LEN - 1].saturating_sub(1);
    below.push(0xff);
    let mut above = token.to_vec();
    above.push(SEPARATOR + 1);
    (below, above)
}

/// What a value records about its holder, beyond the token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Recorded {
    /// Whether the value starts with an owner token: written by this
    /// library (any version), so a forced release can leave a mark for it.
    pub(crate) ours: bool,
    pub(crate) identity: Option<Identity>,
    /// By the holder's clock.
    pub(crate) acquired_at: Option<SystemTime>,
}

/// Reads a lock key's value; anything not in this library's form is a
/// holder that recorded nothing.
pub(crate) fn decode(value: &[u8]) -> Recorded {
    let token_like = value.len() >= TOKEN_LEN
        && value[..TOKEN_LEN]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    if !token_like {
        return Recorded::default();
    }
    if value.len() == TOKEN_LEN {
        return Recorded {
            ours: true,
            ..Recorded::default()
        };
    }
    if value[TOKEN_LEN] != SEPARATOR {
        return Recorded::default();
    }
    let rest = std::str::from_utf8(&value[TOKEN_LEN + 1..]).unwrap_or_default();
    let (millis, identity) = rest.split_once(char::from(SEPARATOR)).unwrap_or(("", ""));
    Recorded {
        ours: true,
        identity: Identity::new(identity).ok(),
        acquired_at: millis
            .parse::<u64>()
            .ok()
            .and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> OwnerToken {
        OwnerToken::generate().expect("randomness")
    }

    #[test]
    fn values_round_trip_and_compare_on_the_token() {
        let (owner, other) = (token(), token());
        let who = Identity::new("web-1/4242/0a1b2c3d").expect("valid");
        let at = UNIX_EPOCH + Duration::from_millis(1_765_069_200_123);
        let full = value_for(&owner, Some(&who), at);
        let bare = value_for(&owner, None, at);
        assert_eq!(bare, owner.to_hex());
        assert!(owned_by(full.as_bytes(), &owner));
        assert!(owned_by(bare.as_bytes(), &owner));
        assert!(!owned_by(full.as_bytes(), &other));
        assert!(!owned_by(format!("{bare}0").as_bytes(), &owner));
        assert!(!owned_by(&bare.as_bytes()[..31], &owner));
        let got = decode(full.as_bytes());
        assert!(got.ours);
        assert_eq!(got.identity, Some(who));
        assert_eq!(got.acquired_at, Some(at));
        assert_eq!(
            decode(bare.as_bytes()),
            Recorded {
                ours: true,
                ..Recorded::default()
            }
        );
        assert_eq!(decode(b"x"), Recorded::default());
        assert_eq!(
            decode(format!("{bare}-junk").as_bytes()),
            Recorded::default()
        );
    }

    #[test]
    fn the_compare_bounds_enclose_exactly_the_owners_values() {
        // The same order etcd uses: bytes, lexicographically.
        for _ in 0..200 {
            let owner = token();
            let (below, above) = owner_bounds(&owner);
            let inside = |v: &[u8]| v > below.as_slice() && v < above.as_slice();
            let who = Identity::new("a b").expect("valid");
            assert!(inside(owner.to_hex().as_bytes()));
            assert!(inside(
                value_for(&owner, Some(&who), SystemTime::now()).as_bytes()
            ));
            let other = token();
            assert!(!inside(other.to_hex().as_bytes()));
            assert!(!inside(
                value_for(&other, Some(&who), SystemTime::now()).as_bytes()
            ));
            assert!(!inside(format!("{}0", owner.to_hex()).as_bytes()));
            assert!(!inside(&owner.to_hex().as_bytes()[..31]));
        }
    }
}
