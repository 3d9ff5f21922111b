//! The docker rows (the `docker` feature): every conformance case against
//! Redis, Postgres and etcd in containers, as `docker_redis::<case>`,
//! `docker_postgres::<case>` and `docker_etcd::<case>`.
//!
//! The containers start when the rows are registered, and only if the
//! command line's filter can select one of their trials. A missing engine
//! or image fails the run when `DISTLOCK_REQUIRE_DOCKER=1` (CI) and is a
//! loud skip elsewhere. `DISTLOCK_DOCKER_CASES` narrows the rows to the
//! cases it names.

use std::sync::Arc;

use libtest_mimic::{Arguments, Trial};

use super::etcd::EtcdFactory;
use super::redis::RedisRun;
use crate::harness::docker;
use crate::{cases, BackendFactory, BoxError, Suite};

/// Names the cases the docker rows run (comma-separated), where a run has
/// no time for all of them; unset, they run every case. A name that is no
/// case fails the run.
pub const CASES_VAR: &str = "DISTLOCK_DOCKER_CASES";

/// The rows, in the order they are registered.
pub const ROWS: [&str; 3] = ["docker_redis", "docker_postgres", "docker_etcd"];

/// Adds the docker rows the filter in `args` can select; returns whether
/// the engine answered (and so may hold containers of this run to remove
/// at the end).
pub fn register(suite: &mut Suite, redis: &mut RedisRun, args: &Arguments) -> bool {
    let wanted: Vec<&str> = ROWS.into_iter().filter(|r| selects(args, r)).collect();
    if wanted.is_empty() {
        return false;
    }
    match docker::engine() {
        Ok(engine) => eprintln!("docker rows: engine {engine}"),
        Err(e) => {
            for row in wanted {
                missing(suite, row, &e);
            }
            return false;
        }
    }
    let only = subset();
    for row in wanted {
        let added: Result<(), BoxError> = match row {
            "docker_redis" => redis
                .docker_factory(suite.run_id())
                .map(|f| add(suite, f, only.as_deref())),
            "docker_postgres" => super::postgres::docker_factory().map(|f| {
                add(suite, f.clone(), only.as_deref());
                super::postgres::register_leftover_check(suite, &f);
            }),
            _ => EtcdFactory::docker().map(|f| add(suite, Arc::new(f), only.as_deref())),
        };
        if let Err(e) = added {
            missing(suite, row, &e);
        }
    }
    true
}

/// The cases [`CASES_VAR`] names, if it is set.
fn subset() -> Option<Vec<String>> {
    let raw = std::env::var(CASES_VAR).ok()?;
    Some(
        raw.split([',', ' ', '\n'])
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect(),
    )
}

fn add(suite: &mut Suite, factory: Arc<dyn BackendFactory>, only: Option<&[String]>) {
    match only {
        Some(names) => {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            suite.add_named(factory, &names);
        }
        None => suite.add(factory),
    }
}

/// Whether libtest's name filter can select a trial of `row`.
fn selects(args: &Arguments, row: &str) -> bool {
    let Some(filter) = &args.filter else {
        return true;
    };
    let extra = ["server_available", "no_leftovers_after_suite"];
    cases::ALL
        .iter()
        .map(|c| c.name)
        .chain(extra)
        .map(|case| format!("{row}::{case}"))
        .any(|name| {
            if args.exact {
                &name == filter
            } else {
                name.contains(filter.as_str())
            }
        })
}

fn missing(suite: &mut Suite, row: &str, why: &BoxError) {
    if docker::required() {
        let msg = format!(
            "{row}: no container ({why}); {} requires the docker rows",
            docker::REQUIRE_VAR
        );
        suite.push(Trial::test(format!("{row}::server_available"), move || {
            Err(msg.into())
        }));
    } else {
        eprintln!(
            "!!! SKIPPING EVERY {row} CASE: no container ({why}). Set {}=1 to make this a failure.",
            docker::REQUIRE_VAR
        );
    }
}
