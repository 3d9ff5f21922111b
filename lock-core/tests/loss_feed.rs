//! The loss feed: a backend that learns leases ended tells every `Locker`
//! over it at once, before it frees them on the server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{
    async_trait,
    backend::{AcquireAttempt, Expiry, Lease, LeaseStatus, LossFeed, ReleaseOutcome},
    BackendError, Capabilities, Error, LockBackend, LockMetrics, LockName, LockOptions, Locker,
    LossReason, OwnerToken,
};
use prometheus::Registry;

/// A session backend in a map, with one "session" whose end it can push.
#[derive(Debug, Default)]
struct SessionBackend {
    held: Mutex<HashMap<LockName, OwnerToken>>,
    feed: LossFeed,
    /// The session ends right after the server grants the next lock, before
    /// the grant reaches the caller.
    end_on_grant: AtomicBool,
}

impl SessionBackend {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<LockName, OwnerToken>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session ends: tell lock-core first, then forget every lock.
    fn end_session(&self) -> usize {
        let owners: Vec<OwnerToken> = self.map().values().copied().collect();
        let ended = self.feed.leases_ended(&owners, LossReason::Expired);
        self.map().clear();
        ended
    }
}

#[async_trait]
impl LockBackend for SessionBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(Expiry::Session).with_loss_push(true)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        _ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        let mut map = self.map();
        if map.contains_key(name) {
            return Ok(AcquireAttempt::HeldElsewhere);
        }
        map.insert(name.clone(), *owner);
        drop(map);
        if self.end_on_grant.swap(false, Ordering::SeqCst) {
            self.end_session();
        }
        Ok(AcquireAttempt::Acquired(Lease::new(None)))
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        _ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.check(name, owner).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        Ok(match self.map().get(name) {
            Some(o) if o == owner => LeaseStatus::Held,
            Some(_) => LeaseStatus::Stolen,
            None => LeaseStatus::Expired,
        })
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let mut map = self.map();
        if map.get(name) == Some(owner) {
            map.remove(name);
            return Ok(ReleaseOutcome::Released);
        }
        Ok(ReleaseOutcome::NotHeld)
    }

    fn loss_feed(&self) -> Option<LossFeed> {
        Some(self.feed.clone())
    }
}

fn locker(backend: &Arc<SessionBackend>) -> (Locker, LockMetrics) {
    let metrics = LockMetrics::register(&Registry::new()).expect("metrics");
    let locker = Locker::builder()
        .with_backend_arc(Arc::clone(backend) as Arc<dyn LockBackend>)
        .with_metrics(metrics.clone())
        .build()
        .expect("locker");
    (locker, metrics)
}

fn name(s: &str) -> LockName {
    LockName::new(s).expect("name")
}

#[tokio::test(start_paused = true)]
async fn a_pushed_loss_ends_every_lease_of_the_session_at_once() {
    let backend = Arc::new(SessionBackend::default());
    let (l1, m1) = locker(&backend);
    let (l2, m2) = locker(&backend);
    let opts = LockOptions::new(Duration::from_secs(30));
    let a = l1.try_lock(&name("a"), &opts).await.expect("a");
    let b = l1.try_lock(&name("b"), &opts).await.expect("b");
    let c = l2.try_lock(&name("c"), &opts).await.expect("c");
    let released = l1.try_lock(&name("r"), &opts).await.expect("r");
    released.release().await.expect("release");
    let (ha, hc, token) = (a.handle(), c.handle(), b.cancellation_token());

    // Before the push returns, every lease of the session reports lost, in
    // both Lockers; nothing waits for a renewal.
    assert_eq!(backend.end_session(), 3);
    for (h, what) in [(&ha, "a"), (&hc, "c")] {
        assert!(
            matches!(
                h.assert_held(),
                Err(Error::LockLost {
                    reason: LossReason::Expired,
                    ..
                })
            ),
            "{what} still says held"
        );
        assert_eq!(h.lost().await, LossReason::Expired);
    }
    assert!(token.is_cancelled(), "b's token did not fire");
    assert_eq!(m1.losses("a", LossReason::Expired), 1);
    assert_eq!(m1.losses("b", LossReason::Expired), 1);
    assert_eq!(m2.losses("c", LossReason::Expired), 1);
    assert_eq!(
        m1.losses("r", LossReason::Expired),
        0,
        "a released lease was counted"
    );

    // A second push of the same owners ends nothing more.
    assert_eq!(backend.end_session(), 0);
    drop((a, b, c));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_locker_leaves_the_feed() {
    let backend = Arc::new(SessionBackend::default());
    let (l1, _) = locker(&backend);
    let opts = LockOptions::new(Duration::from_secs(30));
    let g = l1.try_lock(&name("x"), &opts).await.expect("x");
    drop(g);
    drop(l1);
    tokio::task::yield_now().await;
    assert_eq!(backend.end_session(), 0);
    assert!(format!("{:?}", backend.feed).contains("subscribers: 0"));
}

#[tokio::test(start_paused = true)]
async fn a_loss_pushed_while_the_grant_is_on_its_way_is_not_missed() {
    let backend = Arc::new(SessionBackend::default());
    let (l1, m1) = locker(&backend);
    let opts = LockOptions::new(Duration::from_secs(30));
    backend.end_on_grant.store(true, Ordering::SeqCst);
    let r = l1.try_lock(&name("g"), &opts).await;
    assert!(
        matches!(&r, Err(Error::Unavailable { .. })),
        "a lock whose session ended as it was granted was handed out: {r:?}"
    );
    assert_eq!(m1.losses("g", LossReason::Expired), 1);
    // The registration of the abandoned owner is gone; the next grant is good.
    let g = l1.try_lock(&name("g"), &opts).await.expect("g again");
    assert!(g.is_held());
    assert_eq!(backend.end_session(), 1);
    assert!(!g.is_held());
}
