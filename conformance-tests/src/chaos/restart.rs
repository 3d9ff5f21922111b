//! X7 (Redis): `SCRIPT FLUSH` under a holder, then a restart without
//! persistence, which loses the key and every cached script.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{Error, LockGuard, LossReason, RenewalOutcome};
use tokio::time::{sleep, Instant};

use super::case_timing;
use super::figures::{self, Row};
use super::holder::{Holder, Resource};
use super::key_int;
use super::Target;
use crate::{Ctx, Replica};

/// Attempts the successor makes while the restarted server comes back.
const SUCCESSOR_ATTEMPTS: usize = 50;

/// A plain connection to the server, for what an operator would type.
async fn plain(ctx: &Ctx) -> redis::aio::MultiplexedConnection {
    let addr = ctx.factory().server_addr().expect("a loopback server");
    redis::Client::open(format!("redis://{addr}"))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("a plain connection")
}

/// Panics if a user-facing error carries the server's NOSCRIPT.
fn no_noscript(what: &str, e: &Error) {
    assert!(
        !e.to_string().to_ascii_uppercase().contains("NOSCRIPT"),
        "{what}: NOSCRIPT reached the caller: {e}"
    );
}

/// Takes `name` for the successor, retrying while the server restarts.
async fn successor_acquires(
    successor: &Replica,
    name: &lock_core::LockName,
    opts: &lock_core::LockOptions,
    within: Duration,
) -> LockGuard {
    let until = Instant::now() + within;
    for _ in 0..SUCCESSOR_ATTEMPTS {
        match successor.locker.try_lock(name, opts).await {
            Ok(g) => return g,
            Err(e) => {
                no_noscript("the successor's acquire", &e);
                assert!(Instant::now() < until, "the successor never acquired: {e}");
                sleep(within / 20).await;
            }
        }
    }
    panic!("the successor never acquired in {SUCCESSOR_ATTEMPTS} attempts");
}

/// X7 against the private Redis behind `ctx`, whose replicas use `prefix`.
pub(super) async fn restart(ctx: Ctx, target: Target, prefix: String) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let interval = opts.renew_interval();
    let server = ctx.factory().server_process().expect("a private server");
    let holder_rep = ctx.replica().await;
    let successor = ctx.replica().await;
    let mut row = Row::of(&ctx, "chaos_restart");
    let mut fence_backwards = 0;
    for i in 0..target.iterations {
        let name = ctx.name(&format!("restart-{i}"));
        let label = name.as_str().to_owned();
        let key = format!("{prefix}{label}");
        let resource = Arc::new(Resource::default());
        let mut holder = Holder::start(&holder_rep, &name, &opts, Arc::clone(&resource)).await;
        let mut c = plain(&ctx).await;

        // SCRIPT FLUSH: renewals carry on, nothing fails, nothing is lost.
        sleep(interval / 2).await;
        let errors_before = holder_rep.metrics.renewals(&label, RenewalOutcome::Error);
        let renewed_before = holder_rep.metrics.renewals(&label, RenewalOutcome::Renewed);
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut c)
            .await
            .expect("SCRIPT FLUSH");
        row.faults += 1;
        sleep(interval * 2 + tol).await;
        assert!(
            holder.handle.assert_held().is_ok(),
            "the lease was lost after SCRIPT FLUSH: {:?}",
            holder.handle.loss_reason()
        );
        assert_eq!(
            holder_rep.metrics.renewals(&label, RenewalOutcome::Error),
            errors_before,
            "a renewal failed after SCRIPT FLUSH"
        );
        assert!(
            holder_rep.metrics.renewals(&label, RenewalOutcome::Renewed) >= renewed_before + 2,
            "renewals stopped after SCRIPT FLUSH"
        );
        if let Err(e) = holder.handle.verify().await {
            no_noscript("verify after SCRIPT FLUSH", &e);
            panic!("verify after SCRIPT FLUSH: {e}");
        }

        // Restart without persistence: the key and the scripts are gone.
        let killed_at = Instant::now();
        server.restart().expect("the server restarts");
        row.faults += 1;
        let (lost_at, reason) = holder
            .lost_by(killed_at + interval + target.op_timeout + tol)
            .await
            .expect("the holder detects the restart within renew interval + op timeout");
        row.detection.push(lost_at - killed_at);
        row.abort.push(lost_at - killed_at);
        assert_eq!(
            reason,
            LossReason::Expired,
            "a renewal after the restart must find the key gone (not fail on NOSCRIPT)"
        );
        // The renewal that found it gone must not have re-created it, nor
        // any later one.
        sleep(interval * 2).await;
        let mut c = plain(&ctx).await;
        let exists: i64 = key_int(&mut c, "EXISTS", &key).await;
        assert_eq!(exists, 0, "the lost key was re-created after the restart");
        let old_token = holder.token;
        let (old, writes) = holder.writes(ttl).await;
        match old.release().await {
            Ok(()) => panic!("the lost holder released a lock it no longer had"),
            Err(e) => no_noscript("the lost holder's release", &e),
        }
        row.writes += writes;
        row.after_deadline += resource.log.after_deadline();

        // The successor gets the lock; without persistence the fencing
        // counter restarted too, so its token can be lower (reported).
        let succ = successor_acquires(&successor, &name, &opts, ttl * 2).await;
        let acquired_at = Instant::now();
        let token = succ.fencing_token().expect("fenced");
        if token <= old_token {
            fence_backwards += 1;
        }
        row.stale_accepts += resource.stale_accepted(token, acquired_at);
        succ.release().await.expect("the successor releases");
        let exists: i64 = key_int(&mut c, "EXISTS", &key).await;
        row.leaked += usize::try_from(exists).unwrap_or(1);
    }
    row.iterations = target.iterations;
    let summary = format!(
        "{row:?}; fencing token went backwards after {fence_backwards} of {} restarts (INCR counter lost without persistence)",
        target.iterations
    );
    figures::record_safe("chaos_restart", row, &summary);
}
