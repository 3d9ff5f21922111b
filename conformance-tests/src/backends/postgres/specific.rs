//! Postgres-specific trials (`postgres::<name>`), run against the private server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
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
use crate::harness::in_ci;
use crate::{BoxError, Suite};

type Body = fn(Arc<PostgresFactory>) -> Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

const TRIAL_TIMEOUT: Duration = Duration::from_secs(150);

fn run(factory: Arc<PostgresFactory>, body: Body) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(async move {
        match timeout(TRIAL_TIMEOUT, body(factory)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Failed::from(e.to_string())),
            Err(_) => Err(Failed::from(format!(
                "did not finish within {TRIAL_TIMEOUT:?}"
            ))),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    outcome
}

pub(super) fn add(suite: &mut Suite, factory: &Arc<PostgresFactory>, name: &str, body: Body) {
    let f = Arc::clone(factory);
    let full = format!("{}::{name}", lock_core_name(&f));
    suite.push(Trial::test(full, move || run(f, body)));
}

fn lock_core_name(f: &PostgresFactory) -> &str {
    use crate::BackendFactory;
    f.name()
}

/// The Postgres-specific trials.
pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    add(suite, f, "psql_pairs_interoperate", |f| {
        Box::pin(interop::psql_pairs_interoperate(f))
    });
    add(suite, f, "golden_keys_on_the_server", |f| {
        Box::pin(interop::golden_keys_on_the_server(f))
    });
    add(suite, f, "two_lockers_one_backend_exclude", |f| {
        Box::pin(two_lockers_one_backend_exclude(f))
    });
    add(suite, f, "tick_store_keeps_the_maximum", |f| {
        Box::pin(tick_store_keeps_the_maximum(f))
    });
    add(suite, f, "release_wakes_a_subscriber", |f| {
        Box::pin(release_wakes_a_subscriber(f))
    });
    session_end::register(suite, f);
    super::inspect::register(suite, f);
    super::tick_tables::register(suite, f);
    add(suite, f, "one_session_end_loses_only_its_leases", |f| {
        Box::pin(super::sessions::one_session_end_loses_only_its_leases(f))
    });
    add(suite, f, "standby_is_refused", |f| {
        Box::pin(super::standby_refused::standby_is_refused(f))
    });
    add(suite, f, "release_waiters_stay_bounded", |f| {
        Box::pin(super::waiters::release_waiters_stay_bounded(f))
    });
    add(
        suite,
        f,
        "release_is_announced_only_while_waited_for",
        |f| {
            Box::pin(super::waiters::release_is_announced_only_while_waited_for(
                f,
            ))
        },
    );
    add(suite, f, "tls_verify_full", |f| {
        Box::pin(input::tls_verify_full(f))
    });
    add(suite, f, "tls_require_with_root_verifies", |f| {
        Box::pin(input::tls_require_with_root_verifies(f))
    });
    add(suite, f, "bad_input_gets_typed_errors", |f| {
        Box::pin(input::bad_input_gets_typed_errors(f))
    });
    add(suite, f, "server_keepalive_follows_max_ttl", |f| {
        Box::pin(faults::server_keepalive_follows_max_ttl(f))
    });
    add(
        suite,
        f,
        "slow_session_setup_is_bounded_by_connect_timeout",
        |f| Box::pin(faults::slow_session_setup_is_bounded_by_connect_timeout(f)),
    );
    add(suite, f, "frozen_session_fails_closed", |f| {
        Box::pin(faults::frozen_session_fails_closed(f))
    });
    if super::nft_installed() {
        add(suite, f, "partitioned_holder_aborts_first", |f| {
            Box::pin(partition::partitioned_holder_aborts_first(f))
        });
    } else if in_ci() {
        suite.push(Trial::test(
            "postgres::partitioned_holder_aborts_first",
            || Err("nft is not installed; CI must test the partition case".into()),
        ));
    } else {
        eprintln!("!!! SKIPPING postgres::partitioned_holder_aborts_first: nft is not installed (apt-get install nftables). Set CI=true to make this a failure.");
    }
    if faults::pgbouncer_installed() {
        add(suite, f, "transaction_pooler_is_refused", |f| {
            Box::pin(faults::transaction_pooler_is_refused(f))
        });
    } else if in_ci() {
        suite.push(Trial::test(
            "postgres::transaction_pooler_is_refused",
            || Err("pgbouncer is not installed; CI must test pooler detection".into()),
        ));
    } else {
        eprintln!("!!! SKIPPING postgres::transaction_pooler_is_refused: pgbouncer is not installed (apt-get install pgbouncer). Set CI=true to make this a failure.");
    }
}

/// The check that nothing of the run is left on the server; registered last.
pub(super) fn register_leftover_check(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    add(suite, f, "no_leftovers_after_suite", |f| {
        Box::pin(no_leftovers_after_suite(f))
    });
}

pub(super) fn locker(backend: Arc<dyn LockBackend>) -> Result<Locker, BoxError> {
    let metrics = LockMetrics::register(&Registry::new())?;
    Ok(Locker::builder()
        .with_backend_arc(backend)
        .with_metrics(metrics)
        .build()?)
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
    if !matches!(
        a.try_acquire(&n, &token, TTL).await?,
        AcquireAttempt::Acquired(_)
    ) {
        return Err("setup: the lock was held".into());
    }
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
