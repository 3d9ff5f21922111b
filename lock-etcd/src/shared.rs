//! The shared leases: one etcd lease per whole-second TTL for every lock
//! this instance holds, the proof that it lives long enough for a new
//! acquire, the end of all its locks at once when it is lost, and the
//! releases that got no answer and must still be done.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use etcd_client::{Txn, TxnOp};
use lock_core::backend::LossFeed;
use lock_core::{BackendError, BackendErrorKind, LockName, LossReason, OwnerToken};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::connection::{secs, Inner};
use crate::error::convert;
use crate::holder::owner_compares;
use crate::lease::lease_seconds;
use crate::members::Attempt;

/// Most leases remembered as dead; past it the set starts over (a
/// forgotten dead lease is found dead again by its next keep-alive).
const MAX_DEAD: usize = 1024;

/// Most kept deletes one acquire or sweep retries.
const RETRIES_PER_CALL: usize = 64;

/// Most releases kept to retry; past it the oldest are left to their lease.
const MAX_PENDING: usize = 4096;

/// The answer of one keep-alive round: the TTL the lease got back (0: gone),
/// or the error's kind and text.
type RoundAnswer = Option<Result<i64, (BackendErrorKind, String)>>;

/// What an acquire learns of its shared lease from a keep-alive: the TTL
/// the lease got back (0: gone), and, when the keep-alive was sent before
/// the acquire started, how long after that start the lease lives at least.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proof {
    pub(crate) ttl: i64,
    pub(crate) lasts: Option<Duration>,
}

/// How much shorter than its TTL an acquire's lock may be, as a fraction
/// of the TTL: an answered keep-alive sent at most this long before the
/// acquire started proves the lease for it, with no keep-alive of its own.
/// Its first renewal then comes that much earlier (at most half of the
/// usual third of the TTL), so a renewal still has two thirds of the TTL.
const REUSE_DIVISOR: u32 = 6;

/// One keep-alive of a shared lease sent for acquires: when it was sent,
/// and its answer once it came.
struct Round {
    /// Unset while it waits for the member's keep-alive stream: any acquire
    /// may join it then, since it will be sent after that acquire started.
    sent_at: Arc<OnceLock<Instant>>,
    answer: watch::Receiver<RoundAnswer>,
    /// The member it went to, and its task while it may still run.
    member: usize,
    task: Option<JoinHandle<()>>,
}

/// A release that got no answer: the key may still be on a shared lease
/// that other locks keep alive, so it is deleted later.
#[derive(Debug, Clone)]
pub(crate) struct Pending {
    name: LockName,
    owner: OwnerToken,
    /// The shared lease the key was on.
    lease: i64,
    /// The lock's TTL: how long the key could have lived on its own lease.
    ttl: Duration,
    since: Instant,
}

/// The shared-lease state of one backend instance.
#[derive(Default)]
pub(crate) struct SharedLeases {
    /// Per whole-second TTL, the lease new acquires put their key on.
    current: Mutex<HashMap<i64, i64>>,
    /// Serialises grants, so concurrent first acquires share one lease.
    granting: tokio::sync::Mutex<()>,
    /// Per lease, the last keep-alive sent for acquires.
    rounds: Mutex<HashMap<i64, Round>>,
    /// Leases found lost or given up: never used or trusted again.
    dead: Mutex<HashSet<i64>>,
    /// Releases still to do.
    pending: Mutex<Vec<Pending>>,
    /// Where lost leases are reported to every `Locker` over this backend.
    pub(crate) feed: LossFeed,
}

/// Locks a map whose every critical section is one operation: a poisoned
/// one is still consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SharedLeases {
    /// State for a new backend, reporting losses through `feed`.
    pub(crate) fn new(feed: LossFeed) -> Self {
        Self {
            feed,
            ..Self::default()
        }
    }

    /// Whether `lease` is, or was, one of this instance's shared leases
    /// (so revoking it would end other locks, or it is dead anyway).
    pub(crate) fn is_shared(&self, lease: i64) -> bool {
        lock(&self.current).values().any(|l| *l == lease) || lock(&self.dead).contains(&lease)
    }

    pub(crate) fn is_dead(&self, lease: i64) -> bool {
        lock(&self.dead).contains(&lease)
    }

    /// The shared lease of `seconds`, if one is in use.
    fn current(&self, seconds: i64) -> Option<i64> {
        lock(&self.current).get(&seconds).copied()
    }

    /// Whether any release waits to be retried.
    pub(crate) fn has_pending(&self) -> bool {
        !lock(&self.pending).is_empty()
    }
}

impl Inner {
    /// The shared lease for `seconds`, granted on first use. Cancel safe:
    /// a grant whose answer is dropped leaves an unused lease that expires.
    pub(crate) async fn shared_lease(
        &self,
        at: &Attempt,
        seconds: i64,
    ) -> Result<i64, BackendError> {
        if let Some(id) = self.shared.current(seconds) {
            return Ok(id);
        }
        let _one = self.shared.granting.lock().await;
        if let Some(id) = self.shared.current(seconds) {
            return Ok(id);
        }
        let (id, granted) = self.leases.grant(at, seconds).await?;
        if granted != seconds {
            debug!(
                asked = seconds,
                granted, "etcd changed the shared lease TTL"
            );
        }
        lock(&self.shared.current).insert(seconds, id);
        debug!(lease = id, seconds, "granted a shared lease");
        Ok(id)
    }

    /// Proves how long `lease` lives on the server after `started`, for a
    /// lock of `ttl` on it. An answered keep-alive sent at most a sixth of
    /// `ttl` before `started` proves it at once, for less than `ttl`
    /// ([`Proof::lasts`]); otherwise the answer (its TTL, 0 if gone) of a
    /// keep-alive sent at or after `started` proves the whole TTL. Acquires
    /// that started before a round was sent share it, so concurrent
    /// acquires cost one keep-alive between them, and a steady stream of
    /// acquires one per sixth of the TTL.
    ///
    /// Cancel safe: the keep-alive runs in a task of its own, bounded by the
    /// request timeout, and other acquires may be waiting for it.
    pub(crate) async fn prove(
        &self,
        at: &Attempt,
        lease: i64,
        started: Instant,
        ttl: Duration,
    ) -> Result<Proof, BackendError> {
        if self.shared.is_dead(lease) {
            return Ok(Proof {
                ttl: 0,
                lasts: None,
            });
        }
        let mut answer = {
            let mut rounds = lock(&self.shared.rounds);
            let round = rounds.get(&lease);
            if let Some(proof) = round.and_then(|r| r.proves(started, ttl)) {
                return Ok(proof);
            }
            match round {
                Some(r) if r.sent_at.get().is_none_or(|at| *at >= started) => r.answer.clone(),
                _ => {
                    // A round stuck on another member (the call moved on from
                    // it) would hold the keep-alive stream until its timeout.
                    abort_elsewhere(&mut rounds, at.member);
                    let (tx, rx) = watch::channel(None);
                    let (leases, sent_to, limit) =
                        (Arc::clone(&self.leases), at.clone(), self.timeout);
                    let sent_at = Arc::new(OnceLock::new());
                    let marked = Arc::clone(&sent_at);
                    let task = tokio::spawn(async move {
                        let got = match tokio::time::timeout(
                            limit,
                            leases.keep_alive_marking(&sent_to, &[lease], &marked),
                        )
                        .await
                        {
                            Ok(Ok(ttls)) => Ok(ttls.first().copied().unwrap_or(0)),
                            Ok(Err(e)) => Err((e.kind(), e.to_string())),
                            Err(_) => Err((
                                BackendErrorKind::Timeout,
                                format!("lease keep-alive: no answer within {limit:?}"),
                            )),
                        };
                        let _ = tx.send(Some(got));
                    });
                    rounds.insert(
                        lease,
                        Round {
                            sent_at,
                            answer: rx.clone(),
                            member: at.member,
                            task: Some(task),
                        },
                    );
                    rx
                }
            }
        };
        let got = answer
            .wait_for(Option::is_some)
            .await
            .map_err(|_| BackendError::unavailable("lease keep-alive: abandoned"))?
            .clone();
        match got {
            Some(Ok(ttl)) => Ok(Proof { ttl, lasts: None }),
            Some(Err((kind, text))) => Err(BackendError::new(kind, text)),
            None => Err(BackendError::unavailable("lease keep-alive: no answer")),
        }
    }

    /// Records that a keep-alive of `lease` sent at `sent_at` answered `ttl`,
    /// so acquires that started before it need not send their own.
    pub(crate) fn note_kept_alive(&self, lease: i64, sent_at: Instant, ttl: i64) {
        let mut rounds = lock(&self.shared.rounds);
        if rounds
            .get(&lease)
            .is_some_and(|r| r.sent_at.get().is_none_or(|at| *at >= sent_at))
        {
            return;
        }
        let (_tx, rx) = watch::channel(Some(Ok(ttl)));
        rounds.insert(
            lease,
            Round {
                sent_at: Arc::new(OnceLock::from(sent_at)),
                answer: rx,
                member: usize::MAX,
                task: None,
            },
        );
    }

    /// Stops acquire keep-alives still waiting on a member other than
    /// `member`, before a call on `member` needs the keep-alive stream.
    pub(crate) fn abort_rounds_elsewhere(&self, member: usize) {
        abort_elsewhere(&mut lock(&self.shared.rounds), member);
    }

    /// The shared lease `lease` is gone on the server (keep-alive answered
    /// TTL 0 or "not found"), or given up here: every lock on it ended.
    /// Tells every `Locker` first, then lets the next acquire grant a new one.
    pub(crate) fn shared_lease_ended(&self, lease: i64) {
        if !self.shared.is_shared(lease) {
            return;
        }
        {
            let mut dead = lock(&self.shared.dead);
            if dead.len() >= MAX_DEAD {
                dead.clear();
            }
            dead.insert(lease);
        }
        let owners = self.forget_all_on(lease);
        let ended = self
            .shared
            .feed
            .leases_ended(owners.iter(), LossReason::Expired);
        lock(&self.shared.current).retain(|_, l| *l != lease);
        lock(&self.shared.rounds).remove(&lease);
        warn!(
            lease,
            locks = owners.len(),
            ended,
            "a shared lease ended: every lock on it is lost"
        );
    }

    /// Gives up the shared lease `lease`: ends its locks here (as
    /// [`Inner::shared_lease_ended`]), stops keeping it alive and revokes it,
    /// which frees every key on it at once if the server is reachable, and
    /// within its TTL otherwise.
    fn abandon(&self, lease: i64) {
        if !self.shared.is_shared(lease) {
            return;
        }
        self.shared_lease_ended(lease);
        self.revoke_in_background(lease);
    }

    /// Revokes `lease` unless other locks share it.
    pub(crate) fn revoke_if_own(&self, lease: i64) {
        if lease != 0 && !self.shared.is_shared(lease) {
            self.revoke_in_background(lease);
        }
    }

    /// Keeps `owner`'s key on `name` to delete later: a release (or an
    /// acquire that may have put it) got no answer. Only keys on a shared
    /// lease need it; a key on a lease of its own ends with that lease.
    pub(crate) fn delete_later(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        lease: i64,
        ttl: Duration,
    ) {
        let mut pending = lock(&self.shared.pending);
        if pending.iter().any(|p| p.name == *name && p.owner == *owner) {
            return;
        }
        if pending.len() >= MAX_PENDING {
            pending.remove(0);
        }
        pending.push(Pending {
            name: name.clone(),
            owner: *owner,
            lease,
            ttl,
            since: Instant::now(),
        });
    }

    /// After an acquire of `name` that ended in an error: its key may be on
    /// the shared lease of `ttl` (an attempt got no answer), so it is kept to
    /// delete (a compare-and-delete, harmless if there is no such key).
    pub(crate) fn acquire_failed(&self, name: &LockName, owner: &OwnerToken, ttl: Duration) {
        if let Some(lease) = self.shared.current(lease_seconds(ttl)) {
            self.delete_later(name, owner, lease, ttl);
        }
    }

    /// After a release of `name` that ended in an error: a key on a shared
    /// lease is kept to delete; one on a lease of its own goes with that lease.
    pub(crate) fn release_failed(&self, name: &LockName, owner: &OwnerToken) {
        let Some(held) = self.forget(name, owner) else {
            return;
        };
        if self.shared.is_shared(held.lease) {
            self.delete_later(name, owner, held.lease, secs(held.seconds));
        } else {
            self.revoke_in_background(held.lease);
        }
    }

    /// Drops what is kept to delete for `owner` on `name`: it holds the key
    /// again (an acquire took over what its unanswered attempt put).
    pub(crate) fn keep_key(&self, name: &LockName, owner: &OwnerToken) {
        lock(&self.shared.pending).retain(|p| !(p.name == *name && p.owner == *owner));
    }

    /// Retries the deletes kept by [`Inner::delete_later`], each a
    /// compare-and-delete on the owner token. A key that could not be
    /// deleted for a third of its TTL (one renewal interval) is freed by
    /// giving up its shared lease: the server then drops it, with the other
    /// locks on that lease (whose loss is reported first), within the
    /// lease's TTL. Cancel safe: what is not done stays kept.
    pub(crate) async fn retry_deletes(&self, at: &Attempt) {
        // The oldest first, a bounded number per call: after an outage
        // many failed acquires may be kept, most of which wrote nothing.
        let todo: Vec<Pending> = lock(&self.shared.pending)
            .iter()
            .take(RETRIES_PER_CALL)
            .cloned()
            .collect();
        let mut kv = at.client.kv_client();
        for p in todo {
            let key = self.key(&p.name);
            let txn = Txn::new()
                .when(owner_compares(&key, &p.owner))
                .and_then([TxnOp::delete(key.as_str(), None)]);
            let done = match kv.txn(txn).await {
                Ok(_) => true,
                Err(e) => {
                    let e = convert(&format!("delete {key} after an unanswered call"), e);
                    debug!(lock = %p.name, error = %e, "deleting a released key failed again");
                    if p.since.elapsed() >= p.ttl / 3 {
                        warn!(lock = %p.name, lease = p.lease, "a released key could not be deleted; giving up its shared lease");
                        self.abandon(p.lease);
                        true
                    } else {
                        false
                    }
                }
            };
            if done {
                lock(&self.shared.pending)
                    .retain(|q| !(q.name == p.name && q.owner == p.owner && q.since == p.since));
            }
        }
    }
}

impl Round {
    /// The proof this round gives an acquire that started at `started`,
    /// after the round was sent, for a lock of `ttl`: if it was answered
    /// with the lease alive and sent at most a sixth of `ttl` earlier.
    fn proves(&self, started: Instant, ttl: Duration) -> Option<Proof> {
        let sent_at = *self.sent_at.get()?;
        let answered = match *self.answer.borrow() {
            Some(Ok(answered)) if answered > 0 => answered,
            _ => return None,
        };
        let alive_until = sent_at.checked_add(secs(answered))?;
        let lasts = alive_until.checked_duration_since(started)?;
        (lasts >= ttl - ttl / REUSE_DIVISOR).then_some(Proof {
            ttl: answered,
            lasts: (lasts < ttl).then_some(lasts),
        })
    }
}

/// Aborts the unfinished rounds sent to members other than `member`; their
/// waiters get an error, and the keep-alive stream is free at once.
fn abort_elsewhere(rounds: &mut HashMap<i64, Round>, member: usize) {
    rounds.retain(|_, r| match &r.task {
        Some(task) if r.member != member && !task.is_finished() => {
            task.abort();
            false
        }
        _ => true,
    });
}
