//! Redis Cluster: the client built from a `redis+cluster://` URL, the
//! connection type commands run on in either mode, and batch renewal
//! grouped by slot.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use lock_core::backend::{LeaseStatus, RenewRequest};
use lock_core::BackendError;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::cluster_keys::key_slot;
use crate::cluster_link::ClusterLink;
use crate::connection::Connection;
use crate::error::{config, protocol};
use crate::scripts::RENEW_MANY;

/// How often the cluster client follows a `MOVED`/`ASK` redirect or
/// re-sends after a dropped connection before it hands the error back. A
/// slot that moves during a call costs one redirect; answers that keep
/// redirecting (a failover the nodes are still converging on) are sent
/// again by [`ClusterLink`] with backoff, within the operation timeout. Not
/// raised instead: redis-rs follows `MOVED` at once, so more tries would be
/// spent as fast as the answers come, and before every try it computes a
/// wait of `10 * 2^try` ms in `u64`, which overflows (a panic in a debug
/// build) past 60 tries.
const REDIRECTS: u32 = 3;
/// Bounds of the client's wait between two such attempts, in ms: short,
/// since a renewal has only a third of the TTL to succeed.
const MIN_RETRY_WAIT_MS: u64 = 10;
const MAX_RETRY_WAIT_MS: u64 = 100;

/// The connection a command runs on: one server's (direct or through
/// Sentinel) or a cluster's, which routes each command by its first key.
#[derive(Clone)]
pub(crate) enum Link {
    Single(ConnectionManager),
    Cluster(ClusterLink),
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Where the cluster's seed nodes are (credentials live in the builder).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClusterSpec {
    pub(crate) nodes: Vec<(String, u16)>,
}

/// Builds the cluster client. Nothing is contacted yet.
pub(crate) fn client(
    spec: &ClusterSpec,
    username: Option<&str>,
    password: Option<&str>,
    connect_timeout: Duration,
    op_timeout: Duration,
    target: &str,
) -> Result<ClusterClient, BackendError> {
    let seeds: Vec<String> = spec
        .nodes
        .iter()
        .map(|(h, p)| {
            if h.contains(':') {
                format!("redis://[{h}]:{p}")
            } else {
                format!("redis://{h}:{p}")
            }
        })
        .collect();
    let mut builder = ClusterClient::builder(seeds)
        .retries(REDIRECTS)
        .min_retry_wait(MIN_RETRY_WAIT_MS)
        .max_retry_wait(MAX_RETRY_WAIT_MS)
        .connection_timeout(connect_timeout)
        .response_timeout(op_timeout);
    if let Some(user) = username {
        builder = builder.username(user);
    }
    if let Some(pw) = password {
        builder = builder.password(pw);
    }
    // The client's message may quote a seed URL; ours name only the target.
    builder.build().map_err(|_| {
        config(format!(
            "cannot configure a cluster client for {target}: check the seed nodes"
        ))
    })
}

/// Renews `requests` with one script per slot, all sent at once, so the
/// batch costs about one round trip per primary; statuses come back in
/// request order. `to_status` maps a script's code.
///
/// Leases of one slot are renewed together atomically; different slots are
/// not (no script may span them), which renewal does not need.
///
/// # Cancel safety
///
/// Cancel safe in the sense that matters: a dropped call may have renewed
/// some leases, which only extends leases their owner holds.
pub(crate) async fn renew_by_slot(
    conn: &Connection,
    keys: Vec<[String; 2]>,
    args: Vec<(String, String)>,
    to_status: impl Fn(i64) -> Result<LeaseStatus, BackendError>,
) -> Result<Vec<LeaseStatus>, BackendError> {
    let mut groups: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        groups
            .entry(key_slot(key[0].as_bytes()))
            .or_default()
            .push(i);
    }
    let calls = groups.into_values().map(|idx| {
        let (mut k, mut a) = (
            Vec::with_capacity(idx.len() * 2),
            Vec::with_capacity(idx.len() * 2),
        );
        for &i in &idx {
            if let (Some(key), Some((token, ttl))) = (keys.get(i), args.get(i)) {
                k.extend(key.iter().cloned());
                a.push(token.clone());
                a.push(ttl.clone());
            }
        }
        async move {
            let codes: Vec<i64> = conn
                .run("renew batch", |mut c| async move {
                    RENEW_MANY.run(&mut c, &k, &a).await
                })
                .await?;
            Ok::<_, BackendError>((idx, codes))
        }
    });
    let mut out: Vec<Option<LeaseStatus>> = vec![None; keys.len()];
    for group in join_all(calls).await {
        let (idx, codes) = group?;
        if codes.len() != idx.len() {
            return Err(protocol(
                "renew batch",
                conn.target(),
                format!(
                    "{} statuses for {} leases of one slot",
                    codes.len(),
                    idx.len()
                ),
            ));
        }
        for (i, code) in idx.into_iter().zip(codes) {
            if let Some(slot) = out.get_mut(i) {
                *slot = Some(to_status(code)?);
            }
        }
    }
    out.into_iter()
        .map(|s| {
            s.ok_or_else(|| protocol("renew batch", conn.target(), "a lease without a status"))
        })
        .collect()
}

/// The keys of each lease (lock, holder record, forced-release mark, all in
/// one slot), and the `(owner token, TTL in ms)` of each.
pub(crate) type KeysAndArgs = (Vec<[String; 2]>, Vec<(String, String)>);

/// [`RenewRequest`]s as keys and `(token, ttl ms)` pairs, for
/// [`renew_by_slot`].
pub(crate) fn split_requests(
    requests: &[RenewRequest],
    key: impl Fn(&RenewRequest) -> [String; 2],
    ttl_ms: impl Fn(Duration) -> Result<u64, BackendError>,
) -> Result<KeysAndArgs, BackendError> {
    let mut keys = Vec::with_capacity(requests.len());
    let mut args = Vec::with_capacity(requests.len());
    for r in requests {
        keys.push(key(r));
        args.push((r.owner.to_hex(), ttl_ms(r.ttl)?.to_string()));
    }
    Ok((keys, args))
}
