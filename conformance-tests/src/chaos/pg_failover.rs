//! X11 (Postgres): a failover to a streaming standby. Holders and three
//! per-tick `chaos-replica` schedulers reach the primary through the
//! multi-host URL `postgres://P1,P2/db?target_session_attrs=read-write`; the
//! primary is stopped (fast and immediate shutdown in turn: a clean stop and
//! a crash) and, once it is gone, the standby is promoted (`pg_ctl promote`).
//! A new standby of the promoted server is made on the old port before the
//! next iteration, so the URL stays the same.
//!
//! Advisory locks are session state of the primary: none survives. Asserted:
//! - every holder aborts before any lock is granted on the promoted server
//!   (to a successor trying its lock, or to a holder's own reconnect probe);
//! - the successors' grants are on the promoted server (its `pg_locks`);
//! - the fencing sequence, replicated, never goes back: each successor's
//!   token is above its holder's, and the fenced store accepts no stale
//!   write (I2); no guarded write after a deadline (I5); no lock left;
//! - holders reconnect through the same URL: the time from the promotion to
//!   each holder's first successful acquire is the row's reconnect figure;
//! - the scheduler finishes no tick twice, writes under no older token once
//!   a newer run began, misses no more ticks than the outages explain,
//!   finishes a tick on each promoted server, and every tick it reported
//!   finished before a stop has its completion mark on the promoted server
//!   (the tick table replicates; an immediate stop may lose the last second,
//!   which is reported, not counted).
//!
//! The ordering assertion is about safety, not speed: a promotion takes a
//! few hundred milliseconds here, so a library that only noticed the loss
//! at its next renewal could still pass it. The abort figures (the server
//! ends the sessions as it stops, and the library marks the leases lost on
//! that) show how soon holders were told.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{LockGuard, LockName, LockOptions};
use lock_postgres::PostgresBackend;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use super::case_timing;
use super::cases::{wind_down, Handover};
use super::churn::judge;
use super::figures::{self, Row};
use super::holder::{Holder, Resource};
use super::procs::{process_url, replica_args, Journal, Line};
use crate::backends::postgres::standby::{pair_factory, PgPair, StopMode};
use crate::backends::postgres::{PostgresFactory, OP_TIMEOUT};
use crate::mono::now_ns;
use crate::{BackendFactory, Ctx, Replica};

/// Smoke failovers per trial; `CHAOS_SOAK` multiplies them. Each makes a
/// new standby (a base backup), so fewer than the one-server cases.
const SMOKE_ITERATIONS: usize = 2;

/// Locks held across each failover, each with a successor.
const HOLDERS: usize = 2;

/// Scheduler replicas.
const REPLICAS: usize = 3;

/// Longest a successor or a reconnect probe keeps trying after the stop: a
/// promotion on a loaded machine takes a few seconds.
const RETRY_WITHIN: Duration = Duration::from_secs(30);

/// Pause between two tries of a successor or a probe.
const RETRY_EVERY: Duration = Duration::from_millis(50);

/// The scheduler's time per failover, for its run length.
const PER_FAILOVER: Duration = Duration::from_secs(15);

/// The trial `postgres::chaos_failover`, on a primary and standby of its own.
pub(super) fn trial(run_id: &str, bins: &super::Bins) -> Trial {
    let run_id = run_id.to_owned();
    let replica = bins.replica.clone();
    let iterations = figures::iterations(SMOKE_ITERATIONS);
    Trial::test("postgres::chaos_failover", move || {
        let pair =
            PgPair::start().map_err(|e| Failed::from(format!("no primary and standby: {e}")))?;
        let pg = pair_factory(&run_id, pair.url());
        let factory: Arc<dyn BackendFactory> = pg.clone();
        let pair = Arc::new(Mutex::new(pair));
        let shared = Arc::clone(&pair);
        let outcome = super::run_on(factory, &run_id, "chaos_failover", move |ctx| {
            failover(pg, ctx, shared, iterations, replica)
        });
        // The last handle: the servers stop and their dirs go, pass or fail.
        drop(pair);
        outcome
    })
}

/// A replica over its own backend through the factory's (multi-host) URL,
/// with the suite's configuration.
async fn replica_at(f: &PostgresFactory, ctx: &Ctx) -> (Arc<PostgresBackend>, Replica) {
    let url = f.url().expect("the pair's URL");
    super::pg::replica_at(f, ctx, &url).await
}

/// Tries `name` every [`RETRY_EVERY`] until granted (any error, a refused
/// connection or a standby, is tried again) within [`RETRY_WITHIN`]; when it
/// was granted and the guard.
async fn take_when_possible(
    replica: &Replica,
    name: &LockName,
    opts: &LockOptions,
) -> (Instant, LockGuard) {
    let give_up = Instant::now() + RETRY_WITHIN;
    let mut last = String::new();
    while Instant::now() < give_up {
        match replica.locker.try_lock(name, opts).await {
            Ok(guard) => return (Instant::now(), guard),
            Err(e) => last = e.to_string(),
        }
        sleep(RETRY_EVERY).await;
    }
    panic!("{name} was not granted within {RETRY_WITHIN:?} of the stop; last: {last}");
}

/// One lock held across the failover.
struct Held {
    name: LockName,
    resource: Arc<Resource>,
    holder: Holder,
    holder_rep: Replica,
    succ_rep: Replica,
    succ_backend: Arc<PostgresBackend>,
}

/// Runs the pair, wrapped for blocking calls, under `f`.
async fn with_pair<T: Send + 'static>(
    pair: &Arc<Mutex<PgPair>>,
    f: impl FnOnce(&mut PgPair) -> T + Send + 'static,
) -> T {
    let pair = Arc::clone(pair);
    tokio::task::spawn_blocking(move || f(&mut pair.lock().expect("the pair")))
        .await
        .expect("the blocking pair task")
}

async fn failover(
    f: Arc<PostgresFactory>,
    ctx: Ctx,
    pair: Arc<Mutex<PgPair>>,
    iterations: usize,
    replica: PathBuf,
) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let (journal, mut children) = start_schedulers(&ctx, &replica, iterations, ttl).await;
    let mut row = Row::of(&ctx, "chaos_failover");
    let (mut outages, mut stops) = (Vec::new(), Vec::new());
    for i in 0..iterations {
        let mut held = Vec::new();
        for h in 0..HOLDERS {
            let (_, holder_rep) = replica_at(&f, &ctx).await;
            let (succ_backend, succ_rep) = replica_at(&f, &ctx).await;
            let name = ctx.name(&format!("failover-{i}-{h}"));
            let resource = Arc::new(Resource::default());
            let holder = Holder::start(&holder_rep, &name, &opts, Arc::clone(&resource)).await;
            held.push(Held {
                name,
                resource,
                holder,
                holder_rep,
                succ_rep,
                succ_backend,
            });
        }
        sleep(ttl / 2).await;
        assert!(
            held.iter().all(|h| h.holder.handle.is_held()),
            "healthy before the failover"
        );
        // Fast and immediate in turn: a clean shutdown, and a crash.
        let mode = if i % 2 == 0 {
            StopMode::Fast
        } else {
            StopMode::Immediate
        };
        stops.push((now_ns(), mode));
        let (stop_sent, stopped) = with_pair(&pair, move |p| p.stop_primary(mode))
            .await
            .expect("the primary stops");
        let (stop_sent, stopped) = (Instant::from_std(stop_sent), Instant::from_std(stopped));
        row.faults += 1;
        // From the moment the old primary is gone, every successor tries its
        // lock and every holder's replica tries a lock of its own, while
        // the standby is promoted: the first grant anywhere is on the
        // promoted server.
        let successors: Vec<JoinHandle<(Instant, LockGuard)>> = held
            .iter()
            .map(|h| {
                let (rep, name, opts) = (h.succ_rep.clone(), h.name.clone(), opts.clone());
                tokio::spawn(async move { take_when_possible(&rep, &name, &opts).await })
            })
            .collect();
        let probes: Vec<JoinHandle<(Instant, LockGuard)>> = held
            .iter()
            .enumerate()
            .map(|(h, x)| {
                let rep = x.holder_rep.clone();
                let (name, opts) = (ctx.name(&format!("failover-{i}-{h}-again")), opts.clone());
                tokio::spawn(async move { take_when_possible(&rep, &name, &opts).await })
            })
            .collect();
        let promoted = with_pair(&pair, PgPair::promote_standby)
            .await
            .map(Instant::from_std)
            .expect("the standby is promoted");
        let mut grants = Vec::new();
        let mut taken = Vec::new();
        for s in successors {
            let (at, guard) = s.await.expect("successor task");
            grants.push(at);
            taken.push((at, guard));
        }
        for (h, p) in probes.into_iter().enumerate() {
            let (at, guard) = p.await.expect("probe task");
            grants.push(at);
            row.reconnect.push(at - stop_sent);
            guard
                .release()
                .await
                .unwrap_or_else(|e| panic!("holder {h}'s probe releases: {e}"));
        }
        let first_grant = grants.iter().min().copied().expect("a grant");
        assert!(
            first_grant > stopped,
            "a lock was granted before the old primary was gone"
        );
        outages.push(first_grant - stop_sent);
        let primary_port = with_pair(&pair, |p| p.primary().map(|n| n.port()))
            .await
            .expect("the promoted primary");
        for (h, ((acquired_at, succ), x)) in taken.into_iter().zip(held).enumerate() {
            let Held {
                name,
                resource,
                mut holder,
                holder_rep: _,
                succ_rep,
                succ_backend,
            } = x;
            let (lost_at, reason) = holder
                .lost_by(stopped + opts.renew_interval() + OP_TIMEOUT + tol)
                .await
                .expect("the holder learns that its session ended with the old primary");
            row.abort.push(lost_at - stop_sent);
            // The server ends its sessions as the stop begins: that is the loss.
            row.detection.push(lost_at - stop_sent);
            assert!(
                lost_at < first_grant,
                "holder {h} aborted ({reason}) {:?} after a lock was granted on the promoted server",
                lost_at - first_grant
            );
            let pid = succ_backend
                .lock_session_pid(&name)
                .await
                .expect("the successor's pid");
            let on_promoted = with_pair(&pair, move |p| {
                p.primary()?.psql(&format!(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = {pid}"
                ))
            })
            .await
            .expect("pg_locks of the promoted server");
            assert_eq!(
                on_promoted.trim(),
                "1",
                "the successor's lock is on the promoted server (port {primary_port})"
            );
            let token = succ.handle().fencing_token().expect("fenced");
            assert!(
                token > holder.token,
                "the fencing sequence went back: {token} after {} on the old primary",
                holder.token
            );
            let (writes, _) = holder.writes_after_loss(ttl).await;
            assert!(writes > 0, "the holder wrote before the failover");
            let late = resource.log.after_deadline();
            let h = Handover::new(&succ_rep.locker, &name, &opts);
            wind_down(&mut row, h, succ, &resource, acquired_at, (writes, late)).await;
        }
        println!(
            "postgres::chaos_failover: {mode:?} stop {:?}, promote {:?}, first grant on the promoted server {:?} after the stop",
            stopped - stop_sent,
            promoted.saturating_duration_since(stopped),
            first_grant - stop_sent
        );
        wait_finished_after(&journal, stops.last().map_or(0, |s| s.0)).await;
        if i + 1 < iterations {
            with_pair(&pair, PgPair::rebuild_standby)
                .await
                .expect("a new standby of the promoted server");
        }
    }
    row.iterations = iterations;
    let sched = finish_schedulers(&ctx, &journal, &mut children, &pair, &outages, &stops).await;
    row.finish();
    assert!(sched.is_empty(), "scheduler: {}", sched.join("; "));
}

/// Starts [`REPLICAS`] per-tick schedulers on the URL and waits for a run.
async fn start_schedulers(
    ctx: &Ctx,
    replica: &Path,
    iterations: usize,
    ttl: Duration,
) -> (Journal, Vec<tokio::process::Child>) {
    let run_for = PER_FAILOVER * (u32::try_from(iterations).unwrap_or(8) + 2);
    let args = replica_args(process_url(ctx), "per-tick", ttl, run_for);
    let (journal, _feed) = Journal::new();
    let children: Vec<_> = (0..REPLICAS)
        .map(|w| journal.spawn(w, replica, &args, None))
        .collect();
    journal.wait_first_run().await;
    (journal, children)
}

/// Waits until some replica finished a tick after `since` (monotonic ns):
/// the schedulers run on the promoted server.
async fn wait_finished_after(journal: &Journal, since: u64) {
    let give_up = Instant::now() + RETRY_WITHIN;
    while !finished_after(&journal.lines(), since) {
        assert!(
            Instant::now() < give_up,
            "no tick finished on the promoted server within {RETRY_WITHIN:?}"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

fn finished_after(lines: &[Line], since: u64) -> bool {
    lines.iter().any(|l| l.kind() == "END" && l.mono > since)
}

/// Waits for a tick finished after the last failover, stops the
/// schedulers, judges their journal (a row of its own) and checks that the
/// ticks finished before each stop are marked on the promoted server;
/// returns what failed.
async fn finish_schedulers(
    ctx: &Ctx,
    journal: &Journal,
    children: &mut [tokio::process::Child],
    pair: &Arc<Mutex<PgPair>>,
    outages: &[Duration],
    stops: &[(u64, StopMode)],
) -> Vec<String> {
    let ttl = ctx.timing().ttl;
    for child in children.iter_mut() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    journal.drained(Duration::from_secs(5)).await;
    let lines = journal.lines();
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case: "chaos_failover_scheduler_per_tick".to_owned(),
        iterations: stops.len(),
        faults: stops.len(),
        detection: outages.to_vec(),
        ..Row::default()
    };
    // The job could not run from the stop until the first grant on the
    // promoted server, then up to two TTLs for runs under way to end.
    let windows: Vec<Duration> = outages.iter().map(|o| *o + ttl * 2).collect();
    let mut failed = judge(&lines, &windows, &mut row);
    failed.extend(missing_marks(&lines, pair, stops).await);
    figures::record(row);
    failed
}

/// Ticks reported finished (`OUTCOME … success`) before a stop whose
/// completion mark the promoted server does not have. An immediate stop
/// may lose what was committed but not yet streamed: ticks finished in the
/// second before one are not counted as missing (they are reported).
async fn missing_marks(
    lines: &[Line],
    pair: &Arc<Mutex<PgPair>>,
    stops: &[(u64, StopMode)],
) -> Vec<String> {
    let last_stop = stops.last().map_or(0, |s| s.0);
    let may_be_lost = |mono: u64| {
        stops
            .iter()
            .any(|(at, m)| *m == StopMode::Immediate && mono < *at && at - mono < 1_000_000_000)
    };
    let finished: Vec<&Line> = lines
        .iter()
        .filter(|l| l.kind() == "OUTCOME" && l.words.get(2).is_some_and(|w| w == "success"))
        .filter(|l| l.mono < last_stop)
        .collect();
    let unsure: Vec<i64> = finished
        .iter()
        .filter(|l| may_be_lost(l.mono))
        .map(|l| l.num(1))
        .collect();
    let done: Vec<i64> = finished
        .iter()
        .filter(|l| !may_be_lost(l.mono))
        .map(|l| l.num(1))
        .collect();
    let marks = with_pair(pair, |p| {
        p.primary()?
            .psql("SELECT tick FROM public.lock_ticks_marks ORDER BY tick")
    })
    .await
    .expect("the promoted server's tick marks");
    let marks: Vec<i64> = marks
        .lines()
        .filter_map(|t| t.trim().parse().ok())
        .collect();
    // Marks a minute older than the latest are pruned by design.
    let kept_from = marks.last().map_or(i64::MIN, |t| t - 55_000);
    let missing: Vec<i64> = done
        .iter()
        .filter(|t| **t >= kept_from && !marks.contains(t))
        .copied()
        .collect();
    let unsure_kept = unsure.iter().filter(|t| marks.contains(t)).count();
    println!(
        "postgres::chaos_failover: {} ticks finished before the last stop, {} marks on the promoted server, {} missing; {} finished within 1 s of an immediate stop, {unsure_kept} of them marked",
        done.len() + unsure.len(),
        marks.len(),
        missing.len(),
        unsure.len()
    );
    if done.is_empty() {
        return vec!["no tick finished before the last stop".to_owned()];
    }
    if missing.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "ticks finished before a stop but not marked on the promoted server: {missing:?}"
        )]
    }
}
