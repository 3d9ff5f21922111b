//! X2 (server stall) and X3 (blackhole partition) against a private server.

use std::time::Duration;

use lock_core::{BackendErrorKind, Error, LockGuard, LockName, LockOptions, Locker, LossReason};
use tokio::time::{sleep, sleep_until, Instant};

use super::case_timing;
use super::figures::Row;
use super::holder::{Holder, Resource};
use crate::proxy::FaultProxy;
use crate::{Ctx, Replica};

/// What a chaos case needs to know about its backend beyond the factory.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// The backend's operation timeout: the longest any single call may
    /// block on a server that does not answer.
    pub op_timeout: Duration,
    /// Smoke iterations per case.
    pub iterations: usize,
    /// The URL scheme `scheduler::connect` knows the backend by.
    pub scheme: &'static str,
}

/// How long the leak probe keeps asking a server that cannot answer yet:
/// after a Sentinel failover the new primary refuses writes
/// (`NOREPLICAS`) until the sentinels re-link a replica to it, which took
/// up to about 11 s here.
const PROBE_PATIENCE: Duration = Duration::from_secs(15);

/// 1 if `name` is still held (by anyone) when `locker` tries it, else 0. A
/// backend error (the server not answering yet after a fault) is retried
/// for [`PROBE_PATIENCE`]; only then does the probe fail.
pub(super) async fn leak_probe(locker: &Locker, name: &LockName, opts: &LockOptions) -> usize {
    let until = Instant::now() + PROBE_PATIENCE;
    loop {
        match locker.try_lock(name, opts).await {
            Ok(guard) => {
                guard.release().await.expect("release of the leak probe");
                return 0;
            }
            Err(Error::HeldElsewhere { .. }) => return 1,
            Err(Error::Unavailable { .. } | Error::Backend(_)) if Instant::now() < until => {
                sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("leak probe failed: {e}"),
        }
    }
}

/// Whether a release failed because the server refuses writes for a
/// while: a Sentinel-promoted primary whose replica the sentinels are
/// re-linking answers `NOREPLICAS` (min-replicas-to-write). That fails
/// closed: the key expires with its TTL, which a later leak probe checks.
pub(super) fn refused_for_now(e: &Error) -> bool {
    match e {
        Error::Unavailable { .. } => true,
        Error::Backend(b) => b.kind() == BackendErrorKind::Unavailable,
        _ => false,
    }
}

/// A fault proxy in front of the backend's loopback server.
pub(super) async fn proxy_to_server(ctx: &Ctx) -> FaultProxy {
    let upstream = ctx.factory().server_addr().expect("a loopback server");
    FaultProxy::start(upstream).await.expect("proxy starts")
}

/// A replica with a connection of its own through `proxy`.
pub(super) async fn replica_through(ctx: &Ctx, proxy: &FaultProxy) -> Replica {
    let via = ctx
        .factory()
        .replica_via(proxy.addr())
        .await
        .expect("connects through the proxy")
        .expect("the backend can be proxied");
    ctx.replica_over(via)
}

/// Where an iteration's lock went: the successor's locker and the name.
pub(super) struct Handover<'a> {
    /// The successor's locker (it also probes for a leak at the end).
    pub locker: &'a Locker,
    /// The lock.
    pub name: &'a LockName,
    /// Options for the leak probe.
    pub opts: &'a LockOptions,
}

impl<'a> Handover<'a> {
    /// The lock `name`, gone to the successor's `locker`.
    pub(super) fn new(locker: &'a Locker, name: &'a LockName, opts: &'a LockOptions) -> Self {
        Self { locker, name, opts }
    }
}

/// Ends an iteration in which `succ` took over from a holder that made
/// `writes` guarded writes, `late` of them at or after its deadline: the
/// successor must still hold and let go, and `row` counts the writes, the
/// stale writes `resource` accepted after `since` (the successor's first
/// fenced write or its acquire), the late ones, and a lock left behind.
pub(super) async fn wind_down(
    row: &mut Row,
    h: Handover<'_>,
    succ: LockGuard,
    resource: &Resource,
    since: Instant,
    (writes, late): (usize, usize),
) {
    let token = succ.handle().fencing_token().expect("the backend fences");
    succ.handle()
        .verify()
        .await
        .expect("the successor still holds");
    succ.release().await.expect("successor releases");
    row.writes += writes;
    row.stale_accepts += resource.stale_accepted(token, since);
    row.after_deadline += late;
    row.leaked += leak_probe(h.locker, h.name, h.opts).await;
}

/// The holder's loss during a fault that began at `fault_at` (`expect` is
/// the failure message should there be none): counted in `row.abort`, and
/// no later than the holder's local `deadline` plus `tol`. When it was
/// lost and why.
pub(super) fn aborted_in_time(
    row: &mut Row,
    lost: Option<(Instant, LossReason)>,
    expect: &str,
    fault_at: Instant,
    deadline: Instant,
    tol: Duration,
) -> (Instant, LossReason) {
    let (lost_at, reason) = lost.expect(expect);
    row.abort.push(lost_at - fault_at);
    assert!(
        lost_at <= deadline + tol,
        "abort {:?} after the deadline ({reason:?})",
        lost_at - deadline
    );
    (lost_at, reason)
}

/// Tries `name` through `replica` while a fault holds, which must refuse
/// it (`refused` says what a grant would mean); how long the call blocked,
/// also counted in `row.max_blocked`.
pub(super) async fn refused_during_fault(
    row: &mut Row,
    replica: &Replica,
    name: &LockName,
    opts: &LockOptions,
    refused: &str,
) -> Duration {
    let call_at = Instant::now();
    let probe = replica.locker.try_lock(name, opts).await;
    let blocked = call_at.elapsed();
    assert!(probe.is_err(), "{refused}");
    row.max_blocked = row.max_blocked.max(Some(blocked));
    blocked
}

/// Ends an iteration whose `holder` lost its lease to `succ`: waits up to
/// `ttl` for the lost holder's writer to stop and checks that its guard
/// cannot release (how long that took goes to `max_blocked`), then
/// [`wind_down`] with the late writes `resource` logged.
pub(super) async fn lost_holder_winds_down(
    row: &mut Row,
    holder: Holder,
    ttl: Duration,
    h: Handover<'_>,
    succ: LockGuard,
    resource: &Resource,
    since: Instant,
) {
    let (writes, release_took) = holder.writes_after_loss(ttl).await;
    row.max_blocked = row.max_blocked.max(Some(release_took));
    let late = resource.log.after_deadline();
    wind_down(row, h, succ, resource, since, (writes, late)).await;
}

/// Waits for `name` through `replica`'s locker, as `opts` say: the guard,
/// when it was granted, and its fencing token. `expect` is the failure
/// message should it not be granted.
pub(super) async fn granted(
    replica: &Replica,
    name: &LockName,
    opts: &LockOptions,
    expect: &str,
) -> (LockGuard, Instant, u64) {
    let guard = replica
        .locker
        .lock(name, opts)
        .await
        .unwrap_or_else(|e| panic!("{expect}: {e:?}"));
    let at = Instant::now();
    let token = guard.handle().fencing_token().expect("the backend fences");
    (guard, at, token)
}

/// The successor takes `name` (waiting out the old lease), writes once under
/// its token, and returns when it acquired and its guard.
pub(super) async fn successor_takes(
    successor: &Replica,
    name: &LockName,
    opts: &LockOptions,
    wait: Duration,
    resource: &Resource,
) -> (Instant, LockGuard) {
    let opts = opts.clone().with_acquire_timeout(wait);
    let expect = "the successor acquires after the fault";
    let (guard, at, token) = granted(successor, name, &opts, expect).await;
    assert!(resource.write(token), "the successor's write is accepted");
    (at, guard)
}

/// X2: the server is frozen (SIGSTOP) for 1.5 × TTL while a holder writes.
/// The holder must abort before the successor acquires after the thaw, make
/// no write after its deadline, and no call may hang past the op timeout.
pub(super) async fn server_stall(ctx: Ctx, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let holder_rep = ctx.replica().await;
    let probe_rep = ctx.replica().await;
    let successor = ctx.replica().await;
    let server = ctx.factory().server_process().expect("a private server");
    let mut row = Row::of(&ctx, "chaos_server_stall");
    for i in 0..target.iterations {
        let name = ctx.name(&format!("stall-{i}"));
        let (mut holder, resource) = Holder::healthy(&holder_rep, &name, &opts, ttl).await;
        let fault_at = Instant::now();
        let deadline = fault_at + holder.handle.remaining_validity().expect("a deadline");
        server.pause().expect("SIGSTOP the server");
        row.faults += 1;
        let thaw_at = fault_at + ttl * 3 / 2;
        // A call made while the server is frozen must give up in time.
        let probe_name = ctx.name(&format!("stall-probe-{i}"));
        let refused = "nothing is granted by a frozen server";
        let blocked = refused_during_fault(&mut row, &probe_rep, &probe_name, &opts, refused).await;
        let lost = holder.lost_by(thaw_at).await;
        sleep_until(thaw_at).await;
        server.resume().expect("SIGCONT the server");
        let expect = "the holder aborted while the server was frozen";
        let (lost_at, _) = aborted_in_time(&mut row, lost, expect, fault_at, deadline, tol);
        let (acquired_at, succ) =
            successor_takes(&successor, &name, &opts, ttl * 4, &resource).await;
        assert!(
            lost_at < acquired_at,
            "the holder aborted before the successor acquired"
        );
        let writes = holder.superseded_by(&succ, ttl).await;
        assert!(writes > 0, "the holder wrote before the fault");
        let late = resource.log.after_deadline();
        let h = Handover::new(&successor.locker, &name, &opts);
        wind_down(&mut row, h, succ, &resource, acquired_at, (writes, late)).await;
        assert!(
            blocked <= target.op_timeout + tol,
            "a call blocked {blocked:?} on the frozen server"
        );
    }
    row.iterations = target.iterations;
    row.finish();
}

/// X3: the holder's connection is blackholed for 2 × TTL while the successor
/// reaches the server directly. The holder aborts by its deadline, the
/// successor acquires after it, and after healing the old lease stays lost.
pub(super) async fn partition(ctx: Ctx, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let proxy = proxy_to_server(&ctx).await;
    let successor = ctx.replica().await;
    let mut row = Row::of(&ctx, "chaos_partition");
    for i in 0..target.iterations {
        // A fresh connection each time, so iterations do not share a
        // stream that a partition held back.
        let holder_rep = replica_through(&ctx, &proxy).await;
        let name = ctx.name(&format!("partition-{i}"));
        let (mut holder, resource) = Holder::healthy(&holder_rep, &name, &opts, ttl).await;
        let fault_at = Instant::now();
        let deadline = fault_at + holder.handle.remaining_validity().expect("a deadline");
        proxy.blackhole(true);
        row.faults += 1;
        let (lost_at, reason) = holder
            .lost_by(deadline + tol)
            .await
            .expect("the holder aborts by its local deadline");
        row.abort.push(lost_at - fault_at);
        let (acquired_at, succ) =
            successor_takes(&successor, &name, &opts, ttl * 4, &resource).await;
        assert!(
            lost_at < acquired_at,
            "aborted ({reason:?}) before the successor acquired"
        );
        sleep_until(fault_at + ttl * 2).await;
        proxy.blackhole(false);
        sleep(opts.renew_interval() * 2).await;
        assert!(
            holder.handle.assert_held().is_err(),
            "the old lease stays lost after healing"
        );
        let h = Handover::new(&successor.locker, &name, &opts);
        lost_holder_winds_down(&mut row, holder, ttl, h, succ, &resource, acquired_at).await;
    }
    row.iterations = target.iterations;
    row.finish();
}
