//! Quotas (how many per period, with what burst) and named limits.

use std::time::Duration;

use crate::error::{Error, Result};

/// The longest period a quota's burst may span: a bucket that takes longer
/// than this to refill is refused as a configuration error (its state would
/// outlive any sensible key expiry).
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 24 * 3600);

/// The largest count or burst a quota accepts.
pub const MAX_COUNT: u64 = 1_000_000_000;

/// How many requests a subject may make per period, and how many at once.
///
/// A quota is a GCRA bucket: it refills one unit every `period / count`
/// (rounded up to the microsecond, so a limit is never exceeded by rounding)
/// and holds at most `burst` units. The burst defaults to the count.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use distlock_ratelimit::Quota;
///
/// let q = Quota::per_minute(5)?;
/// assert_eq!(q.burst(), 5);
/// let steady = Quota::new(100, Duration::from_secs(1))?.with_burst(10)?;
/// assert_eq!(steady.interval(), Duration::from_millis(10));
/// # Ok::<(), distlock_ratelimit::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    count: u64,
    period: Duration,
    /// Microseconds per unit (the emission interval, T).
    interval_us: u64,
    burst: u64,
}

impl Quota {
    /// `count` requests per `period`, with a burst of `count`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a zero count or period, a count above
    /// [`MAX_COUNT`], a period above [`MAX_WINDOW`], or a rate faster than one
    /// unit per microsecond.
    pub fn new(count: u64, period: Duration) -> Result<Self> {
        if count == 0 {
            return Err(Error::Config(
                "a quota's count is 0: nothing could ever be admitted; to block a route, do not route it".into(),
            ));
        }
        if count > MAX_COUNT {
            return Err(Error::Config(format!(
                "a quota's count is {count}; at most {MAX_COUNT} are accepted"
            )));
        }
        if period.is_zero() || period > MAX_WINDOW {
            return Err(Error::Config(format!(
                "a quota's period is {period:?}; it must be above zero and at most {MAX_WINDOW:?}"
            )));
        }
        // period <= MAX_WINDOW, so it fits in u64 microseconds.
        let period_us = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
        let interval_us = period_us.div_ceil(count);
        if interval_us == 0 || period_us < count {
            return Err(Error::Config(format!(
                "{count} per {period:?} is faster than one per microsecond, the store's resolution"
            )));
        }
        Self {
            count,
            period,
            interval_us,
            burst: count,
        }
        .checked()
    }

    /// `count` requests per second.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_second(count: u64) -> Result<Self> {
        Self::new(count, Duration::from_secs(1))
    }

    /// `count` requests per minute.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_minute(count: u64) -> Result<Self> {
        Self::new(count, Duration::from_secs(60))
    }

    /// `count` requests per hour.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_hour(count: u64) -> Result<Self> {
        Self::new(count, Duration::from_secs(3600))
    }

    /// `count` requests per day.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_day(count: u64) -> Result<Self> {
        Self::new(count, Duration::from_secs(86_400))
    }

    /// The same rate with a burst of `burst` (how many may arrive at once).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a zero burst, one above [`MAX_COUNT`], or one
    /// whose refill would take longer than [`MAX_WINDOW`].
    pub fn with_burst(self, burst: u64) -> Result<Self> {
        Self { burst, ..self }.checked()
    }

    fn checked(self) -> Result<Self> {
        if self.burst == 0 || self.burst > MAX_COUNT {
            return Err(Error::Config(format!(
                "a quota's burst is {}; it must be between 1 and {MAX_COUNT}",
                self.burst
            )));
        }
        let window_us = u64::try_from(MAX_WINDOW.as_micros()).unwrap_or(u64::MAX);
        match self.interval_us.checked_mul(self.burst) {
            Some(cap) if cap <= window_us => Ok(self),
            _ => Err(Error::Config(format!(
                "a burst of {} at one per {:?} takes longer than {MAX_WINDOW:?} to refill",
                self.burst,
                self.interval()
            ))),
        }
    }

    /// The count per period, as given.
    #[must_use]
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// The period, as given.
    #[must_use]
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The most units admitted at once.
    #[must_use]
    pub const fn burst(&self) -> u64 {
        self.burst
    }

    /// The time one unit takes to refill.
    #[must_use]
    pub const fn interval(&self) -> Duration {
        Duration::from_micros(self.interval_us)
    }

    /// The quota as the GCRA function takes it.
    #[must_use]
    pub const fn cell(&self) -> crate::gcra::Cell {
        crate::gcra::Cell {
            interval: self.interval_us,
            capacity: self.capacity_us(),
        }
    }

    /// The time an empty bucket takes to fill (`burst × interval`), in µs;
    /// at most [`MAX_WINDOW`] by construction.
    pub(crate) const fn capacity_us(&self) -> u64 {
        self.interval_us.saturating_mul(self.burst)
    }
}

/// The longest limit or limiter name.
pub const MAX_NAME_LEN: usize = 64;

/// Checks a limit or limiter name: 1 to [`MAX_NAME_LEN`] characters of
/// `[A-Za-z0-9._-]`, since it becomes part of store keys and a metric label.
pub(crate) fn check_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "a {what} name must be 1 to {MAX_NAME_LEN} characters of [A-Za-z0-9._-]; got {} bytes",
            name.len()
        )))
    }
}

/// A named quota: one of the limits a limiter checks together ("5 a minute
/// and 100 a day" is two limits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    name: String,
    quota: Quota,
}

impl Limit {
    /// A limit called `name` (1 to [`MAX_NAME_LEN`] characters of
    /// `[A-Za-z0-9._-]`; it names the limit in keys and headers).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid name.
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Self> {
        let name = name.into();
        check_name("limit", &name)?;
        Ok(Self { name, quota })
    }

    /// The limit's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The limit's quota.
    #[must_use]
    pub const fn quota(&self) -> &Quota {
        &self.quota
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_quotas_are_refused_not_panicking() {
        assert!(Quota::new(0, Duration::from_secs(1)).is_err());
        assert!(Quota::new(1, Duration::ZERO).is_err());
        assert!(Quota::new(1, Duration::MAX).is_err());
        assert!(Quota::new(u64::MAX, Duration::from_secs(1)).is_err());
        assert!(Quota::new(1_000_001, Duration::from_secs(1)).is_err());
        assert!(Quota::per_second(1).and_then(|q| q.with_burst(0)).is_err());
        assert!(Quota::per_day(1).and_then(|q| q.with_burst(1000)).is_err());
        assert!(Quota::per_second(1)
            .and_then(|q| q.with_burst(u64::MAX))
            .is_err());
    }

    #[test]
    fn interval_rounds_up_so_the_rate_is_never_exceeded() -> Result<()> {
        let q = Quota::per_second(3)?;
        assert_eq!(q.cell().interval, 333_334);
        assert_eq!(q.cell().capacity, 1_000_002);
        Ok(())
    }

    #[test]
    fn names_are_checked() {
        assert!(Limit::new("", Quota::per_second(1).expect("quota")).is_err());
        assert!(Limit::new("a b", Quota::per_second(1).expect("quota")).is_err());
        assert!(Limit::new("x".repeat(65), Quota::per_second(1).expect("quota")).is_err());
        assert!(Limit::new("per-minute_1.0", Quota::per_second(1).expect("quota")).is_ok());
    }
}
