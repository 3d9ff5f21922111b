//! A backend built while its cluster is down keeps what it promised before
//! it connected: its `Locker`s were built on it.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Failed;
use lock_core::{Error, LockOptions};
use tokio::time::{sleep, Instant};

use super::ensure;
use crate::backends::etcd::{server, EtcdFactory, EtcdSaboteur};
use crate::harness::free_port;
use crate::Ctx;

/// The member's election timeout: etcd raises every lease TTL below 1.5 ×
/// it, so this member grants at least 3 s, more than the 2 s minimum a
/// backend built without contacting its cluster assumes.
const ELECTION_MS: &str = "2000";

/// Longest the member may take to listen and elect itself.
const READY: Duration = Duration::from_secs(20);

/// A backend built while nothing listens on its port, and a `Locker` over it
/// that read its minimum TTL then (2 s). Then a member whose minimum lease
/// TTL is 3 s starts there. Locks with the TTL the backend promised must be
/// granted (the server lengthens their leases, which only delays a takeover),
/// renewed, and released: not refused as misconfigured for ever.
pub(super) async fn deferred_backend_keeps_its_min_ttl(
    _f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    // Distinct: free_port never hands out a port twice.
    let (port, peer) = (free_port()?, free_port()?);
    let backend = server::builder(port).build()?;
    let promised = backend.min_ttl();
    let replica = ctx.replica_over(Arc::new(backend.clone()));
    let opts = LockOptions::new(promised);
    let name = ctx.name("deferred-min-ttl");
    let down = replica.locker.try_lock(&name, &opts).await;
    ensure(
        matches!(&down, Err(Error::Unavailable { source, .. }) if source.kind().is_unavailable()),
        || format!("an acquire before the cluster listens: {down:?}"),
    )?;

    let _member = server::start_on(port, peer, ELECTION_MS)?;
    let started = Instant::now();
    let guard = loop {
        match replica.locker.try_lock(&name, &opts).await {
            Ok(guard) => break guard,
            Err(Error::Unavailable { source, .. })
                if source.kind().is_unavailable() && started.elapsed() < READY =>
            {
                sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                return Err(format!(
                    "once etcd answered, an acquire with the minimum TTL the backend \
                     promised ({promised:?}) failed: {e}"
                )
                .into())
            }
        }
    };
    let measured = server::connect_when_ready(server::builder(port))
        .await?
        .min_ttl();
    ensure(measured > promised, || {
        format!(
            "the member's minimum lease TTL is {measured:?}, not above the promised {promised:?}"
        )
    })?;
    ensure(backend.min_ttl() == promised, || {
        format!(
            "the backend's minimum TTL went from {promised:?} to {:?} after it connected",
            backend.min_ttl()
        )
    })?;
    // Held through several renewals of the lease the server lengthened.
    sleep(promised * 2).await;
    let handle = guard.handle();
    ensure(handle.assert_held().is_ok(), || {
        format!("the lock was lost ({:?})", handle.loss_reason())
    })?;
    guard.renew().await?;
    guard.release().await?;
    let sab = EtcdSaboteur::connect_default(&[format!("http://127.0.0.1:{port}")]).await?;
    ensure(sab.lease_of(&name).await?.is_none(), || {
        "the released key is still there".into()
    })?;
    println!(
        "etcd: a backend built while its cluster was down kept its {promised:?} minimum \
         after a member with a {measured:?} minimum answered"
    );
    Ok(())
}
