//! The fault suite: server stalls and partitions against private servers,
//! with a figures table printed at the end and written to
//! `target/chaos-figures.txt`.
//!
//! Test names are `backend::chaos_<case>`. The run has two parts: first the
//! trials [`chaos::may_overlap`] names, two at a time (`--test-threads`
//! sets how many), then every other trial alone, since those fault or time
//! something a trial beside them would disturb. `--test-threads=1` runs
//! all one at a time; `--list` and `--logfile` make one run of all the
//! trials, one at a time unless `--test-threads` says otherwise.
//! `CHAOS_SOAK=<n>` multiplies the iterations; with `RUST_LOG` set (e.g.
//! `lock_etcd=debug`) the libraries' logs go to stderr.

use std::path::PathBuf;
use std::process::ExitCode;

use conformance_tests::chaos;
use libtest_mimic::{Arguments, Trial};

fn main() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let mut args = Arguments::from_args();
    let run_id = format!("{:08x}", getrandom::u32().unwrap_or(0));
    let trials = chaos::trials(
        &run_id,
        &chaos::Bins {
            holder: PathBuf::from(env!("CARGO_BIN_EXE_chaos-holder")),
            replica: PathBuf::from(env!("CARGO_BIN_EXE_chaos-replica")),
        },
    );
    let failed = if args.list || args.logfile.is_some() {
        // One run: a second would list the trials twice, or overwrite the log.
        args.test_threads = args.test_threads.or(Some(1));
        run(&args, trials)
    } else {
        let (beside, alone): (Vec<_>, Vec<_>) = trials
            .into_iter()
            .partition(|t| chaos::may_overlap(t.name()));
        args.test_threads = args.test_threads.or(Some(chaos::OVERLAP));
        let first = run(&args, beside);
        args.test_threads = Some(1);
        // Both parts run, whatever the first's outcome, as one run would.
        run(&args, alone) || first
    };
    let table = chaos::figures::table();
    if table.lines().count() > 2 {
        println!("\nchaos figures:\n{table}");
        let path = chaos::figures::path();
        if let Err(e) = std::fs::write(&path, &table) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
    if failed {
        ExitCode::from(101)
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs `trials` (each timed, see `suite::timed`); whether any failed.
fn run(args: &Arguments, trials: Vec<Trial>) -> bool {
    if trials.is_empty() && !args.list {
        return false;
    }
    libtest_mimic::run(args, conformance_tests::suite::timed("chaos", trials)).has_failed()
}
