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
//! A tick is run by the replica that holds its lock and whose *start record*
//! won. In order, on the replica that fires it:
//!
//! 1. It takes the tick's lock (at once, or for a missed tick waiting up to
//!    one TTL) and checks the [`TickStore`](lock_core::TickStore) for a
//!    completion mark and the latest completed tick (a tick marked done is
//!    never run again; marks are kept for twice the skew tolerance, at least
//!    a minute).
//! 2. It writes the tick's record `Started { token, replica, at }` under the
//!    lock's fencing token, in one server-side step that is refused if the
//!    tick has any record already (or, for a `Started` record of a lower
//!    token, whose runner's lock has therefore expired, does what the job's
//!    [`Delivery`] says). The handler is called only if this write won. A
//!    write retried after a lost reply finds its own record and answers as
//!    the first did.
//! 3. When the handler returns (`Ok`, an error or a panic) it writes
//!    `Completed { token }`, in one step conditional on the record still
//!    being its own `Started`; the same step marks the tick done and raises
//!    the latest completed tick. A refused `Completed` is counted as
//!    [`TickOutcome::FencedOut`]. A `Completed` write the store fails (an
//!    error, or a timeout whose write may or may not have landed) is sent
//!    again, up to three times in all: under the same token a write that
//!    did land answers as it did. If none lands, the tick stays `Started`
//!    and the run is counted [`TickOutcome::Unrecorded`] (never `success`),
//!    whatever the handler returned.
//! 4. It keeps the lock past the tick plus the skew tolerance
//!    ([`LockGuard::retain_for`](lock_core::LockGuard::retain_for)), so a
//!    replica whose clock is behind finds the tick taken without asking the
//!    store.
//!
//! The two modes differ only in what a *stale* `Started` record leads to:
//! one whose runner stalled (GC pause, frozen VM, starved CPU) or died for
//! longer than the lock's TTL after starting the tick.
//!
//! - [`Delivery::AtMostOnce`] (the default): the next replica to fire the
//!   tick marks it `Abandoned` ([`TickOutcome::Abandoned`], counted and
//!   alerted on by `SchedulerTickAbandoned` in `ops/prometheus/alerts.yml`)
//!   and does not run it. **No tick's handler is called twice**, whatever the
//!   pauses, crashes, lost replies and clock skew. The price: a tick whose
//!   runner died is lost (and one whose runner stalled after its handler
//!   returned is counted abandoned although it ran). The default because
//!   every job of the deployments this crate was built for does damage when
//!   run twice (two live rounds, a round resolved twice with two payouts, a
//!   bet reconciled twice against an external ledger) and a lost run, seen by
//!   the alert, is repaired by the next tick or by hand.
//! - [`Delivery::AtLeastOnce`]: the next replica takes the tick over with its
//!   higher token and runs it again; the first runner's late `Completed` is
//!   refused. **Every tick whose runner keeps running completes, and exactly
//!   one `Completed` is recorded, the highest token's**; the handler may run
//!   twice (never alongside itself while both hold valid locks), so it must
//!   be idempotent, ideally writing under [`JobContext::fencing_token`]. It
//!   needs fencing tokens: without them (Redis or Postgres with fencing
//!   turned off) a stale record cannot be told from a live one, so it is left
//!   and the tick skipped, which is at most once.
//!
//! A run cut short (its lock or the leadership lost mid-run, or shutdown's
//! deadline) is aborted at once and leaves its `Started` record, which the
//! mode then treats as above. So does a run whose `Completed` write never
//! landed ([`TickOutcome::Unrecorded`]), except that its replica keeps the
//! lock as the tick's mark (4.) as a completed run does: no replica within
//! the skew tolerance fires the tick again, and one that fires it later (a
//! missed-tick catch-up) marks it abandoned (at most once) or runs it again
//! (at least once). Leader mode writes the same records, so a new
//! leader neither re-runs a started tick (at most once) nor loses it (at
//! least once).
//!
//! Where it holds: the promises rest on the store never losing an
//! acknowledged write. They hold without exception on **Postgres** and
//! **etcd** (a committed row; a Raft-committed key), and on a single Redis
//! or a Redis Cluster / Sentinel deployment without failovers. **Redis
//! replicates asynchronously**: a failover can promote a replica that missed
//! a `Started` record, and a replica then firing the tick finds no record and
//! runs it again (at most once broken), or misses a `Completed` and takes the
//! tick over (a second run at least once allows). Turn on lock-redis's
//! replica acknowledgement ([`with_replica_ack`], `replica_ack=N` in the
//! URL): every tick record write then waits (`WAIT`) for N replicas, and one
//! that fewer acknowledged is an error, so the tick is not run. `WAIT` is
//! not consensus: the guarantee holds if the replica a failover promotes is
//! one that acknowledged, which asking every replica (N = the number of
//! replicas) ensures and a smaller N makes likely, not certain. For jobs
//! that must never run twice whatever the failover, use Postgres or etcd.
//!
//! [`with_replica_ack`]: https://docs.rs/lock-redis/latest/lock_redis/struct.RedisBuilder.html#method.with_replica_ack
//!
//! The protocol is modelled in `scheduler/model/ticks.pml` and checked with
//! spin by `.ci/run` (see its README): the `FENCED` variant, in both modes,
//! is what this crate runs; a change to one changes the other. The model
//! also shows what the protocol before the start record allowed (a handler
//! run twice when its runner stalled between the handler's return and the
//! completion mark), and that an unconditional `Started` or `Completed`
//! write breaks it. `tests/pause_matrix.rs` freezes a replica at each point
//! of the protocol for three TTLs beside a replica whose clock is 3 s
//! behind, in both modes.
//!
//! # Clock skew
//!
//! Replicas' clocks may differ by up to the skew tolerance (default 5 s,
//! [`SchedulerBuilder::with_skew_tolerance`]). A replica ahead fires early and a
//! replica behind fires late, but they fire the same tick name. Skew larger
//! than the tolerance is still caught by the tick records and marks (1.–3.); the
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
//! Between a tick's lock and its handler stand the start checks (the
//! server's clock, the tick's mark, the job's latest completed tick; see
//! [`StartCheck`](lock_core::StartCheck)) and the `Started` write. A store
//! that [makes the checks in the write's own
//! step](lock_core::TickStore::checks_starts_in_one_step) (Postgres, Redis
//! outside Cluster) gets them as one call; on the others the reads go
//! first, then the write.
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
//! handler is caught, counted `panicked`, and its lock released once its
//! `Completed` record is written. A run whose completion could not be
//! recorded is counted `unrecorded`, whatever its handler returned (an error
//! or a panic is logged), and keeps its lock as the tick's mark. Past the
//! shutdown deadline a failed `Completed` write is not sent again.
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
mod status;
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
pub use status::JobStatus;
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
