//! Leader election over one long-held lock, usable on its own.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::backend::ReleaseSignal;
use lock_core::{Error as LockError, LeaseHandle, LockName, LockOptions, Locker};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{Error, Result, SchedulerMetrics};

/// The default election lock TTL: how long a crashed leader blocks a successor.
pub const DEFAULT_ELECTION_TTL: Duration = Duration::from_secs(15);
/// The default interval between a standby's attempts to become leader.
pub const DEFAULT_ELECTION_INTERVAL: Duration = Duration::from_secs(5);

type Hook = Arc<dyn Fn() + Send + Sync + 'static>;

/// Elects one leader among replicas through a long-held lock.
///
/// Every replica tries to take the lock; the one that gets it is the leader
/// and keeps it through the heartbeat (renewed every `ttl / 3`). The others
/// retry every election interval and, on a backend that reports releases
/// ([`Capabilities::release_notify`](lock_core::Capabilities::release_notify)),
/// as soon as the lock is released. When the leader's lease is lost
/// (stolen, expired, backend down past its local deadline) it is demoted at
/// that instant, before any successor can have taken the lock; a crashed
/// leader is replaced within `ttl + interval` (within about `ttl` where the
/// backend also reports the server dropping the lock, as etcd does).
///
/// Dropping the election stops it and releases the lock in the background;
/// [`LeaderElection::stop`] releases it and waits.
///
/// # Examples
///
/// ```
/// # async fn demo(locker: lock_core::Locker) -> scheduler::Result<()> {
/// use scheduler::LeaderElection;
///
/// let election = LeaderElection::builder(locker, "reports/leader")
///     .with_on_elected(|| tracing::info!("leading"))
///     .with_on_demoted(|| tracing::info!("standing by"))
///     .start()?;
/// let mut leading = election.subscribe();
/// while leading.changed().await.is_ok() {
///     println!("leader: {}", *leading.borrow());
/// }
/// # Ok(()) }
/// ```
#[must_use = "dropping a LeaderElection stops campaigning and gives up leadership at once"]
pub struct LeaderElection {
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    tx: watch::Sender<bool>,
    lease: Mutex<Option<LeaseHandle>>,
}

impl fmt::Debug for LeaderElection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderElection")
            .field("is_leader", &self.is_leader())
            .finish()
    }
}

/// Configures and starts a [`LeaderElection`].
#[must_use = "an election builder campaigns for nothing until `start` is called"]
pub struct ElectionBuilder {
    locker: Locker,
    name: String,
    ttl: Duration,
    interval: Duration,
    metrics: Option<SchedulerMetrics>,
    on_elected: Vec<Hook>,
    on_demoted: Vec<Hook>,
}

impl fmt::Debug for ElectionBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElectionBuilder")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .field("interval", &self.interval)
            .finish()
    }
}

impl ElectionBuilder {
    /// The election lock's TTL (default 15 s).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often a standby tries to become leader (default 5 s).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets `scheduler_is_leader` in these metrics.
    pub fn with_metrics(mut self, metrics: SchedulerMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Calls `hook` each time this replica becomes leader.
    pub fn with_on_elected(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_elected.push(Arc::new(hook));
        self
    }

    /// Calls `hook` each time this replica stops being leader.
    pub fn with_on_demoted(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_demoted.push(Arc::new(hook));
        self
    }

    /// Validates the settings and starts campaigning on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Lock`] for a bad lock name or TTL; [`Error::Config`] for a
    /// zero interval, or when called outside a tokio runtime.
    pub fn start(self) -> Result<LeaderElection> {
        let name = LockName::new(&self.name)?;
        let opts = LockOptions::new(self.ttl);
        match self.locker.capabilities() {
            Some(caps) => opts.validate_for(caps)?,
            None => opts.validate(Duration::ZERO)?,
        }
        if self.interval.is_zero() {
            return Err(Error::Config(
                "the election interval must be greater than zero".into(),
            ));
        }
        let runtime = crate::runtime::current()?;
        let (tx, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            tx,
            lease: Mutex::new(None),
        });
        if let Some(m) = &self.metrics {
            m.set_leader(false);
        }
        let stop = CancellationToken::new();
        let campaign = Campaign {
            locker: self.locker,
            name,
            opts,
            interval: self.interval,
            metrics: self.metrics,
            on_elected: self.on_elected,
            on_demoted: self.on_demoted,
            shared: Arc::clone(&shared),
            stop: stop.clone(),
        };
        let task = runtime.spawn(campaign.run());
        Ok(LeaderElection {
            shared,
            stop,
            task: Mutex::new(Some(task)),
        })
    }
}

impl LeaderElection {
    /// Starts configuring an election on the lock `name` through `locker`.
    pub fn builder(locker: Locker, name: impl Into<String>) -> ElectionBuilder {
        ElectionBuilder {
            locker,
            name: name.into(),
            ttl: DEFAULT_ELECTION_TTL,
            interval: DEFAULT_ELECTION_INTERVAL,
            metrics: None,
            on_elected: Vec::new(),
            on_demoted: Vec::new(),
        }
    }

    /// Whether this replica leads now: elected, and its lease still valid by
    /// its local deadline (so a starved process never trusts a stale flag).
    pub fn is_leader(&self) -> bool {
        *self.shared.tx.borrow() && self.lease().is_some_and(|l| l.is_held())
    }

    /// A receiver that sees `true` on election and `false` on demotion.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.shared.tx.subscribe()
    }

    /// The leadership lease while leader: check it, wait for its loss, read
    /// its fencing token.
    pub fn lease(&self) -> Option<LeaseHandle> {
        self.shared
            .lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops campaigning and releases the lock if held.
    ///
    /// # Cancel safety
    ///
    /// If dropped, the election is still stopped; the lock is then released
    /// in the background.
    pub async fn stop(&self) {
        self.stop.cancel();
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Drop for LeaderElection {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct Campaign {
    locker: Locker,
    name: LockName,
    opts: LockOptions,
    interval: Duration,
    metrics: Option<SchedulerMetrics>,
    on_elected: Vec<Hook>,
    on_demoted: Vec<Hook>,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Campaign {
    async fn run(self) {
        // Kept across attempts until it fires: one subscription per change
        // of leader, not one per attempt.
        let mut released: Option<ReleaseSignal> = None;
        while !self.stop.is_cancelled() {
            if released.is_none() {
                // In place before the attempt, so a release right after a
                // refused attempt still wakes this standby.
                released = self.subscribe_release().await;
            }
            match self.locker.try_lock(&self.name, &self.opts).await {
                Ok(guard) => {
                    released = None;
                    let lease = guard.handle();
                    self.set(Some(lease.clone()));
                    info!(election = %self.name, "elected leader");
                    self.on_elected.iter().for_each(|h| h());
                    let stopping = tokio::select! {
                        reason = lease.lost() => {
                            warn!(election = %self.name, %reason, "leadership lost; standing down");
                            false
                        }
                        _ = self.stop.cancelled() => true,
                    };
                    self.set(None);
                    self.on_demoted.iter().for_each(|h| h());
                    if stopping {
                        if let Err(e) = guard.release().await {
                            debug!(election = %self.name, error = %e, "releasing leadership");
                        }
                        return;
                    }
                    drop(guard);
                }
                Err(LockError::HeldElsewhere { .. } | LockError::HeldLocally { .. }) => {
                    debug!(election = %self.name, "another replica leads");
                }
                Err(e) => warn!(election = %self.name, error = %e, "election attempt failed"),
            }
            let attempted = Instant::now();
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
                () = async {
                    match released.as_mut() {
                        Some(signal) => signal.await,
                        None => std::future::pending().await,
                    }
                } => {
                    released = None;
                    // A signal may fire spuriously (a reconnect): at most
                    // eight attempts per interval, however often it does.
                    tokio::select! {
                        _ = self.stop.cancelled() => return,
                        _ = tokio::time::sleep_until(attempted + self.interval / 8) => {}
                    }
                }
            }
        }
    }

    /// A signal for the next release of the election lock, when the backend
    /// reports releases (etcd also reports a lock whose lease the server
    /// dropped), so a standby takes over at once rather than at its next
    /// attempt. Bounded by a quarter of the interval, so an unreachable
    /// backend does not stretch the time between attempts; `None` on any
    /// failure, and the standby then tries every interval.
    async fn subscribe_release(&self) -> Option<ReleaseSignal> {
        let notify = self.locker.capabilities().is_some_and(|c| c.release_notify);
        let backend = self.locker.backend().filter(|_| notify)?;
        tokio::time::timeout(self.interval / 4, (**backend).subscribe_release(&self.name))
            .await
            .ok()?
            .ok()
            .flatten()
    }

    fn set(&self, lease: Option<LeaseHandle>) {
        let leading = lease.is_some();
        *self
            .shared
            .lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = lease;
        self.shared.tx.send_replace(leading);
        if let Some(m) = &self.metrics {
            m.set_leader(leading);
        }
    }
}
