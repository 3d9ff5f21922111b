//! Redis-specific tests, as `redis::<test>` trials: what other clients,
//! operators and server faults can do to a lock, seen through the library.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{LeaseStatus, RenewRequest},
    Error, LockBackend, LockMetrics, LockName, LockOptions, Locker, LossReason, OwnerToken,
    RenewalOutcome,
};
use prometheus::Registry;
use redis::aio::MultiplexedConnection;
use tokio::time::{sleep, timeout, Instant};

use super::{access, attempts, faults, resent, RedisFactory, TTL};
use crate::harness::push_bounded;
use crate::{BoxError, Suite};

/// Slack on upper time bounds, as in the conformance profile.
pub(super) const TOLERANCE: Duration = Duration::from_millis(350);

/// Longest a Redis-specific trial may run.
pub(super) const TRIAL_TIMEOUT: Duration = Duration::from_secs(120);

/// Adds every Redis-specific trial, run against `factory`'s private server
/// (or servers of their own, for the tests that pause or restart one).
pub(super) fn register(suite: &mut Suite, factory: &Arc<RedisFactory>) {
    let table = crate::trial_table![
        "resent_acquire_is_granted_again" => resent::resent_acquire_is_granted_again,
        "theft_by_plain_set" => theft_by_plain_set,
        "concurrent_attempts_share_commands" => attempts::concurrent_attempts_share_commands,
        "release_waits_for_a_queued_attempt" => attempts::release_waits_for_a_queued_attempt,
        "expiry_by_del_and_pexpire" => expiry_by_del_and_pexpire,
        "renewal_survives_script_flush" => faults::renewal_survives_script_flush,
        "renew_many_reports_each_lease" => renew_many_reports_each_lease,
        "release_notifies_subscribers" => release_notifies_subscribers,
        "paused_server_gives_timeouts" => faults::paused_server_gives_timeouts,
        "restart_reports_expired" => faults::restart_reports_expired,
        "tls_self_signed" => access::tls_self_signed,
        "acl_user_limited_to_prefix" => access::acl_user_limited_to_prefix,
        "bad_input_errors" => access::bad_input_errors,
        "tick_store_keeps_the_maximum" => tick_store_keeps_the_maximum,
    ];
    push_bounded(suite, "redis", factory, TRIAL_TIMEOUT, &table);
}

/// A `Locker` over `backend` with its own metrics.
pub(super) fn locker_over(
    backend: Arc<dyn LockBackend>,
) -> Result<(Locker, LockMetrics), BoxError> {
    let metrics = LockMetrics::register(&Registry::new())?;
    let locker = Locker::builder()
        .with_backend_arc(backend)
        .with_metrics(metrics.clone())
        .build()?;
    Ok((locker, metrics))
}

/// A plain client on `url`, acting as another program would.
pub(super) async fn plain(url: &str) -> Result<MultiplexedConnection, BoxError> {
    let client = redis::Client::open(url)?;
    Ok(timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await??)
}

pub(super) fn opts() -> LockOptions {
    LockOptions::new(TTL)
}

pub(super) fn ensure(ok: bool, what: impl Into<String>) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(what.into().into())
    }
}

/// Waits for the guard's loss and checks reason and latency.
pub(super) async fn lost_within(
    lease: &lock_core::LeaseHandle,
    bound: Duration,
    want: LossReason,
) -> Result<Duration, BoxError> {
    let started = Instant::now();
    let reason = timeout(bound, lease.lost())
        .await
        .map_err(|_| format!("loss not detected within {bound:?}"))?;
    ensure(reason == want, format!("lost as {reason}, expected {want}"))?;
    Ok(started.elapsed())
}

async fn theft_by_plain_set(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let backend = f.config()?.connect().await?;
    let (locker, metrics) = locker_over(Arc::new(backend.clone()))?;
    let name = LockName::new("specific/theft")?;
    let guard = locker.try_lock(&name, &opts()).await?;
    let key = backend.key_for(&name);
    let mut c = plain(f.url()).await?;
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("thief")
        .arg("PX")
        .arg(20_000)
        .query_async(&mut c)
        .await?;
    let took = lost_within(
        &guard.handle(),
        opts().renew_interval() + TOLERANCE,
        LossReason::Stolen,
    )
    .await?;
    ensure(
        matches!(
            guard.release().await,
            Err(Error::LockLost {
                reason: LossReason::Stolen,
                ..
            })
        ),
        "releasing a stolen guard did not report the theft",
    )?;
    let value: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut c).await?;
    let pttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut c).await?;
    ensure(
        value.as_deref() == Some("thief"),
        format!("the thief's value was changed: {value:?}"),
    )?;
    ensure(
        pttl > 15_000,
        format!("the thief's TTL was touched: {pttl} ms left"),
    )?;
    ensure(
        metrics.renewals(name.as_str(), RenewalOutcome::Stolen) == 1,
        "renewal outcome not counted",
    )?;
    let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut c).await?;
    tracing_line(&format!("theft by SET detected after {took:?}"));
    Ok(())
}

async fn expiry_by_del_and_pexpire(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let backend = f.config()?.connect().await?;
    let (locker, _) = locker_over(Arc::new(backend.clone()))?;
    let mut c = plain(f.url()).await?;
    for how in ["DEL", "PEXPIRE"] {
        let name = LockName::new(format!("specific/expiry-{how}"))?;
        let guard = locker.try_lock(&name, &opts()).await?;
        let key = backend.key_for(&name);
        let mut cmd = redis::cmd(how);
        cmd.arg(&key);
        if how == "PEXPIRE" {
            cmd.arg(1);
        }
        let _: i64 = cmd.query_async(&mut c).await?;
        lost_within(
            &guard.handle(),
            opts().renew_interval() + TOLERANCE,
            LossReason::Expired,
        )
        .await?;
        sleep(opts().renew_interval()).await;
        let exists: i64 = redis::cmd("EXISTS").arg(&key).query_async(&mut c).await?;
        ensure(
            exists == 0,
            format!("{how}: the key was re-created after expiry"),
        )?;
        drop(guard);
    }
    Ok(())
}

async fn renew_many_reports_each_lease(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let backend = f.config()?.connect().await?;
    let mut c = plain(f.url()).await?;
    let names: Vec<LockName> = (0..3)
        .map(|i| LockName::new(format!("specific/batch-{i}")))
        .collect::<Result<_, _>>()?;
    let mut requests = Vec::new();
    for name in &names {
        let owner = OwnerToken::generate()?;
        backend.try_acquire(name, &owner, TTL).await?;
        requests.push(RenewRequest {
            name: name.clone(),
            owner,
            ttl: TTL * 10,
        });
    }
    let _: i64 = redis::cmd("DEL")
        .arg(backend.key_for(&names[1]))
        .query_async(&mut c)
        .await?;
    let () = redis::cmd("SET")
        .arg(backend.key_for(&names[2]))
        .arg("thief")
        .arg("PX")
        .arg(5_000)
        .query_async(&mut c)
        .await?;
    let got = backend.renew_many(&requests).await?;
    ensure(
        got == [LeaseStatus::Held, LeaseStatus::Expired, LeaseStatus::Stolen],
        format!("renew_many answered {got:?}"),
    )?;
    let pttl = key_int(&mut c, "PTTL", backend.key_for(&names[0])).await?;
    ensure(
        pttl > 5_000,
        format!("the held lease was not extended: {pttl} ms"),
    )?;
    let thief = key_int(&mut c, "PTTL", backend.key_for(&names[2])).await?;
    ensure(thief <= 5_000, "the thief's lease was extended")?;
    let exists = key_int(&mut c, "EXISTS", backend.key_for(&names[1])).await?;
    ensure(exists == 0, "an expired lease was re-created")?;
    for name in &names {
        key_int(&mut c, "DEL", backend.key_for(name)).await?;
    }
    Ok(())
}

/// `cmd key` for a command that answers an integer (`PTTL`, `EXISTS`, `DEL`).
async fn key_int(c: &mut MultiplexedConnection, cmd: &str, key: String) -> Result<i64, BoxError> {
    Ok(redis::cmd(cmd).arg(key).query_async(c).await?)
}

async fn release_notifies_subscribers(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let holder = f.config()?.connect().await?;
    let waiter = f.config()?.connect().await?;
    let name = LockName::new("specific/notify")?;
    let owner = OwnerToken::generate()?;
    holder.try_acquire(&name, &owner, TTL * 10).await?;
    for round in 0..3 {
        let signal = waiter
            .subscribe_release(&name)
            .await?
            .ok_or("Redis notifies")?;
        tokio::pin!(signal);
        ensure(
            timeout(Duration::from_millis(300), &mut signal)
                .await
                .is_err(),
            format!("round {round}: woken without a release"),
        )?;
        holder.release(&name, &owner).await?;
        let released = Instant::now();
        timeout(Duration::from_millis(200), signal)
            .await
            .map_err(|_| format!("round {round}: no wake-up within 200 ms of the release"))?;
        tracing_line(&format!(
            "release notification after {:?}",
            released.elapsed()
        ));
        holder.try_acquire(&name, &owner, TTL * 10).await?;
    }
    holder.release(&name, &owner).await?;
    Ok(())
}

async fn tick_store_keeps_the_maximum(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    use lock_core::TickStore;
    let a = f.config()?.connect().await?;
    let b = f.config()?.connect().await?;
    let job = LockName::new("specific/ticks")?;
    ensure(
        a.last_completed(&job).await?.is_none(),
        "a fresh job has a tick",
    )?;
    a.record_completed(&job, 1_700_000_002_000, std::time::Duration::from_secs(60))
        .await?;
    b.record_completed(&job, 1_700_000_001_000, std::time::Duration::from_secs(60))
        .await?;
    ensure(
        b.last_completed(&job).await? == Some(1_700_000_002_000),
        "the tick moved backwards",
    )?;
    b.record_completed(&job, 1_700_000_003_000, std::time::Duration::from_secs(60))
        .await?;
    ensure(
        a.last_completed(&job).await? == Some(1_700_000_003_000),
        "a later tick was not kept",
    )?;
    Ok(())
}

/// Prints a measured figure next to the test output.
pub(super) fn tracing_line(what: &str) {
    eprintln!("    [redis] {what}");
}

/// Fails if keys other than the fencing counter and tick marks remain under
/// the run's prefix once leases cut short at a case's end have had `wait`
/// to expire; then removes the counter and tick marks.
pub(super) async fn leftover_keys(f: &RedisFactory, wait: Duration) -> Result<(), BoxError> {
    leftover_keys_at(f.name, f.url(), f.prefix(), wait).await
}

/// [`leftover_keys`] on the server at `url`, for the factory called `name`.
pub(super) async fn leftover_keys_at(
    name: &str,
    url: &str,
    prefix: &str,
    wait: Duration,
) -> Result<(), BoxError> {
    let mut c = plain(url).await?;
    let pattern = format!("{prefix}*");
    let deadline = Instant::now() + wait;
    loop {
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        for _ in 0..10_000 {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut c)
                .await?;
            keys.extend(batch);
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        // Lock names cannot contain '#': only the counter and ticks do.
        let (kept, leaked): (Vec<String>, Vec<String>) =
            keys.into_iter().partition(|k| k.contains('#'));
        if leaked.is_empty() {
            if !kept.is_empty() {
                // One DEL per key: on a cluster node one DEL may not span slots.
                let mut p = redis::pipe();
                for k in &kept {
                    p.cmd("DEL").arg(k).ignore();
                }
                let () = p.query_async(&mut c).await?;
            }
            eprintln!("{name}: no lock key left under {prefix}");
            return Ok(());
        }
        if Instant::now() >= deadline {
            let mut described = Vec::new();
            for k in &leaked {
                let pttl: i64 = redis::cmd("PTTL").arg(k).query_async(&mut c).await?;
                described.push(format!("{k} (pttl {pttl} ms)"));
            }
            return Err(
                format!("{name}: keys left under {prefix}: {}", described.join(", ")).into(),
            );
        }
        sleep(Duration::from_millis(100)).await;
    }
}
