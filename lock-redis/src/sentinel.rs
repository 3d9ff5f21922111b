//! Sentinel: the `redis+sentinel://` URL form and the resolver that asks
//! the sentinels where the primary is.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lock_core::BackendError;
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};
use tracing::debug;

use crate::error::{config, from_redis, timed_out};
use crate::nodes::parse_authority;

/// The port sentinels listen on unless the URL says otherwise.
const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// Where the sentinels are and which primary (by its Sentinel name) to use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SentinelSpec {
    pub(crate) nodes: Vec<(String, u16)>,
    pub(crate) master: String,
}

impl SentinelSpec {
    /// `h1:p1,h2:p2/<master>`: the sentinels and the name, no credentials.
    pub(crate) fn shown(&self) -> String {
        format!("{}/{}", crate::nodes::shown(&self.nodes), self.master)
    }
}

/// A `redis+sentinel://` URL taken apart: the sentinels, the name of the
/// primary they watch, the database and the credentials.
///
/// [`RedisBuilder::from_url`](crate::RedisBuilder::from_url) reads the same
/// form; a crate that speaks to the same deployment for another purpose (a
/// rate limiter's store) parses its URL here, so that one URL means the
/// same servers to both. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SentinelUrl {
    /// The sentinels' hosts and ports, in the URL's order (26379 where the
    /// URL gives no port).
    pub sentinels: Vec<(String, u16)>,
    /// The name the sentinels know the primary by.
    pub master: String,
    /// The database to select on the primary (0 unless the URL says).
    pub db: i64,
    /// The user name for the primary, percent-decoded.
    pub username: Option<String>,
    /// The password for the primary, percent-decoded.
    pub password: Option<String>,
}

impl SentinelUrl {
    /// Parses
    /// `redis+sentinel://[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`.
    ///
    /// Query parameters are refused here; `RedisBuilder::from_url` takes
    /// its own (`replica_ack`) off before it parses the rest.
    ///
    /// # Errors
    ///
    /// A configuration error naming what is malformed; the message shows
    /// the URL with its password masked.
    pub fn parse(url: &str) -> Result<Self, BackendError> {
        let shown = lock_core::redact::redact_url(url);
        let rest = url.strip_prefix("redis+sentinel://").ok_or_else(|| {
            config(format!(
                "malformed Redis Sentinel URL {shown}: expected the scheme redis+sentinel://"
            ))
        })?;
        parse(rest, &shown)
    }

    /// `redis+sentinel://h1:p1,h2:p2/<master>`: where the deployment is,
    /// without credentials or database, for messages.
    pub fn shown(&self) -> String {
        format!(
            "redis+sentinel://{}/{}",
            crate::nodes::shown(&self.sentinels),
            self.master
        )
    }

    /// The sentinels and the primary's name, as the resolver wants them.
    pub(crate) fn spec(&self) -> SentinelSpec {
        SentinelSpec {
            nodes: self.sentinels.clone(),
            master: self.master.clone(),
        }
    }
}

impl std::fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("sentinels", &self.sentinels)
            .field("master", &self.master)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

/// Parses what follows `redis+sentinel://`:
/// `[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`.
/// `shown` is the URL with its credentials masked, for messages.
pub(crate) fn parse(rest: &str, shown: &str) -> Result<SentinelUrl, BackendError> {
    let bad = |why: &str| config(format!("malformed Redis Sentinel URL {shown}: {why}"));
    if rest.contains('?') {
        return Err(bad("query parameters are not supported"));
    }
    let (authority, path) = rest
        .split_once('/')
        .ok_or_else(|| bad("expected /<master-name> after the sentinels"))?;
    let parsed = parse_authority(authority, DEFAULT_SENTINEL_PORT, "sentinel", &bad)?;
    let mut segments = path.split('/');
    let master = segments.next().unwrap_or_default();
    if master.is_empty() {
        return Err(bad("the master name after the sentinels is missing"));
    }
    let db = match segments.next() {
        None | Some("") => 0,
        Some(db) => db
            .parse::<i64>()
            .ok()
            .filter(|d| *d >= 0)
            .ok_or_else(|| bad("the database after the master name must be a number"))?,
    };
    if segments.next().is_some() {
        return Err(bad("expected /<master-name>[/db] and nothing after"));
    }
    Ok(SentinelUrl {
        sentinels: parsed.nodes,
        master: master.to_owned(),
        db,
        username: parsed.username,
        password: parsed.password,
    })
}

/// Finds the current primary through the sentinels.
pub(crate) struct Resolver {
    spec: SentinelSpec,
    settings: RedisConnectionInfo,
    connect_timeout: Duration,
    target: String,
}

impl Resolver {
    pub(crate) fn new(
        spec: SentinelSpec,
        settings: RedisConnectionInfo,
        connect_timeout: Duration,
        target: String,
    ) -> Self {
        Self {
            spec,
            settings,
            connect_timeout,
            target,
        }
    }

    /// A client for the primary that the sentinels name, asking all of them
    /// at once (each within the connect timeout) and trusting, among the
    /// first majority to answer (or all that answer), the answer with the
    /// highest configuration epoch: during a failover a sentinel that has
    /// not heard of it yet still names the old primary.
    ///
    /// The primary is not contacted here; callers check its role.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub(crate) async fn primary(&self) -> Result<redis::Client, BackendError> {
        let asks = self.spec.nodes.iter().map(|(host, port)| async move {
            let answer =
                tokio::time::timeout(self.connect_timeout, ask(host, *port, &self.spec.master))
                    .await;
            match answer {
                Ok(Ok(found)) => Ok(found),
                Ok(Err(e)) => Err(from_redis(
                    e,
                    "ask a sentinel for the primary",
                    &format!("sentinel {host}:{port}"),
                )),
                Err(_) => Err(timed_out(
                    "ask a sentinel for the primary",
                    &format!("sentinel {host}:{port}"),
                    self.connect_timeout,
                )),
            }
        });
        let mut asks: FuturesUnordered<_> = asks.collect();
        // A majority's answers are enough: a sentinel that is frozen or cut
        // off must not hold up every reconnect for its whole timeout.
        let majority = self.spec.nodes.len() / 2 + 1;
        let mut answered = 0;
        let mut best: Option<(u64, String, u16)> = None;
        let mut last_error = None;
        while let Some(answer) = asks.next().await {
            if answer.is_ok() {
                answered += 1;
            }
            match answer {
                Ok(Some((epoch, host, port))) => {
                    if best.as_ref().is_none_or(|(e, _, _)| epoch > *e) {
                        best = Some((epoch, host, port));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    debug!(error = %e, "a sentinel did not answer");
                    last_error = Some(e);
                }
            }
            if answered >= majority && best.is_some() {
                break;
            }
        }
        let Some((epoch, host, port)) = best else {
            return Err(match last_error {
                Some(e) => BackendError::new(
                    e.kind(),
                    format!(
                        "no sentinel of {} named a primary: {}",
                        self.target,
                        e.message()
                    ),
                ),
                None => BackendError::unavailable(format!(
                    "no sentinel of {} names a primary {:?} that is up",
                    self.target, self.spec.master
                )),
            });
        };
        debug!(primary = %format!("{host}:{port}"), epoch, "sentinels named the primary");
        let info = ConnectionAddr::Tcp(host, port)
            .into_connection_info()
            .map_err(|e| config(format!("invalid primary address from the sentinels: {e}")))?
            .set_redis_settings(self.settings.clone());
        redis::Client::open(info)
            .map_err(|e| config(format!("cannot configure a client for the primary: {e}")))
    }
}

/// `(config-epoch, ip, port)` of the primary one sentinel knows by `name`,
/// or `None` when it does not monitor that name or deems it down.
async fn ask(host: &str, port: u16, name: &str) -> redis::RedisResult<Option<(u64, String, u16)>> {
    let client = redis::Client::open(ConnectionAddr::Tcp(host.to_owned(), port))?;
    let mut c = client.get_multiplexed_async_connection().await?;
    let fields: HashMap<String, String> = match redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(name)
        .query_async(&mut c)
        .await
    {
        Ok(f) => f,
        Err(e) if e.code() == Some("ERR") => return Ok(None),
        Err(e) => return Err(e),
    };
    let flags = fields.get("flags").map_or("", String::as_str);
    if flags.contains("o_down") {
        return Ok(None);
    }
    let epoch = fields
        .get("config-epoch")
        .and_then(|e| e.parse().ok())
        .unwrap_or(0);
    let ip = fields.get("ip").cloned();
    let port = fields.get("port").and_then(|p| p.parse().ok());
    Ok(ip.zip(port).map(|(ip, port)| (epoch, ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_names_and_databases_parse() -> Result<(), BackendError> {
        let p = parse("u:p%40ss@h1:1,h2,[::1]:3/mymaster/2", "x")?;
        assert_eq!(
            p.sentinels,
            vec![
                ("h1".to_owned(), 1),
                ("h2".to_owned(), DEFAULT_SENTINEL_PORT),
                ("::1".to_owned(), 3)
            ]
        );
        assert_eq!(p.master, "mymaster");
        assert_eq!(p.db, 2);
        assert_eq!(p.username.as_deref(), Some("u"));
        assert_eq!(p.password.as_deref(), Some("p@ss"));
        assert_eq!(p.spec().shown(), "h1:1,h2:26379,[::1]:3/mymaster");
        assert_eq!(p.shown(), "redis+sentinel://h1:1,h2:26379,[::1]:3/mymaster");
        assert!(!format!("{p:?}").contains("p@ss"), "{p:?}");
        assert_eq!(
            SentinelUrl::parse("redis+sentinel://u:p%40ss@h1:1,h2,[::1]:3/mymaster/2")?,
            p
        );
        let q = parse("h1:1/m", "x")?;
        assert_eq!((q.db, q.username, q.password), (0, None, None));
        Ok(())
    }

    #[test]
    fn malformed_sentinel_urls_are_refused() {
        for rest in [
            "h1:1",
            "h1:1/",
            "h1:x/m",
            "h1:1,,h2:2/m",
            "h1:1/m/notadb",
            "h1:1/m/1/extra",
            "h1:1/m?x=1",
            "[::1:1/m",
        ] {
            assert!(parse(rest, "shown").is_err(), "{rest}");
            let url = format!("redis+sentinel://u:hunter2@{rest}");
            let e = SentinelUrl::parse(&url).expect_err(rest);
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
        assert!(SentinelUrl::parse("redis://h1:1/m").is_err());
    }
}
