//! The raft leader killed (SIGKILL) while holders renew and waiters wait.
//!
//! etcd keeps leases across a leader change (the new leader extends every
//! lease by its full TTL on election), so a holder either keeps its lease
//! through the new leader or, if its renewals stalled past its local
//! deadline, aborts; in both cases nobody else acquires before the holder
//! let go, and no write is accepted under its token afterwards.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockGuard, LockName, LockOptions, LossReason};
use tokio::task::JoinHandle;
use tokio::time::{sleep, sleep_until, Instant};

use super::watch::RenewWatch;
use crate::backends::etcd::cluster::EtcdCluster;
use crate::chaos::case_timing;
use crate::chaos::cases::{granted, wind_down, Handover, Target};
use crate::chaos::figures::Row;
use crate::chaos::holder::{Holder, Resource};
use crate::{Ctx, Replica};

/// Locks held across each fault, each with a waiter queued behind it.
pub(super) const HOLDERS: usize = 2;

/// How long a killed leader's successor may take to be elected.
const ELECTION_WITHIN: Duration = Duration::from_secs(10);

/// A waiter queued on `name`: when it acquired, and its guard. It writes
/// once under its token, as a successor would.
pub(super) fn waiter(
    replica: Replica,
    name: LockName,
    opts: LockOptions,
    resource: Arc<Resource>,
) -> JoinHandle<(Instant, LockGuard)> {
    tokio::spawn(async move {
        let expect = "the waiter acquires once the holder lets go";
        let (guard, at, token) = granted(&replica, &name, &opts, expect).await;
        assert!(resource.write(token), "the waiter's write is accepted");
        (at, guard)
    })
}

/// The messages of [`release_kept`]'s expectations for a lease the new
/// leader serves.
const KEPT_BY_LEADER: (&str, &str) = (
    "a lease held locally is held by the new leader",
    "the holder releases through the new leader",
);

/// When and why a holder that no longer holds its lease lost it (it must
/// have been told within 200 ms).
pub(super) async fn loss_of(holder: &mut Holder) -> (Instant, LossReason) {
    holder
        .lost_by(Instant::now() + Duration::from_millis(200))
        .await
        .expect("a lease not held was lost")
}

/// The waiter's acquire, awaited for at most `within`: when it acquired,
/// and its guard.
pub(super) async fn acquired_within(
    waiter: JoinHandle<(Instant, LockGuard)>,
    within: Duration,
) -> (Instant, LockGuard) {
    tokio::time::timeout(within, waiter)
        .await
        .expect("the waiter acquires in time")
        .expect("waiter task")
}

/// Verifies and releases a lease its holder kept through the fault at
/// `fault_at`, noting the renewal stall into `row`; `held` and `released`
/// are the expectations' messages, which name where the lease is now
/// served. Returns when the holder let go, and its writes.
pub(super) async fn release_kept(
    holder: Holder,
    watch: RenewWatch,
    row: &mut Row,
    fault_at: Instant,
    ttl: Duration,
    (held, released): (&str, &str),
) -> (Instant, usize) {
    holder.handle.verify().await.expect(held);
    row.stall.push(watch.stall(fault_at, Instant::now()));
    let (result, at, writes) = holder.release(ttl).await;
    result.expect(released);
    (at, writes)
}

/// A holder and a waiter queued behind it, each in a replica of its own.
pub(super) struct Pair {
    pub(super) name: LockName,
    pub(super) resource: Arc<Resource>,
    pub(super) holder: Holder,
    pub(super) watch: RenewWatch,
    pub(super) waiter_rep: Replica,
    pub(super) waiter: JoinHandle<(Instant, LockGuard)>,
}

impl Pair {
    /// Takes `name` in one replica and queues a waiter on it in another,
    /// which waits at most `wait` to acquire.
    pub(super) async fn start(
        ctx: &Ctx,
        name: LockName,
        opts: &LockOptions,
        wait: Duration,
    ) -> Self {
        let holder_rep = ctx.replica().await;
        let waiter_rep = ctx.replica().await;
        let resource = Arc::new(Resource::default());
        let holder = Holder::start(&holder_rep, &name, opts, Arc::clone(&resource)).await;
        let watch = RenewWatch::start(holder.handle.clone());
        let wait = opts.clone().with_acquire_timeout(wait);
        let waiter = waiter(
            waiter_rep.clone(),
            name.clone(),
            wait,
            Arc::clone(&resource),
        );
        Self {
            name,
            resource,
            holder,
            watch,
            waiter_rep,
            waiter,
        }
    }

    /// Once the fault at `fault_at` is over: a holder that still holds its
    /// lease verifies and releases it through the new leader; one that lost
    /// it lost it by its deadline, with no write after it. Either way the
    /// waiter acquires only after the holder let go, and the hand-over is
    /// wound down into `row`. Whether the holder kept its lease.
    pub(super) async fn settle(
        self,
        row: &mut Row,
        fault_at: Instant,
        opts: &LockOptions,
        ttl: Duration,
    ) -> bool {
        let Self {
            name,
            resource,
            mut holder,
            watch,
            waiter_rep,
            waiter,
        } = self;
        let kept = holder.handle.is_held();
        let (let_go_at, writes) = if kept {
            release_kept(holder, watch, row, fault_at, ttl, KEPT_BY_LEADER).await
        } else {
            let (lost_at, reason) = loss_of(&mut holder).await;
            row.abort.push(lost_at - fault_at);
            row.stall.push(watch.stall(fault_at, lost_at));
            let deadline_ok = resource.log.after_deadline() == 0;
            assert!(deadline_ok, "writes after the deadline ({reason:?})");
            let (_old, writes) = holder.writes(ttl).await;
            (lost_at, writes)
        };
        let (acquired_at, succ) = acquired_within(waiter, ttl * 12).await;
        assert!(
            let_go_at <= acquired_at,
            "double grant: the waiter acquired {:?} before the holder let go",
            let_go_at - acquired_at
        );
        let late = resource.log.after_deadline();
        let h = Handover::new(&waiter_rep.locker, &name, opts);
        wind_down(row, h, succ, &resource, acquired_at, (writes, late)).await;
        kept
    }
}

/// [`HOLDERS`] holders, each with its waiter, on names `{prefix}-{h}`.
pub(super) async fn start_pairs(
    ctx: &Ctx,
    prefix: &str,
    opts: &LockOptions,
    ttl: Duration,
) -> Vec<Pair> {
    let mut pairs = Vec::with_capacity(HOLDERS);
    for h in 0..HOLDERS {
        let name = ctx.name(&format!("{prefix}-{h}"));
        pairs.push(Pair::start(ctx, name, opts, ttl * 10).await);
    }
    pairs
}

/// Settles every pair once the fault at `fault_at` is over (see
/// [`Pair::settle`]); how many holders kept their lease.
pub(super) async fn settle_all(
    pairs: Vec<Pair>,
    row: &mut Row,
    fault_at: Instant,
    opts: &LockOptions,
    ttl: Duration,
) -> usize {
    let mut kept = 0;
    for p in pairs {
        kept += usize::from(p.settle(row, fault_at, opts, ttl).await);
    }
    kept
}

/// Kills (SIGKILL) the member that leads, once the cluster has a leader
/// (waiting up to 10 s for one), and counts the fault in `row`; returns
/// which member it was and when it was killed. The leader-kill cases, of
/// holders and of schedulers, inject their fault this one way.
pub(super) async fn kill_leader(cluster: &EtcdCluster, row: &mut Row) -> (usize, Instant) {
    let leader = cluster
        .wait_leader(None, Duration::from_secs(10))
        .await
        .expect("the cluster has a leader");
    let fault_at = Instant::now();
    cluster.kill(leader).expect("SIGKILL the leader");
    row.faults += 1;
    (leader, fault_at)
}

/// Kills the leader once per iteration with [`HOLDERS`] holders and their
/// waiters, then restarts it.
pub(super) async fn leader_kill(ctx: Ctx, cluster: Arc<EtcdCluster>, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let mut row = Row::of(&ctx, "chaos_leader_kill");
    let (mut kept, mut lost, mut elections) = (0, 0, Vec::new());
    for i in 0..target.iterations {
        let pairs = start_pairs(&ctx, &format!("leader-kill-{i}"), &opts, ttl).await;
        sleep(ttl).await;
        let (leader, fault_at) = kill_leader(&cluster, &mut row).await;
        let next = cluster
            .wait_leader(Some(leader), ELECTION_WITHIN)
            .await
            .expect("the two survivors elect a leader");
        elections.push(fault_at.elapsed());
        // Past a whole TTL after the fault: a holder whose renewals have not
        // come through by now has lost its lease.
        sleep_until(fault_at + ttl * 2).await;
        let held = settle_all(pairs, &mut row, fault_at, &opts, ttl).await;
        (kept, lost) = (kept + held, lost + HOLDERS - held);
        let restarted = tokio::task::block_in_place(|| cluster.restart(leader));
        restarted.expect("the killed member restarts");
        println!(
            "etcd_cluster: leader m{leader} killed, m{next} elected after {:?}",
            elections.last().copied().unwrap_or_default()
        );
        // The restarted member catches up before the next fault.
        cluster
            .wait_leader(None, ELECTION_WITHIN)
            .await
            .expect("a leader after the restart");
        sleep(ttl).await;
    }
    row.iterations = target.iterations;
    println!(
        "etcd_cluster: leader kill: {kept} holders kept their lease, {lost} lost it; elections {elections:?}; max abort allowed {:?}",
        ttl + tol
    );
    row.finish();
}
