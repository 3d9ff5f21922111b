//! Watches a lease's local deadline to see when it was renewed, so that a
//! case can say how long renewals stalled across a fault.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::LeaseHandle;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

/// How often the deadline is sampled: finer than any renewal interval.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// A forward move of the deadline smaller than this is sampling jitter (the
/// deadline is read as now + remaining validity), not a renewal.
const JITTER: Duration = Duration::from_millis(20);

/// Longest a watch runs, so a lease never lost cannot keep it going.
const MAX_SAMPLES: usize = 30_000;

/// A task that records every instant the lease's deadline moved forward,
/// with the deadline it moved to.
#[derive(Debug)]
pub(super) struct RenewWatch {
    renewals: Arc<Mutex<Vec<(Instant, Instant)>>>,
    task: JoinHandle<()>,
}

impl RenewWatch {
    /// Starts watching `handle` until its lease ends.
    pub(super) fn start(handle: LeaseHandle) -> Self {
        let renewals = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&renewals);
        let task = tokio::spawn(async move {
            let mut last = deadline(&handle);
            for _ in 0..MAX_SAMPLES {
                if !handle.is_held() {
                    break;
                }
                let now = deadline(&handle);
                if now > last + JITTER {
                    seen.lock()
                        .expect("renewals lock")
                        .push((Instant::now(), now));
                    last = now;
                }
                sleep(SAMPLE_EVERY).await;
            }
        });
        Self { renewals, task }
    }

    /// The renewals whose request was sent after `t`: each as (when it was
    /// seen, the earliest its request can have been sent). A deadline is
    /// the request's send instant plus at most `ttl`, so the deadline minus
    /// `ttl` never comes after the send.
    pub(super) fn sent_after(&self, t: Instant, ttl: Duration) -> Vec<(Instant, Instant)> {
        let renewals = self.renewals.lock().expect("renewals lock");
        renewals
            .iter()
            .filter_map(|(seen, deadline)| {
                let sent = deadline.checked_sub(ttl)?;
                (sent > t).then_some((*seen, sent))
            })
            .collect()
    }

    /// Each renewal seen, as (when it was seen, the deadline it set), in
    /// milliseconds after `t0`: for failure messages.
    pub(super) fn timeline(&self, t0: Instant) -> Vec<(i128, i128)> {
        let ms = |i: Instant| {
            if i >= t0 {
                i128::try_from((i - t0).as_millis()).unwrap_or(i128::MAX)
            } else {
                -i128::try_from((t0 - i).as_millis()).unwrap_or(i128::MAX)
            }
        };
        let renewals = self.renewals.lock().expect("renewals lock");
        renewals.iter().map(|(s, d)| (ms(*s), ms(*d))).collect()
    }

    /// Stops watching; the stall across a fault at `fault_at`: from the
    /// last renewal before it to the first after it, or to `end` (the loss,
    /// or the end of the observation) when none came after.
    pub(super) fn stall(self, fault_at: Instant, end: Instant) -> Duration {
        self.task.abort();
        let renewals = self.renewals.lock().expect("renewals lock").clone();
        let before = renewals
            .iter()
            .rev()
            .map(|(seen, _)| *seen)
            .find(|r| *r <= fault_at)
            .unwrap_or(fault_at);
        let after = renewals
            .iter()
            .map(|(seen, _)| *seen)
            .find(|r| *r > fault_at)
            .unwrap_or(end);
        after.saturating_duration_since(before)
    }
}

fn deadline(handle: &LeaseHandle) -> Instant {
    let now = Instant::now();
    handle.remaining_validity().map_or(now, |r| now + r)
}
