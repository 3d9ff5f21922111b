//! Acquiring without a fencing token (`with_fencing_tokens(false)`): one
//! `SET key token NX PX ttl GET`, the cheapest compare-and-set Redis has.

use std::sync::atomic::{AtomicBool, Ordering};

use lock_core::BackendError;
use redis::RedisError;

use crate::backend::Shared;
use crate::scripts::ACQUIRE_UNFENCED;

/// Whether the server refused `SET NX GET` once (before Redis 7.0), so that
/// acquires go straight to the script.
#[derive(Debug, Default)]
pub(crate) struct SetGetRefused(AtomicBool);

/// Takes `key` for `ms` milliseconds for `token` unless another owner holds
/// it: 1 acquired, 0 held. With a holder identity (the second of `meta`'s
/// pair) the unfenced acquire script writes the holder record (the first)
/// with the lock; without one, `SET NX PX GET` takes the lock alone (and a
/// server that refuses it gets the script, which writes a record without
/// an identity).
///
/// A key that already holds `token` is this very attempt re-sent after a
/// lost reply (owner tokens are never reused), so it counts as acquired: the
/// server's TTL then runs from the first write, which came after this call
/// started, as the lease's local deadline assumes.
///
/// # Cancel safety
///
/// Not cancel safe: the lock may have been taken with nobody to release it
/// before its TTL ends, as with every acquire.
pub(crate) async fn acquire(
    shared: &Shared,
    key: String,
    token: String,
    ms: u64,
    (meta, identity): (String, String),
) -> Result<i64, BackendError> {
    let refused = &shared.set_get_refused;
    let skip_set_get = !identity.is_empty() || refused.0.load(Ordering::Relaxed);
    shared
        .conn
        .run("acquire", |mut c| async move {
            if !skip_set_get {
                // Sized up front, as the scripts' commands are (see
                // `scripts::script_command`): the TTL is at most 20 digits.
                let size = "SETNXPXGET".len() + key.len() + token.len() + 20;
                let previous: Result<Option<String>, RedisError> =
                    redis::Cmd::with_capacity(7, size)
                        .arg("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(ms)
                        .arg("GET")
                        .query_async(&mut c)
                        .await;
                match previous {
                    Ok(None) => return Ok(1),
                    Ok(Some(v)) => return Ok(i64::from(v == token)),
                    Err(e) if is_syntax_error(&e) => refused.0.store(true, Ordering::Relaxed),
                    Err(e) => return Err(e),
                }
            }
            ACQUIRE_UNFENCED
                .run(&mut c, &[key, meta], &[token, ms.to_string(), identity])
                .await
        })
        .await
}

/// `ERR syntax error`: how servers before 7.0 answer `SET` with both `NX`
/// and `GET`.
fn is_syntax_error(e: &RedisError) -> bool {
    e.code() == Some("ERR") && e.detail().is_some_and(|d| d.contains("syntax"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a server sends as `reply` (a RESP error line).
    fn server_error(reply: &str) -> RedisError {
        match redis::parse_redis_value(reply.as_bytes()) {
            Ok(redis::Value::ServerError(e)) => RedisError::from(e),
            other => panic!("{reply:?} parsed as {other:?}"),
        }
    }

    #[test]
    fn only_a_syntax_error_sends_acquires_to_the_script() {
        assert!(is_syntax_error(&server_error("-ERR syntax error\r\n")));
        assert!(!is_syntax_error(&server_error(
            "-ERR max memory reached\r\n"
        )));
        assert!(!is_syntax_error(&server_error("-WRONGTYPE syntax\r\n")));
    }
}
