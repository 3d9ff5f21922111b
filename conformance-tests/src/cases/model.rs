//! Random operation sequences against the backend agree with a small model.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome},
    LockBackend, LockName, OwnerToken,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tokio::time::Instant;

use crate::Ctx;

const REPLICAS: usize = 3;
const TTL: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone)]
enum Op {
    Acquire(usize),
    Renew(usize),
    Check(usize),
    Release(usize),
    Steal,
    Expire,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..REPLICAS).prop_map(Op::Acquire),
        2 => (0..REPLICAS).prop_map(Op::Renew),
        1 => (0..REPLICAS).prop_map(Op::Check),
        2 => (0..REPLICAS).prop_map(Op::Release),
        1 => Just(Op::Steal),
        1 => Just(Op::Expire),
        3 => (1u64..1500).prop_map(Op::Advance),
    ]
}

/// Who holds the lock in the model: a replica index or the saboteur, until when.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Owner {
    Replica(usize),
    Thief,
}

#[derive(Debug, Default)]
struct Model {
    holder: Option<(Owner, Instant)>,
}

impl Model {
    fn live(&mut self, now: Instant) -> Option<Owner> {
        match self.holder {
            Some((o, until)) if until > now => Some(o),
            _ => {
                self.holder = None;
                None
            }
        }
    }

    fn status(&mut self, r: usize, now: Instant) -> LeaseStatus {
        match self.live(now) {
            Some(Owner::Replica(h)) if h == r => LeaseStatus::Held,
            Some(_) => LeaseStatus::Stolen,
            None => LeaseStatus::Expired,
        }
    }
}

/// On a paused clock, random sequences of acquire / renew / check / release /
/// steal / expire / advance give the answers a one-variable model predicts,
/// and fencing tokens only grow.
pub(super) fn model_agrees(ctx: Ctx) {
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let seq = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&proptest::collection::vec(op(), 1..60), |ops| {
        let n = seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = ctx.name(&format!("model-{n}"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        rt.block_on(check_sequence(&ctx, &name, &ops))
    });
    if let Err(e) = result {
        panic!("backend and model disagree: {e}");
    }
}

async fn check_sequence(ctx: &Ctx, name: &LockName, ops: &[Op]) -> Result<(), TestCaseError> {
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    let mut replicas: Vec<Arc<dyn LockBackend>> = Vec::new();
    for _ in 0..REPLICAS {
        replicas.push(ctx.factory().replica().await.map_err(|e| fail(&e))?);
    }
    let saboteur = ctx.factory().saboteur().await.map_err(|e| fail(&e))?;
    let mut tokens: Vec<OwnerToken> = Vec::new();
    for _ in 0..REPLICAS {
        tokens.push(OwnerToken::generate().map_err(|e| fail(&e))?);
    }
    let mut model = Model::default();
    let mut last_fence = 0u64;
    for op in ops {
        let now = Instant::now();
        match *op {
            Op::Acquire(r) => {
                let fresh = OwnerToken::generate().map_err(|e| fail(&e))?;
                let got = replicas[r]
                    .try_acquire(name, &fresh, TTL)
                    .await
                    .map_err(|e| fail(&e))?;
                match (model.live(now), got) {
                    (None, AcquireAttempt::Acquired(lease)) => {
                        tokens[r] = fresh;
                        model.holder = Some((Owner::Replica(r), now + TTL));
                        let fence = lease.fencing_token.unwrap_or(last_fence + 1);
                        prop_assert!(
                            fence > last_fence,
                            "fencing token went from {} to {}",
                            last_fence,
                            fence
                        );
                        last_fence = fence;
                    }
                    (Some(_), AcquireAttempt::HeldElsewhere) => {}
                    (expected, got) => {
                        prop_assert!(false, "{op:?}: model holder {expected:?}, backend {got:?}")
                    }
                }
            }
            Op::Renew(r) => {
                let got = replicas[r]
                    .renew(name, &tokens[r], TTL)
                    .await
                    .map_err(|e| fail(&e))?;
                let want = model.status(r, now);
                prop_assert_eq!(got, want, "{:?}", op);
                if want == LeaseStatus::Held {
                    model.holder = Some((Owner::Replica(r), now + TTL));
                }
            }
            Op::Check(r) => {
                let got = replicas[r]
                    .check(name, &tokens[r])
                    .await
                    .map_err(|e| fail(&e))?;
                prop_assert_eq!(got, model.status(r, now), "{:?}", op);
            }
            Op::Release(r) => {
                let got = replicas[r]
                    .release(name, &tokens[r])
                    .await
                    .map_err(|e| fail(&e))?;
                let want = if model.status(r, now) == LeaseStatus::Held {
                    model.holder = None;
                    ReleaseOutcome::Released
                } else {
                    ReleaseOutcome::NotHeld
                };
                prop_assert_eq!(got, want, "{:?}", op);
            }
            Op::Steal => {
                let stolen = saboteur.steal(name, TTL).await.is_ok();
                prop_assert_eq!(stolen, model.live(now).is_some(), "steal");
                if stolen {
                    model.holder = Some((Owner::Thief, now + TTL));
                }
            }
            Op::Expire => {
                let expired = saboteur.expire(name).await.is_ok();
                prop_assert_eq!(expired, model.live(now).is_some(), "expire");
                model.holder = None;
            }
            Op::Advance(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
        }
    }
    let _ = saboteur.clear(name).await;
    Ok(())
}
