//! Interoperation with other programs on the same server: `psql` holding
//! the same `(int4, int4)` pairs, and the documented key mapping as
//! `pg_locks` shows it.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, ReleaseOutcome},
    LockBackend, LockName, OwnerToken,
};
use lock_postgres::{AdvisoryKey, PostgresBackend};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::time::timeout;

use super::specific::{acquire_free, name};
use super::{holder_pid, plain_session, PostgresFactory, TTL};
use crate::BoxError;

/// A `psql` holding `pg_try_advisory_lock(a, b)` excludes us and vice versa;
/// the `bigint` form with the same bits is a different lock.
pub(super) async fn psql_pairs_interoperate(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let n = name(&f, "psql");
    let key = AdvisoryKey::new(
        i32::from_ne_bytes(getrandom::u32().unwrap_or(1).to_ne_bytes()),
        i32::from_ne_bytes(getrandom::u32().unwrap_or(2).to_ne_bytes()),
    );
    let config = f
        .builder_for(&url)?
        .with_explicit_key(n.clone(), key)
        .config()?;
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
    if ours.try_acquire(&n, &token, TTL).await? != AcquireAttempt::HeldElsewhere {
        return Err("we acquired a pair psql holds".into());
    }
    expect(
        psql.ask(&format!("SELECT pg_advisory_unlock({a}, {b});"))
            .await?,
        "t",
        "psql unlocks",
    )?;
    acquire_free(&ours, &n, &token, "we could not acquire the freed pair").await?;
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
pub(super) async fn golden_keys_on_the_server(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let config = f
        .builder_for(&url)?
        .with_namespace("lock")
        .with_fencing_tokens(false)
        .config()?;
    let backend = PostgresBackend::connect(config).await?;
    let n = LockName::new("job")?;
    let golden = AdvisoryKey::new(-711_063_049, 1_043_648_169);
    let token = OwnerToken::generate()?;
    acquire_free(&backend, &n, &token, "the golden name was held").await?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let pid = backend.lock_session_pid(&n).await?;
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
