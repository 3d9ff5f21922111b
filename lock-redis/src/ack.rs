//! Replica acknowledgement: writes that count only once enough replicas
//! have them.
//!
//! Redis replicates asynchronously, so a lock (or a fencing-counter
//! increment) the primary confirmed may be missing on the replica that a
//! failover promotes. With [`ReplicaAck`] on, every acquire and renewal is
//! followed by `WAIT <replicas> <timeout>` in the same pipeline on the same
//! connection, and counts only if enough replicas acknowledged it.
//!
//! The script goes as `EVAL` with its body, not `EVALSHA`: after a
//! `NOSCRIPT` the retry would cost a second `WAIT`. Script and `WAIT` are
//! one pipeline on one connection, so a reconnect between them fails the
//! pipeline rather than counting acknowledgements for a connection that
//! wrote nothing.

use std::time::Duration;

use lock_core::backend::{AcquireAttempt, Lease, LeaseStatus};
use lock_core::{BackendError, Identity, LockName, OwnerToken};
use redis::{FromRedisValue, RedisError};

use crate::backend::{status, Shared};
use crate::connection::Connection;
use crate::error::{config, protocol};
use crate::scripts::{Lua, ACQUIRE, ACQUIRE_UNFENCED, RELEASE, RENEW, RENEW_MANY};

/// The URL parameter naming how many replicas must acknowledge.
const PARAM_REPLICAS: &str = "replica_ack";
/// The URL parameter bounding the wait for them.
const PARAM_TIMEOUT: &str = "replica_ack_timeout";
/// The timeout when the URL names replicas but no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);

/// How many replicas must acknowledge each acquire and renewal, and how long
/// to wait for them. Set with
/// [`RedisBuilder::with_replica_ack`](crate::RedisBuilder::with_replica_ack)
/// or `?replica_ack=N&replica_ack_timeout=200ms` in the URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaAck {
    replicas: u8,
    timeout: Duration,
}

impl ReplicaAck {
    /// The longest acknowledgement timeout accepted. While a `WAIT` blocks,
    /// every other call on the backend's connection waits behind it.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(10);

    /// Asks for `replicas` acknowledgements within `timeout`.
    ///
    /// # Errors
    ///
    /// A [`Config`](lock_core::BackendErrorKind::Config) error for 0
    /// replicas, a zero timeout, or a timeout above [`Self::MAX_TIMEOUT`]
    /// (`Duration::MAX` included).
    pub fn new(replicas: u8, timeout: Duration) -> Result<Self, BackendError> {
        if replicas == 0 {
            return Err(config(
                "replica acknowledgement needs 1 to 255 replicas, got 0 (leave it off instead)",
            ));
        }
        if timeout.is_zero() || timeout > Self::MAX_TIMEOUT {
            return Err(config(format!(
                "the replica acknowledgement timeout must be above zero and at most {:?}, got {timeout:?}",
                Self::MAX_TIMEOUT
            )));
        }
        Ok(Self { replicas, timeout })
    }

    /// How many replicas must acknowledge.
    pub fn replicas(&self) -> u8 {
        self.replicas
    }

    /// How long to wait for them.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The timeout in whole milliseconds, rounded up and at least 1: `WAIT`
    /// with 0 would block forever.
    fn timeout_ms(&self) -> u128 {
        self.timeout.as_nanos().div_ceil(1_000_000).max(1)
    }
}

/// Removes `replica_ack` and `replica_ack_timeout` from the URL's query and
/// returns the URL without them, and the acknowledgement they ask for.
/// `shown` is the URL with its credentials masked, for messages.
pub(crate) fn take_url_params(
    url: &str,
    shown: &str,
) -> Result<(String, Option<ReplicaAck>), BackendError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    let (mut replicas, mut timeout) = (None, None);
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some((PARAM_REPLICAS, v)) => {
                let n = v.parse::<u8>().map_err(|_| {
                    config(format!(
                        "{PARAM_REPLICAS}={v:?} in {shown}: expected a number of replicas from 1 to 255"
                    ))
                })?;
                replicas = Some(n);
            }
            Some((PARAM_TIMEOUT, v)) => {
                timeout = Some(parse_duration(v).ok_or_else(|| {
                    config(format!(
                        "{PARAM_TIMEOUT}={v:?} in {shown}: expected a duration such as 200ms or 2s (at most 10s)"
                    ))
                })?);
            }
            _ => kept.push(pair),
        }
    }
    let ack = match (replicas, timeout) {
        (None, None) => None,
        (None, Some(_)) => {
            return Err(config(format!(
                "{PARAM_TIMEOUT} without {PARAM_REPLICAS} in {shown}: add {PARAM_REPLICAS}=N"
            )))
        }
        (Some(n), t) => Some(ReplicaAck::new(n, t.unwrap_or(DEFAULT_TIMEOUT))?),
    };
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, ack))
}

/// `200ms` or `2s`: whole milliseconds or seconds.
fn parse_duration(text: &str) -> Option<Duration> {
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok().map(Duration::from_millis);
    }
    text.strip_suffix('s')?
        .parse()
        .ok()
        .map(Duration::from_secs)
}

/// Acquires `name` for `ms` milliseconds and waits for the replicas; with
/// too few acknowledgements it releases the lock again and fails.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped call may leave a lock to its TTL, as a plain
/// acquire may.
pub(crate) async fn acquire(
    shared: &Shared,
    ack: &ReplicaAck,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
    holder: Option<&Identity>,
) -> Result<AcquireAttempt, BackendError> {
    let conn = &shared.conn;
    let (key, meta, token) = (
        shared.keys.lock(name),
        shared.keys.meta(name),
        owner.to_hex(),
    );
    let identity = holder.map_or_else(String::new, |h| h.as_str().to_owned());
    let args = [token.clone(), ms.to_string(), identity];
    let (got, acked): (i64, u64) = if shared.fencing {
        let keys = [key.clone(), shared.keys.fence_for(name), meta.clone()];
        eval_and_wait(conn, ack, "acquire", &ACQUIRE, &keys, &args).await?
    } else {
        let keys = [key.clone(), meta.clone()];
        eval_and_wait(conn, ack, "acquire", &ACQUIRE_UNFENCED, &keys, &args).await?
    };
    match u64::try_from(got) {
        Ok(0) => Ok(AcquireAttempt::HeldElsewhere),
        Ok(_) if acked < u64::from(ack.replicas) => {
            let channel = shared.keys.channel(name);
            Err(refuse_acquire(conn, ack, acked, [key, meta], channel, token).await)
        }
        Ok(_) if !shared.fencing => Ok(AcquireAttempt::Acquired(Lease::new(None))),
        Ok(fence) => Ok(AcquireAttempt::Acquired(Lease::new(Some(fence)))),
        Err(_) => Err(protocol("acquire", conn.target(), got)),
    }
}

/// Renews `name` for `ms` milliseconds and waits for the replicas; an
/// extension too few acknowledge is an error, so the local deadline stays.
///
/// # Cancel safety
///
/// Not cancel safe, as a plain renewal: the TTL may have moved unseen.
pub(crate) async fn renew(
    shared: &Shared,
    ack: &ReplicaAck,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
) -> Result<LeaseStatus, BackendError> {
    let conn = &shared.conn;
    let keys = [shared.keys.lock(name), shared.keys.meta(name)];
    let args = [owner.to_hex(), ms.to_string()];
    let (code, acked): (i64, u64) = eval_and_wait(conn, ack, "renew", &RENEW, &keys, &args).await?;
    if code == 1 && acked < u64::from(ack.replicas) {
        return Err(refuse_renewal(conn, "renew", ack, acked));
    }
    let found = status(code, "renew", conn.target())?;
    crate::inspect::unless_forced(shared, name, owner, found).await
}

/// The batch renewal's statuses, with one `WAIT` for the whole batch. If
/// it extended any lease and too few replicas acknowledged, the whole batch
/// fails (an expired or stolen lease in it is reported on the retry).
///
/// # Cancel safety
///
/// Not cancel safe, as a plain batch renewal.
pub(crate) async fn renew_many(
    conn: &Connection,
    ack: &ReplicaAck,
    keys: &[String],
    args: &[String],
) -> Result<Vec<i64>, BackendError> {
    let (codes, acked): (Vec<i64>, u64) =
        eval_and_wait(conn, ack, "renew batch", &RENEW_MANY, keys, args).await?;
    if codes.contains(&1) && acked < u64::from(ack.replicas) {
        return Err(refuse_renewal(conn, "renew batch", ack, acked));
    }
    Ok(codes)
}

/// Runs `script` and then `WAIT` in one pipeline; returns the script's
/// reply and how many replicas acknowledged.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped call may have run the script without anyone
/// learning the reply, as for any write.
pub(crate) async fn eval_and_wait<T: FromRedisValue + Send + 'static>(
    conn: &Connection,
    ack: &ReplicaAck,
    op: &str,
    script: &Lua,
    keys: &[String],
    args: &[String],
) -> Result<(T, u64), BackendError> {
    let mut pipe = redis::pipe();
    pipe.add_command(script.eval(keys, args))
        .cmd("WAIT")
        .arg(u64::from(ack.replicas))
        .arg(ack.timeout_ms().to_string());
    let (reply, acked): (T, i64) = conn
        .run(op, |mut c| async move {
            pipe.query_async(&mut c).await.map_err(first_server_error)
        })
        .await?;
    let acked = u64::try_from(acked).map_err(|_| protocol(op, conn.target(), acked))?;
    Ok((reply, acked))
}

/// The first failed command's error of a failed pipeline, as a plain server
/// error: the pipeline failure hides codes such as `NOREPLICAS`, which decide
/// how the error is classified and whether the sentinels are asked again.
fn first_server_error(e: RedisError) -> RedisError {
    let first = e
        .clone()
        .into_server_errors()
        .and_then(|errors| errors.first().map(|(_, s)| s.clone()));
    first.map_or(e, RedisError::from)
}

/// The message for a write fewer than `ack.replicas()` replicas acknowledged.
fn too_few(ack: &ReplicaAck, acked: u64) -> String {
    format!(
        "{acked} of the {} replicas asked for acknowledged the write within {:?}",
        ack.replicas, ack.timeout
    )
}

/// Deletes a lock (and its holder record: `keys`) whose acquire too few
/// replicas acknowledged (only if it still holds `owner`), and returns the error the acquire fails with.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped call leaves the key to its TTL.
async fn refuse_acquire(
    conn: &Connection,
    ack: &ReplicaAck,
    acked: u64,
    keys: [String; 2],
    channel: String,
    owner: String,
) -> BackendError {
    let released: Result<i64, BackendError> = conn
        .run("release an unacknowledged lock", |mut c| async move {
            RELEASE.run(&mut c, &keys, &[owner, channel]).await
        })
        .await;
    let what = too_few(ack, acked);
    let target = conn.target();
    let hint = "check that the replicas are up and linked (INFO replication), or ask for fewer replicas or a longer replica_ack_timeout";
    match released {
        Ok(_) => BackendError::unavailable(format!(
            "acquire on {target}: {what}; the lock was released again (fail closed): {hint}"
        )),
        Err(e) => BackendError::unavailable(format!(
            "acquire on {target}: {what}; releasing it again failed ({}), so it ends with its TTL (fail closed): {hint}",
            e.message()
        )),
    }
}

/// The error for a renewal too few replicas acknowledged: the server's TTL
/// moved, but the holder's local deadline must not.
fn refuse_renewal(conn: &Connection, op: &str, ack: &ReplicaAck, acked: u64) -> BackendError {
    BackendError::unavailable(format!(
        "{op} on {}: {}; the local deadline was not extended (a promoted replica could expire the key earlier than the holder would believe)",
        conn.target(),
        too_few(ack, acked)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_refused_with_the_valid_range() {
        for (n, t) in [
            (0, Duration::from_millis(100)),
            (1, Duration::ZERO),
            (1, Duration::from_millis(10_001)),
            (1, Duration::MAX),
        ] {
            let err = ReplicaAck::new(n, t).expect_err("out of range");
            assert_eq!(err.kind(), lock_core::BackendErrorKind::Config);
            assert!(
                err.message().contains("1 to 255") || err.message().contains("at most 10s"),
                "{err}"
            );
        }
        let ok = ReplicaAck::new(2, Duration::from_micros(1)).expect("valid");
        assert_eq!(ok.timeout_ms(), 1);
        let max = ReplicaAck::new(255, ReplicaAck::MAX_TIMEOUT).expect("valid");
        assert_eq!(max.timeout_ms(), 10_000);
    }

    #[test]
    fn cluster_refuses_acknowledgement_without_showing_the_password() {
        let by_url = crate::RedisBuilder::from_url(
            "redis+cluster://u:s3cret@127.0.0.1:7000,127.0.0.1:7001?replica_ack=1",
        )
        .expect_err("a cluster takes no replica_ack");
        let by_builder = crate::RedisBuilder::from_url("redis+cluster://u:s3cret@127.0.0.1:7000")
            .and_then(|b| b.with_replica_ack(1, Duration::from_millis(100)).build())
            .expect_err("a cluster takes no replica_ack");
        for err in [by_url, by_builder] {
            assert_eq!(err.kind(), lock_core::BackendErrorKind::Config);
            assert!(
                err.message().contains("not supported with redis+cluster"),
                "{err}"
            );
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn url_parameters_are_taken_out() -> Result<(), BackendError> {
        let (rest, ack) = take_url_params(
            "redis://h:1/0?replica_ack=2&protocol=resp2&replica_ack_timeout=200ms",
            "x",
        )?;
        assert_eq!(rest, "redis://h:1/0?protocol=resp2");
        assert_eq!(ack, Some(ReplicaAck::new(2, Duration::from_millis(200))?));
        let (rest, ack) = take_url_params("h1:1,h2:2/m?replica_ack=1", "x")?;
        assert_eq!(rest, "h1:1,h2:2/m");
        assert_eq!(ack.map(|a| a.timeout()), Some(DEFAULT_TIMEOUT));
        let (rest, ack) = take_url_params("redis://h:1/0?replica_ack_timeout", "x")?;
        assert_eq!(
            (rest.as_str(), ack),
            ("redis://h:1/0?replica_ack_timeout", None)
        );
        for bad in [
            "redis://h?replica_ack=0",
            "redis://h?replica_ack=256",
            "redis://h?replica_ack=-1",
            "redis://h?replica_ack=1&replica_ack_timeout=11s",
            "redis://h?replica_ack=1&replica_ack_timeout=0ms",
            "redis://h?replica_ack=1&replica_ack_timeout=99999999999999999999s",
            "redis://h?replica_ack=1&replica_ack_timeout=1.5s",
            "redis://h?replica_ack_timeout=1s",
        ] {
            assert!(take_url_params(bad, "x").is_err(), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn every_scheme_takes_the_parameters() -> Result<(), BackendError> {
        for url in [
            "redis://u:s3cret@h:1/2?replica_ack=2&replica_ack_timeout=200ms",
            "rediss://h:1?replica_ack=2&replica_ack_timeout=200ms",
            "redis+sentinel://u:s3cret@h1:1,h2:2/m/2?replica_ack=2&replica_ack_timeout=200ms",
        ] {
            let backend = crate::RedisBuilder::from_url(url)?.build()?;
            let want = ReplicaAck::new(2, Duration::from_millis(200))?;
            assert_eq!(backend.replica_ack(), Some(want), "{url}");
            assert!(backend.tokens_survive_failover(2), "{url}");
            assert!(!backend.tokens_survive_failover(3), "{url}");
            assert!(!backend.tokens_survive_failover(0), "{url}");
            assert!(!format!("{backend:?}").contains("s3cret"));
        }
        let plain = crate::RedisBuilder::from_url("redis://h:1/0")?.build()?;
        assert_eq!(plain.replica_ack(), None);
        assert!(!plain.tokens_survive_failover(1));
        let err = crate::RedisBuilder::from_url("redis://u:s3cret@h:1?replica_ack=0")
            .expect_err("0 replicas");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(err.message().contains("1 to 255"), "{err}");
        Ok(())
    }

    #[test]
    fn the_builder_refuses_what_the_url_would() {
        for (n, t) in [
            (0, Duration::from_secs(1)),
            (1, Duration::ZERO),
            (1, Duration::MAX),
        ] {
            let built = crate::RedisBuilder::new().with_replica_ack(n, t).build();
            let err = built.expect_err("out of range");
            assert_eq!(err.kind(), lock_core::BackendErrorKind::Config, "{err}");
        }
    }
}
