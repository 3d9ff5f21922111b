//! The Postgres backend's factories: a private server started by the harness
//! (`postgres::<case>`) and the server in `DATABASE_URL` (`postgres_env::<case>`),
//! plus Postgres-specific trials.

mod faults;
mod input;
mod inspect;
mod interop;
mod partition;
mod saboteur;
pub mod server;
mod session_end;
mod sessions;
mod specific;
pub mod standby;
mod standby_refused;
mod tick_tables;
mod waiters;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_postgres::{PostgresBackend, PostgresBuilder, PostgresConfig};

pub(crate) use crate::harness::nft::installed as nft_installed;
pub(crate) use faults::Frozen;
pub(crate) use partition::{client_port, Blackhole};
pub use saboteur::{holder_pid, plain_session, terminate, PgSaboteur};
pub use server::PrivatePostgres;

use crate::harness::{free_port, Availability};
use crate::{BackendFactory, BoxError, Saboteur, Suite, Timing};

/// The statement timeout the cases configure: the longest a call may block.
pub const OP_TIMEOUT: Duration = Duration::from_secs(1);

/// The TTL the cases use; renewal runs every 500 ms.
pub const TTL: Duration = Duration::from_millis(1500);

/// Where a factory's server comes from.
#[derive(Debug, Clone)]
enum Source {
    Env(String),
    Private(Arc<PrivatePostgres>),
    /// A container (the `docker` feature), removed with the factory.
    #[cfg(feature = "docker")]
    Container(Arc<crate::harness::docker::DockerServer>),
}

/// Makes Postgres replicas: each a backend with its own lock session.
#[derive(Debug)]
pub struct PostgresFactory {
    name: &'static str,
    source: Source,
    namespace: String,
    app: String,
    caps: Capabilities,
}

fn random_id() -> String {
    format!("{:08x}", getrandom::u32().unwrap_or(0))
}

impl PostgresFactory {
    fn new(name: &'static str, source: Source, run: &str) -> Self {
        Self {
            name,
            source,
            namespace: format!("ct-{run}-{name}"),
            app: format!("lock-ct-{run}-{name}"),
            // The capabilities do not depend on the server.
            caps: PostgresBackend::new(
                PostgresConfig::builder()
                    .config()
                    .expect("the default configuration is valid"),
            )
            .capabilities(),
        }
    }

    /// The `application_name` of every session this factory opens.
    pub fn application_name(&self) -> &str {
        &self.app
    }

    /// The server's URL (as `postgres`), starting a private server if needed.
    pub fn url(&self) -> Result<String, BoxError> {
        match &self.source {
            Source::Env(url) => Ok(url.clone()),
            Source::Private(p) => Ok(p.get()?.url("postgres")),
            #[cfg(feature = "docker")]
            Source::Container(c) => Ok(c.url()),
        }
    }

    /// The private server, starting it if needed.
    pub fn private_started(&self) -> Result<&server::Started, BoxError> {
        match &self.source {
            Source::Private(p) => p.get(),
            _ => Err("this factory uses DATABASE_URL or a container, not a private server".into()),
        }
    }

    async fn url_async(&self) -> Result<String, BoxError> {
        match &self.source {
            Source::Env(url) => Ok(url.clone()),
            #[cfg(feature = "docker")]
            Source::Container(c) => Ok(c.url()),
            // Starting the server blocks for a few seconds, once per run.
            Source::Private(_) => {
                use tokio::runtime::{Handle, RuntimeFlavor};
                if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
                    tokio::task::block_in_place(|| self.url())
                } else {
                    // block_in_place panics on a current-thread runtime, where
                    // blocking the only thread once is harmless.
                    self.url()
                }
            }
        }
    }

    /// The suite's configuration for `url`.
    pub fn builder_for(&self, url: &str) -> Result<PostgresBuilder, BoxError> {
        Ok(PostgresBuilder::from_url(url)?
            .with_namespace(self.namespace.clone())
            .with_application_name(self.app.clone())
            .with_connect_timeout(Duration::from_secs(3))
            .with_statement_timeout(OP_TIMEOUT)
            .with_max_ttl(Duration::from_secs(2)))
    }

    async fn config(&self) -> Result<PostgresConfig, BoxError> {
        Ok(self.builder_for(&self.url_async().await?)?.config()?)
    }
}

#[async_trait]
impl BackendFactory for PostgresFactory {
    fn connect_url(&self) -> Option<String> {
        self.url().ok()
    }

    fn name(&self) -> &str {
        self.name
    }

    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }

    fn timing(&self) -> Timing {
        Timing {
            ttl: TTL,
            tolerance: Duration::from_millis(400),
            paused_clock: false,
        }
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(
            PostgresBackend::connect(self.config().await?).await?,
        ))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        let url = self.url_async().await?;
        let client = plain_session(&url, &self.app).await?;
        Ok(Box::new(PgSaboteur::new(client, self.config().await?)))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(
            PostgresBackend::connect(self.config().await?).await?,
        )))
    }

    /// The private server's address (starting it if needed); `None` for
    /// `DATABASE_URL`, which the suite must not put a proxy in front of.
    fn server_addr(&self) -> Option<SocketAddr> {
        match &self.source {
            Source::Private(p) => p
                .get()
                .ok()
                .map(|s| SocketAddr::from(([127, 0, 0, 1], s.port()))),
            #[cfg(feature = "docker")]
            Source::Container(c) => Some(SocketAddr::from(([127, 0, 0, 1], c.port()))),
            Source::Env(_) => None,
        }
    }

    async fn replica_via(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<Arc<dyn LockBackend>>, BoxError> {
        let url = format!("postgres://postgres@{addr}/postgres");
        Ok(Some(Arc::new(self.builder_for(&url)?.connect().await?)))
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        let port = free_port().ok()?;
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let config = self.builder_for(&url).ok()?.config().ok()?;
        Some(Arc::new(PostgresBackend::new(config)))
    }
}

/// One factory for tools outside the suite (the benchmark): `DATABASE_URL`
/// when set (as `postgres_env`), else a private server started on first use
/// (as `postgres`).
pub fn factory(run: &str) -> Availability<Arc<PostgresFactory>> {
    if let Ok(url) = std::env::var(lock_postgres::ENV_VAR) {
        return Availability::Ready(Arc::new(PostgresFactory::new(
            "postgres_env",
            Source::Env(url),
            run,
        )));
    }
    match server::bindir() {
        Some(_) => Availability::Ready(Arc::new(PostgresFactory::new(
            "postgres",
            Source::Private(Arc::default()),
            run,
        ))),
        None => Availability::Missing("no Postgres server binary (pg_config --bindir)".into()),
    }
}

/// A factory on a private server of its own, started on first use: the
/// fault suite freezes, cuts and kills its sessions, so it never uses
/// `DATABASE_URL`.
///
/// # Errors
///
/// If there is no Postgres server binary.
pub fn private_factory(run: &str) -> Result<Arc<PostgresFactory>, BoxError> {
    server::bindir().ok_or("no Postgres server binary (pg_config --bindir)")?;
    Ok(Arc::new(PostgresFactory::new(
        "postgres",
        Source::Private(Arc::default()),
        run,
    )))
}

/// Adds every conformance case and the Postgres-specific trials, for the
/// private server and for `DATABASE_URL`.
pub fn register(suite: &mut Suite) {
    let run = random_id();
    let private = match server::bindir() {
        Some(_) => {
            let factory = Arc::new(PostgresFactory::new(
                "postgres",
                Source::Private(Arc::default()),
                &run,
            ));
            let as_dyn: Arc<dyn BackendFactory> = factory.clone();
            suite.add_server_backend("postgres", Availability::Ready(as_dyn));
            Some(factory)
        }
        None => {
            suite.add_server_backend(
                "postgres",
                Availability::Missing("no Postgres server binary (pg_config --bindir)".into()),
            );
            None
        }
    };
    let env = match std::env::var(lock_postgres::ENV_VAR) {
        Ok(url) => {
            let factory = Arc::new(PostgresFactory::new("postgres_env", Source::Env(url), &run));
            let as_dyn: Arc<dyn BackendFactory> = factory.clone();
            suite.add_server_backend("postgres_env", Availability::Ready(as_dyn));
            Some(factory)
        }
        Err(_) => {
            suite.add_server_backend(
                "postgres_env",
                Availability::Missing(format!("{} is not set", lock_postgres::ENV_VAR)),
            );
            None
        }
    };
    if let Some(f) = &private {
        specific::register(suite, f);
    }
    // Last, so every other trial of the run has started before these look.
    for f in private.iter().chain(env.iter()) {
        specific::register_leftover_check(suite, f);
    }
}

/// The `docker_postgres` factory, on a server in a container (removed with
/// the factory), and its leftover check as a trial to run after its cases.
///
/// # Errors
///
/// When the container cannot be started (no engine, no image).
#[cfg(feature = "docker")]
pub fn docker_factory() -> Result<Arc<PostgresFactory>, BoxError> {
    use crate::harness::docker::{DockerServer, Kind};
    let container = DockerServer::start(Kind::Postgres)?;
    Ok(Arc::new(PostgresFactory::new(
        "docker_postgres",
        Source::Container(Arc::new(container)),
        &random_id(),
    )))
}

/// Adds the check that `f`'s sessions and advisory locks are gone once its
/// cases end.
#[cfg(feature = "docker")]
pub fn register_leftover_check(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    specific::register_leftover_check(suite, f);
}
