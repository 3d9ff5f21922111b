//! Renewing: proving on the lock session that it is alive and still holds
//! each lock, many locks in one statement.

use std::sync::Arc;

use lock_core::{
    backend::{LeaseStatus, RenewRequest},
    BackendError, BackendErrorKind,
};
use tokio_postgres::types::Type;
use tracing::warn;

use crate::error::protocol;
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresBackend};

/// For each key (as unsigned `oid`s): whether this session holds it, and
/// whether any other session does. `objsubid = 2` is the two-`int4` key space.
const PROBE: &str = "SELECT pg_backend_pid(), k.i::int4, \
     EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
       AND l.database = d.oid AND l.classid::int8 = k.c AND l.objid::int8 = k.o \
       AND l.objsubid = 2 AND l.pid = pg_backend_pid()), \
     EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
       AND l.database = d.oid AND l.classid::int8 = k.c AND l.objid::int8 = k.o \
       AND l.objsubid = 2 AND l.pid <> pg_backend_pid()) \
     FROM unnest($1::int8[], $2::int8[]) WITH ORDINALITY AS k(c, o, i), \
       (SELECT oid FROM pg_database WHERE datname = current_database()) d \
     ORDER BY k.i";

/// What a probe found for one key.
#[derive(Debug, Clone, Copy)]
struct Probe {
    mine: bool,
    other: bool,
}

impl PostgresBackend {
    async fn probe(
        &self,
        session: &LockSession,
        keys: &[AdvisoryKey],
    ) -> Result<Vec<Probe>, BackendError> {
        let classids: Vec<i64> = keys.iter().map(|k| k.classid()).collect();
        let objids: Vec<i64> = keys.iter().map(|k| k.objid()).collect();
        let rows = session
            .query(
                "checking pg_locks",
                PROBE,
                &[(&classids, Type::INT8_ARRAY), (&objids, Type::INT8_ARRAY)],
            )
            .await?;
        if rows.len() != keys.len() {
            return Err(protocol(format!(
                "pg_locks probe returned {} rows for {} keys",
                rows.len(),
                keys.len()
            )));
        }
        rows.iter()
            .map(|row| {
                session.check_pid(row)?;
                Ok(Probe {
                    mine: row.try_get(2).map_err(|e| protocol(e.to_string()))?,
                    other: row.try_get(3).map_err(|e| protocol(e.to_string()))?,
                })
            })
            .collect()
    }

    /// Status of keys this backend no longer holds (for the given owners):
    /// `Stolen` if any session holds them now, `Expired` if none does.
    async fn status_elsewhere(&self, keys: &[AdvisoryKey]) -> Vec<LeaseStatus> {
        if keys.is_empty() {
            return Vec::new();
        }
        let answer = match self.session().await {
            Ok(session) => self.probe(&session, keys).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(probes) => probes
                .into_iter()
                .map(|p| {
                    if p.mine || p.other {
                        LeaseStatus::Stolen
                    } else {
                        LeaseStatus::Expired
                    }
                })
                .collect(),
            Err(e) => {
                // Our lease is gone either way (its session ended); only who
                // holds the name now is unknown.
                warn!(error = %e, "could not tell whether a lost lock was taken over; reporting it expired");
                vec![LeaseStatus::Expired; keys.len()]
            }
        }
    }

    /// Renews a batch ([`LockBackend::renew_many`](lock_core::LockBackend::renew_many)).
    pub(crate) async fn renew_batch(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let keys: Vec<AdvisoryKey> = requests
            .iter()
            .map(|r| self.inner.config.key_for(&r.name))
            .collect();
        // Group the leases by the live session that holds them; the rest
        // were lost (dead session, or another owner's now).
        let mut by_session: Vec<(Arc<LockSession>, Vec<usize>)> = Vec::new();
        let mut lost = Vec::new();
        {
            let mut held = self.held();
            for (i, (r, key)) in requests.iter().zip(&keys).enumerate() {
                match held.get(key) {
                    Some(h) if h.owner == r.owner && h.session.is_alive() => {
                        let s = Arc::clone(&h.session);
                        match by_session.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &s)) {
                            Some((_, idx)) => idx.push(i),
                            None => by_session.push((s, vec![i])),
                        }
                    }
                    Some(h) if h.owner == r.owner => {
                        held.remove(key);
                        lost.push(i);
                    }
                    _ => lost.push(i),
                }
            }
        }
        let mut out = vec![LeaseStatus::Expired; requests.len()];
        for (session, idx) in by_session {
            let batch: Vec<AdvisoryKey> = idx.iter().map(|i| keys[*i]).collect();
            match self.probe(&session, &batch).await {
                Ok(probes) => {
                    for (i, p) in idx.into_iter().zip(probes) {
                        if p.mine {
                            out[i] = LeaseStatus::Held;
                        } else {
                            self.take_holding(keys[i], &requests[i].owner);
                            out[i] = if p.other {
                                LeaseStatus::Stolen
                            } else {
                                LeaseStatus::Expired
                            };
                        }
                    }
                }
                // A pooler error also ends the session, but must reach the caller.
                Err(e) if !session.is_alive() && e.kind() != BackendErrorKind::Config => {
                    warn!(error = %e, pid = session.pid(), "the lock session ended; its locks are gone");
                    for i in idx {
                        self.take_holding(keys[i], &requests[i].owner);
                        lost.push(i);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let lost_keys: Vec<AdvisoryKey> = lost.iter().map(|i| keys[*i]).collect();
        let statuses = self.status_elsewhere(&lost_keys).await;
        for (i, status) in lost.into_iter().zip(statuses) {
            out[i] = status;
        }
        Ok(out)
    }
}
