//! `lockrun`: run shell commands under a distributed lock, and kill their
//! whole process tree when the lock is lost. See README.md and `--help`.
#![forbid(unsafe_code)]

mod admin;
mod backend;
mod cli;
mod cron;
mod duration;
mod exec;
mod exit;
mod group;
mod keeper;
mod reaper;
mod supervise;
mod telemetry;

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tracing::{error, warn};

use crate::cli::{Cli, Cmd};
use crate::exit::Failure;
use crate::keeper::Keeper;
use crate::reaper::Reaper;

/// How long the watchdog gets to exit once its pipe is closed at the end.
const KEEPER_STOP: Duration = Duration::from_secs(2);

/// How long the runner waits at the end for its last children to be reaped
/// (every command's group is empty by then, unless SIGKILL could not end it).
const DRAIN_LIMIT: Duration = Duration::from_secs(1);

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { exit::USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let json = match &cli.command {
        Cmd::Exec(a) => a.common.log_json,
        Cmd::Cron(a) => a.common.log_json,
        Cmd::Status(_) | Cmd::Ls(_) | Cmd::Leader(_) | Cmd::Release(_) | Cmd::Keeper => false,
    };
    telemetry::init_logs(json);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::from(exit::INTERNAL);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Exec(args) => with_watchdog(|r, k| exec::run(args, r, k)).await,
            Cmd::Cron(args) => with_watchdog(|r, k| cron::run(args, r, k)).await,
            Cmd::Status(args) => admin::status(args).await,
            Cmd::Ls(args) => admin::ls(args).await,
            Cmd::Leader(args) => admin::leader(args).await,
            Cmd::Release(args) => admin::release(args).await,
            Cmd::Keeper => keeper::run()
                .await
                .map(|()| 0)
                .map_err(|e| Failure::internal(e.to_string())),
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            error!(code = failure.code, "{failure}");
            failure.exit_code()
        }
    }
}

/// Runs a subcommand that starts commands, with the reaper and the watchdog
/// around it: whatever path the subcommand ends by, the watchdog's pipe is
/// closed and the watchdog reaped here, before the runner exits, rather than
/// left to exit after it as a zombie for init (or for a PID 1 that does not
/// reap) to collect.
async fn with_watchdog<F, Fut>(run: F) -> Result<u8, Failure>
where
    F: FnOnce(Reaper, Arc<Keeper>) -> Fut,
    Fut: Future<Output = Result<u8, Failure>>,
{
    let reaper =
        Reaper::start().map_err(|e| Failure::internal(format!("cannot reap children: {e}")))?;
    let keeper = Arc::new(
        Keeper::start(&reaper)
            .map_err(|e| Failure::internal(format!("cannot start the watchdog process: {e}")))?,
    );
    let result = run(reaper.clone(), Arc::clone(&keeper)).await;
    keeper.stop(KEEPER_STOP).await;
    if !reaper.drain(DRAIN_LIMIT).await {
        warn!("children of the runner are still running as it exits");
    }
    result
}
