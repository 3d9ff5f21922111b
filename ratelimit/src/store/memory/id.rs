//! The ids of in-process buckets: a subject's keyed 128-bit hash and a keyed
//! hash of the limit's name, with the hasher that passes them through.

use std::hash::{Hash, Hasher};

use siphasher::sip128::SipHasher13;

/// A bucket of a limiter deciding in process: its subject's 128-bit keyed
/// hash (keyed per limiter, see [`SubjectHasher`]) and a keyed hash of the
/// limit's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BucketId {
    pub(super) subject: [u64; 2],
    pub(super) limit: u64,
}

impl Hash for BucketId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The subject's words are already keyed SipHash outputs: uniform and
        // unpredictable without this process's random key, so one of them
        // (mixed with the limit) is the map hash, with no second hashing.
        state.write_u64(self.subject[0] ^ self.limit.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
}

/// Turns one limiter's subjects into the 128-bit ids of its buckets: SipHash
/// 1-3 with 128-bit output, in one pass, under a key derived from the
/// store's random key and the limiter's key prefix and name. Without the
/// store's key no one can make two subjects collide; it stands for the
/// subject as the SHA-256 prefix does in a shared store's keys (neither
/// keeps the caller's text).
#[derive(Debug, Clone)]
pub(crate) struct SubjectHasher {
    pub(super) sip: SipHasher13,
    pub(super) limits: Vec<u64>,
}

/// Passes a [`BucketId`]'s hash through. Other input (none is hashed with
/// it) is folded in byte by byte, so it would still be a hash.
#[derive(Debug, Default)]
pub(super) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}
