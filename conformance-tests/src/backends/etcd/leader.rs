//! Finding the leader of a 3-member etcd cluster, as the process-based
//! cluster and the one in containers both need it after a fault.

use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};

use crate::BoxError;

/// The member that leads among `members` (index and client port): the one
/// that reports itself as leader with the highest raft term, among those
/// that answer within 1 s. An isolated old leader may still believe it leads
/// until its check-quorum timeout, so the highest term wins.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub(crate) async fn leader_among(members: Vec<(usize, u16)>) -> Result<usize, BoxError> {
    let mut best: Option<(u64, usize)> = None;
    for (i, port) in members {
        let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(1), status_of(port)).await
        else {
            continue;
        };
        let me = status.header().map(|h| h.member_id());
        if me == Some(status.leader()) && best.is_none_or(|(t, _)| status.raft_term() > t) {
            best = Some((status.raft_term(), i));
        }
    }
    best.map(|(_, i)| i)
        .ok_or_else(|| "no member reports itself as leader".into())
}

/// Asks every 50 ms, for up to `within`, for the leader among the members
/// `members` lists at the time, until one other than `not` (a member just
/// killed or cut away) leads, and returns it.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub(crate) async fn wait_for_leader(
    members: impl Fn() -> Vec<(usize, u16)>,
    not: Option<usize>,
    within: Duration,
) -> Result<usize, BoxError> {
    let until = Instant::now() + within;
    loop {
        match leader_among(members()).await {
            Ok(i) if Some(i) != not => return Ok(i),
            _ if Instant::now() >= until => {
                return Err(format!("no new leader within {within:?}").into())
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn status_of(port: u16) -> Result<etcd_client::StatusResponse, BoxError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_millis(500))
        .with_timeout(Duration::from_millis(800));
    let mut client = Client::connect([format!("http://127.0.0.1:{port}")], Some(options)).await?;
    Ok(client.status().await?)
}
