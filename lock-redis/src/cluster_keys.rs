//! Redis Cluster key slots, and the hash tags that place a key in a chosen
//! slot.
//!
//! A script may only touch keys of one slot, so in cluster mode every key a
//! script touches besides the lock key carries a hash tag that puts it in
//! the lock key's slot. The slot function is the server's (CRC16-XMODEM of
//! the key, or of its hash tag, modulo 16,384); the redis crate computes it
//! too but does not export it.
//!
//! The tags are part of the on-server format: a lock's fencing counter is
//! `<prefix>#fence{<tag>}` with the tag [`slot_tag`] returns for the lock
//! key's slot. Changing the enumeration would move counters, and tokens
//! would start again from another counter's value.

use std::sync::LazyLock;

/// How many slots a Redis Cluster has.
pub(crate) const SLOTS: u16 = 16_384;

/// The alphabet of the tag enumeration, in order.
const TAG_ALPHABET: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// The longest tag tried. Every slot has a tag of at most 4 characters
/// (pinned by a test); longer ones are a safety net that is never reached.
const MAX_TAG_LEN: u32 = 5;

/// CRC16-XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster uses.
pub(crate) fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Returns the Redis Cluster slot of `key`, as `CLUSTER KEYSLOT` does: the
/// CRC16 of the text between its first `{` and the next `}` when that text
/// is not empty, else of the whole key, modulo 16,384. For operators and
/// tests that need to know which node holds a lock.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let after = key.get(open + 1..)?;
            let close = after.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &after[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// The first tag of the enumeration (`0`..`z`, then `00`..`zz`, and so
/// on) that hashes to each slot, built once on first use.
static TAGS: LazyLock<Vec<String>> = LazyLock::new(build_tags);

fn build_tags() -> Vec<String> {
    let mut tags: Vec<Option<String>> = vec![None; usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    let base = TAG_ALPHABET.len();
    'lengths: for len in 1..=MAX_TAG_LEN {
        let count = base.pow(len);
        let mut tag = vec![0u8; len as usize];
        for mut n in 0..count {
            for place in tag.iter_mut().rev() {
                *place = TAG_ALPHABET[n % base];
                n /= base;
            }
            let slot = usize::from(crc16(&tag) % SLOTS);
            if let Some(entry @ None) = tags.get_mut(slot) {
                *entry = Some(String::from_utf8_lossy(&tag).into_owned());
                missing -= 1;
                if missing == 0 {
                    break 'lengths;
                }
            }
        }
    }
    // A slot without a tag (never the case, see the tests) gets an empty
    // string; `fence_tag` then falls back to a per-key counter.
    tags.into_iter().map(Option::unwrap_or_default).collect()
}

/// The tag whose slot is `slot` (taken modulo 16,384), or `None` in the
/// impossible case that the enumeration has none.
pub(crate) fn slot_tag(slot: u16) -> Option<&'static str> {
    TAGS.get(usize::from(slot % SLOTS))
        .map(String::as_str)
        .filter(|t| !t.is_empty())
}

/// The hash tag (without braces) that puts a key in the same slot as `key`.
/// Falls back to `key` itself, which is always right but would give every
/// key its own counter.
pub(crate) fn fence_tag(key: &str) -> &str {
    slot_tag(key_slot(key.as_bytes())).unwrap_or(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_the_reference_vectors() {
        // The check value of CRC-16/XMODEM, and the example of the Redis
        // Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"123456789"), 0x31C3 % SLOTS);
    }

    #[test]
    fn key_slots_follow_the_hash_tag_rules() {
        // Values from CLUSTER KEYSLOT on redis 7.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"no{close"), crc16(b"no{close") % SLOTS);
        assert_eq!(key_slot(b""), 0);
    }

    #[test]
    fn every_slot_has_a_tag_of_at_most_four_characters() {
        for slot in 0..SLOTS {
            let tag = slot_tag(slot).unwrap_or_else(|| panic!("slot {slot} has no tag"));
            assert!(tag.len() <= 4, "slot {slot}: {tag}");
            assert_eq!(key_slot(format!("lock:#fence{{{tag}}}").as_bytes()), slot);
        }
    }

    #[test]
    fn tags_are_pinned() {
        // Part of the on-server format: these must never change.
        let pinned: Vec<(u16, &str)> = (0..4).map(|s| (s, slot_tag(s).unwrap_or(""))).collect();
        assert_eq!(pinned, PINNED.to_vec());
        let key = "lock:billing/nightly";
        let tag = fence_tag(key);
        assert_eq!(
            key_slot(format!("lock:#fence{{{tag}}}").as_bytes()),
            key_slot(key.as_bytes())
        );
    }

    const PINNED: [(u16, &str); 4] = [(0, "1bz"), (1, "emj"), (2, "7lw"), (3, "6i7")];
}
