//! The etcd backend's factory: `ETCD_ENDPOINTS` when set, else a private
//! etcd started from `PATH`; plus the etcd-specific trials.

pub mod cluster;
pub(crate) mod cluster_factory;
mod cluster_frozen;
mod inspect;
pub(crate) mod leader;
mod saboteur;
pub mod server;
mod specific;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{backend::Expiry, Capabilities, LockBackend, TickStore};
use lock_etcd::{EtcdBackend, EtcdBuilder};

use crate::harness::{which, Availability, ServerProcess};
use crate::{BackendFactory, BoxError, Saboteur, Timing};

pub use cluster_factory::{cluster_factory, DeploymentFactory, EtcdClusterFactory, EtcdDeployment};
pub use cluster_frozen::add_cluster_specific;
pub use saboteur::EtcdSaboteur;
pub use specific::add_specific;

/// The TTL cases use on private servers: twice their 1 s minimum, so
/// `retain_for(ttl / 2)` is still a valid lease.
const TTL: Duration = Duration::from_secs(2);

/// The TTL on a cluster from `ETCD_ENDPOINTS`, twice the 2 s minimum of
/// etcd's default election timeout.
const ENV_TTL: Duration = Duration::from_secs(4);

/// Where the factory's server comes from.
enum Source {
    /// Endpoints from `ETCD_ENDPOINTS`.
    Env(EtcdBuilder),
    /// A private server, started on first use so that filtered runs that
    /// skip etcd do not pay for it.
    Private(OnceLock<Result<Arc<ServerProcess>, String>>),
    /// A container (the `docker` feature), removed with the factory.
    #[cfg(feature = "docker")]
    Container(Arc<crate::harness::docker::DockerServer>),
}

/// Replicas are separate `EtcdBackend` connections to one cluster.
pub struct EtcdFactory {
    name: &'static str,
    source: Source,
}

impl std::fmt::Debug for EtcdFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdFactory")
            .field("name", &self.name)
            .finish()
    }
}

/// The factory for this run: `etcd_env` over `ETCD_ENDPOINTS` when it is
/// set, else `etcd` over a private server, else missing.
pub fn factory() -> Availability<Arc<dyn BackendFactory>> {
    find().map(|f| f as Arc<dyn BackendFactory>)
}

/// [`factory`], as the concrete type (for its endpoints).
pub fn find() -> Availability<Arc<EtcdFactory>> {
    if std::env::var_os(lock_etcd::ENV_VAR).is_some() {
        return match EtcdBuilder::from_env() {
            Ok(b) => Availability::Ready(Arc::new(EtcdFactory {
                name: "etcd_env",
                source: Source::Env(b),
            })),
            Err(e) => Availability::Missing(e.to_string()),
        };
    }
    match which("etcd") {
        Some(_) => Availability::Ready(Arc::new(EtcdFactory::private())),
        None => Availability::Missing("etcd is not on PATH and ETCD_ENDPOINTS is unset".into()),
    }
}

impl EtcdFactory {
    /// A factory over a server in a container, as `docker_etcd` (the
    /// `docker` feature); the container is removed with the factory.
    ///
    /// # Errors
    ///
    /// When the container cannot be started (no engine, no image).
    #[cfg(feature = "docker")]
    pub fn docker() -> Result<Self, BoxError> {
        use crate::harness::docker::{DockerServer, Kind};
        Ok(Self {
            name: "docker_etcd",
            source: Source::Container(Arc::new(DockerServer::start(Kind::Etcd)?)),
        })
    }

    /// A factory over its own private server, started on first use.
    pub fn private() -> Self {
        Self {
            name: "etcd",
            source: Source::Private(OnceLock::new()),
        }
    }

    /// A factory over an already running server.
    pub fn over(server: Arc<ServerProcess>) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(Ok(server));
        Self {
            name: "etcd",
            source: Source::Private(cell),
        }
    }

    /// A builder for this factory's cluster.
    pub fn builder(&self) -> Result<EtcdBuilder, BoxError> {
        match &self.source {
            Source::Env(b) => Ok(b.clone()),
            #[cfg(feature = "docker")]
            Source::Container(c) => Ok(server::builder(c.port())),
            Source::Private(cell) => {
                let server = cell
                    .get_or_init(|| {
                        server::start(server::ServerTls::default())
                            .map(Arc::new)
                            .map_err(|e| e.to_string())
                    })
                    .as_ref()
                    .map_err(|e| format!("private etcd: {e}"))?;
                Ok(server::builder(server.port()))
            }
        }
    }

    /// The cluster's endpoints as URLs, for plain clients (the saboteur).
    pub fn endpoints(&self) -> Result<Vec<String>, BoxError> {
        match &self.source {
            Source::Env(_) => {
                let raw = std::env::var(lock_etcd::ENV_VAR)?;
                let list = raw
                    .trim_start_matches("etcd://")
                    .split(',')
                    .map(|e| e.trim().trim_end_matches('/'))
                    .filter(|e| !e.is_empty())
                    .map(|e| {
                        if e.contains("://") {
                            e.to_owned()
                        } else {
                            format!("http://{e}")
                        }
                    })
                    .collect();
                Ok(list)
            }
            #[cfg(feature = "docker")]
            Source::Container(c) => Ok(vec![c.url()]),
            Source::Private(_) => {
                self.builder()?;
                match &self.source {
                    Source::Private(cell) => match cell.get() {
                        Some(Ok(server)) => Ok(vec![format!("http://127.0.0.1:{}", server.port())]),
                        _ => Err("private etcd did not start".into()),
                    },
                    _ => Err("unreachable".into()),
                }
            }
        }
    }

    /// A connected backend; waits for a freshly started server to elect itself.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`server::connect_when_ready`].
    pub async fn connect(&self) -> Result<EtcdBackend, BoxError> {
        server::connect_when_ready(self.builder()?).await
    }

    /// A backend as [`EtcdFactory::connect`] makes, and a saboteur of its
    /// own client beside it, under the library's default key prefix.
    pub async fn connect_with_saboteur(&self) -> Result<(EtcdBackend, EtcdSaboteur), BoxError> {
        let backend = self.connect().await?;
        let saboteur = EtcdSaboteur::connect_default(&self.endpoints()?).await?;
        Ok((backend, saboteur))
    }
}

#[async_trait]
impl BackendFactory for EtcdFactory {
    fn connect_url(&self) -> Option<String> {
        let first = self.endpoints().ok()?.into_iter().next()?;
        Some(first.replacen("http://", "etcd://", 1))
    }

    fn name(&self) -> &str {
        self.name
    }

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    fn timing(&self) -> Timing {
        let ttl = match self.source {
            Source::Env(_) => ENV_TTL,
            // The container runs with the private servers' raft timings.
            #[cfg(feature = "docker")]
            Source::Container(_) => TTL,
            Source::Private(_) => TTL,
        };
        Timing {
            ttl,
            // etcd's leader checks for expired leases every 500 ms, and a
            // loaded 2-core machine adds scheduling delay on top.
            tolerance: Duration::from_millis(700),
            paused_clock: false,
        }
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        Ok(Box::new(
            EtcdSaboteur::connect_default(&self.endpoints()?).await?,
        ))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.connect().await?)))
    }

    fn server_addr(&self) -> Option<SocketAddr> {
        // Starts the private server if no replica has yet.
        self.builder().ok()?;
        self.server_process()
            .map(|p| SocketAddr::from((Ipv4Addr::LOCALHOST, p.port())))
    }

    async fn replica_via(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<Arc<dyn LockBackend>>, BoxError> {
        if !addr.ip().is_loopback() {
            return Err(format!("the proxy must be on loopback, not {addr}").into());
        }
        let backend = server::connect_when_ready(server::builder(addr.port())).await?;
        Ok(Some(Arc::new(backend)))
    }

    fn server_process(&self) -> Option<&ServerProcess> {
        match &self.source {
            Source::Private(cell) => match cell.get() {
                Some(Ok(server)) => Some(server),
                _ => None,
            },
            _ => None,
        }
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        server::unreachable()
    }
}

/// What every connected etcd replica reports, one member or a cluster;
/// min_ttl is measured per cluster at connect, and the suite's TTL is well
/// above it.
pub(super) fn capabilities() -> Capabilities {
    Capabilities::new(Expiry::Ttl)
        .with_fencing(true)
        .with_batch_renew(true)
        .with_release_notify(true)
        .with_min_ttl(Duration::from_secs(1))
        .with_loss_push(true)
}
