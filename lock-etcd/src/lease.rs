//! Leases: grant, revoke, and keep-alive over one shared stream.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock, PoisonError};

use std::time::Duration;
use tokio::time::Instant;

use etcd_client::{Error as EtcdError, LeaseKeepAliveStream, LeaseKeeper};
use lock_core::BackendError;
use tokio::sync::Mutex;

use crate::error::{convert, is_lease_not_found, protocol};
use crate::members::Attempt;

/// etcd lease TTLs are whole seconds: the TTL rounded up, at least one.
pub(crate) fn lease_seconds(ttl: Duration) -> i64 {
    let whole = ttl
        .as_secs()
        .saturating_add(u64::from(ttl.subsec_nanos() > 0));
    i64::try_from(whole.max(1)).unwrap_or(i64::MAX)
}

/// Grants, revokes and keeps leases alive for one backend instance.
///
/// Keep-alives share one bidirectional stream per member: etcd answers the
/// requests of a stream one by one, in order, so a batch is written in one
/// go and its answers read back in the same order, one round trip for any
/// number of leases. Each member has its own stream, so a keep-alive stuck on a frozen member
/// does not hold up one that went on to another member.
#[derive(Default)]
pub(crate) struct Leases {
    streams: std::sync::Mutex<HashMap<usize, Arc<Mutex<Option<KeepAliveStream>>>>>,
}

struct KeepAliveStream {
    member: usize,
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
}

impl fmt::Debug for Leases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leases").finish_non_exhaustive()
    }
}

impl Leases {
    /// Grants a lease of `seconds`; returns its id and the TTL the server
    /// actually gave (it raises TTLs below its minimum).
    pub(crate) async fn grant(
        &self,
        at: &Attempt,
        seconds: i64,
    ) -> Result<(i64, i64), BackendError> {
        let resp = at
            .client
            .lease_client()
            .grant(seconds, None)
            .await
            .map_err(|e| convert("lease grant", e))?;
        if !resp.error().is_empty() {
            return Err(protocol("lease grant", resp.error()));
        }
        Ok((resp.id(), resp.ttl()))
    }

    /// Revokes `id`, deleting the keys attached to it. A lease that is
    /// already gone counts as revoked.
    pub(crate) async fn revoke(&self, at: &Attempt, id: i64) -> Result<(), BackendError> {
        match at.client.lease_client().revoke(id).await {
            Ok(_) => Ok(()),
            Err(e) if is_lease_not_found(&e) => Ok(()),
            Err(e) => Err(convert("lease revoke", e)),
        }
    }

    /// Sends one keep-alive per id and returns the TTL each got back, in
    /// order; 0 means the lease no longer exists.
    ///
    /// Cancel safety: if the future is dropped midway, the stream is left
    /// out of step with its answers, so it is discarded (the slot is emptied
    /// before any request goes out) and the next call opens a new one.
    pub(crate) async fn keep_alive(
        &self,
        at: &Attempt,
        ids: &[i64],
    ) -> Result<Vec<i64>, BackendError> {
        self.keep_alive_marking(at, ids, &OnceLock::new()).await
    }

    /// As [`Leases::keep_alive`], and sets `sent` to when the requests went
    /// out (once the member's stream was free). Cancel safe, as it.
    pub(crate) async fn keep_alive_marking(
        &self,
        at: &Attempt,
        ids: &[i64],
        sent: &OnceLock<Instant>,
    ) -> Result<Vec<i64>, BackendError> {
        let slot = Arc::clone(
            self.streams
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(at.member)
                .or_default(),
        );
        let mut slot = slot.lock().await;
        let _ = sent.set(Instant::now());
        let mut ttls = Vec::with_capacity(ids.len());
        let mut stream = match slot.take().filter(|s| s.member == at.member) {
            Some(s) => s,
            None => {
                // Opening a stream renews its first lease, but the client
                // keeps that answer's TTL to itself: the lease is kept alive
                // once more below, for a TTL acquires can count on. The
                // client refuses to open a stream for a lease that is gone,
                // so try the next.
                let mut opened = None;
                for &id in ids {
                    match at.client.lease_client().keep_alive(id).await {
                        Ok((keeper, answers)) => {
                            opened = Some(KeepAliveStream {
                                member: at.member,
                                keeper,
                                answers,
                            });
                            break;
                        }
                        Err(e) if is_lease_not_found(&e) => ttls.push(0),
                        Err(e) => return Err(convert("lease keep-alive", e)),
                    }
                }
                match opened {
                    Some(s) => s,
                    None => return Ok(ttls),
                }
            }
        };
        let rest = &ids[ttls.len()..];
        let KeepAliveStream {
            keeper, answers, ..
        } = &mut stream;
        let send = async {
            for &id in rest {
                // The handle's lease id is public (etcd-client's
                // pub-response-field feature); retargeting it sends the next
                // keep-alive for another lease on the same stream.
                keeper.id = id;
                keeper.keep_alive().await?;
            }
            Ok::<_, EtcdError>(())
        };
        let receive = async {
            let mut got = Vec::with_capacity(rest.len());
            for &id in rest {
                match answers.message().await? {
                    Some(answer) if answer.id() == id => got.push(answer.ttl().max(0)),
                    Some(answer) => {
                        return Ok(Err(format!(
                            "keep-alive answer for lease {:x} where {id:x} was expected",
                            answer.id()
                        )))
                    }
                    None => return Err(EtcdError::LeaseKeepAliveError("stream closed".into())),
                }
            }
            Ok::<_, EtcdError>(Ok(got))
        };
        let ((), received) =
            tokio::try_join!(send, receive).map_err(|e| convert("lease keep-alive", e))?;
        let got = received.map_err(|m| protocol("lease keep-alive", &m))?;
        ttls.extend(got);
        *slot = Some(stream);
        Ok(ttls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(lease_seconds(Duration::from_millis(1)), 1);
        assert_eq!(lease_seconds(Duration::from_secs(2)), 2);
        assert_eq!(lease_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }
}
