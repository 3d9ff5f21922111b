//! The shared lease: an acquire just before it would lapse still gets a
//! full TTL, and a release that got no answer still frees its key.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Failed;
use lock_core::{
    backend::{AcquireAttempt, LeaseStatus},
    Error, LockBackend, LockOptions, OwnerToken,
};
use tokio::time::{sleep, sleep_until, timeout, Instant};

use super::ensure;
use crate::backends::etcd::{server, EtcdFactory, EtcdSaboteur};
use crate::proxy::FaultProxy;
use crate::{BackendFactory, Ctx};

/// The TTL of these trials: etcd's default minimum lease TTL.
const TTL: Duration = Duration::from_secs(2);

/// How long before the lease would lapse the second acquire starts.
const LATE: Duration = Duration::from_millis(250);

/// Lock A takes the shared lease at t0 and nothing renews it. Lock B is
/// acquired at t0 + TTL - 250 ms: without a keep-alive sent after B's call,
/// the lease (and B's key) would go about t0 + TTL (+ etcd's 500 ms expiry
/// sweep). B's key must still be there at its own start + TTL - 150 ms.
pub(super) async fn acquire_near_lease_lapse_gets_full_ttl(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let (backend, sab) = f.connect_with_saboteur().await?;
    let ttl = TTL.max(backend.min_ttl());
    let (a, b) = (ctx.name("lapse-a"), ctx.name("lapse-b"));
    let (oa, ob) = (OwnerToken::generate()?, OwnerToken::generate()?);
    let t0 = Instant::now();
    let got = backend.try_acquire(&a, &oa, ttl).await?;
    ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
        format!("a: {got:?}")
    })?;
    sleep_until(t0 + ttl - LATE).await;
    let t1 = Instant::now();
    let got = backend.try_acquire(&b, &ob, ttl).await?;
    ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
        format!("b: {got:?}")
    })?;
    let lease = sab.lease_of(&b).await?.ok_or("b's key is missing")?;
    ensure(sab.lease_of(&a).await? == Some(lease), || {
        "a and b are not on one shared lease".into()
    })?;
    sleep_until(t1 + ttl - Duration::from_millis(150)).await;
    let status = backend.check(&b, &ob).await?;
    ensure(status == LeaseStatus::Held, || {
        format!(
            "b was {status:?} {:?} after its acquire started (TTL {ttl:?}); \
             the shared lease was last kept alive for a",
            t1.elapsed()
        )
    })?;
    for (name, owner) in [(&a, &oa), (&b, &ob)] {
        backend.release(name, owner).await?;
    }
    println!(
        "etcd: a lock acquired {LATE:?} before its shared lease would lapse was still held {:?} after its call",
        t1.elapsed()
    );
    Ok(())
}

/// How long after lock A's acquire lock B's starts: well inside the sixth
/// of the TTL within which an earlier keep-alive proves the lease for B.
const SOON: Duration = Duration::from_millis(150);

/// Waits until no keep-alive sent so far can prove the shared lease for a
/// new acquire (one is reused within a sixth of the TTL), so that the next
/// acquire sends its own. Otherwise the first acquire of a step may reuse
/// the previous step's proof, and the second one, 150 ms later, finds that
/// proof too old and sends a fresh keep-alive: a full grant where the case
/// expects a reused one (seen on a loaded machine).
async fn outlive_earlier_proofs(ttl: Duration) {
    sleep(ttl / 3).await;
}

/// Most trials of [`acquire_soon_after_another_reuses_its_proof`]: one
/// whose acquires were delayed past a sixth of the TTL (a loaded machine)
/// proves nothing and is run again.
const TRIALS: usize = 3;

/// Lock A's acquire at t0 proves the shared lease with a keep-alive sent
/// after t0 (and before A's call returned, at ta). Lock B, acquired 150 ms
/// later at t1, reuses that proof instead of sending its own: its grant
/// says the server keeps it for less than the TTL, and never longer than
/// the proof covers (ta + TTL - t1). Then, through a `Locker`, a lock taken
/// the same way is valid locally for less than the TTL, renewed in time
/// for that, and still held after three TTLs.
pub(super) async fn acquire_soon_after_another_reuses_its_proof(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let backend = f.connect().await?;
    let ttl = TTL.max(backend.min_ttl());
    let mut reused = None;
    for trial in 0..TRIALS {
        if trial > 0 {
            outlive_earlier_proofs(ttl).await;
        }
        let (a, b) = (
            ctx.name(&format!("soon-a{trial}")),
            ctx.name(&format!("soon-b{trial}")),
        );
        let (oa, ob) = (OwnerToken::generate()?, OwnerToken::generate()?);
        let t0 = Instant::now();
        let got = backend.try_acquire(&a, &oa, ttl).await?;
        let ta = Instant::now();
        ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
            format!("a: {got:?}")
        })?;
        sleep_until(t0 + SOON).await;
        let t1 = Instant::now();
        let got = backend.try_acquire(&b, &ob, ttl).await?;
        let tb = Instant::now();
        for (name, owner) in [(&a, &oa), (&b, &ob)] {
            backend.release(name, owner).await?;
        }
        let AcquireAttempt::Acquired(lease) = got else {
            return Err(format!("b: {got:?}").into());
        };
        if let Some(lasts) = lease.lasts_at_least {
            ensure(
                lasts < ttl && lasts <= (ta + ttl).saturating_duration_since(t1),
                || {
                    format!(
                        "b's grant says the server keeps it {lasts:?}, more than the \
                     proof sent before {:?} ago covers (TTL {ttl:?})",
                        t1 - ta
                    )
                },
            )?;
            reused = Some(lasts);
            break;
        }
        ensure(tb - t0 >= ttl / 6, || {
            format!(
                "b started {:?} after a's acquire and sent a keep-alive of its own \
                 instead of reusing a's",
                t1 - t0
            )
        })?;
    }
    let lasts = reused.ok_or("every trial was delayed past a sixth of the TTL")?;

    let replica = ctx.replica_over(Arc::new(backend.clone()));
    let opts = LockOptions::new(ttl);
    let (c, d) = (ctx.name("soon-c"), ctx.name("soon-d"));
    outlive_earlier_proofs(ttl).await;
    let t0 = Instant::now();
    let first = replica.locker.try_lock(&c, &opts).await?;
    sleep_until(t0 + SOON).await;
    let second = replica.locker.try_lock(&d, &opts).await?;
    let left = second
        .handle()
        .remaining_validity()
        .ok_or("a backend lease has a deadline")?;
    let full = ttl - opts.drift();
    // Both acquires within a sixth of the TTL: the second reused a proof.
    if t0.elapsed() < ttl / 6 {
        ensure(left < full - SOON / 2, || {
            format!("a lock on a reused proof is valid locally {left:?}, as long as a full grant")
        })?;
    }
    sleep_until(t0 + ttl * 3).await;
    ensure(
        second.handle().is_held() && first.handle().is_held(),
        || {
            format!(
                "after three TTLs: first held {}, second {} ({:?})",
                first.handle().is_held(),
                second.handle().is_held(),
                second.handle().loss_reason()
            )
        },
    )?;
    first.release().await?;
    second.release().await?;
    println!(
        "etcd: a lock acquired {SOON:?} after another was granted for {lasts:?} of its {ttl:?} \
         on that one's keep-alive, and through a Locker stayed held"
    );
    Ok(())
}

/// A release that gets no answer (the connection is cut, then reset) on a
/// shared lease that another lock keeps alive: its key is deleted once the
/// connection is back, within about one TTL, and the other lock stays held.
/// Then, cut off for good: the key still frees within the TTL (nothing keeps
/// the lease alive), as a lease of its own would.
pub(super) async fn unanswered_release_frees_the_key(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let upstream = f.server_addr().ok_or("no private etcd")?;
    let proxy = FaultProxy::start(upstream).await?;
    let backend = server::connect_when_ready(server::builder(proxy.addr().port())).await?;
    let replica = ctx.replica_over(Arc::new(backend.clone()));
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let opts = LockOptions::new(TTL.max(backend.min_ttl()));
    let ttl = opts.ttl();
    let tolerance = ctx.timing().tolerance;

    for cut_for_good in [false, true] {
        let tag = if cut_for_good { "cut" } else { "healed" };
        let (kept, released) = (
            ctx.name(&format!("kept-{tag}")),
            ctx.name(&format!("released-{tag}")),
        );
        let keeper = replica.locker.try_lock(&kept, &opts).await?;
        let guard = replica.locker.try_lock(&released, &opts).await?;
        let handle = keeper.handle();
        proxy.blackhole(true);
        let started = Instant::now();
        let outcome = guard.release().await;
        ensure(outcome.is_err(), || {
            format!("{tag}: the release through a cut connection succeeded")
        })?;
        if !cut_for_good {
            // The held request must never arrive: drop it with the connection.
            proxy.reset_all();
            proxy.blackhole(false);
        }
        let gone = timeout(ttl + tolerance * 2, async {
            loop {
                if sab.lease_of(&released).await?.is_none() {
                    return Ok::<_, Failed>(started.elapsed());
                }
                sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .map_err(|_| {
            format!(
                "{tag}: the released key outlived its TTL ({ttl:?}) + {:?}",
                tolerance * 2
            )
        })??;
        ensure(gone <= ttl + tolerance, || {
            format!("{tag}: the released key went {gone:?} after the release (TTL {ttl:?})")
        })?;
        if cut_for_good {
            proxy.reset_all();
            proxy.blackhole(false);
            let _ = timeout(ttl, handle.lost()).await;
            ensure(handle.assert_held().is_err(), || {
                format!("{tag}: the other lock is still held after the cut")
            })?;
        } else {
            ensure(handle.assert_held().is_ok(), || {
                format!(
                    "{tag}: the other lock was lost ({:?})",
                    handle.loss_reason()
                )
            })?;
            // It is still held a TTL later: its lease is still kept alive.
            sleep(ttl).await;
            ensure(handle.assert_held().is_ok(), || {
                format!(
                    "{tag}: the other lock was lost later ({:?})",
                    handle.loss_reason()
                )
            })?;
        }
        println!(
            "etcd: released key went {gone:?} after an unanswered release ({tag}; TTL {ttl:?})"
        );
        let _ = keeper.release().await;
    }
    Ok(())
}

/// How much later than its acquire's caller gave up the given-up put reaches
/// the server.
const PUT_LATE: Duration = Duration::from_millis(300);

/// An acquire given up while its put is on its way: the `Locker`'s clean-up
/// release reaches the server first (finding nothing), then the put lands on
/// the shared lease, which another lock held here keeps alive. The key must
/// still go: the acquire runs to its answer and deletes what it took, within
/// a tolerance of the put, and the other lock is kept. Left alone, the key
/// would be held by nobody for as long as this process renewed that lease.
pub(super) async fn late_put_of_a_given_up_acquire_is_undone(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let backend = f.connect().await?;
    let here = ctx.replica_over(Arc::new(backend.clone()));
    let there = ctx.replica_over(Arc::new(f.connect().await?));
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let opts = LockOptions::new(TTL.max(backend.min_ttl()));
    let tolerance = ctx.timing().tolerance;
    let (kept, given_up) = (ctx.name("late-put-kept"), ctx.name("late-put"));
    let keeper = here.locker.try_lock(&kept, &opts).await?;
    let mut changes = sab.watch_changes(&given_up).await?;
    ensure(backend.delay_next_put(&given_up, PUT_LATE), || {
        "the backend is not connected".into()
    })?;
    let attempt = timeout(PUT_LATE / 6, here.locker.try_lock(&given_up, &opts)).await;
    ensure(attempt.is_err(), || {
        format!("the acquire answered before its delayed put: {attempt:?}")
    })?;
    let put = timeout(PUT_LATE + tolerance, changes.recv()).await;
    ensure(matches!(put, Ok(Some(true))), || {
        format!("the delayed put never landed: {put:?}")
    })?;
    let landed = Instant::now();
    let deleted = timeout(tolerance, changes.recv()).await;
    ensure(matches!(deleted, Ok(Some(false))), || {
        format!(
            "the key a given-up acquire put late was not deleted within {tolerance:?}: {deleted:?}"
        )
    })?;
    let after = landed.elapsed();
    let taken = there.locker.try_lock(&given_up, &opts).await?;
    taken.release().await?;
    ensure(keeper.assert_held().is_ok(), || {
        "the other lock on the shared lease was lost".into()
    })?;
    keeper.release().await?;
    println!("etcd: the key an acquire put after its caller had gone was deleted {after:?} later");
    Ok(())
}

/// The request timeout of [`shared_lease_ending_mid_acquire_is_not_held`]'s
/// backend: an acquire parked at a pause point still runs within it.
const PARKED_TIMEOUT: Duration = Duration::from_secs(5);

/// Where [`shared_lease_ending_mid_acquire_is_not_held`] parks the acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parked {
    /// Its shared lease is proven alive; its hold is not recorded yet.
    BeforeRecord,
    /// Its hold is recorded; it has not answered yet.
    AfterRecord,
}

/// The shared lease ends (revoked on the server, then found gone by a
/// renewal of another lock on it) while an acquire on it is parked, once
/// before it records its hold and once after. The acquire's key went with
/// the lease, so its answer must never be a lock that says held: parked
/// before the record, it either takes the lock again on a new shared lease
/// (its key is then on the server, and another replica is refused) or the
/// loss is reported; parked after, the loss is reported: the `Locker` gets
/// it before it hands the lease out and answers that the lock ended as it
/// was granted (or a guard that says lost).
pub(super) async fn shared_lease_ending_mid_acquire_is_not_held(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let backend =
        server::connect_when_ready(f.builder()?.with_request_timeout(PARKED_TIMEOUT)).await?;
    let here = ctx.replica_over(Arc::new(backend.clone()));
    let there = ctx.replica_over(Arc::new(f.connect().await?));
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let opts = LockOptions::new(TTL.max(backend.min_ttl()));
    let tolerance = ctx.timing().tolerance;
    for parked in [Parked::BeforeRecord, Parked::AfterRecord] {
        let tag = match parked {
            Parked::BeforeRecord => "before",
            Parked::AfterRecord => "after",
        };
        let (kept, caught) = (
            ctx.name(&format!("mid-acquire-kept-{tag}")),
            ctx.name(&format!("mid-acquire-{tag}")),
        );
        let keeper = here.locker.try_lock(&kept, &opts).await?;
        let lease = sab
            .lease_of(&kept)
            .await?
            .ok_or("the kept key is missing")?;
        let pause = match parked {
            Parked::BeforeRecord => backend.pause_next_acquire_before_record(&caught),
            Parked::AfterRecord => backend.pause_next_acquire_after_record(&caught),
        }
        .ok_or("the backend is not connected")?;
        let acquire = {
            let (locker, name, opts) = (here.locker.clone(), caught.clone(), opts.clone());
            tokio::spawn(async move { locker.try_lock(&name, &opts).await })
        };
        timeout(tolerance * 2, pause.reached())
            .await
            .map_err(|_| format!("{tag}: the acquire never reached the pause point"))?;
        ensure(sab.lease_of(&caught).await? == Some(lease), || {
            format!("{tag}: the parked acquire's key is not on the kept lock's shared lease")
        })?;
        sab.client().lease_client().revoke(lease).await?;
        let renewed = keeper.handle().renew().await;
        ensure(keeper.assert_held().is_err(), || {
            format!(
                "{tag}: the kept lock still says held after its lease was revoked \
                 (renewal: {renewed:?})"
            )
        })?;
        pause.resume();
        let answer = timeout(PARKED_TIMEOUT + tolerance, acquire)
            .await
            .map_err(|_| format!("{tag}: the resumed acquire did not answer"))??;
        let guard = match answer {
            Ok(guard) => guard,
            // The `Locker` got the loss before the lease it was about to
            // hand out: it answers that the lock ended as it was granted.
            Err(Error::Unavailable { source, .. }) if source.message().contains("ended") => {
                let on = sab.lease_of(&caught).await?;
                ensure(on.is_none(), || {
                    format!("{tag}: the acquire says the lock ended ({source}), but its key is on {on:?}")
                })?;
                println!(
                    "etcd: an acquire whose shared lease ended {tag} its record answered: {source}"
                );
                continue;
            }
            Err(e) => return Err(format!("{tag}: the resumed acquire failed: {e}").into()),
        };
        let handle = guard.handle();
        let on = sab.lease_of(&caught).await?;
        if handle.is_held() {
            ensure(parked == Parked::BeforeRecord, || {
                format!(
                    "{tag}: the acquire answered a lock that says held, though the shared \
                     lease {lease:x} ended after the hold was recorded (key now on {on:?})"
                )
            })?;
            ensure(on.is_some_and(|l| l != lease), || {
                format!(
                    "{tag}: the acquire answered a lock that says held, but its key is {} \
                     (the shared lease {lease:x} ended before the hold was recorded)",
                    match on {
                        Some(_) => "still on the ended lease",
                        None => "gone with its lease",
                    }
                )
            })?;
            let other = there.locker.try_lock(&caught, &opts).await;
            ensure(other.is_err(), || {
                format!("{tag}: another replica took the lock the acquire says it holds")
            })?;
            guard.handle().renew().await?;
            guard.release().await?;
            println!(
                "etcd: an acquire whose shared lease ended {tag} its record took the lock on a new lease"
            );
        } else {
            let reason = timeout(tolerance, handle.lost())
                .await
                .map_err(|_| format!("{tag}: the guard is neither held nor lost"))?;
            ensure(on.is_none(), || {
                format!("{tag}: the guard reports {reason:?}, but its key is still on {on:?}")
            })?;
            println!(
                "etcd: an acquire whose shared lease ended {tag} its record answered a lock lost as {reason:?}"
            );
        }
    }
    Ok(())
}
