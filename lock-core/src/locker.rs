//! The [`Locker`]: acquires locks through a backend and keeps them.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use prometheus::Registry;
use tokio::time::{sleep, sleep_until, Instant};
use tracing::warn;

use crate::background::Background;
use crate::heartbeat::{release_in_background, HeartbeatHandle};
use crate::lease::{deadline_after, LeaseParts, LeaseState};
use crate::local::{LocalClaim, LocalClaims};
use crate::loss_feed::LeaseRegistry;
use crate::metrics::{AcquireOutcome, LabelMetrics};
use crate::wait::Backoff;
use crate::{
    AcquireAttempt, BackendError, BackendErrorKind, Capabilities, Error, Identity, LockBackend,
    LockGuard, LockMetrics, LockName, LockOptions, OwnerToken, Result, RunOutcome, SkipReason,
};

/// Acquires and holds distributed locks through one backend.
///
/// Build one per process and clone it freely: clones share the backend, the
/// in-process guard (a name held or being acquired through any clone is
/// denied locally without a backend call), the heartbeat task and the metrics.
///
/// # Examples
///
/// ```
/// # async fn demo(backend: impl lock_core::LockBackend + 'static) -> lock_core::Result<()> {
/// use std::time::Duration;
/// use lock_core::{LockName, LockOptions, Locker, RunOutcome};
///
/// let locker = Locker::new(backend)?;
/// let name = LockName::new("reports/nightly")?;
/// let opts = LockOptions::new(Duration::from_secs(30)).with_max_hold(Duration::from_secs(600));
/// match locker.with_lock(&name, &opts, |lease| async move {
///     lease.assert_held()?; // before every unsafe write
///     Ok::<_, lock_core::Error>(42)
/// }).await? {
///     RunOutcome::Completed(value) => println!("ran: {value:?}"),
///     RunOutcome::Skipped(why) => println!("skipped: {why}"),
///     RunOutcome::Aborted(reason) => println!("lock lost: {reason}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Option<Arc<dyn LockBackend>>,
    capabilities: Option<Capabilities>,
    lock_required: bool,
    identity: Identity,
    metrics: LockMetrics,
    claims: Arc<LocalClaims>,
    /// The heartbeat task first started: every acquire reads it, so without
    /// a lock.
    heartbeat: OnceLock<HeartbeatHandle>,
    /// Its replacement, if the runtime that ran it has gone.
    restarted_heartbeat: Mutex<Option<HeartbeatHandle>>,
    next_id: AtomicU64,
    /// This `Locker`'s leases by owner, when the backend pushes losses.
    registry: Option<Arc<LeaseRegistry>>,
    background: Background,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.inner.backend)
            .field("lock_required", &self.inner.lock_required)
            .finish()
    }
}

/// Builds a [`Locker`].
#[derive(Default)]
pub struct LockerBuilder {
    backend: Option<Arc<dyn LockBackend>>,
    metrics: Option<LockMetrics>,
    registry: Option<Registry>,
    lock_required: bool,
    identity: Option<Identity>,
}

impl fmt::Debug for LockerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockerBuilder")
            .field("backend", &self.backend)
            .field("lock_required", &self.lock_required)
            .field("identity", &self.identity)
            .finish()
    }
}

impl LockerBuilder {
    /// Uses `backend`. Without one, the `Locker` runs in unlocked mode.
    pub fn with_backend(mut self, backend: impl LockBackend + 'static) -> Self {
        self.backend = Some(Arc::new(backend));
        self
    }

    /// Uses an already shared backend.
    pub fn with_backend_arc(mut self, backend: Arc<dyn LockBackend>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Reports into `metrics` (shared with other `Locker`s).
    pub fn with_metrics(mut self, metrics: LockMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Registers fresh metrics in `registry` at [`LockerBuilder::build`].
    pub fn with_registry(mut self, registry: &Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Refuses to run anything when no backend is configured, instead of
    /// falling back to the in-process guard.
    pub fn with_lock_required(mut self, required: bool) -> Self {
        self.lock_required = required;
        self
    }

    /// Stores `identity` with every lock this `Locker` takes, so that
    /// [`Locker::describe`] and [`Locker::list`] name who holds it. The
    /// default is [`Identity::for_process`] (host, process id, instance).
    pub fn with_identity(mut self, identity: Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// Builds the `Locker`. Metrics default to the process's default registry.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the metrics cannot be registered.
    pub fn build(self) -> Result<Locker> {
        let metrics = match (self.metrics, self.registry) {
            (Some(m), _) => m,
            (None, Some(r)) => LockMetrics::register(&r)?,
            (None, None) => LockMetrics::default_registry()?,
        };
        let capabilities = self.backend.as_ref().map(|b| b.capabilities());
        let registry = self
            .backend
            .as_ref()
            .and_then(|b| b.loss_feed())
            .map(|feed| {
                let registry = Arc::new(LeaseRegistry::default());
                feed.subscribe(&registry);
                registry
            });
        Ok(Locker {
            inner: Arc::new(Inner {
                backend: self.backend,
                capabilities,
                lock_required: self.lock_required,
                identity: self.identity.unwrap_or_else(Identity::for_process),
                metrics,
                claims: Arc::default(),
                heartbeat: OnceLock::new(),
                restarted_heartbeat: Mutex::new(None),
                next_id: AtomicU64::new(1),
                registry,
                background: Background::default(),
            }),
        })
    }
}

/// Which kind of attempt: a single `try_lock` validates its options and
/// counts a denial; an attempt within `lock`'s wait does neither (its options
/// were validated once before the wait, and it records only its final
/// outcome, not every poll).
#[derive(Clone, Copy, PartialEq, Eq)]
enum AttemptKind {
    Once,
    InWait,
}

impl Locker {
    /// A `Locker` over `backend`, reporting into the default registry.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the metrics cannot be registered.
    pub fn new(backend: impl LockBackend + 'static) -> Result<Self> {
        Self::builder().with_backend(backend).build()
    }

    /// A `Locker` with no backend: jobs run behind the in-process guard only,
    /// with a warning on every run. Safe for one replica only.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the metrics cannot be registered.
    pub fn unlocked() -> Result<Self> {
        Self::builder().build()
    }

    /// Starts a builder.
    pub fn builder() -> LockerBuilder {
        LockerBuilder::default()
    }

    /// The backend, if one is configured.
    pub fn backend(&self) -> Option<&Arc<dyn LockBackend>> {
        self.inner.backend.as_ref()
    }

    /// The identity stored with every lock this `Locker` takes.
    pub fn identity(&self) -> &Identity {
        &self.inner.identity
    }

    /// The backend's capabilities, if one is configured.
    pub fn capabilities(&self) -> Option<&Capabilities> {
        self.inner.capabilities.as_ref()
    }

    /// The metrics this `Locker` reports into.
    pub fn metrics(&self) -> &LockMetrics {
        &self.inner.metrics
    }

    /// Shuts this `Locker` (and every clone of it) down: refuses new
    /// acquisitions, stops renewal, ends every lease it holds for all their
    /// handles (as [`LossReason::Released`](crate::LossReason::Released),
    /// cancelling guarded work) and releases them, then waits up to
    /// `deadline` for that and every other background task (releases queued
    /// by dropped guards, retained holds) to finish.
    ///
    /// Call it last in a graceful shutdown, after the work using the locks has
    /// stopped: a guard dropped at the end of `main` only queues its release,
    /// which the runtime's end would cut off, leaving the lock held until its
    /// TTL (on a session backend, until the connection is noticed gone). A
    /// retained hold on a TTL backend stays on the server until it is over,
    /// as intended; on a session backend it is released now.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] (kind `Timeout`) if background work was still
    /// running at the deadline: those locks end at their TTL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future stops only the waiting; the shutdown
    /// has begun and its releases go on in the background.
    pub async fn shutdown(&self, deadline: std::time::Duration) -> Result<()> {
        let running = self.inner.background.close(deadline).await;
        if running == 0 {
            return Ok(());
        }
        warn!(
            running,
            ?deadline,
            "Locker shutdown: background work still running at the deadline"
        );
        Err(Error::Backend(BackendError::new(
            BackendErrorKind::Timeout,
            format!(
                "{running} background task(s) (releases, most likely) were still running {deadline:?} after shutdown began; their locks end at their TTL"
            ),
        )))
    }

    /// Tries once to acquire `name`.
    ///
    /// # Examples
    ///
    /// A lock per entity, named from arbitrary input, with one metric label
    /// for all of them so the metrics stay one series per kind of lock:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::{Error, LockName, LockOptions, Locker};
    ///
    /// let locker = Locker::builder()
    ///     .with_backend(lock_memory::MemoryBackend::new())
    ///     .with_registry(&prometheus::Registry::new())
    ///     .build()?;
    /// let opts = LockOptions::new(Duration::from_secs(30)).with_metric_label("account");
    /// let name = LockName::for_key("account", "zoe@example.com")?;
    /// match locker.try_lock(&name, &opts).await {
    ///     Ok(guard) => {
    ///         guard.assert_held()?; // before every write the lock protects
    ///         guard.release().await?;
    ///     }
    ///     Err(Error::HeldElsewhere { .. } | Error::HeldLocally { .. }) => {
    ///         println!("someone else is updating this account");
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::HeldElsewhere`] (held elsewhere), [`Error::HeldLocally`],
    /// [`Error::Unavailable`] (backend failed; fail closed),
    /// [`Error::LockRequired`], or [`Error::Config`] for bad options.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped after the backend granted the
    /// lock, the lock is released in the background.
    pub fn try_lock<'a>(
        &'a self,
        name: &'a LockName,
        opts: &'a LockOptions,
    ) -> impl Future<Output = Result<LockGuard>> + 'a {
        // The attempt's own future, not an `async fn` wrapped around it: one
        // state machine less to move and poll on every call.
        self.attempt(name, opts, AttemptKind::Once)
    }

    /// Acquires `name`, waiting while it is held (here or elsewhere) until the
    /// options' acquire timeout. Waiters wake on the backend's release
    /// notification where it has one, otherwise poll with jittered backoff.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> lock_core::Result<()> {
    /// use std::time::Duration;
    /// use lock_core::{LockName, LockOptions, Locker};
    ///
    /// let locker = Locker::builder()
    ///     .with_backend(lock_memory::MemoryBackend::new())
    ///     .with_registry(&prometheus::Registry::new())
    ///     .build()?;
    /// let name = LockName::new("migrations")?;
    /// let opts = LockOptions::new(Duration::from_secs(30))
    ///     .with_acquire_timeout(Duration::from_secs(60)); // then Error::Timeout
    /// let guard = locker.lock(&name, &opts).await?;
    /// // ... migrate, calling guard.assert_held()? before each step ...
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the timeout passes. [`Error::Unavailable`] if
    /// the backend cannot be reached: at once without an acquire timeout, and
    /// otherwise after retrying until the timeout (nothing runs meanwhile).
    /// As [`Locker::try_lock`] otherwise.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future stops waiting and leaves nothing
    /// behind (a lock granted at that moment is released in the background).
    pub async fn lock(&self, name: &LockName, opts: &LockOptions) -> Result<LockGuard> {
        self.validate(opts)?;
        let started = Instant::now();
        // A timeout too large for the clock is no timeout.
        let deadline = opts
            .acquire_timeout()
            .and_then(|t| deadline_after(started, t));
        let notify = self
            .inner
            .capabilities
            .as_ref()
            .is_some_and(|c| c.release_notify);
        let mut backoff = Backoff::new(opts.ttl());
        // A subscription that has not fired is kept for the next round, so a
        // long wait costs one subscription, not one per attempt.
        let mut signal: Option<crate::ReleaseSignal> = None;
        let mut last_outage: Option<BackendError> = None;
        // Counted as a local waiter for the whole wait: releases wake local
        // waiters only while someone is counted.
        let _waiting = self.inner.claims.waiting();
        loop {
            if let (Some(b), true, None) = (&self.inner.backend, notify, &signal) {
                signal = (**b).subscribe_release(name).await.ok().flatten();
            }
            let local_freed = self.inner.claims.freed();
            tokio::pin!(local_freed);
            local_freed.as_mut().enable();
            // Only a local denial waits for a local release: a remote denial
            // drops this attempt's own claim, which would wake us at once.
            let held_locally = match self.attempt(name, opts, AttemptKind::InWait).await {
                Err(Error::HeldLocally { .. }) => true,
                Err(Error::HeldElsewhere { .. }) => false,
                // An outage within a bounded wait is retried until the
                // deadline: nothing runs meanwhile, so this stays fail closed.
                Err(Error::Unavailable { source, .. })
                    if deadline.is_some() && source.kind().is_unavailable() =>
                {
                    last_outage = Some(source);
                    false
                }
                other => return other,
            };
            let nap = backoff.next_sleep();
            let far = Instant::now() + nap + nap;
            tokio::select! {
                _ = async {
                    match signal.as_mut() {
                        Some(s) => s.await,
                        None => std::future::pending().await,
                    }
                } => signal = None,
                _ = &mut local_freed, if held_locally => {}
                _ = sleep(nap) => {}
                _ = sleep_until(deadline.unwrap_or(far)), if deadline.is_some() => {
                    if let Some(source) = last_outage.take() {
                        return Err(Error::Unavailable { name: name.clone(), source });
                    }
                    self.inner.metrics.label(label_of(name, opts)).acquisition(AcquireOutcome::HeldElsewhere);
                    return Err(Error::Timeout { name: name.clone(), waited: started.elapsed() });
                }
            }
        }
    }

    /// Runs `job` while holding `name`, if it can be acquired now.
    ///
    /// The job receives a [`LeaseHandle`](crate::LeaseHandle); it should call
    /// `assert_held()` before every unsafe write. If the lock is lost while the
    /// job runs (stolen, expired, backend down past the deadline, or `max_hold`
    /// reached), the job's future is dropped at once and the run is
    /// [`RunOutcome::Aborted`]. After the job returns, ownership is verified
    /// with the backend once more before the run counts as completed; then the
    /// lock is released.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use lock_core::{LockName, LockOptions, Locker};
    ///
    /// let locker = Locker::builder()
    ///     .with_backend(lock_memory::MemoryBackend::new())
    ///     .with_registry(&prometheus::Registry::new())
    ///     .build()?;
    /// let name = LockName::new("reports/nightly")?;
    /// let opts = LockOptions::new(Duration::from_secs(30)).with_max_hold(Duration::from_secs(600));
    /// let written = locker
    ///     .with_lock(&name, &opts, |lease| async move {
    ///         lease.assert_held()?; // before every unsafe write
    ///         Ok::<_, lock_core::Error>(3) // rows written
    ///     })
    ///     .await?
    ///     .into_result()?; // Ok(None): another replica holds it
    /// if let Some(rows) = written {
    ///     println!("wrote {} rows", rows?);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Only for bad input ([`Error::Config`], [`Error::Entropy`]); every other
    /// situation is a [`RunOutcome`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the job and releases the lock in the background.
    pub async fn with_lock<F, Fut, T>(
        &self,
        name: &LockName,
        opts: &LockOptions,
        job: F,
    ) -> Result<RunOutcome<T>>
    where
        F: FnOnce(crate::LeaseHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = match self.try_lock(name, opts).await {
            Ok(g) => g,
            Err(e) => return skip_reason(e).map(RunOutcome::Skipped),
        };
        let handle = guard.handle();
        let work = job(handle.clone());
        let value = tokio::select! {
            biased;
            reason = handle.lost() => return Ok(RunOutcome::Aborted(reason)),
            value = work => value,
        };
        match handle.verify().await {
            Ok(()) => {}
            Err(Error::LockLost { reason, .. }) => return Ok(RunOutcome::Aborted(reason)),
            Err(e) => {
                // The backend cannot confirm; the local deadline still can.
                warn!(lock = %name, error = %e, "could not re-verify the lock after the job; relying on its local deadline");
                if let Err(Error::LockLost { reason, .. }) = handle.assert_held() {
                    return Ok(RunOutcome::Aborted(reason));
                }
            }
        }
        if let Err(e) = guard.release().await {
            warn!(lock = %name, error = %e, "release after a completed run failed");
        }
        Ok(RunOutcome::Completed(value))
    }

    #[inline]
    fn validate(&self, opts: &LockOptions) -> Result<()> {
        match &self.inner.capabilities {
            Some(caps) => opts.validate_for(caps),
            None => opts.validate(std::time::Duration::ZERO),
        }
    }

    async fn attempt(
        &self,
        name: &LockName,
        opts: &LockOptions,
        kind: AttemptKind,
    ) -> Result<LockGuard> {
        if kind == AttemptKind::Once {
            self.validate(opts)?;
        }
        if self.inner.background.is_closing() {
            return Err(Error::ShutDown { name: name.clone() });
        }
        let Some(claim) = self.inner.claims.claim(name) else {
            let metrics = self.inner.metrics.label(label_of(name, opts));
            if kind == AttemptKind::Once {
                metrics.acquisition(AcquireOutcome::HeldLocally);
            }
            return Err(Error::HeldLocally { name: name.clone() });
        };
        let metrics = match opts.metric_label() {
            Some(label) => self.inner.metrics.label(label),
            None => claim.name_label(|| self.inner.metrics.label(name.as_str())),
        };
        let Some(backend) = self.inner.backend.as_ref() else {
            return self.unlocked_guard(name, opts, metrics, claim);
        };
        let owner = OwnerToken::generate()?;
        let _expected = self.inner.registry.as_ref().map(|r| r.expect(owner));
        let mut cleanup = ReleaseOnDrop::arm(backend, name, owner, &self.inner.background);
        let sent_at = Instant::now();
        // Called on the trait object itself (here and at every backend call):
        // method lookup on the `Arc` would pick the forwarding impl for
        // `Arc<T>`, which boxes a second future around the backend's own.
        let attempt = (**backend)
            .try_acquire_as(name, &owner, opts.ttl(), &self.inner.identity)
            .await;
        let lease = match attempt {
            Ok(AcquireAttempt::Acquired(lease)) => lease,
            Ok(_) => {
                cleanup.disarm();
                if kind == AttemptKind::Once {
                    metrics.acquisition(AcquireOutcome::HeldElsewhere);
                }
                return Err(Error::HeldElsewhere { name: name.clone() });
            }
            Err(source) => {
                // The request may have reached the server; keep the cleanup armed.
                let outcome = if source.kind().is_unavailable() {
                    AcquireOutcome::Unavailable
                } else {
                    AcquireOutcome::Error
                };
                metrics.acquisition(outcome);
                warn!(lock = %name, error = %source, "lock backend failed on acquire; not running (fail closed)");
                return Err(Error::Unavailable {
                    name: name.clone(),
                    source,
                });
            }
        };
        // A lock on a shared server-side lease may be kept for less than its
        // TTL (the lease's last proof of life came before this attempt): it
        // counts as proven then, so its validity and first renewal come early.
        let proved_at = match lease.lasts_at_least {
            Some(lasts) if lasts < opts.ttl() => sent_at.checked_sub(opts.ttl() - lasts),
            _ => Some(sent_at),
        };
        let usable_until = proved_at.and_then(|at| deadline_after(at, opts.timing().validity));
        if usable_until.is_none_or(|until| Instant::now() >= until) {
            // The grant arrived after its own validity ran out (X5): unusable.
            metrics.acquisition(AcquireOutcome::Unavailable);
            return Err(Error::Unavailable {
                name: name.clone(),
                source: BackendError::new(
                    BackendErrorKind::Timeout,
                    format!("acquire took longer than the TTL of {:?}", opts.ttl()),
                ),
            });
        }
        cleanup.disarm();
        metrics.acquisition(AcquireOutcome::Acquired);
        let state = LeaseState::new(LeaseParts {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            name: name.clone(),
            owner,
            fencing: lease.fencing_token,
            options: opts,
            sent_at,
            proved_at: proved_at.unwrap_or(sent_at),
            valid_until: usable_until,
            backend: Some(Arc::clone(backend)),
            metrics,
            registry: self.inner.registry.clone(),
            background: self.inner.background.clone(),
        });
        // Only a backend with a loss feed can have ended the lease already.
        let pushed_end = self
            .inner
            .registry
            .as_ref()
            .and_then(|_| state.loss_reason());
        if let Some(reason) = pushed_end {
            // The backend pushed the end of this lease (its session closed)
            // while the grant was on its way: no usable lock was taken.
            if reason != crate::LossReason::Stolen {
                release_in_background(backend, &self.inner.background, state);
            }
            return Err(Error::Unavailable {
                name: name.clone(),
                source: BackendError::new(
                    BackendErrorKind::Unavailable,
                    format!("the lock ended ({reason}) as it was granted; try again"),
                ),
            });
        }
        let heartbeat = self.heartbeat(backend);
        heartbeat.track(Arc::clone(&state));
        if self.inner.background.is_closing() {
            // Shutdown began during the acquire: its heartbeat may have
            // stopped before seeing this lease, so end and release it here
            // (a second release, if the heartbeat did too, finds nothing).
            let _ = state.finish(Instant::now());
            release_in_background(backend, &self.inner.background, state);
            return Err(Error::ShutDown { name: name.clone() });
        }
        Ok(LockGuard::new(state, Some(heartbeat), claim))
    }

    fn unlocked_guard(
        &self,
        name: &LockName,
        opts: &LockOptions,
        metrics: Arc<LabelMetrics>,
        claim: LocalClaim,
    ) -> Result<LockGuard> {
        if self.inner.lock_required {
            metrics.acquisition(AcquireOutcome::Unavailable);
            return Err(Error::LockRequired { name: name.clone() });
        }
        warn!(lock = %name, "running without a distributed lock: no backend is configured; this is only safe with a single replica");
        metrics.acquisition(AcquireOutcome::Unlocked);
        let now = Instant::now();
        let state = LeaseState::new(LeaseParts {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            name: name.clone(),
            owner: OwnerToken::generate()?,
            fencing: None,
            options: opts,
            sent_at: now,
            proved_at: now,
            valid_until: None,
            backend: None,
            metrics,
            registry: None,
            background: self.inner.background.clone(),
        });
        Ok(LockGuard::new(state, None, claim))
    }

    /// The heartbeat task, started on first use (and restarted if the runtime
    /// that ran it has gone).
    fn heartbeat(&self, backend: &Arc<dyn LockBackend>) -> HeartbeatHandle {
        let first = self
            .inner
            .heartbeat
            .get_or_init(|| HeartbeatHandle::spawn(Arc::clone(backend), &self.inner.background));
        if !first.is_closed() {
            return first.clone();
        }
        self.restart_heartbeat(backend)
    }

    /// A heartbeat task in place of one whose runtime has gone.
    #[cold]
    #[inline(never)]
    fn restart_heartbeat(&self, backend: &Arc<dyn LockBackend>) -> HeartbeatHandle {
        let mut slot = self
            .inner
            .restarted_heartbeat
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match slot.as_ref() {
            Some(hb) if !hb.is_closed() => hb.clone(),
            _ => {
                let hb = HeartbeatHandle::spawn(Arc::clone(backend), &self.inner.background);
                *slot = Some(hb.clone());
                hb
            }
        }
    }
}

/// The `lock` label of `name`'s metrics: the options' label, else the name.
fn label_of<'a>(name: &'a LockName, opts: &'a LockOptions) -> &'a str {
    opts.metric_label().unwrap_or(name.as_str())
}

fn skip_reason(e: Error) -> Result<SkipReason> {
    match e {
        Error::HeldElsewhere { .. } => Ok(SkipReason::HeldElsewhere),
        Error::HeldLocally { .. } => Ok(SkipReason::HeldLocally),
        Error::Unavailable { source, .. } => Ok(SkipReason::Unavailable(source)),
        Error::LockRequired { .. } => Ok(SkipReason::LockRequired),
        other => Err(other),
    }
}

/// Releases an owner token if an acquire is abandoned midway, so a cancelled
/// or failed acquire leaves no lock behind on the server. It borrows what
/// the acquire already holds: only an abandoned acquire pays for copies.
struct ReleaseOnDrop<'a> {
    armed: Option<(
        &'a Arc<dyn LockBackend>,
        &'a LockName,
        OwnerToken,
        &'a Background,
    )>,
}

impl<'a> ReleaseOnDrop<'a> {
    fn arm(
        backend: &'a Arc<dyn LockBackend>,
        name: &'a LockName,
        owner: OwnerToken,
        background: &'a Background,
    ) -> Self {
        Self {
            armed: Some((backend, name, owner, background)),
        }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseOnDrop<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some((backend, name, owner, background)) = self.armed.take() {
            release_abandoned(backend, name, owner, background);
        }
    }
}

/// Releases the owner token of an abandoned acquire in the background.
#[cold]
#[inline(never)]
fn release_abandoned(
    backend: &Arc<dyn LockBackend>,
    name: &LockName,
    owner: OwnerToken,
    background: &Background,
) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        let (backend, name) = (Arc::clone(backend), name.clone());
        background.spawn_on(
            async move {
                let _ = (*backend).release(&name, &owner).await;
            },
            &rt,
        );
    }
}
