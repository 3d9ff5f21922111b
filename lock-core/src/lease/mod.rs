//! A held lease: its shared state, the handle jobs receive, and the guard.
//!
//! A lease ends once, for every view of it at the same instant: released,
//! dropped, its retained hold over, its `max_hold` reached, or lost. From
//! then on every clone of its [`LeaseHandle`] fails `assert_held`, `lost()`
//! completes and the cancellation token has fired.

mod cell;
mod guard;
mod handle;
pub(crate) mod retention;
mod spares;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

pub use guard::LockGuard;
pub use handle::LeaseHandle;

// The cell names its clock, lock and reasons through this module, so the
// model checker can compile it against loom's `Mutex` instead.
use crate::LossReason;
use tokio::time::Instant;

use crate::background::Background;
use crate::loss_feed::LeaseRegistry;
use crate::metrics::LabelMetrics;
use crate::{Error, LockBackend, LockName, OwnerToken};
use cell::{LeaseCell, Validity};

/// State of one lease shared by its guard, its handles and the heartbeat.
pub(crate) struct LeaseState {
    pub(crate) id: u64,
    pub(crate) name: LockName,
    pub(crate) owner: OwnerToken,
    pub(crate) fencing: Option<u64>,
    pub(crate) ttl: Duration,
    /// The TTL less the drift: how long a renewal keeps the lease valid.
    validity: Duration,
    pub(crate) interval: Duration,
    /// When the heartbeat must first look at the lease, and how long after
    /// the grant that is.
    first_attention: Instant,
    pub(crate) attention_span: Duration,
    pub(crate) auto_renew: bool,
    pub(crate) hold_deadline: Option<Instant>,
    pub(crate) acquired_at: Instant,
    /// `None` for a lease taken without a backend (unlocked mode): it never expires.
    pub(crate) backend: Option<Arc<dyn LockBackend>>,
    cell: LeaseCell,
    /// Cancelled when the lease ends; made on first demand (most leases are
    /// never waited on), under its own lock: see [`LeaseState::cancel_token`].
    cancel: Mutex<Option<CancellationToken>>,
    /// Set (before the cell is read) when a token is first asked for: an
    /// ending that finds it unset has no token to cancel and skips the lock.
    cancel_asked: AtomicBool,
    renewal_done: Notify,
    hold_counted: AtomicBool,
    /// The series of this lease's `lock` label, resolved at the claim.
    metrics: Arc<LabelMetrics>,
    /// Where the backend's loss feed finds this lease, if it has one.
    registry: Option<Arc<LeaseRegistry>>,
    /// The owning `Locker`'s tasks, which shutdown waits for.
    pub(crate) background: Background,
}

impl std::fmt::Debug for LeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseState")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Everything needed to build a [`LeaseState`].
pub(crate) struct LeaseParts<'a> {
    pub(crate) id: u64,
    pub(crate) name: LockName,
    pub(crate) owner: OwnerToken,
    pub(crate) fencing: Option<u64>,
    pub(crate) options: &'a crate::LockOptions,
    pub(crate) sent_at: Instant,
    /// From when the server is known to keep the lock for its TTL: `sent_at`,
    /// or earlier when the backend granted less than the TTL
    /// ([`Lease::lasts_at_least`](crate::backend::Lease::lasts_at_least)).
    /// Renewals and the local deadline count from here.
    pub(crate) proved_at: Instant,
    /// `proved_at` plus the options' validity, which the caller has checked
    /// (`None` without a backend: the lease never expires).
    pub(crate) valid_until: Option<Instant>,
    pub(crate) backend: Option<Arc<dyn LockBackend>>,
    pub(crate) metrics: Arc<LabelMetrics>,
    pub(crate) registry: Option<Arc<LeaseRegistry>>,
    pub(crate) background: Background,
}

/// `at + d`, or `None` when that is past what the clock can represent: a
/// deadline so far away is no deadline.
#[inline]
pub(crate) fn deadline_after(at: Instant, d: Duration) -> Option<Instant> {
    at.checked_add(d)
}

impl LeaseState {
    pub(crate) fn new(p: LeaseParts<'_>) -> Arc<Self> {
        let timing = p.options.timing();
        let hold_deadline = p
            .options
            .max_hold()
            .and_then(|h| deadline_after(p.sent_at, h));
        p.metrics.held_start();
        let first_attention =
            deadline_after(p.proved_at, timing.first_attention).unwrap_or(p.proved_at);
        let state = match spares::take() {
            // An ended lease's allocation saves its free and this one's
            // allocation (see `spares`); `get_mut` proves no guard, handle,
            // heartbeat or feed still sees it. Overwritten field by field:
            // assigning a whole new state builds it on the stack first.
            Some(mut spare) => match Arc::get_mut(&mut spare) {
                Some(s) => {
                    s.id = p.id;
                    s.name = p.name;
                    s.owner = p.owner;
                    s.fencing = p.fencing;
                    s.ttl = p.options.ttl();
                    s.validity = timing.validity;
                    s.interval = timing.interval;
                    s.first_attention = first_attention;
                    s.attention_span = timing.first_attention;
                    s.auto_renew = p.options.auto_renew();
                    s.hold_deadline = hold_deadline;
                    s.acquired_at = p.sent_at;
                    s.backend = p.backend;
                    s.cell = LeaseCell::new(p.valid_until, hold_deadline);
                    *s.cancel.get_mut().unwrap_or_else(PoisonError::into_inner) = None;
                    *s.cancel_asked.get_mut() = false;
                    // No one else holds the state, so no one waits on it.
                    s.renewal_done = Notify::new();
                    *s.hold_counted.get_mut() = false;
                    s.metrics = p.metrics;
                    s.registry = p.registry;
                    s.background = p.background;
                    spare
                }
                None => Self::allocate(p, first_attention, hold_deadline),
            },
            None => Self::allocate(p, first_attention, hold_deadline),
        };
        if let Some(registry) = &state.registry {
            if let Some(reason) = registry.insert(&state) {
                // The server ended it between the grant and now.
                state.mark_lost(reason);
            }
        }
        state
    }

    /// A new allocation for the lease `p` describes.
    fn allocate(
        p: LeaseParts<'_>,
        first_attention: Instant,
        hold_deadline: Option<Instant>,
    ) -> Arc<Self> {
        let timing = p.options.timing();
        // Built where the allocation already is (the weak reference goes
        // unused): `Arc::new` builds the state on the stack and then copies
        // all of it, which cost about 60 instructions per acquire.
        Arc::new_cyclic(|_| Self {
            id: p.id,
            name: p.name,
            owner: p.owner,
            fencing: p.fencing,
            ttl: p.options.ttl(),
            validity: timing.validity,
            interval: timing.interval,
            first_attention,
            attention_span: timing.first_attention,
            auto_renew: p.options.auto_renew(),
            hold_deadline,
            acquired_at: p.sent_at,
            backend: p.backend,
            cell: LeaseCell::new(p.valid_until, hold_deadline),
            cancel: Mutex::new(None),
            cancel_asked: AtomicBool::new(false),
            renewal_done: Notify::new(),
            hold_counted: AtomicBool::new(false),
            metrics: p.metrics,
            registry: p.registry,
            background: p.background,
        })
    }

    /// The first instant the heartbeat must look at this lease: its first
    /// renewal, its local deadline or its `max_hold`, whichever comes first.
    pub(crate) fn first_attention(&self) -> Instant {
        self.first_attention
    }

    /// When the first renewal is due: one interval after the server was
    /// last known to keep the lock for its TTL (the grant, or earlier).
    pub(crate) fn first_renew_due(&self) -> Instant {
        // `first_attention` counts `attention_span` from that instant.
        let proved_at = self
            .first_attention
            .checked_sub(self.attention_span)
            .unwrap_or(self.acquired_at);
        self.renew_due_after(proved_at).unwrap_or(proved_at)
    }

    /// When the next renewal is due after one sent at `sent_at`.
    pub(crate) fn renew_due_after(&self, sent_at: Instant) -> Option<Instant> {
        deadline_after(sent_at, self.interval)
    }

    /// The series of this lease's `lock` label.
    pub(crate) fn metrics(&self) -> &LabelMetrics {
        &self.metrics
    }

    pub(crate) fn valid_until(&self) -> Option<Instant> {
        self.cell.valid_until()
    }

    /// Moves the validity deadline to `sent_at + ttl - drift` after a
    /// successful renewal whose request left at `sent_at`. Counting from the
    /// send, not the reply, is what keeps the local deadline ahead of the
    /// server's expiry however slow the reply was.
    pub(crate) fn extend(&self, sent_at: Instant) {
        if let Some(candidate) = deadline_after(sent_at, self.validity) {
            self.cell.extend(candidate);
        }
    }

    /// Marks a heartbeat renewal as started; false if the lease ended or its
    /// renewals were stopped, and the renewal must not be sent.
    pub(crate) fn begin_renewal(&self) -> bool {
        self.cell.begin_renewal()
    }

    /// Called by the renewal task as soon as the backend answered, so that a
    /// retained hold waiting for it can go ahead.
    pub(crate) fn end_renewal(&self) {
        self.cell.end_renewal();
        self.renewal_done.notify_waiters();
    }

    /// Stops heartbeat renewals and waits (at most `bound`) until none is in
    /// flight, so that nothing sent afterwards can be overtaken by a renewal
    /// request still on its way (which would set the TTL back).
    pub(crate) async fn quiesce_renewals(&self, bound: Duration) {
        if !self.cell.stop_renewals() {
            return;
        }
        let _ = tokio::time::timeout(bound, async {
            loop {
                let done = self.renewal_done.notified();
                tokio::pin!(done);
                done.as_mut().enable();
                if !self.cell.renewal_in_flight() {
                    return;
                }
                done.await;
            }
        })
        .await;
    }

    pub(crate) fn set_renew_failing(&self) {
        self.cell.set_renew_failing();
    }

    /// Why the lease ended, if it has.
    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        self.cell.ended()
    }

    /// Ends the lease with `reason` unless it already ended: counts a loss,
    /// ends the hold and fires the cancellation token. Returns whether this
    /// call was the one that ended it.
    pub(crate) fn mark_lost(&self, reason: LossReason) -> bool {
        let ended = self.cell.end(reason);
        if ended {
            self.on_end(reason, Instant::now());
        }
        ended
    }

    /// Ok while the lease is valid; otherwise ends it (if a deadline just
    /// passed) and returns why it is not.
    pub(crate) fn check_valid(&self, now: Instant) -> std::result::Result<(), LossReason> {
        self.settle(self.cell.check(now), now)
    }

    /// The holder is done: ends the lease as released if it is still valid,
    /// and returns why it had ended otherwise.
    pub(crate) fn finish(&self, now: Instant) -> std::result::Result<(), LossReason> {
        match self.cell.finish(now) {
            Validity::Valid => {
                self.on_end(LossReason::Released, now);
                Ok(())
            }
            ended => self.settle(ended, now),
        }
    }

    /// Keeps the lease valid until `until`, then lets it end as released.
    pub(crate) fn retain_until(&self, until: Instant) -> bool {
        self.cell.retain_until(until)
    }

    fn settle(&self, validity: Validity, at: Instant) -> std::result::Result<(), LossReason> {
        match validity {
            Validity::Valid => Ok(()),
            Validity::Ended { reason, now } => {
                if now {
                    self.on_end(reason, at);
                }
                Err(reason)
            }
        }
    }

    /// The token cancelled when the lease ends (already cancelled if it has).
    ///
    /// An ending sets the cell's reason before it looks for a token here, and
    /// a token is made after looking at the reason, both under this lock: so
    /// either the ending finds the token and cancels it, or the token is made
    /// after the ending and sees the reason.
    ///
    /// The ending looks only if `cancel_asked` is set. That flag is set
    /// before the reason is read under the cell's lock, and read after the
    /// reason was set under it; the cell's lock orders the two, so an ending
    /// that misses the flag came first, and the token made later sees the
    /// reason.
    pub(crate) fn cancel_token(&self) -> CancellationToken {
        let mut slot = self.cancel.lock().unwrap_or_else(PoisonError::into_inner);
        slot.get_or_insert_with(|| {
            self.cancel_asked.store(true, Ordering::SeqCst);
            let token = CancellationToken::new();
            if self.cell.ended().is_some() {
                token.cancel();
            }
            token
        })
        .clone()
    }

    /// The side effects of the one ending at `now`, run by whichever caller
    /// ended it.
    fn on_end(&self, reason: LossReason, now: Instant) {
        if reason.is_loss() {
            self.count_loss(reason);
        }
        self.end_hold(now);
        if let Some(registry) = &self.registry {
            registry.remove(&self.owner);
        }
        if self.cancel_asked.load(Ordering::SeqCst) {
            self.cancel_now();
        }
        // Otherwise there is no token yet: one made from now on sees the
        // ending (see `cancel_token`).
    }

    /// Logs and counts a loss (out of line: a release, the usual ending,
    /// then keeps fewer registers live).
    #[cold]
    #[inline(never)]
    fn count_loss(&self, reason: LossReason) {
        warn!(lock = %self.name, %reason, "lock lost; cancelling the guarded work");
        self.metrics.lost(reason);
    }

    /// Fires the cancellation token, if one was made.
    #[inline(never)]
    fn cancel_now(&self) {
        let slot = self.cancel.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(token) = slot.as_ref() {
            token.cancel();
        }
    }

    /// Stops the held-time metrics (once), when the holder is done with the
    /// lease even if a retained hold keeps it on the server a while longer.
    /// `now` is the caller's reading of the clock: a release reads it once
    /// for its check, its ending and this (each read of tokio's clock costs
    /// about as much as the rest of the ending).
    #[inline]
    pub(crate) fn end_hold(&self, now: Instant) {
        if !self.hold_counted.swap(true, Ordering::AcqRel) {
            self.count_hold(now);
        }
    }

    fn count_hold(&self, now: Instant) {
        let held = now
            .saturating_duration_since(self.acquired_at)
            .as_secs_f64();
        self.metrics.held_end(held);
    }

    pub(crate) fn lost_error(&self, reason: LossReason) -> Error {
        Error::LockLost {
            name: self.name.clone(),
            reason,
        }
    }
}
