//! Extreme durations in a scheduler's settings (`Duration::MAX`, `u64::MAX`
//! ms, 0, 1 ns): each is refused when the scheduler is built, with an error
//! that says what is wrong, or the scheduler runs and stops cleanly. Never
//! a panic, never a lock left held.

use std::sync::Arc;
use std::time::Duration;

use lock_core::LockName;
use prometheus::Registry;
use scheduler::{ElectionOptions, Error, Job, MissedTicks, Mode, Scheduler, WallClock};
use tokio::time::{sleep, Instant};

use super::fleet::{self, Fleet, Plan};
use super::panics::{count_panics, panics_on_this_thread};
use crate::Ctx;

/// `u64::MAX` milliseconds: representable as an `Instant` offset on Linux,
/// not as a `chrono::TimeDelta`.
pub(crate) const HUGE: Duration = Duration::from_millis(u64::MAX);
const NS: Duration = Duration::from_nanos(1);
/// The values every duration setting is tried with.
pub(crate) const EXTREMES: [Duration; 4] = [Duration::MAX, HUGE, Duration::ZERO, NS];
/// How much longer than its deadline a shutdown may take.
pub(crate) const SHUTDOWN_MARGIN: Duration = scheduler::SHUTDOWN_GRACE;

/// One duration setting of a scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Knob {
    SkewTolerance,
    ElectionTtl,
    ElectionInterval,
    JobTtl,
    MaxHold,
    CatchUpWindow,
    ShutdownDeadline,
}

/// Every duration setting of one scheduler with one job.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) tolerance: Duration,
    /// Leader mode with this election TTL and interval; per tick otherwise.
    pub(crate) election: Option<(Duration, Duration)>,
    pub(crate) job_ttl: Duration,
    pub(crate) max_hold: Option<Duration>,
    /// `MissedTicks::RunAll` with this window; `Skip` otherwise.
    pub(crate) window: Option<Duration>,
    pub(crate) deadline: Duration,
}

impl Settings {
    /// Ordinary settings for a backend whose tests use `ttl`.
    pub(crate) fn normal(ttl: Duration, tolerance: Duration) -> Self {
        Self {
            tolerance,
            election: None,
            job_ttl: ttl,
            max_hold: None,
            window: None,
            deadline: Duration::from_secs(10),
        }
    }

    /// These settings with `knob` set to `value` (election knobs switch to
    /// leader mode).
    pub(crate) fn with(mut self, knob: Knob, value: Duration) -> Self {
        let ttl = self.job_ttl;
        match knob {
            Knob::SkewTolerance => self.tolerance = value,
            Knob::ElectionTtl => self.election = Some((value, ttl / 4)),
            Knob::ElectionInterval => self.election = Some((ttl, value)),
            Knob::JobTtl => self.job_ttl = value,
            Knob::MaxHold => self.max_hold = Some(value),
            Knob::CatchUpWindow => self.window = Some(value),
            Knob::ShutdownDeadline => self.deadline = value,
        }
        self
    }

    /// A scheduler with these settings and one job, `job`, recording
    /// nothing but its outcomes in its metrics.
    pub(crate) fn build(
        &self,
        locker: lock_core::Locker,
        ticks: Arc<dyn lock_core::TickStore>,
        clock: Arc<dyn WallClock>,
        job: &LockName,
        cron: &str,
    ) -> scheduler::Result<Scheduler> {
        let work = Duration::from_millis(10);
        let mut j = Job::new(job.as_str(), cron, move |ctx| async move {
            sleep(work).await;
            ctx.assert_held()?;
            Ok(())
        })
        .with_ttl(self.job_ttl);
        if let Some(max_hold) = self.max_hold {
            j = j.with_max_hold(max_hold);
        }
        if let Some(window) = self.window {
            j = j.with_missed_ticks(MissedTicks::RunAll { window, max: 3 });
        }
        let mode = match self.election {
            Some((ttl, interval)) => Mode::Leader(
                ElectionOptions::new()
                    .with_name(format!("{job}/leader"))
                    .with_ttl(ttl)
                    .with_interval(interval),
            ),
            None => Mode::PerTick,
        };
        Scheduler::builder(locker, ticks)
            .with_mode(mode)
            .with_clock(clock)
            .with_registry(&Registry::new())
            .with_skew_tolerance(self.tolerance)
            .with_job(j)
            .build()
    }

    /// [`Settings::build`] on the first replica of `fleet`, with the
    /// fleet's tick store and that replica's clock.
    fn build_on(&self, fleet: &Fleet, job: &LockName, cron: &str) -> scheduler::Result<Scheduler> {
        self.build(
            fleet.replicas[0].locker.clone(),
            Arc::clone(&fleet.ticks),
            fleet.clocks[0].clone(),
            job,
            cron,
        )
    }
}

/// Whether a build error is a configuration error that says what is wrong.
pub(crate) fn is_clear_refusal(e: &Error) -> bool {
    let clear = matches!(
        e,
        Error::Config(_) | Error::InvalidJob { .. } | Error::Lock(lock_core::Error::Config(_))
    );
    clear && e.to_string().len() > 20
}

/// What the scheduler must do with one extreme setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Refused,
    Runs,
}

/// The scheduler's own settings at their extremes, on every backend. The
/// skew tolerance bounds how long finished ticks stay marked and their locks
/// kept: beyond a day, or below a millisecond, it is refused. A TTL of 0 or
/// 1 ns leaves no validity and is refused. A `max_hold`, catch-up window,
/// election interval or shutdown deadline of any length runs; the longest
/// mean "no limit". Runs are checked for an outcome of their ticks, a bounded
/// shutdown and no lock left held.
pub(crate) async fn scheduler_extreme_settings_refused_or_run(ctx: Ctx) {
    count_panics();
    let before = panics_on_this_thread();
    let plan = Plan::of(&ctx);
    let ttl = ctx.timing().ttl;
    let fleet = Fleet::new(&ctx, &[0, 0]).await;
    let normal = Settings::normal(ttl, fleet::tolerance(&ctx));
    let mut trials = Vec::new();
    for value in EXTREMES {
        trials.push((Knob::SkewTolerance, value, Expect::Refused));
        let runs = if value == Duration::ZERO {
            Expect::Refused
        } else {
            Expect::Runs
        };
        trials.push((Knob::ElectionInterval, value, runs));
        trials.push((Knob::CatchUpWindow, value, runs));
        trials.push((Knob::ShutdownDeadline, value, Expect::Runs));
        if value >= ttl {
            trials.push((Knob::MaxHold, value, Expect::Runs));
        } else {
            trials.push((Knob::JobTtl, value, Expect::Refused));
            trials.push((Knob::ElectionTtl, value, Expect::Refused));
        }
    }
    let mut running = Vec::new();
    for (i, (knob, value, expect)) in trials.into_iter().enumerate() {
        let name = ctx.name(&format!("x{i}"));
        let settings = normal.clone().with(knob, value);
        let built = settings.build_on(&fleet, &name, plan.cron);
        match (built, expect) {
            (Err(e), Expect::Refused) => {
                assert!(is_clear_refusal(&e), "{knob:?} = {value:?}: {e:?}");
            }
            (Ok(_), Expect::Refused) => panic!("{knob:?} = {value:?} was accepted"),
            (Err(e), Expect::Runs) => panic!("{knob:?} = {value:?} was refused: {e}"),
            (Ok(s), Expect::Runs) => {
                if settings.window.is_some() {
                    let last = fleet.clocks[0].now() - chrono::TimeDelta::seconds(3);
                    let keep = Duration::from_secs(60);
                    let tick = last.timestamp_millis() / 1_000 * 1_000;
                    fleet
                        .ticks
                        .record_completed(&name, tick, keep)
                        .await
                        .expect("record");
                }
                let s = s.start().expect("starts");
                running.push((knob, value, name, settings, s));
            }
        }
    }
    sleep(plan.period * 5 / 2).await;
    for (knob, value, name, settings, s) in running {
        let what = format!("{knob:?} = {value:?}");
        let metrics = s.metrics().clone();
        let began = Instant::now();
        let result = s.shutdown(settings.deadline).await;
        let took = began.elapsed();
        let bound = settings.deadline.min(plan.period) + SHUTDOWN_MARGIN + ctx.timing().tolerance;
        assert!(took <= bound, "{what}: shutdown took {took:?}");
        assert!(
            result.is_ok() || settings.deadline < plan.period,
            "{what}: {result:?}"
        );
        let fired: u64 = [
            scheduler::TickOutcome::Success,
            scheduler::TickOutcome::Skipped,
        ]
        .into_iter()
        .map(|o| metrics.runs(name.as_str(), o))
        .sum();
        assert!(fired > 0, "{what}: no tick of the job reported an outcome");
        let held = &fleet.replicas[0].metrics;
        assert_eq!(held.held(name.as_str()), 0, "{what}: a tick lock is held");
        if settings.election.is_some() {
            let leader = LockName::new(format!("{name}/leader")).expect("valid");
            assert_eq!(held.held(leader.as_str()), 0, "{what}: leadership held");
            fleet.replicas[1]
                .locker
                .try_lock(&leader, &ctx.opts())
                .await
                .unwrap_or_else(|e| panic!("{what}: the election lock is still taken: {e}"))
                .release()
                .await
                .expect("release");
        }
    }
    assert_eq!(panics_on_this_thread(), before, "something panicked");
}

/// Job and election lock TTLs of `Duration::MAX` and `u64::MAX` ms: refused
/// at build time with a clear error, or run and stopped cleanly with nothing
/// held. The scheduler does no arithmetic on these; the lock layer and the
/// backend do (a backend's `max_ttl` refuses them at build time).
pub(crate) async fn scheduler_extreme_lock_ttls_refused_or_run(ctx: Ctx) {
    count_panics();
    let before = panics_on_this_thread();
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0]).await;
    let normal = Settings::normal(ctx.timing().ttl, fleet::tolerance(&ctx));
    let mut running = Vec::new();
    for (i, knob) in [Knob::JobTtl, Knob::ElectionTtl].into_iter().enumerate() {
        for (j, value) in [Duration::MAX, HUGE].into_iter().enumerate() {
            let name = ctx.name(&format!("t{i}{j}"));
            let settings = normal.clone().with(knob, value);
            let built = settings.build_on(&fleet, &name, plan.cron);
            match built {
                Err(e) => assert!(is_clear_refusal(&e), "{knob:?} = {value:?}: {e:?}"),
                Ok(s) => {
                    let s = s.start().expect("starts");
                    running.push((format!("{knob:?} = {value:?}"), name, s));
                }
            }
        }
    }
    sleep(plan.period * 5 / 2).await;
    for (what, name, s) in running {
        let began = Instant::now();
        let _ = s.shutdown(plan.period).await;
        let took = began.elapsed();
        let bound = plan.period + SHUTDOWN_MARGIN + ctx.timing().tolerance;
        assert!(took <= bound, "{what}: shutdown took {took:?}");
        let held = &fleet.replicas[0].metrics;
        assert_eq!(held.held(name.as_str()), 0, "{what}: a tick lock is held");
        let leader = format!("{name}/leader");
        assert_eq!(held.held(&leader), 0, "{what}: leadership held");
    }
    assert_eq!(panics_on_this_thread(), before, "something panicked");
}
