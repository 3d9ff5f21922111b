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

/// A task that records every instant the lease's deadline moved forward.
#[derive(Debug)]
pub(super) struct RenewWatch {
    renewals: Arc<Mutex<Vec<Instant>>>,
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
                    seen.lock().expect("renewals lock").push(Instant::now());
                    last = now;
                }
                sleep(SAMPLE_EVERY).await;
            }
        });
        Self { renewals, task }
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
            .find(|r| **r <= fault_at)
            .copied()
            .unwrap_or(fault_at);
        let after = renewals
            .iter()
            .find(|r| **r > fault_at)
            .copied()
            .unwrap_or(end);
        after.saturating_duration_since(before)
    }
}

fn deadline(handle: &LeaseHandle) -> Instant {
    let now = Instant::now();
    handle.remaining_validity().map_or(now, |r| now + r)
}
