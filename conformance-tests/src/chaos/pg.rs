//! Postgres in the fault suite, against one private server shared by its
//! trials (never `DATABASE_URL`: the cases freeze, cut and kill sessions):
//!
//! - X1 `chaos_holder_pause`: a `chaos-holder` process is stopped for
//!   1.5 × TTL;
//! - X2 `chaos_server_stall`: the holder's server process (its backend, found
//!   in `pg_locks`) is stopped for 1.5 × TTL; `chaos_retain_stall` (in
//!   `pg_retain`) stops it while the holder sets a retained hold;
//! - X3 `chaos_partition`: the holder's connection runs through the fault
//!   proxy, which blackholes it for 2 × TTL while nftables drops the proxy's
//!   leg to the server, so that the server hears nothing either;
//! - X8 `chaos_session_kill`: `pg_terminate_backend` of the holder's session
//!   at a random idle point, and while a renewal is in flight; the holder is
//!   told before the successor can get the lock;
//! - X11 `chaos_failover` (in `pg_failover`), on a primary and streaming
//!   standby of its own: the primary is stopped and the standby promoted.
//!
//! Postgres locks are session-scoped: the server keeps a lock for as long as
//! the session that took it is open, whatever the client's TTL says. Where a
//! TTL backend hands the lock to a successor while its holder is stopped or
//! cut off, Postgres must not; and once the holder's own deadline has passed
//! the library must let go of the server lock (unlock it, or end the
//! session), not leave it orphaned. The pause, stall and partition cases assert
//! both; every case asserts the suite's I2 (no stale write accepted) and I5
//! (no guarded write after the deadline), and that no lock is left behind.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{Error, LockGuard, LockName, LockOptions, LossReason, RenewalOutcome};
use lock_postgres::{AdvisoryKey, PostgresBackend, PostgresBuilder, PostgresConfig};
use tokio::process::Command;
use tokio::task::JoinHandle;
use tokio::time::{sleep, sleep_until, Instant};
use tokio_postgres::Client;

use super::case_timing;
use super::cases::{
    aborted_in_time, lost_holder_winds_down, refused_during_fault, successor_takes, wind_down,
    Handover,
};
use super::figures::{self, Row};
use super::holder::{stops_saying_held, Holder, Resource, PUSH_LAG};
use super::pause::{apply, successor_at, Reports};
use super::procs::signal;
use crate::backends::postgres::{
    self as pg, client_port, holder_pid, nft_installed, plain_session, terminate, Blackhole,
    Frozen, PostgresFactory,
};
use crate::harness::unavailable;
use crate::proxy::FaultProxy;
use crate::{BackendFactory, Ctx, Replica};

/// Smoke iterations per case (X8 kills twice per iteration).
const SMOKE_ITERATIONS: usize = 3;

/// The `application_name` of the cases' inspecting session.
const INSPECTOR: &str = "lock-ct-chaos-inspector";

/// The Postgres chaos trials, sharing one private server that starts with
/// the first of them and stops when the last is done.
pub(super) fn trials(run_id: &str, bins: &super::Bins) -> Vec<Trial> {
    let factory = match pg::private_factory(run_id) {
        Ok(f) => f,
        Err(e) => {
            let why = format!("postgres: {e}");
            return unavailable("postgres::chaos_server_available", &why)
                .into_iter()
                .collect();
        }
    };
    let iterations = figures::iterations(SMOKE_ITERATIONS);
    let holder = bins.holder.clone();
    let mut out = vec![
        trial("chaos_holder_pause", &factory, run_id, move |f, ctx| {
            holder_pause(f, ctx, iterations, holder)
        }),
        trial("chaos_server_stall", &factory, run_id, move |f, ctx| {
            server_stall(f, ctx, iterations)
        }),
        trial("chaos_retain_stall", &factory, run_id, |f, ctx| {
            super::pg_retain::retain_stall(f, ctx)
        }),
    ];
    if nft_installed() {
        out.push(trial("chaos_partition", &factory, run_id, move |f, ctx| {
            partition(f, ctx, iterations)
        }));
    } else {
        out.extend(unavailable(
            "postgres::chaos_partition",
            "nft is not installed (apt-get install nftables)",
        ));
    }
    out.push(trial(
        "chaos_session_kill",
        &factory,
        run_id,
        move |f, ctx| session_kill(f, ctx, iterations),
    ));
    let target = super::Target {
        op_timeout: pg::OP_TIMEOUT,
        iterations,
        scheme: "postgres",
    };
    let holder = bins.holder.clone();
    out.push(trial(
        "chaos_clock_step_holder",
        &factory,
        run_id,
        move |_, ctx| async move {
            super::clock::holder_clock_step(ctx, target, &holder).await;
        },
    ));
    let replica = bins.replica.clone();
    out.push(trial(
        "chaos_clock_step_scheduler",
        &factory,
        run_id,
        move |_, ctx| async move {
            super::clock::scheduler_clock_step(ctx, &replica).await;
        },
    ));
    out.push(trial(
        "chaos_flap",
        &factory,
        run_id,
        move |_, ctx| async move {
            super::flap::flap(ctx, target).await;
        },
    ));
    let replica = bins.replica.clone();
    out.push(trial(
        "chaos_leader_churn",
        &factory,
        run_id,
        move |_, ctx| async move {
            super::churn::leader_churn(ctx, target, &replica).await;
        },
    ));
    for plan in super::frozen::PLANS {
        let replica = bins.replica.clone();
        out.push(
            trial(plan.case, &factory, run_id, move |_, ctx| async move {
                super::frozen::frozen_after_handler(ctx, plan, &replica).await;
            })
            .with_ignored_flag(!plan.included()),
        );
    }
    // On a primary and standby of its own: it stops the primary.
    out.push(super::pg_failover::trial(run_id, bins));
    out
}

fn trial<F, Fut>(case: &'static str, factory: &Arc<PostgresFactory>, run_id: &str, body: F) -> Trial
where
    F: FnOnce(Arc<PostgresFactory>, Ctx) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (f, run_id) = (Arc::clone(factory), run_id.to_owned());
    Trial::test(format!("postgres::{case}"), move || {
        // Started here, outside the case's runtime: it blocks for seconds.
        f.private_started()
            .map_err(|e| Failed::from(format!("no server: {e}")))?;
        let as_dyn: Arc<dyn BackendFactory> = f.clone();
        super::run_on(as_dyn, &run_id, case, move |ctx| body(f, ctx))
    })
}

/// What every case sets up: the server's URL, the suite's configuration
/// (for key mapping and the op timeout) and an inspecting session.
pub(super) struct Setup {
    pub(super) url: String,
    pub(super) config: PostgresConfig,
    inspector: Client,
    port: u16,
}

impl Setup {
    pub(super) async fn new(f: &PostgresFactory) -> Self {
        let url = f.url().expect("the private server runs");
        let config = f
            .builder_for(&url)
            .expect("configuration")
            .config()
            .expect("the configuration builds");
        let inspector = plain_session(&url, INSPECTOR)
            .await
            .expect("the inspector connects");
        let port = f.private_started().expect("started").port();
        Self {
            url,
            config,
            inspector,
            port,
        }
    }

    /// Whether server process `pid` has left `pg_stat_activity` within
    /// `within`: its session ended, and with it every lock it held.
    async fn session_ends(&self, pid: i32, within: Duration) -> bool {
        let give_up = Instant::now() + within;
        loop {
            let alive = self
                .inspector
                .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
                .await
                .expect("pg_stat_activity can be read")
                .is_some();
            if !alive {
                return true;
            }
            if Instant::now() >= give_up {
                return false;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether server process `pid` holds no advisory lock (or is gone)
    /// within `within`.
    pub(super) async fn holds_nothing(&self, pid: i32, within: Duration) -> bool {
        let give_up = Instant::now() + within;
        loop {
            let locks: i64 = self
                .inspector
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
                    &[&pid],
                )
                .await
                .expect("pg_locks can be read")
                .get(0);
            if locks == 0 {
                return true;
            }
            if Instant::now() >= give_up {
                return false;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// The server process holding `key`, from `pg_locks`.
    pub(super) async fn holder_of(&self, key: AdvisoryKey) -> Option<i32> {
        holder_pid(&self.inspector, key)
            .await
            .expect("pg_locks can be read")
    }
}

/// A replica of its own over the suite's configuration at `url`.
pub(super) async fn replica_at(
    f: &PostgresFactory,
    ctx: &Ctx,
    url: &str,
) -> (Arc<PostgresBackend>, Replica) {
    let config = f
        .builder_for(url)
        .expect("configuration")
        .config()
        .expect("the configuration builds");
    let backend = Arc::new(
        PostgresBackend::connect(config)
            .await
            .expect("the replica connects"),
    );
    let replica = ctx.replica_over(backend.clone());
    (backend, replica)
}

/// The successor, waiting in the background for `name` (up to `wait`) and
/// writing once under its token when it gets it.
fn successor_waits(
    successor: &Replica,
    name: &LockName,
    opts: &LockOptions,
    wait: Duration,
    resource: &Arc<Resource>,
) -> JoinHandle<(Instant, LockGuard)> {
    let (s, n, o, r) = (
        successor.clone(),
        name.clone(),
        opts.clone(),
        Arc::clone(resource),
    );
    tokio::spawn(async move { successor_takes(&s, &n, &o, wait, &r).await })
}

/// Closes a case's `row` after its `iterations`, first saying `note` (what
/// the figures table does not show) on stdout.
fn finish(mut row: Row, iterations: usize, note: String) {
    row.iterations = iterations;
    println!("postgres::{}: {note}", row.case);
    row.finish();
}

/// `min/p50/max` in milliseconds.
fn spread(samples: &[Duration]) -> String {
    let mut ms: Vec<u128> = samples.iter().map(Duration::as_millis).collect();
    ms.sort_unstable();
    match (ms.first(), ms.get(ms.len() / 2), ms.last()) {
        (Some(lo), Some(mid), Some(hi)) => format!("{lo}/{mid}/{hi} ms"),
        _ => "-".to_owned(),
    }
}

/// X1: the holder process is stopped for 1.5 × TTL. Its session stays open
/// (the kernel keeps its socket), so the server keeps the lock: the
/// successor is refused for the whole pause. After the thaw the holder's
/// first guard fails (its local deadline passed while it was stopped), and
/// its heartbeat releases the server lock even though the job still holds
/// its guard (it lingers for a TTL before releasing): the successor gets the
/// lock within the tolerance, before the holder lets go or exits.
async fn holder_pause(f: Arc<PostgresFactory>, ctx: Ctx, iterations: usize, holder: PathBuf) {
    let timing = ctx.timing();
    let (ttl, tol) = (timing.ttl, timing.tolerance);
    let setup = Setup::new(&f).await;
    // The holder and the successor connect as a user of the library would,
    // with the default configuration; the key follows from it.
    let default_config = PostgresBuilder::from_url(&setup.url)
        .and_then(PostgresBuilder::config)
        .expect("the default configuration builds");
    let successor = successor_at(&setup.url).await;
    let opts = LockOptions::new(ttl);
    let mut row = Row::of(&ctx, "chaos_holder_pause");
    let mut handed_over = Vec::new();
    for i in 0..iterations {
        let name = ctx.name(&format!("pause-{i}"));
        let key = default_config.key_for(&name);
        let resource = Arc::new(Resource::default());
        let mut child = Command::new(&holder)
            .arg(&setup.url)
            .arg(name.as_str())
            .arg(ttl.as_millis().to_string())
            .arg((ttl * 10).as_millis().to_string())
            .arg("--linger-ms")
            .arg(ttl.as_millis().to_string())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the holder starts");
        let mut reports = Reports::new(child.stdout.take().expect("piped stdout"));
        let token = reports.acquired(ttl * 5).await;
        let (mut writes, mut late) = reports.healthy_writes(ttl, &resource).await;
        let pid = setup
            .holder_of(key)
            .await
            .expect("pg_locks shows the holder's session");
        signal(&child, "STOP");
        let stopped_at = Instant::now();
        row.faults += 1;
        let thaw_at = stopped_at + ttl * 3 / 2;
        // Writes made before the stop are applied now, so that everything
        // read after the thaw was done after it.
        while let Some(line) = reports.poll(Duration::from_millis(100)).await {
            assert!(
                apply(&line, &resource, &mut late),
                "a stopped holder reported {line:?}"
            );
            writes += 1;
        }
        // Session-scoped: nobody else gets the lock while the holder is stopped.
        let mut refusals = 0;
        while Instant::now() + Duration::from_millis(200) < thaw_at {
            match successor.try_lock(&name, &opts).await {
                Err(Error::HeldElsewhere { .. }) => refusals += 1,
                Ok(_) => panic!("the lock of a stopped (connected) holder was handed out"),
                Err(e) => panic!("the successor's try failed: {e}"),
            }
            sleep(Duration::from_millis(100)).await;
        }
        assert!(refusals > 0, "the successor never tried during the pause");
        assert_eq!(
            setup.holder_of(key).await,
            Some(pid),
            "the stopped holder's session keeps the lock"
        );
        sleep_until(thaw_at).await;
        let waiter = {
            let (s, n, o) = (successor.clone(), name.clone(), opts.clone());
            tokio::spawn(async move {
                let guard = s
                    .lock(&n, &o.with_acquire_timeout(ttl * 4))
                    .await
                    .expect("the successor acquires after the thaw");
                (Instant::now(), guard)
            })
        };
        let resumed_at = Instant::now();
        signal(&child, "CONT");
        let lost_line = reports
            .next(ttl)
            .await
            .expect("the holder reports after the thaw");
        let lost_seen = Instant::now();
        assert!(
            lost_line.starts_with("LOST"),
            "the first guard after the thaw passed: {lost_line:?}"
        );
        let abort = lost_seen - resumed_at;
        row.abort.push(abort);
        assert!(
            abort <= tol,
            "the holder saw its loss {abort:?} after the thaw"
        );
        let (acquired_at, guard) = waiter.await.expect("successor task");
        let still_running = child.try_wait().expect("try_wait").is_none();
        handed_over.push(acquired_at.saturating_duration_since(resumed_at));
        assert!(
            still_running,
            "the successor got the lock only once the holder process had exited"
        );
        assert!(
            acquired_at <= resumed_at + tol,
            "the successor acquired {:?} after the thaw",
            acquired_at - resumed_at
        );
        if acquired_at < lost_seen {
            row.overlaps += 1;
        }
        let succ_token = guard.handle().fencing_token().expect("fenced");
        assert!(succ_token > token, "the successor's token is newer");
        assert!(resource.write(succ_token), "the successor writes");
        let status = tokio::time::timeout(ttl * 3, child.wait())
            .await
            .expect("the holder exits after its linger")
            .expect("wait");
        assert!(status.success(), "the holder exited with {status}");
        while let Some(line) = reports.poll(Duration::from_millis(50)).await {
            assert!(
                !apply(&line, &resource, &mut late),
                "the holder wrote after its loss"
            );
        }
        let h = Handover::new(&successor, &name, &opts);
        wind_down(&mut row, h, guard, &resource, acquired_at, (writes, late)).await;
    }
    finish(
        row,
        iterations,
        format!("successor acquired {} after the thaw", spread(&handed_over)),
    );
}

/// X2: the holder's server process is stopped (SIGSTOP) for 1.5 × TTL. Calls
/// on that session give up by the op timeout; the holder aborts by its
/// local deadline with `backend_error`; the frozen session keeps the lock,
/// so the successor, waiting from the moment of the freeze, gets it only
/// after the thaw, and then within the op timeout: the releases that timed
/// out on the frozen session (the lost lease's, and the cleanup of an
/// acquire that timed out) are still queued on it, and run on the thaw.
/// The session itself may stay: it is healthy again, and a slow server is
/// no reason to drop the other locks a process holds on it.
async fn server_stall(f: Arc<PostgresFactory>, ctx: Ctx, iterations: usize) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let setup = Setup::new(&f).await;
    let op_timeout = setup.config.statement_timeout();
    let (_, successor) = replica_at(&f, &ctx, &setup.url).await;
    let mut row = Row::of(&ctx, "chaos_server_stall");
    let mut after_thaw = Vec::new();
    for i in 0..iterations {
        let (backend, holder_rep) = replica_at(&f, &ctx, &setup.url).await;
        let name = ctx.name(&format!("stall-{i}"));
        let key = setup.config.key_for(&name);
        let (mut holder, resource) = Holder::healthy(&holder_rep, &name, &opts, ttl).await;
        let pid = setup
            .holder_of(key)
            .await
            .expect("pg_locks shows the holder's session");
        assert_eq!(
            Some(pid),
            backend.lock_session_pid(&name).await.ok(),
            "pg_locks names the holder's own session"
        );
        // Another call on the frozen session gives up in time: a name the
        // backend puts on that session (names are spread over its lock
        // sessions by hash), found before the freeze.
        let mut probe_name = ctx.name(&format!("stall-probe-{i}"));
        for k in 0..256 {
            if backend.lock_session_pid(&probe_name).await.ok() == Some(pid) {
                break;
            }
            probe_name = ctx.name(&format!("stall-probe-{i}-{k}"));
        }
        assert_eq!(
            backend.lock_session_pid(&probe_name).await.ok(),
            Some(pid),
            "setup: a probe name on the holder's lock session"
        );
        let fault_at = Instant::now();
        let deadline = fault_at + holder.handle.remaining_validity().expect("a deadline");
        let frozen = Frozen::stop(pid).expect("SIGSTOP the holder's server process");
        row.faults += 1;
        let thaw_at = fault_at + ttl * 3 / 2;
        let waiter = successor_waits(&successor, &name, &opts, ttl * 4, &resource);
        let refused = "nothing is granted by a frozen session";
        let blocked =
            refused_during_fault(&mut row, &holder_rep, &probe_name, &opts, refused).await;
        let lost = holder.lost_by(thaw_at).await;
        assert_eq!(
            setup.holder_of(key).await,
            Some(pid),
            "the frozen (not dead) session keeps its lock"
        );
        sleep_until(thaw_at).await;
        let thaw_sent = Instant::now();
        drop(frozen);
        let expect = "the holder aborted while its session was frozen";
        let (_, reason) = aborted_in_time(&mut row, lost, expect, fault_at, deadline, tol);
        assert_eq!(reason, LossReason::BackendError, "why the holder aborted");
        let (acquired_at, succ) = waiter.await.expect("successor task");
        assert!(
            acquired_at > thaw_sent,
            "the lock of a frozen session was handed out"
        );
        after_thaw.push(acquired_at - thaw_sent);
        assert!(
            setup.holds_nothing(pid, op_timeout + tol).await,
            "the frozen session still holds a lock after its thaw: a release that timed out \
             on it never ran"
        );
        assert!(
            acquired_at <= thaw_sent + op_timeout + tol,
            "the successor acquired {:?} after the thaw",
            acquired_at - thaw_sent
        );
        let writes = holder.superseded_by(&succ, ttl).await;
        assert!(writes > 0, "the holder wrote before the fault");
        let late = resource.log.after_deadline();
        let h = Handover::new(&successor.locker, &name, &opts);
        wind_down(&mut row, h, succ, &resource, acquired_at, (writes, late)).await;
        row.leaked += usize::from(setup.holder_of(key).await.is_some());
        assert!(
            blocked <= op_timeout + tol,
            "a call blocked {blocked:?} on the frozen session"
        );
    }
    finish(
        row,
        iterations,
        format!("successor acquired {} after the thaw", spread(&after_thaw)),
    );
}

/// X3: the holder reaches the server through the fault proxy, which
/// blackholes the connection for 2 × TTL; nftables drops the proxy's leg to
/// the server meanwhile, so the server's TCP hears nothing (the proxy's
/// kernel would otherwise answer its keepalives). The successor connects
/// directly and waits from the moment of the cut. The holder aborts by its
/// local deadline; the server frees the lock when its keepalive and
/// `tcp_user_timeout` (set by the library from `max_ttl`: 3 s here) give up
/// on the silent peer: within that timeout of the cut, strictly after the
/// abort.
async fn partition(f: Arc<PostgresFactory>, ctx: Ctx, iterations: usize) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let setup = Setup::new(&f).await;
    let upstream = SocketAddr::from(([127, 0, 0, 1], setup.port));
    let proxy = FaultProxy::start(upstream).await.expect("proxy starts");
    let via = format!("postgres://postgres@{}/postgres", proxy.addr());
    let (_, successor) = replica_at(&f, &ctx, &setup.url).await;
    let mut row = Row::of(&ctx, "chaos_partition");
    let mut freed = Vec::new();
    // What the library sets on its session (see lock-postgres): the server
    // gives up on a silent peer this long after it last heard from it.
    let user_timeout = Duration::from_secs(setup.config.max_ttl().as_secs_f64().ceil() as u64 + 1);
    for i in 0..iterations {
        // A fresh connection each time: a blackhole drops bytes mid-stream.
        let (backend, holder_rep) = replica_at(&f, &ctx, &via).await;
        let name = ctx.name(&format!("partition-{i}"));
        let key = setup.config.key_for(&name);
        let (mut holder, resource) = Holder::healthy(&holder_rep, &name, &opts, ttl).await;
        let pid = backend
            .lock_session_pid(&name)
            .await
            .expect("the session's pid");
        assert_eq!(setup.holder_of(key).await, Some(pid), "pg_locks");
        let leg = tokio::task::block_in_place(|| client_port(setup.port, pid))
            .expect("the proxy's port towards the server");
        let fault_at = Instant::now();
        let deadline = fault_at + holder.handle.remaining_validity().expect("a deadline");
        proxy.blackhole(true);
        let hole = Blackhole::cut(leg, setup.port).expect("nft cuts the proxy's leg");
        row.faults += 1;
        let waiter = successor_waits(&successor, &name, &opts, ttl * 5, &resource);
        let (lost_at, reason) = holder
            .lost_by(deadline + tol)
            .await
            .expect("the holder aborts by its local deadline");
        row.abort.push(lost_at - fault_at);
        let renewed = holder_rep
            .metrics
            .renewals(name.as_str(), RenewalOutcome::Renewed);
        sleep_until(fault_at + ttl * 2).await;
        proxy.blackhole(false);
        drop(hole);
        let (acquired_at, succ) = waiter.await.expect("successor task");
        assert!(
            lost_at < acquired_at,
            "the successor acquired {:?} after the cut, before the holder aborted ({reason})",
            acquired_at - fault_at
        );
        freed.push(acquired_at - fault_at);
        assert!(
            acquired_at <= fault_at + user_timeout + tol,
            "the server freed the silent holder's lock only {:?} after the cut \
             (tcp_user_timeout {user_timeout:?})",
            acquired_at - fault_at
        );
        assert!(
            setup.session_ends(pid, tol).await,
            "the partitioned session still exists after its lock was freed"
        );
        sleep(opts.renew_interval() * 2).await;
        assert!(
            holder.handle.assert_held().is_err(),
            "the old lease stays lost after healing"
        );
        assert_eq!(
            holder_rep
                .metrics
                .renewals(name.as_str(), RenewalOutcome::Renewed),
            renewed,
            "the old holder renewed after its loss"
        );
        let h = Handover::new(&successor.locker, &name, &opts);
        lost_holder_winds_down(&mut row, holder, ttl, h, succ, &resource, acquired_at).await;
        row.leaked += usize::from(setup.holder_of(key).await.is_some());
    }
    finish(
        row,
        iterations,
        format!(
            "server freed the partitioned holder's lock {} after the cut",
            spread(&freed)
        ),
    );
}

/// Bytes waiting in the receive queue of server process `pid`'s socket.
async fn recv_queue(port: u16, pid: i32) -> usize {
    let out = Command::new("ss")
        .args(["-tnHp", "state", "established"])
        .arg(format!("( sport = :{port} )"))
        .output()
        .await
        .expect("ss runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains(&format!("pid={pid},")))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|q| q.parse().ok())
        .unwrap_or_else(|| panic!("ss shows no socket of pid {pid}:\n{text}"))
}

/// X8: the holder's session is killed with `pg_terminate_backend`, at a
/// random idle point or while a renewal is in flight (the server process is
/// stopped until the renewal is in its socket, then terminated and resumed).
/// The successor starts at the kill. A terminating server sends its error
/// to the session before it frees the session's locks, and the library
/// marks the lease lost on that error. The successor's grant can still
/// reach this process in the same instant as the holder's notice (always
/// possible under load, likeliest after a kill during a renewal): an
/// overlap is counted, and the holder's lease must stop saying held within
/// `PUSH_LAG` of the grant (asserted). The fenced store
/// must reject the holder's writes from the successor's first write on. The
/// holder aborts within renew interval + op timeout of the kill.
async fn session_kill(f: Arc<PostgresFactory>, ctx: Ctx, iterations: usize) {
    let timing = ctx.timing();
    let (ttl, tol) = (timing.ttl, timing.tolerance);
    let opts = ctx.opts();
    let setup = Setup::new(&f).await;
    let bound = opts.renew_interval() + setup.config.statement_timeout();
    let (_, successor) = replica_at(&f, &ctx, &setup.url).await;
    let mut row = Row::of(&ctx, "chaos_session_kill");
    let mut detection: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for i in 0..iterations {
        for in_renewal in [false, true] {
            let (_, holder_rep) = replica_at(&f, &ctx, &setup.url).await;
            let name = ctx.name(&format!("kill-{i}-{}", u8::from(in_renewal)));
            let key = setup.config.key_for(&name);
            let resource = Arc::new(Resource::default());
            let mut holder = Holder::start(&holder_rep, &name, &opts, Arc::clone(&resource)).await;
            // A random point within the first renewal intervals.
            let span = u64::try_from(ttl.as_millis() / 2).unwrap_or(1).max(1);
            sleep(ttl / 10 + Duration::from_millis(getrandom::u64().unwrap_or(0) % span)).await;
            assert!(holder.handle.is_held(), "healthy before the kill");
            let pid = setup
                .holder_of(key)
                .await
                .expect("pg_locks shows the holder's session");
            let killed_at = if in_renewal {
                let frozen = Frozen::stop(pid).expect("SIGSTOP the session's process");
                let give_up = Instant::now() + opts.renew_interval() + tol;
                while recv_queue(setup.port, pid).await == 0 {
                    assert!(
                        Instant::now() < give_up,
                        "no renewal reached the stopped session"
                    );
                    sleep(Duration::from_millis(5)).await;
                }
                // Without a wait: the process acts on it once resumed.
                let sent: bool = setup
                    .inspector
                    .query_one("SELECT pg_terminate_backend($1)", &[&pid])
                    .await
                    .expect("pg_terminate_backend")
                    .get(0);
                assert!(sent, "pg_terminate_backend({pid})");
                let at = Instant::now();
                drop(frozen);
                at
            } else {
                let at = Instant::now();
                terminate(&setup.inspector, pid)
                    .await
                    .expect("pg_terminate_backend");
                at
            };
            row.faults += 1;
            let waiter = {
                let (s, n, o, r) = (
                    successor.clone(),
                    name.clone(),
                    opts.clone(),
                    Arc::clone(&resource),
                );
                let old = holder.handle.clone();
                tokio::spawn(async move {
                    let guard = s
                        .locker
                        .lock(&n, &o.with_acquire_timeout(ttl * 2))
                        .await
                        .expect("the successor acquires after the kill");
                    // Asked first, stamped after: a lease that says lost
                    // here was lost before `acquired_at`.
                    let overlapped = old.is_held();
                    let acquired_at = Instant::now();
                    let lag = overlapped.then(|| {
                        tokio::spawn(async move { stops_saying_held(&old, PUSH_LAG).await })
                    });
                    let token = guard.handle().fencing_token().expect("fenced");
                    assert!(r.write(token), "the successor's first write is accepted");
                    // From here on the store knows the newer token.
                    (acquired_at, lag, Instant::now(), guard)
                })
            };
            let (lost_at, reason) = holder
                .lost_by(killed_at + bound + tol)
                .await
                .expect("the holder learns of the kill within renew interval + op timeout");
            row.abort.push(lost_at - killed_at);
            row.detection.push(lost_at - killed_at);
            detection[usize::from(in_renewal)].push(lost_at - killed_at);
            assert!(
                matches!(reason, LossReason::Expired | LossReason::Stolen),
                "a killed session is reported as {reason}"
            );
            let (acquired_at, lag, fenced_from, succ) = waiter.await.expect("successor task");
            // The holder's watcher task may stamp `lost_at` after
            // `acquired_at` (a scheduling delay) although the lease said
            // lost by then: the overlap is whether it still said held.
            row.overlaps += usize::from(lag.is_some());
            // The successor starts once the killed process is gone, after
            // its farewell reached the holder's socket; but which of the two
            // this process handles first is its scheduler's choice (after a
            // kill during a renewal the two arrive within a fraction of a
            // millisecond). Counted, and the old lease must stop saying held
            // within PUSH_LAG of the grant.
            let heard = match lag {
                Some(t) => t.await.expect("overlap timing task"),
                None => Some(Duration::ZERO),
            };
            assert!(
                heard.is_some(),
                "the successor got the lock {:?} after the kill and the killed session's lease \
                 still said held {PUSH_LAG:?} later (the holder learnt of it {:?} after the kill)",
                acquired_at - killed_at,
                lost_at - killed_at
            );
            let writes = holder.superseded_by(&succ, ttl).await;
            let late = resource.log.after_deadline();
            let h = Handover::new(&successor.locker, &name, &opts);
            wind_down(&mut row, h, succ, &resource, fenced_from, (writes, late)).await;
            row.leaked += usize::from(setup.holder_of(key).await.is_some());
        }
    }
    finish(
        row,
        iterations,
        format!(
            "holder aborted {} after an idle kill, {} after a kill during renewal",
            spread(&detection[0]),
            spread(&detection[1])
        ),
    );
}
