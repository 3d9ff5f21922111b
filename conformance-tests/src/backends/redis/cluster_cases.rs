//! Redis Cluster cases, as `redis_cluster::<case>` trials: the key layout
//! against the server's slots, batch renewal across slots, and the re-sent
//! acquire.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_core::backend::{AcquireAttempt, LeaseStatus, RenewRequest};
use lock_core::{LockBackend, LockName, OwnerToken};
use lock_redis::cluster_key_slot;
use redis::cluster_async::ClusterConnection;

use super::cluster_factory::ClusterFactory;
use super::specific::{ensure, TRIAL_TIMEOUT};
use super::TTL;
use crate::harness::push_bounded;
use crate::{BoxError, Saboteur, Suite};

/// Adds the cluster trials, run against `factory`'s cluster.
pub(super) fn register(suite: &mut Suite, factory: &Arc<ClusterFactory>) {
    let table = crate::trial_table![
        "key_layout_matches_server_slots" => key_layout_matches_server_slots,
        "renew_many_by_slot_keeps_order" => renew_many_by_slot_keeps_order,
        "acquire_regrants_own_token" => acquire_regrants_own_token,
    ];
    push_bounded(suite, "redis_cluster", factory, TRIAL_TIMEOUT, &table);
}

/// A plain cluster client (not the library's) for reading what is stored.
pub(super) async fn plain_cluster(f: &ClusterFactory) -> Result<ClusterConnection, BoxError> {
    let client = redis::cluster::ClusterClient::builder(f.set()?.node_urls())
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .build()?;
    Ok(tokio::time::timeout(Duration::from_secs(5), client.get_async_connection()).await??)
}

/// `CLUSTER KEYSLOT` of each key, asked of one node in one pipeline.
async fn server_slots(f: &ClusterFactory, keys: &[String]) -> Result<Vec<u16>, BoxError> {
    let port = *f.set()?.primaries()?.first().ok_or("no primary")?;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut c = client.get_multiplexed_async_connection().await?;
    let mut p = redis::pipe();
    for k in keys {
        p.cmd("CLUSTER").arg("KEYSLOT").arg(k);
    }
    Ok(p.query_async(&mut c).await?)
}

/// Our slot function agrees with the server's on keys with and without
/// hash tags, and every lock key shares its slot with its fencing counter.
async fn key_layout_matches_server_slots(f: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let backend = f.connect().await?;
    let mut keys: Vec<String> = vec![
        "foo".into(),
        "{user1000}.following".into(),
        "foo{}{bar}".into(),
        "foo{{bar}}zap".into(),
        "foo{bar}{zap}".into(),
        "no{close".into(),
        "}{".into(),
        "{}".into(),
        "a{b}".into(),
    ];
    for i in 0..2_000 {
        keys.push(format!("{}k{i}:{}", f.prefix(), i * 7919));
        keys.push(format!("x{{{}}}y", i * 31));
    }
    let ours: Vec<u16> = keys
        .iter()
        .map(|k| cluster_key_slot(k.as_bytes()))
        .collect();
    let theirs = server_slots(&f, &keys).await?;
    for ((k, a), b) in keys.iter().zip(&ours).zip(&theirs) {
        ensure(a == b, format!("{k:?}: our slot {a}, the server's {b}"))?;
    }
    let mut pairs = Vec::new();
    for i in 0..500 {
        let name = LockName::new(format!("layout/{i}"))?;
        pairs.push(backend.key_for(&name));
        pairs.push(backend.fence_key_for(&name));
    }
    let slots = server_slots(&f, &pairs).await?;
    for (k, s) in pairs.chunks(2).zip(slots.chunks(2)) {
        ensure(
            s.first() == s.get(1),
            format!("{k:?} are in slots {s:?}: one script could not touch both"),
        )?;
    }
    eprintln!(
        "    [redis_cluster] {} keys: our slot function agrees with CLUSTER KEYSLOT; 500 lock keys share a slot with their counter",
        keys.len()
    );
    Ok(())
}

/// 31 leases over every primary, some expired and some stolen, renewed in
/// one batch: each status lands at its request's index, held leases are
/// extended, the others are left alone.
async fn renew_many_by_slot_keeps_order(f: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let backend = f.connect().await?;
    let saboteur = f.saboteur().await?;
    let mut plain = plain_cluster(&f).await?;
    let set = Arc::clone(f.set()?);
    let primaries: BTreeSet<u16> = set.primaries()?.into_iter().collect();
    let run = format!("{:x}", rand_suffix());
    let names: Vec<LockName> = (0..31)
        .map(|i| LockName::new(format!("batch/{run}/{i}")))
        .collect::<Result<_, _>>()?;
    let mut covered = BTreeSet::new();
    for n in &names {
        covered.insert(set.owner_of(cluster_key_slot(backend.key_for(n).as_bytes()))?);
    }
    ensure(
        covered == primaries,
        format!("the names cover primaries {covered:?} of {primaries:?}"),
    )?;
    let mut requests = Vec::new();
    for name in &names {
        let owner = OwnerToken::generate()?;
        let got = backend.try_acquire(name, &owner, TTL * 3).await?;
        ensure(
            matches!(got, AcquireAttempt::Acquired(_)),
            format!("{name}: {got:?}"),
        )?;
        requests.push(RenewRequest {
            name: name.clone(),
            owner,
            ttl: TTL * 10,
        });
    }
    // Every third lease expired, every fifth (not already expired) stolen.
    let mut expected = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if i % 3 == 1 {
            saboteur.expire(name).await?;
            expected.push(LeaseStatus::Expired);
        } else if i % 5 == 2 {
            saboteur.steal(name, TTL * 3).await?;
            expected.push(LeaseStatus::Stolen);
        } else {
            expected.push(LeaseStatus::Held);
        }
    }
    // Requests in an order unrelated to slots, the answer in the same order.
    requests.reverse();
    expected.reverse();
    let started = Instant::now();
    let got = backend.renew_many(&requests).await?;
    let took = started.elapsed();
    ensure(
        got == expected,
        format!("renew_many answered {got:?}, expected {expected:?}"),
    )?;
    for (r, status) in requests.iter().zip(&expected) {
        let key = backend.key_for(&r.name);
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut plain).await?;
        match status {
            LeaseStatus::Held => ensure(pttl > 5_000, format!("{key} not extended: {pttl} ms"))?,
            LeaseStatus::Stolen => {
                ensure(pttl <= 3_000, format!("the thief's {key} was extended"))?
            }
            _ => ensure(
                pttl == -2,
                format!("the expired {key} was re-created ({pttl})"),
            )?,
        }
    }
    eprintln!(
        "    [redis_cluster] renew_many of 31 leases over {} primaries: {took:?}",
        primaries.len()
    );
    for r in &requests {
        let _ = backend.release(&r.name, &r.owner).await?;
        saboteur.clear(&r.name).await?;
    }
    Ok(())
}

/// An acquire re-sent with the same owner token (as the cluster client does
/// after an I/O error) is granted with a higher token; another owner is not.
async fn acquire_regrants_own_token(f: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let backend = f.connect().await?;
    regrant(&backend, &format!("regrant/{:x}", rand_suffix())).await
}

/// The body of the re-sent acquire case, on any Redis backend.
pub(super) async fn regrant(backend: &dyn LockBackend, name: &str) -> Result<(), BoxError> {
    let name = LockName::new(name)?;
    let (a, b) = (OwnerToken::generate()?, OwnerToken::generate()?);
    let first = backend.try_acquire(&name, &a, TTL).await?;
    let again = backend.try_acquire(&name, &a, TTL).await?;
    let other = backend.try_acquire(&name, &b, TTL).await?;
    let released = backend.release(&name, &a).await;
    let (AcquireAttempt::Acquired(l1), AcquireAttempt::Acquired(l2)) = (&first, &again) else {
        return Err(format!("first {first:?}, re-sent {again:?}").into());
    };
    ensure(
        l2.fencing_token > l1.fencing_token,
        format!(
            "re-sent acquire token {:?} after {:?}",
            l2.fencing_token, l1.fencing_token
        ),
    )?;
    ensure(
        matches!(other, AcquireAttempt::HeldElsewhere),
        format!("another owner got {other:?}"),
    )?;
    released?;
    Ok(())
}

fn rand_suffix() -> u64 {
    getrandom::u64().unwrap_or(0)
}
