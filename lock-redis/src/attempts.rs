//! Lock attempts, as a [`Batch`]: up to [`IN_FLIGHT`] at a time are sent
//! at once, each as its single-key command; those that come past that
//! queue in the lane ([`lock_core::lane`]) and go together, as one script
//! over all their keys.
//!
//! Why: the jobs of a scheduler that fire at the same instant each take a
//! tick lock, and a thousand single commands cost the client a thousand
//! encodings, time limits and replies to route, where one script call over
//! a thousand keys costs one of each.
//!
//! An attempt that is queued but not yet sent could be overtaken by a
//! release for the same owner (a caller that gave up, whose `Locker`
//! releases the token it tried): the release would find nothing, and the
//! attempt would then take a lock that nobody releases before its TTL runs
//! out. So every queued attempt is registered as pending until its command
//! has answered or failed (or it will never be sent), and a release of its
//! owner waits for that first ([`Attempts::settled`]). An attempt sent at
//! once needs no registration: its command is ahead of any later release
//! on the connection.
//!
//! Redis Cluster keeps one attempt per command (a script's keys must share a
//! slot), and acknowledged acquires have their own pipeline (`ack`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::backend::{AcquireAttempt, Lease};
use lock_core::lane::{self, Batch, Lane, Settled, Unsettled};
use lock_core::{BackendError, Identity, LockName, OwnerToken};

use crate::backend::Shared;
use crate::error::{protocol, timed_out};
use crate::scripts::{ACQUIRE, ACQUIRE_MANY, ACQUIRE_MANY_UNFENCED};
use crate::unfenced;

/// The most attempt commands in flight on one connection: up to this many
/// attempts are sent at once, each its own command; attempts that come
/// past it queue and make one script call, not one each. Sending one costs
/// the caller nothing but the command, where a queued attempt costs a task
/// and a channel per script call, a registration, and a wait for a command
/// in flight to answer, which only pays off when many come at once (a
/// scheduler's tick locks). With 1 or 2, 16 tasks looping on acquire and
/// release ran 20-30 % slower than with every attempt sent at once.
const IN_FLIGHT: usize = 16;

/// The most attempts one script call carries: about a millisecond of the
/// server's time, during which it serves nobody else.
const MAX_BATCH: usize = 1000;

/// The attempt lane of one backend, and the queued attempts not yet
/// settled.
#[derive(Debug, Default)]
pub(crate) struct Attempts {
    lane: Lane<Acquires>,
    pending: Arc<Pending>,
}

/// Queued attempts whose command has not answered yet, by owner, so that a
/// release of that owner can wait for its attempt.
#[derive(Debug, Default)]
struct Pending {
    next: AtomicU64,
    /// How many entries `by_owner` holds, so that a release finds none
    /// without taking the lock (every release asks).
    len: AtomicUsize,
    by_owner: Mutex<HashMap<OwnerToken, (u64, Settled), foldhash::fast::RandomState>>,
}

impl Pending {
    fn by_owner(
        &self,
    ) -> MutexGuard<'_, HashMap<OwnerToken, (u64, Settled), foldhash::fast::RandomState>> {
        // Every critical section leaves the map whole.
        self.by_owner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Registers one queued attempt as pending for as long as it lives;
/// dropped once its command answered or failed, or when it is never sent.
#[derive(Debug)]
struct PendingGuard {
    pending: Arc<Pending>,
    owner: OwnerToken,
    id: u64,
    /// Dropped after [`Drop::drop`] has unregistered the attempt, which
    /// wakes every release waiting for it.
    _unsettled: Unsettled,
}

impl PendingGuard {
    fn register(pending: &Arc<Pending>, owner: OwnerToken) -> Self {
        let (unsettled, settled) = lane::settle();
        let id = pending.next.fetch_add(1, Ordering::Relaxed);
        let mut by_owner = pending.by_owner();
        by_owner.insert(owner, (id, settled));
        pending.len.store(by_owner.len(), Ordering::Release);
        drop(by_owner);
        Self {
            pending: Arc::clone(pending),
            owner,
            id,
            _unsettled: unsettled,
        }
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        let mut by_owner = self.pending.by_owner();
        // A newer attempt of the same owner keeps its own entry.
        if by_owner
            .get(&self.owner)
            .is_some_and(|(id, _)| *id == self.id)
        {
            by_owner.remove(&self.owner);
            self.pending.len.store(by_owner.len(), Ordering::Release);
        }
    }
}

/// One attempt: the lock's key, its holder record's key, its owner, the
/// owner token as sent, the TTL in ms, the holder's identity (empty: none),
/// and its registration once queued.
#[derive(Debug)]
pub(crate) struct Attempt {
    key: String,
    meta: String,
    owner: OwnerToken,
    token: String,
    ms: u64,
    identity: String,
    pending: Option<PendingGuard>,
}

impl Attempt {
    /// An attempt to take `name` for `owner` for `ms` milliseconds, not yet
    /// queued.
    fn new(
        shared: &Shared,
        name: &LockName,
        owner: &OwnerToken,
        ms: u64,
        holder: Option<&Identity>,
    ) -> Self {
        Self {
            key: shared.keys.lock(name),
            meta: shared.keys.meta(name),
            owner: *owner,
            token: owner.to_hex(),
            ms,
            identity: holder.map_or_else(String::new, |h| h.as_str().to_owned()),
            pending: None,
        }
    }
}

impl Attempts {
    /// Waits until no attempt of `owner` can still take a lock after a
    /// command sent now. Returns at once when none is queued. Bounded by
    /// the operation timeouts of the attempt's batch and of those queued
    /// before it.
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn settled(&self, owner: &OwnerToken) {
        // An attempt abandoned before this release was made registered
        // before it, so a count of 0 means none of this owner's is pending.
        if self.pending.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let settled = self.pending.by_owner().get(owner).map(|(_, s)| s.clone());
        if let Some(settled) = settled {
            settled.wait().await;
        }
    }
}

/// Tries to take `name` for `owner` for `ms` milliseconds: at once when
/// fewer than [`IN_FLIGHT`] attempts are in flight, else in the next script
/// call of queued attempts; within the operation timeout either way (a
/// queued one counted from when it queued).
///
/// # Cancel safety
///
/// Not cancel safe, as no acquire is: a dropped call's attempt may still be
/// sent and take the lock. Sent at once, it is ahead of any later release
/// on the connection; queued, a release of `owner` waits for it.
pub(crate) async fn acquire(
    shared: &Arc<Shared>,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
    holder: Option<&Identity>,
) -> Result<AcquireAttempt, BackendError> {
    let attempt = Attempt::new(shared, name, owner, ms, holder);
    let got = lane::call::<Acquires>(shared, attempt).await?;
    answer(shared.fencing, got, shared.conn.target())
}

/// Tries to take `name` for `owner` for `ms` milliseconds with a command
/// of its own, for Redis Cluster. Not cancel safe (see [`acquire`]).
pub(crate) async fn alone(
    shared: &Shared,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
    holder: Option<&Identity>,
) -> Result<AcquireAttempt, BackendError> {
    let fence = shared.fencing.then(|| shared.keys.fence_for(name));
    let attempt = Attempt::new(shared, name, owner, ms, holder);
    let got = single(shared, attempt, fence).await?;
    answer(shared.fencing, got, shared.conn.target())
}

/// One attempt as its single command: the acquire script (with the `fence`
/// counter's key) with fencing tokens; without them the unfenced script, or
/// `SET NX PX GET` for an attempt that stores no holder identity. Both
/// scripts write the holder record with the lock.
async fn single(shared: &Shared, a: Attempt, fence: Option<String>) -> Result<i64, BackendError> {
    let Attempt {
        key,
        meta,
        token,
        ms,
        identity,
        pending,
        ..
    } = a;
    let Some(fence) = fence else {
        let got = unfenced::acquire(shared, key, token, ms, (meta, identity)).await;
        drop(pending);
        return got;
    };
    let got = shared
        .conn
        .run("acquire", |mut c| async move {
            ACQUIRE
                .run(
                    &mut c,
                    &[key, fence, meta],
                    &[token, ms.to_string(), identity],
                )
                .await
        })
        .await;
    drop(pending);
    got
}

/// An attempt's answer: with fencing tokens, the token or 0 when held
/// elsewhere; without, 1 when taken and 0 when held elsewhere.
fn answer(fencing: bool, got: i64, target: &str) -> Result<AcquireAttempt, BackendError> {
    match (fencing, u64::try_from(got)) {
        (_, Ok(0)) => Ok(AcquireAttempt::HeldElsewhere),
        (true, Ok(token)) => Ok(AcquireAttempt::Acquired(Lease::new(Some(token)))),
        (false, Ok(1)) => Ok(AcquireAttempt::Acquired(Lease::new(None))),
        _ => Err(protocol("acquire", target, got)),
    }
}

/// Lock attempts on one connection, with fencing tokens when the backend
/// draws them.
#[derive(Debug)]
struct Acquires;

impl Batch for Acquires {
    type Host = Shared;
    type Item = Attempt;
    type Answer = i64;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(shared: &Shared) -> &Lane<Self> {
        &shared.attempts.lane
    }

    /// Given up at this bound, a queued attempt is still sent, and a
    /// release of its owner waits for it.
    fn queued_limit(shared: &Shared) -> Option<Duration> {
        Some(shared.conn.op_timeout())
    }

    fn timed_out(shared: &Shared, limit: Duration) -> BackendError {
        timed_out("acquire", shared.conn.target(), limit)
    }

    fn queued(shared: &Shared, attempt: &mut Attempt) {
        attempt.pending = Some(PendingGuard::register(
            &shared.attempts.pending,
            attempt.owner,
        ));
    }

    async fn run_one(shared: &Shared, a: Attempt) -> Result<i64, BackendError> {
        let fence = shared.fencing.then(|| shared.keys.fence());
        single(shared, a, fence).await
    }

    async fn run(shared: &Shared, items: Vec<Attempt>) -> Vec<Result<i64, BackendError>> {
        let len = items.len();
        let mut keys = Vec::with_capacity(len * 2 + 1);
        let mut args = Vec::with_capacity(len * 3);
        // The registrations outlive the command.
        let mut pending = Vec::with_capacity(len);
        if shared.fencing {
            keys.push(shared.keys.fence());
        }
        for a in items {
            keys.push(a.key);
            keys.push(a.meta);
            args.push(a.token);
            args.push(a.ms.to_string());
            args.push(a.identity);
            pending.push(a.pending);
        }
        let script = if shared.fencing {
            &ACQUIRE_MANY
        } else {
            &ACQUIRE_MANY_UNFENCED
        };
        let answer = shared
            .conn
            .run("acquire batch", |mut c| async move {
                script.run(&mut c, &keys, &args).await
            })
            .await;
        drop(pending);
        lane::each(answer, len)
    }
}
