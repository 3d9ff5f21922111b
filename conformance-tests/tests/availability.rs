//! The availability policy from the environment, on every server backend:
//! `cargo test -p conformance-tests --test availability -- redis::`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    libtest_mimic::run(&args, conformance_tests::availability::trials()).exit_code()
}
