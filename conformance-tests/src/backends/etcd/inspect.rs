//! Who holds it, on etcd (`etcd::inspect_*` on a private server and
//! `etcd_cluster::inspect_*` on a private 3-member cluster): `describe`
//! against what the holder knows while held, after a renewal, after a
//! release and after an expiry; a key a stock client put; `list` across
//! pages of 1,000 locks; inspections that change nothing on the server; and
//! a forced release that its holder reports as `forced` within one renewal
//! interval while its other lock on the same shared lease stays held.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use etcd_client::{Client, GetOptions, Permission};
use libtest_mimic::{Failed, Trial};
use lock_core::backend::{AcquireAttempt, LeaseStatus, RenewRequest};
use lock_core::{
    BackendErrorKind, Error, ForceOutcome, Identity, LockBackend, LockMetrics, LockName, Locker,
    LossReason, OwnerToken, RunOutcome,
};
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Instant};

use super::specific::{ensure, BoxedCase};
use super::{server, EtcdClusterFactory, EtcdFactory, EtcdSaboteur};
use crate::harness::which;
use crate::{BackendFactory, Ctx, Suite};

/// Longest one inspection trial may run.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(170);

/// Locks held at once by the listing case.
const MANY: usize = 1_000;

/// Forced releases measured per row.
const ROUNDS: usize = 5;

/// etcd reports a lease's remaining TTL in whole seconds, rounded down.
const GRANULARITY: Duration = Duration::from_secs(1);

type Case = fn(Ctx, Vec<String>) -> BoxedCase;

const CASES: &[(&str, Case)] = &crate::trial_table![(c, e) as Case;
    "inspect_describe_follows_the_holder" => describe_follows_the_holder,
    "inspect_stock_client_key_is_held_by_unknown" => stock_client_key_is_held_by_unknown,
    "inspect_list_pages_through_1000_locks" => list_pages_through_many_locks,
    "inspect_changes_nothing" => inspection_changes_nothing,
    "inspect_force_release_is_reported_forced" => force_release_is_reported_forced,
    "inspect_forced_in_check_renew_and_batch" => forced_in_check_renew_and_batch,
];

/// Adds the cases on the single-server row, over `factory` (shared with the
/// other etcd-specific trials).
pub(super) fn add_single(suite: &mut Suite, factory: &Arc<EtcdFactory>) {
    let run_id = suite.run_id().to_owned();
    for (name, body) in CASES {
        let (factory, body) = (Arc::clone(factory), *body);
        let ctx = Ctx::new(
            Arc::clone(&factory) as Arc<dyn BackendFactory>,
            &run_id,
            name,
        );
        suite.push(Trial::test(format!("etcd::{name}"), move || {
            let endpoints = factory.endpoints().map_err(|e| e.to_string())?;
            run(body(ctx, endpoints))
        }));
    }
    let ctx = Ctx::new(
        Arc::clone(factory) as Arc<dyn BackendFactory>,
        &run_id,
        "inspect_rbac",
    );
    suite.push(Trial::test(
        "etcd::inspect_read_only_role_inspects_but_cannot_force",
        move || run(Box::pin(read_only_role_inspects_but_cannot_force(ctx))),
    ));
}

/// Adds the cases on the 3-member cluster row, over one private cluster
/// started by the first of them that runs.
pub(super) fn add_cluster(suite: &mut Suite) {
    if which("etcd").is_none() {
        return;
    }
    let run_id = suite.run_id().to_owned();
    let factory = Arc::new(EtcdClusterFactory::default());
    for (name, body) in CASES {
        let (factory, body) = (Arc::clone(&factory), *body);
        let ctx = Ctx::new(
            Arc::clone(&factory) as Arc<dyn BackendFactory>,
            &run_id,
            name,
        );
        suite.push(Trial::test(format!("etcd_cluster::{name}"), move || {
            let endpoints = factory.cluster().map_err(|e| e.to_string())?.endpoints();
            run(body(ctx, endpoints))
        }));
    }
}

/// Runs one trial's body under the trial timeout.
fn run(body: BoxedCase) -> Result<(), Failed> {
    crate::harness::run_bounded(body, TRIAL_TIMEOUT)
}

/// A `Locker` over a new connection of the case's row that names itself
/// `identity`, with its own metrics.
async fn named_locker(ctx: &Ctx, identity: &str) -> Result<(Locker, Arc<dyn LockBackend>), Failed> {
    let backend = ctx.replica().await.backend;
    let locker = Locker::builder()
        .with_backend_arc(Arc::clone(&backend))
        .with_metrics(LockMetrics::register(
            &lock_core::prometheus::Registry::new(),
        )?)
        .with_identity(Identity::new(identity)?)
        .build()?;
    Ok((locker, backend))
}

/// `|a - b| <= slack`, for times.
fn near(a: SystemTime, b: SystemTime, slack: Duration) -> bool {
    match a.duration_since(b) {
        Ok(d) => d <= slack,
        Err(e) => e.duration() <= slack,
    }
}

fn key(name: &LockName) -> String {
    format!("{}{}", lock_etcd::DEFAULT_PREFIX, name.as_str())
}

/// While held, `describe` (from another connection) names the holder's
/// identity and token and an expiry one TTL after the last renewal, within
/// etcd's one-second granularity; after a renewal the expiry has moved on;
/// after the release, and after a lock left unrenewed expires, it answers
/// none.
async fn describe_follows_the_holder(ctx: Ctx, _endpoints: Vec<String>) -> Result<(), Failed> {
    let tol = ctx.timing().tolerance;
    let ttl = ctx.timing().ttl;
    let identity = format!("inspect-test/{}/holder", std::process::id());
    let (holder, _) = named_locker(&ctx, &identity).await?;
    let inspector = ctx.replica().await.locker;
    let name = ctx.name("described");
    ensure(inspector.describe(&name).await?.is_none(), || {
        "a free lock was described as held".into()
    })?;

    let before = SystemTime::now();
    let guard = holder.try_lock(&name, &ctx.opts()).await?;
    let taken = SystemTime::now();
    let seen = inspector
        .describe(&name)
        .await?
        .ok_or("a held lock was described as free")?;
    ensure(seen.name == name, || format!("described {}", seen.name))?;
    ensure(
        seen.identity.as_ref().map(Identity::as_str) == Some(identity.as_str()),
        || format!("identity {:?}, not {identity}", seen.identity),
    )?;
    ensure(seen.fencing_token == guard.fencing_token(), || {
        format!(
            "token {:?}, the holder has {:?}",
            seen.fencing_token,
            guard.fencing_token()
        )
    })?;
    let acquired = seen.acquired_at.ok_or("no acquire time")?;
    ensure(
        acquired >= before - Duration::from_millis(5) && acquired <= taken,
        || format!("acquired at {acquired:?}, taken between {before:?} and {taken:?}"),
    )?;
    let expires = seen.expires_at.ok_or("no expiry")?;
    ensure(near(expires, taken + ttl, GRANULARITY + tol), || {
        format!(
            "expires {:?} after the acquire, TTL {ttl:?}",
            expires.duration_since(taken)
        )
    })?;

    // Past two renewals (TTL / 3 each): the lease was kept alive.
    sleep(ctx.opts().renew_interval() * 2 + tol).await;
    ensure(guard.handle().is_held(), || {
        "the holder lost its lock".into()
    })?;
    let now = SystemTime::now();
    let renewed = inspector
        .describe(&name)
        .await?
        .ok_or("a renewed lock was described as free")?;
    let later = renewed.expires_at.ok_or("no expiry after the renewal")?;
    ensure(later > expires, || {
        "the expiry did not move with the renewals".into()
    })?;
    // The last renewal came within one interval: the server keeps the lock
    // between TTL - interval and TTL from now.
    let slack = ctx.opts().renew_interval() + GRANULARITY + tol;
    ensure(near(later, now + ttl, slack), || {
        format!(
            "after a renewal it expires {:?} from now",
            later.duration_since(now)
        )
    })?;
    ensure(renewed.renewed_at.is_some_and(|r| r > acquired), || {
        format!(
            "renewed at {:?}, acquired at {acquired:?}",
            renewed.renewed_at
        )
    })?;
    ensure(renewed.fencing_token == guard.fencing_token(), || {
        "the token changed with a renewal".into()
    })?;
    ensure(renewed.identity == seen.identity, || {
        "the identity changed with a renewal".into()
    })?;

    guard.release().await?;
    ensure(inspector.describe(&name).await?.is_none(), || {
        "a released lock was described as held".into()
    })?;

    // Taken on a connection of its own and never renewed: gone after its TTL.
    let abandoned = ctx.name("abandoned");
    let raw = ctx.replica().await.backend;
    let who = Identity::new("inspect-test/abandoned")?;
    let got = raw
        .try_acquire_as(&abandoned, &OwnerToken::generate()?, ttl, &who)
        .await?;
    ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
        format!("abandoned lock: {got:?}")
    })?;
    let taken = Instant::now();
    let seen = inspector.describe(&abandoned).await?;
    ensure(
        seen.as_ref().and_then(|h| h.identity.clone()) == Some(who),
        || format!("the abandoned lock was described as {seen:?}"),
    )?;
    let gone = loop {
        if inspector.describe(&abandoned).await?.is_none() {
            break taken.elapsed();
        }
        if taken.elapsed() > ttl + GRANULARITY + tol * 2 {
            return Err("an expired lock was still described as held".into());
        }
        sleep(Duration::from_millis(100)).await;
    };
    ensure(gone >= ttl - tol, || {
        format!("described as free {gone:?} after an acquire of TTL {ttl:?}")
    })?;
    Ok(())
}

/// A key put by a stock client (etcdctl when on `PATH`) shows as held with no
/// identity, its create revision as the token and no expiry (no lease);
/// `list` shows it; the `Locker` cannot take it; a forced release with its
/// token frees it.
async fn stock_client_key_is_held_by_unknown(
    ctx: Ctx,
    endpoints: Vec<String>,
) -> Result<(), Failed> {
    let inspector = ctx.replica().await.locker;
    let name = ctx.name("stock");
    let key = key(&name);
    let sab = EtcdSaboteur::connect_default(&endpoints).await?;
    let mut kv = sab.client().kv_client();
    if which("etcdctl").is_some() {
        let out = tokio::process::Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")))
            .args(["put", key.as_str(), "x"])
            .output()
            .await?;
        ensure(out.status.success(), || {
            format!("etcdctl put: {}", String::from_utf8_lossy(&out.stderr))
        })?;
    } else {
        kv.put(key.as_str(), "x", None).await?;
    }
    let stored = kv.get(key.as_str(), None).await?;
    let created = stored
        .kvs()
        .first()
        .map(|kv| kv.create_revision())
        .ok_or("the stock put left no key")?;
    let seen = inspector
        .describe(&name)
        .await?
        .ok_or("a stock client's key was described as free")?;
    ensure(seen.identity.is_none(), || {
        format!("a stock key named {:?}", seen.identity)
    })?;
    ensure(seen.fencing_token == u64::try_from(created).ok(), || {
        format!("token {:?}, create revision {created}", seen.fencing_token)
    })?;
    ensure(
        seen.expires_at.is_none() && seen.acquired_at.is_none(),
        || format!("a key without a lease described as {seen:?}"),
    )?;
    let page = inspector.list(ctx.prefix(), None, 10).await?;
    ensure(
        page.holders
            .iter()
            .any(|h| h.name == name && h.identity.is_none()),
        || format!("list under {} missed the stock key: {page:?}", ctx.prefix()),
    )?;
    match inspector.try_lock(&name, &ctx.opts()).await {
        Err(Error::HeldElsewhere { .. }) => {}
        other => return Err(format!("a stock key's name could be taken: {other:?}").into()),
    }
    let token = seen.fencing_token.ok_or("no token")?;
    let outcome = inspector.force_release(&name, token).await?;
    ensure(outcome == ForceOutcome::Released, || {
        format!("forcing the stock key: {outcome:?}")
    })?;
    ensure(inspector.describe(&name).await?.is_none(), || {
        "a force-released stock key is still described".into()
    })?;
    let marks = kv
        .get(
            format!("{}#forced/{}", lock_etcd::DEFAULT_PREFIX, name.as_str()),
            Some(GetOptions::new().with_count_only()),
        )
        .await?
        .count();
    ensure(marks == 0, || {
        "a mark was left for a holder that cannot read it".into()
    })?;
    Ok(())
}

/// `list` under a prefix finds exactly the 1,000 held locks across pages
/// of several sizes, with their identities and tokens, and not a released
/// lock, a lock outside the prefix, the tick store's keys or the mark of a
/// forced release; a bad cursor is refused by name. Prints the time of a
/// whole listing.
async fn list_pages_through_many_locks(ctx: Ctx, endpoints: Vec<String>) -> Result<(), Failed> {
    let identity = format!("inspect-test/{}/many", std::process::id());
    let (holder, _) = named_locker(&ctx, &identity).await?;
    let inspector = ctx.replica().await.locker;
    let opts = ctx.opts();
    let prefix = format!("{}/many/", ctx.prefix());
    let mut guards = BTreeMap::new();
    let mut taking = JoinSet::new();
    let taken_at = Instant::now();
    for i in 0..MANY {
        let (holder, opts) = (holder.clone(), opts.clone());
        let name = LockName::new(format!("{prefix}{i:04}"))?;
        taking.spawn(async move {
            let guard = holder.try_lock(&name, &opts).await;
            (name, guard)
        });
        if taking.len() >= 64 {
            if let Some(done) = taking.join_next().await {
                let (name, guard) = done?;
                guards.insert(name, guard?);
            }
        }
    }
    while let Some(done) = taking.join_next().await {
        let (name, guard) = done?;
        guards.insert(name, guard?);
    }
    eprintln!(
        "{}: took {MANY} locks in {:?}",
        ctx.factory().name(),
        taken_at.elapsed()
    );
    // Near misses: released, and outside the prefix.
    let released = LockName::new(format!("{prefix}released"))?;
    holder.try_lock(&released, &opts).await?.release().await?;
    let outside = LockName::new(format!("{}/many-not/0", ctx.prefix()))?;
    let outside_guard = holder.try_lock(&outside, &opts).await?;
    // The mark of a forced release under the prefix is no lock.
    let forced = LockName::new(format!("{prefix}forced"))?;
    let forced_guard = holder.try_lock(&forced, &opts).await?;
    let token = forced_guard.fencing_token().ok_or("no token")?;
    ensure(
        inspector.force_release(&forced, token).await? == ForceOutcome::Released,
        || "the forced release under the prefix failed".into(),
    )?;
    let sab = EtcdSaboteur::connect_default(&endpoints).await?;
    let marks = sab
        .client()
        .kv_client()
        .get(
            format!("{}#forced/{}", lock_etcd::DEFAULT_PREFIX, forced.as_str()),
            Some(GetOptions::new().with_count_only()),
        )
        .await?
        .count();
    ensure(marks == 1, || {
        format!("{marks} marks of the forced release")
    })?;

    let want: BTreeMap<String, Option<u64>> = guards
        .iter()
        .map(|(n, g)| (n.as_str().to_owned(), g.fencing_token()))
        .collect();
    for limit in [1_000, 333, 100] {
        let started = Instant::now();
        let (mut seen, mut cursor, mut pages) = (BTreeMap::new(), None::<String>, 0);
        loop {
            let page = inspector.list(&prefix, cursor.as_deref(), limit).await?;
            pages += 1;
            ensure(page.holders.len() <= limit, || {
                format!("a page of {} for a limit of {limit}", page.holders.len())
            })?;
            for h in page.holders {
                ensure(
                    h.identity.as_ref().map(Identity::as_str) == Some(identity.as_str()),
                    || format!("{} listed with identity {:?}", h.name, h.identity),
                )?;
                ensure(h.expires_at.is_some(), || {
                    format!("{} without expiry", h.name)
                })?;
                let again = seen.insert(h.name.as_str().to_owned(), h.fencing_token);
                ensure(again.is_none(), || format!("{} listed twice", h.name))?;
            }
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
            ensure(pages <= MANY / limit + 2, || {
                format!("more than {} pages of {limit}", MANY / limit + 2)
            })?;
        }
        if seen != want {
            let extra: Vec<_> = seen.keys().filter(|k| !want.contains_key(*k)).collect();
            let missing: Vec<_> = want.keys().filter(|k| !seen.contains_key(*k)).collect();
            return Err(format!(
                "pages of {limit}: {} listed, {} held; extra {extra:?}; missing {} (first {:?}); or tokens differ",
                seen.len(),
                want.len(),
                missing.len(),
                missing.first()
            )
            .into());
        }
        eprintln!(
            "{}: listed {MANY} locks in {pages} pages of {limit} in {:?}",
            ctx.factory().name(),
            started.elapsed()
        );
    }
    // Every lock of the server, from the start: ours are among them and no
    // `#` key is.
    let (mut ours, mut cursor) = (BTreeSet::new(), None::<String>);
    for _ in 0..1_000 {
        let page = inspector.list("", cursor.as_deref(), 1_000).await?;
        for h in &page.holders {
            if h.name.as_str().starts_with(&prefix) {
                ours.insert(h.name.as_str().to_owned());
            }
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    ensure(ours.len() == MANY, || {
        format!("the whole listing found {} of our {MANY}", ours.len())
    })?;
    match inspector.list(&prefix, Some("not a cursor"), 10).await {
        Err(e) if e.to_string().contains("cursor") => {}
        other => return Err(format!("a bad cursor gave {other:?}").into()),
    }
    match inspector.list("many*", None, 10).await {
        Err(Error::InvalidName { .. }) => {}
        other => return Err(format!("a wildcard prefix gave {other:?}").into()),
    }

    let mut releasing = JoinSet::new();
    for (_, guard) in guards {
        releasing.spawn(guard.release());
        if releasing.len() >= 64 {
            if let Some(done) = releasing.join_next().await {
                done??;
            }
        }
    }
    while let Some(done) = releasing.join_next().await {
        done??;
    }
    outside_guard.release().await?;
    let _ = forced_guard.release().await;
    let left = inspector.list(&prefix, None, 10).await?;
    ensure(left.holders.is_empty() && left.next.is_none(), || {
        format!("after the releases: {left:?}")
    })?;
    Ok(())
}

/// `describe` and `list` change nothing: the lock key's revisions and
/// lease are the same before and after, no watch event fires, and the
/// lease's remaining TTL only runs down (no keep-alive). The lock is taken
/// by a bare backend that never renews, so nothing else touches it.
async fn inspection_changes_nothing(ctx: Ctx, endpoints: Vec<String>) -> Result<(), Failed> {
    let inspector = ctx.replica().await.locker;
    let name = ctx.name("untouched");
    let raw = ctx.replica().await.backend;
    let ttl = Duration::from_secs(4);
    let owner = OwnerToken::generate()?;
    let got = raw
        .try_acquire_as(
            &name,
            &owner,
            ttl,
            &Identity::new("inspect-test/untouched")?,
        )
        .await?;
    ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
        format!("acquire: {got:?}")
    })?;
    let sab = EtcdSaboteur::connect_default(&endpoints).await?;
    let client = sab.client();
    let the_key = key(&name);
    let read = |client: Client| {
        let the_key = the_key.clone();
        async move {
            let c = client;
            let resp = c.kv_client().get(the_key, None).await?;
            let kv = resp.kvs().first().cloned().ok_or("the key is gone")?;
            let ttl = c.lease_client().time_to_live(kv.lease(), None).await?;
            Ok::<_, Failed>((
                kv.create_revision(),
                kv.mod_revision(),
                kv.version(),
                kv.lease(),
                ttl.ttl(),
                ttl.granted_ttl(),
            ))
        }
    };
    sleep(Duration::from_millis(1_200)).await;
    let mut events = sab.watch_changes(&name).await?;
    let before = read(client.clone()).await?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1_200) {
        inspector
            .describe(&name)
            .await?
            .ok_or("described as free")?;
        inspector.list(ctx.prefix(), None, 10).await?;
    }
    let after = read(client.clone()).await?;
    let (kept, now) = (
        (before.0, before.1, before.2, before.3),
        (after.0, after.1, after.2, after.3),
    );
    ensure(kept == now, || {
        format!("(create, mod, version, lease) went from {before:?} to {after:?}")
    })?;
    // Without a keep-alive the TTL only runs down: 4 s granted, read
    // about 1.2 s and 2.4 s in.
    ensure(after.4 <= before.4 && after.4 < after.5 - 1, || {
        format!(
            "the lease's TTL went from {} to {} of {} s: kept alive by an inspection",
            before.4, after.4, after.5
        )
    })?;
    ensure(events.try_recv().is_err(), || {
        "an inspection changed the key".into()
    })?;
    let _ = raw.release(&name, &owner).await?;
    Ok(())
}

/// A forced release with a wrong token is refused and changes nothing;
/// with the right one the holder's `lost()` resolves as `forced` within one
/// renewal interval (measured), its `with_lock` job is aborted, the loss
/// is counted under `forced`, a waiter gets the lock with a higher token,
/// and the holder's other lock, on the same shared lease, stays held.
async fn force_release_is_reported_forced(ctx: Ctx, endpoints: Vec<String>) -> Result<(), Failed> {
    let tol = ctx.timing().tolerance;
    let opts = ctx.opts();
    let bound = opts.renew_interval() + tol;
    let (holder, _) = named_locker(&ctx, "inspect-test/forced-holder").await?;
    let waiter = ctx.replica().await.locker;
    let inspector = ctx.replica().await.locker;
    let sab = EtcdSaboteur::connect_default(&endpoints).await?;
    let other = ctx.name("forced-neighbour");
    let neighbour = holder.try_lock(&other, &opts).await?;
    let neighbour_lease = sab.lease_of(&other).await?.ok_or("no neighbour key")?;
    let mut took = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        let name = ctx.name(&format!("forced-{round}"));
        ensure(
            inspector.force_release(&name, 1).await? == ForceOutcome::NotHeld,
            || format!("round {round}: forcing a free lock"),
        )?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = {
            let (holder, name, opts) = (holder.clone(), name.clone(), opts.clone());
            tokio::spawn(async move {
                holder
                    .with_lock(&name, &opts, |lease| async move {
                        let _ = tx.send(lease);
                        std::future::pending::<()>().await
                    })
                    .await
            })
        };
        let lease = rx.await.map_err(|_| "the job did not start")?;
        let token = lease.fencing_token().ok_or("no token")?;
        ensure(sab.lease_of(&name).await? == Some(neighbour_lease), || {
            format!("round {round}: the two locks are on different leases")
        })?;
        let waiting = {
            let (waiter, name) = (waiter.clone(), name.clone());
            let opts = opts.clone().with_acquire_timeout(Duration::from_secs(20));
            tokio::spawn(async move { waiter.lock(&name, &opts).await })
        };
        let described = inspector
            .describe(&name)
            .await?
            .ok_or("described as free")?;
        ensure(described.fencing_token == Some(token), || {
            format!(
                "round {round}: described token {:?}",
                described.fencing_token
            )
        })?;
        // Wrong tokens: the one before and after; nothing changes.
        for wrong in [token - 1, token + 1, u64::MAX] {
            let outcome = inspector.force_release(&name, wrong).await?;
            ensure(
                outcome == ForceOutcome::TokenMismatch { held: Some(token) },
                || format!("round {round}: forcing with {wrong}: {outcome:?}"),
            )?;
        }
        // Vary where in the renewal interval the release lands.
        sleep(opts.renew_interval() * (round as u32 + 1) / (ROUNDS as u32 + 1)).await;
        ensure(lease.is_held(), || {
            format!("round {round}: a refused forced release ended the lock")
        })?;
        let forced_at = Instant::now();
        let outcome = inspector.force_release(&name, token).await?;
        ensure(outcome == ForceOutcome::Released, || {
            format!("round {round}: forcing with the right token: {outcome:?}")
        })?;
        let reason = timeout(bound * 2, lease.lost())
            .await
            .map_err(|_| format!("round {round}: the holder never noticed"))?;
        let noticed = forced_at.elapsed();
        ensure(reason == LossReason::Forced, || {
            format!("round {round}: lost as {reason}")
        })?;
        ensure(noticed <= bound, || {
            format!("round {round}: noticed after {noticed:?} > {bound:?}")
        })?;
        match job.await?? {
            RunOutcome::Aborted(LossReason::Forced) => {}
            other => return Err(format!("round {round}: the job ended {other:?}").into()),
        }
        ensure(
            holder.metrics().losses(name.as_str(), LossReason::Forced) == 1,
            || format!("round {round}: the loss was not counted as forced"),
        )?;
        let successor = timeout(Duration::from_secs(20), waiting)
            .await
            .map_err(|_| format!("round {round}: the waiter never got the lock"))???;
        ensure(successor.fencing_token().is_some_and(|t| t > token), || {
            format!(
                "round {round}: successor token {:?} after {token}",
                successor.fencing_token()
            )
        })?;
        successor.release().await?;
        took.push(noticed);
    }
    // The neighbour shared the forced locks' lease all along.
    sleep(opts.renew_interval() + tol).await;
    ensure(neighbour.handle().is_held(), || {
        "the other lock on the holder's lease was lost".into()
    })?;
    ensure(sab.lease_of(&other).await? == Some(neighbour_lease), || {
        "the other lock's key is gone or moved".into()
    })?;
    neighbour.release().await?;
    took.sort();
    eprintln!(
        "{}: forced release to the holder's lost() over {ROUNDS} rounds: min {:?}, median {:?}, max {:?} (renew interval {:?})",
        ctx.factory().name(),
        took[0],
        took[ROUNDS / 2],
        took[ROUNDS - 1],
        opts.renew_interval()
    );
    Ok(())
}

/// The backend alone: after a forced release, `check` and `renew` of the
/// freed owner answer `Forced` (not `Expired`), also once a successor took
/// the lock (not `Stolen`), and a batch renewal reports it for that lock
/// only.
async fn forced_in_check_renew_and_batch(ctx: Ctx, _endpoints: Vec<String>) -> Result<(), Failed> {
    let ttl = ctx.timing().ttl;
    let raw = ctx.replica().await.backend;
    let other = ctx.replica().await.backend;
    let inspector = ctx.replica().await.locker;
    let who = Identity::new("inspect-test/raw")?;
    let mut requests = Vec::new();
    for i in 0..3 {
        let name = ctx.name(&format!("raw-{i}"));
        let owner = OwnerToken::generate()?;
        match raw.try_acquire_as(&name, &owner, ttl, &who).await? {
            AcquireAttempt::Acquired(_) => {}
            other => return Err(format!("acquire {i}: {other:?}").into()),
        }
        requests.push(RenewRequest { name, owner, ttl });
    }
    let forced = &requests[1];
    let token = inspector
        .describe(&forced.name)
        .await?
        .and_then(|h| h.fencing_token)
        .ok_or("no token")?;
    ensure(
        inspector.force_release(&forced.name, token).await? == ForceOutcome::Released,
        || "the forced release failed".into(),
    )?;
    let statuses = raw.renew_many(&requests).await?;
    ensure(
        statuses == [LeaseStatus::Held, LeaseStatus::Forced, LeaseStatus::Held],
        || format!("batch renewal after the forced release: {statuses:?}"),
    )?;
    let checked = raw.check(&forced.name, &forced.owner).await?;
    ensure(checked == LeaseStatus::Forced, || {
        format!("check: {checked:?}")
    })?;
    let renewed = raw.renew(&forced.name, &forced.owner, ttl).await?;
    ensure(renewed == LeaseStatus::Forced, || {
        format!("renew: {renewed:?}")
    })?;
    // A successor's key does not hide the mark.
    let successor = OwnerToken::generate()?;
    match other.try_acquire(&forced.name, &successor, ttl).await? {
        AcquireAttempt::Acquired(_) => {}
        got => return Err(format!("successor: {got:?}").into()),
    }
    let checked = raw.check(&forced.name, &forced.owner).await?;
    ensure(checked == LeaseStatus::Forced, || {
        format!("check with a successor holding: {checked:?}")
    })?;
    let statuses = raw.renew_many(&requests).await?;
    ensure(
        statuses == [LeaseStatus::Held, LeaseStatus::Forced, LeaseStatus::Held],
        || format!("batch renewal with a successor holding: {statuses:?}"),
    )?;
    // The successor itself is untouched by the mark.
    let theirs = other.check(&forced.name, &successor).await?;
    ensure(theirs == LeaseStatus::Held, || {
        format!("successor: {theirs:?}")
    })?;
    let _ = other.release(&forced.name, &successor).await?;
    for r in [&requests[0], &requests[2]] {
        let _ = raw.release(&r.name, &r.owner).await?;
    }
    Ok(())
}

/// With RBAC on, a role with read permission on the lock prefix describes
/// and lists, and is refused a forced release as `Auth`; a role with
/// read-write permission there forces, and its holder sees `forced`. Its
/// own server, since it enables auth.
async fn read_only_role_inspects_but_cannot_force(ctx: Ctx) -> Result<(), Failed> {
    let (srv, _, mut root) = server::start_for_auth().await?;
    for (role, user, permission) in [
        ("lockrole", "locksvc", Permission::read_write("/locks/")),
        ("viewrole", "viewer", Permission::read("/locks/")),
    ] {
        root.role_add(role).await?;
        root.role_grant_permission(role, permission.with_prefix())
            .await?;
        root.user_add(user, "pw", None).await?;
        root.user_grant_role(user, role).await?;
    }
    root.auth_enable().await?;

    let as_user = |user: &str| server::builder(srv.port()).with_credentials(user, "pw");
    let holder = Locker::builder()
        .with_backend(as_user("locksvc").connect().await?)
        .with_identity(Identity::new("inspect-test/rbac-holder")?)
        .build()?;
    let viewer = Locker::new(as_user("viewer").connect().await?)?;
    let operator = Locker::new(as_user("locksvc").connect().await?)?;
    let name = ctx.name("rbac");
    let guard = holder.try_lock(&name, &ctx.opts()).await?;
    let seen = viewer
        .describe(&name)
        .await?
        .ok_or("the read-only role saw the lock as free")?;
    ensure(
        seen.fencing_token == guard.fencing_token() && seen.expires_at.is_some(),
        || format!("the read-only role described {seen:?}"),
    )?;
    let page = viewer.list(ctx.prefix(), None, 10).await?;
    ensure(page.holders.len() == 1, || {
        format!("the read-only role listed {page:?}")
    })?;
    let token = guard.fencing_token().ok_or("no token")?;
    match viewer.force_release(&name, token).await {
        Err(Error::Backend(e)) if e.kind() == BackendErrorKind::Auth => {}
        other => return Err(format!("a read-only forced release gave {other:?}").into()),
    }
    ensure(guard.handle().is_held(), || {
        "a refused forced release ended the lock".into()
    })?;
    let outcome = operator.force_release(&name, token).await?;
    ensure(outcome == ForceOutcome::Released, || {
        format!("a read-write forced release gave {outcome:?}")
    })?;
    let bound = ctx.opts().renew_interval() + ctx.timing().tolerance;
    let reason = timeout(bound * 2, guard.handle().lost())
        .await
        .map_err(|_| "the holder never noticed")?;
    ensure(reason == LossReason::Forced, || format!("lost as {reason}"))?;
    Ok(())
}
