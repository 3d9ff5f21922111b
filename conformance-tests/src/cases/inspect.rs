//! Who holds a lock, and a forced release: what an operator sees and does,
//! on every backend.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use lock_core::backend::{AcquireAttempt, Expiry};
use lock_core::{Error, ForceOutcome, Holder, Identity, LockName, Locker, LossReason, OwnerToken};
use tokio::time::{sleep, timeout, Instant};

use super::{assert_between, hold_in_job};
use crate::Ctx;

/// How far a backend's clock and granularity may put `expires_at` past
/// the TTL asked for (Redis and etcd round to milliseconds or seconds;
/// the server's clock is not this process's).
const EXPIRY_SLACK: Duration = Duration::from_secs(2);

fn describe_err(e: Error) -> String {
    format!("describe failed: {e}")
}

/// What `locker` describes `name` as, which must be held; `when` names
/// the step in the failure.
async fn held_now(locker: &lock_core::Locker, name: &LockName, when: &str) -> Holder {
    match locker.describe(name).await {
        Ok(Some(h)) => h,
        Ok(None) => panic!("{when}: held, yet described as free"),
        Err(e) => panic!("{when}: {}", describe_err(e)),
    }
}

/// A held lock is described with its holder's identity, its token and an
/// expiry within the TTL; still so after a renewal; `None` once released,
/// and `None` once it expired.
pub(super) async fn describe_names_the_holder(ctx: Ctx) {
    let a = ctx.replica_as("inspect-a/1/00000001").await;
    let name = ctx.name("described");
    let timing = ctx.timing();
    let session = ctx.factory().capabilities().expiry == Expiry::Session;
    assert_eq!(
        a.locker.describe(&name).await.map_err(describe_err),
        Ok(None)
    );

    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("lock");
    let taken = SystemTime::now();
    let held = held_now(&a.locker, &name, "while held").await;
    check_holder(
        &held,
        &name,
        "inspect-a/1/00000001",
        guard.handle().fencing_token(),
    );
    if !session {
        expires_within(&held, taken, timing.ttl);
    }

    // Two renewals later the lock is still described, with its expiry moved on.
    sleep(ctx.opts().renew_interval() * 2 + timing.tolerance).await;
    guard.handle().assert_held().expect("still held");
    let renewed = held_now(&a.locker, &name, "after renewals").await;
    check_holder(
        &renewed,
        &name,
        "inspect-a/1/00000001",
        guard.handle().fencing_token(),
    );
    if let (Some(first), Some(later)) = (held.expires_at, renewed.expires_at) {
        if !timing.paused_clock {
            assert!(
                later > first,
                "a renewal moves the expiry on: {first:?} then {later:?}"
            );
        }
    }

    guard.release().await.expect("release");
    assert_eq!(
        a.locker.describe(&name).await.map_err(describe_err),
        Ok(None),
        "released, yet described as held"
    );

    // A lease that ends on the server (expiry, or its session's end) is
    // described as free.
    let owner = OwnerToken::generate().expect("token");
    let taken = a
        .backend
        .try_acquire_as(&name, &owner, timing.ttl, a.locker.identity())
        .await
        .expect("acquire");
    assert!(matches!(taken, AcquireAttempt::Acquired(_)), "{taken:?}");
    ctx.saboteur().await.expire(&name).await.expect("expire");
    let bound = timing.tolerance + Duration::from_secs(1);
    let deadline = Instant::now() + bound;
    loop {
        match a.locker.describe(&name).await.map_err(describe_err) {
            Ok(None) => break,
            Ok(Some(h)) if Instant::now() < deadline => {
                let _ = h;
                sleep(Duration::from_millis(20)).await;
            }
            other => panic!("expired, yet still described after {bound:?}: {other:?}"),
        }
    }
    let _ = a.backend.release(&name, &owner).await;
}

fn check_holder(h: &Holder, name: &LockName, identity: &str, token: Option<u64>) {
    assert_eq!(&h.name, name);
    assert_eq!(
        h.identity.as_ref().map(Identity::as_str),
        Some(identity),
        "the holder's identity"
    );
    if token.is_some() {
        assert_eq!(h.fencing_token, token, "the holder's fencing token");
    }
    if let (Some(acquired), Some(renewed)) = (h.acquired_at, h.renewed_at) {
        assert!(
            renewed >= acquired,
            "renewed {renewed:?} before acquired {acquired:?}"
        );
    }
}

fn expires_within(h: &Holder, taken: SystemTime, ttl: Duration) {
    let Some(at) = h.expires_at else {
        panic!("a TTL backend describes when the lease expires: {h:?}");
    };
    let low = taken.checked_sub(EXPIRY_SLACK).unwrap_or(taken);
    let high = taken + ttl + EXPIRY_SLACK;
    assert!(
        at >= low && at <= high,
        "expires_at {at:?} outside [{low:?}, {high:?}] for a TTL of {ttl:?}"
    );
}

/// How many locks the listing case holds: enough for many pages.
const LISTED: usize = 1_000;
/// The page size it asks for.
const PAGE: usize = 64;

/// A listing finds exactly the locks held under a prefix, each once, across
/// pages; not a lock under a sibling prefix, not a released one.
pub(super) async fn list_pages_through_held_locks(ctx: Ctx) {
    let a = ctx.replica_as("inspect-list/1/00000002").await;
    // Held through the `Locker`, renewed while the listing runs and
    // released at the end, as a service's locks are (a lease taken straight
    // on the backend with a long TTL would outlive the case: etcd keeps it
    // until that TTL, which the residue check counts).
    let opts = ctx.opts();
    let prefix = format!("{}/listed/", ctx.prefix());
    let mut held = BTreeSet::new();
    let mut guards = Vec::with_capacity(LISTED + 1);
    for i in 0..LISTED {
        let name = LockName::new(format!("{prefix}{i:04}")).expect("name");
        let guard = a.locker.try_lock(&name, &opts).await;
        guards.push(guard.unwrap_or_else(|e| panic!("taking {name}: {e}")));
        held.insert(name.as_str().to_owned());
    }
    // Neither of these may be listed.
    let sibling = LockName::new(format!("{}/listedx/0", ctx.prefix())).expect("name");
    guards.push(a.locker.try_lock(&sibling, &opts).await.expect("sibling"));
    let released = LockName::new(format!("{prefix}released")).expect("name");
    let guard = a.locker.try_lock(&released, &opts).await.expect("lock");
    guard.release().await.expect("release");

    let started = Instant::now();
    let mut seen = BTreeSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = timeout(
            Duration::from_secs(30),
            a.locker.list(&prefix, cursor.as_deref(), PAGE),
        )
        .await
        .expect("a page within 30 s")
        .unwrap_or_else(|e| panic!("list failed: {e}"));
        pages += 1;
        assert!(
            page.holders.len() <= PAGE,
            "a page of {} over {PAGE}",
            page.holders.len()
        );
        for h in page.holders {
            assert_eq!(
                h.identity.as_ref().map(Identity::as_str),
                Some("inspect-list/1/00000002")
            );
            assert!(
                seen.insert(h.name.as_str().to_owned()),
                "{} listed twice",
                h.name
            );
        }
        assert!(pages <= LISTED + 2, "the listing does not end");
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    eprintln!(
        "{}: listed {} locks in {pages} pages of up to {PAGE} in {:?}",
        ctx.factory().name(),
        seen.len(),
        started.elapsed()
    );
    let missing: Vec<_> = held.difference(&seen).take(5).collect();
    let extra: Vec<_> = seen.difference(&held).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    for guard in guards {
        guard.release().await.expect("release");
    }
}

async fn take(a: &crate::Replica, name: &LockName, owner: &OwnerToken, ttl: Duration) {
    match a
        .backend
        .try_acquire_as(name, owner, ttl, a.locker.identity())
        .await
    {
        Ok(AcquireAttempt::Acquired(_)) => {}
        other => panic!("taking {name}: {other:?}"),
    }
}

/// Describing and listing a lock many times neither extends nor frees it:
/// it is free again when its TTL runs out, and not before.
pub(super) async fn inspection_changes_nothing(ctx: Ctx) {
    let a = ctx.replica().await;
    let b = ctx.replica().await;
    let name = ctx.name("untouched");
    let timing = ctx.timing();
    let owner = OwnerToken::generate().expect("token");
    let taken_at = Instant::now();
    take(&a, &name, &owner, timing.ttl).await;
    let mut reads = 0;
    while taken_at.elapsed() < timing.ttl / 2 {
        let h = b.locker.describe(&name).await.map_err(describe_err);
        assert!(matches!(h, Ok(Some(_))), "held, yet described as {h:?}");
        let listed = list_whole(&b.locker, &format!("{}/", ctx.prefix()), 10).await;
        assert_eq!(listed.len(), 1, "{listed:?}");
        reads += 1;
        sleep(timing.ttl / 20).await;
    }
    assert!(reads >= 2, "only {reads} inspections ran");
    match b
        .backend
        .try_acquire(&name, &OwnerToken::generate().expect("token"), timing.ttl)
        .await
    {
        Ok(AcquireAttempt::HeldElsewhere) => {}
        other => panic!("inspections freed the lock: {other:?}"),
    }
    if ctx.factory().capabilities().expiry == Expiry::Ttl {
        // Taken again no later than its TTL after it was taken: no
        // inspection extended it.
        b.assert_free(
            "after its TTL",
            &name,
            &ctx,
            timing.ttl + timing.tolerance - taken_at.elapsed().min(timing.ttl),
        )
        .await;
    } else {
        // A session lease lives as long as its session: still held.
        assert!(matches!(
            a.backend.check(&name, &owner).await,
            Ok(lock_core::backend::LeaseStatus::Held)
        ));
    }
    let _ = a.backend.release(&name, &owner).await;
}

/// A forced release naming the holder's token frees the lock: the holder
/// learns it as `Forced` within one renewal interval, its job is aborted,
/// the loss is counted under `forced`, and a waiter gets the lock with a
/// higher token.
pub(super) async fn forced_release_ends_the_holders_run(ctx: Ctx) {
    let a = ctx.replica_as("inspect-holder/1/0000000a").await;
    let b = ctx.replica().await;
    let operator = ctx.replica().await;
    let name = ctx.name("forced");
    let timing = ctx.timing();
    let (lease, run) = hold_in_job(&a, &ctx, &name).await.expect("job started");
    let token = lease.fencing_token();
    let described = held_now(&operator.locker, &name, "before the forced release").await;
    let Some(expected) = described.fencing_token else {
        panic!("a forced release needs the holder's token; described as {described:?}");
    };
    if let Some(t) = token {
        assert_eq!(expected, t);
    }
    let waiter = {
        let (locker, name) = (b.locker.clone(), name.clone());
        let opts = ctx.opts().with_acquire_timeout(timing.ttl * 4);
        tokio::spawn(async move { locker.lock(&name, &opts).await })
    };
    let forced_at = Instant::now();
    let outcome = operator
        .locker
        .force_release(&name, expected)
        .await
        .unwrap_or_else(|e| panic!("force_release failed: {e}"));
    assert_eq!(outcome, ForceOutcome::Released);
    let reason = timeout(
        ctx.opts().renew_interval() * 2 + timing.tolerance,
        lease.lost(),
    )
    .await
    .expect("the holder learns of the forced release");
    let detected = forced_at.elapsed();
    eprintln!(
        "{}: forced release to the holder's loss in {detected:?} (renewal interval {:?})",
        ctx.factory().name(),
        ctx.opts().renew_interval()
    );
    assert_eq!(reason, LossReason::Forced);
    assert_between(
        "forced release detection",
        detected,
        Duration::ZERO,
        ctx.opts().renew_interval() + timing.tolerance,
    );
    match timeout(timing.ttl + timing.tolerance, run).await {
        Ok(Ok(lock_core::RunOutcome::Aborted(LossReason::Forced))) => {}
        other => panic!("expected the job Aborted(forced), got {other:?}"),
    }
    assert_eq!(a.metrics.losses(name.as_str(), LossReason::Forced), 1);
    let next = waiter
        .await
        .expect("waiter task")
        .unwrap_or_else(|e| panic!("the waiter did not get the lock: {e}"));
    if let (Some(old), Some(new)) = (token, next.handle().fencing_token()) {
        assert!(
            new > old,
            "the next holder's token {new} is not above {old}"
        );
    }
    next.release().await.expect("release");
}

/// A forced release naming another token, or a free lock, changes
/// nothing: the holder keeps its lock through renewals.
pub(super) async fn forced_release_with_a_stale_token_is_refused(ctx: Ctx) {
    let a = ctx.replica().await;
    let operator = ctx.replica().await;
    let name = ctx.name("kept");
    let free = ctx.name("free");
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("lock");
    let held = held_now(&operator.locker, &name, "before the forced release").await;
    let token = held.fencing_token.unwrap_or(0);
    let wrong = token.wrapping_add(1);
    assert_eq!(
        operator
            .locker
            .force_release(&name, wrong)
            .await
            .map_err(|e| e.to_string()),
        Ok(ForceOutcome::TokenMismatch {
            held: held.fencing_token
        })
    );
    assert_eq!(
        operator
            .locker
            .force_release(&free, token)
            .await
            .map_err(|e| e.to_string()),
        Ok(ForceOutcome::NotHeld)
    );
    sleep(ctx.opts().renew_interval() * 2 + ctx.timing().tolerance).await;
    guard
        .handle()
        .assert_held()
        .expect("the holder kept its lock");
    assert_eq!(a.metrics.losses(name.as_str(), LossReason::Forced), 0);
    guard.release().await.expect("release");
}

/// Prefixes no lock name can start with are refused before any backend
/// call, saying why.
pub(super) async fn inspection_refuses_bad_prefixes(ctx: Ctx) {
    let a = ctx.replica().await;
    for bad in ["jobs/*", "a?b", "[ab]", "line\nbreak", "{tag}"] {
        match a.locker.list(bad, None, 10).await {
            Err(Error::InvalidName { reason, .. }) => {
                assert!(reason.contains("prefix"), "{bad:?}: {reason}");
            }
            other => panic!("{bad:?} accepted: {other:?}"),
        }
    }
    let listed = list_whole(&a.locker, &format!("{}/none/", ctx.prefix()), 0).await;
    assert!(listed.is_empty(), "{listed:?}");
}

/// Every holder a whole listing of `prefix` finds, following its cursor to
/// the end: a page may come back short, even empty, with a cursor to go on
/// from (a Redis page scans a bounded share of the keyspace, and a server
/// shared with other programs may hold many keys no lock name matches).
async fn list_whole(locker: &Locker, prefix: &str, limit: usize) -> Vec<Holder> {
    /// Far more pages than any keyspace the suite meets needs (each scans
    /// thousands of keys), so that a cursor that never ends fails the case.
    const MAX_PAGES: usize = 10_000;
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let page = locker
            .list(prefix, cursor.as_deref(), limit)
            .await
            .unwrap_or_else(|e| panic!("list failed: {e}"));
        all.extend(page.holders);
        match page.next {
            None => return all,
            next => cursor = next,
        }
    }
    panic!("the listing of {prefix:?} did not end within {MAX_PAGES} pages");
}
