//! `chaos_retain_stall`: a holder keeps its lock as a completion mark
//! (`retain_for`) while its session's server process is stopped past the
//! statement timeout. The hold cannot be set, so the lock is released
//! instead; the release runs once the server answers again, and the lock is
//! free within the TTL of the thaw. A session keeps an advisory lock for as
//! long as it is open, so a hold that was neither set nor released would
//! leave the lock to nobody for the life of the process.

use std::sync::Arc;

use tokio::time::Instant;

use super::pg::{replica_at, Setup};
use crate::backends::postgres::{Frozen, PostgresFactory};
use crate::Ctx;

pub(super) async fn retain_stall(f: Arc<PostgresFactory>, ctx: Ctx) {
    let timing = ctx.timing();
    let (ttl, tol) = (timing.ttl, timing.tolerance);
    let setup = Setup::new(&f).await;
    let op_timeout = setup.config.statement_timeout();
    let (_, successor) = replica_at(&f, &ctx, &setup.url).await;
    let (_, holder) = replica_at(&f, &ctx, &setup.url).await;
    let name = ctx.name("retain-stall");
    let key = setup.config.key_for(&name);
    let guard = holder
        .locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("the lock is free");
    let pid = setup
        .holder_of(key)
        .await
        .expect("pg_locks shows the holder's session");
    let frozen = Frozen::stop(pid).expect("SIGSTOP the holder's server process");
    let asked = Instant::now();
    let kept = guard.retain_for(ttl * 4).await;
    let answered = asked.elapsed();
    assert!(
        kept.is_err(),
        "a hold was set on a stopped server: {kept:?}"
    );
    assert!(
        answered <= op_timeout * 2 + tol,
        "retain_for on a stopped server answered after {answered:?}"
    );
    assert_eq!(
        setup.holder_of(key).await,
        Some(pid),
        "the stopped (not dead) session keeps its lock meanwhile"
    );
    let thawed = Instant::now();
    drop(frozen);
    successor
        .assert_free("after the thaw", &name, &ctx, ttl + tol)
        .await;
    println!(
        "postgres::chaos_retain_stall: retain_for answered in {answered:?}; the lock was free \
         {:?} after the thaw",
        thawed.elapsed()
    );
    assert!(
        setup.holds_nothing(pid, op_timeout + tol).await,
        "the holder's session still holds a lock after the thaw"
    );
}
