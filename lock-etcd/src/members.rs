//! The cluster's members: one etcd client per endpoint, and which member
//! each attempt of a call goes to.
//!
//! etcd-client's balanced channel is not used for this: it spreads calls
//! over every endpoint whose connection looks ready, and a frozen member's
//! (SIGSTOP, a stalled VM) still does, since the kernel keeps its sockets
//! open. Calls kept landing there and timing out (runs of four in a row were
//! seen), and holders whose keep-alive stream sat on it lost leases that the
//! two healthy members of three were keeping. So each member gets a client
//! of its own, calls stay on one member while it answers, and a member that
//! does not answer within its share of a call's time is passed over: at once
//! for the rest of that call, and for [`BENCH`] after it.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use lock_core::redact::redact_url;
use lock_core::{BackendError, BackendErrorKind};
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::error::{convert, unserved};

/// How long a member that failed a call is passed over when another one
/// can be tried: long enough that calls do not keep paying for a frozen
/// member, short enough that a healed one is back in the rotation soon.
pub(crate) const BENCH: Duration = Duration::from_secs(5);

/// Most attempts in one call. Beyond one per member, attempts repeat a
/// member only after it refused at once (a restarted member's channel may
/// refuse a call or two before it reconnects).
const MAX_ATTEMPTS: usize = 4;

/// The members of one cluster, as one backend instance reaches them.
pub(crate) struct Members {
    members: Vec<Member>,
    /// The member calls go to first while it answers.
    current: AtomicUsize,
    options: ConnectOptions,
}

struct Member {
    endpoint: String,
    shown: String,
    client: OnceCell<Client>,
    /// Until when this member is passed over, after it failed a call.
    benched_until: Mutex<Option<Instant>>,
}

/// One attempt of a call: the member it goes to and that member's client.
#[derive(Clone)]
pub(crate) struct Attempt {
    pub(crate) client: Client,
    /// The member's index: the keep-alive stream remembers where it runs.
    pub(crate) member: usize,
    /// Whether an earlier attempt of the same call failed after its request
    /// may have reached a member, so that it may have taken effect.
    pub(crate) after_unclear: bool,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: Vec<&str> = self.members.iter().map(|m| m.shown.as_str()).collect();
        f.debug_struct("Members")
            .field("endpoints", &shown)
            .finish()
    }
}

/// Whether an attempt that failed with `e` should go on at another member:
/// that member is unreachable, cut off, or did not answer in time. Answers
/// that say what is wrong with the request (auth, config, protocol) would
/// be the same anywhere.
fn passes_over(e: &BackendError) -> bool {
    matches!(
        e.kind(),
        BackendErrorKind::Unavailable | BackendErrorKind::Timeout
    )
}

impl Members {
    /// Members for `endpoints` (URLs with their scheme), not contacted yet:
    /// each connects (and authenticates) on its first attempt.
    pub(crate) fn new(endpoints: &[String], options: ConnectOptions) -> Self {
        let members: Vec<Member> = endpoints
            .iter()
            .map(|e| Member {
                endpoint: e.clone(),
                shown: redact_url(e),
                client: OnceCell::new(),
                benched_until: Mutex::new(None),
            })
            .collect();
        // Start at a random member, so that many processes spread out.
        let start = RandomState::new().hash_one(0u8) as usize % members.len().max(1);
        Self {
            members,
            current: AtomicUsize::new(start),
            options,
        }
    }

    fn benched_until(&self, i: usize) -> Option<Instant> {
        // One read or write per critical section: a poisoned slot is consistent.
        *self.members[i]
            .benched_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn bench(&self, i: usize, why: &dyn std::fmt::Display) {
        let now = Instant::now();
        let until = now.checked_add(BENCH).unwrap_or(now);
        let was = self.members[i]
            .benched_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(until);
        if was.is_none_or(|w| w <= now) && self.members.len() > 1 {
            warn!(member = %self.members[i].shown, reason = %why,
                "etcd member passed over for {BENCH:?}; calls go to the others");
        }
    }

    fn unbench(&self, i: usize) {
        *self.members[i]
            .benched_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The member the next attempt goes to: the current one unless it is
    /// passed over, else the next one in order that is not; among members
    /// all passed over, the one passed over longest ago. Members this call
    /// tried already come last, and only if `repeat` allows.
    fn pick(&self, tried: &[bool], repeat: bool) -> Option<usize> {
        let n = self.members.len();
        let start = self.current.load(Ordering::Relaxed);
        let now = Instant::now();
        let order = (0..n).map(|k| (start + k) % n);
        let fresh = order.clone().filter(|i| !tried[*i]);
        if let Some(i) = fresh
            .clone()
            .find(|i| self.benched_until(*i).is_none_or(|u| u <= now))
        {
            return Some(i);
        }
        if let Some(i) = fresh.min_by_key(|i| self.benched_until(*i)) {
            return Some(i);
        }
        repeat
            .then(|| order.min_by_key(|i| self.benched_until(*i)))
            .flatten()
    }

    async fn client(&self, i: usize) -> Result<Client, BackendError> {
        let member = &self.members[i];
        member
            .client
            .get_or_try_init(|| async {
                Client::connect([member.endpoint.as_str()], Some(self.options.clone()))
                    .await
                    .map_err(|e| convert(&format!("connect to {}", member.shown), e))
            })
            .await
            .cloned()
    }

    /// Runs `attempt` against one member after another until one answers,
    /// all within `limit`.
    ///
    /// While another member is left to try, an attempt gets half of `limit`
    /// (and never more than is left): a member that does not answer by then
    /// is passed over and the call goes on at the next member with the time
    /// that is left. An attempt that fails as unreachable or cut off moves
    /// on the same way. Any other error ends the call. When no member
    /// answers in time the call fails closed with a timeout.
    ///
    /// Cancel safe: a dropped call drops its attempt's request.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        limit: Duration,
        op: &str,
        mut attempt: F,
    ) -> Result<T, BackendError>
    where
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, BackendError>>,
    {
        let n = self.members.len();
        let start = Instant::now();
        let end = start.checked_add(limit);
        let share = if n > 1 { limit / 2 } else { limit };
        let mut tried = vec![false; n];
        let (mut after_unclear, mut repeat) = (false, true);
        let mut last: Option<BackendError> = None;
        for _ in 0..MAX_ATTEMPTS.max(n) {
            let left = end.map_or(Duration::MAX, |e| {
                e.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                break;
            }
            let Some(i) = self.pick(&tried, repeat) else {
                break;
            };
            tried[i] = true;
            let others_left = tried.iter().any(|t| !t);
            let bound = if others_left { share.min(left) } else { left };
            let run = async {
                let client = self.client(i).await?;
                attempt(Attempt {
                    client,
                    member: i,
                    after_unclear,
                })
                .await
            };
            let error = match tokio::time::timeout(bound, run).await {
                Ok(Ok(value)) => {
                    self.current.store(i, Ordering::Relaxed);
                    self.unbench(i);
                    return Ok(value);
                }
                Ok(Err(e)) if passes_over(&e) => {
                    let refused = unserved(&e);
                    after_unclear |= !refused;
                    repeat = refused;
                    e
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    after_unclear = true;
                    repeat = false;
                    BackendError::timeout(format!(
                        "{op}: etcd member {} did not answer within {bound:?}",
                        self.members[i].shown
                    ))
                }
            };
            debug!(op, member = %self.members[i].shown, error = %error, "attempt failed");
            self.bench(i, &error);
            last = Some(error);
        }
        let waited = start.elapsed();
        Err(match last {
            Some(e) if waited < limit => e,
            _ => BackendError::timeout(format!(
                "{op}: no etcd member answered within {limit:?}; the call fails closed"
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three members that are never contacted: without credentials a
    /// client connects on its first request, and these attempts send none.
    fn three() -> Members {
        let endpoints: Vec<String> = (1..=3).map(|p| format!("http://127.0.0.1:{p}")).collect();
        Members::new(&endpoints, ConnectOptions::new())
    }

    /// An attempt that hangs on `frozen`, as a call to a SIGSTOPped member
    /// does, and answers with the member's index elsewhere.
    async fn answer_unless(at: Attempt, frozen: usize) -> Result<usize, BackendError> {
        if at.member == frozen {
            std::future::pending::<()>().await;
        }
        Ok(at.member)
    }

    #[tokio::test(start_paused = true)]
    async fn a_frozen_member_costs_one_share_of_one_call_then_is_passed_over() {
        let members = three();
        members.current.store(1, Ordering::Relaxed);
        let limit = Duration::from_secs(1);
        let started = Instant::now();
        let first = members.run(limit, "op", |at| answer_unless(at, 1)).await;
        assert_eq!(first.expect("another member answers"), 2);
        assert_eq!(started.elapsed(), limit / 2, "the frozen member got half");
        for _ in 0..20 {
            let at = Instant::now();
            let next = members.run(limit, "op", |at| answer_unless(at, 1)).await;
            assert_eq!(
                next.expect("answers"),
                2,
                "calls stay on the healthy member"
            );
            assert_eq!(
                at.elapsed(),
                Duration::ZERO,
                "no call waits on the frozen one"
            );
        }
        // The healthy current member fails: the frozen one is still benched,
        // so member 0 is tried before it.
        let moved = members.run(limit, "op", |at| async move {
            match at.member {
                2 => Err(BackendError::unavailable("refused")),
                m => answer_unless(at, 1).await.map(|_| m),
            }
        });
        assert_eq!(moved.await.expect("member 0 answers"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_member_answering_fails_closed_within_the_limit() {
        let members = three();
        let limit = Duration::from_millis(900);
        let started = Instant::now();
        let e = members
            .run(limit, "op", |_| std::future::pending::<Result<(), _>>())
            .await
            .expect_err("nobody answers");
        assert_eq!(e.kind(), BackendErrorKind::Timeout, "{e}");
        assert_eq!(started.elapsed(), limit);
        // Errors that name the request end the call at the first member.
        let mut calls = 0;
        let e = members
            .run(limit, "op", |_| {
                calls += 1;
                async { Err::<(), _>(BackendError::new(BackendErrorKind::Auth, "denied")) }
            })
            .await
            .expect_err("refused credentials");
        assert_eq!((e.kind(), calls), (BackendErrorKind::Auth, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn extreme_limits_do_not_overflow() {
        let members = three();
        let got = members
            .run(Duration::MAX, "op", |at| answer_unless(at, 9))
            .await;
        assert!(got.is_ok());
    }
}
