//! The fault suite: server stalls and partitions against private servers,
//! with a figures table printed at the end and written to
//! `target/chaos-figures.txt`.
//!
//! Test names are `backend::chaos_<case>`. Trials run one at a time unless
//! `--test-threads` says otherwise, since each freezes or partitions its own
//! server against timing bounds. `CHAOS_SOAK=<n>` multiplies the iterations;
//! with `RUST_LOG` set (e.g. `lock_etcd=debug`) the libraries' logs go to
//! stderr.

use std::path::PathBuf;
use std::process::ExitCode;

use conformance_tests::chaos;
use libtest_mimic::Arguments;

fn main() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(1);
    }
    let run_id = format!("{:08x}", getrandom::u32().unwrap_or(0));
    let trials = chaos::trials(
        &run_id,
        &chaos::Bins {
            holder: PathBuf::from(env!("CARGO_BIN_EXE_chaos-holder")),
            replica: PathBuf::from(env!("CARGO_BIN_EXE_chaos-replica")),
        },
    );
    let conclusion = libtest_mimic::run(&args, conformance_tests::suite::timed("chaos", trials));
    let table = chaos::figures::table();
    if table.lines().count() > 2 {
        println!("\nchaos figures:\n{table}");
        let path = chaos::figures::path();
        if let Err(e) = std::fs::write(&path, &table) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
    conclusion.exit_code()
}
