//! Cron jobs that run once across replicas.
//!
//! A service embeds a [`Scheduler`], adds [`Job`]s (a name, a cron
//! expression with optional seconds, a time zone, lock TTL and maximum hold,
//! a missed-tick policy, and an async handler that receives a
//! [`JobContext`]), starts it, and runs the same binary on N replicas. Every
//! scheduled tick of a job then runs to completion on one replica, whatever
//! the replicas' clocks and crashes, within the limits below.
//!
//! # Two modes
//!
//! - **Per tick** ([`Mode::PerTick`]): every replica fires every tick on its
//!   own clock and tries the lock `<job>/<tick in Unix ms>`. The tick is named
//!   by its scheduled instant, not by when a replica fired, so all replicas
//!   contend for the same lock and exactly one wins.
//! - **Leader** ([`Mode::Leader`]): replicas elect a leader through one
//!   long-held lock ([`LeaderElection`], also usable on its own), renewed by
//!   the heartbeat; standbys retry every election interval. Only the leader
//!   fires; when its lease is lost it stops firing and aborts its running
//!   handlers at that instant. A crashed leader is replaced within the
//!   election TTL plus one interval. The leader still takes each tick's lock,
//!   so a handover can never run a tick twice.
//!
//! # Why a tick runs once
//!
//! 1. Only the holder of a tick's lock runs it, and it runs only while the
//!    lock is valid by its local deadline (the handler is dropped the moment
//!    the lock is lost, and the lock is verified with the backend afterwards,
//!    which logs a loss the heartbeat had not seen yet).
//! 2. The lock is not released when the handler returns: it is kept
//!    ([`LockGuard::retain_for`](lock_core::LockGuard::retain_for)) until the
//!    tick plus the skew tolerance has passed, so a replica whose clock is
//!    behind finds the tick taken, even if the job took a millisecond. The
//!    hold is never shorter than the backend's minimum TTL (a second on
//!    etcd): a mark kept a little long is harmless, one the backend refuses
//!    is none.
//! 3. A finished tick is recorded in the [`TickStore`](lock_core::TickStore),
//!    on the same server as the locks, and a replica checks that record
//!    *after* taking the tick's lock, before running: a tick marked as
//!    completed is never run again (marks are kept for twice the tolerance,
//!    at least a minute), and a tick older than the tolerance is not run
//!    once a later one has completed. A later tick finished by a replica
//!    whose clock is ahead does not cancel an earlier one that nobody has run
//!    yet. The store's mark, unlike the lock of 2., outlives the replica: on
//!    Postgres a crashed replica's locks, completion marks included, vanish
//!    with its session.
//!
//! A run that is cut short is not finished: if its replica crashes, or loses
//! the tick's lock (or the leadership) mid-run, its handler stops at once,
//! nothing is recorded, and a replica that fires the tick later (its clock
//! behind, or a new leader) may run it again. The first run has stopped by
//! then: its guard failed at its local deadline, before the lock could be
//! taken again. Handlers that must not repeat a partial effect should write
//! under the run's fencing token ([`JobContext::fencing_token`]). A tick whose
//! run finished, successfully or with an error, never runs again: the mark is
//! written as soon as the handler returns, before anything else. One window
//! remains, and no lock service can close it: a replica that stalls (starved
//! of CPU, frozen) for longer than the TTL between its handler's return and
//! the mark's write lets the lock run out unmarked, and a replica whose clock
//! is behind may then take the tick and run it again, after the first run
//! ended, never alongside it. The stalled replica logs a warning when its
//! mark lands after its lock's deadline.
//!
//! The protocol is modelled in `scheduler/model/ticks.pml`, checked with spin
//! by `.ci/run` (its README says how): the model describes today's protocol
//! and the fenced start record meant to replace it, with `Started`,
//! `Completed` and `Abandoned` written under the run's token. In today's it
//! finds the window above, and a second one: a replica that stalls between
//! reading the completion mark and calling the handler may start the handler
//! (aborted once it sees the lock lost) of a tick another replica ran.
//!
//! # Clock skew
//!
//! Replicas' clocks may differ by up to the skew tolerance (default 5 s,
//! [`SchedulerBuilder::with_skew_tolerance`]). A replica ahead fires early and a
//! replica behind fires late, but they fire the same tick name. Skew larger
//! than the tolerance is still caught by the completed-tick record (2.); the
//! tolerance only bounds how long completion marks are kept. Ticks are
//! computed on an injectable [`WallClock`]; waiting uses tokio's monotonic
//! timer and the wall clock is re-read on every wake, so a clock stepped
//! backwards neither fires early nor fires a tick twice, and one stepped
//! forward runs the ticks it jumped over that are still within the
//! tolerance, late, and treats older ones as missed.
//!
//! A replica whose clock is far *ahead* (beyond the tolerance) would run
//! future ticks early and record one as the latest completed, and every
//! replica with a true clock would then skip its ticks as past until real
//! time caught up. Where the backend has a server clock
//! ([`TickStore::server_time`](lock_core::TickStore::server_time): Redis
//! `TIME`, Postgres `clock_timestamp()`), a tick further ahead of it than the
//! tolerance is refused with a warning instead. etcd has no clock to read:
//! there, keep replicas' clocks within the tolerance (NTP slewing, not
//! stepping), or a forward step of one replica makes the others skip the
//! ticks it ran early, and the ones up to them.
//!
//! # Tick store calls
//!
//! One task fires every job (one timer for the next instant any job is due)
//! and polls each job's runs as a future of its own; handlers run in tasks
//! of their own. So many jobs due at the same instant ask the tick store the
//! same questions at once. Those calls are coalesced: a call
//! that finds no batch of its kind in flight goes at once, and those that
//! arrive meanwhile go together as one batch when it answers (the
//! [`TickStore`](lock_core::TickStore) batch methods: one statement on
//! Postgres, one `MGET` or pipeline on Redis). A server clock reading is
//! shared only by calls that began before it was taken, so it is never older
//! than a reading of a tick's own, and a failed batch fails each of its
//! ticks as the single call would (the tick is not run).
//!
//! # Missed ticks
//!
//! Ticks that passed while no replica ran them (all down, an election under
//! way, a stall longer than the skew tolerance) follow the job's
//! [`MissedTicks`] policy: skip (default), run the latest once, or run all
//! within a window up to a count. They are counted from the last completed
//! tick in the tick store, so the policy holds across failovers.
//!
//! A tick is late, not missed, while it is within the skew tolerance: a
//! running replica whose timer fires late (its process starved of CPU)
//! runs every tick that passed meanwhile and is still that recent, in
//! order, under its lock as usual, exactly as a replica whose clock is
//! behind would fire it.
//!
//! # Shutdown
//!
//! [`Scheduler::shutdown`] starts no run once it has been called (not the
//! rest of a catch-up batch, nor a catch-up waiting for its lock), and
//! returns by its deadline plus [`SHUTDOWN_GRACE`].
//!
//! # Daylight saving time
//!
//! See [`Schedule`]: a fixed-time job in a spring-forward gap runs once right
//! after the gap; on a fall-back day it runs once, on the first pass.
//!
//! # Availability
//!
//! A service takes its lock backend from the environment with
//! [`connect_from_env`] (or [`Policy`] from values): [`LOCK_URL`] names the
//! backend; without it jobs run unlocked (one replica only, warned on every
//! run, counted `unlocked`) unless [`SCHEDULER_LOCK_REQUIRED`] is true,
//! which refuses to start. A backend whose server is down at start does not
//! stop the service: its ticks are skipped as `unavailable` (fail closed,
//! counted) and run again once the server answers, and in leader mode the
//! campaign keeps retrying every election interval. A malformed URL or a
//! server that refuses the credentials still fails at start. [`connect`]
//! itself stays strict: it fails when the server cannot be reached.
//!
//! # Outcomes and metrics
//!
//! Each tick on each replica ends as one [`TickOutcome`], counted in
//! `scheduler_runs_total{job,outcome}`; see [`SchedulerMetrics`]. A panicking
//! handler is caught, counted `panicked`, and its lock released.
//!
//! # Overlap
//!
//! A job never runs twice at once in one process. A tick that fires while
//! the job's previous run is still going here waits for it; when that run
//! ends, the newest such tick runs if it is still within the skew tolerance,
//! and the ones it replaced are skipped. So a run that started late (a
//! starved process) does not cost the next tick, and a job slower than its
//! schedule runs back to back on its newest tick. Other replicas, free at
//! the tick, take it first as usual.
//!
//! # Examples
//!
//! See [`Scheduler`], and `cargo run -p scheduler --example replicas`.
#![forbid(unsafe_code)]

mod batch;
mod builder;
mod clock;
mod connect;
mod context;
mod delivery;
mod driver;
mod error;
mod job;
mod leader;
mod metrics;
mod missed;
mod overlap;
mod pause;
mod per_tick;
mod policy;
mod run;
mod runtime;
mod schedule;
mod scheduler;
#[cfg(feature = "test-util")]
mod tokio_clock;

pub use builder::{
    ElectionOptions, Mode, SchedulerBuilder, DEFAULT_SKEW_TOLERANCE, MAX_SKEW_TOLERANCE,
};
pub use clock::{SystemClock, WallClock};
pub use connect::{connect, Backend, LockMode};
pub use context::JobContext;
pub use delivery::{Delivery, UnknownDelivery};
pub use error::{Error, JobError, Result};
pub use job::{Job, DEFAULT_JOB_TTL, MAX_JOB_NAME_LEN};
pub use leader::{
    ElectionBuilder, LeaderElection, DEFAULT_ELECTION_INTERVAL, DEFAULT_ELECTION_TTL,
};
pub use metrics::{SchedulerMetrics, TickOutcome};
pub use missed::MissedTicks;
#[cfg(feature = "test-util")]
pub use pause::PauseHook;
pub use pause::ProtocolPoint;
pub use policy::{connect_from_env, Policy, LOCK_URL, SCHEDULER_LOCK_REQUIRED};
pub use runtime::RunReport;
pub use schedule::Schedule;
pub use scheduler::{Scheduler, SHUTDOWN_GRACE};
#[cfg(feature = "test-util")]
pub use tokio_clock::TokioClock;

/// The date-time library of [`JobContext::scheduled_at`] and [`WallClock`],
/// re-exported so a service names the same `DateTime` without a dependency
/// of its own.
pub use chrono;
/// The lock API the scheduler runs on ([`lock_core::Locker`],
/// [`lock_core::LockName`], the backend trait), re-exported at the version
/// this crate was built with.
pub use lock_core;
