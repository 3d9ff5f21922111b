//! The set of lock sessions a backend spreads its locks over, each key on
//! the one session its hash picks.
//!
//! One by default: calls that arrive together on a session go as one
//! statement over arrays of keys, and one session gathers the most of them
//! (16 tasks taking and releasing locks ran at 1.1 times a single pipelined
//! connection's time on one session, 1.7 times on four, whose statements
//! were smaller and whose server processes shared the client's cores).
//! Because calls go in batches, holding many locks no longer costs a
//! session one walk of its lock table per lock (the end of each statement
//! walks it): 10,000 locks were taken in about the same time on 1 to 16
//! sessions.
//!
//! Why more than one may still be wanted: the end of a session loses only
//! the locks on it, and a slow statement holds up only its own session's
//! calls.

use std::sync::Arc;

use lock_core::BackendError;

use crate::error::config;
use crate::holders::HolderSql;
use crate::lifeline::OnEnd;
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresConfig};

/// The number of lock sessions a backend uses unless told otherwise.
pub(crate) const DEFAULT_LOCK_SESSIONS: usize = 1;

/// The most lock sessions a backend may use: each is a server connection,
/// counted against `max_connections`.
pub(crate) const MAX_LOCK_SESSIONS: usize = 64;

/// Checks a lock session count.
///
/// # Errors
///
/// A `Config` error for 0 or more than [`MAX_LOCK_SESSIONS`], naming the range.
pub(crate) fn check_count(n: usize) -> Result<(), BackendError> {
    if (1..=MAX_LOCK_SESSIONS).contains(&n) {
        Ok(())
    } else {
        Err(config(format!(
            "lock_sessions is {n}; it must be between 1 and {MAX_LOCK_SESSIONS} \
             (each lock session is one server connection; default {DEFAULT_LOCK_SESSIONS})"
        )))
    }
}

/// Parses the `lock_sessions` URL parameter; the range is checked with the
/// rest of the configuration. `quotable` says whether the value may be shown
/// (not after a secret parameter).
pub(crate) fn parse_count(value: &str, quotable: bool) -> Result<usize, BackendError> {
    value.parse().map_err(|_| {
        let got = if quotable {
            format!(" {value:?}")
        } else {
            String::new()
        };
        config(format!(
            "lock_sessions{got} is not a number; use an integer between 1 and {MAX_LOCK_SESSIONS}"
        ))
    })
}

/// Which of `n` sessions holds `key`: a multiplicative hash of both halves,
/// so that explicit keys that differ in one half only still spread. Only
/// this process relies on it (exclusion between processes is the
/// server's), so it may change between versions.
pub(crate) fn index_of(key: AdvisoryKey, n: usize) -> usize {
    let bits = (u64::from(key.key1 as u32) << 32) | u64::from(key.key2 as u32);
    let mixed = bits.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // The high bits are the well-mixed ones; scale them onto 0..n.
    let high = u128::from(mixed >> 32);
    let n = u128::try_from(n.max(1)).unwrap_or(1);
    usize::try_from((high * n) >> 32).unwrap_or(0)
}

/// One slot per lock session; each connects on first use and reconnects
/// after its session ended.
#[derive(Debug)]
pub(crate) struct SessionSet {
    slots: Box<[tokio::sync::Mutex<Option<Arc<LockSession>>>]>,
}

impl SessionSet {
    /// `n` empty slots (at least one).
    pub(crate) fn new(n: usize) -> Self {
        Self {
            slots: (0..n.max(1))
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
        }
    }

    /// The slot that holds `key`.
    pub(crate) fn index_for(&self, key: AdvisoryKey) -> usize {
        index_of(key, self.slots.len())
    }

    /// The live session in slot `i` (clamped to the last slot), connecting
    /// a new one if there is none or it died. `on_end` is asked for the end
    /// hook only when a session is connected.
    ///
    /// Cancel safe: a dropped future leaves the slot empty or as it was.
    pub(crate) async fn get(
        &self,
        i: usize,
        cfg: &PostgresConfig,
        on_end: impl FnOnce() -> OnEnd,
        holders: &Arc<HolderSql>,
    ) -> Result<Arc<LockSession>, BackendError> {
        let Some(slot) = self.slots.get(i).or_else(|| self.slots.last()) else {
            return Err(config("a backend without lock sessions"));
        };
        let mut slot = slot.lock().await;
        if let Some(s) = slot.as_ref() {
            if s.is_alive() {
                return Ok(Arc::clone(s));
            }
        }
        *slot = None;
        let fresh = Arc::new(LockSession::connect(cfg, on_end(), Arc::clone(holders)).await?);
        *slot = Some(Arc::clone(&fresh));
        Ok(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_outside_one_to_sixty_four_are_refused_with_the_range() {
        for n in [0, MAX_LOCK_SESSIONS + 1, usize::MAX] {
            let e = check_count(n).expect_err("out of range");
            assert!(e.message().contains("between 1 and 64"), "{e}");
        }
        for n in [1, DEFAULT_LOCK_SESSIONS, MAX_LOCK_SESSIONS] {
            assert!(check_count(n).is_ok());
        }
        assert!(parse_count("x", true).is_err());
        assert!(parse_count("-1", true).is_err());
        assert!(parse_count("99999999999999999999999", true).is_err());
    }

    #[test]
    fn keys_spread_over_every_session_and_stay_in_range() {
        for n in [1, 2, 4, 8, 16, 64] {
            let mut seen = vec![0usize; n];
            for i in 0..(n as i32 * 200) {
                let at = index_of(AdvisoryKey::new(7, i), n);
                assert!(at < n);
                seen[at] += 1;
            }
            assert!(seen.iter().all(|c| *c > 100), "{n}: {seen:?}");
        }
        assert_eq!(index_of(AdvisoryKey::new(i32::MIN, i32::MAX), 0), 0);
        assert!(index_of(AdvisoryKey::new(-1, -1), usize::MAX) < usize::MAX);
    }
}

#[cfg(test)]
mod url_tests {
    use crate::PostgresBuilder;

    #[test]
    fn the_url_parameter_sets_the_count_and_bad_values_are_refused() {
        let c = PostgresBuilder::from_url("postgres://u@h/d?lock_sessions=8")
            .and_then(PostgresBuilder::config)
            .expect("8 sessions");
        assert_eq!(c.lock_sessions(), 8);
        let c = PostgresBuilder::new().config().expect("defaults");
        assert_eq!(c.lock_sessions(), 1);
        for url in [
            "postgres://u@h/d?lock_sessions=0",
            "postgres://u@h/d?lock_sessions=65",
            "postgres://u@h/d?lock_sessions=many",
        ] {
            let e = PostgresBuilder::from_url(url)
                .and_then(PostgresBuilder::config)
                .expect_err(url);
            assert!(e.message().contains("between 1 and 64"), "{url}: {e}");
        }
        assert!(PostgresBuilder::new()
            .with_lock_sessions(0)
            .config()
            .is_err());
    }
}
