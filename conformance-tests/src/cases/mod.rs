//! The conformance cases. Each is written once and runs for every backend
//! whose capabilities it needs.

mod blocking;
mod ended;
mod exclusion;
mod extreme;
mod facade;
mod fencing;
mod input;
mod inspect;
mod local;
mod locker_shutdown;
mod loss;
mod metrics;
mod model;
mod renewal;
mod retained;
mod scheduler;
mod ticks;
mod watchdog;

pub(crate) use loss::hold_in_job;

use std::time::Duration;

use lock_core::{backend::Expiry, LossReason, RenewalOutcome};

use crate::suite::{Case, CaseFn, Requires};
use crate::Ctx;

macro_rules! case {
    ($module:ident :: $name:ident, $req:expr) => {
        Case {
            name: stringify!($name),
            requires: $req,
            run: CaseFn::Async(|ctx| Box::pin($module::$name(ctx))),
        }
    };
}

/// Every case, in the order they are listed in test output.
pub static ALL: &[Case] = &[
    case!(exclusion::mutual_exclusion, Requires::Nothing),
    case!(
        exclusion::burst_of_acquires_grants_each_name_once,
        Requires::Nothing
    ),
    case!(exclusion::cancelled_burst_leaves_nothing, Requires::Nothing),
    case!(
        exclusion::cancelled_releases_leave_nothing,
        Requires::Nothing
    ),
    case!(renewal::renewal_keeps_lease_alive, Requires::Nothing),
    case!(renewal::deadline_without_heartbeat, Requires::Nothing),
    case!(
        renewal::stalled_renewal_fails_closed_at_deadline,
        Requires::Nothing
    ),
    case!(
        renewal::refused_renewal_loses_the_lease_at_once,
        Requires::Nothing
    ),
    case!(
        renewal::waiting_acquire_rides_out_an_outage,
        Requires::Nothing
    ),
    case!(loss::theft_is_detected, Requires::Nothing),
    case!(inspect::describe_names_the_holder, Requires::Nothing),
    case!(inspect::list_pages_through_held_locks, Requires::Nothing),
    case!(inspect::inspection_changes_nothing, Requires::Nothing),
    case!(inspect::inspection_refuses_bad_prefixes, Requires::Nothing),
    case!(
        inspect::forced_release_ends_the_holders_run,
        Requires::Fencing
    ),
    case!(
        inspect::forced_release_with_a_stale_token_is_refused,
        Requires::Fencing
    ),
    case!(loss::expiry_is_detected, Requires::Nothing),
    case!(loss::stale_holder_cannot_touch_successor, Requires::Nothing),
    case!(loss::release_after_loss_reports_lost, Requires::Nothing),
    case!(loss::retained_lock_ends_after_hold, Requires::Nothing),
    case!(retained::failed_hold_releases_the_lock, Requires::Nothing),
    case!(
        retained::short_hold_is_refused_and_released,
        Requires::Nothing
    ),
    case!(retained::renew_keeps_a_retained_hold, Requires::Nothing),
    case!(watchdog::max_hold_aborts_and_frees, Requires::Nothing),
    case!(ended::released_lease_ends_every_clone, Requires::Nothing),
    case!(
        locker_shutdown::locker_shutdown_releases_every_lease,
        Requires::Nothing
    ),
    case!(
        locker_shutdown::locker_shutdown_is_bounded_by_its_deadline,
        Requires::Nothing
    ),
    case!(ended::dropped_guard_ends_every_clone, Requires::Nothing),
    case!(
        ended::retained_lease_ends_every_clone_after_hold,
        Requires::Nothing
    ),
    case!(
        ended::retained_leases_end_in_the_order_of_their_holds,
        Requires::Nothing
    ),
    case!(
        ended::election_lease_ends_on_stop_and_drop,
        Requires::Nothing
    ),
    case!(
        ended::election_standby_takes_over_at_release,
        Requires::Nothing
    ),
    Case {
        name: "max_hold_fails_assert_held_while_starved",
        requires: Requires::Nothing,
        run: CaseFn::Blocking(ended::max_hold_fails_assert_held_while_starved),
    },
    case!(
        extreme::extreme_durations_never_panic_or_leak,
        Requires::Nothing
    ),
    case!(
        extreme::extreme_durations_through_the_trait,
        Requires::Nothing
    ),
    case!(local::in_process_guard, Requires::Nothing),
    case!(local::unlocked_mode, Requires::Nothing),
    case!(local::fail_closed_when_backend_down, Requires::Nothing),
    case!(
        local::fail_closed_when_server_unreachable,
        Requires::Nothing
    ),
    case!(
        local::backend_failure_mid_job_aborts_before_deadline,
        Requires::Nothing
    ),
    case!(fencing::fencing_tokens_increase, Requires::Fencing),
    case!(fencing::fencing_declared_matches_tokens, Requires::Nothing),
    case!(
        blocking::blocking_acquire_wakes_on_release,
        Requires::Nothing
    ),
    case!(blocking::blocking_acquire_times_out, Requires::Nothing),
    case!(
        blocking::cancelled_acquire_leaves_nothing,
        Requires::Nothing
    ),
    case!(metrics::metrics_track_outcomes, Requires::Nothing),
    case!(input::bad_input_is_rejected, Requires::Nothing),
    case!(facade::facade_connect, Requires::ConnectUrl),
    Case {
        name: "guard_dropped_outside_runtime",
        requires: Requires::Nothing,
        run: CaseFn::Blocking(local::guard_dropped_outside_runtime),
    },
    Case {
        name: "model_agrees",
        requires: Requires::PausedClock,
        run: CaseFn::Blocking(model::model_agrees),
    },
    case!(
        ticks::tick_store_batch_reads_match_single_calls,
        Requires::Nothing
    ),
    case!(
        ticks::tick_store_batch_records_match_single_calls,
        Requires::Nothing
    ),
    case!(
        ticks::tick_store_batches_past_one_request,
        Requires::Nothing
    ),
    case!(
        ticks::tick_records_transitions_follow_the_token,
        Requires::Nothing
    ),
    case!(
        ticks::tick_records_take_over_and_fence_out,
        Requires::Nothing
    ),
    case!(ticks::tick_records_abandon, Requires::Nothing),
    case!(ticks::tick_records_one_start_wins, Requires::Nothing),
    case!(
        ticks::tick_starts_checked_as_the_verdict_says,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_per_tick_exactly_once,
        Requires::Nothing
    ),
    case!(scheduler::scheduler_leader_exactly_once, Requires::Nothing),
    case!(
        scheduler::scheduler_leader_failover_aborts_before_successor,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_missed_tick_policies_after_outage,
        Requires::Nothing
    ),
    case!(scheduler::scheduler_pause_matrix, Requires::Nothing),
    case!(scheduler::scheduler_crash_matrix, Requires::Nothing),
    case!(
        scheduler::scheduler_overlapping_tick_is_skipped,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_panic_is_caught_and_lock_released,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_shutdown_releases_every_lock,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_busy_fast_replica_does_not_cancel_a_tick,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_skew_beyond_tolerance_still_runs_once,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_finished_tick_is_marked_before_its_lock_is_checked,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_far_ahead_replica_does_not_starve_others,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_finished_tick_outlives_its_replica,
        Requires::Nothing
    ),
    case!(facade::scheduler_through_facade, Requires::ConnectUrl),
    case!(
        scheduler::scheduler_shutdown_stops_a_catch_up_batch,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_shutdown_is_not_held_up_by_a_catch_up_wait,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_late_wakeup_runs_ticks_still_in_window,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_late_runs_do_not_crowd_out_the_next_tick,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_extreme_settings_refused_or_run,
        Requires::Nothing
    ),
    case!(
        scheduler::scheduler_extreme_lock_ttls_refused_or_run,
        Requires::Nothing
    ),
    Case {
        name: "scheduler_extreme_durations_never_panic",
        requires: Requires::PausedClock,
        run: CaseFn::Blocking(scheduler::scheduler_extreme_durations_never_panic),
    },
    Case {
        name: "scheduler_extreme_lock_ttls_never_panic",
        requires: Requires::PausedClock,
        run: CaseFn::Blocking(scheduler::scheduler_extreme_lock_ttls_never_panic),
    },
];

/// Asserts `actual` lies in `[low, high]`, naming what was measured.
#[track_caller]
pub(crate) fn assert_between(what: &str, actual: Duration, low: Duration, high: Duration) {
    assert!(
        actual >= low && actual <= high,
        "{what}: {actual:?} is outside [{low:?}, {high:?}]"
    );
}

/// What a holder reports after [`Saboteur::steal`](crate::Saboteur::steal),
/// and which renewal outcome it counts for it: `stolen` found by a renewal,
/// except on a session backend that pushes losses. There a theft must end
/// the holder's session first, and the holder is told of that end
/// (`expired`, no renewal involved) before the thief can be granted the
/// lock, so it never sees the lock held by another.
pub(crate) fn theft_seen_as(ctx: &Ctx) -> (LossReason, Option<RenewalOutcome>) {
    let caps = ctx.factory().capabilities();
    if caps.expiry == Expiry::Session && caps.loss_push {
        (LossReason::Expired, None)
    } else {
        (LossReason::Stolen, Some(RenewalOutcome::Stolen))
    }
}

/// Once `replica`'s background work has ended, nothing was logged at `WARN`
/// or above about any of `names`: giving up a call is routine (a timeout
/// around it, a `select!`), and the clean-up it leaves to the library
/// (releasing what an attempt may have taken, sending a release again in
/// case the first never left) must not alarm anyone when it finds the
/// work already done.
pub(super) async fn no_warnings_after(
    replica: &crate::Replica,
    names: &[lock_core::LockName],
    cause: &str,
) {
    replica
        .locker
        .shutdown(Duration::from_secs(10))
        .await
        .expect("the Locker's background work ends");
    let logged = crate::warnings::about(names);
    assert!(
        logged.is_empty(),
        "{} warnings after {cause}, e.g. {}",
        logged.len(),
        logged
            .iter()
            .take(3)
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

/// A replica over a fresh backend of the row behind a [`FaultyBackend`]
/// whose stalls last `stall`, and the handle that sets its fault.
///
/// [`FaultyBackend`]: crate::faulty::FaultyBackend
pub(super) async fn faulty_replica(
    ctx: &Ctx,
    stall: Duration,
) -> (crate::faulty::FaultyBackend, crate::Replica) {
    let backend = ctx.factory().replica().await.expect("replica");
    let faulty = crate::faulty::FaultyBackend::new(backend, stall);
    let replica = ctx.replica_over(std::sync::Arc::new(faulty.clone()));
    (faulty, replica)
}
