//! Who holds a lock: `describe`, `list` and the forced release.
//!
//! Every acquire writes a holder record beside the lock key, in the same
//! script and the same slot (see [`KeySpace::meta`]): owner token, fencing
//! token, the server's time, the TTL asked for and the holder's identity.
//! Inspections read the lock key, its `PTTL` and the record in one
//! read-only script, with the server's `TIME`; the record counts only while
//! it names the owner token the lock key holds, so a lock taken by a client
//! that writes no record (a stock client, an older version of this crate)
//! is reported as held by an unknown holder.
//!
//! A forced release compares the fencing token in the record and frees the
//! lock in one script, leaving a mark (`<prefix>#forced...`) naming the
//! freed owner token, which the holder's next renewal or check reads and
//! answers as [`LeaseStatus::Forced`](lock_core::backend::LeaseStatus).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use lock_core::backend::LeaseStatus;
use lock_core::inspect::MAX_LIST_PAGE;
use lock_core::{
    BackendError, BackendErrorKind, ForceOutcome, Holder, HolderPage, Identity, LockName,
    OwnerToken,
};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;

use crate::backend::Shared;
use crate::cluster::Link;
use crate::cluster_keys::key_slot;
use crate::error::{config, protocol};
use crate::scripts::{DESCRIBE, FORCE_RELEASE, MARK};

/// The most `SCAN` calls one page makes: the bound on a page's work when
/// few keys under the prefix match (each call visits about `COUNT` buckets).
const MAX_SCANS: usize = 32;

/// How many buckets a `SCAN` call is asked to visit, at least. Small, since
/// the names of a call beyond the page's room travel in its cursor.
const MIN_SCAN_COUNT: usize = 10;

/// The most buckets a `SCAN` call is asked to visit beyond the page's room:
/// the count doubles from [`MIN_SCAN_COUNT`] after each call that found no
/// lock under the prefix (a sparse keyspace), and this bounds both the
/// work and the names a cursor may have to carry.
const MAX_SPARSE_COUNT: usize = 256;

/// The version tag that opens every cursor this module hands out.
const CURSOR_TAG: &str = "r2";

/// Who holds `name`, read in one step without writing anything.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub(crate) async fn describe(
    shared: &Shared,
    name: &LockName,
) -> Result<Option<Holder>, BackendError> {
    let keys = [shared.keys.lock(name), shared.keys.meta(name)];
    let conn = &shared.conn;
    let reply: Vec<Value> = conn
        .run("describe", |mut c| async move {
            DESCRIBE.run_read_only(&mut c, &keys, &[]).await
        })
        .await?;
    let mut found = read_snapshot(&reply, std::slice::from_ref(name))
        .map_err(|what| protocol("describe", conn.target(), what))?;
    Ok(found.pop().flatten())
}

/// Frees `name` if its holder record carries `expected`.
///
/// # Cancel safety
///
/// Not cancel safe in effect: a dropped call may have freed the lock.
/// `status` as found by a renew or check, or `Forced` when the lease was
/// gone or taken because an operator's forced release freed this owner's
/// lease (its mark names `owner`). Only a lost lease costs this read.
pub(crate) async fn unless_forced(
    shared: &Shared,
    name: &LockName,
    owner: &OwnerToken,
    status: LeaseStatus,
) -> Result<LeaseStatus, BackendError> {
    if !matches!(status, LeaseStatus::Expired | LeaseStatus::Stolen) {
        return Ok(status);
    }
    let mark = [shared.keys.forced(name)];
    let token = [owner.to_hex()];
    let named: i64 = shared
        .conn
        .run("read the forced-release mark", |mut c| async move {
            MARK.run(&mut c, &mark, &token).await
        })
        .await?;
    Ok(if named == 1 {
        LeaseStatus::Forced
    } else {
        status
    })
}

pub(crate) async fn force_release(
    shared: &Shared,
    name: &LockName,
    expected: u64,
) -> Result<ForceOutcome, BackendError> {
    if !shared.fencing {
        return Err(BackendError::new(
            BackendErrorKind::Unsupported,
            "this Redis backend draws no fencing tokens (with_fencing_tokens(false)), so a forced release has no token to compare and could free a successor: free the lock with a backend that draws tokens, or let its TTL run out",
        ));
    }
    let keys = &shared.keys;
    let lease = [keys.lock(name), keys.meta(name), keys.forced(name)];
    let args = [expected.to_string(), keys.channel(name)];
    let conn = &shared.conn;
    let reply: Vec<Value> = conn
        .run("force release", |mut c| async move {
            FORCE_RELEASE.run(&mut c, &lease, &args).await
        })
        .await?;
    let bad = |what: &str| protocol("force release", conn.target(), what);
    match reply.first().and_then(int) {
        Some(1) => Ok(ForceOutcome::Released),
        Some(0) => Ok(ForceOutcome::NotHeld),
        Some(2) => {
            let held = match reply.get(1).and_then(text) {
                None => return Err(bad("a refusal without the held token")),
                Some(t) if t.is_empty() => None,
                Some(t) => Some(t.parse::<u64>().map_err(|_| bad("a malformed token"))?),
            };
            Ok(ForceOutcome::TokenMismatch { held })
        }
        _ => Err(bad("an unknown forced-release code")),
    }
}

/// One page of the locks under `prefix` (lock names starting with it),
/// from `cursor`.
///
/// A page scans (`SCAN` with `MATCH`, and a `COUNT` of the room left on the
/// page, at least [`MIN_SCAN_COUNT`], more after calls that found nothing,
/// up to [`MAX_SPARSE_COUNT`]) until it has `limit` locks or has
/// made [`MAX_SCANS`] calls, then describes what it found in one read-only
/// script per slot. Each `SCAN` call is made once: the names of a call that
/// do not fit on the page travel in the cursor to the next page (never
/// scanned again, since a repeated call on a table resized meanwhile would
/// return names already handed out). On a cluster every primary is scanned
/// in turn, in address order; the cursor names the node.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub(crate) async fn list(
    shared: &Shared,
    prefix: &str,
    cursor: Option<&str>,
    limit: usize,
) -> Result<HolderPage, BackendError> {
    let limit = limit.clamp(1, MAX_LIST_PAGE);
    let cluster = shared.keys.is_cluster();
    let mut pos = match cursor {
        None => Position::default(),
        Some(text) => Position::parse(text, cluster).ok_or_else(|| {
            config(format!(
                "the list cursor {:?} is not one this backend handed out: pass back the `next` of the previous page as it is, or start again without a cursor",
                text.escape_debug().to_string()
            ))
        })?,
    };
    let mut names: Vec<LockName> = Vec::new();
    let mut seen: HashSet<LockName> = HashSet::new();
    // Names a previous page found and had no room for.
    let carried = pos.pending.len().min(limit);
    for name in pos.pending.drain(..carried) {
        if seen.insert(name.clone()) {
            names.push(name);
        }
    }
    if !pos.pending.is_empty() || pos.finished {
        let next = (!pos.pending.is_empty()).then(|| pos.render());
        let holders = describe_many(shared, &names).await?;
        return Ok(HolderPage::new(holders, next));
    }
    let nodes = if cluster {
        primaries(shared).await?
    } else {
        vec![String::new()]
    };
    // The node the cursor names; if it is gone (a failover, a resharding),
    // the next one in address order, from its start.
    let Some(mut node) = nodes.iter().position(|n| *n >= pos.node) else {
        let holders = describe_many(shared, &names).await?;
        return Ok(HolderPage::new(holders, None));
    };
    if nodes.get(node) != Some(&pos.node) {
        pos.node = nodes.get(node).cloned().unwrap_or_default();
        pos.scan = 0;
    }
    let pattern = format!(
        "{}{}*",
        glob_escape(shared.keys.prefix()),
        glob_escape(prefix)
    );
    let mut next = Some(pos.render());
    let mut sparse = MIN_SCAN_COUNT;
    for _ in 0..MAX_SCANS {
        if names.len() >= limit {
            break;
        }
        let room = limit - names.len();
        let count = room.max(sparse);
        let (after_call, keys) = scan(shared, &pos.node, pos.scan, &pattern, count).await?;
        let mut found: Vec<LockName> = keys
            .iter()
            .filter_map(|k| shared.keys.name_of(k))
            .filter(|n| n.as_str().starts_with(prefix))
            .filter(|n| !seen.contains(n))
            .collect();
        found.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        found.dedup();
        sparse = if found.is_empty() {
            (sparse * 2).min(MAX_SPARSE_COUNT)
        } else {
            MIN_SCAN_COUNT
        };
        let leftover = found.split_off(found.len().min(room));
        seen.extend(found.iter().cloned());
        names.extend(found);
        pos.pending = leftover;
        if after_call == 0 {
            node += 1;
            match nodes.get(node) {
                Some(n) => {
                    pos.node = n.clone();
                    pos.scan = 0;
                }
                None => pos.finished = true,
            }
        } else {
            pos.scan = after_call;
        }
        next = (!pos.finished || !pos.pending.is_empty()).then(|| pos.render());
        if next.is_none() || !pos.pending.is_empty() {
            break;
        }
    }
    let holders = describe_many(shared, &names).await?;
    Ok(HolderPage::new(holders, next))
}

/// Where a listing stands: the node (empty on one server) and its `SCAN`
/// cursor, or that every node has been scanned; and the names found by the
/// last `SCAN` call that did not fit on the page.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Position {
    node: String,
    scan: u64,
    finished: bool,
    pending: Vec<LockName>,
}

impl Position {
    /// `r2|<node>|<scan cursor, or end>|<names not yet handed out, by
    /// commas>`: no address or lock name holds `|` or `,`.
    fn render(&self) -> String {
        let mut out = format!("{CURSOR_TAG}|{}|", self.node);
        if self.finished {
            out.push_str("end");
        } else {
            out.push_str(&self.scan.to_string());
        }
        out.push('|');
        for (i, name) in self.pending.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(name.as_str());
        }
        out
    }

    fn parse(text: &str, cluster: bool) -> Option<Self> {
        let mut parts = text.splitn(4, '|');
        if parts.next()? != CURSOR_TAG {
            return None;
        }
        let node = parts.next()?.to_owned();
        let (scan, finished) = match parts.next()? {
            "end" => (0, true),
            n => (n.parse().ok()?, false),
        };
        let pending = match parts.next()? {
            "" => Vec::new(),
            names => names
                .split(',')
                .map(|n| LockName::new(n).ok())
                .collect::<Option<Vec<_>>>()?,
        };
        // One server has no node names; a cluster always names one.
        if node.is_empty() == cluster {
            return None;
        }
        Some(Self {
            node,
            scan,
            finished,
            pending,
        })
    }
}

/// `text` with the glob characters of `SCAN MATCH` escaped (prefixes and
/// names are validated not to hold them; this keeps that from mattering).
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One `SCAN` call on `node` (empty: the one server): the next cursor and
/// the keys returned.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
async fn scan(
    shared: &Shared,
    node: &str,
    cursor: u64,
    pattern: &str,
    count: usize,
) -> Result<(u64, Vec<String>), BackendError> {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(count);
    let conn = &shared.conn;
    let route = node_route(node);
    let reply: Value = conn
        .run("list (SCAN)", |link| async move {
            match link {
                Link::Single(mut c) => cmd.query_async(&mut c).await,
                Link::Cluster(c) => match route {
                    Some(r) => c.route(&cmd, &r).await,
                    None => Err(redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "a cluster listing names no node",
                    ))),
                },
            }
        })
        .await?;
    let (next, keys): (String, Vec<String>) =
        redis::from_redis_value(reply).map_err(|e| protocol("list (SCAN)", conn.target(), e))?;
    let next = next.parse().map_err(|_| {
        protocol(
            "list (SCAN)",
            conn.target(),
            "a cursor that is not a number",
        )
    })?;
    Ok((next, keys))
}

/// The route to the cluster node `host:port`; `None` for an empty name.
fn node_route(node: &str) -> Option<RoutingInfo> {
    let (host, port) = node.rsplit_once(':')?;
    Some(RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port: port.parse().ok()?,
    }))
}

/// The cluster's primaries as `host:port`, sorted, from `CLUSTER SLOTS`.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
async fn primaries(shared: &Shared) -> Result<Vec<String>, BackendError> {
    let conn = &shared.conn;
    let reply: Value = conn
        .run("list (CLUSTER SLOTS)", |link| async move {
            let cmd = redis::cmd("CLUSTER").arg("SLOTS").clone();
            match link {
                Link::Cluster(c) => {
                    c.route(
                        &cmd,
                        &RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                    )
                    .await
                }
                Link::Single(mut c) => cmd.query_async(&mut c).await,
            }
        })
        .await?;
    let bad = |what: &str| protocol("list (CLUSTER SLOTS)", conn.target(), what);
    let Value::Array(ranges) = reply else {
        return Err(bad("not an array"));
    };
    let mut nodes = Vec::new();
    for range in ranges {
        let Value::Array(parts) = range else {
            return Err(bad("a slot range that is not an array"));
        };
        let Some(Value::Array(primary)) = parts.get(2) else {
            return Err(bad("a slot range without its primary"));
        };
        let host = primary
            .first()
            .and_then(text)
            .ok_or_else(|| bad("a primary without a host"))?;
        let port = primary
            .get(1)
            .and_then(int)
            .ok_or_else(|| bad("a primary without a port"))?;
        nodes.push(format!("{host}:{port}"));
    }
    nodes.sort();
    nodes.dedup();
    Ok(nodes)
}

/// The holders of `names` (those still held), each read with its record in
/// one read-only script per slot (one script in all on one server).
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
async fn describe_many(shared: &Shared, names: &[LockName]) -> Result<Vec<Holder>, BackendError> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let mut groups: BTreeMap<u16, Vec<LockName>> = BTreeMap::new();
    for name in names {
        let slot = if shared.keys.is_cluster() {
            key_slot(shared.keys.lock(name).as_bytes())
        } else {
            0
        };
        groups.entry(slot).or_default().push(name.clone());
    }
    let conn = &shared.conn;
    let calls = groups.into_values().map(|group| async move {
        let keys: Vec<String> = group
            .iter()
            .flat_map(|n| [shared.keys.lock(n), shared.keys.meta(n)])
            .collect();
        let reply: Vec<Value> = conn
            .run("list (describe)", |mut c| async move {
                DESCRIBE.run_read_only(&mut c, &keys, &[]).await
            })
            .await?;
        read_snapshot(&reply, &group).map_err(|what| protocol("list", conn.target(), what))
    });
    let mut holders = Vec::with_capacity(names.len());
    for group in join_all(calls).await {
        holders.extend(group?.into_iter().flatten());
    }
    Ok(holders)
}

/// Reads [`DESCRIBE`]'s reply for `names`: the holder of each, or `None`
/// for a lock that is free.
fn read_snapshot(reply: &[Value], names: &[LockName]) -> Result<Vec<Option<Holder>>, String> {
    let secs = reply
        .first()
        .and_then(text)
        .and_then(|t| t.parse::<u64>().ok());
    let micros = reply
        .get(1)
        .and_then(text)
        .and_then(|t| t.parse::<u64>().ok());
    let (Some(secs), Some(micros)) = (secs, micros) else {
        return Err("a snapshot without the server's time".to_owned());
    };
    let now = UNIX_EPOCH
        .checked_add(Duration::from_secs(secs))
        .and_then(|t| t.checked_add(Duration::from_micros(micros)))
        .ok_or("a server time out of range")?;
    let rest = reply.get(2..).unwrap_or_default();
    if rest.len() != names.len() * 3 {
        return Err(format!("{} values for {} locks", rest.len(), names.len()));
    }
    let mut out = Vec::with_capacity(names.len());
    for (name, lock) in names.iter().zip(rest.chunks_exact(3)) {
        let (Some(pttl), Some(value), Some(record)) =
            (int(&lock[0]), text(&lock[1]), text(&lock[2]))
        else {
            return Err("a malformed lock in the snapshot".to_owned());
        };
        out.push(holder(name, now, pttl, &value, &record));
    }
    Ok(out)
}

/// The holder of `name` from its `PTTL` (-2: no key, -1: no expiry), its
/// value and its holder record, at the server's time `now`.
fn holder(
    name: &LockName,
    now: SystemTime,
    pttl: i64,
    value: &str,
    record: &str,
) -> Option<Holder> {
    if pttl == -2 {
        return None;
    }
    let expires_at = u64::try_from(pttl)
        .ok()
        .and_then(|ms| now.checked_add(Duration::from_millis(ms)));
    let unknown = Holder::unknown(name.clone()).with_expires_at(expires_at);
    let Some(record) = Record::parse(record).filter(|r| !value.is_empty() && r.owner == value)
    else {
        return Some(unknown);
    };
    let acquired_at = UNIX_EPOCH.checked_add(Duration::from_micros(record.acquired_us));
    // The last extension set the expiry to its server time plus the TTL;
    // renewals ask for the TTL the lease was taken with (as a `Locker`'s
    // do), so that time is the expiry less the recorded TTL. Expiries are
    // whole milliseconds: within one of the acquire, it is the acquire.
    let renewed_at = expires_at
        .and_then(|e| e.checked_sub(Duration::from_millis(record.ttl_ms)))
        .map(|r| match acquired_at {
            Some(a)
                if a.checked_add(Duration::from_millis(1))
                    .is_none_or(|a1| r < a1) =>
            {
                a
            }
            _ => r,
        });
    Some(
        unknown
            .with_identity(record.identity)
            .with_fencing_token(record.fence)
            .with_times(acquired_at, renewed_at),
    )
}

/// A holder record as [`KeySpace::meta`](crate::scripts::KeySpace::meta)
/// describes it.
#[derive(Debug, PartialEq, Eq)]
struct Record<'a> {
    owner: &'a str,
    fence: Option<u64>,
    acquired_us: u64,
    ttl_ms: u64,
    identity: Option<Identity>,
}

impl<'a> Record<'a> {
    /// `None` for anything but a well-formed version-1 record.
    fn parse(text: &'a str) -> Option<Self> {
        let mut parts = text.splitn(6, ' ');
        if parts.next()? != "1" {
            return None;
        }
        let owner = parts.next()?;
        let fence = match parts.next()? {
            "-" => None,
            f => Some(f.parse().ok()?),
        };
        let acquired_us = parts.next()?.parse().ok()?;
        let ttl_ms = parts.next()?.parse().ok()?;
        let identity = match parts.next()? {
            "" => None,
            // A record written with an identity this version would refuse
            // shows no identity rather than failing the inspection.
            id => Identity::new(id).ok(),
        };
        Some(Self {
            owner,
            fence,
            acquired_us,
            ttl_ms,
            identity,
        })
    }
}

/// An integer reply.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// A string reply (bulk or simple), lossily as UTF-8.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_and_refuse_the_malformed() {
        let r = Record::parse("1 abcd 42 1700000000123456 3000 web-1/77/0a0b0c0d");
        assert_eq!(
            r,
            Some(Record {
                owner: "abcd",
                fence: Some(42),
                acquired_us: 1_700_000_000_123_456,
                ttl_ms: 3000,
                identity: Identity::new("web-1/77/0a0b0c0d").ok(),
            })
        );
        let spaced = Record::parse("1 abcd - 5 10 a b c").and_then(|r| r.identity);
        assert_eq!(spaced, Identity::new("a b c").ok());
        assert_eq!(
            Record::parse("1 abcd - 5 10 ").map(|r| r.identity),
            Some(None)
        );
        for bad in [
            "",
            "2 abcd 1 2 3 x",
            "1 abcd x 2 3 x",
            "1 abcd 1 2",
            "somevalue",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_record_counts_only_for_the_owner_the_lock_holds() -> Result<(), lock_core::Error> {
        let name = LockName::new("jobs/a")?;
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_010);
        let record = "1 abcd 7 1700000000000000 30000 me";
        let held = holder(&name, now, 25_000, "abcd", record);
        let h = held.ok_or_else(|| lock_core::Error::Config("free".into()))?;
        assert_eq!(h.identity, Identity::new("me").ok());
        assert_eq!(h.fencing_token, Some(7));
        assert_eq!(h.expires_at, Some(now + Duration::from_secs(25)));
        assert_eq!(h.renewed_at, Some(now - Duration::from_secs(5)));
        let stock = holder(&name, now, 25_000, "somevalue", record);
        assert_eq!(
            stock,
            Some(
                Holder::unknown(name.clone()).with_expires_at(Some(now + Duration::from_secs(25)))
            )
        );
        assert_eq!(holder(&name, now, -2, "", ""), None);
        let forever = holder(&name, now, -1, "x", "");
        assert_eq!(forever, Some(Holder::unknown(name)));
        Ok(())
    }

    #[test]
    fn cursors_round_trip_and_refuse_the_foreign() -> Result<(), lock_core::Error> {
        let p = Position {
            node: "127.0.0.1:7000".into(),
            scan: 99,
            finished: false,
            pending: vec![LockName::new("jobs/a:b")?, LockName::new("jobs/c")?],
        };
        assert_eq!(p.render(), "r2|127.0.0.1:7000|99|jobs/a:b,jobs/c");
        assert_eq!(Position::parse(&p.render(), true), Some(p.clone()));
        assert_eq!(Position::parse(&p.render(), false), None);
        let single = Position::default();
        assert_eq!(Position::parse(&single.render(), false), Some(single));
        let done = Position {
            finished: true,
            ..Position::default()
        };
        assert_eq!(done.render(), "r2||end|");
        assert_eq!(Position::parse(&done.render(), false), Some(done));
        for bad in [
            "",
            "r2",
            "r1||0|",
            "r2||x|",
            "r2||0|a*b",
            "r2||-1|",
            "r2||0|a,,b",
        ] {
            assert_eq!(Position::parse(bad, false), None, "{bad:?}");
        }
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(
            node_route("::1:7000"),
            Some(RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: "::1".into(),
                port: 7000
            }))
        );
        Ok(())
    }
}
