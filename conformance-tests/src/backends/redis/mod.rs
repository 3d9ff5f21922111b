//! The Redis backend's factory and test servers.
//!
//! Two factories can run the whole suite: `redis` on a private
//! `redis-server` started from `PATH`, and `redis_env` on the server at
//! `REDIS_URL` when it is set (with the `docker` feature, `docker_redis` on
//! a container too).
//! Redis-specific tests (`redis::<test>`) run on private servers only, since
//! they flush scripts, pause and restart their server.

mod access;
mod attempts;
pub mod cluster;
mod cluster_cases;
mod cluster_factory;
mod faults;
mod inspect;
mod resent;
mod saboteur;
pub mod sentinel;
mod sentinel_ack;
mod sentinel_factory;
mod sentinel_frozen;
mod sentinel_refused;
pub mod server;
mod specific;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_core::backend::Expiry;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_redis::{RedisBackend, RedisBuilder};

pub use access::acl_rules;
pub use cluster_factory::{cluster_factory, ClusterFactory};
pub use saboteur::RedisSaboteur;
pub use sentinel_ack::{replica_ack, replica_ack_cost};
pub use sentinel_factory::{sentinel_factory, SentinelFactory};
pub use sentinel_frozen::frozen_sentinel_does_not_stall;
pub use sentinel_refused::replica_refused;

use crate::harness::{free_port, Availability, ServerProcess};
use crate::{BackendFactory, BoxError, Saboteur, Suite, Timing};

/// TTL of the Redis timing profile.
const TTL: Duration = Duration::from_secs(1);
/// The Redis timing profile, of every Redis row: the Sentinel and cluster
/// rows' conformance cases see no failover, and their writes do not wait
/// for the replicas, so they need no more slack than a single server.
pub(crate) const TIMING: Timing = Timing {
    ttl: TTL,
    tolerance: Duration::from_millis(350),
    paused_clock: false,
};
/// Operation timeout: above the slowest answer seen on a loaded 2-core
/// machine, and short enough that a stalled renewal is retried before the
/// local deadline (ttl - drift).
pub const OP_TIMEOUT: Duration = Duration::from_millis(500);
/// Connect timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a factory's server is.
enum Server {
    Private(ServerProcess),
    #[cfg(feature = "docker")]
    Container(crate::harness::docker::DockerServer),
    External,
}

/// Makes Redis replicas against one server, all under one key prefix.
pub struct RedisFactory {
    name: &'static str,
    url: String,
    prefix: String,
    server: Server,
    /// Whether replicas draw fencing tokens (`with_fencing_tokens`).
    fencing: bool,
}

impl std::fmt::Debug for RedisFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisFactory")
            .field("name", &self.name)
            .field("prefix", &self.prefix)
            .field("fencing", &self.fencing)
            .finish()
    }
}

impl RedisFactory {
    /// The URL of its server (may carry credentials; do not print it).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The key prefix every replica uses.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The private server process, if this factory started one.
    pub fn process(&self) -> Option<&ServerProcess> {
        match &self.server {
            Server::Private(p) => Some(p),
            _ => None,
        }
    }

    /// The configuration replicas use.
    pub fn config(&self) -> Result<RedisBuilder, BoxError> {
        Ok(config_for(&self.url)?
            .with_key_prefix(&self.prefix)
            .with_fencing_tokens(self.fencing))
    }

    /// The same server with fencing tokens off, as `<name>_nofence`, its keys
    /// under a prefix of their own. It borrows the server: keep `self` alive
    /// while it is used. Cases that stop or cut off the server do not run on
    /// it (they test the connection, which is the same).
    pub fn without_fencing(&self) -> Self {
        Self {
            name: if self.name == "redis" {
                "redis_nofence"
            } else {
                "redis_env_nofence"
            },
            url: self.url.clone(),
            prefix: format!("{}nofence:", self.prefix),
            server: Server::External,
            fencing: false,
        }
    }

    /// A backend of the test profile on `url`.
    pub fn backend(&self) -> Result<RedisBackend, BoxError> {
        Ok(self.config()?.build()?)
    }
}

/// The test profile's timeouts on `url`.
pub fn config_for(url: &str) -> Result<RedisBuilder, BoxError> {
    Ok(RedisBuilder::from_url(url)?
        .with_operation_timeout(OP_TIMEOUT)
        .with_connect_timeout(CONNECT_TIMEOUT))
}

/// `127.0.0.1:<port>` of each of `ports`, comma-separated: the host list
/// of a URL that names every server of a local set as a seed.
fn local_hosts(ports: impl IntoIterator<Item = u16>) -> String {
    let hosts: Vec<String> = ports
        .into_iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    hosts.join(",")
}

/// What a backend built as `built` reports (its settings decide it, not a
/// server), or TTL expiry alone should it not build.
pub(crate) fn capabilities_of<E>(built: Result<RedisBackend, E>) -> Capabilities {
    built.map_or_else(|_| Capabilities::new(Expiry::Ttl), |b| b.capabilities())
}

/// What a backend through sentinels can do: a plain builder's, since the
/// sentinels only tell it where the primary is. The process and container
/// deployments both report these.
pub(crate) fn sentinel_capabilities() -> Capabilities {
    capabilities_of(RedisBuilder::new().build())
}

/// A replica of the test profile that reaches nothing: `url` of a free port
/// nobody listens on.
pub(crate) fn unreachable(url: impl FnOnce(u16) -> String) -> Option<Arc<dyn LockBackend>> {
    let port = free_port().ok()?;
    let backend = config_for(&url(port)).ok()?.build().ok()?;
    Some(Arc::new(backend))
}

#[async_trait]
impl BackendFactory for RedisFactory {
    fn connect_url(&self) -> Option<String> {
        Some(self.url.clone())
    }

    fn name(&self) -> &str {
        self.name
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_of(
            RedisBuilder::new()
                .with_fencing_tokens(self.fencing)
                .build(),
        )
    }

    fn timing(&self) -> Timing {
        TIMING
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.config()?.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        Ok(Box::new(
            RedisSaboteur::connect(&self.url, &self.prefix).await?,
        ))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.config()?.connect().await?)))
    }

    fn server_addr(&self) -> Option<SocketAddr> {
        let port = match &self.server {
            Server::Private(p) => p.port(),
            #[cfg(feature = "docker")]
            Server::Container(c) => c.port(),
            Server::External => return None,
        };
        Some(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
    }

    async fn replica_via(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<Arc<dyn LockBackend>>, BoxError> {
        let backend = config_for(&format!("redis://{addr}"))?
            .with_key_prefix(&self.prefix)
            .with_fencing_tokens(self.fencing)
            .connect()
            .await?;
        Ok(Some(Arc::new(backend)))
    }

    fn server_process(&self) -> Option<&ServerProcess> {
        self.process()
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        unreachable(|port| format!("redis://127.0.0.1:{port}"))
    }
}

/// The cases `redis_nofence::` runs: those whose outcome depends on how a
/// lock is taken, which is all fencing tokens change.
const UNFENCED_CASES: &[&str] = &[
    "mutual_exclusion",
    "theft_is_detected",
    "expiry_is_detected",
    "stale_holder_cannot_touch_successor",
    "release_after_loss_reports_lost",
    "released_lease_ends_every_clone",
    "fencing_tokens_increase",
    "fencing_declared_matches_tokens",
    "blocking_acquire_times_out",
    "blocking_acquire_wakes_on_release",
    "cancelled_acquire_leaves_nothing",
    "bad_input_is_rejected",
    "extreme_durations_never_panic_or_leak",
    "scheduler_per_tick_exactly_once",
    "scheduler_leader_exactly_once",
];

/// The Redis servers of one test run, and what the suite needs from them.
#[derive(Debug, Default)]
pub struct RedisRun {
    factories: Vec<Arc<RedisFactory>>,
    sentinel: Option<Arc<SentinelFactory>>,
    cluster: Option<Arc<ClusterFactory>>,
}

impl RedisRun {
    /// Finds servers and adds every Redis trial to `suite`: the conformance
    /// cases as `redis::<case>` (private server) and `redis_env::<case>`
    /// (`REDIS_URL`, when set), `redis_sentinel::<case>` (a private primary,
    /// two replicas and three sentinels), `redis_cluster::<case>` (a private
    /// 3-primary, 3-replica cluster), and the Redis-specific tests as
    /// `redis::<test>` and `redis_cluster::<test>`.
    pub fn register(suite: &mut Suite) -> Self {
        let prefix = format!("lock-test:{}:", suite.run_id());
        let mut run = Self::default();
        match private(&prefix) {
            Ok(factory) => {
                let factory = Arc::new(factory);
                run.factories.push(Arc::clone(&factory));
                suite.add_server_backend(
                    "redis",
                    Availability::Ready(factory.clone() as Arc<dyn BackendFactory>),
                );
                specific::register(suite, &factory);
                inspect::register(suite, &inspect::Deployment::Single(Arc::clone(&factory)));
                let unfenced = Arc::new(factory.without_fencing());
                run.factories.push(Arc::clone(&unfenced));
                inspect::register(suite, &inspect::Deployment::Unfenced(Arc::clone(&unfenced)));
                suite.add_named(unfenced, UNFENCED_CASES);
            }
            Err(why) => suite.add_server_backend("redis", Availability::Missing(why.to_string())),
        }
        if let Some(factory) = from_env(&prefix) {
            let factory = Arc::new(factory);
            run.factories.push(Arc::clone(&factory));
            suite.add_server_backend(
                "redis_env",
                Availability::Ready(factory as Arc<dyn BackendFactory>),
            );
        }
        let sentinel = sentinel_factory(&prefix);
        if let Availability::Ready(f) = &sentinel {
            run.sentinel = Some(Arc::clone(f));
            inspect::register(suite, &inspect::Deployment::Sentinel(Arc::clone(f)));
        }
        suite.add_server_backend(
            "redis_sentinel",
            sentinel.map(|f| f as Arc<dyn BackendFactory>),
        );
        let cluster = cluster_factory(&prefix);
        if let Availability::Ready(f) = &cluster {
            run.cluster = Some(Arc::clone(f));
            cluster_cases::register(suite, f);
            inspect::register(suite, &inspect::Deployment::Cluster(Arc::clone(f)));
        }
        suite.add_server_backend(
            "redis_cluster",
            cluster.map(|f| f as Arc<dyn BackendFactory>),
        );
        if crate::harness::which("redis-server").is_some() {
            suite.push(sentinel_trial(
                "redis_sentinel::replica_refused",
                replica_refused,
            ));
            suite.push(sentinel_trial(
                "redis_sentinel::frozen_sentinel_does_not_stall",
                frozen_sentinel_does_not_stall,
            ));
            suite.push(sentinel_trial("redis_sentinel::replica_ack", replica_ack));
            suite.push(
                sentinel_trial("redis_sentinel::replica_ack_cost", replica_ack_cost)
                    .with_ignored_flag(true),
            );
        }
        run
    }

    /// Checks that no lock key is left under the run's prefix on any server,
    /// waiting up to two TTLs for leases whose release was cut short when a
    /// case ended. The fencing counter (and tick marks) are meant to stay;
    /// they are removed afterwards.
    ///
    /// # Errors
    ///
    /// Lists the leftover keys.
    pub fn check_no_leftover_keys(&self) -> Result<(), BoxError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            for f in &self.factories {
                // Scheduler cases keep per-tick locks as completion marks for
                // their skew tolerance (5 s); those end on their own.
                specific::leftover_keys(f, TTL * 2 + Duration::from_secs(6)).await?;
            }
            // The Sentinel deployment, if a case started it.
            if let Some(set) = self.sentinel.as_ref().and_then(|f| f.started()) {
                let url = format!("redis://127.0.0.1:{}", set.primary_port()?);
                let prefix = self.sentinel.as_ref().map_or("", |f| f.prefix());
                specific::leftover_keys_at(
                    "redis_sentinel",
                    &url,
                    prefix,
                    TTL * 2 + Duration::from_secs(6),
                )
                .await?;
            }
            // The cluster, if a case started it: every primary holds keys.
            if let Some(f) = &self.cluster {
                if let Some(set) = f.started() {
                    for port in set.primaries()? {
                        specific::leftover_keys_at(
                            "redis_cluster",
                            &format!("redis://127.0.0.1:{port}"),
                            f.prefix(),
                            TTL * 2 + Duration::from_secs(6),
                        )
                        .await?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// A trial that runs `body` (which starts its own servers) on a runtime of
/// its own.
fn sentinel_trial<F, Fut>(name: &str, body: F) -> libtest_mimic::Trial
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>>,
{
    libtest_mimic::Trial::test(name, move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(body()).map_err(|e| e.to_string().into())
    })
}

/// A factory over a private server of its own, for cases that pause, kill
/// or partition their server and so must not share it.
///
/// # Errors
///
/// When no server can be started.
pub fn private_factory(prefix: &str) -> Result<RedisFactory, BoxError> {
    private(prefix)
}

/// One factory for tools outside the suite (the benchmark): `REDIS_URL` when
/// set (as `redis_env`), else a private server (as `redis`).
pub fn factory(prefix: &str) -> Availability<Arc<RedisFactory>> {
    if let Some(f) = from_env(prefix) {
        return Availability::Ready(Arc::new(f));
    }
    match private(prefix) {
        Ok(f) => Availability::Ready(Arc::new(f)),
        Err(why) => Availability::Missing(why.to_string()),
    }
}

/// `redis_env`, on the server at `REDIS_URL` when it is set.
fn from_env(prefix: &str) -> Option<RedisFactory> {
    let url = std::env::var(lock_redis::ENV_VAR).ok()?;
    Some(RedisFactory {
        name: "redis_env",
        url,
        prefix: prefix.to_owned(),
        server: Server::External,
        fencing: true,
    })
}

fn private(prefix: &str) -> Result<RedisFactory, BoxError> {
    let server = server::start_plain()?;
    Ok(RedisFactory {
        name: "redis",
        url: format!("redis://127.0.0.1:{}", server.port()),
        prefix: prefix.to_owned(),
        server: Server::Private(server),
        fencing: true,
    })
}

#[cfg(feature = "docker")]
impl RedisRun {
    /// The `docker_redis` factory, on a server in a container (removed with
    /// the run), its keys added to the leftover check.
    ///
    /// # Errors
    ///
    /// When the container cannot be started (no engine, no image).
    pub fn docker_factory(&mut self, run_id: &str) -> Result<Arc<RedisFactory>, BoxError> {
        use crate::harness::docker::{DockerServer, Kind};
        let container = DockerServer::start(Kind::Redis)?;
        let factory = Arc::new(RedisFactory {
            name: "docker_redis",
            url: container.url(),
            prefix: format!("lock-test:{run_id}:docker:"),
            server: Server::Container(container),
            fencing: true,
        });
        self.factories.push(Arc::clone(&factory));
        Ok(factory)
    }
}
