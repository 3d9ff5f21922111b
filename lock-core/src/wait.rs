//! Jittered exponential backoff for waiting acquires.

use std::time::Duration;

/// Backoff between acquire attempts: doubles from 2 ms up to a cap tied to
/// the TTL, each sleep drawn uniformly from the upper half of the current step
/// so that waiters released together do not retry in lockstep.
#[derive(Debug)]
pub(crate) struct Backoff {
    step: Duration,
    cap: Duration,
}

impl Backoff {
    pub(crate) fn new(ttl: Duration) -> Self {
        let cap = (ttl / 8).clamp(Duration::from_millis(10), Duration::from_millis(500));
        Self {
            step: Duration::from_millis(2),
            cap,
        }
    }

    pub(crate) fn next_sleep(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.cap);
        let half = step / 2;
        let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1);
        let jitter = getrandom::u64().unwrap_or(0) % nanos;
        half + Duration::from_nanos(jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_stays_in_range() {
        let mut b = Backoff::new(Duration::from_secs(1));
        let sleeps: Vec<Duration> = (0..20).map(|_| b.next_sleep()).collect();
        assert!(sleeps[0] >= Duration::from_millis(1) && sleeps[0] <= Duration::from_millis(2));
        for s in &sleeps[10..] {
            assert!(
                *s >= Duration::from_millis(62) && *s <= Duration::from_millis(125),
                "{s:?}"
            );
        }
    }
}
