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
use crate::harness::run_bounded;
use crate::{BackendFactory, Ctx, Suite};

/// Longest an etcd-specific trial may run.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(170);

/// Longest the no-residue trial may run: it runs every case once more, one
/// after another, each within the suite's own per-case limit.
const RESIDUE_TIMEOUT: Duration = Duration::from_secs(900);

/// Adds the etcd-specific trials. They always use private servers (never
/// `ETCD_ENDPOINTS`), because they pause servers and enable auth.
pub fn add_specific(suite: &mut Suite) {
    if !suite.has_binary("etcd", "etcd::private_server_available") {
        return;
    }
    let shared = Arc::new(EtcdFactory::private());
    let run_id = suite.run_id().to_owned();
    let add = |suite: &mut Suite, name: &str, limit: Duration, body: Body| {
        let factory = Arc::clone(&shared);
        let ctx = Ctx::new(
            Arc::clone(&shared) as Arc<dyn BackendFactory>,
            &run_id,
            name,
        );
        suite.push(Trial::test(format!("etcd::{name}"), move || {
            run_bounded(body(factory, ctx), limit)
        }));
    };
    let table = crate::trial_table![(f, c) as Body;
        "theft_by_lease_revoke" => faults::theft_by_lease_revoke,
        "theft_by_delete_and_put" => faults::theft_by_delete_and_put,
        "paused_server_holder_aborts_first" => faults::paused_server_holder_aborts_first,
        "abandoned_lock_frees_after_ttl" => crash::abandoned_lock_frees_after_ttl,
        "bad_input_gives_typed_errors" => security::bad_input_gives_typed_errors,
        "rbac_user_limited_to_prefix" => security::rbac_user_limited_to_prefix,
        "tls_with_test_certificate" => security::tls_with_test_certificate,
        "batch_renewal_reports_each_lease" => batch::batch_renewal_reports_each_lease,
        "batch_renewal_sees_rewrites_on_the_lease" => batch::batch_renewal_sees_rewrites_on_the_lease,
        "retain_during_renewal_keeps_the_mark" => retain::retain_during_renewal_keeps_the_mark,
        "tick_store_keeps_the_maximum" => ticks::tick_store_keeps_the_maximum,
        "acquire_near_lease_lapse_gets_full_ttl" => shared::acquire_near_lease_lapse_gets_full_ttl,
        "acquire_soon_after_another_reuses_its_proof" => shared::acquire_soon_after_another_reuses_its_proof,
        "unanswered_release_frees_the_key" => shared::unanswered_release_frees_the_key,
        "late_put_of_a_given_up_acquire_is_undone" => shared::late_put_of_a_given_up_acquire_is_undone,
        "shared_lease_ending_mid_acquire_is_not_held" => shared::shared_lease_ending_mid_acquire_is_not_held,
        "deferred_backend_keeps_its_min_ttl" => deferred::deferred_backend_keeps_its_min_ttl,
    ];
    for (name, body) in table {
        add(suite, name, TRIAL_TIMEOUT, body);
    }
    super::inspect::add_single(suite, &shared);
    add(suite, "no_residue_after_cases", RESIDUE_TIMEOUT, |f, c| {
        Box::pin(faults::no_residue_after_cases(f, c))
    });
}

pub(super) type BoxedCase = std::pin::Pin<Box<dyn Future<Output = Result<(), Failed>> + Send>>;

/// A trial body over the shared private server.
type Body = fn(Arc<EtcdFactory>, Ctx) -> BoxedCase;

/// Turns a boolean check into a trial failure that says what went wrong.
pub(super) fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}
