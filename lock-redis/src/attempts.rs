//! Lock attempts: up to [`ALONE`] at a time are sent straight away, each as
//! its single-key command; past that they go through a lane
//! ([`lock_core::lane`], a [`Batch`]), where those that queue while others
//! are in flight go together, as one script over all their keys.
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
//! out. So every attempt is registered as pending until its command has
//! answered or failed (or it will never be sent), and a release of its owner
//! waits for that first ([`Attempts::settled`]).
//!
//! Redis Cluster keeps one attempt per command (a script's keys must share a
//! slot), and acknowledged acquires have their own pipeline (`ack`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::backend::{AcquireAttempt, Lease};
use lock_core::lane::{self, Batch, Lane};
use lock_core::{BackendError, LockName, OwnerToken};
use tokio::sync::watch;

use crate::backend::Shared;
use crate::error::{protocol, timed_out};
use crate::scripts::{ACQUIRE, ACQUIRE_MANY, ACQUIRE_MANY_UNFENCED};
use crate::unfenced;

/// The most attempts sent straight away, each its own command, before the
/// rest go through the lanes. Sending one costs the caller nothing but the
/// command; going through a lane costs a task and a channel per batch, a
/// registration per attempt and, while script calls are in flight, a wait
/// for one of them, which only pays off when many attempts come at once (a
/// scheduler's tick locks). With only 1 sent alone, 16 tasks looping on
/// acquire and release ran 20-30 % slower than with every attempt alone.
pub(crate) const ALONE: usize = 16;

/// The most script calls of one kind in flight on one connection, past the
/// attempts sent alone: attempts that come while these are in flight make
/// one call, not one each.
const IN_FLIGHT: usize = 2;

/// The most attempts one script call carries: about a millisecond of the
/// server's time, during which it serves nobody else.
const MAX_BATCH: usize = 1000;

/// The attempt lanes of one backend, the attempts in them not yet settled,
/// and how many are being sent alone.
#[derive(Debug, Default)]
pub(crate) struct Attempts {
    plain: Lane<Plain>,
    fenced: Lane<Fenced>,
    pending: Arc<Pending>,
    alone: AtomicUsize,
}

/// One of the [`ALONE`] slots for attempts sent straight away, given back
/// on drop.
struct AloneSlot<'a>(&'a AtomicUsize);

impl<'a> AloneSlot<'a> {
    fn take(count: &'a AtomicUsize) -> Option<Self> {
        if count.fetch_add(1, Ordering::AcqRel) < ALONE {
            Some(Self(count))
        } else {
            count.fetch_sub(1, Ordering::AcqRel);
            None
        }
    }
}

impl Drop for AloneSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Attempts whose command has not answered yet, by owner, so that a release
/// of that owner can wait for its attempt.
#[derive(Debug, Default)]
struct Pending {
    next: AtomicU64,
    /// How many entries `by_owner` holds, so that a release finds none
    /// without taking the lock (every release asks).
    len: AtomicUsize,
    by_owner: Mutex<HashMap<OwnerToken, (u64, Settled), foldhash::fast::RandomState>>,
}

/// Closes when an attempt has settled: its sender is dropped then.
type Settled = watch::Receiver<()>;

impl Pending {
    fn by_owner(
        &self,
    ) -> MutexGuard<'_, HashMap<OwnerToken, (u64, Settled), foldhash::fast::RandomState>> {
        // Every critical section leaves the map whole.
        self.by_owner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Registers one attempt as pending for as long as it lives; dropped once
/// its command answered or failed, or when it is never sent.
#[derive(Debug)]
struct PendingGuard {
    pending: Arc<Pending>,
    owner: OwnerToken,
    id: u64,
    /// Dropped after [`Drop::drop`] has unregistered the attempt, which
    /// wakes every release waiting for it.
    _settled: watch::Sender<()>,
}

impl PendingGuard {
    fn register(pending: &Arc<Pending>, owner: OwnerToken) -> Self {
        let (settled, signal) = watch::channel(());
        let id = pending.next.fetch_add(1, Ordering::Relaxed);
        let mut by_owner = pending.by_owner();
        by_owner.insert(owner, (id, signal));
        pending.len.store(by_owner.len(), Ordering::Release);
        drop(by_owner);
        Self {
            pending: Arc::clone(pending),
            owner,
            id,
            _settled: settled,
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

/// One attempt: the lock's key, the owner token as sent, the TTL in ms.
#[derive(Debug)]
pub(crate) struct Attempt {
    key: String,
    token: String,
    ms: u64,
    pending: PendingGuard,
}

impl Attempts {
    /// Waits until no attempt of `owner` can still take a lock after a
    /// command sent now. Returns at once when none is pending. Bounded by
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
        let signal = self.pending.by_owner().get(owner).map(|(_, s)| s.clone());
        if let Some(mut signal) = signal {
            // Nothing is ever sent: this returns when the sender is dropped.
            let _ = signal.changed().await;
        }
    }
}

/// Tries to take `name` for `owner` for `ms` milliseconds: at once when
/// fewer than [`ALONE`] attempts are being sent, else through a lane (in the
/// next script call of queued attempts); within the operation timeout
/// either way.
///
/// # Cancel safety
///
/// Not cancel safe, as no acquire is: a dropped call's attempt may still be
/// sent and take the lock. Sent alone, it is ahead of any later release on
/// the connection; queued, a release of `owner` waits for it.
pub(crate) async fn acquire(
    shared: &Arc<Shared>,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
) -> Result<AcquireAttempt, BackendError> {
    if let Some(_slot) = AloneSlot::take(&shared.attempts.alone) {
        return alone(shared, name, owner, ms).await;
    }
    let attempt = Attempt {
        key: shared.keys.lock(name),
        token: owner.to_hex(),
        ms,
        pending: PendingGuard::register(&shared.attempts.pending, *owner),
    };
    let (target, limit) = (shared.conn.target(), shared.conn.op_timeout());
    if shared.fencing {
        let got = within(limit, target, lane::call::<Fenced>(shared, attempt)).await?;
        fenced_answer(got, target)
    } else {
        match within(limit, target, lane::call::<Plain>(shared, attempt)).await? {
            0 => Ok(AcquireAttempt::HeldElsewhere),
            1 => Ok(AcquireAttempt::Acquired(Lease::new(None))),
            other => Err(protocol("acquire", target, other)),
        }
    }
}

/// Tries to take `name` for `owner` for `ms` milliseconds with a command
/// of its own: `SET NX PX GET` without fencing tokens, the acquire script
/// with them. Not cancel safe (see [`acquire`]).
pub(crate) async fn alone(
    shared: &Shared,
    name: &LockName,
    owner: &OwnerToken,
    ms: u64,
) -> Result<AcquireAttempt, BackendError> {
    let (key, token) = (shared.keys.lock(name), owner.to_hex());
    let conn = &shared.conn;
    if !shared.fencing {
        return match unfenced::acquire(shared, key, token, ms).await? {
            0 => Ok(AcquireAttempt::HeldElsewhere),
            1 => Ok(AcquireAttempt::Acquired(Lease::new(None))),
            other => Err(protocol("acquire", conn.target(), other)),
        };
    }
    let fence = shared.keys.fence_for(name);
    let got: i64 = conn
        .run("acquire", |mut c| async move {
            ACQUIRE
                .run(&mut c, &[key, fence], &[token, ms.to_string()])
                .await
        })
        .await?;
    fenced_answer(got, conn.target())
}

/// The acquire script's answer: a fencing token, or 0 when held elsewhere.
fn fenced_answer(got: i64, target: &str) -> Result<AcquireAttempt, BackendError> {
    match u64::try_from(got) {
        Ok(0) => Ok(AcquireAttempt::HeldElsewhere),
        Ok(token) => Ok(AcquireAttempt::Acquired(Lease::new(Some(token)))),
        Err(_) => Err(protocol("acquire", target, got)),
    }
}

/// `answer` within `limit`. A queued attempt waits for a batch in flight
/// before its own is sent, so without this bound a stalled server could
/// hold it for two operation timeouts. Given up here, the attempt is still
/// sent, and a release of its owner waits for it.
async fn within<T>(
    limit: Duration,
    target: &str,
    answer: impl Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    tokio::time::timeout(limit, answer)
        .await
        .unwrap_or_else(|_| Err(timed_out("acquire", target, limit)))
}

/// Attempts without a fencing token.
#[derive(Debug)]
struct Plain;

/// Attempts that draw a fencing token when they take the lock.
#[derive(Debug)]
struct Fenced;

impl Batch for Plain {
    type Host = Shared;
    type Item = Attempt;
    type Answer = i64;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(shared: &Shared) -> &Lane<Self> {
        &shared.attempts.plain
    }

    async fn run(shared: &Shared, mut items: Vec<Attempt>) -> Vec<Result<i64, BackendError>> {
        if items.len() == 1 {
            if let Some(Attempt {
                key,
                token,
                ms,
                pending,
            }) = items.pop()
            {
                let got = unfenced::acquire(shared, key, token, ms).await;
                drop(pending);
                return vec![got];
            }
        }
        let len = items.len();
        let (keys, args, settled) = split(items);
        let answer = shared
            .conn
            .run("acquire batch", |mut c| async move {
                ACQUIRE_MANY_UNFENCED.run(&mut c, &keys, &args).await
            })
            .await;
        drop(settled);
        lane::each(answer, len)
    }
}

impl Batch for Fenced {
    type Host = Shared;
    type Item = Attempt;
    type Answer = i64;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(shared: &Shared) -> &Lane<Self> {
        &shared.attempts.fenced
    }

    async fn run(shared: &Shared, items: Vec<Attempt>) -> Vec<Result<i64, BackendError>> {
        let len = items.len();
        let (mut keys, args, settled) = split(items);
        let fence = shared.keys.fence();
        let answer = if keys.len() == 1 {
            keys.push(fence);
            shared
                .conn
                .run("acquire", |mut c| async move {
                    ACQUIRE.run(&mut c, &keys, &args).await.map(|t| vec![t])
                })
                .await
        } else {
            keys.insert(0, fence);
            shared
                .conn
                .run("acquire batch", |mut c| async move {
                    ACQUIRE_MANY.run(&mut c, &keys, &args).await
                })
                .await
        };
        drop(settled);
        lane::each(answer, len)
    }
}

/// The keys, the (token, TTL) argument pairs and the pending registrations
/// of `items`, in order; the registrations must outlive the command.
fn split(items: Vec<Attempt>) -> (Vec<String>, Vec<String>, Vec<PendingGuard>) {
    let mut keys = Vec::with_capacity(items.len() + 1);
    let mut args = Vec::with_capacity(items.len() * 2);
    let mut settled = Vec::with_capacity(items.len());
    for a in items {
        keys.push(a.key);
        args.push(a.token);
        args.push(a.ms.to_string());
        settled.push(a.pending);
    }
    (keys, args, settled)
}
