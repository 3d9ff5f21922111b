//! Runs every conformance case against every backend compiled in.
//!
//! Test names are `backend::case`; filter with `cargo test -p conformance-tests -- redis::`.

use std::process::ExitCode;
use std::sync::Arc;

use conformance_tests::backends::etcd;
use conformance_tests::backends::memory::MemoryFactory;
use conformance_tests::Suite;
use libtest_mimic::Arguments;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mut suite = Suite::new();
    suite.add(Arc::new(MemoryFactory::new()));
    suite.add_server_backend("etcd", etcd::factory());
    etcd::add_specific(&mut suite);
    suite.run(&args)
}
