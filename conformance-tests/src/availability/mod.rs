//! The availability policy a service takes from its environment
//! (`scheduler::Policy`), against private servers that this suite stops and
//! starts: a server down at start does not stop the service, its ticks are
//! skipped as `unavailable` until the server answers, and the next tick
//! then runs; what cannot work (a malformed URL, refused credentials) still
//! fails at start.

mod down;
mod refused;
mod servers;

use libtest_mimic::{Failed, Trial};

pub use down::{down_at_start, Recovery};
pub use refused::{malformed_urls, rejected_password};
pub use servers::{Kind, Private};

/// Every case, named `<backend>::<case>` (or `policy::<case>`).
pub fn trials() -> Vec<Trial> {
    let mut trials = Vec::new();
    for kind in Kind::ALL {
        trials.push(Trial::test(
            format!("{}::down_at_start_then_up", kind.name()),
            move || {
                let took = down_at_start(kind).map_err(Failed::from)?;
                println!(
                    "{}: the first tick ran {} ms (per tick) and {} ms (leader) after the server listened again",
                    kind.name(),
                    took.per_tick.as_millis(),
                    took.leader.as_millis()
                );
                Ok(())
            },
        ));
    }
    for kind in [Kind::Redis, Kind::Postgres] {
        trials.push(Trial::test(
            format!("{}::rejected_password_fails_at_start", kind.name()),
            move || rejected_password(kind).map_err(Failed::from),
        ));
    }
    trials.push(Trial::test("policy::malformed_urls_fail_at_start", || {
        malformed_urls().map_err(Failed::from)
    }));
    trials
}
