//! The completion mark a finished tick leaves is a retained lock, and a
//! retained hold is a TTL on the server: on a backend with a minimum TTL
//! (whole seconds on etcd) the scheduler keeps the mark for at least that
//! long instead of asking for a hold the backend refuses. On the memory
//! backend and tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::DateTime;
use lock_core::backend::{AcquireAttempt, LeaseStatus, OwnerToken, RenewRequest};
use lock_core::{
    async_trait, BackendError, BackendErrorKind, Capabilities, Error as LockError, LockBackend,
    LockName, LockOptions, Locker,
};
use lock_memory::{Intercept, Intercepted, MemoryBackend};
use prometheus::Registry;
use scheduler::{Job, Scheduler, TickOutcome, TokioClock};

const MIN_TTL: Duration = Duration::from_secs(1);

/// Gives the memory backend etcd's rule: a TTL below one second is refused
/// with a configuration error. Records the TTL of every single renewal (a
/// retained hold is set by one).
#[derive(Debug, Default)]
struct WholeSeconds {
    renewals: Mutex<Vec<Duration>>,
}

impl WholeSeconds {
    fn refuse_short(ttl: Duration) -> Result<(), BackendError> {
        if ttl < MIN_TTL {
            return Err(BackendError::new(
                BackendErrorKind::Config,
                format!("a TTL of {ttl:?} is below this backend's minimum of {MIN_TTL:?}"),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl Intercept for WholeSeconds {
    fn capabilities(&self, inner: &MemoryBackend) -> Capabilities {
        inner.capabilities().with_min_ttl(MIN_TTL)
    }
    async fn try_acquire(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        Self::refuse_short(ttl)?;
        inner.try_acquire(name, owner, ttl).await
    }
    async fn renew(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        if let Ok(mut r) = self.renewals.lock() {
            r.push(ttl);
        }
        Self::refuse_short(ttl)?;
        inner.renew(name, owner, ttl).await
    }
    async fn renew_many(
        &self,
        inner: &MemoryBackend,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        for r in requests {
            Self::refuse_short(r.ttl)?;
        }
        inner.renew_many(requests).await
    }
}

/// A tick that finishes with less than the minimum TTL left of the skew
/// tolerance keeps its lock as a mark for the minimum TTL: another replica
/// cannot take it for that long, and the hold asked of the backend is never
/// one it refuses.
#[tokio::test(start_paused = true)]
async fn a_short_mark_is_raised_to_the_backends_minimum_ttl() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let memory = MemoryBackend::new();
        let backend = Intercepted::over(memory.clone(), WholeSeconds::default());
        let locker = Locker::builder()
            .with_backend(backend.clone())
            .with_registry(&Registry::new())
            .build()
            .expect("locker");
        // The first tick is due 100 ms after the start: at +0.1 s.
        let base = DateTime::from_timestamp(1_800_000_000, 900_000_000).expect("valid");
        let outcomes: Arc<Mutex<Vec<TickOutcome>>> = Arc::default();
        let seen = Arc::clone(&outcomes);
        let s = Scheduler::builder(locker, Arc::new(memory.clone()))
            .with_registry(&Registry::new())
            .with_clock(Arc::new(TokioClock::starting_at(base)))
            .with_skew_tolerance(Duration::from_millis(500))
            .with_on_outcome(move |r| seen.lock().expect("log").push(r.outcome))
            .with_job(
                Job::new("marked", "* * * * * *", |_| async { Ok(()) })
                    .with_ttl(Duration::from_secs(3)),
            )
            .start()
            .expect("starts");
        // Past the tick and the tolerance (+0.6 s), inside the minimum TTL.
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(*outcomes.lock().expect("log"), vec![TickOutcome::Success]);
        let holds = backend.renewals.lock().expect("log").clone();
        assert_eq!(
            holds,
            vec![MIN_TTL],
            "the mark's hold must be raised to the backend's minimum TTL"
        );
        let other = Locker::builder()
            .with_backend(memory.clone())
            .with_registry(&Registry::new())
            .build()
            .expect("locker");
        let tick = LockName::new("marked/1800000001000").expect("valid");
        let taken = other.try_lock(&tick, &LockOptions::new(MIN_TTL)).await;
        assert!(
            matches!(taken, Err(LockError::HeldElsewhere { .. })),
            "the tick's mark must still hold it: {taken:?}"
        );
        s.shutdown(Duration::from_secs(1)).await.expect("clean");
    })
    .await
    .expect("the test finishes within its bound");
}
