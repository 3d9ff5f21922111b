//! X4: the proxy resets every connection every 500 ms while holders in
//! separate replicas acquire, write, renew and release through it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{backend::Expiry, Error, LeaseHandle, LockName, LockOptions, LossReason};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{sleep, sleep_until, Instant};

use super::case_timing;
use super::cases::{proxy_to_server, replica_through};
use super::figures::{self, Row};
use super::holder::{stops_saying_held, Resource, PUSH_LAG};
use super::Target;
use crate::observe::OverlapObserver;
use crate::{Ctx, Replica};

/// How often the proxy resets every connection.
const FLAP_EVERY: Duration = Duration::from_millis(500);
/// Replicas contending through the proxy, and the names they share.
const REPLICAS: usize = 3;
const NAMES: usize = 2;
/// Pause between guarded writes, and between attempts on a busy name.
const WRITE_EVERY: Duration = Duration::from_millis(10);
const RETRY_EVERY: Duration = Duration::from_millis(20);
/// Upper bound on cycles per worker, whatever the duration.
const MAX_CYCLES: usize = 5_000;

/// One name's shared resource, holders' sections and acquisitions.
#[derive(Debug, Default)]
struct Shared {
    resource: Resource,
    sections: OverlapObserver,
    acquisitions: Mutex<Vec<(Instant, u64)>>,
    /// The lease of the latest holder, to ask at the next acquisition.
    holder: Mutex<Option<LeaseHandle>>,
    /// Acquisitions granted while the previous holder's lease still said
    /// held: what the library let two replicas believe at once, whatever
    /// their jobs did with it.
    known_overlaps: AtomicUsize,
    /// For each of those, how long after the grant the previous lease
    /// stopped saying held (`None`: not within [`PUSH_LAG`]).
    heard: Mutex<Vec<JoinHandle<Option<Duration>>>>,
}

impl Shared {
    /// Records a new holder. If the previous holder's lease still says held
    /// now that another replica has the lock, counts a known overlap and
    /// starts timing how long the previous lease goes on saying so.
    fn acquired(&self, lease: LeaseHandle) {
        let mut holder = self.holder.lock().expect("holder");
        if let Some(old) = holder.take().filter(LeaseHandle::is_held) {
            self.known_overlaps.fetch_add(1, Ordering::SeqCst);
            let timing = tokio::spawn(async move { stops_saying_held(&old, PUSH_LAG).await });
            self.heard.lock().expect("heard").push(timing);
        }
        *holder = Some(lease);
    }

    /// How long each known overlap lasted after the grant, once all are timed.
    async fn overlap_lags(&self) -> Vec<Option<Duration>> {
        let timings = std::mem::take(&mut *self.heard.lock().expect("heard"));
        let mut lags = Vec::with_capacity(timings.len());
        for t in timings {
            lags.push(t.await.expect("overlap timing task"));
        }
        lags
    }
}

/// What the workers saw.
#[derive(Debug, Default)]
struct Seen {
    cycles: usize,
    writes: usize,
    acquire_errors: usize,
    release_errors: usize,
    /// Losses while the server was never told to drop anything.
    losses: Vec<(LossReason, Duration)>,
    max_blocked: Duration,
}

/// Tasks alive on this runtime, and file descriptors open in this process.
fn footprint() -> (usize, usize) {
    let tasks = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count);
    (tasks, fds)
}

/// Waits (bounded) for tasks and descriptors to come back to `baseline`;
/// the footprint at the end.
pub(super) async fn settle_to(baseline: (usize, usize), within: Duration) -> (usize, usize) {
    let until = Instant::now() + within;
    loop {
        let now = footprint();
        if (now.0 <= baseline.0 && now.1 <= baseline.1) || Instant::now() >= until {
            return now;
        }
        sleep(Duration::from_millis(50)).await;
    }
}

/// How long the flapping lasts: about 10 s in smoke, 60 s under `CHAOS_SOAK`.
pub(super) fn flap_for() -> Duration {
    let scale = u32::try_from(figures::iterations(1)).unwrap_or(u32::MAX);
    (Duration::from_secs(10) * scale).min(Duration::from_secs(60))
}

async fn worker(
    replica: Replica,
    names: Arc<Vec<(LockName, Arc<Shared>)>>,
    opts: LockOptions,
    seed: usize,
    until: Instant,
    last_reset: Arc<Mutex<Instant>>,
    seen: Arc<Mutex<Seen>>,
) {
    for cycle in 0..MAX_CYCLES {
        if Instant::now() >= until {
            break;
        }
        let (name, shared) = &names[(seed + cycle) % names.len()];
        let asked = Instant::now();
        let attempt = replica.locker.try_lock(name, &opts).await;
        let blocked = asked.elapsed();
        let guard = match attempt {
            Ok(g) => g,
            Err(Error::HeldElsewhere { .. } | Error::HeldLocally { .. }) => {
                sleep(RETRY_EVERY).await;
                continue;
            }
            Err(e) => {
                assert!(
                    matches!(e, Error::Unavailable { .. }),
                    "acquire failed with {e}"
                );
                {
                    let mut s = seen.lock().expect("seen");
                    s.acquire_errors += 1;
                    s.max_blocked = s.max_blocked.max(blocked);
                }
                sleep(RETRY_EVERY).await;
                continue;
            }
        };
        shared.acquired(guard.handle());
        let token = guard.fencing_token().expect("the backend fences");
        shared
            .acquisitions
            .lock()
            .expect("acquisitions")
            .push((Instant::now(), token));
        shared.sections.enter();
        // Hold across several renewals and resets: 1 to 3 renew intervals.
        let hold = opts.renew_interval() * (1 + u32::try_from((seed + cycle) % 3).unwrap_or(0));
        let hold_until = (Instant::now() + hold).min(until);
        let mut writes = 0;
        let mut lost = None;
        // As a job should: act on the loss when told, not at the next write.
        let handle = guard.handle();
        let told = handle.lost();
        tokio::pin!(told);
        let mut was_told = false;
        while Instant::now() < hold_until {
            let deadline = guard.remaining_validity().map(|r| Instant::now() + r);
            if guard.assert_held().is_err() {
                let reason = guard.loss_reason().expect("a lost lease has a reason");
                let since_reset = last_reset.lock().map_or(Duration::ZERO, |r| r.elapsed());
                lost = Some((reason, since_reset));
                break;
            }
            shared.resource.log.record(Instant::now(), deadline);
            shared.resource.write(token);
            writes += 1;
            tokio::select! {
                () = sleep(WRITE_EVERY) => {}
                _ = &mut told, if !was_told => was_told = true,
            }
        }
        shared.sections.exit();
        let released_at = Instant::now();
        let released = guard.release().await;
        let blocked = released_at.elapsed();
        let mut s = seen.lock().expect("seen");
        s.cycles += 1;
        s.writes += writes;
        s.max_blocked = s.max_blocked.max(blocked);
        match (lost, released) {
            (Some(loss), _) => s.losses.push(loss),
            (None, Err(Error::LockLost { reason, .. })) => {
                // Lost between the last write and the release.
                s.losses.push((reason, Duration::ZERO));
            }
            (None, Err(_)) => s.release_errors += 1,
            (None, Ok(())) => {}
        }
    }
}

/// X4 on the backend behind `ctx`.
pub(super) async fn flap(ctx: Ctx, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let proxy = proxy_to_server(&ctx).await;
    let direct = ctx.replica().await;
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(replica_through(&ctx, &proxy).await);
    }
    let names: Arc<Vec<(LockName, Arc<Shared>)>> = Arc::new(
        (0..NAMES)
            .map(|i| (ctx.name(&format!("flap-{i}")), Arc::new(Shared::default())))
            .collect(),
    );
    // Warm up every replica's connections (and the leak probe's), holding
    // across a renewal so that renewal streams exist, then take the baseline.
    // Every name the run uses is taken: a backend that spreads keys over
    // several sessions (Postgres' lock sessions) opens the ones these names
    // hash to, and the run must find them already open.
    for r in replicas.iter().chain([&direct]) {
        let mut held = Vec::new();
        for (name, _) in names.iter() {
            held.push(
                r.locker
                    .try_lock(name, &opts)
                    .await
                    .expect("healthy acquire through the proxy"),
            );
        }
        sleep(opts.renew_interval() * 3 / 2).await;
        for g in held {
            g.release().await.expect("healthy release");
        }
    }
    sleep(opts.renew_interval()).await;
    let baseline = footprint();

    let duration = flap_for();
    let started = Instant::now();
    let until = started + duration;
    let last_reset = Arc::new(Mutex::new(started));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut workers = JoinSet::new();
    for (seed, r) in replicas.iter().enumerate() {
        workers.spawn(worker(
            r.clone(),
            Arc::clone(&names),
            opts.clone(),
            seed,
            until,
            Arc::clone(&last_reset),
            Arc::clone(&seen),
        ));
    }
    let mut resets = 0;
    let mut next = started + FLAP_EVERY;
    while next < until {
        sleep_until(next).await;
        // Stamped first: a holder may hear of the reset before this task
        // runs again.
        *last_reset.lock().expect("last reset") = Instant::now();
        proxy.reset_all();
        resets += 1;
        next += FLAP_EVERY;
    }
    let mut panics = Vec::new();
    let joined_by = until + ttl * 2 + target.op_timeout * 2;
    while let Ok(Some(done)) = tokio::time::timeout_at(joined_by, workers.join_next()).await {
        if let Err(e) = done {
            panics.push(e.to_string());
        }
    }
    assert!(workers.is_empty(), "a worker did not stop in time");
    let ended = Instant::now();

    // One TTL after the end, nothing may still be held.
    sleep_until(ended + ttl + tol).await;
    let mut leaked = 0;
    for (name, _) in names.iter() {
        leaked += super::cases::leak_probe(&direct.locker, name, &opts).await;
    }
    let after = settle_to(baseline, ttl * 2).await;

    let seen = Arc::try_unwrap(seen)
        .map(|m| m.into_inner().expect("seen"))
        .unwrap_or_else(|arc| std::mem::take(&mut *arc.lock().expect("seen")));
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case: "chaos_flap".to_owned(),
        iterations: seen.cycles,
        faults: resets,
        writes: seen.writes,
        leaked,
        max_blocked: Some(seen.max_blocked),
        ..Row::default()
    };
    for (_, shared) in names.iter() {
        let acquisitions = shared.acquisitions.lock().expect("acquisitions").clone();
        row.stale_accepts += shared.resource.stale_after_any(&acquisitions);
        row.after_deadline += shared.resource.log.after_deadline();
        row.overlaps += usize::try_from(shared.sections.overlaps()).unwrap_or(usize::MAX);
    }
    let known: usize = names
        .iter()
        .map(|(_, s)| s.known_overlaps.load(Ordering::SeqCst))
        .sum();
    let mut lags = Vec::new();
    for (_, shared) in names.iter() {
        lags.extend(shared.overlap_lags().await);
    }
    row.abort = seen.losses.iter().map(|(_, since)| *since).collect();
    let summary = format!(
        "{row:?}; known overlaps {known}, said held after the grant for {lags:?}; false aborts {:?}; acquire errors {}, release errors {}; tasks {} -> {}, fds {} -> {}",
        seen.losses, seen.acquire_errors, seen.release_errors, baseline.0, after.0, baseline.1, after.1
    );
    eprintln!("{} chaos_flap: {summary}", row.backend);
    figures::record(row.clone());
    assert!(panics.is_empty(), "workers panicked: {panics:?}");
    assert!(
        row.iterations > 0,
        "no lock cycle completed in {duration:?} of flapping: {summary}"
    );
    // On a TTL backend a false abort is only allowed as "the renewals could
    // not get through before the local deadline": a backend error at the
    // deadline. Anything else (expired, stolen) means the server dropped a
    // lease nobody let lapse. On a session backend a reset ends the session,
    // and the server frees its locks at once: the loss is real and may show
    // as expired or stolen (a successor got in first).
    let caps = ctx.factory().capabilities();
    let session = caps.expiry == Expiry::Session;
    for (reason, _) in &seen.losses {
        assert!(
            *reason == LossReason::BackendError
                || (session && matches!(reason, LossReason::Expired | LossReason::Stolen)),
            "a lease was lost ({reason:?}) with no fault on the server: {summary}"
        );
    }
    // No replica may get a lock while the lease of the one before still
    // says held. A TTL backend's server forgets a lease only after the
    // holder's local deadline: asserted at the grant. A session backend
    // frees the locks when the connection ends, which a reset makes happen
    // at both ends at once; one that pushes losses marks the lease lost as
    // soon as its connection task reads the end, which on a loaded machine
    // may come after another replica's grant (a connection the reset missed
    // needs one round trip): the old lease must stop saying held within
    // PUSH_LAG of the grant. A session backend without the push learns
    // only at the next renewal: that window is what the figures then show.
    if !session {
        assert_eq!(
            known, 0,
            "a lock was granted while its lease said held: {summary}"
        );
    } else if caps.loss_push {
        assert!(
            lags.iter().all(Option::is_some),
            "a lock was granted and the previous lease went on saying held for more than \
             {PUSH_LAG:?}: {summary}"
        );
    }
    // Raw overlaps (sections by the monotonic clock) are reported, not
    // asserted: the job leaves its section when its task next runs after
    // being told, a scheduling delay that a loaded machine can stretch.
    assert!(
        row.stale_accepts == 0 && row.after_deadline == 0 && row.leaked == 0,
        "unsafe writes or leaks: {summary}"
    );
    assert!(
        after.0 <= baseline.0 && after.1 <= baseline.1,
        "tasks or sockets above the baseline after the end: {summary}"
    );
}
