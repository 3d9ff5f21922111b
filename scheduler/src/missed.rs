//! What to do with ticks that passed while no replica ran them.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::Schedule;

/// A job's policy for ticks that were missed: scheduled, but never completed
/// because every replica was down, a leader was being elected, or the
/// process stalled or its clock jumped.
///
/// Missed ticks are counted from the job's last completed tick as recorded
/// in the [`TickStore`](lock_core::TickStore), on the same server as the
/// locks, so a replica that takes over after a failover knows what its
/// predecessor finished. A job with no record yet has missed nothing.
///
/// A missed tick whose lock is still held (by a replica that died running
/// it) is waited for, up to the job's TTL, until that lease runs out; a tick
/// that comes due meanwhile waits for the catch-up like for any run (see
/// the crate docs on overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissedTicks {
    /// Missed ticks are not run (the default, like `cron`).
    #[default]
    Skip,
    /// The most recent missed tick is run once; older ones are dropped.
    RunOnce,
    /// Every missed tick within `window` of now is run, oldest first, at
    /// most `max` of them (the most recent ones when there are more).
    RunAll {
        /// How far back missed ticks are still worth running.
        window: Duration,
        /// The most ticks run in one catch-up.
        max: usize,
    },
}

impl MissedTicks {
    pub(crate) fn validate(&self) -> Result<(), String> {
        match *self {
            Self::RunAll { window, .. } if window.is_zero() => Err(
                "MissedTicks::RunAll needs a window greater than zero; use Skip to run nothing"
                    .into(),
            ),
            Self::RunAll { max: 0, .. } => {
                Err("MissedTicks::RunAll needs max of at least 1; use Skip to run nothing".into())
            }
            _ => Ok(()),
        }
    }

    /// The ticks to run now: missed ticks after `last_completed` and no
    /// later than `upto`, chosen by this policy, oldest first.
    pub(crate) fn select(
        &self,
        schedule: &Schedule,
        last_completed: Option<DateTime<Utc>>,
        upto: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        self.select_at(schedule, last_completed, upto, upto)
    }

    /// As [`MissedTicks::select`], with `RunAll`'s window reaching back
    /// from `now` rather than from `upto`.
    pub(crate) fn select_at(
        &self,
        schedule: &Schedule,
        last_completed: Option<DateTime<Utc>>,
        upto: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        let Some(last) = last_completed else {
            return Vec::new();
        };
        match *self {
            Self::Skip => Vec::new(),
            Self::RunOnce => schedule
                .latest_at_or_before(upto)
                .filter(|t| *t > last)
                .into_iter()
                .collect(),
            Self::RunAll { window, max } => {
                let window = TimeDelta::from_std(window).unwrap_or(TimeDelta::MAX);
                let from = now.checked_sub_signed(window).unwrap_or(last).max(last);
                // A tick exactly `window` old is still inside the window.
                let from = from
                    .checked_sub_signed(TimeDelta::milliseconds(1))
                    .unwrap_or(from);
                let mut ticks: Vec<_> = schedule
                    .ticks_between(from, upto)
                    .into_iter()
                    .filter(|t| *t > last)
                    .collect();
                let excess = ticks.len().saturating_sub(max);
                ticks.drain(..excess);
                ticks
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).expect("valid")
    }

    #[test]
    fn each_policy_picks_its_ticks() {
        let every_2 = Schedule::parse("j", "*/2 * * * * *", "UTC").expect("valid");
        let (last, now) = (Some(t(0)), t(21)); // missed: 2, 4, ..., 20
        assert!(MissedTicks::Skip.select(&every_2, last, now).is_empty());
        assert_eq!(
            MissedTicks::RunOnce.select(&every_2, last, now),
            vec![t(20)]
        );
        let all = MissedTicks::RunAll {
            window: Duration::from_secs(10),
            max: 100,
        };
        assert_eq!(
            all.select(&every_2, last, now),
            vec![t(12), t(14), t(16), t(18), t(20)]
        );
        let capped = MissedTicks::RunAll {
            window: Duration::from_secs(3600),
            max: 3,
        };
        assert_eq!(
            capped.select(&every_2, last, now),
            vec![t(16), t(18), t(20)]
        );
        assert!(
            MissedTicks::RunOnce
                .select(&every_2, Some(t(20)), now)
                .is_empty(),
            "nothing after the last completed tick"
        );
        assert!(
            all.select(&every_2, None, now).is_empty(),
            "no record: nothing was missed"
        );
    }

    #[test]
    fn run_all_rejects_an_empty_window_or_zero_max() {
        let zero_window = MissedTicks::RunAll {
            window: Duration::ZERO,
            max: 1,
        };
        let zero_max = MissedTicks::RunAll {
            window: Duration::from_secs(1),
            max: 0,
        };
        assert!(zero_window.validate().is_err());
        assert!(zero_max.validate().is_err());
        assert!(MissedTicks::RunOnce.validate().is_ok());
    }
}
