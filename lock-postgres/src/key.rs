//! Lock names to Postgres advisory keys.

use std::fmt;

use lock_core::LockName;

/// A Postgres advisory lock key in the two-`int4` form, as taken by
/// `pg_try_advisory_lock(key1 int4, key2 int4)`.
///
/// This is a different key space from the one-`bigint` form
/// (`pg_try_advisory_lock(bigint)`): `(1, 5)` and `(1 << 32) | 5` are two
/// different locks. In `pg_locks` the pair shows up as `classid = key1`,
/// `objid = key2` (both as unsigned `oid`) with `objsubid = 2`.
///
/// # Derivation (must never change)
///
/// [`AdvisoryKey::derive`] hashes the bytes of `namespace`, one NUL byte and
/// the lock name with 64-bit FNV-1a (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`) and splits the result: the high 32 bits become `key1`, the
/// low 32 bits `key2`, each reinterpreted as a signed `int4`. Every replica of
/// every version must compute the same key for the same name, or two of them
/// could hold "the same" lock at once; the golden vectors in the tests pin it.
/// The NUL separator cannot occur in a [`LockName`], so `("a", "b/c")` and
/// `("a\0b", "c")`-style collisions between namespace and name are impossible.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdvisoryKey {
    /// The first `int4` (`classid` in `pg_locks`).
    pub key1: i32,
    /// The second `int4` (`objid` in `pg_locks`).
    pub key2: i32,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl AdvisoryKey {
    /// An explicit key, for deployments that already lock a fixed pair
    /// (for instance `pg_try_advisory_lock(42, 7)` from another program).
    pub const fn new(key1: i32, key2: i32) -> Self {
        Self { key1, key2 }
    }

    /// The key of `name` inside `namespace`, by the documented hash above.
    pub fn derive(namespace: &str, name: &LockName) -> Self {
        let mut hash = FNV_OFFSET;
        for byte in namespace
            .as_bytes()
            .iter()
            .chain(std::iter::once(&0u8))
            .chain(name.as_str().as_bytes())
        {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(FNV_PRIME);
        }
        let [a0, a1, a2, a3, b0, b1, b2, b3] = hash.to_be_bytes();
        Self {
            key1: i32::from_be_bytes([a0, a1, a2, a3]),
            key2: i32::from_be_bytes([b0, b1, b2, b3]),
        }
    }

    /// `key1` as `pg_locks.classid` shows it (an unsigned `oid`), widened.
    pub fn classid(self) -> i64 {
        i64::from(u32::from_ne_bytes(self.key1.to_ne_bytes()))
    }

    /// `key2` as `pg_locks.objid` shows it (an unsigned `oid`), widened.
    pub fn objid(self) -> i64 {
        i64::from(u32::from_ne_bytes(self.key2.to_ne_bytes()))
    }
}

impl fmt::Debug for AdvisoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AdvisoryKey({}, {})", self.key1, self.key2)
    }
}

impl fmt::Display for AdvisoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.key1, self.key2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn key(ns: &str, name: &str) -> AdvisoryKey {
        AdvisoryKey::derive(ns, &LockName::new(name).expect("valid name"))
    }

    /// Golden vectors: if this test fails, the mapping changed and replicas of
    /// different versions would no longer exclude each other. Do not update
    /// the expected values; restore the derivation instead.
    #[test]
    fn golden_vectors_never_change() {
        let golden: &[(&str, &str, i32, i32)] = &[
            ("lock", "a", -1_416_138_017, -446_891_259),
            ("lock", "job", -711_063_049, 1_043_648_169),
            ("lock", "billing/nightly-report", -742_265_452, 609_850_064),
            ("", "a", 137_520_903, -1_259_653_158),
            ("tenant-7", "cron:scheduler", 1_771_771_834, -1_451_455_456),
        ];
        for (ns, name, k1, k2) in golden {
            assert_eq!(
                key(ns, name),
                AdvisoryKey::new(*k1, *k2),
                "key of ({ns:?}, {name:?})"
            );
        }
    }

    #[test]
    fn matches_the_published_fnv1a_reference() {
        // The published FNV-1a 64 test vector for "a".
        let mut h = FNV_OFFSET;
        for b in b"a" {
            h ^= u64::from(*b);
            h = h.wrapping_mul(FNV_PRIME);
        }
        assert_eq!(h, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn namespaces_separate_and_names_do_not_collide() {
        assert_ne!(key("a", "x"), key("b", "x"));
        let mut seen = HashSet::new();
        for i in 0..100_000 {
            let k = key("lock", &format!("tenant-{}/job-{i}", i % 97));
            assert!(seen.insert(k), "collision at {i}");
        }
    }

    #[test]
    fn oid_views_are_unsigned() {
        let k = AdvisoryKey::new(-1, 5);
        assert_eq!(k.classid(), 4_294_967_295);
        assert_eq!(k.objid(), 5);
    }
}
