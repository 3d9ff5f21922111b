//! Server backends: one connection serves both the locks and the tick store.
//!
//! Redis and Postgres backends are built without touching the network
//! (each connects on first use and reconnects after failures, one attempt
//! at a time), then asked once whether their server answers. etcd is
//! connected with a probe (which also measures its minimum lease TTL), and
//! built to connect on first use when the probe cannot reach it. Whether a server that does not answer fails the call is
//! the caller's [`Start`] policy; a server that answers and refuses
//! (credentials, a missing database, TLS) always does, since waiting would
//! not fix it.
//!
//! Building the real backend up front, rather than wrapping a connection
//! made later, keeps what a `Locker` reads when it is built right from the
//! start: the capabilities come from the parsed configuration, and the
//! Postgres loss feed is the one its sessions will report through.

use std::sync::Arc;

use lock_core::redact::redact_url;
use lock_core::{BackendError, LockBackend, TickStore};
use tracing::warn;

use super::{Backend, Start};
use crate::{Error, Result};

/// One connection serves both the locks and the tick store.
fn both<T: LockBackend + TickStore + 'static>(backend: T) -> Backend {
    let shared = Arc::new(backend);
    Backend::new(Arc::clone(&shared) as Arc<dyn LockBackend>, shared)
}

fn failed(backend: &'static str) -> impl Fn(BackendError) -> Error {
    move |source| Error::Connect { backend, source }
}

/// Applies `start` to the answer of the first contact with the server.
fn first_contact(
    start: Start,
    backend: &'static str,
    url: &str,
    answer: std::result::Result<(), BackendError>,
) -> Result<()> {
    match answer {
        Ok(()) => Ok(()),
        Err(e) if start == Start::Deferred && e.kind().is_unavailable() => {
            warn!(
                backend,
                url = %redact_url(url),
                error = %e,
                "the lock server does not answer; starting anyway: every lock attempt fails \
                 closed (ticks are skipped as `unavailable`) until it does"
            );
            Ok(())
        }
        Err(source) => Err(Error::Connect { backend, source }),
    }
}

#[cfg(feature = "redis")]
pub(super) async fn redis(url: &str, start: Start) -> Result<Backend> {
    let backend = lock_redis::RedisBuilder::from_url(url)
        .and_then(lock_redis::RedisBuilder::build)
        .map_err(failed("redis"))?;
    first_contact(start, "redis", url, backend.ping().await)?;
    Ok(both(backend))
}

#[cfg(feature = "postgres")]
pub(super) async fn postgres(url: &str, start: Start) -> Result<Backend> {
    let backend = lock_postgres::PostgresBuilder::from_url(url)
        .and_then(lock_postgres::PostgresBuilder::build)
        .map_err(failed("postgres"))?;
    let answer = backend.session_pid().await.map(drop);
    first_contact(start, "postgres", url, answer)?;
    Ok(both(backend))
}

#[cfg(feature = "etcd")]
pub(super) async fn etcd(url: &str, start: Start) -> Result<Backend> {
    let builder = lock_etcd::EtcdBuilder::from_url(url).map_err(failed("etcd"))?;
    // The probing connect also measures the cluster's minimum lease TTL.
    match builder.clone().connect().await {
        Ok(backend) => Ok(both(backend)),
        Err(e) => {
            first_contact(start, "etcd", url, Err(e))?;
            Ok(both(builder.build().map_err(failed("etcd"))?))
        }
    }
}
