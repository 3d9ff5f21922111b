//! Runs every conformance case against every backend compiled in.
//!
//! Test names are `backend::case`; filter with `cargo test -p conformance-tests -- redis::`.

use std::process::ExitCode;
use std::sync::Arc;

use conformance_tests::backends::etcd;
use conformance_tests::backends::memory::MemoryFactory;
use conformance_tests::backends::redis::RedisRun;
use conformance_tests::Suite;
use libtest_mimic::Arguments;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    if let Err(e) = conformance_tests::warnings::install() {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    let mut suite = Suite::new();
    suite.add(Arc::new(MemoryFactory::new()));
    conformance_tests::backends::memory::add_specific(&mut suite);
    #[allow(unused_mut)] // only the docker rows add to it
    let mut redis = RedisRun::register(&mut suite);
    conformance_tests::backends::postgres::register(&mut suite);
    suite.add_server_backend("etcd", etcd::factory());
    etcd::add_specific(&mut suite);
    suite.add_server_backend("etcd_cluster", etcd::cluster_factory());
    etcd::add_cluster_specific(&mut suite);
    for trial in conformance_tests::backends::connect_urls::trials(suite.run_id()) {
        suite.push(trial);
    }
    #[cfg(feature = "docker")]
    let docker_used = conformance_tests::backends::docker::register(&mut suite, &mut redis, &args);
    let mut code = suite.run(&args);
    if let Err(e) = redis.check_no_leftover_keys() {
        eprintln!("leftover check failed: {e}");
        code = ExitCode::FAILURE;
    }
    // The docker rows' containers went with their factories; this removes
    // any a hung case still held.
    drop(redis);
    #[cfg(feature = "docker")]
    match docker_used.then(conformance_tests::harness::docker::remove_leftovers) {
        None | Some(Ok(0)) => {}
        Some(Ok(n)) => eprintln!("removed {n} containers a case still held"),
        Some(Err(e)) => {
            eprintln!("could not remove this run's containers: {e}");
            code = ExitCode::FAILURE;
        }
    }
    code
}
