//! Per-acquisition options and their validation.

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    max_hold: Option<Duration>,
    renew_interval: Option<Duration>,
    acquire_timeout: Option<Duration>,
    auto_renew: bool,
    metric_label: Option<String>,
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
        }
    }

    /// Caps how long renewal keeps the lock alive; at that instant the job is
    /// cancelled and the lock released (`max_hold_exceeded`). Must be ≥ the TTL.
    /// A value too large for the clock (such as `Duration::MAX`) means no cap.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// Overrides the renewal interval (default `ttl / 3`). Must be below the
    /// TTL and at least 1 ms.
    pub fn with_renew_interval(mut self, interval: Duration) -> Self {
        self.renew_interval = Some(interval);
        self
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
        self
    }

    /// Sets the `lock` label used in metrics (default: the lock name). Use it
    /// when names carry unbounded parts, such as a timestamp, so the metric
    /// cardinality stays bounded.
    pub fn with_metric_label(mut self, label: impl Into<String>) -> Self {
        self.metric_label = Some(label.into());
        self
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
        self.renew_interval.unwrap_or(self.ttl / 3)
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
        drift_for(self.ttl)
    }

    /// Checks the options against each other and against a backend's TTL
    /// limits ([`Capabilities::min_ttl`](crate::Capabilities::min_ttl) and
    /// [`Capabilities::max_ttl`](crate::Capabilities::max_ttl)).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the offending value.
    pub fn validate_for(&self, capabilities: &crate::Capabilities) -> Result<()> {
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
        if self.ttl.is_zero() {
            return Err(Error::Config("the TTL must be greater than zero".into()));
        }
        if self.ttl > MAX_TTL {
            return Err(Error::Config(format!(
                "a TTL of {:?} is above the longest supported ({MAX_TTL:?}); the TTL bounds how long a crashed holder blocks others, so keep it short and use max_hold for long runs",
                self.ttl
            )));
        }
        if self.ttl < min_ttl {
            return Err(Error::Config(format!(
                "a TTL of {:?} is below this backend's minimum of {min_ttl:?}",
                self.ttl
            )));
        }
        if self.drift() >= self.ttl {
            return Err(Error::Config(format!(
                "a TTL of {:?} leaves no validity after the {:?} drift margin; use at least 5 ms",
                self.ttl,
                self.drift()
            )));
        }
        let interval = self.renew_interval();
        if interval < MIN_RENEW_INTERVAL {
            return Err(Error::Config(format!(
                "a renewal interval of {interval:?} is below the shortest supported ({MIN_RENEW_INTERVAL:?}); a shorter one would only busy the backend"
            )));
        }
        if interval >= self.ttl {
            return Err(Error::Config(format!(
                "the renewal interval ({interval:?}) must be below the TTL ({:?})",
                self.ttl
            )));
        }
        if let Some(max_hold) = self.max_hold {
            if max_hold < self.ttl {
                return Err(Error::Config(format!(
                    "max_hold ({max_hold:?}) must be at least the TTL ({:?})",
                    self.ttl
                )));
            }
        }
        if let Some(label) = &self.metric_label {
            if label.is_empty() {
                return Err(Error::Config("the metric label must not be empty".into()));
            }
        }
        Ok(())
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
    }
}
