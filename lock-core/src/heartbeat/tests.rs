//! The heartbeat's queue and idle sleep, looked at without running the task.

use super::*;
use crate::backend::{AcquireAttempt, Capabilities, Expiry, ReleaseOutcome};
use crate::{BackendError, LockMetrics, LockName, LockOptions, OwnerToken};

/// A backend that is never reached: these tests look at the queue only.
#[derive(Debug)]
struct Unreached;

#[async_trait::async_trait]
impl LockBackend for Unreached {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(Expiry::Ttl)
    }
    async fn try_acquire(
        &self,
        _: &LockName,
        _: &OwnerToken,
        _: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        Err(unreached())
    }
    async fn renew(
        &self,
        _: &LockName,
        _: &OwnerToken,
        _: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        Err(unreached())
    }
    async fn check(&self, _: &LockName, _: &OwnerToken) -> Result<LeaseStatus, BackendError> {
        Err(unreached())
    }
    async fn release(&self, _: &LockName, _: &OwnerToken) -> Result<ReleaseOutcome, BackendError> {
        Err(unreached())
    }
}

fn unreached() -> BackendError {
    BackendError::new(BackendErrorKind::Unavailable, "unreached")
}

fn lease(id: u64, backend: &Arc<dyn LockBackend>, background: &Background) -> Arc<LeaseState> {
    let metrics = LockMetrics::register(&prometheus::Registry::new())
        .map(|m| m.label("queue"))
        .expect("a fresh registry");
    LeaseState::new(crate::lease::LeaseParts {
        id,
        name: LockName::new(format!("queue/{id}")).expect("a valid name"),
        owner: OwnerToken::generate().expect("entropy"),
        fencing: None,
        options: &LockOptions::new(Duration::from_secs(3)),
        sent_at: Instant::now(),
        proved_at: Instant::now(),
        valid_until: Instant::now().checked_add(Duration::from_secs(2)),
        backend: Some(Arc::clone(backend)),
        metrics,
        registry: None,
        background: background.clone(),
    })
}

fn queued(hb: &HeartbeatHandle) -> Vec<(bool, u64)> {
    hb.inner
        .shared
        .pending()
        .commands
        .iter()
        .map(|c| match c {
            Command::Track(l) => (true, l.id),
            Command::Forget { id, .. } => (false, *id),
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_lease_forgotten_before_the_task_saw_it_is_taken_out_of_the_queue() {
    let backend: Arc<dyn LockBackend> = Arc::new(Unreached);
    let background = Background::default();
    let hb = HeartbeatHandle::spawn(Arc::clone(&backend), &background);
    // No await from here on: the task cannot drain the queue meanwhile.
    let leases: Vec<_> = (1..=3).map(|id| lease(id, &backend, &background)).collect();
    for l in &leases {
        assert!(hb.track(Arc::clone(l)));
    }
    hb.forget(2);
    assert_eq!(
        queued(&hb),
        [(true, 1), (true, 3)],
        "only lease 2's Track left"
    );
    hb.forget(7);
    assert_eq!(
        queued(&hb),
        [(true, 1), (true, 3), (false, 7)],
        "a lease the task already holds is forgotten by command"
    );
    hb.forget_and_release(Arc::clone(&leases[0]));
    assert_eq!(
        queued(&hb),
        [(false, 7), (true, 3), (false, 1)],
        "a dropped lease's release still goes through the task"
    );
}

#[tokio::test(start_paused = true)]
async fn a_release_looks_back_only_a_bounded_way() {
    let backend: Arc<dyn LockBackend> = Arc::new(Unreached);
    let background = Background::default();
    let hb = HeartbeatHandle::spawn(Arc::clone(&backend), &background);
    let count = u64::try_from(WITHDRAW_SEARCH).expect("small") + 1;
    for id in 1..=count {
        hb.track(lease(id, &backend, &background));
    }
    hb.forget(1);
    let q = queued(&hb);
    assert_eq!(q.len(), WITHDRAW_SEARCH + 2);
    assert_eq!(q.last(), Some(&(false, 1)));
    hb.forget(count);
    let q = queued(&hb);
    assert_eq!(q.len(), WITHDRAW_SEARCH + 1);
    assert!(
        !q.contains(&(true, count)),
        "the last lease's Track is gone"
    );
    assert!(q.contains(&(true, count - 1)));
}

#[test]
fn idle_sleep_starts_at_the_span_and_doubles_up_to_an_hour() {
    let ms = Duration::from_millis;
    assert_eq!(idle_sleep(None, 0), MAX_IDLE_SLEEP);
    assert_eq!(idle_sleep(Some(ms(1)), 0), ms(1));
    assert_eq!(idle_sleep(Some(ms(1)), 3), ms(8));
    // 2^22 ms is past an hour: from there on it sleeps an hour.
    assert_eq!(idle_sleep(Some(ms(1)), 22), MAX_IDLE_SLEEP);
    assert_eq!(idle_sleep(Some(ms(1)), u32::MAX), MAX_IDLE_SLEEP);
    let day = Duration::from_secs(86_400);
    assert_eq!(idle_sleep(Some(day), 0), day, "a longer span is kept");
    assert_eq!(idle_sleep(Some(Duration::MAX), 5), Duration::MAX);
}
