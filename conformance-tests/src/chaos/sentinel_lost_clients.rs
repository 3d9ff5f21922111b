//! The clients of the Sentinel primary-lost cases: connections through the
//! sentinels (with or without replica acknowledgement), a direct connection
//! to one data server, and the waiter that takes the lost lock.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockName, LockOptions};
use tokio::time::{sleep, Instant};

use super::holder::Resource;
use crate::backends::redis::config_for;
use crate::backends::redis::sentinel::SentinelSet;
use crate::{Ctx, Replica};

/// Pause between the waiter's writes.
const STEP: Duration = Duration::from_millis(10);
/// Writes the waiter makes once granted.
const WAITER_WRITES: usize = 20;

/// What the waiter saw: granted at, its token, its first write's instant,
/// its accepted and refused writes, and when it let go.
#[derive(Debug)]
pub(super) struct Waited {
    pub(super) granted: Instant,
    pub(super) token: u64,
    pub(super) first_write: Instant,
    pub(super) accepted: usize,
    pub(super) refused: usize,
    pub(super) end: Instant,
}

/// Waits for `name`, then makes guarded, fenced writes to `resource`.
pub(super) async fn waiter(
    rep: Replica,
    name: LockName,
    opts: LockOptions,
    resource: Arc<Resource>,
) -> Waited {
    let expect = "the waiter is granted the lock on the promoted primary";
    let (guard, granted, token) = super::cases::granted(&rep, &name, &opts, expect).await;
    let handle = guard.handle();
    let (mut accepted, mut refused) = (0, 0);
    let mut first_write = None;
    for _ in 0..WAITER_WRITES {
        let deadline = handle.remaining_validity().map(|r| Instant::now() + r);
        if handle.assert_held().is_err() {
            break;
        }
        resource.log.record(Instant::now(), deadline);
        first_write.get_or_insert_with(Instant::now);
        if resource.write(token) {
            accepted += 1;
        } else {
            refused += 1;
        }
        sleep(STEP).await;
    }
    let end = Instant::now();
    guard.release().await.expect("the waiter releases");
    Waited {
        granted,
        token,
        first_write: first_write.unwrap_or(end),
        accepted,
        refused,
        end,
    }
}

/// A plain connection to the data server on `port`, around the sentinels.
pub(super) async fn direct(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("a direct connection")
}

/// Replica acknowledgement of the `_acked` case: one replica, well above a
/// loopback round trip.
pub(super) const ACK: (u8, Duration) = (1, Duration::from_millis(250));

/// A replica whose backend finds the primary through the sentinels of
/// `set`, asking for `ack` when given.
pub(super) async fn through(
    ctx: &Ctx,
    set: &SentinelSet,
    prefix: &str,
    ack: Option<(u8, Duration)>,
) -> Replica {
    let mut config = config_for(&set.url())
        .expect("config")
        .with_key_prefix(prefix);
    if let Some((n, t)) = ack {
        config = config.with_replica_ack(n, t);
    }
    let backend = config
        .connect()
        .await
        .expect("connects through the sentinels");
    ctx.replica_over(Arc::new(backend))
}
