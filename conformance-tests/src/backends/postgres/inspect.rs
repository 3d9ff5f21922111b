//! Who holds a lock, and a forced release, on Postgres: the holder rows the
//! lock statements write, read back through `pg_locks`, and the mark a
//! forced release leaves for the holder's renewal.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use lock_core::{
    backend::AcquireAttempt, BackendErrorKind, Error, ForceOutcome, Identity, LockBackend,
    LockMetrics, LockName, LockOptions, Locker, LossReason, OwnerToken, RunOutcome,
};
use lock_postgres::PostgresBackend;
use prometheus::Registry;
use tokio::time::{sleep, timeout, Instant};
use tokio_postgres::Client;

use super::specific::{add, backend_as, hold, name};
use super::{holder_pid, plain_session, terminate, PostgresFactory, TTL};
use crate::{BoxError, Suite};

/// The renewal interval of the cases' leases (a third of the TTL).
const INTERVAL: Duration = Duration::from_millis(500);

pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    let table = crate::trial_table![
        "inspect_describe_follows_the_lease" => describe_follows_the_lease,
        "inspect_stock_lock_is_held_by_unknown" => stock_lock_is_held_by_unknown,
        "inspect_list_pages_through_1000_locks" => list_pages_through_1000_locks,
        "inspect_without_holder_records" => inspect_without_holder_records,
        "inspect_with_select_only" => inspect_with_select_only,
        "force_release_of_a_holder_that_does_not_renew" => force_release_of_a_holder_that_does_not_renew,
        "force_release_frees_only_the_named_lease" => force_release_frees_only_the_named_lease,
    ];
    add(suite, f, &table);
}

fn locker_as(backend: Arc<dyn LockBackend>, who: &str) -> Result<Locker, BoxError> {
    let metrics = LockMetrics::register(&Registry::new())?;
    Ok(Locker::builder()
        .with_backend_arc(backend)
        .with_metrics(metrics)
        .with_identity(Identity::new(who)?)
        .build()?)
}

/// An operator's view: its own backend, hence its own session.
async fn operator(f: &PostgresFactory) -> Result<Locker, BoxError> {
    locker_as(Arc::new(backend_as(f, "postgres").await?), "operator")
}

/// The server's state the inspections must leave alone: the advisory locks
/// of the sessions holding names under `prefix` and those names' holder
/// rows (other trials run meanwhile on the same server).
async fn server_state(client: &Client, prefix: &str) -> Result<Vec<String>, BoxError> {
    let rows = client
        .query(
            "SELECT format('%s %s %s %s %s', pid, classid, objid, objsubid, granted) FROM pg_locks \
             WHERE locktype = 'advisory' AND pid IN \
               (SELECT pid FROM lock_holders WHERE starts_with(name, $1)) UNION ALL \
             SELECT format('%s %s %s %s %s %s %s', namespace, name, key1, key2, pid, token, forced) \
             FROM lock_holders WHERE starts_with(name, $1) ORDER BY 1",
            &[&prefix],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Describe answers what the holder knows while it holds the lock, moves
/// its renewal time with the renewals, and answers none after a release and
/// after the holder's session ended (whose row stays behind, stale).
async fn describe_follows_the_lease(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let holder_backend = backend_as(&f, "postgres").await?;
    let holder = locker_as(Arc::new(holder_backend.clone()), "web-1/4242/0a1b2c3d")?;
    let op = operator(&f).await?;
    let n = name(&f, "described");
    let opts = LockOptions::new(TTL);

    if op.describe(&n).await?.is_some() {
        return Err("a lock never taken is described as held".into());
    }
    let before_acquire = SystemTime::now() - Duration::from_secs(5);
    let guard = holder.try_lock(&n, &opts).await?;
    let token = guard.handle().fencing_token();
    let seen = op
        .describe(&n)
        .await?
        .ok_or("a held lock is described as free")?;
    if seen.identity.as_ref().map(Identity::as_str) != Some("web-1/4242/0a1b2c3d") {
        return Err(format!("described with identity {:?}", seen.identity).into());
    }
    if seen.fencing_token != token || token.is_none() {
        return Err(format!("described token {:?}, held {token:?}", seen.fencing_token).into());
    }
    let acquired = seen.acquired_at.ok_or("no acquired_at")?;
    if acquired < before_acquire || seen.renewed_at != Some(acquired) {
        return Err(format!(
            "fresh lease: acquired {acquired:?}, renewed {:?}",
            seen.renewed_at
        )
        .into());
    }
    if seen.expires_at.is_some() {
        return Err("a session-bound lock was described with an expiry".into());
    }

    // Inspection changes nothing on the server.
    let state = server_state(&inspector, n.as_str()).await?;
    for _ in 0..3 {
        op.describe(&n).await?;
        op.list(&format!("{}/", f.application_name()), None, 10)
            .await?;
    }
    if server_state(&inspector, n.as_str()).await? != state {
        return Err("describing and listing changed the server's locks or holder rows".into());
    }

    sleep(INTERVAL * 3).await;
    let later = op
        .describe(&n)
        .await?
        .ok_or("described free while renewed")?;
    let renewed = later.renewed_at.ok_or("no renewed_at after renewals")?;
    if renewed <= acquired || later.acquired_at != Some(acquired) || later.fencing_token != token {
        return Err(format!(
            "after renewals: acquired {:?} (was {acquired:?}), renewed {renewed:?}, token {:?}",
            later.acquired_at, later.fencing_token
        )
        .into());
    }
    guard.assert_held()?;

    guard.release().await?;
    if let Some(h) = op.describe(&n).await? {
        return Err(format!("described after release: {h:?}").into());
    }

    // The holder's session ends without a release: its row stays, stale
    // (put back if a backend pruned it meanwhile: rows of ended sessions go
    // when a backend first writes the table).
    let guard = holder.try_lock(&n, &opts).await?;
    let pid = holder_backend.lock_session_pid(&n).await?;
    let row = inspector
        .query_one(
            "SELECT namespace, key1, key2, token FROM lock_holders WHERE name = $1 AND pid = $2",
            &[&n.as_str(), &pid],
        )
        .await?;
    let (ns, key1, key2, row_token): (String, i32, i32, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let lost = guard.handle();
    terminate(&inspector, pid).await?;
    timeout(Duration::from_secs(5), lost.lost())
        .await
        .map_err(|_| "the holder did not learn that its session ended")?;
    inspector
        .execute(
            "INSERT INTO lock_holders (namespace, name, key1, key2, pid, token, identity, acquired_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'ghost', now()) ON CONFLICT (namespace, name) DO NOTHING",
            &[&ns, &n.as_str(), &key1, &key2, &pid, &row_token],
        )
        .await?;
    if let Some(h) = op.describe(&n).await? {
        return Err(format!("described after its session ended: {h:?}").into());
    }
    let page = op.list(n.as_str(), None, 10).await?;
    if !page.holders.is_empty() {
        return Err(format!("listed after its session ended: {:?}", page.holders).into());
    }
    drop(guard);
    inspector
        .execute("DELETE FROM lock_holders WHERE name = $1", &[&n.as_str()])
        .await?;
    Ok(())
}

/// A lock taken with plain `pg_advisory_lock` on the name's key (a stock
/// client, an older version) is held by an unknown holder, never free; it
/// cannot be listed (no name is known) nor released by force.
async fn stock_lock_is_held_by_unknown(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let op_backend = backend_as(&f, "postgres").await?;
    let op = locker_as(Arc::new(op_backend.clone()), "operator")?;
    let n = name(&f, "stock");
    let key = op_backend.config().key_for(&n);
    let stock = plain_session(&url, f.application_name()).await?;
    stock
        .execute("SELECT pg_advisory_lock($1, $2)", &[&key.key1, &key.key2])
        .await?;
    let seen = op
        .describe(&n)
        .await?
        .ok_or("a stock client's lock is described as free")?;
    if seen.identity.is_some() || seen.fencing_token.is_some() || seen.acquired_at.is_some() {
        return Err(format!("a stock client's lock described as {seen:?}").into());
    }
    let page = op.list(n.as_str(), None, 10).await?;
    if !page.holders.is_empty() {
        return Err(format!("a lock with no known name was listed: {:?}", page.holders).into());
    }
    match op.force_release(&n, 1).await? {
        ForceOutcome::TokenMismatch { held: None } => {}
        other => return Err(format!("forced release of a stock lock answered {other:?}").into()),
    }
    if holder_pid(&stock, key).await?.is_none() {
        return Err("the stock lock went away".into());
    }
    stock
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&key.key1, &key.key2])
        .await?;
    if op.describe(&n).await?.is_some() {
        return Err("described as held after the stock client unlocked".into());
    }
    Ok(())
}

/// `list` finds exactly the held locks under a prefix, across pages, with
/// 1,000 of them held (on two sessions) beside released, stale and
/// differently-prefixed ones.
async fn list_pages_through_1000_locks(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let config = f.builder_for(&url)?.with_lock_sessions(2).config()?;
    let backend: Arc<dyn LockBackend> = Arc::new(PostgresBackend::connect(config).await?);
    let holder = locker_as(backend, "lister")?;
    let op = operator(&f).await?;
    let root = name(&f, "list");
    let prefix = format!("{root}/a/");
    let opts = LockOptions::new(TTL);
    let mut guards = Vec::new();
    let mut want = BTreeSet::new();
    for i in 0..1000 {
        let n = LockName::new(format!("{prefix}{i:04}"))?;
        guards.push(holder.try_lock(&n, &opts).await?);
        want.insert(n.as_str().to_owned());
    }
    // Beside it: a sibling prefix ("a_" sorts between "a/" and "a0"), a
    // released lock and a stale row under the prefix.
    let sibling = holder
        .try_lock(&LockName::new(format!("{root}/a_0"))?, &opts)
        .await?;
    let outer = holder
        .try_lock(&LockName::new(format!("{root}/b"))?, &opts)
        .await?;
    holder
        .try_lock(&LockName::new(format!("{prefix}released"))?, &opts)
        .await?
        .release()
        .await?;
    inspector
        .execute(
            "INSERT INTO lock_holders (namespace, name, key1, key2, pid, token, identity, acquired_at) \
             SELECT namespace, $1, 1, 2, pid, 7, 'ghost', now() FROM lock_holders WHERE name = $2",
            &[&format!("{prefix}stale"), &format!("{prefix}0000")],
        )
        .await?;

    let state = server_state(&inspector, &prefix).await?;
    let mut got = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    let started = Instant::now();
    loop {
        let page = op.list(&prefix, cursor.as_deref(), 128).await?;
        pages += 1;
        if page.holders.len() > 128 {
            return Err(format!("a page of 128 held {}", page.holders.len()).into());
        }
        for h in &page.holders {
            if h.identity.as_ref().map(Identity::as_str) != Some("lister")
                || h.fencing_token.is_none()
            {
                return Err(format!("listed {h:?}").into());
            }
            got.push(h.name.as_str().to_owned());
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
        if pages > 20 {
            return Err("the listing did not end".into());
        }
    }
    let elapsed = started.elapsed();
    if server_state(&inspector, &prefix).await? != state {
        return Err("listing changed the server's locks or holder rows".into());
    }
    let unique: BTreeSet<String> = got.iter().cloned().collect();
    if unique.len() != got.len() {
        return Err(format!("{} names listed twice", got.len() - unique.len()).into());
    }
    if unique != want {
        let extra: Vec<_> = unique.difference(&want).take(5).collect();
        let missing: Vec<_> = want.difference(&unique).take(5).collect();
        return Err(format!(
            "listed {} of 1000; extra {extra:?}, missing {missing:?}",
            unique.len()
        )
        .into());
    }
    eprintln!("listed 1,000 held locks in {pages} pages of 128 in {elapsed:?}");
    let whole = op.list(&format!("{root}/"), None, 5000).await?;
    if whole.holders.len() != 1000 || whole.next.is_none() {
        return Err(format!(
            "a page asked for 5,000 held {} (the most is 1,000) and next {:?}",
            whole.holders.len(),
            whole.next
        )
        .into());
    }
    for bad in ["a*", "a%", "a\nb"] {
        match op.list(bad, None, 10).await {
            Err(Error::InvalidName { .. }) => {}
            other => return Err(format!("prefix {bad:?}: {other:?}").into()),
        }
    }
    match op.list(&prefix, Some("not a name"), 10).await {
        Err(Error::Backend(e)) if e.kind() == BackendErrorKind::Config => {}
        other => return Err(format!("a forged cursor: {other:?}").into()),
    }
    inspector
        .execute(
            "DELETE FROM lock_holders WHERE name = $1",
            &[&format!("{prefix}stale")],
        )
        .await?;
    for g in guards {
        g.release().await?;
    }
    sibling.release().await?;
    outer.release().await?;
    Ok(())
}

/// A forced release with the wrong token changes nothing; with the right
/// one the holder's `lost()` resolves `Forced` within one renewal interval,
/// its job is aborted, a waiter takes the lock with a higher token, and
/// another lease on the same session keeps its lock.
async fn force_release_frees_only_the_named_lease(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let holder_backend = backend_as(&f, "postgres").await?;
    let holder = locker_as(Arc::new(holder_backend.clone()), "holder")?;
    let waiter = locker_as(Arc::new(backend_as(&f, "postgres").await?), "waiter")?;
    let op = operator(&f).await?;
    let (forced, kept) = (name(&f, "forced"), name(&f, "kept"));
    let opts = LockOptions::new(TTL);

    if op.force_release(&forced, 1).await? != ForceOutcome::NotHeld {
        return Err("a free lock was not answered NotHeld".into());
    }
    match op.force_release(&forced, u64::MAX).await {
        Err(Error::Backend(e)) if e.kind() == BackendErrorKind::Config => {}
        other => return Err(format!("an out-of-range token: {other:?}").into()),
    }
    let (lease, job) = hold(&holder, &forced).await?;
    let other = holder.try_lock(&kept, &opts).await?;
    let pid = holder_backend.lock_session_pid(&forced).await?;
    if holder_backend.lock_session_pid(&kept).await? != pid {
        return Err("setup: the two leases are not on one session".into());
    }
    let token = lease.fencing_token().ok_or("no token")?;
    let kept_token = other.handle().fencing_token();

    match op.force_release(&forced, token + 1).await? {
        ForceOutcome::TokenMismatch { held: Some(t) } if t == token => {}
        answer => return Err(format!("a wrong token answered {answer:?}").into()),
    }
    sleep(INTERVAL * 2).await;
    lease
        .assert_held()
        .map_err(|e| format!("a refused forced release hurt the holder: {e}"))?;

    let asked = Instant::now();
    if op.force_release(&forced, token).await? != ForceOutcome::Released {
        return Err("the right token was not released".into());
    }
    let reason = timeout(Duration::from_secs(3), lease.lost())
        .await
        .map_err(|_| "the holder did not learn of the forced release within 3 s")?;
    let to_lost = asked.elapsed();
    eprintln!("postgres: force_release to the holder's lost(): {to_lost:?} (renewal interval {INTERVAL:?})");
    if reason != LossReason::Forced {
        return Err(format!("the holder lost its lease as {reason:?}").into());
    }
    // One interval, and the suite's tolerance for a loaded machine.
    if to_lost > INTERVAL + Duration::from_millis(400) {
        return Err(format!("the holder learnt it after {to_lost:?}, over one interval").into());
    }
    match timeout(Duration::from_secs(3), job).await {
        Ok(Ok(Ok(RunOutcome::Aborted(LossReason::Forced)))) => {}
        other => return Err(format!("the guarded job ended as {other:?}").into()),
    }
    if holder.metrics().losses(forced.as_str(), LossReason::Forced) != 1 {
        return Err("the loss was not counted under reason forced".into());
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let next = loop {
        match waiter.try_lock(&forced, &opts).await {
            Ok(g) => break g,
            Err(Error::HeldElsewhere { .. }) if Instant::now() < deadline => {
                sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(format!("the waiter did not get the lock: {e}").into()),
        }
    };
    eprintln!(
        "postgres: force_release to the waiter's acquire: {:?}",
        asked.elapsed()
    );
    let next_token = next.handle().fencing_token().ok_or("no token")?;
    if next_token <= token {
        return Err(format!("the next holder's token {next_token} is not above {token}").into());
    }
    let described = op
        .describe(&forced)
        .await?
        .ok_or("the waiter's lock described free")?;
    if described.fencing_token != Some(next_token)
        || described.identity.as_ref().map(Identity::as_str) != Some("waiter")
    {
        return Err(format!("after the handover: {described:?}").into());
    }

    // The other lease on the holder's session kept its lock throughout.
    sleep(INTERVAL * 2).await;
    other.assert_held()?;
    let kept_key = holder_backend.config().key_for(&kept);
    if holder_pid(&inspector, kept_key).await? != Some(pid) {
        return Err("the other lease on the holder's session lost its lock".into());
    }
    let still = op
        .describe(&kept)
        .await?
        .ok_or("the other lease described free")?;
    if still.fencing_token != kept_token {
        return Err(format!("the other lease is described as {still:?}").into());
    }
    if holder.metrics().losses(kept.as_str(), LossReason::Forced) != 0 {
        return Err("the other lease was counted lost".into());
    }
    other.release().await?;
    next.release().await?;
    Ok(())
}

/// A role with `SELECT` on the holder tables and no other right describes
/// and lists; its forced release is refused as not permitted, and changes
/// nothing.
async fn inspect_with_select_only(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    use super::server::ROLE_NO_CREATE;
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let holder = locker_as(Arc::new(backend_as(&f, "postgres").await?), "holder")?;
    let n = name(&f, "read-only");
    let guard = holder.try_lock(&n, &LockOptions::new(TTL)).await?;
    inspector
        .batch_execute(&format!(
            "GRANT SELECT ON lock_holders, lock_holders_sessions TO {ROLE_NO_CREATE}"
        ))
        .await?;
    let outcome = async {
        let reader = locker_as(Arc::new(backend_as(&f, ROLE_NO_CREATE).await?), "reader")?;
        let seen = reader.describe(&n).await?.ok_or("described free")?;
        if seen.fencing_token != guard.handle().fencing_token()
            || seen.identity.as_ref().map(Identity::as_str) != Some("holder")
        {
            return Err(format!("a read-only role described {seen:?}").into());
        }
        let page = reader.list(n.as_str(), None, 10).await?;
        if page.holders.len() != 1 {
            return Err(format!("a read-only role listed {:?}", page.holders).into());
        }
        let token = seen.fencing_token.ok_or("no token")?;
        match reader.force_release(&n, token).await {
            Err(Error::Backend(e)) if e.kind() == BackendErrorKind::Auth => {}
            other => return Err(format!("a forced release without UPDATE: {other:?}").into()),
        }
        sleep(INTERVAL * 2).await;
        guard.assert_held()?;
        Ok::<(), BoxError>(())
    }
    .await;
    inspector
        .batch_execute(&format!(
            "REVOKE SELECT ON lock_holders, lock_holders_sessions FROM {ROLE_NO_CREATE}"
        ))
        .await?;
    outcome?;
    guard.release().await?;
    Ok(())
}

/// A holder that does not renew (a stopped process; here leases taken
/// straight through the trait, with no heartbeat) keeps its lock after a
/// forced release's mark. `terminate_holder` then ends its session, but
/// only once told to end the other leases on it too.
async fn force_release_of_a_holder_that_does_not_renew(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let stopped = backend_as(&f, "postgres").await?;
    let op_backend = backend_as(&f, "postgres").await?;
    let op = locker_as(Arc::new(op_backend.clone()), "operator")?;
    let (a, b) = (name(&f, "stopped-a"), name(&f, "stopped-b"));
    let (owner_a, owner_b) = (OwnerToken::generate()?, OwnerToken::generate()?);
    let who = Identity::new("stopped")?;
    let mut tokens = Vec::new();
    for (n, owner) in [(&a, &owner_a), (&b, &owner_b)] {
        match stopped.try_acquire_as(n, owner, TTL, &who).await? {
            AcquireAttempt::Acquired(lease) => tokens.push(lease.fencing_token.ok_or("no token")?),
            other => return Err(format!("setup: {other:?}").into()),
        }
    }
    let (token_a, token_b) = (tokens[0], tokens[1]);
    if op.force_release(&a, token_a).await? != ForceOutcome::Released {
        return Err("the mark was refused".into());
    }
    sleep(INTERVAL * 3).await;
    if op.describe(&a).await?.is_none() {
        return Err("a holder that never renewed lost its lock to a mark alone".into());
    }
    match op_backend.terminate_holder(&a, token_a + 1, true).await? {
        ForceOutcome::TokenMismatch { held: Some(t) } if t == token_a => {}
        other => return Err(format!("terminate with a wrong token: {other:?}").into()),
    }
    match op_backend.terminate_holder(&a, token_a, false).await {
        Err(e) if e.kind() == BackendErrorKind::Config && e.message().contains("1 other") => {}
        other => return Err(format!("terminate beside another lease: {other:?}").into()),
    }
    if op.describe(&b).await?.is_none() || op.describe(&a).await?.is_none() {
        return Err("a refused terminate freed a lock".into());
    }
    if op_backend.terminate_holder(&a, token_a, true).await? != ForceOutcome::Released {
        return Err("terminate with the right token did not end the session".into());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while op.describe(&a).await?.is_some() || op.describe(&b).await?.is_some() {
        if Instant::now() > deadline {
            return Err("the terminated session's locks are still held after 5 s".into());
        }
        sleep(Duration::from_millis(20)).await;
    }
    if op_backend.terminate_holder(&b, token_b, true).await? != ForceOutcome::NotHeld {
        return Err("a freed lock was not NotHeld".into());
    }
    Ok(())
}

/// With holder records off, a backend writes no row: its locks are still
/// described as held, by an unknown holder.
async fn inspect_without_holder_records(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let config = f.builder_for(&url)?.with_holder_records(false).config()?;
    let quiet = locker_as(Arc::new(PostgresBackend::connect(config).await?), "quiet")?;
    let op = operator(&f).await?;
    let n = name(&f, "unrecorded");
    let guard = quiet.try_lock(&n, &LockOptions::new(TTL)).await?;
    sleep(INTERVAL * 2).await;
    let seen = op
        .describe(&n)
        .await?
        .ok_or("an unrecorded lock described free")?;
    if seen.identity.is_some() || seen.fencing_token.is_some() {
        return Err(format!("an unrecorded lock described as {seen:?}").into());
    }
    let rows: i64 = inspector
        .query_one(
            "SELECT count(*) FROM lock_holders WHERE name = $1",
            &[&n.as_str()],
        )
        .await?
        .get(0);
    if rows != 0 {
        return Err("holder records off, a row was written".into());
    }
    guard.assert_held()?;
    guard.release().await?;
    if op.describe(&n).await?.is_some() {
        return Err("described after release".into());
    }
    Ok(())
}
