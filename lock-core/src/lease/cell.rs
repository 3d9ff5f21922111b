//! The synchronous core of one lease: its deadlines and how it ended.
//!
//! Every clone of a lease's handle, the guard, the heartbeat and the
//! backend's loss feed read and change the lease through this cell, under one
//! lock, so each of them sees the same answer at the same instant. The cell
//! knows nothing of tokio tasks, metrics or backends: the caller performs the
//! side effects of an ending (cancel the token, count the loss) when a call
//! reports that it was the one that ended the lease. That keeps it small
//! enough to check every interleaving with a model checker
//! (`lock-core/tests/loom_lease.rs` compiles this file against loom's `Mutex`).

use super::{Instant, LossReason, Mutex};

/// The state shared by every view of one lease.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Local validity deadline; `None` for a lease with no backend (unlocked).
    valid_until: Option<Instant>,
    /// The `max_hold` instant, if any.
    hold_deadline: Option<Instant>,
    /// Set once, never cleared: why the lease ended.
    ended: Option<LossReason>,
    /// The deadline was set by a retained hold: reaching it is a normal end.
    retained: bool,
    /// No renewal may start any more (a retained hold is being set).
    renewals_stopped: bool,
    renew_failing: bool,
    /// Renewals sent and not yet answered: the heartbeat's and manual ones
    /// (`LeaseHandle::renew`) may be on their way at the same time.
    renewals_in_flight: u32,
}

/// What a check found: the lease is valid, or it ended (and whether this
/// call is the one that ended it, so its caller does the side effects once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Validity {
    Valid,
    Ended { reason: LossReason, now: bool },
}

impl LeaseCell {
    pub(crate) fn new(valid_until: Option<Instant>, hold_deadline: Option<Instant>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                valid_until,
                hold_deadline,
                ended: None,
                retained: false,
                renewals_stopped: false,
                renew_failing: false,
                renewals_in_flight: 0,
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // Every critical section leaves the state whole, so a panic elsewhere
        // that poisoned the lock left nothing half-written.
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut inner)
    }

    pub(crate) fn valid_until(&self) -> Option<Instant> {
        self.with(|i| i.valid_until)
    }

    pub(crate) fn ended(&self) -> Option<LossReason> {
        self.with(|i| i.ended)
    }

    /// Ends the lease with `reason` unless it already ended. Returns whether
    /// this call ended it.
    pub(crate) fn end(&self, reason: LossReason) -> bool {
        self.with(|i| i.end(reason))
    }

    /// Valid at `now`, or ended; ends it first if a deadline has passed.
    pub(crate) fn check(&self, now: Instant) -> Validity {
        self.with(|i| i.check(now))
    }

    /// The holder is done with the lease: ends it as released if it is still
    /// valid at `now`, otherwise as whatever ended it first.
    pub(crate) fn finish(&self, now: Instant) -> Validity {
        self.with(|i| match i.check(now) {
            Validity::Valid => {
                i.end(LossReason::Released);
                Validity::Valid
            }
            ended => ended,
        })
    }

    /// Moves the validity deadline to `candidate` after a successful renewal,
    /// never backwards and never after the lease ended.
    pub(crate) fn extend(&self, candidate: Instant) {
        self.with(|i| {
            i.renew_failing = false;
            if i.ended.is_some() || i.retained {
                return;
            }
            if let Some(current) = i.valid_until {
                if candidate > current {
                    i.valid_until = Some(candidate);
                }
            }
        });
    }

    /// Keeps the lease as a completion mark until `until`, when it ends as
    /// released. Renewals no longer move the deadline. Returns false if the
    /// lease had already ended.
    pub(crate) fn retain_until(&self, until: Instant) -> bool {
        self.with(|i| {
            if i.ended.is_some() {
                return false;
            }
            i.retained = true;
            i.hold_deadline = None;
            if i.valid_until.is_some() {
                i.valid_until = Some(until);
            }
            true
        })
    }

    /// Marks a renewal as started, unless the lease ended or its renewals
    /// were stopped (a retained hold is being set, or was): returns whether
    /// it may be sent. Every `true` must be followed by one `end_renewal`.
    pub(crate) fn begin_renewal(&self) -> bool {
        self.with(|i| {
            if i.ended.is_some() || i.renewals_stopped {
                return false;
            }
            i.renewals_in_flight = i.renewals_in_flight.saturating_add(1);
            true
        })
    }

    /// A renewal's reply (or failure) arrived, or its caller gave up on it.
    pub(crate) fn end_renewal(&self) {
        self.with(|i| i.renewals_in_flight = i.renewals_in_flight.saturating_sub(1));
    }

    /// Lets no renewal start any more; returns whether one is still in
    /// flight (its request may reach the server after anything sent now).
    pub(crate) fn stop_renewals(&self) -> bool {
        self.with(|i| {
            i.renewals_stopped = true;
            i.renewals_in_flight > 0
        })
    }

    pub(crate) fn renewal_in_flight(&self) -> bool {
        self.with(|i| i.renewals_in_flight > 0)
    }

    pub(crate) fn set_renew_failing(&self) {
        self.with(|i| i.renew_failing = true);
    }
}

impl Inner {
    fn end(&mut self, reason: LossReason) -> bool {
        if self.ended.is_some() {
            return false;
        }
        self.ended = Some(reason);
        true
    }

    fn check(&mut self, now: Instant) -> Validity {
        if let Some(reason) = self.ended {
            return Validity::Ended { reason, now: false };
        }
        let held_past = self.hold_deadline.filter(|h| now >= *h);
        let valid_past = self.valid_until.filter(|d| now >= *d);
        // Both passed unobserved: the one that passed first ended the lease.
        let reason = match (held_past, valid_past) {
            (Some(h), Some(d)) if h <= d => LossReason::MaxHoldExceeded,
            (Some(_), None) => LossReason::MaxHoldExceeded,
            (_, Some(_)) => self.validity_reason(),
            (None, None) => return Validity::Valid,
        };
        self.ended = Some(reason);
        Validity::Ended { reason, now: true }
    }

    fn validity_reason(&self) -> LossReason {
        if self.retained {
            LossReason::Released
        } else if self.renew_failing || self.renewals_in_flight > 0 {
            LossReason::BackendError
        } else {
            LossReason::Expired
        }
    }
}
