//! A private server of each kind, with the URL a service would be given.

use crate::backends::postgres::PrivatePostgres;
use crate::backends::{etcd, redis};
use crate::harness::ServerProcess;
use crate::BoxError;

/// The server backends the policy is checked on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `redis://`
    Redis,
    /// `postgres://`
    Postgres,
    /// `etcd://`
    Etcd,
}

impl Kind {
    /// Every server backend.
    pub const ALL: [Kind; 3] = [Kind::Redis, Kind::Postgres, Kind::Etcd];

    /// The test-name prefix.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Postgres => "postgres",
            Kind::Etcd => "etcd",
        }
    }
}

/// A private server this test started (and alone stops), and its URL.
#[derive(Debug)]
pub enum Private {
    /// A process the harness started directly.
    Process(ServerProcess),
    /// A private Postgres cluster, whose process is inside.
    Postgres(PrivatePostgres),
}

impl Private {
    /// Starts a server of `kind` on a free loopback port.
    pub fn start(kind: Kind) -> Result<(Self, String), BoxError> {
        match kind {
            Kind::Redis => {
                let server = redis::server::start_plain()?;
                let url = format!("redis://127.0.0.1:{}", server.port());
                Ok((Self::Process(server), url))
            }
            Kind::Etcd => {
                let server = etcd::server::start(etcd::server::ServerTls::default())?;
                let url = format!("etcd://127.0.0.1:{}", server.port());
                Ok((Self::Process(server), url))
            }
            Kind::Postgres => {
                // Its own cluster, not the suite's shared one: this test kills it.
                let cluster = PrivatePostgres::default();
                let url = cluster.get()?.url("postgres");
                Ok((Self::Postgres(cluster), url))
            }
        }
    }

    /// The server process.
    ///
    /// # Errors
    ///
    /// If the Postgres cluster never started.
    pub fn process(&self) -> Result<&ServerProcess, BoxError> {
        match self {
            Self::Process(p) => Ok(p),
            Self::Postgres(cluster) => Ok(cluster.get()?.process()),
        }
    }
}

/// Starts `redis-server` requiring `password`, on a free loopback port.
pub(super) fn redis_with_password(password: &str) -> Result<ServerProcess, BoxError> {
    redis::server::start_with(&["--requirepass", password])
}
