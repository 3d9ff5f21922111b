//! `retain_for` while a heartbeat renewal is in flight: the completion mark
//! it leaves must not be taken for a lost lease.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use libtest_mimic::Failed;
use lock_core::{LossReason, RenewalOutcome};
use tokio::time::{timeout, Instant};

use super::ensure;
use crate::backends::etcd::{server, EtcdFactory, EtcdSaboteur};
use crate::Ctx;

/// Longer than the renewal is parked, on a loaded machine: the parked
/// renewal must end by reading the key, not by timing out.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A heartbeat renewal has kept the lease alive and is about to read the
/// key when `retain_for(hold)` is called. `retain_for` waits for it, then
/// moves the key to a lease of `hold`; the key must stay until `hold` has
/// passed and then end by itself, no `expired` renewal or loss may be
/// counted, and the lease must not be marked lost.
pub(super) async fn retain_during_renewal_keeps_the_mark(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let backend =
        server::connect_when_ready(f.builder()?.with_request_timeout(REQUEST_TIMEOUT)).await?;
    let replica = ctx.replica_over(Arc::new(backend.clone()));
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let timing = ctx.timing();
    let opts = ctx.opts();
    let hold = timing.ttl * 2;
    let name = ctx.name("retained-mid-renewal");
    let key = backend.key_for(&name);
    let label = name.as_str();

    let pause = backend
        .pause_next_renewal_before_read()
        .ok_or("a connected backend arms a renewal pause")?;
    let guard = replica.locker.try_lock(&name, &opts).await?;
    let handle = guard.handle();
    let first_lease = sab
        .lease_of(&name)
        .await?
        .ok_or("the held key is missing")?;
    timeout(
        opts.renew_interval() + timing.tolerance * 2,
        pause.reached(),
    )
    .await
    .map_err(|_| "no heartbeat renewal reached the pause point")?;

    let mut events = sab
        .client()
        .watch(key.as_str(), None::<WatchOptions>)
        .await?;
    // Deletes are seen only once the server has created the watch.
    let created = events.message().await?.is_some_and(|r| r.created());
    ensure(created, || "the watch on the key was not created".into())?;
    let retained_at = Instant::now();
    // lock-core lets the in-flight renewal land before it sets the hold, so
    // retain_for waits while the renewal is parked.
    let mut retain = tokio::spawn(guard.retain_for(hold));
    let early_end = timeout(timing.tolerance, &mut retain).await;
    ensure(early_end.is_err(), || {
        format!("retain_for returned while a renewal was still in flight: {early_end:?}")
    })?;
    pause.resume();
    retain.await??;
    let mark_lease = sab
        .lease_of(&name)
        .await?
        .ok_or("retain_for deleted the key")?;
    ensure(mark_lease != first_lease, || {
        "retain_for left the key on its first lease".into()
    })?;

    // The key must stay until `hold` has passed, then end by itself (etcd
    // checks for expired leases every 500 ms).
    let limit = hold + timing.ttl / 8 + timing.tolerance;
    let deleted = timeout(limit, async {
        while let Some(resp) = events.message().await? {
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return Ok::<_, etcd_client::Error>(true);
            }
        }
        Ok(false)
    })
    .await
    .map_err(|_| format!("the mark outlived its hold: still there {limit:?} after retain_for"))??;
    let gone_after = retained_at.elapsed();
    ensure(deleted, || "the watch ended before the key went".into())?;
    let early = gone_after < hold.saturating_sub(timing.tolerance);
    if early {
        // Let a false loss land before looking, so the report says all of it.
        let _ = timeout(timing.tolerance, handle.lost()).await;
    }
    let expired = replica.metrics.renewals(label, RenewalOutcome::Expired);
    let lost = replica.metrics.losses(label, LossReason::Expired);
    let mut wrong = Vec::new();
    if early {
        wrong.push(format!(
            "the completion mark went {gone_after:?} after retain_for({hold:?})"
        ));
    }
    if let Some(reason) = handle.loss_reason().filter(|r| r.is_loss()) {
        wrong.push(format!("the retained lease was marked lost ({reason})"));
    }
    if expired != 0 || lost != 0 {
        wrong.push(format!(
            "{expired} expired renewals and {lost} expiry losses were counted"
        ));
    }
    ensure(wrong.is_empty(), || wrong.join("; "))?;
    let renewed = replica.metrics.renewals(label, RenewalOutcome::Renewed);
    println!(
        "etcd: mark kept by retain_for({hold:?}) during a parked renewal went after \
         {gone_after:?}; the parked renewal counted {renewed} renewed, 0 expired"
    );
    Ok(())
}
