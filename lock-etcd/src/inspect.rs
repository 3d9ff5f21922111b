//! Who holds a lock, which locks are held, and a forced release.
//!
//! Inspections read only: a get (or a range get) of lock keys and a
//! `LeaseTimeToLive` of their leases, which reports a lease's remaining TTL
//! without extending it. A forced release is one transaction that compares
//! the key's create revision (the fencing token) and deletes the key, and
//! puts a mark naming the freed owner on that owner's own lease, so that its
//! next renewal or check, which reads the mark with the key, answers
//! `forced`. The lease is not revoked: it is shared with the holder's other
//! locks of the same TTL, which keep theirs.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::{Duration, SystemTime};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use futures_util::future::try_join_all;
use lock_core::{BackendError, BackendErrorKind, ForceOutcome, Holder, HolderPage, LockName};

use crate::connection::Inner;
use crate::error::{convert, is_lease_not_found, protocol};
use crate::holder::{decode, MARKS};
use crate::members::Attempt;

/// Most reads and writes one forced release tries while the key keeps
/// changing under it (moved to another lease by its holder's renewal).
const FORCE_TRIES: usize = 3;

/// Most `LeaseTimeToLive` requests in flight at once for one page.
const LEASE_LOOKUPS_AT_ONCE: usize = 64;

/// The smallest byte a lock name can start with (`-`): a listing of every
/// lock starts there, past the tick store's and the marks' keys, which
/// start with `#`.
const FIRST_NAME_BYTE: u8 = b'-';

/// The longest key part a cursor may name, in bytes: the last key of a
/// page may be a stock client's under the prefix, longer than any lock name.
const MAX_CURSOR_KEY: usize = 64 * 1024;

/// A lease's remaining and granted TTL in seconds, as `LeaseTimeToLive`
/// answered; `None` when the lease no longer exists.
type LeaseTimes = Option<(i64, i64)>;

impl Inner {
    /// The key of the mark a forced release of `name` leaves.
    pub(crate) fn mark_key(&self, name: &LockName) -> String {
        let mut key = String::with_capacity(self.prefix.len() + MARKS.len() + name.as_str().len());
        key.push_str(&self.prefix);
        key.push_str(MARKS);
        key.push_str(name.as_str());
        key
    }

    /// The lock key of `name` and the mark of a forced release of it, in
    /// one read-only transaction (one round trip, as a get).
    pub(crate) async fn read_marked(
        &self,
        at: &Attempt,
        name: &LockName,
    ) -> Result<(Option<KeyValue>, Option<KeyValue>), BackendError> {
        let key = self.key(name);
        let txn = Txn::new().and_then([
            TxnOp::get(key.as_str(), None),
            TxnOp::get(self.mark_key(name), None),
        ]);
        let resp = at
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| convert(&format!("read {key}"), e))?;
        two_kvs(resp)
    }

    /// The remaining and granted TTL of `lease`, without extending it.
    async fn lease_times(&self, at: &Attempt, lease: i64) -> Result<LeaseTimes, BackendError> {
        match at.client.lease_client().time_to_live(lease, None).await {
            Ok(resp) if resp.ttl() >= 0 => Ok(Some((resp.ttl(), resp.granted_ttl()))),
            Ok(_) => Ok(None),
            Err(e) if is_lease_not_found(&e) => Ok(None),
            Err(e) => Err(convert(&format!("lease time-to-live {lease:x}"), e)),
        }
    }

    /// Who holds `name`: a get of its key and a look at its lease.
    pub(crate) async fn describe_one(
        &self,
        at: Attempt,
        name: &LockName,
    ) -> Result<Option<Holder>, BackendError> {
        let Some(kv) = self.get(&at, &self.key(name)).await? else {
            return Ok(None);
        };
        let times = match kv.lease() {
            0 => None,
            lease => self.lease_times(&at, lease).await?,
        };
        Ok(Some(holder_from(
            name.clone(),
            &kv,
            times,
            SystemTime::now(),
        )))
    }

    /// One page of the locks whose names start with `prefix`: a range get
    /// from the cursor, limited to `limit` keys, then one `LeaseTimeToLive`
    /// per distinct lease on the page (a backend instance's locks share
    /// one per TTL, so usually a few).
    pub(crate) async fn list_page(
        &self,
        at: Attempt,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        let base = format!("{}{prefix}", self.prefix).into_bytes();
        let end = range_end(&base);
        let mut start = base.clone();
        if prefix.is_empty() {
            start.push(FIRST_NAME_BYTE);
        }
        if let Some(cursor) = cursor {
            let mut after = self.prefix.as_bytes().to_vec();
            after.extend(decode_cursor(cursor)?);
            // The smallest key after the cursor's.
            after.push(0);
            start = start.max(after);
        }
        if start >= end {
            return Ok(HolderPage::new(Vec::new(), None));
        }
        let limit = i64::try_from(limit.clamp(1, lock_core::inspect::MAX_LIST_PAGE)).unwrap_or(1);
        let mut resp = at
            .client
            .kv_client()
            .get(
                start,
                Some(GetOptions::new().with_range(end).with_limit(limit)),
            )
            .await
            .map_err(|e| convert(&format!("list {}{prefix}", self.prefix), e))?;
        let more = resp.more();
        let kvs = resp.take_kvs();
        let next = if more {
            kvs.last()
                .map(|kv| encode_cursor(&kv.key()[self.prefix.len().min(kv.key().len())..]))
        } else {
            None
        };
        // Keys under the prefix that are no lock's (a `#` key, a stock
        // client's key whose name no lock can have) are passed over.
        let named: Vec<(LockName, KeyValue)> = kvs
            .into_iter()
            .filter_map(|kv| {
                let suffix = kv.key().get(self.prefix.len()..)?;
                let name = LockName::new(std::str::from_utf8(suffix).ok()?).ok()?;
                Some((name, kv))
            })
            .collect();
        let mut leases: Vec<i64> = named
            .iter()
            .map(|(_, kv)| kv.lease())
            .filter(|l| *l != 0)
            .collect();
        leases.sort_unstable();
        leases.dedup();
        let mut times: HashMap<i64, LeaseTimes> = HashMap::with_capacity(leases.len());
        for group in leases.chunks(LEASE_LOOKUPS_AT_ONCE) {
            let answers = try_join_all(group.iter().map(|l| self.lease_times(&at, *l))).await?;
            times.extend(group.iter().copied().zip(answers));
        }
        let now = SystemTime::now();
        let holders = named
            .into_iter()
            .map(|(name, kv)| {
                let t = times.get(&kv.lease()).copied().flatten();
                holder_from(name, &kv, t, now)
            })
            .collect();
        Ok(HolderPage::new(holders, next))
    }

    /// Frees `name` if its key's create revision is `expected`: one
    /// transaction that compares it (and the key's mod revision read just
    /// before, so the lease and value are those read), deletes the key and
    /// puts the mark naming the freed owner on that owner's lease.
    ///
    /// `tried` keeps, across the attempts of one call, the value the last
    /// transaction tried to free: if one got no answer and a later attempt
    /// finds the key gone or taken, the mark holding that value shows the
    /// earlier one did it (values carry a random owner token). A key that
    /// gets no mark (a stock client's) is then answered as it is found.
    pub(crate) async fn force_one(
        &self,
        at: Attempt,
        name: &LockName,
        expected: u64,
        tried: &std::sync::Mutex<Option<Vec<u8>>>,
    ) -> Result<ForceOutcome, BackendError> {
        let key = self.key(name);
        for _ in 0..FORCE_TRIES {
            let kv = self.get(&at, &key).await?;
            let held = kv
                .as_ref()
                .map(|kv| u64::try_from(kv.create_revision()).ok());
            if held != Some(Some(expected)) {
                if at.after_unclear && self.freed_earlier(&at, name, tried).await? {
                    return Ok(ForceOutcome::Released);
                }
                return Ok(match held {
                    None => ForceOutcome::NotHeld,
                    Some(held) => ForceOutcome::TokenMismatch { held },
                });
            }
            let Some(kv) = kv else {
                return Ok(ForceOutcome::NotHeld);
            };
            *tried.lock().unwrap_or_else(PoisonError::into_inner) = Some(kv.value().to_vec());
            let mut ops = vec![TxnOp::delete(key.as_str(), None)];
            if decode(kv.value()).ours && kv.lease() != 0 {
                // The mark lives as long as the freed owner's lease, which is
                // as long as that owner can still renew or check: its
                // renewals keep the lease alive while it has other locks on
                // it, and a lease of its own is revoked when it learns.
                ops.push(TxnOp::put(
                    self.mark_key(name),
                    kv.value(),
                    Some(PutOptions::new().with_lease(kv.lease())),
                ));
            }
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key.as_str(), CompareOp::Equal, kv.create_revision()),
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision()),
                ])
                .and_then(ops);
            match at.client.kv_client().txn(txn).await {
                Ok(resp) if resp.succeeded() => return Ok(ForceOutcome::Released),
                // Changed since the read (moved to another lease, released,
                // or the lease ended with the key): read again.
                Ok(_) => {}
                Err(e) if is_lease_not_found(&e) => {}
                Err(e) => return Err(convert(&format!("force release {key}"), e)),
            }
        }
        Err(BackendError::new(
            BackendErrorKind::Other,
            format!(
                "force release {key}: the key changed between each read and release \
                 ({FORCE_TRIES} tries); describe the lock and try again"
            ),
        ))
    }
}

impl Inner {
    /// Whether the mark of a forced release of `name` holds the value an
    /// earlier attempt of this call tried to free.
    async fn freed_earlier(
        &self,
        at: &Attempt,
        name: &LockName,
        tried: &std::sync::Mutex<Option<Vec<u8>>>,
    ) -> Result<bool, BackendError> {
        let Some(value) = tried.lock().unwrap_or_else(PoisonError::into_inner).clone() else {
            return Ok(false);
        };
        let mark = self.get(at, &self.mark_key(name)).await?;
        Ok(mark.is_some_and(|m| m.value() == value.as_slice()))
    }
}

/// The holder a lock key shows, with its lease's `times` read at `now`.
///
/// Fencing token: the key's create revision. Identity and acquire time:
/// from the value, by the holder's clock (etcd answers carry no time).
/// Expiry: `now` plus the lease's remaining TTL, which etcd reports in
/// whole seconds rounded down, so the lease ends up to a second after it;
/// last renewal: that expiry less the lease's granted TTL, plus half that
/// second, at most `now` and at least the recorded acquire time.
fn holder_from(name: LockName, kv: &KeyValue, times: LeaseTimes, now: SystemTime) -> Holder {
    let recorded = decode(kv.value());
    let (renewed, expires) = match times {
        Some((remaining, granted)) => {
            let expires = now.checked_add(Duration::from_secs(remaining.unsigned_abs()));
            // The remaining TTL is rounded down, so the keep-alive came up
            // to a second after this: take the middle, never after now, and
            // never before the acquire the value records.
            let renewed = expires
                .and_then(|e| e.checked_sub(Duration::from_secs(granted.unsigned_abs())))
                .map(|r| (r + Duration::from_millis(500)).min(now))
                .map(|r| recorded.acquired_at.map_or(r, |a| r.max(a)));
            (renewed, expires)
        }
        None => (None, None),
    };
    Holder::unknown(name)
        .with_identity(recorded.identity)
        .with_fencing_token(u64::try_from(kv.create_revision()).ok())
        .with_times(recorded.acquired_at, renewed)
        .with_expires_at(expires)
}

/// The first key-value of each of the two gets of a read-only transaction.
pub(crate) fn two_kvs(
    resp: TxnResponse,
) -> Result<(Option<KeyValue>, Option<KeyValue>), BackendError> {
    let mut gets = resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => Ok(get.kvs().first().cloned()),
        _ => Err(protocol("read", "a read answered a non-get")),
    });
    match (gets.next(), gets.next()) {
        (Some(first), Some(second)) => Ok((first?, second?)),
        _ => Err(protocol("read", "a read of two keys answered fewer")),
    }
}

/// The end of the range of keys that start with `base` (etcd's prefix end).
fn range_end(base: &[u8]) -> Vec<u8> {
    let mut end = base.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the keyspace.
    vec![0]
}

/// A page's cursor: the last key's part after the prefix, in hex.
fn encode_cursor(suffix: &[u8]) -> String {
    use std::fmt::Write;
    suffix.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn decode_cursor(cursor: &str) -> Result<Vec<u8>, BackendError> {
    let bad = || {
        BackendError::new(
            BackendErrorKind::Config,
            format!(
                "{:?} is not a cursor this etcd backend gave: pass back a page's `next` as it is",
                cursor.escape_debug().to_string()
            ),
        )
    };
    if !cursor.len().is_multiple_of(2) || cursor.len() > 2 * MAX_CURSOR_KEY {
        return Err(bad());
    }
    (0..cursor.len())
        .step_by(2)
        .map(|i| {
            cursor
                .get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let key = b"jobs/a-1:x";
        assert_eq!(decode_cursor(&encode_cursor(key)).expect("valid"), key);
        for bad in ["abc", "zz", "é0", &"00".repeat(MAX_CURSOR_KEY + 1)] {
            let err = decode_cursor(bad).expect_err(bad);
            assert_eq!(err.kind(), BackendErrorKind::Config);
        }
    }

    #[test]
    fn range_ends_follow_etcds_prefix_end() {
        assert_eq!(range_end(b"/locks/a"), b"/locks/b");
        assert_eq!(range_end(b"a\xff"), b"b");
        assert_eq!(range_end(b""), b"\0");
    }
}
