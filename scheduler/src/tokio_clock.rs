//! A simulated wall clock on tokio's clock (feature `test-util`).

use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, TimeDelta, Utc};
use tokio::time::Instant;

use crate::WallClock;

/// A wall clock driven by tokio's clock: `base + (tokio now − start) + skew`
/// (feature `test-util`: for simulations and tests, not for production).
///
/// Under `#[tokio::test(start_paused = true)]` it advances exactly with
/// tokio's paused time, so scheduling tests are exact and instant. The skew
/// models a replica whose clock is ahead (positive) or behind (negative), and
/// [`TokioClock::step`] models an operator or NTP stepping the clock.
#[derive(Debug)]
pub struct TokioClock {
    base_wall: DateTime<Utc>,
    base_instant: Instant,
    skew_ms: AtomicI64,
}

impl TokioClock {
    /// A clock reading `base` now, then advancing with tokio's clock.
    pub fn starting_at(base: DateTime<Utc>) -> Self {
        Self {
            base_wall: base,
            base_instant: Instant::now(),
            skew_ms: AtomicI64::new(0),
        }
    }

    /// The same clock offset by `skew_ms` milliseconds (negative: behind).
    pub fn with_skew_ms(self, skew_ms: i64) -> Self {
        self.skew_ms.store(skew_ms, Ordering::SeqCst);
        self
    }

    /// Steps the clock by `delta_ms` milliseconds from now on (saturating).
    pub fn step(&self, delta_ms: i64) {
        let _ = self
            .skew_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |skew| {
                Some(skew.saturating_add(delta_ms))
            });
    }
}

impl WallClock for TokioClock {
    /// The base plus tokio's elapsed time plus the skew, clamped to the
    /// range `DateTime<Utc>` can represent.
    fn now(&self) -> DateTime<Utc> {
        let elapsed = Instant::now().saturating_duration_since(self.base_instant);
        let elapsed = TimeDelta::from_std(elapsed).unwrap_or(TimeDelta::MAX);
        let skew_ms = self.skew_ms.load(Ordering::SeqCst);
        let skew = TimeDelta::try_milliseconds(skew_ms).unwrap_or(if skew_ms < 0 {
            TimeDelta::MIN
        } else {
            TimeDelta::MAX
        });
        let limit = if skew < -elapsed {
            DateTime::<Utc>::MIN_UTC
        } else {
            DateTime::<Utc>::MAX_UTC
        };
        self.base_wall
            .checked_add_signed(elapsed)
            .and_then(|t| t.checked_add_signed(skew))
            .unwrap_or(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::until;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn follows_tokio_time_with_skew_and_steps() {
        let base = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let clock = TokioClock::starting_at(base).with_skew_ms(2_000);
        assert_eq!(clock.now(), base + TimeDelta::seconds(2));
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(clock.now(), base + TimeDelta::milliseconds(3_500));
        clock.step(-10_000);
        assert_eq!(clock.now(), base - TimeDelta::milliseconds(6_500));
        assert_eq!(until(clock.now(), base), Duration::from_millis(6_500));
        assert_eq!(until(base, clock.now()), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn extreme_skews_clamp_instead_of_panicking() {
        let base = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        let behind = TokioClock::starting_at(base).with_skew_ms(i64::MIN);
        assert_eq!(behind.now(), DateTime::<Utc>::MIN_UTC);
        let ahead = TokioClock::starting_at(base).with_skew_ms(i64::MAX);
        assert_eq!(ahead.now(), DateTime::<Utc>::MAX_UTC);
        ahead.step(i64::MAX);
        assert_eq!(ahead.now(), DateTime::<Utc>::MAX_UTC);
        ahead.step(i64::MIN);
        ahead.step(i64::MIN);
        assert_eq!(ahead.now(), DateTime::<Utc>::MIN_UTC);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(until(behind.now(), ahead.now()), Duration::ZERO);
    }
}
