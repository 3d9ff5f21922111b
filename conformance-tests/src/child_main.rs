//! The entry of the chaos suite's child processes (`chaos-holder`,
//! `chaos-replica`): how they run their body and what they exit with.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// Runs `body` on a 2-worker runtime, the size of the small host a service
/// would run on, and turns its outcome into the exit code: success, or the
/// error on stderr after `name` and failure. A runtime that cannot be built
/// is said on stderr and fails too.
pub fn run_child<E: Display>(name: &str, body: impl Future<Output = Result<(), E>>) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(body) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
