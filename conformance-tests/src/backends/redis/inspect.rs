//! Inspection and forced release on Redis, as `<row>::inspect_<case>`
//! trials on the single server (`redis`), Sentinel (`redis_sentinel`) and
//! Cluster (`redis_cluster`) rows: what `describe` and `list` report next to
//! what the holder knows and what the server stores, what a stock client's
//! key looks like, that inspection changes nothing, and what a forced
//! release does to its holder, its guarded job and a waiter.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use lock_core::backend::AcquireAttempt;
use lock_core::{
    ForceOutcome, Identity, LockBackend, LockMetrics, LockName, LockOptions, Locker, LossReason,
    OwnerToken, RunOutcome,
};
use lock_redis::{cluster_key_slot, RedisBackend};
use prometheus::Registry;
use redis::aio::ConnectionLike;
use redis::FromRedisValue;
use tokio::task::JoinSet;
use tokio::time::{sleep, timeout, Instant};

use super::cluster_factory::ClusterFactory;
use super::sentinel_factory::SentinelFactory;
use super::specific::{ensure, TOLERANCE, TRIAL_TIMEOUT};
use super::{RedisFactory, TTL};
use crate::harness::push_bounded;
use crate::{BoxError, Suite};

/// How many locks the listing case holds at once.
const MANY: usize = 1_000;

/// One Redis deployment the cases run on.
#[derive(Clone)]
pub(super) enum Deployment {
    Single(Arc<RedisFactory>),
    /// The single server with fencing tokens off.
    Unfenced(Arc<RedisFactory>),
    Sentinel(Arc<SentinelFactory>),
    Cluster(Arc<ClusterFactory>),
}

impl Deployment {
    fn row(&self) -> &'static str {
        match self {
            Self::Single(_) => "redis",
            Self::Unfenced(_) => "redis_nofence",
            Self::Sentinel(_) => "redis_sentinel",
            Self::Cluster(_) => "redis_cluster",
        }
    }

    /// A separate backend (its own connections), as another process's.
    async fn backend(&self) -> Result<RedisBackend, BoxError> {
        match self {
            Self::Single(f) | Self::Unfenced(f) => Ok(f.config()?.connect().await?),
            Self::Sentinel(f) => f.connect().await,
            Self::Cluster(f) => f.connect().await,
        }
    }

    /// A plain client (not the library's), acting as another program.
    async fn raw(&self) -> Result<Raw, BoxError> {
        match self {
            Self::Single(f) | Self::Unfenced(f) => {
                Ok(Raw::Single(super::specific::plain(f.url()).await?))
            }
            Self::Sentinel(f) => {
                let port = f.set()?.primary_port()?;
                let url = format!("redis://127.0.0.1:{port}");
                Ok(Raw::Single(super::specific::plain(&url).await?))
            }
            Self::Cluster(f) => Ok(Raw::Cluster(super::cluster_cases::plain_cluster(f).await?)),
        }
    }
}

/// A plain connection to one server or to the cluster.
enum Raw {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Raw {
    async fn query<T: FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, BoxError> {
        let reply = match self {
            Self::Single(c) => c.req_packed_command(cmd).await?,
            Self::Cluster(c) => c.req_packed_command(cmd).await?,
        };
        Ok(redis::from_redis_value(reply)?)
    }

    /// The lock key's value and PTTL.
    async fn state(&mut self, key: &str) -> Result<(Option<String>, i64), BoxError> {
        let value = self.query(redis::cmd("GET").arg(key)).await?;
        let pttl = self.query(redis::cmd("PTTL").arg(key)).await?;
        Ok((value, pttl))
    }
}

impl Deployment {
    /// Whether its backends draw fencing tokens.
    fn fenced(&self) -> bool {
        !matches!(self, Self::Unfenced(_))
    }
}

/// Adds the inspection trials for `deployment`, as `<row>::inspect_<case>`.
pub(super) fn register(suite: &mut Suite, deployment: &Deployment) {
    let row = deployment.row();
    let every = crate::trial_table![
        "inspect_describe_follows_the_lease" => describe_follows_the_lease,
        "inspect_stock_client_key_is_held_by_unknown" => stock_client_key_is_held_by_unknown,
        "inspect_list_pages_find_each_lock_once" => list_pages_find_each_lock_once,
    ];
    push_bounded(suite, row, deployment, TRIAL_TIMEOUT, &every);
    if deployment.fenced() {
        let fenced = crate::trial_table![
            "inspect_force_release_aborts_the_holder" => force_release_aborts_the_holder,
            "inspect_force_release_wrong_token_is_refused" => force_release_wrong_token_is_refused,
        ];
        push_bounded(suite, row, deployment, TRIAL_TIMEOUT, &fenced);
    } else {
        let unfenced = crate::trial_table![
            "inspect_force_release_is_unsupported" => force_release_is_unsupported,
        ];
        push_bounded(suite, row, deployment, TRIAL_TIMEOUT, &unfenced);
    }
    if let Deployment::Single(_) = deployment {
        // ACL users are made on the private server only.
        let single = crate::trial_table![
            "inspect_read_only_acl_user" => read_only_acl_user,
        ];
        push_bounded(suite, row, deployment, TRIAL_TIMEOUT, &single);
    }
}

/// The ACL rules the crate documents for a read-only inspector of the locks
/// under `prefix` (`describe` and `list`, no forced release): read-only key
/// access, `SCAN`, and the read-only describe script (`EVALSHA_RO`).
pub(super) fn inspector_acl_rules(prefix: &str) -> Vec<String> {
    let mut rules = vec![
        "on".to_owned(),
        "resetkeys".to_owned(),
        format!("%R~{prefix}*"),
        "resetchannels".to_owned(),
        "-@all".to_owned(),
    ];
    for cmd in [
        "get",
        "pttl",
        "time",
        "scan",
        "evalsha_ro",
        "eval_ro",
        "ping",
    ] {
        rules.push(format!("+{cmd}"));
    }
    rules
}

/// The rules of a user that may also force releases: the lock user's
/// (`acl_rules`), and `pttl`, `scan` and the read-only script commands to
/// describe and list.
pub(super) fn operator_acl_rules(prefix: &str) -> Vec<String> {
    let mut rules = super::acl_rules(prefix);
    for cmd in ["pttl", "scan", "evalsha_ro", "eval_ro"] {
        rules.push(format!("+{cmd}"));
    }
    rules
}

/// A `Locker` over `backend` naming itself `identity`, with its own metrics.
fn locker(backend: RedisBackend, identity: &str) -> Result<(Locker, LockMetrics), BoxError> {
    let metrics = LockMetrics::register(&Registry::new())?;
    let locker = Locker::builder()
        .with_backend_arc(Arc::new(backend))
        .with_metrics(metrics.clone())
        .with_identity(Identity::new(identity)?)
        .build()?;
    Ok((locker, metrics))
}

fn opts() -> LockOptions {
    LockOptions::new(TTL)
}

/// Every lock under `prefix`, page by page (a page may be short, even
/// empty, with a next cursor).
async fn list_all<B: LockBackend + ?Sized>(
    backend: &B,
    prefix: &str,
) -> Result<Vec<lock_core::Holder>, BoxError> {
    let (mut all, mut cursor) = (Vec::new(), None::<String>);
    for _ in 0..10_000 {
        let page = backend.list(prefix, cursor.as_deref(), 10).await?;
        all.extend(page.holders);
        match page.next {
            Some(next) => cursor = Some(next),
            None => return Ok(all),
        }
    }
    Err("the listing does not end".into())
}

/// `a` and `b` are at most `slack` apart.
fn near(a: SystemTime, b: SystemTime, slack: Duration) -> bool {
    a.duration_since(b)
        .or_else(|_| b.duration_since(a))
        .is_ok_and(|d| d <= slack)
}

async fn describe_follows_the_lease(d: Deployment) -> Result<(), BoxError> {
    let (holder, _) = locker(d.backend().await?, "inspect-holder/1/abcdef01")?;
    let (operator, _) = locker(d.backend().await?, "inspect-operator")?;
    let mut raw = d.raw().await?;
    let name = LockName::new("inspect/describe")?;
    let key = d.backend().await?.key_for(&name);
    ensure(
        operator.describe(&name).await?.is_none(),
        "a free lock was described as held",
    )?;

    let sent = SystemTime::now();
    let guard = holder.try_lock(&name, &opts()).await?;
    let got = SystemTime::now();
    let first = operator
        .describe(&name)
        .await?
        .ok_or("a held lock described as free")?;
    ensure(
        first.identity.as_ref().map(Identity::as_str) == Some("inspect-holder/1/abcdef01"),
        format!("identity {:?}", first.identity),
    )?;
    ensure(
        first.fencing_token == guard.fencing_token() && first.fencing_token.is_some() == d.fenced(),
        format!(
            "token {:?}, the holder has {:?}",
            first.fencing_token,
            guard.fencing_token()
        ),
    )?;
    let acquired = first.acquired_at.ok_or("no acquired_at")?;
    ensure(
        acquired + TOLERANCE >= sent && acquired <= got + TOLERANCE,
        format!("acquired_at {acquired:?} outside [{sent:?}, {got:?}]"),
    )?;
    let expires = first.expires_at.ok_or("no expires_at")?;
    ensure(
        near(expires, acquired + TTL, TOLERANCE),
        format!("expires_at {expires:?}, acquired at {acquired:?} with a TTL of {TTL:?}"),
    )?;

    // Inspection changes nothing: the value stays, the TTL only runs down.
    let (value0, pttl0) = raw.state(&key).await?;
    for _ in 0..10 {
        operator.describe(&name).await?;
        operator.list("inspect/describe", None, 10).await?;
    }
    let (value1, pttl1) = raw.state(&key).await?;
    ensure(value0 == value1, "inspection changed the lock's value")?;
    ensure(
        pttl1 <= pttl0,
        format!("inspection extended the lock: PTTL {pttl0} -> {pttl1} ms"),
    )?;

    // After a renewal: renewed_at and expires_at move, acquired_at stays.
    sleep(opts().renew_interval() + Duration::from_millis(150)).await;
    let later = operator.describe(&name).await?.ok_or("lost while held")?;
    let renewed = later.renewed_at.ok_or("no renewed_at")?;
    ensure(
        renewed > acquired + opts().renew_interval() / 2,
        format!("renewed_at {renewed:?} did not move past acquired_at {acquired:?}"),
    )?;
    ensure(later.acquired_at == first.acquired_at, "acquired_at moved")?;
    ensure(
        later.expires_at > first.expires_at,
        "expires_at did not move with the renewal",
    )?;
    ensure(later.fencing_token == first.fencing_token, "token changed")?;

    guard.release().await?;
    ensure(
        operator.describe(&name).await?.is_none(),
        "described as held after release",
    )?;

    // After expiry (a lease nobody renews).
    let backend = d.backend().await?;
    let owner = OwnerToken::generate()?;
    let short = Duration::from_millis(300);
    let who = Identity::new("inspect-expiring")?;
    match backend.try_acquire_as(&name, &owner, short, &who).await? {
        AcquireAttempt::Acquired(_) => {}
        other => return Err(format!("not acquired: {other:?}").into()),
    }
    ensure(
        backend.describe(&name).await?.is_some(),
        "the short lease was not described",
    )?;
    sleep(short + Duration::from_millis(150)).await;
    ensure(
        backend.describe(&name).await?.is_none(),
        "described as held after expiry",
    )?;
    Ok(())
}

async fn stock_client_key_is_held_by_unknown(d: Deployment) -> Result<(), BoxError> {
    let backend = d.backend().await?;
    let (operator, _) = locker(d.backend().await?, "inspect-operator")?;
    let mut raw = d.raw().await?;
    let name = LockName::new("inspect/stock")?;
    let key = backend.key_for(&name);
    let () = raw
        .query(
            redis::cmd("SET")
                .arg(&key)
                .arg("somevalue")
                .arg("PX")
                .arg(30_000),
        )
        .await?;
    let outcome = async {
        let held = operator
            .describe(&name)
            .await?
            .ok_or("a stock client's key was described as free")?;
        ensure(held.identity.is_none(), "an identity for a stock key")?;
        ensure(held.fencing_token.is_none(), "a token for a stock key")?;
        let expires = held.expires_at.ok_or("no expires_at")?;
        ensure(
            near(
                expires,
                SystemTime::now() + Duration::from_secs(30),
                Duration::from_secs(2),
            ),
            format!("expires_at {expires:?}"),
        )?;
        let listed = list_all(&backend, "inspect/stock").await?;
        ensure(
            listed.iter().any(|h| h.name == name),
            "a stock key not listed",
        )?;
        if d.fenced() {
            ensure(
                operator.force_release(&name, 1).await?
                    == ForceOutcome::TokenMismatch { held: None },
                "a forced release of a stock key was not refused",
            )?;
        }
        let (value, _) = raw.state(&key).await?;
        ensure(
            value.as_deref() == Some("somevalue"),
            "the stock key was changed",
        )
    }
    .await;
    let _: i64 = raw.query(redis::cmd("DEL").arg(&key)).await?;
    outcome
}

async fn list_pages_find_each_lock_once(d: Deployment) -> Result<(), BoxError> {
    let backend = d.backend().await?;
    let who = Identity::new("inspect-lister")?;
    // 1,000 locks under the prefix and a few beside it, taken concurrently.
    let mut wanted = BTreeSet::new();
    let mut owners = Vec::new();
    let mut tasks = JoinSet::new();
    let long = Duration::from_secs(60);
    for i in 0..MANY + 20 {
        let text = if i < MANY {
            format!("inspect/list/{i:05}")
        } else {
            format!("inspect/listx/{i}")
        };
        let name = LockName::new(text)?;
        if i < MANY {
            wanted.insert(name.clone());
        }
        let (b, who) = (backend.clone(), who.clone());
        let owner = OwnerToken::generate()?;
        owners.push((name.clone(), owner));
        tasks.spawn(async move { b.try_acquire_as(&name, &owner, long, &who).await });
        if tasks.len() >= 64 {
            if let Some(done) = tasks.join_next().await {
                ensure(
                    matches!(done??, AcquireAttempt::Acquired(_)),
                    "a lock not acquired",
                )?;
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        ensure(
            matches!(done??, AcquireAttempt::Acquired(_)),
            "a lock not acquired",
        )?;
    }
    let outcome = async {
        if matches!(d, Deployment::Cluster(_)) {
            let slots: BTreeSet<u16> = wanted
                .iter()
                .map(|n| cluster_key_slot(backend.key_for(n).as_bytes()))
                .collect();
            ensure(slots.len() > 500, format!("only {} slots", slots.len()))?;
        }
        let started = Instant::now();
        let (mut seen, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
        loop {
            let page = backend.list("inspect/list/", cursor.as_deref(), 97).await?;
            ensure(page.holders.len() <= 97, "a page longer than its limit")?;
            for h in &page.holders {
                ensure(
                    h.identity.as_ref() == Some(&who) && h.fencing_token.is_some() == d.fenced(),
                    format!("{h:?}"),
                )?;
            }
            seen.extend(page.holders.into_iter().map(|h| h.name));
            pages += 1;
            ensure(pages < 1_000, "the listing does not end")?;
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        let took = started.elapsed();
        let unique: BTreeSet<LockName> = seen.iter().cloned().collect();
        ensure(
            unique.len() == seen.len(),
            format!("{} locks listed more than once", seen.len() - unique.len()),
        )?;
        ensure(
            unique == wanted,
            format!(
                "listed {} locks, {} missing, {} extra",
                unique.len(),
                wanted.difference(&unique).count(),
                unique.difference(&wanted).count()
            ),
        )?;
        eprintln!(
            "    [{}] listed {MANY} locks in {pages} pages of at most 97 in {took:?}",
            d.row()
        );
        Ok::<_, BoxError>(())
    }
    .await;
    for (name, owner) in &owners {
        backend.release(name, owner).await?;
    }
    outcome
}

async fn force_release_aborts_the_holder(d: Deployment) -> Result<(), BoxError> {
    let (holder, metrics) = locker(d.backend().await?, "inspect-victim")?;
    let (operator, _) = locker(d.backend().await?, "inspect-operator")?;
    let (waiter, _) = locker(d.backend().await?, "inspect-waiter")?;
    let name = LockName::new("inspect/forced")?;

    // The holder runs a guarded job that never ends on its own.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (job_name, job_opts) = (name.clone(), opts());
    let job = tokio::spawn(async move {
        holder
            .with_lock(&job_name, &job_opts, |lease| async move {
                let _ = tx.send(lease);
                std::future::pending::<()>().await;
            })
            .await
    });
    let lease = timeout(Duration::from_secs(5), rx).await??;
    let token = lease.fencing_token().ok_or("no fencing token")?;
    let seen = operator
        .describe(&name)
        .await?
        .ok_or("held lock described as free")?;
    ensure(
        seen.fencing_token == Some(token),
        "describe's token differs",
    )?;

    // A waiter queues for the lock.
    let (wait_name, wait_opts) = (
        name.clone(),
        opts().with_acquire_timeout(Duration::from_secs(10)),
    );
    let waiting = tokio::spawn(async move {
        let guard = waiter.lock(&wait_name, &wait_opts).await?;
        let token = guard.fencing_token();
        guard.release().await?;
        Ok::<_, lock_core::Error>(token)
    });

    let forced_at = Instant::now();
    let outcome = operator.force_release(&name, token).await?;
    ensure(
        outcome == ForceOutcome::Released,
        format!("forced release answered {outcome:?}"),
    )?;
    let bound = opts().renew_interval() + TOLERANCE;
    let reason = timeout(bound, lease.lost())
        .await
        .map_err(|_| format!("the holder did not learn of the forced release within {bound:?}"))?;
    let took = forced_at.elapsed();
    ensure(
        reason == LossReason::Forced,
        format!("lost as {reason}, expected forced"),
    )?;
    eprintln!(
        "    [{}] force_release -> holder's lost() resolved (forced) after {took:?} (renew interval {:?})",
        d.row(),
        opts().renew_interval()
    );
    let ran = timeout(Duration::from_secs(2), job).await??;
    ensure(
        matches!(ran, Ok(RunOutcome::Aborted(LossReason::Forced))),
        format!("the guarded job ended as {ran:?}, expected aborted (forced)"),
    )?;
    ensure(
        metrics.losses(name.as_str(), LossReason::Forced) == 1,
        "the loss was not counted as forced",
    )?;
    let next = timeout(Duration::from_secs(12), waiting).await???;
    ensure(
        next.is_some_and(|n| n > token),
        format!("the waiter's token {next:?} is not above the freed {token}"),
    )?;
    Ok(())
}

async fn force_release_wrong_token_is_refused(d: Deployment) -> Result<(), BoxError> {
    let (holder, metrics) = locker(d.backend().await?, "inspect-kept")?;
    let (operator, _) = locker(d.backend().await?, "inspect-operator")?;
    let mut raw = d.raw().await?;
    let name = LockName::new("inspect/refused")?;
    let key = d.backend().await?.key_for(&name);
    ensure(
        operator.force_release(&name, 1).await? == ForceOutcome::NotHeld,
        "a forced release of a free lock was not NotHeld",
    )?;
    let guard = holder.try_lock(&name, &opts()).await?;
    let token = guard.fencing_token().ok_or("no fencing token")?;
    let (value, _) = raw.state(&key).await?;
    for wrong in [token + 1, token.saturating_sub(1), u64::MAX] {
        let got = operator.force_release(&name, wrong).await?;
        ensure(
            got == ForceOutcome::TokenMismatch { held: Some(token) },
            format!("token {wrong}: {got:?}"),
        )?;
    }
    // The holder keeps renewing and never hears of it.
    sleep(opts().renew_interval() * 2 + Duration::from_millis(100)).await;
    ensure(guard.is_held(), "the holder lost its lock")?;
    ensure(
        raw.state(&key).await?.0 == value,
        "the lock's value changed",
    )?;
    let still = operator.describe(&name).await?.ok_or("described as free")?;
    ensure(still.fencing_token == Some(token), "another token holds it")?;
    ensure(
        LossReason::LOSSES
            .iter()
            .all(|r| metrics.losses(name.as_str(), *r) == 0),
        "a loss was counted",
    )?;
    guard.release().await?;
    Ok(())
}

/// Makes ACL user `user` with `rules`.
async fn set_user(
    admin: &mut redis::aio::MultiplexedConnection,
    user: &str,
    rules: &[String],
) -> Result<(), BoxError> {
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg(">inspect-pw")
        .arg(rules)
        .query_async(admin)
        .await?;
    Ok(())
}

async fn read_only_acl_user(d: Deployment) -> Result<(), BoxError> {
    let Deployment::Single(f) = &d else {
        return Err("runs on the single server only".into());
    };
    let mut admin = super::specific::plain(f.url()).await?;
    let tag = OwnerToken::generate()?.to_hex();
    let (reader, operator) = (
        format!("inspector-{}", &tag[..12]),
        format!("operator-{}", &tag[..12]),
    );
    let allowed = format!("{}inspect-acl:", f.prefix());
    set_user(&mut admin, &reader, &inspector_acl_rules(&allowed)).await?;
    set_user(&mut admin, &operator, &operator_acl_rules(&allowed)).await?;
    eprintln!(
        "    [redis] inspector: ACL SETUSER {reader} >*** {}",
        inspector_acl_rules(&allowed).join(" ")
    );
    eprintln!(
        "    [redis] operator: ACL SETUSER {operator} >*** {}",
        operator_acl_rules(&allowed).join(" ")
    );
    let outcome = async {
        let as_user = |user: &str| -> Result<lock_redis::RedisBuilder, BoxError> {
            let url = f
                .url()
                .replacen("redis://", &format!("redis://{user}:inspect-pw@"), 1);
            Ok(super::config_for(&url)?.with_key_prefix(&allowed))
        };
        let holder_backend = super::config_for(f.url())?
            .with_key_prefix(&allowed)
            .connect()
            .await?;
        let (holder, metrics) = locker(holder_backend, "inspect-acl-holder")?;
        let name = LockName::new("inspect/acl")?;
        let guard = holder.try_lock(&name, &opts()).await?;
        let token = guard.fencing_token().ok_or("no token")?;

        let ro = as_user(&reader)?.connect().await?;
        let seen = ro.describe(&name).await?.ok_or("described as free")?;
        ensure(
            seen.fencing_token == Some(token)
                && seen.identity.as_ref().map(Identity::as_str) == Some("inspect-acl-holder"),
            format!("{seen:?}"),
        )?;
        let listed = list_all(&ro, "").await?;
        ensure(
            listed.iter().map(|h| &h.name).eq([&name]),
            format!("{listed:?}"),
        )?;
        match ro.force_release(&name, token).await {
            Err(e) if e.kind() == lock_core::BackendErrorKind::Auth => {
                eprintln!("    [redis] forced release as the inspector: {e}");
            }
            other => return Err(format!("the inspector forced a release: {other:?}").into()),
        }
        ensure(
            guard.is_held() && ro.describe(&name).await?.is_some(),
            "a refused forced release changed the lock",
        )?;

        let op = as_user(&operator)?.connect().await?;
        ensure(
            op.force_release(&name, token).await? == ForceOutcome::Released,
            "the operator's forced release was not done",
        )?;
        let reason = timeout(opts().renew_interval() + TOLERANCE, guard.lost())
            .await
            .map_err(|_| "the holder did not learn of the forced release")?;
        ensure(reason == LossReason::Forced, format!("lost as {reason}"))?;
        ensure(
            metrics.losses(name.as_str(), LossReason::Forced) == 1,
            "not counted",
        )?;
        Ok::<_, BoxError>(())
    }
    .await;
    for user in [&reader, &operator] {
        let _: i64 = redis::cmd("ACL")
            .arg("DELUSER")
            .arg(user)
            .query_async(&mut admin)
            .await?;
    }
    outcome
}

async fn force_release_is_unsupported(d: Deployment) -> Result<(), BoxError> {
    let (holder, _) = locker(d.backend().await?, "inspect-unfenced")?;
    let (operator, _) = locker(d.backend().await?, "inspect-operator")?;
    let name = LockName::new("inspect/unfenced-force")?;
    let guard = holder.try_lock(&name, &opts()).await?;
    match operator.force_release(&name, 1).await {
        Err(lock_core::Error::Backend(e))
            if e.kind() == lock_core::BackendErrorKind::Unsupported =>
        {
            eprintln!("    [{}] forced release without tokens: {e}", d.row());
        }
        other => return Err(format!("expected Unsupported, got {other:?}").into()),
    }
    sleep(opts().renew_interval() + Duration::from_millis(100)).await;
    ensure(guard.is_held(), "the holder lost its lock")?;
    guard.release().await?;
    Ok(())
}
