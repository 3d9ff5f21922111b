//! Postgres-specific trials (`postgres::<name>`), run against the private server.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, ReleaseOutcome},
    Error, LeaseHandle, LockBackend, LockMetrics, LockName, LockOptions, Locker, OwnerToken,
    RunOutcome,
};
use lock_postgres::PostgresBackend;
use prometheus::Registry;
use tokio::sync::oneshot;
use tokio::time::{sleep, timeout, Instant};

use super::{faults, input, interop, partition, plain_session, session_end, PostgresFactory, TTL};
use crate::harness::{push_bounded, TrialBody};
use crate::{BoxError, Suite};

/// Longest a Postgres-specific trial may run.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(150);

/// Adds `table`'s trials as `<row>::<name>` on `factory`'s row.
pub(super) fn add(
    suite: &mut Suite,
    factory: &Arc<PostgresFactory>,
    table: &[(&str, TrialBody<Arc<PostgresFactory>>)],
) {
    use crate::BackendFactory;
    push_bounded(suite, factory.name(), factory, TRIAL_TIMEOUT, table);
}

/// The Postgres-specific trials.
pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    let first = crate::trial_table![
        "psql_pairs_interoperate" => interop::psql_pairs_interoperate,
        "golden_keys_on_the_server" => interop::golden_keys_on_the_server,
        "two_lockers_one_backend_exclude" => two_lockers_one_backend_exclude,
        "tick_store_keeps_the_maximum" => tick_store_keeps_the_maximum,
        "release_wakes_a_subscriber" => release_wakes_a_subscriber,
    ];
    add(suite, f, &first);
    session_end::register(suite, f);
    super::inspect::register(suite, f);
    super::tick_tables::register(suite, f);
    let rest = crate::trial_table![
        "one_session_end_loses_only_its_leases" => super::sessions::one_session_end_loses_only_its_leases,
        "standby_is_refused" => super::standby_refused::standby_is_refused,
        "release_waiters_stay_bounded" => super::waiters::release_waiters_stay_bounded,
        "release_is_announced_only_while_waited_for" => super::waiters::release_is_announced_only_while_waited_for,
        "tls_verify_full" => input::tls_verify_full,
        "tls_require_with_root_verifies" => input::tls_require_with_root_verifies,
        "bad_input_gets_typed_errors" => input::bad_input_gets_typed_errors,
        "server_keepalive_follows_max_ttl" => faults::server_keepalive_follows_max_ttl,
        "slow_session_setup_is_bounded_by_connect_timeout" => faults::slow_session_setup_is_bounded_by_connect_timeout,
        "frozen_session_fails_closed" => faults::frozen_session_fails_closed,
    ];
    add(suite, f, &rest);
    // Each needs a tool the machine may lack; without it, what
    // `push_unavailable` stands in for it.
    let needs_tool = crate::trial_table![
        "partitioned_holder_aborts_first" => partition::partitioned_holder_aborts_first,
        "transaction_pooler_is_refused" => faults::transaction_pooler_is_refused,
    ];
    let missing = [
        (!super::nft_installed()).then_some(
            "nft is not installed (apt-get install nftables); CI must test the partition case",
        ),
        (!faults::pgbouncer_installed()).then_some(
            "pgbouncer is not installed (apt-get install pgbouncer); CI must test pooler detection",
        ),
    ];
    for (trial, missing) in needs_tool.into_iter().zip(missing) {
        match missing {
            None => add(suite, f, &[trial]),
            Some(why) => suite.push_unavailable(&format!("postgres::{}", trial.0), why),
        }
    }
}

/// The check that nothing of the run is left on the server; registered last.
pub(super) fn register_leftover_check(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    let table = crate::trial_table![
        "no_leftovers_after_suite" => no_leftovers_after_suite,
    ];
    add(suite, f, &table);
}

pub(super) fn locker(backend: Arc<dyn LockBackend>) -> Result<Locker, BoxError> {
    let metrics = LockMetrics::register(&Registry::new())?;
    Ok(Locker::builder()
        .with_backend_arc(backend)
        .with_metrics(metrics)
        .build()?)
}

/// Acquires `name` for `owner` through `backend` for [`TTL`]; `taken` is
/// the error should it be held already (a case's precondition).
pub(super) async fn acquire_free(
    backend: &dyn LockBackend,
    name: &LockName,
    owner: &OwnerToken,
    taken: &str,
) -> Result<(), BoxError> {
    match backend.try_acquire(name, owner, TTL).await? {
        AcquireAttempt::Acquired(_) => Ok(()),
        _ => Err(taken.into()),
    }
}

pub(super) async fn backend_as(
    f: &PostgresFactory,
    user: &str,
) -> Result<PostgresBackend, BoxError> {
    let url = private_url(f, user)?;
    Ok(f.builder_for(&url)?.connect().await?)
}

pub(super) fn private_url(f: &PostgresFactory, user: &str) -> Result<String, BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    Ok(url.replacen("postgres@", &format!("{user}@"), 1))
}

pub(super) fn name(f: &PostgresFactory, suffix: &str) -> LockName {
    LockName::new(format!(
        "{}/{suffix}-{:08x}",
        f.application_name(),
        getrandom::u32().unwrap_or(0)
    ))
    .expect("valid test name")
}

/// Starts a job that runs until aborted; returns its lease and outcome task.
pub(super) async fn hold(
    locker: &Locker,
    name: &LockName,
) -> Result<
    (
        LeaseHandle,
        tokio::task::JoinHandle<Result<RunOutcome<()>, Error>>,
    ),
    BoxError,
> {
    let (tx, rx) = oneshot::channel();
    let (locker, name) = (locker.clone(), name.clone());
    let run = tokio::spawn(async move {
        locker
            .with_lock(&name, &LockOptions::new(TTL), |lease| async move {
                let _ = tx.send(lease);
                std::future::pending::<()>().await
            })
            .await
    });
    let lease = timeout(Duration::from_secs(5), rx)
        .await
        .map_err(|_| "the job did not start")?
        .map_err(|_| "the job was not entered")?;
    Ok((lease, run))
}

/// Advisory locks are re-entrant per session; two `Locker`s over one
/// backend (one session) must still exclude each other, and a foreign token
/// can neither release nor renew.
async fn two_lockers_one_backend_exclude(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let backend: Arc<dyn LockBackend> = Arc::new(backend_as(&f, "postgres").await?);
    let (a, b) = (locker(backend.clone())?, locker(backend.clone())?);
    let n = name(&f, "shared-session");
    let opts = LockOptions::new(TTL);
    let guard = a.try_lock(&n, &opts).await?;
    if !matches!(
        b.try_lock(&n, &opts).await,
        Err(Error::HeldElsewhere { .. })
    ) {
        return Err("a second Locker on the same session acquired a held name".into());
    }
    let stranger = OwnerToken::generate()?;
    if backend.release(&n, &stranger).await? != ReleaseOutcome::NotHeld {
        return Err("a foreign token released the lock".into());
    }
    if backend.renew(&n, &stranger, TTL).await? == lock_core::backend::LeaseStatus::Held {
        return Err("a foreign token renewed the lock".into());
    }
    guard.assert_held()?;
    if !matches!(
        b.try_lock(&n, &opts).await,
        Err(Error::HeldElsewhere { .. })
    ) {
        return Err("the foreign release freed the lock".into());
    }
    guard.release().await?;
    b.try_lock(&n, &opts).await?.release().await?;
    Ok(())
}

/// A subscriber to a held name is not woken while it is held, and is woken
/// promptly by its release (`NOTIFY`), well before any polling interval.
async fn release_wakes_a_subscriber(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let a = backend_as(&f, "postgres").await?;
    let b = backend_as(&f, "postgres").await?;
    let n = name(&f, "notified");
    let token = OwnerToken::generate()?;
    acquire_free(&a, &n, &token, "setup: the lock was held").await?;
    let mut signal = b
        .subscribe_release(&n)
        .await?
        .ok_or("release notification is on by default")?;
    if timeout(Duration::from_millis(500), &mut signal)
        .await
        .is_ok()
    {
        return Err("the subscriber woke while the lock was held".into());
    }
    let released_at = Instant::now();
    a.release(&n, &token).await?;
    timeout(Duration::from_secs(2), signal)
        .await
        .map_err(|_| "the release did not wake the subscriber")?;
    let latency = released_at.elapsed();
    if latency > Duration::from_millis(400) {
        return Err(format!("woken {latency:?} after the release").into());
    }
    Ok(())
}

/// The tick store keeps the maximum per job, across backends sharing the
/// server, and answers `None` for a job never recorded.
async fn tick_store_keeps_the_maximum(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    use crate::BackendFactory;
    let a = f.tick_store().await?.ok_or("Postgres has a tick store")?;
    let b = f.tick_store().await?.ok_or("Postgres has a tick store")?;
    let job = name(&f, "ticks");
    if a.last_completed(&job).await?.is_some() {
        return Err("a fresh job has a tick".into());
    }
    a.record_completed(&job, 2_000, std::time::Duration::from_secs(60))
        .await?;
    b.record_completed(&job, 1_000, std::time::Duration::from_secs(60))
        .await?;
    if b.last_completed(&job).await? != Some(2_000) {
        return Err("an older tick moved the maximum backwards".into());
    }
    b.record_completed(&job, 3_000, std::time::Duration::from_secs(60))
        .await?;
    if a.last_completed(&job).await? != Some(3_000) {
        return Err("a newer tick was not recorded".into());
    }
    Ok(())
}

/// After every other trial of the run: no advisory lock and no session of
/// this run is left on the server.
async fn no_leftovers_after_suite(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, "lock-ct-inspector").await?;
    let app = f.application_name();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let row = inspector
            .query_one(
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE application_name = $1), \
                        (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                          WHERE l.locktype = 'advisory' AND a.application_name = $1)",
                &[&app],
            )
            .await?;
        let (sessions, locks): (i64, i64) = (row.get(0), row.get(1));
        if sessions == 0 && locks == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{sessions} sessions and {locks} advisory locks of this run are left"
            )
            .into());
        }
        sleep(Duration::from_millis(200)).await;
    }
}
