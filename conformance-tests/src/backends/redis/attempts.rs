//! Lock attempts that arrive together share script calls, and a release
//! never lets a queued attempt of its owner take the lock after it:
//! `redis::concurrent_attempts_share_commands` and
//! `redis::release_waits_for_a_queued_attempt`.

use std::collections::{HashMap, HashSet};
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::backend::{AcquireAttempt, ReleaseOutcome};
use lock_core::{LockBackend, LockName, OwnerToken};
use lock_redis::RedisBackend;
use redis::aio::MultiplexedConnection;
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout};

use super::specific::{ensure, plain, tracing_line};
use super::{config_for, server, RedisFactory, TTL};
use crate::harness::ServerProcess;
use crate::BoxError;

/// Names tried at once in `concurrent_attempts_share_commands`, each by two
/// owners.
const NAMES: usize = 150;

/// Starts recording every command on the server (its slow log, with a
/// threshold of 0), forgetting what was recorded before.
async fn record_commands(c: &mut MultiplexedConnection) -> Result<(), BoxError> {
    for (setting, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "100000"),
    ] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(setting)
            .arg(value)
            .query_async(c)
            .await?;
    }
    let () = redis::cmd("SLOWLOG").arg("RESET").query_async(c).await?;
    Ok(())
}

/// The commands recorded since [`record_commands`] that can take a lock
/// (`SET`, `EVAL`, `EVALSHA`), as clients sent them: the slow log also
/// lists the commands a script calls, with the address `?:0`, and those are
/// left out (`INFO commandstats` counts both alike).
async fn acquiring_commands(c: &mut MultiplexedConnection) -> Result<usize, BoxError> {
    type Entry = (i64, i64, i64, Vec<String>, String, String);
    let log: Vec<Entry> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(c)
        .await?;
    Ok(log
        .iter()
        .filter(|(_, _, _, args, addr, _)| {
            addr != "?:0"
                && args.first().is_some_and(|cmd| {
                    ["set", "eval", "evalsha"].contains(&cmd.to_ascii_lowercase().as_str())
                })
        })
        .count())
}

/// Runs `attempt`, counting it in `entered` once it has been polled once:
/// an attempt enters the backend's lane (sent, or queued) in its first poll,
/// before it waits for anything.
async fn counted_once<F: Future>(attempt: F, entered: &AtomicUsize) -> F::Output {
    let mut attempt = pin!(attempt);
    let mut first = true;
    poll_fn(|cx| {
        let polled = attempt.as_mut().poll(cx);
        if std::mem::take(&mut first) {
            entered.fetch_add(1, Ordering::SeqCst);
        }
        polled
    })
    .await
}

/// The winners of a burst: each name's owner and fencing token.
type Winners = HashMap<LockName, (OwnerToken, Option<u64>)>;

/// 300 concurrent attempts on 150 names, two owners each: exactly one owner
/// wins each name, the key holds the winner's token, fencing tokens are
/// distinct, and the server runs 17 commands for them (with and without
/// fencing tokens): the 16 sent at once, the most in flight on a connection,
/// and one script for the rest, which queue behind those. A server of its
/// own, so that nobody else's commands are counted, and a first burst
/// before the counted one, so that the scripts are loaded (a script's first
/// call on a server is sent twice).
pub(super) async fn concurrent_attempts_share_commands(
    f: Arc<RedisFactory>,
) -> Result<(), BoxError> {
    /// Attempts sent at once, each its own command, before the rest queue
    /// (`IN_FLIGHT` in lock-redis's attempts), plus the one script that
    /// carries the queued ones.
    const COMMANDS: usize = 16 + 1;
    let srv = server::start_plain()?;
    let url = format!("redis://127.0.0.1:{}", srv.port());
    let mut raw = plain(&url).await?;
    for fenced in [true, false] {
        let backend = config_for(&url)?
            .with_key_prefix(f.prefix())
            .with_fencing_tokens(fenced)
            .connect()
            .await?;
        backend.ping().await?;
        for (name, (owner, _)) in burst(&backend, &srv, &format!("warm-up/{fenced}")).await? {
            backend.release(&name, &owner).await?;
        }
        record_commands(&mut raw).await?;
        let winners = burst(&backend, &srv, &format!("attempts/{fenced}")).await?;
        let commands = acquiring_commands(&mut raw).await?;
        ensure(
            winners.len() == NAMES,
            format!("{} of {NAMES} names granted", winners.len()),
        )?;
        let mut tokens = HashSet::new();
        for (name, (owner, token)) in &winners {
            let value: Option<String> = redis::cmd("GET")
                .arg(backend.key_for(name))
                .query_async(&mut raw)
                .await?;
            ensure(
                value.as_deref() == Some(owner.to_hex().as_str()),
                format!("{name} holds another token than its winner's"),
            )?;
            ensure(
                token.is_some() == fenced && token.is_none_or(|t| tokens.insert(t)),
                format!("{name}: fencing token {token:?} (fencing {fenced}) missing or repeated"),
            )?;
            backend.release(name, owner).await?;
        }
        ensure(
            commands <= COMMANDS,
            format!(
                "{} attempts took {commands} commands, not {COMMANDS}: concurrent attempts are not sharing them",
                NAMES * 2
            ),
        )?;
        tracing_line(&format!(
            "fencing {fenced}: {} concurrent attempts in {commands} commands",
            NAMES * 2
        ));
    }
    Ok(())
}

/// 300 attempts on 150 names under `prefix`, two owners each, made while the
/// server is stopped (SIGSTOP) and let through once every one has been sent
/// or queued, so that all of them are concurrent whatever the speed of this
/// machine's threads (an attempt that came after a reply would take a slot
/// of its own). Fails when a name is granted twice or an attempt errs.
async fn burst(
    backend: &RedisBackend,
    srv: &ServerProcess,
    prefix: &str,
) -> Result<Winners, BoxError> {
    srv.pause()?;
    let entered = Arc::new(AtomicUsize::new(0));
    let mut tries = JoinSet::new();
    for i in 0..NAMES * 2 {
        let (backend, entered) = (backend.clone(), Arc::clone(&entered));
        let made = LockName::new(format!("{prefix}/{}", i % NAMES)).map_err(BoxError::from);
        let owner = OwnerToken::generate().map_err(BoxError::from);
        tries.spawn(async move {
            let (name, owner) = (made?, owner?);
            let got = counted_once(backend.try_acquire(&name, &owner, TTL), &entered).await;
            Ok::<_, BoxError>((name, owner, got))
        });
    }
    let all_in = timeout(TTL, async {
        while entered.load(Ordering::SeqCst) < NAMES * 2 {
            sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    srv.resume()?;
    ensure(
        all_in.is_ok(),
        format!(
            "{} of {} attempts reached the backend within {TTL:?}",
            entered.load(Ordering::SeqCst),
            NAMES * 2
        ),
    )?;
    let mut winners = Winners::new();
    while let Some(joined) = timeout(TTL, tries.join_next()).await? {
        let (name, owner, got) = joined??;
        match got? {
            AcquireAttempt::Acquired(lease) => {
                let earlier = winners.insert(name.clone(), (owner, lease.fencing_token));
                ensure(earlier.is_none(), format!("{name} granted twice"))?;
            }
            AcquireAttempt::HeldElsewhere => {}
            other => return Err(format!("{name}: unexpected {other:?}").into()),
        }
    }
    Ok(winners)
}

/// Fillers stalled in flight on a stopped server (SIGSTOP), a queued
/// attempt abandoned by its caller, and at once its owner's release (as a
/// `Locker` sends for an abandoned acquire): once the server runs again the
/// release must come after the attempt it was sent for, freeing the lock the
/// attempt took, not before it, leaving a lock nobody holds until its TTL.
pub(super) async fn release_waits_for_a_queued_attempt(
    f: Arc<RedisFactory>,
) -> Result<(), BoxError> {
    let srv = server::start_plain()?;
    let url = format!("redis://127.0.0.1:{}", srv.port());
    // An operation timeout far above the stop below, so that nothing gives
    // up while the server is stopped.
    let backend: RedisBackend = config_for(&url)?
        .with_key_prefix(f.prefix())
        .with_operation_timeout(Duration::from_secs(10))
        .connect()
        .await?;
    backend.ping().await?;
    let mut raw = plain(&url).await?;
    // The first fillers are each sent as a command of their own while the
    // backend has room for more in flight (16); once those are stuck on the
    // stopped server, the rest queue, the victim among them. 30 ms apart so
    // that each is sent before the next comes (one that comes early only
    // queues sooner; the case cannot fail for it).
    const SENT: usize = 24;
    srv.pause()?;
    let mut fillers = JoinSet::new();
    for i in 0..SENT + 4 {
        let backend = backend.clone();
        let name = LockName::new(format!("queued/filler-{i}"))?;
        let owner = OwnerToken::generate()?;
        fillers.spawn(async move { backend.try_acquire(&name, &owner, TTL).await });
        if i < SENT {
            sleep(Duration::from_millis(30)).await;
        }
    }
    let victim = LockName::new("queued/victim")?;
    let owner = OwnerToken::generate()?;
    let attempt = {
        let (backend, victim) = (backend.clone(), victim.clone());
        tokio::spawn(async move { backend.try_acquire(&victim, &owner, TTL).await })
    };
    sleep(Duration::from_millis(20)).await;
    attempt.abort();
    ensure(
        attempt.await.is_err_and(|e| e.is_cancelled()),
        "the victim's attempt answered while the server was stopped",
    )?;
    let release = {
        let (backend, victim) = (backend.clone(), victim.clone());
        tokio::spawn(async move { backend.release(&victim, &owner).await })
    };
    sleep(Duration::from_millis(20)).await;
    srv.resume()?;
    let released = timeout(TTL, release)
        .await
        .map_err(|_| "the release did not finish within a TTL of the thaw")???;
    while let Some(filler) = timeout(TTL, fillers.join_next()).await? {
        ensure(
            matches!(filler??, AcquireAttempt::Acquired(_)),
            "a filler on a name of its own was refused",
        )?;
    }
    let left: Option<String> = redis::cmd("GET")
        .arg(backend.key_for(&victim))
        .query_async(&mut raw)
        .await?;
    ensure(
        left.is_none(),
        "the abandoned attempt took the lock after its owner's release: nobody holds it until its TTL",
    )?;
    ensure(
        released == ReleaseOutcome::Released,
        format!("the release ran before the attempt it was sent for ({released:?})"),
    )?;
    Ok(())
}
