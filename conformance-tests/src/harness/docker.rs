//! Servers in containers, through testcontainers (the `docker` feature), for
//! machines with a Docker engine but without the server binaries. Every
//! container publishes its port on the host's loopback and is removed when
//! its handle drops.

use testcontainers::core::wait::LogWaitStrategy;
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};

use crate::BoxError;

/// Which server a container runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `redis:7`, without persistence.
    Redis,
    /// `postgres:16`, trust authentication for the `postgres` user.
    Postgres,
    /// etcd 3.5 from its project registry, one member.
    Etcd,
}

impl Kind {
    fn port(self) -> u16 {
        match self {
            Self::Redis => 6379,
            Self::Postgres => 5432,
            Self::Etcd => 2379,
        }
    }

    fn scheme(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Postgres => "postgres",
            Self::Etcd => "http",
        }
    }
}

/// A running server container; removed on drop.
pub struct DockerServer {
    kind: Kind,
    port: u16,
    // Held for its drop, which removes the container. Boxed: the handle is
    // large, and factories keep it in an enum beside small variants.
    _container: Box<Container<GenericImage>>,
}

impl std::fmt::Debug for DockerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerServer")
            .field("kind", &self.kind)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl DockerServer {
    /// Starts a `kind` server and waits until it accepts clients.
    ///
    /// # Errors
    ///
    /// When there is no Docker engine, the image cannot be pulled, or the
    /// server does not become ready.
    pub fn start(kind: Kind) -> Result<Self, BoxError> {
        let inner = kind.port();
        let image = match kind {
            Kind::Redis => GenericImage::new("redis", "7")
                .with_exposed_port(inner.tcp())
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_cmd(["redis-server", "--save", "", "--appendonly", "no"]),
            // The entrypoint starts the server twice (once to initialise):
            // the second "ready" is the one that counts.
            Kind::Postgres => GenericImage::new("postgres", "16")
                .with_exposed_port(inner.tcp())
                .with_wait_for(WaitFor::log(
                    LogWaitStrategy::stderr("database system is ready to accept connections")
                        .with_times(2),
                ))
                .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust"),
            Kind::Etcd => GenericImage::new("gcr.io/etcd-development/etcd", "v3.5.17")
                .with_exposed_port(inner.tcp())
                .with_wait_for(WaitFor::message_on_stderr("ready to serve client requests"))
                .with_cmd([
                    "etcd",
                    "--listen-client-urls",
                    "http://0.0.0.0:2379",
                    "--advertise-client-urls",
                    "http://127.0.0.1:2379",
                    "--auto-compaction-retention",
                    "1",
                ]),
        };
        let container = image
            .start()
            .map_err(|e| format!("docker: cannot start a {kind:?} container: {e}"))?;
        let port = container
            .get_host_port_ipv4(inner.tcp())
            .map_err(|e| format!("docker: no published port for {kind:?}: {e}"))?;
        Ok(Self {
            kind,
            port,
            _container: Box::new(container),
        })
    }

    /// The host port the server is published on (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's URL: `redis://…`, `postgres://postgres@…/postgres` or
    /// `http://…` (an etcd endpoint).
    pub fn url(&self) -> String {
        match self.kind {
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{}/postgres", self.port),
            _ => format!("{}://127.0.0.1:{}", self.kind.scheme(), self.port),
        }
    }
}
