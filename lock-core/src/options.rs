//! Per-acquisition options and their validation.

use std::fmt;
use std::time::Duration;

use crate::{Error, Result};

/// The longest TTL (and retained hold) a lease may have: a year. Longer
/// values are refused rather than passed to a server or added to a clock.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest renewal interval accepted.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(1);

/// The clock-drift margin for a lease of `ttl`: 1 % plus 2 ms.
pub(crate) fn drift_for(ttl: Duration) -> Duration {
    (ttl / 100).saturating_add(Duration::from_millis(2))
}

/// How a lock is held: TTL, watchdog, renewal and waiting.
///
/// The TTL answers "how long may a crashed holder block everyone else"; keep it
/// short. `max_hold` answers "how long may a healthy run hold the lock" and is
/// enforced by the watchdog. Renewal runs every `ttl / 3` unless overridden.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lock_core::LockOptions;
///
/// let opts = LockOptions::new(Duration::from_secs(30))
///     .with_max_hold(Duration::from_secs(600))
///     .with_acquire_timeout(Duration::from_secs(5));
/// assert_eq!(opts.ttl(), Duration::from_secs(30));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    max_hold: Option<Duration>,
    renew_interval: Option<Duration>,
    acquire_timeout: Option<Duration>,
    auto_renew: bool,
    metric_label: Option<String>,
    /// Derived from the fields above by every constructor and setter, so an
    /// acquire reads them instead of working them out again.
    timing: Timing,
}

impl fmt::Debug for LockOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockOptions")
            .field("ttl", &self.ttl)
            .field("max_hold", &self.max_hold)
            .field("renew_interval", &self.renew_interval)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("auto_renew", &self.auto_renew)
            .field("metric_label", &self.metric_label)
            .finish()
    }
}

/// What a lease taken with some options needs to know of them, worked out
/// once per [`LockOptions`] rather than on every acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timing {
    pub(crate) drift: Duration,
    pub(crate) interval: Duration,
    /// How long a grant stays valid locally: the TTL less the drift.
    pub(crate) validity: Duration,
    /// How long after a grant the heartbeat must first look at the lease:
    /// its first renewal, its local deadline or its `max_hold`.
    pub(crate) first_attention: Duration,
    /// The first check the options fail that does not depend on a backend.
    problem: Option<Problem>,
}

/// A check that options fail by themselves (in the order they are checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Problem {
    ZeroTtl,
    TtlAboveMax,
    NoValidity,
    IntervalTooShort,
    IntervalNotBelowTtl,
    MaxHoldBelowTtl,
    EmptyLabel,
}

impl Problem {
    /// Whether it is checked before a backend's minimum TTL is.
    fn precedes_min_ttl(self) -> bool {
        matches!(self, Self::ZeroTtl | Self::TtlAboveMax)
    }
}

impl Default for LockOptions {
    /// A 30 s TTL, renewed every 10 s, no maximum hold.
    fn default() -> Self {
        Self::new(Duration::from_secs(30))
    }
}

impl LockOptions {
    /// Options with the given TTL and everything else at its default.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            max_hold: None,
            renew_interval: None,
            acquire_timeout: None,
            auto_renew: true,
            metric_label: None,
            timing: Timing {
                drift: Duration::ZERO,
                interval: Duration::ZERO,
                validity: Duration::ZERO,
                first_attention: Duration::ZERO,
                problem: None,
            },
        }
        .derived()
    }

    /// Works out [`Timing`] again after a field changed.
    fn derived(mut self) -> Self {
        let drift = drift_for(self.ttl);
        let interval = self.renew_interval.unwrap_or(self.ttl / 3);
        let validity = self.ttl.saturating_sub(drift);
        let renew = self.auto_renew.then_some(interval);
        let first_attention = [renew, Some(validity), self.max_hold]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(validity);
        self.timing = Timing {
            drift,
            interval,
            validity,
            first_attention,
            problem: None,
        };
        self.timing.problem = self.problem();
        self
    }

    /// The derived values an acquire uses.
    pub(crate) fn timing(&self) -> &Timing {
        &self.timing
    }

    fn problem(&self) -> Option<Problem> {
        let Timing {
            drift, interval, ..
        } = self.timing;
        if self.ttl.is_zero() {
            Some(Problem::ZeroTtl)
        } else if self.ttl > MAX_TTL {
            Some(Problem::TtlAboveMax)
        } else if drift >= self.ttl {
            Some(Problem::NoValidity)
        } else if interval < MIN_RENEW_INTERVAL {
            Some(Problem::IntervalTooShort)
        } else if interval >= self.ttl {
            Some(Problem::IntervalNotBelowTtl)
        } else if self.max_hold.is_some_and(|h| h < self.ttl) {
            Some(Problem::MaxHoldBelowTtl)
        } else if self.metric_label.as_deref() == Some("") {
            Some(Problem::EmptyLabel)
        } else {
            None
        }
    }

    /// Caps how long renewal keeps the lock alive; at that instant the job is
    /// cancelled and the lock released (`max_hold_exceeded`). Must be ≥ the TTL.
    /// A value too large for the clock (such as `Duration::MAX`) means no cap.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self.derived()
    }

    /// Overrides the renewal interval (default `ttl / 3`). Must be below the
    /// TTL and at least 1 ms.
    pub fn with_renew_interval(mut self, interval: Duration) -> Self {
        self.renew_interval = Some(interval);
        self.derived()
    }

    /// Bounds how long [`Locker::lock`](crate::Locker::lock) waits. Without it, it
    /// waits until the lock is free or the future is dropped; a value too
    /// large for the clock (such as `Duration::MAX`) means the same.
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = Some(timeout);
        self
    }

    /// Turns the background heartbeat on or off (default on). Without it the
    /// lease is valid for one TTL unless renewed with
    /// [`LeaseHandle::renew`](crate::LeaseHandle::renew).
    pub fn with_auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self.derived()
    }

    /// Sets the `lock` label used in metrics (default: the lock name). Use it
    /// when names carry unbounded parts, such as a timestamp, so the metric
    /// cardinality stays bounded.
    pub fn with_metric_label(mut self, label: impl Into<String>) -> Self {
        self.metric_label = Some(label.into());
        self.derived()
    }

    /// The TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The maximum hold time, if any.
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// The acquire timeout, if any.
    pub fn acquire_timeout(&self) -> Option<Duration> {
        self.acquire_timeout
    }

    /// The renewal interval in force: the override, or `ttl / 3`.
    pub fn renew_interval(&self) -> Duration {
        self.timing.interval
    }

    /// Whether the background heartbeat runs.
    pub fn auto_renew(&self) -> bool {
        self.auto_renew
    }

    /// The metric label override, if any.
    pub fn metric_label(&self) -> Option<&str> {
        self.metric_label.as_deref()
    }

    /// The clock-drift margin subtracted from every validity deadline:
    /// 1 % of the TTL plus 2 ms, the allowance Redlock's analysis uses for
    /// clocks that run at slightly different rates.
    pub fn drift(&self) -> Duration {
        self.timing.drift
    }

    /// Checks the options against each other and against a backend's TTL
    /// limits ([`Capabilities::min_ttl`](crate::Capabilities::min_ttl) and
    /// [`Capabilities::max_ttl`](crate::Capabilities::max_ttl)).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the offending value.
    #[inline]
    pub fn validate_for(&self, capabilities: &crate::Capabilities) -> Result<()> {
        // Every acquire checks its options: valid ones cost three comparisons,
        // inlined into the acquire; the explanation is built out of line.
        if self.timing.problem.is_none()
            && self.ttl >= capabilities.min_ttl
            && capabilities.max_ttl.is_none_or(|max| self.ttl <= max)
        {
            return Ok(());
        }
        self.refuse_for(capabilities)
    }

    /// The error [`LockOptions::validate_for`] returns for options it refuses.
    #[cold]
    #[inline(never)]
    fn refuse_for(&self, capabilities: &crate::Capabilities) -> Result<()> {
        self.validate(capabilities.min_ttl)?;
        match capabilities.max_ttl {
            Some(max) if self.ttl > max => Err(Error::Config(format!(
                "a TTL of {:?} is above this backend's maximum of {max:?}; use a shorter TTL or raise the backend's limit",
                self.ttl
            ))),
            _ => Ok(()),
        }
    }

    /// Checks the options against each other and against a minimum TTL.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the offending value.
    pub fn validate(&self, min_ttl: Duration) -> Result<()> {
        let problem = self.timing.problem;
        if let Some(p) = problem.filter(|p| p.precedes_min_ttl()) {
            return Err(self.explain(p));
        }
        if self.ttl < min_ttl {
            return Err(Error::Config(format!(
                "a TTL of {:?} is below this backend's minimum of {min_ttl:?}",
                self.ttl
            )));
        }
        match problem {
            Some(p) => Err(self.explain(p)),
            None => Ok(()),
        }
    }

    fn explain(&self, problem: Problem) -> Error {
        let Timing {
            drift, interval, ..
        } = self.timing;
        Error::Config(match problem {
            Problem::ZeroTtl => "the TTL must be greater than zero".into(),
            Problem::TtlAboveMax => format!(
                "a TTL of {:?} is above the longest supported ({MAX_TTL:?}); the TTL bounds how long a crashed holder blocks others, so keep it short and use max_hold for long runs",
                self.ttl
            ),
            Problem::NoValidity => format!(
                "a TTL of {:?} leaves no validity after the {drift:?} drift margin; use at least 5 ms",
                self.ttl
            ),
            Problem::IntervalTooShort => format!(
                "a renewal interval of {interval:?} is below the shortest supported ({MIN_RENEW_INTERVAL:?}); a shorter one would only busy the backend"
            ),
            Problem::IntervalNotBelowTtl => format!(
                "the renewal interval ({interval:?}) must be below the TTL ({:?})",
                self.ttl
            ),
            Problem::MaxHoldBelowTtl => format!(
                "max_hold ({:?}) must be at least the TTL ({:?})",
                self.max_hold.unwrap_or_default(),
                self.ttl
            ),
            Problem::EmptyLabel => "the metric label must not be empty".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn defaults_are_valid_and_derive_the_interval() {
        let o = LockOptions::new(Duration::from_secs(3));
        assert!(o.validate(MS).is_ok());
        assert_eq!(o.renew_interval(), Duration::from_secs(1));
        assert_eq!(o.drift(), Duration::from_millis(32));
    }

    #[test]
    fn rejects_each_bad_combination() {
        let s = Duration::from_secs(1);
        let cases = [
            LockOptions::new(Duration::ZERO),
            LockOptions::new(s).with_renew_interval(s),
            LockOptions::new(s).with_renew_interval(2 * s),
            LockOptions::new(s).with_renew_interval(Duration::ZERO),
            LockOptions::new(2 * s).with_max_hold(s),
            LockOptions::new(2 * MS),
            LockOptions::new(s).with_metric_label(""),
        ];
        for o in cases {
            assert!(matches!(o.validate(MS), Err(Error::Config(_))), "{o:?}");
        }
        assert!(matches!(
            LockOptions::new(s).validate(2 * s),
            Err(Error::Config(m)) if m.contains("minimum")
        ));
        // Checked in the same order as ever: the backend's minimum before
        // the drift margin.
        assert!(matches!(
            LockOptions::new(2 * MS).validate(s),
            Err(Error::Config(m)) if m.contains("minimum")
        ));
        assert!(matches!(
            LockOptions::new(Duration::ZERO).validate(s),
            Err(Error::Config(m)) if m.contains("greater than zero")
        ));
    }

    #[test]
    fn derived_timing_follows_every_setter() {
        let s = Duration::from_secs(1);
        let o = LockOptions::new(3 * s);
        assert_eq!(o.timing().interval, s);
        assert_eq!(o.timing().validity, 3 * s - o.drift());
        assert_eq!(o.timing().first_attention, s, "the first renewal");

        let o = o.with_renew_interval(2 * s);
        assert_eq!(o.renew_interval(), 2 * s);
        assert_eq!(o.timing().first_attention, 2 * s);

        let o = o.with_auto_renew(false);
        assert_eq!(
            o.timing().first_attention,
            3 * s - o.drift(),
            "without renewal, the local deadline"
        );

        let o = LockOptions::new(3 * s)
            .with_max_hold(3 * s)
            .with_auto_renew(false);
        assert_eq!(o.timing().first_attention, 3 * s - o.drift());
        let o = LockOptions::new(30 * s).with_max_hold(30 * s);
        assert_eq!(o.timing().first_attention, 10 * s);

        // A setter that repairs the options clears the recorded problem.
        let bad = LockOptions::new(s).with_renew_interval(s);
        assert!(bad.validate(MS).is_err());
        assert!(bad.with_renew_interval(s / 2).validate(MS).is_ok());
        let unlabelled = LockOptions::new(s).with_metric_label("");
        assert!(unlabelled.validate(MS).is_err());
        assert!(unlabelled.with_metric_label("x").validate(MS).is_ok());
    }

    #[test]
    fn debug_shows_the_options_not_the_derived_values() {
        let shown = format!("{:?}", LockOptions::new(Duration::from_secs(3)));
        assert!(shown.starts_with("LockOptions { ttl: 3s"), "{shown}");
        assert!(!shown.contains("timing"), "{shown}");
    }
}
