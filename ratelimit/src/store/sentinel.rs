//! Redis behind Sentinel: the `redis+sentinel://` URL form and a link that
//! finds the primary through the sentinels (the `redis` crate's sentinel
//! client) and finds it again after the primary fails, stalls or is demoted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_redis::SentinelUrl;
use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::{StoreError, StoreErrorKind};

/// How long one search for the primary may take: asking the sentinels,
/// checking the named server's `ROLE`, connecting to it.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long after a failed search the next may start: an outage costs the
/// sentinels one search per this interval, not one per request.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// How often the sentinels are asked whether the primary is still the one
/// connected to: a primary demoted by a failover may keep answering as a
/// primary for seconds until the sentinels reconfigure it, and decisions
/// made there are lost.
const RECHECK: Duration = Duration::from_secs(1);

/// A connection that has not answered for this long while calls on it were
/// abandoned (the limiter's timeout dropped them) is presumed stalled: the
/// primary may be frozen while the sentinels promote another.
const STALL: Duration = Duration::from_secs(1);

/// Parses a `redis+sentinel://` URL with lock-redis's parser, so that the
/// limiter and the locks read one URL the same way; `Protocol` errors, the
/// password masked.
pub(crate) fn parse(url: &str) -> Result<SentinelUrl, StoreError> {
    SentinelUrl::parse(url).map_err(|e| StoreError::new(StoreErrorKind::Protocol, e.to_string()))
}

/// Where the link stands.
#[derive(Clone)]
enum Primary {
    /// Not searched for yet, or dropped after an error.
    Unknown,
    /// A search is under way in a task of its own.
    Searching,
    /// Connected to the server the sentinels named, which said it is the
    /// primary; `generation` counts the connections made.
    Ready {
        connection: MultiplexedConnection,
        generation: u64,
        /// `host:port` of the primary.
        addr: String,
    },
    /// The last search failed at `at`.
    Failed { error: StoreError, at: Instant },
}

/// The primary behind the sentinels, shared by every call of one store.
///
/// One search runs at a time, in a spawned task, so a caller dropped by the
/// limiter's timeout never abandons a search half-way; callers wait for its
/// outcome. An error that says the primary may have moved (I/O, timeout,
/// `READONLY`, `MASTERDOWN`, `LOADING`, `TRYAGAIN`, `NOREPLICAS`), a
/// connection that stopped answering while calls on it were abandoned, or
/// sentinels that name another primary when asked again (every second, in
/// the background) drop the connection, and the next call searches again.
pub(crate) struct SentinelLink {
    client: tokio::sync::Mutex<SentinelClient>,
    state: watch::Sender<Primary>,
    /// The last reply on the current connection (generation, instant).
    last_reply: Mutex<(u64, Instant)>,
    /// A check that the sentinels still name the connected primary is
    /// under way.
    checking: AtomicBool,
    /// When the last such check started.
    checked_at: Mutex<Instant>,
    target: String,
}

impl SentinelLink {
    /// A link for `url` (parsed); nothing is contacted yet. `target` names
    /// the deployment in messages, without credentials.
    pub(crate) fn new(url: &SentinelUrl, target: String) -> Result<Self, StoreError> {
        let addrs = url
            .sentinels
            .iter()
            .map(|(h, p)| ConnectionAddr::Tcp(h.clone(), *p));
        let bad = |e: &RedisError| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!("cannot configure the sentinel client for {target}: {e}"),
            )
        };
        let mut builder =
            SentinelClientBuilder::new(addrs, &url.master, SentinelServerType::Master)
                .map_err(|e| bad(&e))?
                .set_client_to_redis_db(url.db);
        if let Some(u) = &url.username {
            builder = builder.set_client_to_redis_username(u);
        }
        if let Some(p) = &url.password {
            builder = builder.set_client_to_redis_password(p);
        }
        let client = builder.build().map_err(|e| bad(&e))?;
        Ok(Self {
            client: tokio::sync::Mutex::new(client),
            state: watch::channel(Primary::Unknown).0,
            last_reply: Mutex::new((0, Instant::now())),
            checking: AtomicBool::new(false),
            checked_at: Mutex::new(Instant::now()),
            target,
        })
    }

    /// A connection to the current primary and its generation, searching
    /// the sentinels first when there is none.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the search runs in its own task and completes whether
    /// or not anyone still waits for it.
    pub(crate) async fn connection(
        self: &Arc<Self>,
    ) -> Result<(MultiplexedConnection, u64), StoreError> {
        let mut seen = self.state.subscribe();
        // Searching -> Ready/Failed, or Unknown -> Searching -> ...: a few
        // rounds at most; the limiter's timeout bounds the waiting.
        for _ in 0..4 {
            let now = seen.borrow_and_update().clone();
            match now {
                Primary::Ready {
                    connection,
                    generation,
                    addr,
                } => {
                    self.maybe_recheck(generation, addr);
                    return Ok((connection, generation));
                }
                Primary::Failed { error, at } if at.elapsed() < RETRY_PAUSE => return Err(error),
                Primary::Searching => {
                    seen.wait_for(|p| !matches!(p, Primary::Searching))
                        .await
                        .map_err(|_| self.closed())?;
                }
                Primary::Unknown | Primary::Failed { .. } => self.start_search()?,
            }
        }
        let last = seen.borrow().clone();
        match last {
            Primary::Ready {
                connection,
                generation,
                ..
            } => Ok((connection, generation)),
            Primary::Failed { error, .. } => Err(error),
            Primary::Unknown | Primary::Searching => Err(StoreError::new(
                StoreErrorKind::Connection,
                format!("the primary of {} is still being searched for", self.target),
            )),
        }
    }

    fn closed(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Connection,
            format!("the link to {} was closed", self.target),
        )
    }

    /// Starts a search unless one runs or a connection is ready.
    fn start_search(self: &Arc<Self>) -> Result<(), StoreError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            StoreError::new(
                StoreErrorKind::Protocol,
                "the Redis Sentinel store needs a Tokio runtime: call it from within one",
            )
        })?;
        let started = self.state.send_if_modified(|p| {
            if matches!(p, Primary::Unknown | Primary::Failed { .. }) {
                *p = Primary::Searching;
                true
            } else {
                false
            }
        });
        if started {
            let link = Arc::clone(self);
            handle.spawn(async move { link.search().await });
        }
        Ok(())
    }

    /// Every [`RECHECK`], in a task of its own, asks the sentinels for the
    /// primary again and drops the connection of `generation` when they
    /// name another server than `addr`.
    fn maybe_recheck(self: &Arc<Self>, generation: u64, addr: String) {
        {
            let mut at = self
                .checked_at
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if at.elapsed() < RECHECK
                || self
                    .checking
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                return;
            }
            *at = Instant::now();
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            self.checking.store(false, Ordering::Release);
            return;
        };
        let link = Arc::clone(self);
        handle.spawn(async move {
            let named = tokio::time::timeout(RESOLVE_TIMEOUT, async {
                link.client.lock().await.async_get_client().await
            })
            .await;
            if let Ok(Ok(client)) = named {
                let now = client.get_connection_info().addr().to_string();
                if now != addr {
                    tracing::debug!(target_deployment = %link.target, old = %addr, new = %now, "rate-limit store: the sentinels name another primary");
                    link.forget(generation);
                }
            }
            link.checking.store(false, Ordering::Release);
        });
    }

    /// Asks the sentinels for the primary, checks its `ROLE` (the `redis`
    /// crate does) and connects, within [`RESOLVE_TIMEOUT`].
    async fn search(&self) {
        let found = tokio::time::timeout(RESOLVE_TIMEOUT, async {
            let client = self.client.lock().await.async_get_client().await?;
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(RESOLVE_TIMEOUT))
                .set_response_timeout(Some(STALL));
            let addr = client.get_connection_info().addr().to_string();
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map(|c| (c, addr))
        })
        .await;
        let next = match found {
            Ok(Ok((connection, addr))) => {
                let generation = {
                    let mut last = self
                        .last_reply
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    *last = (last.0 + 1, Instant::now());
                    last.0
                };
                tracing::debug!(target_deployment = %self.target, generation, "rate-limit store: connected to the primary the sentinels named");
                Primary::Ready {
                    connection,
                    generation,
                    addr,
                }
            }
            Ok(Err(e)) => Primary::Failed {
                error: StoreError::new(
                    StoreErrorKind::Connection,
                    format!(
                        "no primary found through the sentinels of {}: {e}",
                        self.target
                    ),
                ),
                at: Instant::now(),
            },
            Err(_) => Primary::Failed {
                error: StoreError::new(
                    StoreErrorKind::Timeout,
                    format!(
                        "the sentinels of {} named no answering primary within {RESOLVE_TIMEOUT:?}",
                        self.target
                    ),
                ),
                at: Instant::now(),
            },
        };
        self.state.send_replace(next);
    }

    /// Records a reply on the connection of `generation`.
    pub(crate) fn replied(&self, generation: u64) {
        let mut last = self
            .last_reply
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.0 == generation {
            last.1 = Instant::now();
        }
    }

    /// After `e` on the connection of `generation`: drops that connection
    /// when the primary may have moved, so the next call searches again.
    pub(crate) fn failed(&self, generation: u64, e: &RedisError) {
        if primary_may_have_moved(e) {
            self.forget(generation);
        }
    }

    /// A call on the connection of `generation` was abandoned before its
    /// reply: drops the connection when it has not answered for
    /// [`STALL`].
    pub(crate) fn abandoned(&self, generation: u64) {
        let (g, at) = *self
            .last_reply
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if g == generation && at.elapsed() >= STALL {
            self.forget(generation);
        }
    }

    fn forget(&self, generation: u64) {
        self.state.send_if_modified(|p| match p {
            Primary::Ready { generation: g, .. } if *g == generation => {
                tracing::debug!(target_deployment = %self.target, generation, "rate-limit store: asking the sentinels for the primary again");
                *p = Primary::Unknown;
                true
            }
            _ => false,
        });
    }
}

/// Whether after `e` the sentinels should be asked again: the server is
/// gone, stalled, demoted to a replica, not serving, or cut off from its
/// replicas (`NOREPLICAS`, under `min-replicas-to-write`).
fn primary_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.code() == Some("NOREPLICAS")
        || e.code() == Some("READONLY")
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
            )
        )
}

/// Reports an abandoned call to its link when dropped before
/// [`finish`](Self::finish).
pub(crate) struct InFlight<'a> {
    link: &'a SentinelLink,
    generation: u64,
    done: bool,
}

impl<'a> InFlight<'a> {
    pub(crate) fn new(link: &'a SentinelLink, generation: u64) -> Self {
        Self {
            link,
            generation,
            done: false,
        }
    }

    /// The call ended with a reply or an error: reports which.
    pub(crate) fn finish<T>(mut self, result: &Result<T, RedisError>) {
        self.done = true;
        match result {
            Ok(_) => self.link.replied(self.generation),
            Err(e) => self.link.failed(self.generation, e),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.link.abandoned(self.generation);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_as_lock_redis_reads_them() -> Result<(), StoreError> {
        let p = parse("redis+sentinel://u:p%40ss@h1:1,h2,[::1]:3/mymaster/2")?;
        assert_eq!(p.sentinels.len(), 3);
        assert_eq!((p.master.as_str(), p.db), ("mymaster", 2));
        assert_eq!(p.password.as_deref(), Some("p@ss"));
        Ok(())
    }

    #[test]
    fn malformed_sentinel_urls_are_refused_without_the_password() {
        for rest in ["h1:1", "h1:0/m", "h1:1/m?x=1"] {
            let url = format!("redis+sentinel://u:hunter2@{rest}");
            let e = parse(&url).expect_err(rest);
            assert_eq!(e.kind, StoreErrorKind::Protocol, "{e}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
