//! Postgres trials with real faults: a frozen server session, and a
//! transaction-mode PgBouncer in front of the private server.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::AcquireAttempt, BackendErrorKind, LockBackend, LockName, LockOptions, LossReason,
    OwnerToken, RunOutcome,
};
use lock_postgres::PostgresBackend;
use tokio::time::{timeout, Instant};

use super::specific::{acquire_free, backend_as, hold, locker, name};
use super::{holder_pid, plain_session, PostgresFactory, OP_TIMEOUT, TTL};
use crate::harness::{which, ServerProcess, ServerSpec};
use crate::proxy::FaultProxy;
use crate::BoxError;

/// Sends SIGCONT to a stopped process when dropped, so a failing trial never
/// leaves a server process frozen.
pub(crate) struct Frozen(i32);

impl Frozen {
    /// Stops process `pid` (SIGSTOP) until the guard is dropped.
    pub(crate) fn stop(pid: i32) -> Result<Self, BoxError> {
        signal("STOP", pid)?;
        Ok(Self(pid))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = signal("CONT", self.0);
    }
}

fn signal(sig: &str, pid: i32) -> Result<(), BoxError> {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()?
        .success();
    if ok {
        Ok(())
    } else {
        Err(format!("kill -{sig} {pid} failed").into())
    }
}

/// SIGSTOP the server process of our lock session (a process of the private
/// server): calls time out instead of hanging, the job is aborted with
/// `backend_error` at its local deadline, nobody else gets the lock while the
/// frozen session still holds it, and after SIGCONT the lock is released.
pub(super) async fn frozen_session_fails_closed(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let a = Arc::new(backend_as(&f, "postgres").await?);
    let b = Arc::new(backend_as(&f, "postgres").await?);
    let (la, lb) = (locker(a.clone())?, locker(b.clone())?);
    let n = name(&f, "frozen");
    let opts = LockOptions::new(TTL);
    let started = Instant::now();
    let (lease, run) = hold(&la, &n).await?;
    // Another name on the same lock session: its call must time out too.
    let pid = a.lock_session_pid(&n).await?;
    let mut other = name(&f, "frozen-other");
    for i in 0..256 {
        if a.lock_session_pid(&other).await? == pid {
            break;
        }
        other = name(&f, &format!("frozen-other-{i}"));
    }
    if a.lock_session_pid(&other).await? != pid {
        return Err("setup: no name found on the frozen session".into());
    }
    let frozen = Frozen::stop(pid)?;

    let statement_timeout = a.config().statement_timeout();
    let asked = Instant::now();
    let r = timeout(
        statement_timeout * 3,
        a.try_acquire(&other, &OwnerToken::generate()?, TTL),
    )
    .await
    .map_err(|_| "a call on a frozen session hung")?;
    match r {
        Err(e) if e.kind() == BackendErrorKind::Timeout => {}
        other => return Err(format!("a call on a frozen session gave {other:?}").into()),
    }
    if asked.elapsed() > statement_timeout + Duration::from_millis(400) {
        return Err(format!("the timeout took {:?}", asked.elapsed()).into());
    }

    let reason = timeout(TTL * 2, lease.lost())
        .await
        .map_err(|_| "the job was not aborted")?;
    let lost_after = started.elapsed();
    if reason != LossReason::BackendError {
        return Err(format!("expected backend_error, got {reason}").into());
    }
    let deadline = opts.ttl() - opts.drift();
    if lost_after > deadline + Duration::from_millis(400) {
        return Err(format!("aborted {lost_after:?} after acquire; deadline {deadline:?}").into());
    }
    if !matches!(
        run.await?,
        Ok(RunOutcome::Aborted(LossReason::BackendError))
    ) {
        return Err("the run was not aborted".into());
    }
    // Session-scoped: the frozen session still holds the lock.
    if b.try_acquire(&n, &OwnerToken::generate()?, TTL).await? != AcquireAttempt::HeldElsewhere {
        return Err("the lock of a frozen (not dead) session was handed out".into());
    }
    drop(frozen);
    let wait = opts.clone().with_acquire_timeout(TTL * 3);
    lb.lock(&n, &wait).await?.release().await?;
    Ok(())
}

const PGBOUNCER_INI: &str = "[databases]
postgres = host=127.0.0.1 port=@PG_PORT@ dbname=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = @PORT@
unix_socket_dir =
auth_type = trust
auth_file = @DIR@/users.txt
pool_mode = transaction
default_pool_size = 2
ignore_startup_parameters = extra_float_digits,options
";

/// Whether `pgbouncer` is installed.
pub(super) fn pgbouncer_installed() -> bool {
    which("pgbouncer").is_some() || std::path::Path::new("/usr/sbin/pgbouncer").is_file()
}

/// Starts PgBouncer in transaction mode in front of the private server.
fn start_pgbouncer(f: &PostgresFactory) -> Result<(ServerProcess, tempfile::TempDir), BoxError> {
    let pg_port = f.private_started()?.port();
    let program = which("pgbouncer").unwrap_or_else(|| "/usr/sbin/pgbouncer".into());
    let conf = tempfile::Builder::new().prefix("lock-pgb-").tempdir()?;
    let (uid, gid) = super::server::postgres_ids()?;
    std::os::unix::fs::chown(conf.path(), Some(uid), Some(gid))?;
    let dir = conf.path().to_string_lossy().into_owned();
    std::fs::write(
        conf.path().join("pgbouncer.ini.in"),
        PGBOUNCER_INI
            .replace("@PG_PORT@", &pg_port.to_string())
            .replace("@DIR@", &dir),
    )?;
    std::fs::write(conf.path().join("users.txt"), "\"postgres\" \"\"\n")?;
    // The harness picks the port at start, so the ini is written then.
    let script = format!(
        "sed s/@PORT@/{{port}}/ {dir}/pgbouncer.ini.in > {{dir}}/pgbouncer.ini && exec {} {{dir}}/pgbouncer.ini",
        program.display()
    );
    let spec = ServerSpec {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script],
        run_as: Some((uid, gid)),
        ready_timeout: Duration::from_secs(15),
    };
    Ok((ServerProcess::start(spec)?, conf))
}

/// Through PgBouncer in transaction mode, statements of one client session
/// run on whichever server connection is free. When that changes
/// `pg_backend_pid()`, acquire and renew refuse with a `Config` error naming
/// the pooler, and the refused acquire takes no lock.
pub(super) async fn transaction_pooler_is_refused(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let (bouncer, _conf) = tokio::task::block_in_place(|| start_pgbouncer(&f))?;
    let via = format!("postgres://postgres@127.0.0.1:{}/postgres", bouncer.port());
    let direct = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&direct, "lock-ct-inspector").await?;
    // One lock session: the pinning below assumes one client connection.
    let config = f
        .builder_for(&via)?
        .with_fencing_tokens(false)
        .with_lock_sessions(1)
        .config()?;

    // The backend's setup ran on the only server connection, X. A client in
    // an open transaction now pins X, so our next statement runs on Y.
    let backend = PostgresBackend::connect(config.clone()).await?;
    let x = backend.session_pid().await?;
    let pin = plain_session(&via, f.application_name()).await?;
    pin.batch_execute("BEGIN").await?;
    let pinned: i32 = pin.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    if pinned != x {
        return Err(format!("setup: the pinning client got {pinned}, not the idle {x}").into());
    }
    let n = name(&f, "pooled");
    let r = backend.try_acquire(&n, &OwnerToken::generate()?, TTL).await;
    if !is_pooler(r.as_ref().err()) {
        return Err(format!("acquire through a transaction pooler gave {r:?}").into());
    }
    if holder_pid(&inspector, backend.config().key_for(&n))
        .await?
        .is_some()
    {
        return Err("the refused acquire left a lock on the server".into());
    }
    pin.batch_execute("COMMIT").await?;

    // Renew: acquire while nobody else is active, then pin that connection.
    let second = PostgresBackend::connect(config).await?;
    let token = OwnerToken::generate()?;
    let m: LockName = name(&f, "pooled-renew");
    acquire_free(
        &second,
        &m,
        &token,
        "setup: acquire through the pooler failed",
    )
    .await?;
    let p = second.session_pid().await?;
    pin.batch_execute("BEGIN").await?;
    let pinned: i32 = pin.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    if pinned != p {
        return Err(format!("setup: the pinning client got {pinned}, not {p}").into());
    }
    let r = second.renew(&m, &token, TTL).await;
    if !is_pooler(r.as_ref().err()) {
        return Err(format!("renew through a transaction pooler gave {r:?}").into());
    }
    pin.batch_execute("ROLLBACK").await?;
    drop(bouncer);
    Ok(())
}

fn is_pooler(e: Option<&lock_core::BackendError>) -> bool {
    e.is_some_and(|e| {
        e.kind() == BackendErrorKind::Config && e.to_string().contains("transaction-mode pooler")
    })
}

/// The server applies the keepalive derived from `max_ttl` to the lock
/// session's socket: `ss` shows its keepalive timer at most `ceil(max_ttl)`
/// seconds, where a session without it shows the kernel's two hours.
pub(super) async fn server_keepalive_follows_max_ttl(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let port = tokio::task::block_in_place(|| f.private_started())?.port();
    for max_ttl in [Duration::from_secs(2), Duration::from_secs(30)] {
        let url = tokio::task::block_in_place(|| f.url())?;
        let backend = f.builder_for(&url)?.with_max_ttl(max_ttl).connect().await?;
        let pid = backend.session_pid().await?;
        // Right after a statement the socket may show its retransmission
        // timer instead, until the client's delayed ACK arrives.
        let mut timer = keepalive_timer(port, pid);
        for _ in 0..40 {
            if timer.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            timer = keepalive_timer(port, pid);
        }
        let timer = timer?;
        let low = max_ttl.saturating_sub(Duration::from_secs(2));
        if timer > max_ttl || timer < low {
            return Err(
                format!("max_ttl {max_ttl:?}: the server's keepalive timer is {timer:?}").into(),
            );
        }
    }
    Ok(())
}

/// The keepalive timer `ss` shows for the server process `pid`'s socket.
fn keepalive_timer(port: u16, pid: i32) -> Result<Duration, BoxError> {
    let line = super::partition::ss_line("-tnoHp", port, pid)?;
    let timer = line
        .split("timer:(keepalive,")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .ok_or_else(|| format!("no keepalive timer in {line:?}"))?;
    parse_ss_time(timer).ok_or_else(|| format!("cannot read ss time {timer:?}").into())
}

/// Reads `ss` times: `[Nmin][S(sec|.)][MMMms]`, such as `119min`, `29sec`,
/// `1.756ms` (1 s 756 ms) or `998ms`.
fn parse_ss_time(text: &str) -> Option<Duration> {
    let (mins, rest) = match text.split_once("min") {
        Some((m, rest)) => (m.parse::<u64>().ok()?, rest),
        None => (0, text),
    };
    let (secs, rest) = if let Some((s, r)) = rest.split_once("sec") {
        (s.parse::<u64>().ok()?, r)
    } else if let Some((s, r)) = rest.split_once('.') {
        (s.parse::<u64>().ok()?, r)
    } else {
        (0, rest)
    };
    let millis = match rest.strip_suffix("ms") {
        Some(ms) => ms.parse::<u64>().ok()?,
        None if rest.is_empty() => 0,
        None => return None,
    };
    Some(Duration::from_secs(mins * 60 + secs) + Duration::from_millis(millis))
}

/// A new lock session on a slow server (every reply 1.3 s late, as a freshly
/// forked server process on a loaded machine can be) is set up within the
/// connect timeout, not the shorter statement timeout; the lock calls on it
/// are still bounded by the statement timeout.
pub(super) async fn slow_session_setup_is_bounded_by_connect_timeout(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let port = tokio::task::block_in_place(|| f.private_started())?.port();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    let slow = OP_TIMEOUT + Duration::from_millis(300);
    proxy.set_response_delay(slow);
    let via = format!("postgres://postgres@{}/postgres", proxy.addr());
    let connect_timeout = Duration::from_secs(15);
    let backend = timeout(
        connect_timeout + Duration::from_secs(2),
        f.builder_for(&via)?
            .with_connect_timeout(connect_timeout)
            .connect(),
    )
    .await
    .map_err(|_| "connecting hung past its connect timeout")?
    .map_err(|e| format!("a slow session was not set up within the connect timeout: {e}"))?;
    if backend.config().statement_timeout() != OP_TIMEOUT {
        return Err("the statement timeout changed".into());
    }
    let n = name(&f, "slow-setup");
    let asked = Instant::now();
    let r = timeout(
        OP_TIMEOUT * 4,
        backend.try_acquire(&n, &OwnerToken::generate()?, TTL),
    )
    .await
    .map_err(|_| "a lock call on the slow session hung")?;
    match r {
        Err(e) if e.kind() == BackendErrorKind::Timeout => {}
        other => {
            return Err(
                format!("a lock call slower than the statement timeout gave {other:?}").into(),
            )
        }
    }
    if asked.elapsed() > OP_TIMEOUT + Duration::from_millis(500) {
        return Err(format!("the lock call's timeout took {:?}", asked.elapsed()).into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ss_times() {
        assert_eq!(parse_ss_time("119min"), Some(Duration::from_secs(7140)));
        assert_eq!(parse_ss_time("29sec"), Some(Duration::from_secs(29)));
        assert_eq!(parse_ss_time("1.756ms"), Some(Duration::from_millis(1756)));
        assert_eq!(parse_ss_time("998ms"), Some(Duration::from_millis(998)));
        assert_eq!(parse_ss_time("1min5sec"), Some(Duration::from_secs(65)));
        assert_eq!(parse_ss_time("soon"), None);
    }
}
