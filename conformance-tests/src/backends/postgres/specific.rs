//! Postgres-specific trials (`postgres::<name>`), run against the private server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{
    AcquireAttempt, Error, LeaseHandle, LockBackend, LockMetrics, LockName, LockOptions, Locker,
    LossReason, OwnerToken, ReleaseOutcome, RunOutcome,
};
use lock_postgres::{AdvisoryKey, PostgresBackend};
use prometheus::Registry;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;
use tokio::time::{sleep, timeout, Instant};

use super::server::ROLE_IDLER;
use super::{faults, holder_pid, input, partition, plain_session, terminate, PostgresFactory, TTL};
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

fn add(suite: &mut Suite, factory: &Arc<PostgresFactory>, name: &str, body: Body) {
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
    add(suite, f, "terminate_backend_aborts_the_job", |f| {
        Box::pin(terminate_backend_aborts_the_job(f))
    });
    add(suite, f, "idle_session_timeout_is_detected", |f| {
        Box::pin(idle_session_timeout_is_detected(f))
    });
    add(suite, f, "psql_pairs_interoperate", |f| {
        Box::pin(psql_pairs_interoperate(f))
    });
    add(suite, f, "golden_keys_on_the_server", |f| {
        Box::pin(golden_keys_on_the_server(f))
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
    add(suite, f, "release_waiters_stay_bounded", |f| {
        Box::pin(super::waiters::release_waiters_stay_bounded(f))
    });
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
    add(suite, f, "frozen_session_fails_closed", |f| {
        Box::pin(faults::frozen_session_fails_closed(f))
    });
    if partition::nft_installed() {
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
        .backend_arc(backend)
        .metrics(metrics)
        .build()?)
}

pub(super) async fn backend_as(
    f: &PostgresFactory,
    user: &str,
) -> Result<PostgresBackend, BoxError> {
    let url = private_url(f, user)?;
    Ok(PostgresBackend::connect(f.builder_for(&url)?.build()?).await?)
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

/// Kills our lock session with `pg_terminate_backend`, another session then
/// takes the lock; the job must abort within one renewal interval. Prints
/// the measured latency from the kill to the abort.
async fn terminate_backend_aborts_the_job(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let killer = plain_session(&url, f.application_name()).await?;
    let interval = LockOptions::new(TTL).renew_interval();
    let bound = interval + Duration::from_millis(400);
    let mut latencies = Vec::new();
    for round in 0..8u32 {
        let a = Arc::new(backend_as(&f, "postgres").await?);
        let b = Arc::new(backend_as(&f, "postgres").await?);
        let (la, lb) = (locker(a.clone())?, locker(b.clone())?);
        let n = name(&f, "terminated");
        let (lease, run) = hold(&la, &n).await?;
        // Spread the kills over the renewal cycle.
        sleep(Duration::from_millis(100 + u64::from(round) * 61)).await;
        let pid = a.session_pid().await?;
        let killed_at = Instant::now();
        terminate(&killer, pid).await?;
        let successor = lb.try_lock(&n, &LockOptions::new(TTL)).await?;
        let reason = timeout(bound * 2, lease.lost())
            .await
            .map_err(|_| format!("round {round}: the job was not told within {:?}", bound * 2))?;
        let latency = killed_at.elapsed();
        if !matches!(reason, LossReason::Stolen | LossReason::Expired) {
            return Err(format!("round {round}: loss reason {reason}").into());
        }
        if latency > bound {
            return Err(format!(
                "round {round}: abort {latency:?} after the kill (bound {bound:?})"
            )
            .into());
        }
        match run.await? {
            Ok(RunOutcome::Aborted(_)) => {}
            other => {
                return Err(format!("round {round}: expected an aborted run, got {other:?}").into())
            }
        }
        successor.release().await?;
        latencies.push(latency);
    }
    latencies.sort();
    println!(
        "postgres: pg_terminate_backend -> job abort over {} kills (renew every {interval:?}): \
         min {:?}, median {:?}, max {:?}",
        latencies.len(),
        latencies[0],
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    Ok(())
}

/// A role with `idle_session_timeout = 300ms`: the server ends the lock
/// session between renewals; the holder learns it at the next renewal.
async fn idle_session_timeout_is_detected(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let idle = Duration::from_millis(300);
    let interval = LockOptions::new(TTL).renew_interval();
    let a = Arc::new(backend_as(&f, ROLE_IDLER).await?);
    let la = locker(a.clone())?;
    let n = name(&f, "idle");
    let (lease, run) = hold(&la, &n).await?;
    let acquired = Instant::now();
    let reason = timeout(TTL * 2, lease.lost())
        .await
        .map_err(|_| "the idle-timed-out session was not noticed")?;
    let since_kill = acquired.elapsed().saturating_sub(idle);
    if reason != LossReason::Expired {
        return Err(format!("expected expired, got {reason}").into());
    }
    if since_kill > interval + Duration::from_millis(400) {
        return Err(
            format!("noticed {since_kill:?} after the idle timeout at the earliest").into(),
        );
    }
    if !matches!(run.await?, Ok(RunOutcome::Aborted(LossReason::Expired))) {
        return Err("the run was not aborted".into());
    }
    let b = locker(Arc::new(backend_as(&f, "postgres").await?))?;
    b.try_lock(&n, &LockOptions::new(TTL))
        .await?
        .release()
        .await?;
    println!(
        "postgres: idle_session_timeout loss noticed {since_kill:?} after the server's timeout"
    );
    Ok(())
}

/// A `psql` holding `pg_try_advisory_lock(a, b)` excludes us and vice versa;
/// the `bigint` form with the same bits is a different lock.
async fn psql_pairs_interoperate(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let n = name(&f, "psql");
    let key = AdvisoryKey::new(
        i32::from_ne_bytes(getrandom::u32().unwrap_or(1).to_ne_bytes()),
        i32::from_ne_bytes(getrandom::u32().unwrap_or(2).to_ne_bytes()),
    );
    let config = f.builder_for(&url)?.explicit_key(n.clone(), key).build()?;
    let ours = PostgresBackend::connect(config).await?;
    let mut psql = Psql::spawn(&url, f.application_name()).await?;
    let (a, b) = (key.key1, key.key2);
    let pair = format!("pg_try_advisory_lock({a}, {b})");
    let big = format!("(({a})::bigint << 32) | ({b}::bigint & 4294967295)");
    let token = OwnerToken::generate()?;

    expect(
        psql.ask(&format!("SELECT {pair};")).await?,
        "t",
        "psql takes the pair",
    )?;
    if ours.try_acquire(&n, &token, TTL).await? != AcquireAttempt::Held {
        return Err("we acquired a pair psql holds".into());
    }
    expect(
        psql.ask(&format!("SELECT pg_advisory_unlock({a}, {b});"))
            .await?,
        "t",
        "psql unlocks",
    )?;
    if !matches!(
        ours.try_acquire(&n, &token, TTL).await?,
        AcquireAttempt::Acquired(_)
    ) {
        return Err("we could not acquire the freed pair".into());
    }
    expect(
        psql.ask(&format!("SELECT {pair};")).await?,
        "f",
        "psql is excluded by us",
    )?;
    let bigint = format!("SELECT pg_try_advisory_lock({big}), pg_advisory_unlock({big});");
    expect(
        psql.ask(&bigint).await?,
        "t|t",
        "the bigint form is another key space",
    )?;
    if ours.release(&n, &token).await? != ReleaseOutcome::Released {
        return Err("release did not report released".into());
    }
    expect(
        psql.ask(&format!("SELECT {pair};")).await?,
        "t",
        "psql takes it after our release",
    )?;
    psql.quit().await
}

fn expect(actual: String, want: &str, what: &str) -> Result<(), BoxError> {
    if actual == want {
        Ok(())
    } else {
        Err(format!("{what}: psql said {actual:?}, expected {want:?}").into())
    }
}

/// A long-lived `psql` session driven line by line.
struct Psql {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Psql {
    async fn spawn(url: &str, app: &str) -> Result<Self, BoxError> {
        let mut child = tokio::process::Command::new("psql")
            .args([url, "-At", "-v", "ON_ERROR_STOP=1"])
            .env("PGAPPNAME", app)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child.stdin.take().ok_or("psql stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("psql stdout")?).lines();
        Ok(Self {
            child,
            stdin,
            stdout,
        })
    }

    async fn ask(&mut self, sql: &str) -> Result<String, BoxError> {
        self.stdin.write_all(format!("{sql}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        let line = timeout(Duration::from_secs(5), self.stdout.next_line())
            .await
            .map_err(|_| format!("psql did not answer {sql}"))??;
        line.ok_or_else(|| format!("psql exited on {sql}").into())
    }

    async fn quit(mut self) -> Result<(), BoxError> {
        self.stdin.write_all(b"\\q\n").await?;
        drop(self.stdin);
        match timeout(Duration::from_secs(5), self.child.wait()).await {
            Ok(status) => {
                status?;
                Ok(())
            }
            Err(_) => {
                self.child.kill().await?;
                Err("psql did not exit".into())
            }
        }
    }
}

/// The documented mapping is what the server sees: a golden name shows up
/// in `pg_locks` with the golden key.
async fn golden_keys_on_the_server(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let config = f
        .builder_for(&url)?
        .namespace("lock")
        .fencing(false)
        .build()?;
    let backend = PostgresBackend::connect(config).await?;
    let n = LockName::new("job")?;
    let golden = AdvisoryKey::new(-711_063_049, 1_043_648_169);
    let token = OwnerToken::generate()?;
    if !matches!(
        backend.try_acquire(&n, &token, TTL).await?,
        AcquireAttempt::Acquired(_)
    ) {
        return Err("the golden name was held".into());
    }
    let inspector = plain_session(&url, f.application_name()).await?;
    let pid = backend.session_pid().await?;
    let rows = inspector
        .query(
            "SELECT classid::int8, objid::int8, objsubid::int4 FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = $1",
            &[&pid],
        )
        .await?;
    let seen: Vec<(i64, i64, i32)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    backend.release(&n, &token).await?;
    if seen != [(golden.classid(), golden.objid(), 2)] {
        return Err(format!("pg_locks shows {seen:?} for the golden key {golden}").into());
    }
    if holder_pid(&inspector, golden).await?.is_some() {
        return Err("the golden key is still held after release".into());
    }
    Ok(())
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
    if !matches!(b.try_lock(&n, &opts).await, Err(Error::Contended { .. })) {
        return Err("a second Locker on the same session acquired a held name".into());
    }
    let stranger = OwnerToken::generate()?;
    if backend.release(&n, &stranger).await? != ReleaseOutcome::NotHeld {
        return Err("a foreign token released the lock".into());
    }
    if backend.renew(&n, &stranger, TTL).await? == lock_core::LeaseStatus::Held {
        return Err("a foreign token renewed the lock".into());
    }
    guard.assert_held()?;
    if !matches!(b.try_lock(&n, &opts).await, Err(Error::Contended { .. })) {
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
