//! Faults from outside: a second client revoking or overwriting, a stopped
//! server, and what the cases leave behind.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{GetOptions, PutOptions};
use libtest_mimic::Failed;
use lock_core::{Error, LossReason, OwnerToken, RunOutcome};
use tokio::task::{JoinError, JoinSet};
use tokio::time::{sleep, timeout, Instant};

use super::{ensure, hold_in_job};
use crate::backends::etcd::{server, EtcdFactory, EtcdSaboteur};
use crate::suite::{CaseFn, Requires};
use crate::{cases, BackendFactory, Ctx};

const ROUNDS: usize = 5;

/// The suite's own limit for one case.
const CASE_LIMIT: Duration = Duration::from_secs(180);
/// How many cases the residue check runs at once.
const CASES_AT_ONCE: usize = 3;

/// `etcdctl lease revoke` on the shared lease of one backend instance
/// deletes every key on it: every lock on it, in every `Locker` over that
/// instance, is lost at once (pushed through the loss feed at the first
/// keep-alive that finds the lease gone), the jobs abort as `expired`, a
/// lock of another instance stays held, and the next acquire gets a new
/// shared lease. Prints the measured abort times.
pub(super) async fn theft_by_lease_revoke(f: Arc<EtcdFactory>, ctx: Ctx) -> Result<(), Failed> {
    let a = ctx.replica().await;
    let a2 = ctx.replica_over(Arc::clone(&a.backend));
    let other = ctx.replica().await;
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let bound = ctx.opts().renew_interval() + ctx.timing().tolerance;
    // Losses pushed in one call land in the same instant; the tasks that
    // see them are scheduled a little apart.
    let together = ctx.timing().tolerance / 4;
    let mut taken = Vec::with_capacity(ROUNDS);
    let mut last_lease = None;
    for round in 0..ROUNDS {
        let (x, y, z) = (
            ctx.name(&format!("revoked-{round}-x")),
            ctx.name(&format!("revoked-{round}-y")),
            ctx.name(&format!("revoked-{round}-z")),
        );
        let (lx, rx) = hold_in_job(&a, &ctx, &x).await?;
        let (ly, ry) = hold_in_job(&a2, &ctx, &y).await?;
        let (lz, rz) = hold_in_job(&other, &ctx, &z).await?;
        let id = sab.lease_of(&x).await?.ok_or("the held key is missing")?;
        ensure(sab.lease_of(&y).await? == Some(id), || {
            format!("round {round}: two locks of one instance are on different leases")
        })?;
        ensure(sab.lease_of(&z).await? != Some(id), || {
            format!("round {round}: two instances share a lease")
        })?;
        ensure(last_lease != Some(id), || {
            format!("round {round}: the revoked lease {id:x} was used again")
        })?;
        last_lease = Some(id);
        // Vary where in the renewal interval the revoke lands.
        sleep(ctx.opts().renew_interval() * (round as u32 + 1) / (ROUNDS as u32 + 1)).await;
        let revoked_at = Instant::now();
        sab.client().lease_client().revoke(id).await?;
        let lost_x = async {
            let r = lx.lost().await;
            (r, revoked_at.elapsed())
        };
        let lost_y = async {
            let r = ly.lost().await;
            (r, revoked_at.elapsed())
        };
        let ((rx_reason, took_x), (ry_reason, took_y)) =
            timeout(bound * 2, async { tokio::join!(lost_x, lost_y) })
                .await
                .map_err(|_| "the holders never noticed the revoke")?;
        for (what, reason, took) in [("x", rx_reason, took_x), ("y", ry_reason, took_y)] {
            ensure(reason == LossReason::Expired, || {
                format!("round {round}: {what} lost as {reason}")
            })?;
            ensure(took <= bound, || {
                format!("round {round}: {what} aborted after {took:?} > {bound:?}")
            })?;
        }
        let apart = took_x.abs_diff(took_y);
        ensure(apart <= together, || {
            format!("round {round}: the two locks were lost {apart:?} apart, not at once")
        })?;
        for run in [rx, ry] {
            match run.await? {
                RunOutcome::Aborted(LossReason::Expired) => {}
                other => return Err(format!("round {round}: run ended {other:?}").into()),
            }
        }
        ensure(lz.assert_held().is_ok(), || {
            format!("round {round}: the other instance's lock was lost")
        })?;
        // Dropping the job's future releases its lock.
        rz.abort();
        let _ = rz.await;
        taken.push(took_x.max(took_y));
    }
    taken.sort();
    println!(
        "etcd: abort of two locks on a revoked shared lease over {ROUNDS} rounds: min {:?}, median {:?}, max {:?} (renew interval {:?})",
        taken[0],
        taken[ROUNDS / 2],
        taken[ROUNDS - 1],
        ctx.opts().renew_interval()
    );
    Ok(())
}

/// A second client deletes the key (the holder sees `expired`), or
/// overwrites it with its own token (`stolen`); the overwrite survives the
/// old holder.
pub(super) async fn theft_by_delete_and_put(f: Arc<EtcdFactory>, ctx: Ctx) -> Result<(), Failed> {
    let a = ctx.replica().await;
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let bound = ctx.opts().renew_interval() + ctx.timing().tolerance;
    let mut kv = sab.client().kv_client();

    let name = ctx.name("deleted");
    let key = format!("{}{}", lock_etcd::DEFAULT_PREFIX, name.as_str());
    let (lease, run) = hold_in_job(&a, &ctx, &name).await?;
    let deleted_at = Instant::now();
    kv.delete(key.as_str(), None).await?;
    let reason = timeout(bound * 2, lease.lost())
        .await
        .map_err(|_| "delete unnoticed")?;
    ensure(reason == LossReason::Expired, || {
        format!("delete: lost as {reason}")
    })?;
    ensure(deleted_at.elapsed() <= bound, || {
        format!("delete noticed after {:?}", deleted_at.elapsed())
    })?;
    ensure(
        matches!(run.await?, RunOutcome::Aborted(LossReason::Expired)),
        || "delete: not aborted".into(),
    )?;

    let name = ctx.name("overwritten");
    let key = format!("{}{}", lock_etcd::DEFAULT_PREFIX, name.as_str());
    let (lease, run) = hold_in_job(&a, &ctx, &name).await?;
    let thief = OwnerToken::generate()?.to_hex();
    let thief_lease = sab.client().lease_client().grant(30, None).await?.id();
    let put_at = Instant::now();
    kv.put(
        key.as_str(),
        thief.as_str(),
        Some(PutOptions::new().with_lease(thief_lease)),
    )
    .await?;
    let reason = timeout(bound * 2, lease.lost())
        .await
        .map_err(|_| "overwrite unnoticed")?;
    ensure(reason == LossReason::Stolen, || {
        format!("overwrite: lost as {reason}")
    })?;
    ensure(put_at.elapsed() <= bound, || {
        format!("overwrite noticed after {:?}", put_at.elapsed())
    })?;
    ensure(
        matches!(run.await?, RunOutcome::Aborted(LossReason::Stolen)),
        || "overwrite: not aborted".into(),
    )?;
    sleep(ctx.opts().renew_interval()).await;
    let still = kv.get(key.as_str(), None).await?;
    ensure(
        still
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == thief.as_bytes()),
        || "the old holder touched the thief's key".into(),
    )?;
    sab.client().lease_client().revoke(thief_lease).await?;
    Ok(())
}

/// SIGSTOP the server for longer than the TTL: calls end with timeouts
/// within the request timeout, the holder aborts at its local deadline
/// while the server is still stopped, and a second client acquires only
/// after the resume.
pub(super) async fn paused_server_holder_aborts_first(
    _f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let srv = Arc::new(server::start(server::ServerTls::default())?);
    let factory: Arc<dyn BackendFactory> = Arc::new(EtcdFactory::over(Arc::clone(&srv)));
    let ctx = Ctx::new(factory, "paused", ctx.prefix());
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("stopped-server");
    let ttl = ctx.timing().ttl;
    let tol = ctx.timing().tolerance;
    let request_timeout = Duration::from_secs(1);
    let acquired_at = Instant::now();
    let (lease, run) = hold_in_job(&a, &ctx, &name).await?;
    sleep(ttl / 2).await;
    let paused_at = Instant::now();
    srv.pause()?;
    let probe = Instant::now();
    let answer = a.backend.check(&name, &OwnerToken::generate()?).await;
    let probe_took = probe.elapsed();
    let reason = timeout(ttl * 2, lease.lost()).await;
    let aborted_at = Instant::now();
    let pause = ttl * 3 / 2 + Duration::from_millis(500);
    sleep((paused_at + pause).saturating_duration_since(Instant::now())).await;
    srv.resume()?;
    let resumed_at = Instant::now();

    match answer {
        Err(e) if e.kind() == lock_core::BackendErrorKind::Timeout => {}
        other => return Err(format!("a call to a stopped server gave {other:?}").into()),
    }
    ensure(probe_took <= request_timeout + tol, || {
        format!("a call blocked {probe_took:?}")
    })?;
    let reason = reason.map_err(|_| "the holder never aborted while the server was stopped")?;
    ensure(reason == LossReason::BackendError, || {
        format!("lost as {reason}")
    })?;
    ensure(aborted_at - acquired_at <= ttl + tol, || {
        format!("aborted {:?} after acquiring", aborted_at - acquired_at)
    })?;
    ensure(aborted_at < resumed_at, || {
        "the holder aborted only after the resume".into()
    })?;

    let opts = ctx.opts();
    let mut successor = None;
    for _ in 0..100 {
        match b.locker.try_lock(&name, &opts).await {
            Ok(g) => {
                successor = Some((g, Instant::now()));
                break;
            }
            Err(Error::HeldElsewhere { .. } | Error::Unavailable { .. }) => {
                sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(format!("successor: {e}").into()),
        }
    }
    let (guard, successor_at) = successor.ok_or("no successor within 10 s of the resume")?;
    ensure(aborted_at < successor_at, || {
        "the successor acquired before the holder aborted".into()
    })?;
    match run.await? {
        RunOutcome::Aborted(LossReason::BackendError) => {}
        other => return Err(format!("holder run ended {other:?}").into()),
    }
    println!(
        "etcd: stopped {:?}: holder aborted {:?} after the stop, successor acquired {:?} after the resume",
        pause,
        aborted_at - paused_at,
        successor_at - resumed_at
    );
    guard.release().await?;
    Ok(())
}

/// Runs every applicable case against a server of its own, then checks for
/// real that no lock key and no lease of the run is left.
pub(super) async fn no_residue_after_cases(_f: Arc<EtcdFactory>, _ctx: Ctx) -> Result<(), Failed> {
    let srv = Arc::new(server::start(server::ServerTls::default())?);
    let factory = Arc::new(EtcdFactory::over(Arc::clone(&srv)));
    let dynf: Arc<dyn BackendFactory> = factory.clone();
    let ttl = dynf.timing().ttl;
    // A few at a time, as the suite runs them against a shared server: each
    // case names its own locks. One by one they took over a minute.
    let mut running = JoinSet::new();
    for case in cases::ALL {
        let CaseFn::Async(body) = case.run else {
            continue;
        };
        // Scheduler cases add nothing to what the lock cases leave behind
        // (they lock through the same Locker) and take minutes in real time.
        if case.requires == Requires::PausedClock || case.name.starts_with("scheduler_") {
            continue;
        }
        if running.len() >= CASES_AT_ONCE {
            joined(running.join_next().await)?;
        }
        let ctx = Ctx::new(Arc::clone(&dynf), "residue", case.name);
        let name = case.name;
        running.spawn(async move {
            timeout(CASE_LIMIT, body(ctx))
                .await
                .map_err(|_| format!("case {name} did not finish within {CASE_LIMIT:?}"))
        });
    }
    while !running.is_empty() {
        joined(running.join_next().await)?;
    }
    let sab = EtcdSaboteur::connect_default(&factory.endpoints()?).await?;
    let mut client = sab.client();
    let ticks = format!("{}#", lock_etcd::DEFAULT_PREFIX);
    let ended = Instant::now();
    let (mut keys, mut leases) = (usize::MAX, usize::MAX);
    let (mut keys_at_end, mut leases_at_end) = (None, None);
    // Orphans end by themselves within one TTL (a dropped acquire's lease,
    // a retained lock); anything alive after that is kept alive by someone.
    while ended.elapsed() < ttl * 2 + Duration::from_secs(1) {
        let resp = client
            .get(
                lock_etcd::DEFAULT_PREFIX,
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await?;
        // The tick store's keys (latest ticks and marks) share the prefix
        // behind a `#`, which lock names cannot contain, and persist by design.
        keys = resp
            .kvs()
            .iter()
            .filter(|kv| !kv.key().starts_with(ticks.as_bytes()))
            .count();
        leases = client.leases().await?.leases().len();
        keys_at_end.get_or_insert(keys);
        leases_at_end.get_or_insert(leases);
        if keys == 0 && leases == 0 {
            break;
        }
        sleep(Duration::from_millis(200)).await;
    }
    println!(
        "etcd: after the cases: {:?} keys and {:?} leases at once, {keys} and {leases} after {:?}",
        keys_at_end,
        leases_at_end,
        ended.elapsed()
    );
    ensure(keys == 0, || {
        format!("{keys} lock keys left under {}", lock_etcd::DEFAULT_PREFIX)
    })?;
    ensure(leases == 0, || format!("{leases} leases still alive"))?;
    Ok(())
}

/// One finished case of the residue check: its failure (a panic, or its
/// time running out) is the check's.
fn joined(done: Option<Result<Result<(), String>, JoinError>>) -> Result<(), Failed> {
    match done {
        None | Some(Ok(Ok(()))) => Ok(()),
        Some(Ok(Err(why))) => Err(why.into()),
        Some(Err(e)) => Err(format!("a case failed: {e}").into()),
    }
}
