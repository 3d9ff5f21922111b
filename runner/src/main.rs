//! `lockrun`: run shell commands under a distributed lock, and kill their
//! whole process tree when the lock is lost. See README.md and `--help`.
#![forbid(unsafe_code)]

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

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tracing::error;

use crate::cli::{Cli, Cmd};
use crate::exit::Failure;

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
        Cmd::Keeper => false,
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
            Cmd::Exec(args) => exec::run(args).await,
            Cmd::Cron(args) => cron::run(args).await,
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
