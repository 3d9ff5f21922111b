//! Memory-specific trials (`memory::<name>`): the backend's bookkeeping for
//! waiting acquires stays bounded by the waits that are still live.

use std::sync::mpsc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{
    backend::AcquireAttempt, Error, LockBackend, LockName, LockOptions, Locker, OwnerToken,
};
use lock_memory::MemoryBackend;
use prometheus::Registry;

use crate::Suite;

/// Abandoned waits per run, each on its own name.
const WAITS: usize = 100_000;

/// Longest the trial may run in real time (its own clock is paused).
const WALL_LIMIT: Duration = Duration::from_secs(240);

/// Adds the memory-specific trials.
pub fn add_specific(suite: &mut Suite) {
    let prefix = format!("ct-{}/memory", suite.run_id());
    suite.push(Trial::test(
        "memory::abandoned_waits_leave_no_waiter_entries",
        move || on_paused_clock(abandoned_waits_leave_no_waiter_entries(prefix)),
    ));
}

/// Runs `body` on a paused current-thread runtime in its own thread, and
/// fails if it has not finished within [`WALL_LIMIT`] of real time.
fn on_paused_clock(
    body: impl std::future::Future<Output = Result<(), Failed>> + Send + 'static,
) -> Result<(), Failed> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let outcome = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .map_err(Failed::from)
            .and_then(|rt| rt.block_on(body));
        let _ = tx.send(outcome);
    });
    match rx.recv_timeout(WALL_LIMIT) {
        Ok(outcome) => outcome,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            Err(format!("did not finish within {WALL_LIMIT:?}").into())
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err("the trial panicked".into()),
    }
}

fn locker(backend: &MemoryBackend) -> Result<Locker, Failed> {
    Ok(Locker::builder()
        .with_backend(backend.clone())
        .with_registry(&Registry::new())
        .build()?)
}

/// 100,000 waits on distinct names that end by timeout, by cancellation, or
/// by the lock they waited for running out, leave no waiter entry behind;
/// a live wait keeps exactly one, until it ends too.
async fn abandoned_waits_leave_no_waiter_entries(prefix: String) -> Result<(), Failed> {
    let backend = MemoryBackend::new();
    let waiter = locker(&backend)?;
    let holder = OwnerToken::generate()?;
    // One label for every name, so the registry stays small.
    let opts = LockOptions::new(Duration::from_secs(1)).with_metric_label("waits");
    let name = |i: usize| LockName::new(format!("{prefix}/wait-{i}"));
    let (mut timed_out, mut cancelled, mut outlived) = (0usize, 0usize, 0usize);
    for i in 0..WAITS {
        let name = name(i)?;
        match i % 3 {
            // Held for 10 ms; the wait gives up after 1 ms.
            0 => {
                hold(&backend, &name, &holder, ms(10)).await?;
                let got = waiter
                    .lock(&name, &opts.clone().with_acquire_timeout(ms(1)))
                    .await;
                if !matches!(got, Err(Error::Timeout { .. })) {
                    return Err(format!("wait {i}: {got:?}, expected a timeout").into());
                }
                timed_out += 1;
            }
            // Held for 10 ms; the caller drops the wait after 1 ms.
            1 => {
                hold(&backend, &name, &holder, ms(10)).await?;
                let wait = waiter.lock(&name, &opts);
                if tokio::time::timeout(ms(1), wait).await.is_ok() {
                    return Err(format!("wait {i} ended before it was cancelled").into());
                }
                cancelled += 1;
            }
            // The holder's lease runs out after 1 ms; the waiter takes the
            // lock and keeps it for 1 ms more, so it too ends by expiry and
            // no release ever wakes the name.
            _ => {
                hold(&backend, &name, &holder, ms(1)).await?;
                let guard = waiter
                    .lock(&name, &opts.clone().with_acquire_timeout(ms(50)))
                    .await
                    .map_err(|e| format!("wait {i}: {e}"))?;
                guard.retain_for(ms(1)).await?;
                outlived += 1;
            }
        }
    }
    let left = backend.waiter_entries();
    println!(
        "memory: {left} waiter entries after {WAITS} ended waits \
         ({timed_out} timed out, {cancelled} cancelled, {outlived} outlived the lock)"
    );
    if left != 0 {
        return Err(
            format!("{left} waiter entries left after {WAITS} ended waits, expected 0").into(),
        );
    }
    live_wait_keeps_one_entry(&backend, &waiter, &opts, &name(WAITS)?).await
}

/// A wait still in progress keeps its entry, and only its own.
async fn live_wait_keeps_one_entry(
    backend: &MemoryBackend,
    waiter: &Locker,
    opts: &LockOptions,
    name: &LockName,
) -> Result<(), Failed> {
    let holder = OwnerToken::generate()?;
    hold(backend, name, &holder, Duration::from_secs(60)).await?;
    let wait = {
        let (waiter, name, opts) = (waiter.clone(), name.clone(), opts.clone());
        tokio::spawn(async move { waiter.lock(&name, &opts).await })
    };
    // The wait subscribes on its first poll; the paused clock does not move
    // while this task yields.
    for _ in 0..100 {
        if backend.waiter_entries() > 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let live = backend.waiter_entries();
    if live != 1 {
        return Err(format!("{live} waiter entries with one live wait, expected 1").into());
    }
    backend.release(name, &holder).await?;
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .map_err(|_| "the live wait was not woken by the release")???;
    guard.release().await?;
    let left = backend.waiter_entries();
    if left != 0 {
        return Err(format!("{left} waiter entries after the live wait ended, expected 0").into());
    }
    Ok(())
}

async fn hold(
    backend: &MemoryBackend,
    name: &LockName,
    owner: &OwnerToken,
    ttl: Duration,
) -> Result<(), Failed> {
    match backend.try_acquire(name, owner, ttl).await? {
        AcquireAttempt::Acquired(_) => Ok(()),
        other => Err(format!("{name}: {other:?}, expected a free name").into()),
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
