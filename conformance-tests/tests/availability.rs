//! The availability policy from the environment, on every server backend:
//! `cargo test -p conformance-tests --test availability -- redis::`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    let trials = conformance_tests::availability::trials();
    libtest_mimic::run(
        &args,
        conformance_tests::suite::timed("availability", trials),
    )
    .exit_code()
}
