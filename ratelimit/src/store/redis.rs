//! The Redis store: one Lua script per decision, on the server's clock.

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use std::sync::Arc;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, Script, Value};

use super::sentinel::{self, InFlight, SentinelLink};
use super::{Store, StoreDecision, StoreRequest};
use crate::error::{StoreError, StoreErrorKind};

/// GCRA over every key of one request, transcribed from
/// [`gcra::decide`](crate::gcra::decide). Times are integer microseconds
/// from `TIME`; TATs are written as decimal integers (`%d`), never through
/// Lua's float formatting. Each key expires when its bucket is full again.
/// ARGV: cost, then interval and capacity per key.
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local allowed = 1
local retry, refused_by = 0, 1
local tats, news = {}, {}
for i = 1, #KEYS do
  local interval = tonumber(ARGV[2 * i])
  local full_at = now + tonumber(ARGV[2 * i + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or now) or now
  if tat < now then tat = now end
  if tat > full_at then tat = full_at end
  local new = tat + cost * interval
  if new > full_at then
    allowed = 0
    if new - full_at > retry then retry = new - full_at; refused_by = i end
  end
  tats[i] = tat
  news[i] = new
end
local remaining, least, resets = -1, 1, {}
for i = 1, #KEYS do
  local after = tats[i]
  if allowed == 1 then after = news[i] end
  local left = math.floor((now + tonumber(ARGV[2 * i + 1]) - after) / tonumber(ARGV[2 * i]))
  if remaining < 0 or left < remaining then remaining = left; least = i end
  resets[i] = after - now
  if allowed == 1 and after > now then
    redis.call('SET', KEYS[i], string.format('%d', after), 'PX', math.ceil((after - now) / 1000))
  end
end
if remaining < 0 then remaining = 0 end
local limiting = least
if allowed == 0 then limiting = refused_by end
return {allowed, string.format('%d', remaining), string.format('%d', retry), string.format('%d', resets[limiting] or 0), limiting - 1, string.format('%d', now)}
";

/// Buckets in Redis, shared by every replica that uses the same server and
/// key prefix.
///
/// Every decision is one `EVALSHA` of a script that reads the server's
/// `TIME`; on `NOSCRIPT` (after `SCRIPT FLUSH` or a restart) the body is
/// loaded and the call repeated, so a flushed script cache never opens the
/// gate. The keys of one request share a hash tag (the hashed subject), so
/// on Redis Cluster they sit in one slot and the script stays atomic.
///
/// It works over any connection of the `redis` crate: a
/// [`ConnectionManager`] ([`connect`](Self::connect) makes one from a URL and
/// reconnects after errors), the primary a set of sentinels names
/// ([`connect_sentinel`](Self::connect_sentinel), found again after a
/// failover), a cluster ([`connect_cluster`](Self::connect_cluster)), or a
/// connection you made ([`with_connection`](Self::with_connection)).
pub struct RedisStore<C = ConnectionManager> {
    connection: Connection<C>,
    script: Script,
}

enum Connection<C> {
    Given(C),
    /// Made at the first decision: the connection manager needs a running
    /// Tokio runtime, which a service may not have yet when it builds its
    /// limiters.
    Url {
        client: Box<redis::Client>,
        manager: OnceLock<ConnectionManager>,
    },
    /// The primary the sentinels name, searched for at the first decision
    /// and again after an error that says it may have moved.
    Sentinel(Arc<SentinelLink>),
    /// Made at the first decision that finds the cluster; a failed attempt
    /// is retried at the next.
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        connection: tokio::sync::OnceCell<ClusterConnection>,
    },
}

impl<C> fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore").finish_non_exhaustive()
    }
}

impl RedisStore<ConnectionManager> {
    /// A store over a reconnecting connection to the server `url` names
    /// (`redis://` or `rediss://`). It may be called outside a Tokio
    /// runtime; the connection is made at the first decision, so a server
    /// that is down at start does not stop the service; its decisions fail until it answers, and the limiter's policy
    /// applies.
    ///
    /// # Errors
    ///
    /// [`StoreError`] (kind `Protocol`) for a URL the `redis` crate cannot
    /// parse; the message never repeats the URL's password.
    pub fn connect(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!(
                    "cannot use Redis URL {}: {}",
                    lock_core::redact::redact_url(url),
                    e.kind_name()
                ),
            )
        })?;
        Ok(Self {
            connection: Connection::Url {
                client: Box::new(client),
                manager: OnceLock::new(),
            },
            script: Script::new(SCRIPT),
        })
    }
}

impl RedisStore<ConnectionManager> {
    /// A store over a Redis Cluster:
    /// `redis+cluster://[user[:password]@]host1[:port1][,host2[:port2]...]`
    /// names the seed nodes (port 6379 unless given). The cluster connection
    /// is made at the first decision and follows `MOVED`/`ASK` redirections.
    ///
    /// # Errors
    ///
    /// [`StoreError`] (kind `Protocol`) for a malformed URL; the message never
    /// repeats the password.
    pub fn connect_cluster(url: &str) -> Result<Self, StoreError> {
        let shown = lock_core::redact::redact_url(url);
        let bad = || {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!("cannot use Redis Cluster URL {shown}: expected redis+cluster://[user[:password]@]host[:port][,host[:port]...]"),
            )
        };
        let rest = url.strip_prefix("redis+cluster://").ok_or_else(bad)?;
        let (credentials, hosts) = match rest.rsplit_once('@') {
            Some((c, h)) => (format!("{c}@"), h),
            None => (String::new(), rest),
        };
        let hosts = hosts.split('/').next().unwrap_or_default();
        let seeds: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{credentials}{h}"))
            .collect();
        if seeds.is_empty() {
            return Err(bad());
        }
        let client = redis::cluster::ClusterClient::new(seeds).map_err(|_| bad())?;
        Ok(Self {
            connection: Connection::Cluster {
                client: Box::new(client),
                connection: tokio::sync::OnceCell::new(),
            },
            script: Script::new(SCRIPT),
        })
    }
}

impl RedisStore<ConnectionManager> {
    /// A store over the primary that a set of Redis Sentinels names:
    /// `redis+sentinel://[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`
    /// (sentinels on port 26379 unless given; the credentials and database
    /// are the primary's, the sentinels are asked without them), the form
    /// lock-redis reads. It may be called outside a Tokio runtime; nothing
    /// is contacted until the first decision.
    ///
    /// The sentinels are asked through the `redis` crate's sentinel client,
    /// which checks that the server they name answers `ROLE` as a primary.
    /// After an I/O error, a timeout, `READONLY` (the server was demoted),
    /// `MASTERDOWN`, `LOADING`, `TRYAGAIN` or `NOREPLICAS`, or once calls
    /// abandoned by the limiter's timeout show the primary has not answered
    /// for a second (frozen), the sentinels are asked again, by one
    /// background search at a time (at most every 100 ms while they name no
    /// answering primary). While connected, the sentinels are also asked
    /// every second, in the background, whether they still name this
    /// primary: after `SENTINEL FAILOVER` the old primary keeps answering as
    /// a primary for seconds until the sentinels demote it. Decisions thus
    /// move to the new primary within about a second of a failover.
    /// Replication is asynchronous and what the old primary admits after
    /// the promotion never reaches the new one, so across a failover a
    /// limit may admit again what it admitted meanwhile: up to about a
    /// second of its rate, and never more than one burst (the bucket's
    /// capacity), since a bucket's state holds no more than that.
    ///
    /// # Errors
    ///
    /// [`StoreError`] (kind `Protocol`) for a malformed URL; the message
    /// never repeats the password.
    pub fn connect_sentinel(url: &str) -> Result<Self, StoreError> {
        let parsed = sentinel::parse(url)?;
        let target = parsed.shown();
        Ok(Self {
            connection: Connection::Sentinel(Arc::new(SentinelLink::new(&parsed, target)?)),
            script: Script::new(SCRIPT),
        })
    }
}

impl<C: Clone> RedisStore<C> {
    /// The connection to send the next call on.
    async fn connection(&self) -> Result<Either<C>, StoreError> {
        match &self.connection {
            Connection::Sentinel(link) => {
                let (c, generation) = link.connection().await?;
                Ok(Either::Sentinel(c, generation, Arc::clone(link)))
            }
            Connection::Cluster { client, connection } => {
                let c = connection
                    .get_or_try_init(|| client.get_async_connection())
                    .await
                    .map_err(|e| map_error(&e))?;
                Ok(Either::Cluster(c.clone()))
            }
            Connection::Given(c) => Ok(Either::Given(c.clone())),
            Connection::Url { client, manager } => {
                if let Some(m) = manager.get() {
                    return Ok(Either::Manager(m.clone()));
                }
                // No retries inside a call: the limiter's timeout and
                // breaker decide how long a request waits, and the manager
                // reconnects in the background.
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(0)
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)));
                let made = ConnectionManager::new_lazy_with_config((**client).clone(), config)
                    .map_err(|e| map_error(&e))?;
                Ok(Either::Manager(manager.get_or_init(|| made).clone()))
            }
        }
    }
}

enum Either<C> {
    Given(C),
    Manager(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(MultiplexedConnection, u64, Arc<SentinelLink>),
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store over `connection` (a cluster connection, or one a Sentinel
    /// client resolved).
    #[must_use]
    pub fn with_connection(connection: C) -> Self {
        Self {
            connection: Connection::Given(connection),
            script: Script::new(SCRIPT),
        }
    }
}

trait KindName {
    fn kind_name(&self) -> &'static str;
}

impl KindName for RedisError {
    fn kind_name(&self) -> &'static str {
        if self.is_io_error() {
            "I/O error"
        } else {
            "invalid URL or option"
        }
    }
}

fn map_error(e: &RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        StoreErrorKind::Timeout
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        StoreErrorKind::Connection
    } else if matches!(e.kind(), ErrorKind::Server(_)) {
        StoreErrorKind::Server
    } else {
        StoreErrorKind::Protocol
    };
    StoreError::new(kind, e.to_string())
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

#[async_trait]
impl<C> Store for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        for key in request.keys {
            invocation.key(key.as_str());
        }
        invocation.arg(request.cost);
        for cell in request.cells {
            invocation.arg(cell.interval).arg(cell.capacity);
        }
        let reply: Vec<Value> = match self.connection().await? {
            Either::Given(mut c) => invocation.invoke_async(&mut c).await,
            Either::Manager(mut m) => invocation.invoke_async(&mut m).await,
            Either::Cluster(mut c) => invocation.invoke_async(&mut c).await,
            Either::Sentinel(mut c, generation, link) => {
                // Tells the link about the reply, the error, or a call
                // dropped before either (the limiter's timeout).
                let call = InFlight::new(&link, generation);
                let result = invocation.invoke_async(&mut c).await;
                call.finish(&result);
                result
            }
        }
        .map_err(|e| map_error(&e))?;
        let bad = || StoreError::new(StoreErrorKind::Protocol, "unexpected script reply");
        let field = |i: usize| reply.get(i).and_then(int).ok_or_else(bad);
        Ok(StoreDecision {
            allowed: field(0)? == 1,
            remaining: field(1)?,
            retry_after_us: field(2)?,
            reset_after_us: field(3)?,
            limiting: usize::try_from(field(4)?).map_err(|_| bad())?,
            now_us: field(5)?,
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}
