//! A silent partition between a holder and the server (packets dropped by
//! nftables on loopback, for the one connection only): the holder must stop
//! trusting its lease before the server frees the lock for a successor.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{backend::AcquireAttempt, LockBackend, LockOptions, LossReason, OwnerToken};
use tokio::time::{sleep, timeout, Instant};

use super::specific::{backend_as, hold, locker, name};
use super::{PostgresFactory, TTL};
use crate::harness::nft::nft;
use crate::BoxError;

/// An nftables table that drops one TCP connection's packets both ways;
/// deleted when dropped. Matching both ports keeps it from touching any
/// other connection.
pub(crate) struct Blackhole {
    table: String,
}

impl Blackhole {
    /// Drops every packet between loopback ports `a` and `b`, both ways.
    pub(crate) fn cut(a: u16, b: u16) -> Result<Self, BoxError> {
        let table = format!("lock_ct_{a}_{b}");
        let hole = Self { table };
        let t = &hole.table;
        nft(&["add", "table", "inet", t])?;
        nft(&[
            "add",
            "chain",
            "inet",
            t,
            "input",
            "{ type filter hook input priority 0 ; }",
        ])?;
        for (s, d) in [(a, b), (b, a)] {
            let (s, d) = (s.to_string(), d.to_string());
            nft(&[
                "add", "rule", "inet", t, "input", "tcp", "sport", &s, "tcp", "dport", &d, "drop",
            ])?;
        }
        Ok(hole)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        let _ = nft(&["delete", "table", "inet", &self.table]);
    }
}

/// What `ss` (run with `flags`) shows of the established connection that
/// the server process `pid` serves on `server_port`.
pub(super) fn ss_line(flags: &str, server_port: u16, pid: i32) -> Result<String, BoxError> {
    let out = Command::new("ss")
        .args([flags, "state", "established"])
        .arg(format!("( sport = :{server_port} )"))
        .output()?;
    let text = String::from_utf8(out.stdout)?;
    let line = text
        .lines()
        .find(|l| l.contains(&format!("pid={pid},")))
        .ok_or_else(|| format!("ss shows no socket of pid {pid}:\n{text}"))?;
    Ok(line.to_owned())
}

/// The client port of the server process `pid`'s connection, from `ss`.
pub(crate) fn client_port(server_port: u16, pid: i32) -> Result<u16, BoxError> {
    let line = ss_line("-tnHp", server_port, pid)?;
    // Columns: Recv-Q Send-Q Local:Port Peer:Port Process
    let peer = line
        .split_whitespace()
        .nth(3)
        .ok_or_else(|| format!("no peer in {line:?}"))?;
    let port = peer.rsplit(':').next().ok_or("no peer port")?;
    Ok(port.parse()?)
}

/// X8: cut the holder's connection silently. Its job is aborted at its
/// local deadline; the server frees the lock only when TCP gives up on the
/// connection (`tcp_user_timeout` = ceil(max_ttl) + 1 s), so the successor
/// acquires strictly after the abort. Prints both instants.
pub(super) async fn partitioned_holder_aborts_first(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let server_port = tokio::task::block_in_place(|| f.private_started())?.port();
    let a = Arc::new(backend_as(&f, "postgres").await?);
    let b = backend_as(&f, "postgres").await?;
    let la = locker(a.clone())?;
    let n = name(&f, "partitioned");
    let (lease, run) = hold(&la, &n).await?;
    let port = client_port(server_port, a.lock_session_pid(&n).await?)?;
    let hole = Blackhole::cut(port, server_port)?;
    let cut_at = Instant::now();

    let token = OwnerToken::generate()?;
    let mut acquired_after = None;
    let mut aborted_after = None;
    let give_up = cut_at + Duration::from_secs(20);
    while acquired_after.is_none() && Instant::now() < give_up {
        if aborted_after.is_none() && lease.loss_reason().is_some() {
            aborted_after = Some(cut_at.elapsed());
        }
        if let AcquireAttempt::Acquired(_) = b.try_acquire(&n, &token, TTL).await? {
            acquired_after = Some(cut_at.elapsed());
        }
        sleep(Duration::from_millis(20)).await;
    }
    drop(hole);
    let acquired = acquired_after.ok_or("the server never freed the partitioned holder's lock")?;
    let reason = timeout(Duration::from_secs(1), lease.lost())
        .await
        .map_err(|_| {
            format!("the successor acquired after {acquired:?}, yet the holder was never told")
        })?;
    let aborted = aborted_after.ok_or_else(|| {
        format!("the successor acquired {acquired:?} after the cut, before the holder's abort ({reason})")
    })?;
    b.release(&n, &token).await?;
    if reason != LossReason::BackendError {
        return Err(format!("expected backend_error, got {reason}").into());
    }
    let deadline = LockOptions::new(TTL).ttl();
    if aborted > deadline + Duration::from_millis(400) {
        return Err(format!("aborted {aborted:?} after the cut; the TTL is {deadline:?}").into());
    }
    if !matches!(run.await?, Ok(lock_core::RunOutcome::Aborted(_))) {
        return Err("the run was not aborted".into());
    }
    println!(
        "postgres: partition: holder aborted {aborted:?} after the cut, server freed the lock \
         {acquired:?} after the cut (max_ttl {:?})",
        a.config().max_ttl()
    );
    Ok(())
}
