//! A single replica on the memory backend and tokio's paused clock:
//! configuration errors, wall-clock steps, the election on its own, and a
//! leadership lost and won back during a run.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use lock_core::{LockName, Locker, TickStore};
use lock_memory::{Counting, Intercepted, MemoryBackend};
use prometheus::Registry;
use scheduler::{ElectionOptions, Error, Job, LeaderElection, Mode, Scheduler, TokioClock};

fn backend() -> (Locker, Arc<dyn TickStore>, MemoryBackend) {
    let memory = MemoryBackend::new();
    let locker = common::locker(memory.clone());
    (locker, Arc::new(memory.clone()), memory)
}

/// A tick and the wall-clock time its handler started.
type RunAt = (DateTime<Utc>, DateTime<Utc>);

fn noop(name: &str) -> Job {
    Job::new(name, "* * * * * *", |_| async { Ok(()) })
}

fn build(
    f: impl FnOnce(scheduler::SchedulerBuilder) -> scheduler::SchedulerBuilder,
) -> scheduler::Result<Scheduler> {
    let (locker, ticks, _) = backend();
    f(Scheduler::builder(locker, ticks).with_registry(&Registry::new())).build()
}

#[test]
fn configuration_errors_say_what_is_wrong() {
    let msg = |r: scheduler::Result<Scheduler>| r.expect_err("must be rejected").to_string();
    for tolerance in [
        Duration::ZERO,
        Duration::from_nanos(1),
        scheduler::MAX_SKEW_TOLERANCE + Duration::from_nanos(1),
        Duration::from_millis(u64::MAX),
        Duration::MAX,
    ] {
        let refused = msg(build(|b| {
            b.with_job(noop("a")).with_skew_tolerance(tolerance)
        }));
        assert!(refused.contains("skew tolerance"), "{refused}");
    }
    let zero_interval = ElectionOptions::new().with_interval(Duration::ZERO);
    assert!(msg(build(|b| b
        .with_job(noop("a"))
        .with_mode(Mode::Leader(zero_interval))))
    .contains("election interval"));
    let zero_ttl = ElectionOptions::new().with_ttl(Duration::ZERO);
    assert!(msg(build(|b| b
        .with_job(noop("a"))
        .with_mode(Mode::Leader(zero_ttl))))
    .contains("TTL"));
    assert!(msg(build(|b| b.with_job(noop("a")).with_job(noop("a")))).contains("unique"));
    assert!(msg(build(|b| b)).contains("at least one job"));
    let bad_cron = Job::new("a", "61 * * * *", |_| async { Ok(()) });
    assert!(matches!(
        build(|b| b.with_job(bad_cron)),
        Err(Error::InvalidCron { .. })
    ));
    let bad_zone = noop("a").with_time_zone("Nowhere/Special");
    assert!(matches!(
        build(|b| b.with_job(bad_zone)),
        Err(Error::InvalidTimeZone { .. })
    ));
    // A second scheduler on one registry shares the first one's metrics.
    let registry = Registry::new();
    let (locker, ticks, _) = backend();
    let first = Scheduler::builder(locker.clone(), Arc::clone(&ticks))
        .with_registry(&registry)
        .with_job(noop("a"))
        .build()
        .expect("first");
    let again = Scheduler::builder(locker, ticks)
        .with_registry(&registry)
        .with_job(noop("a"))
        .build();
    assert!(again.is_ok(), "{again:?}");
    drop(first);
}

#[test]
fn start_outside_a_runtime_is_an_error_not_a_panic() {
    let s = build(|b| b.with_job(noop("a"))).expect("valid");
    assert!(matches!(s.start(), Err(Error::Config(m)) if m.contains("tokio runtime")));
}

/// Runs a job every 2 s on a clock that is stepped back 5 s and later forward
/// 10 s: no tick runs twice or early; of the ticks jumped over, those within
/// the 5 s skew tolerance run late, in order, and the older ones are missed
/// (`Skip` drops them).
#[tokio::test(start_paused = true)]
async fn wall_clock_steps_never_refire_a_tick() {
    let (locker, ticks, _) = backend();
    let base = DateTime::from_timestamp(1_800_000_001, 0).expect("valid");
    let clock = Arc::new(TokioClock::starting_at(base));
    let ran: Arc<Mutex<Vec<RunAt>>> = Arc::default();
    let log = Arc::clone(&ran);
    let seen = Arc::clone(&clock);
    let job = Job::new("stepped", "*/2 * * * * *", move |ctx| {
        let (log, clock) = (Arc::clone(&log), Arc::clone(&seen));
        async move {
            use scheduler::WallClock;
            log.lock()
                .expect("log")
                .push((ctx.scheduled_at(), clock.now()));
            Ok(())
        }
    });
    let s = Scheduler::builder(locker, ticks)
        .with_registry(&Registry::new())
        .with_clock(clock.clone())
        .with_job(job)
        .build()
        .expect("valid");
    let s = s.start().expect("starts");
    tokio::time::sleep(Duration::from_secs(6)).await; // ticks at +1, +3, +5 s
    clock.step(-5_000);
    tokio::time::sleep(Duration::from_millis(8_500)).await; // reads +1..+9.5: +7, +9 run
    clock.step(10_000);
    // Reads +19.5..+21.5: +11 and +13 are missed; +15, +17, +19 and +21 run.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    s.shutdown(Duration::from_secs(1)).await.expect("clean");
    let ran = ran.lock().expect("log").clone();
    let offsets: Vec<i64> = ran.iter().map(|(t, _)| (*t - base).num_seconds()).collect();
    assert_eq!(offsets, vec![1, 3, 5, 7, 9, 15, 17, 19, 21]);
    assert!(
        ran.iter().all(|(tick, now)| now >= tick),
        "a tick ran early: {ran:?}"
    );
}

/// The election on its own: one leader among three, hooks fire, and a
/// standby takes over within TTL + interval when the leader stops.
#[tokio::test(start_paused = true)]
async fn election_elects_one_and_hands_over() {
    let memory = MemoryBackend::new();
    let lockers: Vec<Locker> = (0..3).map(|_| common::locker(memory.clone())).collect();
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let (ttl, interval) = (Duration::from_secs(3), Duration::from_secs(1));
    let elections: Vec<LeaderElection> = lockers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let (up, down) = (Arc::clone(&events), Arc::clone(&events));
            LeaderElection::builder(l.clone(), "svc/leader")
                .with_ttl(ttl)
                .with_interval(interval)
                .with_on_elected(move || up.lock().expect("log").push(format!("{i} up")))
                .with_on_demoted(move || down.lock().expect("log").push(format!("{i} down")))
                .start()
                .expect("starts")
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let leading: Vec<bool> = elections.iter().map(LeaderElection::is_leader).collect();
    assert_eq!(leading, vec![true, false, false]);
    let mut watch = elections[1].subscribe();
    let stopped = tokio::time::Instant::now();
    elections[0].stop().await;
    let mut other = elections[2].subscribe();
    tokio::select! {
        _ = watch.wait_for(|l| *l) => {}
        _ = other.wait_for(|l| *l) => {}
    }
    assert!(
        stopped.elapsed() <= interval,
        "a released leadership is taken within one interval"
    );
    assert_eq!(elections.iter().filter(|e| e.is_leader()).count(), 1);
    let events = events.lock().expect("log").clone();
    assert_eq!(&events[..2], &["0 up".to_owned(), "0 down".to_owned()]);
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(ttl > interval);
}

/// A standby over a backend that reports releases takes a released
/// leadership at once, not at its next attempt an interval later.
#[tokio::test(start_paused = true)]
async fn election_standby_takes_a_released_leadership_at_once() {
    tokio::time::timeout(Duration::from_secs(600), async {
        let memory = MemoryBackend::new();
        let locker = || common::locker(memory.clone());
        let interval = Duration::from_secs(5);
        let start = |l: Locker| {
            LeaderElection::builder(l, "svc/released-leader")
                .with_ttl(Duration::from_secs(30))
                .with_interval(interval)
                .start()
                .expect("starts")
        };
        let leader = start(locker());
        leader.subscribe().wait_for(|l| *l).await.expect("leads");
        let standby = start(locker());
        // Its first attempt is refused; its next would come an interval later.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!standby.is_leader());
        let stopped = tokio::time::Instant::now();
        leader.stop().await;
        standby
            .subscribe()
            .wait_for(|l| *l)
            .await
            .expect("takes over");
        assert!(
            stopped.elapsed() < Duration::from_millis(100),
            "the standby took the released leadership {:?} after the leader stopped",
            stopped.elapsed()
        );
        standby.stop().await;
    })
    .await
    .expect("the test ran past its bound");
}

/// A handler written as a function with its own error type fits
/// `Job::from_fn`; its errors are counted as failed runs.
#[tokio::test(start_paused = true)]
async fn function_handlers_with_their_own_error_type_run() {
    #[derive(Debug)]
    struct StoreDown;
    impl std::fmt::Display for StoreDown {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the report store is down")
        }
    }
    impl std::error::Error for StoreDown {}
    async fn fails(_ctx: scheduler::JobContext) -> Result<(), StoreDown> {
        Err(StoreDown)
    }
    let (locker, ticks, _) = backend();
    let base = DateTime::from_timestamp(1_800_000_000, 500_000_000).expect("valid");
    let outcomes: Arc<Mutex<Vec<scheduler::TickOutcome>>> = Arc::default();
    let log = Arc::clone(&outcomes);
    let s = Scheduler::builder(locker, ticks)
        .with_registry(&Registry::new())
        .with_clock(Arc::new(TokioClock::starting_at(base)))
        .with_on_outcome(move |report| log.lock().expect("log").push(report.outcome))
        .with_job(Job::from_fn("reports/failing", "* * * * * *", fails))
        .start()
        .expect("starts");
    tokio::time::sleep(Duration::from_secs(2)).await; // ticks at +0.5 s and +1.5 s
    let m = s.metrics().clone();
    s.shutdown(Duration::from_secs(1)).await.expect("clean");
    assert_eq!(
        *outcomes.lock().expect("log"),
        vec![scheduler::TickOutcome::Failure; 2]
    );
    assert_eq!(
        m.runs("reports/failing", scheduler::TickOutcome::Failure),
        2
    );
}

/// Many jobs due at the same instant all run, and the scheduler fires them
/// from one task: between ticks, no task per job is alive (a task and timer
/// per job per tick were the burst's bookkeeping at a thousand jobs).
#[tokio::test(start_paused = true)]
async fn one_task_fires_every_job() {
    const JOBS: usize = 200;
    let (locker, ticks, _) = backend();
    let base = DateTime::from_timestamp(1_800_000_000, 500_000_000).expect("valid");
    let ran: Arc<Mutex<Vec<(usize, i64)>>> = Arc::default();
    let mut builder = Scheduler::builder(locker, ticks)
        .with_registry(&Registry::new())
        .with_clock(Arc::new(TokioClock::starting_at(base)));
    for j in 0..JOBS {
        let log = Arc::clone(&ran);
        builder = builder.with_job(Job::new(format!("many/{j}"), "* * * * * *", move |ctx| {
            let offset = (ctx.scheduled_at() - base).num_milliseconds();
            log.lock().expect("log").push((j, offset));
            async { Ok(()) }
        }));
    }
    let tasks = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let before = tasks();
    let s = builder.start().expect("starts");
    // Ticks at +0.5, +1.5 and +2.5 s; read between the last two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let between = tasks();
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.shutdown(Duration::from_secs(1)).await.expect("clean");
    assert!(
        between.saturating_sub(before) < 10,
        "{} tasks alive between ticks for {JOBS} jobs ({before} before the start)",
        between
    );
    let mut ran = ran.lock().expect("log").clone();
    ran.sort_unstable();
    let expected: Vec<(usize, i64)> = (0..JOBS)
        .flat_map(|j| [(j, 500), (j, 1_500), (j, 2_500)])
        .collect();
    assert_eq!(ran, expected);
}

/// A leader loses its leadership mid-run and wins it back while that run is
/// still releasing its tick lock; the new term's first tick waits for that
/// run and then runs once, under the new term's leadership.
#[tokio::test(start_paused = true)]
async fn a_tick_waiting_across_terms_runs_under_the_new_leadership() {
    tokio::time::timeout(Duration::from_secs(60), async {
        // Ticks every 10 s from +1 s: +1, +11, +21.
        let base = DateTime::from_timestamp(1_799_999_999, 0).expect("valid");
        let first_tick = LockName::new("slow/1800000000000").expect("valid");
        let memory = MemoryBackend::new();
        // A backend slow to answer, which keeps the run releasing the first
        // tick's lock going.
        let locker = common::locker(Intercepted::over(
            memory.clone(),
            Counting::default().with_slow_release(first_tick, Duration::from_secs(10)),
        ));
        // (tick offset, whether the handler started under a held leadership)
        let ran: Arc<Mutex<Vec<(i64, bool)>>> = Arc::default();
        let log = Arc::clone(&ran);
        let job = Job::new("slow", "*/10 * * * * *", move |ctx| {
            let log = Arc::clone(&log);
            async move {
                let offset = (ctx.scheduled_at() - base).num_seconds();
                log.lock()
                    .expect("log")
                    .push((offset, ctx.assert_held().is_ok()));
                if offset == 1 {
                    // Longer than a tick: still going when the leadership goes.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Ok(())
            }
        });
        let outcomes: Arc<Mutex<Vec<(i64, scheduler::TickOutcome)>>> = Arc::default();
        let seen = Arc::clone(&outcomes);
        let election = ElectionOptions::new()
            .with_name("svc/leader")
            .with_ttl(Duration::from_secs(3))
            .with_interval(Duration::from_secs(1));
        let s = Scheduler::builder(locker, Arc::new(memory.clone()))
            .with_registry(&Registry::new())
            .with_clock(Arc::new(TokioClock::starting_at(base)))
            .with_mode(Mode::Leader(election))
            .with_on_outcome(move |r| {
                let offset = (r.scheduled - base).num_seconds();
                seen.lock().expect("log").push((offset, r.outcome));
            })
            .with_job(job)
            .start()
            .expect("starts");
        let mut leading = s.leadership();
        leading.wait_for(|l| *l).await.expect("elected");
        tokio::time::sleep(Duration::from_millis(2_500)).await; // inside tick +1's run
        assert!(memory.expire(&LockName::new("svc/leader").expect("valid")));
        leading.wait_for(|l| !*l).await.expect("demoted");
        leading.wait_for(|l| *l).await.expect("elected again");
        assert!(
            outcomes.lock().expect("log").is_empty(),
            "tick +1's run ended before the new term began"
        );
        tokio::time::sleep(Duration::from_secs(12)).await; // past +11 and the slow release
        s.shutdown(Duration::from_secs(1)).await.expect("clean");
        assert_eq!(
            *outcomes.lock().expect("log"),
            vec![
                (1, scheduler::TickOutcome::Aborted),
                (11, scheduler::TickOutcome::Success)
            ]
        );
        assert_eq!(*ran.lock().expect("log"), vec![(1, true), (11, true)]);
    })
    .await
    .expect("the test finishes within its bound");
}

/// `status` per job: the last tick completed (any replica), the last that
/// ended here and how, the next tick, and whether this replica fires; in
/// leader mode only the leader fires.
#[tokio::test(start_paused = true)]
async fn status_reports_each_jobs_ticks_and_who_fires() {
    let memory = MemoryBackend::new();
    let base = DateTime::from_timestamp(1_800_000_000, 0).expect("valid");
    let start = |clock: Arc<TokioClock>, mode: Mode| {
        let locker = common::locker(memory.clone());
        Scheduler::builder(locker, Arc::new(memory.clone()))
            .with_registry(&Registry::new())
            .with_clock(clock)
            .with_mode(mode)
            .with_job(noop("every-second"))
            .with_job(Job::new("yearly", "0 0 0 1 1 *", |_| async { Ok(()) }))
            .start()
            .expect("starts")
    };
    let clock = Arc::new(TokioClock::starting_at(base));
    let s = start(clock.clone(), Mode::PerTick);
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let status = s.status().await.expect("status");
    assert_eq!(status.len(), 2);
    let every = &status[0];
    assert_eq!(every.job, "every-second");
    let last = base + chrono::Duration::seconds(3);
    assert_eq!(every.last_completed, Some(last));
    assert_eq!(
        every.last_here,
        Some((last, scheduler::TickOutcome::Success))
    );
    assert_eq!(every.next_tick, Some(base + chrono::Duration::seconds(4)));
    assert!(every.fires_here);
    let yearly = &status[1];
    assert_eq!((yearly.last_completed, yearly.last_here), (None, None));
    assert!(yearly.next_tick.is_some_and(|t| t > base));
    s.shutdown(Duration::from_secs(1)).await.expect("clean");

    // Two leader-mode replicas on the same store: one fires, and both see
    // the ticks the per-tick run completed.
    let election = || Mode::Leader(ElectionOptions::new().with_ttl(Duration::from_secs(3)));
    let a = start(clock.clone(), election());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = start(clock.clone(), election());
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let (sa, sb) = (a.status().await.expect("a"), b.status().await.expect("b"));
    assert_eq!(
        [sa[0].fires_here, sb[0].fires_here],
        [true, false],
        "the first replica leads"
    );
    assert!(sa[0].last_completed > Some(last), "{sa:?}");
    assert_eq!(sa[0].last_completed, sb[0].last_completed);
    assert_eq!(sb[0].last_here, None, "the standby fired nothing");
    a.shutdown(Duration::from_secs(1)).await.expect("clean");
    b.shutdown(Duration::from_secs(1)).await.expect("clean");
}
