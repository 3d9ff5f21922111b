//! An in-process holder that does guarded, fenced writes until its lease is
//! lost, and what the cases measure about it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LeaseHandle, LockGuard, LockName, LockOptions, LossReason};
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use super::cases::refused_for_now;
use crate::observe::{FencedStore, GuardLog};
use crate::Replica;

/// Pause between two guarded writes: often enough that a write lands close
/// to the deadline, rarely enough to cost nothing on 2 cores.
const WRITE_EVERY: Duration = Duration::from_millis(10);

/// Upper bound on writes per holder, so a lease that is never lost cannot
/// keep the loop going forever (the case's own timeouts fail first).
const MAX_WRITES: usize = 6_000;

/// How long, after a successor's grant, a session backend that pushes
/// losses may take to tell the previous holder. By the grant the server has
/// ended the holder's session and its end is in this process's socket: only
/// the runtime's and the OS's scheduling stand between it and the lease (a
/// loaded 2-core machine delays a task by milliseconds, seldom by tens). A
/// backend that learnt only at its next renewal would take up to a renew
/// interval, 500 ms on Postgres here.
pub(super) const PUSH_LAG: Duration = Duration::from_millis(100);

/// Waits, at most `bound`, until `old` no longer says held: how long that
/// took, or `None` if it still said held at the bound.
pub(super) async fn stops_saying_held(old: &LeaseHandle, bound: Duration) -> Option<Duration> {
    let from = Instant::now();
    let ended = old.lost();
    tokio::pin!(ended);
    let mut heard = false;
    loop {
        if !old.is_held() {
            return Some(from.elapsed());
        }
        if from.elapsed() >= bound {
            return None;
        }
        // The local deadline ends a lease without any event: poll too.
        tokio::select! {
            _ = &mut ended, if !heard => heard = true,
            () = sleep(Duration::from_millis(1)) => {}
        }
    }
}

/// One iteration's shared resource: the fenced store, the guard log, and
/// when each accepted write happened with which token.
#[derive(Debug, Default)]
pub(super) struct Resource {
    /// I2: rejects tokens below the highest seen.
    pub store: FencedStore,
    /// I5: every guarded write with its lease's deadline.
    pub log: GuardLog,
    accepted: Mutex<Vec<(Instant, u64)>>,
}

impl Resource {
    /// Offers a write under `token` and remembers it if accepted.
    pub(super) fn write(&self, token: u64) -> bool {
        let at = Instant::now();
        let ok = self.store.write(token);
        if ok {
            self.accepted
                .lock()
                .expect("resource lock")
                .push((at, token));
        }
        ok
    }

    /// Every accepted write: when, and under which token.
    pub(super) fn accepted(&self) -> Vec<(Instant, u64)> {
        self.accepted.lock().expect("resource lock").clone()
    }

    /// Accepted writes made at or after some acquisition (`at`, `token`)
    /// with a newer token: writes a fenced store should have refused, for
    /// cases with many successive holders of one name.
    pub(super) fn stale_after_any(&self, acquisitions: &[(Instant, u64)]) -> usize {
        self.accepted()
            .iter()
            .filter(|(at, token)| acquisitions.iter().any(|(a, t)| t > token && a <= at))
            .count()
    }

    /// Writes accepted under a token older than `newer` at or after `since`:
    /// a stale holder's writes that landed after its successor got the lock.
    pub(super) fn stale_accepted(&self, newer: u64, since: Instant) -> usize {
        self.accepted
            .lock()
            .expect("resource lock")
            .iter()
            .filter(|(at, token)| *token < newer && *at >= since)
            .count()
    }
}

/// A lock held through a `Locker`, with a writer task and a loss watcher.
#[derive(Debug)]
pub(super) struct Holder {
    /// The guard; released (or dropped) by the case.
    pub guard: LockGuard,
    /// The lease, for `lost`, `remaining_validity` and `assert_held`.
    pub handle: LeaseHandle,
    /// Its fencing token.
    pub token: u64,
    writer: JoinHandle<usize>,
    lost: JoinHandle<(Instant, LossReason)>,
}

impl Holder {
    /// Takes `name` (it must be free) and starts writing to `resource`.
    pub(super) async fn start(
        replica: &Replica,
        name: &LockName,
        opts: &LockOptions,
        resource: Arc<Resource>,
    ) -> Self {
        let guard = replica
            .locker
            .try_lock(name, opts)
            .await
            .expect("the holder acquires a free lock");
        let handle = guard.handle();
        let token = handle.fencing_token().expect("the backend fences");
        let writer = tokio::spawn(write_until_lost(handle.clone(), token, resource));
        let watched = handle.clone();
        let lost = tokio::spawn(async move {
            let reason = watched.lost().await;
            (Instant::now(), reason)
        });
        Self {
            guard,
            handle,
            token,
            writer,
            lost,
        }
    }

    /// A holder of `name` writing to a fresh resource, half a TTL on and
    /// still held: the state each fault is injected into.
    pub(super) async fn healthy(
        replica: &Replica,
        name: &LockName,
        opts: &LockOptions,
        ttl: Duration,
    ) -> (Self, Arc<Resource>) {
        let resource = Arc::new(Resource::default());
        let holder = Self::start(replica, name, opts, Arc::clone(&resource)).await;
        sleep(ttl / 2).await;
        assert!(holder.handle.is_held(), "healthy before the fault");
        (holder, resource)
    }

    /// Waits at most until `by` for the loss; its time and reason if it came.
    pub(super) async fn lost_by(&mut self, by: Instant) -> Option<(Instant, LossReason)> {
        match tokio::time::timeout_at(by, &mut self.lost).await {
            Ok(joined) => Some(joined.expect("loss watcher")),
            Err(_) => None,
        }
    }

    /// Releases the lock it still holds, then waits for the writer to stop
    /// (its guard fails once released): the release's result, the instant
    /// the lease ended here (just before the release was sent), and the
    /// writes made.
    pub(super) async fn release(self, within: Duration) -> (lock_core::Result<()>, Instant, usize) {
        // The lease ends here, before the server is asked: a successor may be
        // granted the lock as soon as the server deletes it, before the
        // release's reply reaches this holder, so that is not the instant to
        // compare a successor's grant against.
        let at = Instant::now();
        let released = self.guard.release().await;
        let n = tokio::time::timeout(within, self.writer)
            .await
            .expect("the writer stops once the lock is released")
            .expect("writer task");
        self.lost.abort();
        (released, at, n)
    }

    /// Ends a lease kept through a Sentinel failover: it must verify on the
    /// promoted primary, and is then released ([`Holder::release`]). A
    /// release the promoted primary refuses for now (it refuses writes while
    /// its replica is not linked) fails closed, the key expiring with its
    /// TTL: it is said on stderr and not failed. Whether the release was
    /// refused, the instant the lease ended here, and the writes made.
    pub(super) async fn release_kept(self, within: Duration) -> (bool, Instant, usize) {
        self.handle
            .verify()
            .await
            .expect("a kept lease verifies on the promoted primary");
        let (released, at, n) = self.release(within).await;
        let refused = match released {
            Ok(()) => false,
            Err(e) if refused_for_now(&e) => {
                eprintln!(
                    "a kept lease's release was refused for now ({e}); it expires with its TTL"
                );
                true
            }
            Err(e) => panic!("a kept lease releases: {e}"),
        };
        (refused, at, n)
    }

    /// Waits for the writer to stop (it stops at the first failed guard) and
    /// returns how many writes it made.
    pub(super) async fn writes(self, within: Duration) -> (LockGuard, usize) {
        let n = tokio::time::timeout(within, self.writer)
            .await
            .expect("the writer stops once the guard fails")
            .expect("writer task");
        self.lost.abort();
        (self.guard, n)
    }

    /// The writes of a holder whose lock went to `succ` (its writer stopped
    /// within `within`): the successor's token is newer, and the lost
    /// holder cannot release.
    pub(super) async fn superseded_by(self, succ: &LockGuard, within: Duration) -> usize {
        let token = succ.handle().fencing_token().expect("fenced");
        assert!(token > self.token, "the successor's token is newer");
        self.writes_after_loss(within).await.0
    }

    /// Waits for the writer of a holder that lost the lock to stop (as
    /// [`Holder::writes`]), then checks that its guard cannot release: the
    /// lock is gone, or someone else's. The writes made, and how long the
    /// refused release took.
    pub(super) async fn writes_after_loss(self, within: Duration) -> (usize, Duration) {
        let (old, writes) = self.writes(within).await;
        let release_at = Instant::now();
        assert!(
            old.release().await.is_err(),
            "the lost holder cannot release"
        );
        (writes, release_at.elapsed())
    }
}

async fn write_until_lost(handle: LeaseHandle, token: u64, resource: Arc<Resource>) -> usize {
    for n in 0..MAX_WRITES {
        // The deadline is read before the guard, so a write that slips past
        // it (the guard passing too late) is counted, not hidden.
        let deadline = handle.remaining_validity().map(|r| Instant::now() + r);
        if handle.assert_held().is_err() {
            return n;
        }
        resource.log.record(Instant::now(), deadline);
        resource.write(token);
        sleep(WRITE_EVERY).await;
    }
    MAX_WRITES
}
