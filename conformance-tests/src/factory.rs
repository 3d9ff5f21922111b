//! What a backend provides to the suite, and what a case sees.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{
    Capabilities, Identity, LockBackend, LockMetrics, LockName, LockOptions, Locker, TickStore,
};
use prometheus::Registry;

/// Errors from test plumbing (connecting, sabotaging); cases turn them into failures.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How fast a backend's cases run and how much slack their bounds get.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// The TTL cases use.
    pub ttl: Duration,
    /// Slack added to every upper time bound (scheduling on a loaded 2-core
    /// machine, network round trips). Zero-ish on the paused clock.
    pub tolerance: Duration,
    /// Whether cases run on tokio's paused clock (exact, instant).
    pub paused_clock: bool,
}

/// Makes replicas of one backend for the suite.
#[async_trait]
pub trait BackendFactory: Send + Sync + 'static {
    /// The prefix of this backend's test names, such as `memory` or `redis`.
    fn name(&self) -> &str;

    /// What the backends it makes can do.
    fn capabilities(&self) -> Capabilities;

    /// The timing profile.
    fn timing(&self) -> Timing;

    /// A new independent replica with its own connections, as a separate
    /// process would have. Called inside the case's runtime.
    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError>;

    /// A saboteur acting from outside the library.
    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError>;

    /// A [`TickStore`] on the same server as the replicas' locks, with its own
    /// connection. Every backend that the scheduler supports returns one.
    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(None)
    }

    /// The loopback address of the server, when the suite can put a fault
    /// proxy in front of it.
    fn server_addr(&self) -> Option<SocketAddr> {
        None
    }

    /// A replica whose connections go to `addr` (a fault proxy in front of
    /// [`BackendFactory::server_addr`]) instead of the server itself.
    async fn replica_via(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<Arc<dyn LockBackend>>, BoxError> {
        let _ = addr;
        Ok(None)
    }

    /// The URL `scheduler::connect` reaches this factory's server by, for
    /// cases that run the library in another process (`None`: in-process
    /// only).
    fn connect_url(&self) -> Option<String> {
        None
    }

    /// Whether [`BackendFactory::connect_url`] gives a URL, answered without
    /// starting a server, so that registering the cases of a deployment
    /// (a Sentinel set, a cluster) that a filtered run skips costs nothing.
    fn has_connect_url(&self) -> bool {
        self.connect_url().is_some()
    }

    /// The private server process, when the suite started one (to pause,
    /// kill or restart it).
    fn server_process(&self) -> Option<&crate::harness::ServerProcess> {
        None
    }

    /// A backend configured to reach a server that is not there (a closed
    /// port), for the fail-closed case. `None` if the backend has no server.
    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        None
    }
}

/// Changes leases behind their holders' backs, as another client or an
/// operator could.
#[async_trait]
pub trait Saboteur: Send + Sync {
    /// Gives `name` to a new owner that keeps it for at least `hold`.
    async fn steal(&self, name: &LockName, hold: Duration) -> Result<(), BoxError>;

    /// Makes the lease on `name` vanish, as its expiry or a killed session would.
    async fn expire(&self, name: &LockName) -> Result<(), BoxError>;

    /// Whether the owner set by the last [`Saboteur::steal`] of `name` still holds it.
    async fn thief_holds(&self, name: &LockName) -> Result<bool, BoxError>;

    /// Ends whatever the saboteur itself still holds on `name`.
    async fn clear(&self, name: &LockName) -> Result<(), BoxError>;
}

/// One replica: a backend instance and a `Locker` with its own metrics.
#[derive(Debug, Clone)]
pub struct Replica {
    /// The backend, for single attempts that bypass the `Locker`.
    pub backend: Arc<dyn LockBackend>,
    /// The replica's `Locker`.
    pub locker: Locker,
    /// The replica's metrics.
    pub metrics: LockMetrics,
}

impl Replica {
    /// Asserts that this replica takes `name` with a single attempt (then
    /// gives it back): whatever released it has finished by now. `what`
    /// names the step in the failure.
    pub async fn takes_at_once(&self, what: &str, name: &LockName, ctx: &Ctx) {
        match self.locker.try_lock(name, &ctx.opts()).await {
            Ok(g) => g.release().await.expect("release"),
            Err(e) => panic!("{what}: the lock was not free yet ({e})"),
        }
    }

    /// Asserts that `name` is free: this replica takes it within `bound`
    /// (background releases included), then gives it back. `what` names the
    /// step in the failure.
    pub async fn assert_free(&self, what: &str, name: &LockName, ctx: &Ctx, bound: Duration) {
        let opts = ctx.opts().with_acquire_timeout(bound);
        match self.locker.lock(name, &opts).await {
            Ok(g) => g.release().await.expect("release"),
            Err(e) => panic!("{what}: the lock was left held ({e})"),
        }
    }

    /// Asserts that `name` is free right now: this replica takes it at its
    /// first try, then gives it back. `expect` is the failure message.
    pub async fn assert_free_now(&self, expect: &str, name: &LockName, ctx: &Ctx) {
        let g = self
            .locker
            .try_lock(name, &ctx.opts())
            .await
            .unwrap_or_else(|e| panic!("{expect}: {e:?}"));
        g.release().await.expect("release");
    }
}

/// What a case gets: the factory, a unique name prefix, and helpers.
#[derive(Clone)]
pub struct Ctx {
    factory: Arc<dyn BackendFactory>,
    prefix: String,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("backend", &self.factory.name())
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Ctx {
    /// A context for one case; `run_id` is random per test run.
    pub fn new(factory: Arc<dyn BackendFactory>, run_id: &str, case: &str) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        Self {
            prefix: format!("ct-{run_id}/{case}-{seq}"),
            factory,
        }
    }

    /// The factory.
    pub fn factory(&self) -> &Arc<dyn BackendFactory> {
        &self.factory
    }

    /// The timing profile.
    pub fn timing(&self) -> Timing {
        self.factory.timing()
    }

    /// The case's name prefix; every lock it takes starts with it.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A lock name unique to this case.
    pub fn name(&self, suffix: &str) -> LockName {
        LockName::new(format!("{}/{suffix}", self.prefix)).expect("test lock names are valid")
    }

    /// Options with the profile's TTL.
    pub fn opts(&self) -> LockOptions {
        LockOptions::new(self.timing().ttl)
    }

    /// A new replica with its own connections and metrics registry.
    pub async fn replica(&self) -> Replica {
        let backend = self.factory.replica().await.expect("replica connects");
        self.replica_over(backend)
    }

    /// A new replica whose locks name `identity` as their holder.
    pub async fn replica_as(&self, identity: &str) -> Replica {
        let backend = self.factory.replica().await.expect("replica connects");
        self.replica_with(backend, Some(identity))
    }

    /// A replica whose `Locker` uses `backend` (for instance a fault wrapper).
    pub fn replica_over(&self, backend: Arc<dyn LockBackend>) -> Replica {
        self.replica_with(backend, None)
    }

    fn replica_with(&self, backend: Arc<dyn LockBackend>, identity: Option<&str>) -> Replica {
        let metrics = LockMetrics::register(&Registry::new()).expect("fresh registry");
        let mut builder = Locker::builder()
            .with_backend_arc(Arc::clone(&backend))
            .with_metrics(metrics.clone());
        if let Some(id) = identity {
            builder = builder.with_identity(Identity::new(id).expect("a valid identity"));
        }
        let locker = builder.build().expect("locker builds");
        Replica {
            backend,
            locker,
            metrics,
        }
    }

    /// The saboteur.
    pub async fn saboteur(&self) -> Box<dyn Saboteur> {
        self.factory.saboteur().await.expect("saboteur connects")
    }
}
