//! `lockrun exec`: one command under one lock.

use std::io;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use distlock::{CancellationToken, Error, LockName, LockOptions};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::cli::ExecArgs;
use crate::exit::{self, Failure};
use crate::group::Group;
use crate::keeper::Keeper;
use crate::reaper::Reaper;
use crate::supervise::{supervise, Cause, Forwarded, KillTiming};
use crate::{backend, telemetry};

/// How long queued releases get at exit.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// Runs `lockrun exec` with the runner's reaper and watchdog; returns the
/// runner's exit code.
pub(crate) async fn run(
    args: ExecArgs,
    reaper: Reaper,
    keeper: Arc<Keeper>,
) -> Result<u8, Failure> {
    let name = LockName::new(&args.name).map_err(|e| Failure::usage(format!("--name: {e}")))?;
    if args.ttl.is_zero() {
        return Err(Failure::usage("--ttl must be greater than zero"));
    }
    let timing = KillTiming::for_ttl(args.ttl, args.common.kill_grace).map_err(Failure::usage)?;
    if args.max_hold.is_some_and(|m| m < args.ttl) {
        return Err(Failure::usage("--max-hold must be at least --ttl"));
    }
    // No max hold on the lease: the supervisor enforces it, so that the
    // lock is let go only once the group is gone (see supervise).
    let mut options = LockOptions::new(args.ttl);
    if let Some(timeout) = args.timeout {
        options = options.with_acquire_timeout(timeout);
    }
    // Caught from here on: a signal while waiting for the lock ends the
    // runner as that signal would have, without running anything.
    let mut forwarded = Forwarded::catch().map_err(|e| Failure::internal(e.to_string()))?;
    let metrics = telemetry::serve_metrics(args.common.metrics_addr).await?;
    let locks = backend::connect(args.common.backend.as_deref()).await?;
    let locker = locks
        .locker()
        .map_err(|e| Failure::from_lock(&e, args.conflict_exit_code))?;

    let acquire = async {
        if args.wait {
            locker.lock(&name, &options).await
        } else {
            locker.try_lock(&name, &options).await
        }
    };
    let acquired = tokio::select! {
        acquired = acquire => acquired,
        sig = forwarded.recv() => {
            info!(signal = sig.as_raw(), "signalled while acquiring; not running the command");
            return Ok(u8::try_from(128 + sig.as_raw()).unwrap_or(u8::MAX));
        }
    };
    let guard = match acquired {
        Ok(guard) => guard,
        Err(e) => {
            let failure = Failure::from_lock(&e, args.conflict_exit_code);
            match &e {
                Error::HeldElsewhere { .. } | Error::HeldLocally { .. } | Error::Timeout { .. } => {
                    info!(lock = %name, error = %e, "lock held elsewhere; not running the command")
                }
                _ => error!(lock = %name, error = %e, "cannot acquire the lock"),
            }
            return Ok(failure.code);
        }
    };
    let acquired_at = Instant::now();
    let lease = guard.handle();
    let token = lease.fencing_token();

    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("LOCK_NAME", name.as_str());
    match token {
        Some(t) => command.env("LOCK_FENCING_TOKEN", t.to_string()),
        None => command.env_remove("LOCK_FENCING_TOKEN"),
    };
    let group = match Group::spawn(&reaper, &keeper, &mut command) {
        Ok((group, _child)) => group,
        Err(e) => {
            error!(command = %args.command[0], error = %e, "cannot run the command");
            let _ = guard.release().await;
            return Ok(match e.kind() {
                io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            });
        }
    };
    info!(lock = %name, fencing_token = ?token, pgid = group.id(), "lock acquired; command started");
    let max_hold_at = args.max_hold.and_then(|m| acquired_at.checked_add(m));
    let ended = supervise(
        group,
        &lease,
        timing,
        max_hold_at,
        Some(&mut forwarded),
        &CancellationToken::new(),
        &CancellationToken::new(),
    )
    .await;
    if !ended.emptied {
        error!(lock = %name, "some processes of the command could not be killed");
    }
    let released = guard.release().await;
    let code = match ended.cause {
        Cause::Exited | Cause::Cancelled => match released {
            Err(Error::LockLost { reason, .. }) => {
                warn!(lock = %name, %reason, "the lock was lost before the command exited");
                exit::LOCK_LOST
            }
            _ => ended.status.map_or(exit::INTERNAL, exit::status_code),
        },
        Cause::Lost(_) | Cause::Expiring | Cause::MaxHold => exit::LOCK_LOST,
    };
    if let Err(e) = &released {
        if !e.is_lock_lost() {
            warn!(lock = %name, error = %e, "could not release the lock; it ends at its TTL");
        }
    }
    if let Err(e) = locker.shutdown(SHUTDOWN_DEADLINE).await {
        warn!(error = %e, "lock shutdown did not finish");
    }
    if let Some(m) = metrics {
        m.shutdown().await;
    }
    info!(code, "done");
    Ok(code)
}
