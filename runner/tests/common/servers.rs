//! The server backends the tests run against: the shared Redis and
//! Postgres, a private etcd per test (stopped when the guard drops).

use std::time::{Duration, Instant};

use conformance_tests::backends::etcd::server;
use conformance_tests::harness::ServerProcess;

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A server backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Postgres,
    Etcd,
}

/// A backend ready for runners: its URL, and the private server if any.
pub struct Server {
    pub backend: Backend,
    pub url: String,
    /// The etcd client endpoint (`127.0.0.1:PORT`) for etcdctl.
    pub endpoint: Option<String>,
    _etcd: Option<ServerProcess>,
}

impl Backend {
    pub fn label(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Postgres => "postgres",
            Self::Etcd => "etcd",
        }
    }

    /// The backend's server, ready to serve.
    pub fn server(self) -> Server {
        match self {
            Self::Redis => Server {
                backend: self,
                url: redis_url(),
                endpoint: None,
                _etcd: None,
            },
            Self::Postgres => Server {
                backend: self,
                url: database_url(),
                endpoint: None,
                _etcd: None,
            },
            Self::Etcd => {
                let etcd = server::start(server::ServerTls::default()).expect("a private etcd");
                let endpoint = format!("127.0.0.1:{}", etcd.port());
                let ready = Instant::now();
                let put = ["--endpoints", &endpoint, "put", "/ready", "1"];
                while !super::run_bounded("etcdctl", &put, Duration::from_secs(5))
                    .is_some_and(|o| o.status.success())
                {
                    assert!(
                        ready.elapsed() < Duration::from_secs(20),
                        "etcd never became ready"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
                Server {
                    backend: self,
                    url: format!("etcd://{endpoint}"),
                    endpoint: Some(endpoint),
                    _etcd: Some(etcd),
                }
            }
        }
    }
}
