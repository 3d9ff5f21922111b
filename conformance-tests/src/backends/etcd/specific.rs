//! etcd-specific trials (`etcd::<name>`): theft by a second client, a
//! paused server, RBAC, TLS, bad input, a cluster that answers only after
//! the backend was built, and no residue after the cases.

mod batch;
mod crash;
mod deferred;
mod faults;
mod retain;
mod security;
mod shared;
mod ticks;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};

use super::EtcdFactory;
pub(super) use crate::cases::hold_in_job;
use crate::harness::{in_ci, which};
use crate::{BackendFactory, Ctx, Suite};

/// Longest an etcd-specific trial may run.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(170);

/// Longest the no-residue trial may run: it runs every case once more, one
/// after another, each within the suite's own per-case limit.
const RESIDUE_TIMEOUT: Duration = Duration::from_secs(900);

/// Adds the etcd-specific trials. They always use private servers (never
/// `ETCD_ENDPOINTS`), because they pause servers and enable auth.
pub fn add_specific(suite: &mut Suite) {
    if which("etcd").is_none() {
        if in_ci() {
            suite.push(Trial::test("etcd::private_server_available", || {
                Err("etcd is not on PATH; CI must test etcd".into())
            }));
        } else {
            eprintln!("!!! SKIPPING the etcd-specific trials: etcd is not on PATH. Set CI=true to make this a failure.");
        }
        return;
    }
    let shared = Arc::new(EtcdFactory::private());
    let run_id = suite.run_id().to_owned();
    let add_with = |suite: &mut Suite,
                    name: &str,
                    limit: Duration,
                    body: fn(Arc<EtcdFactory>, Ctx) -> BoxedCase| {
        let factory = Arc::clone(&shared);
        let ctx = Ctx::new(
            Arc::clone(&shared) as Arc<dyn BackendFactory>,
            &run_id,
            name,
        );
        suite.push(Trial::test(format!("etcd::{name}"), move || {
            run(body(factory, ctx), limit)
        }));
    };
    let add = |suite: &mut Suite, name: &str, body: fn(Arc<EtcdFactory>, Ctx) -> BoxedCase| {
        add_with(suite, name, TRIAL_TIMEOUT, body)
    };
    add(suite, "theft_by_lease_revoke", |f, c| {
        Box::pin(faults::theft_by_lease_revoke(f, c))
    });
    add(suite, "theft_by_delete_and_put", |f, c| {
        Box::pin(faults::theft_by_delete_and_put(f, c))
    });
    add(suite, "paused_server_holder_aborts_first", |f, c| {
        Box::pin(faults::paused_server_holder_aborts_first(f, c))
    });
    add(suite, "abandoned_lock_frees_after_ttl", |f, c| {
        Box::pin(crash::abandoned_lock_frees_after_ttl(f, c))
    });
    add(suite, "bad_input_gives_typed_errors", |f, c| {
        Box::pin(security::bad_input_gives_typed_errors(f, c))
    });
    add(suite, "rbac_user_limited_to_prefix", |f, c| {
        Box::pin(security::rbac_user_limited_to_prefix(f, c))
    });
    add(suite, "tls_with_test_certificate", |f, c| {
        Box::pin(security::tls_with_test_certificate(f, c))
    });
    add(suite, "batch_renewal_reports_each_lease", |f, c| {
        Box::pin(batch::batch_renewal_reports_each_lease(f, c))
    });
    add(suite, "batch_renewal_sees_rewrites_on_the_lease", |f, c| {
        Box::pin(batch::batch_renewal_sees_rewrites_on_the_lease(f, c))
    });
    add(suite, "retain_during_renewal_keeps_the_mark", |f, c| {
        Box::pin(retain::retain_during_renewal_keeps_the_mark(f, c))
    });
    add(suite, "tick_store_keeps_the_maximum", |f, c| {
        Box::pin(ticks::tick_store_keeps_the_maximum(f, c))
    });
    add(suite, "acquire_near_lease_lapse_gets_full_ttl", |f, c| {
        Box::pin(shared::acquire_near_lease_lapse_gets_full_ttl(f, c))
    });
    add(
        suite,
        "acquire_soon_after_another_reuses_its_proof",
        |f, c| Box::pin(shared::acquire_soon_after_another_reuses_its_proof(f, c)),
    );
    add(suite, "unanswered_release_frees_the_key", |f, c| {
        Box::pin(shared::unanswered_release_frees_the_key(f, c))
    });
    add(suite, "late_put_of_a_given_up_acquire_is_undone", |f, c| {
        Box::pin(shared::late_put_of_a_given_up_acquire_is_undone(f, c))
    });
    add(
        suite,
        "shared_lease_ending_mid_acquire_is_not_held",
        |f, c| Box::pin(shared::shared_lease_ending_mid_acquire_is_not_held(f, c)),
    );
    add(suite, "deferred_backend_keeps_its_min_ttl", |f, c| {
        Box::pin(deferred::deferred_backend_keeps_its_min_ttl(f, c))
    });
    super::inspect::add_single(suite, &shared);
    add_with(suite, "no_residue_after_cases", RESIDUE_TIMEOUT, |f, c| {
        Box::pin(faults::no_residue_after_cases(f, c))
    });
}

pub(super) type BoxedCase = std::pin::Pin<Box<dyn Future<Output = Result<(), Failed>> + Send>>;

/// Runs one trial's body on a runtime of its own, failing it past `limit`.
pub(super) fn run(body: BoxedCase, limit: Duration) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = rt.block_on(async {
        match tokio::time::timeout(limit, body).await {
            Ok(result) => result,
            Err(_) => Err(format!("did not finish within {limit:?}").into()),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    outcome
}

/// Turns a boolean check into a trial failure that says what went wrong.
pub(super) fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}
