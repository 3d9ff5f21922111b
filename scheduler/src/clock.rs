//! The wall clock that cron expressions are evaluated against.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock time for evaluating cron schedules.
///
/// Only *which* tick is due comes from this clock; waiting for it uses
/// tokio's monotonic timer, and the clock is read again after every wake, so a
/// clock stepped backwards neither fires a tick early nor fires it twice.
pub trait WallClock: fmt::Debug + Send + Sync + 'static {
    /// The current wall-clock time.
    fn now(&self) -> DateTime<Utc>;
}

/// The operating system's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// How long from `now` until `at`, zero if it has passed.
pub(crate) fn until(now: DateTime<Utc>, at: DateTime<Utc>) -> Duration {
    (at - now).to_std().unwrap_or(Duration::ZERO)
}
