//! The crash matrix: a replica that dies at each point of the tick protocol,
//! beside a replica whose clock is 4 s behind, in both delivery modes, on
//! every backend row. One tick per cell; the twelve cells run at once.
//!
//! 4 s, where the pause matrix has 3: the survivor tries the tick's lock
//! once, when its clock reaches the tick, and the dead replica's lock (2 s
//! TTL, taken just after the tick) must have run out by then. 3 s left about
//! a second for that on a loaded machine, less on etcd, whose server ends an
//! expired lease up to half a second late; 4 s leaves two.
//!
//! The death is a whole scheduler's: at its step the replica stops reaching
//! the server (every backend call fails from then on, so no renewal or
//! release leaves it) and its tasks are dropped, heartbeat included, so its
//! locks are left to expire. Against a real server the replica runs on a
//! tokio runtime of its own, built on its own thread with its own backend
//! connections, and that runtime is shut down: its connections close, so a
//! session backend (Postgres) ends its session and frees its locks as a
//! killed process's would. On the paused clock (memory) there is no
//! connection to close; the replica's scheduler is dropped and its backend
//! refuses every call, so its locks run out by their TTL.
//!
//! Asserted on every row: at most once, no tick's handler is called twice,
//! and a tick the dead replica left `Started` is marked `Abandoned` by the
//! replica behind, once (counted); at least once, the tick is `Completed`
//! once, with the highest token any run of it held.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use lock_core::TickStore;
use scheduler::{Delivery, Scheduler, TokioClock, WallClock};
use tokio::sync::{oneshot, Semaphore};

use super::fleet::Fleet;
use super::pause::{matrix, Action, Cell, Expect, ReplicaPlan, Step, REPORT_SLACK, TTL};
use crate::faulty::{Fault, FaultyBackend};
use crate::Ctx;

/// How far the survivor's clock is behind the dying replica's (see above).
const SURVIVOR_BEHIND_MS: i64 = -4_000;

/// How long a replica waits for its step before giving up on dying: past
/// the tick on its clock, with slack.
const DEATH_BOUND: Duration = Duration::from_secs(15);

/// The dying: once, the replica's backend refuses every call, its reports
/// stop counting, and `died` is told; the caller resumes only when `grave`
/// is closed, once the cell has been read (on the paused clock its tasks
/// are not dropped with a runtime, and a lock they hold would otherwise
/// keep the dead locker's heartbeat calling the refusing backend).
fn death(
    fault: FaultyBackend,
    alive: Arc<AtomicBool>,
    died: oneshot::Sender<()>,
    grave: Arc<Semaphore>,
) -> Action {
    let died = Arc::new(Mutex::new(Some(died)));
    Arc::new(move || {
        let (fault, alive, died) = (fault.clone(), Arc::clone(&alive), Arc::clone(&died));
        let grave = Arc::clone(&grave);
        Box::pin(async move {
            fault.set(Fault::Down);
            alive.store(false, Ordering::SeqCst);
            if let Some(tx) = died.lock().expect("death").take() {
                let _ = tx.send(());
            }
            // Never granted: it returns (an error) when the grave is closed.
            let _ = grave.acquire().await;
        })
    })
}

/// Builds the replica that dies at `step`, starts it, and waits until it
/// died (or `DEATH_BOUND` passed); its scheduler is then dropped. Runs on
/// whatever runtime the caller is on: that runtime's end is the rest of the
/// crash.
async fn doomed(
    ctx: Ctx,
    plan: ReplicaPlan,
    ticks: Arc<dyn TickStore>,
    clock: Arc<dyn WallClock>,
    step: Step,
    grave: Arc<Semaphore>,
) {
    let backend = ctx.factory().replica().await.expect("replica connects");
    let fault = FaultyBackend::new(backend, TTL);
    let replica = ctx.replica_over(Arc::new(fault.clone()));
    let alive = Arc::new(AtomicBool::new(true));
    let (tx, rx) = oneshot::channel();
    let action = death(fault, Arc::clone(&alive), tx, grave);
    let scheduler: Scheduler = plan
        .scheduler(
            replica.locker.clone(),
            ticks,
            clock,
            Some((step, action)),
            alive,
        )
        .start()
        .expect("starts");
    let _ = tokio::time::timeout(DEATH_BOUND, rx).await;
    drop(scheduler);
}

async fn cell(ctx: Ctx, index: usize, step: Step, delivery: Delivery) -> Cell {
    // The survivor, behind by more than the dead replica's lock lasts.
    let fleet = Fleet::new(&ctx, &[SURVIVOR_BEHIND_MS]).await;
    let plan = ReplicaPlan::new(&ctx, &format!("crash-{index}"), delivery);
    let survivor = plan
        .scheduler(
            fleet.replicas[0].locker.clone(),
            Arc::clone(&fleet.ticks),
            fleet.clocks[0].clone(),
            None,
            Arc::new(AtomicBool::new(true)),
        )
        .start()
        .expect("starts");
    let clock: Arc<dyn WallClock> = Arc::new(TokioClock::starting_at(Utc::now()));
    let ticks = Arc::clone(&fleet.ticks);
    let grave = Arc::new(Semaphore::new(0));
    if ctx.timing().paused_clock {
        doomed(
            ctx.clone(),
            plan.clone(),
            ticks,
            clock,
            step,
            Arc::clone(&grave),
        )
        .await;
    } else {
        // A runtime of its own, on a thread of its own: shutting it down
        // drops every task and connection of the replica at once.
        let (ctx2, plan2) = (ctx.clone(), plan.clone());
        let grave = Arc::clone(&grave);
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("the replica's runtime builds");
            rt.block_on(doomed(ctx2, plan2, ticks, clock, step, grave));
            rt.shutdown_timeout(Duration::from_secs(1));
        });
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .expect("joins")
            .expect("the replica's thread ends without panicking");
    }
    // The survivor's report of the tick (the dead replica's stopped
    // counting when it died): past the tick on the replica behind, after the
    // dead one's lock ran out, with slack for a loaded machine.
    let behind = Duration::from_millis(SURVIVOR_BEHIND_MS.unsigned_abs());
    let bound = plan.tick.until() + behind + TTL + ctx.timing().tolerance + TTL;
    plan.reported(1, bound + REPORT_SLACK).await;
    let _ = survivor.shutdown(Duration::from_secs(5)).await;
    let cell = plan.read(&*fleet.ticks).await;
    grave.close();
    cell
}

/// Every cell of the crash matrix on this row, asserted and printed.
pub(crate) async fn scheduler_crash_matrix(ctx: Ctx) {
    let expect = Expect {
        completes: true,
        abandons: true,
    };
    matrix(&ctx, "crash", Duration::from_secs(60), expect, cell).await;
}
