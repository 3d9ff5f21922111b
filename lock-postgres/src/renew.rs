//! Renewing: proving that each lock session holding a lease is alive, one
//! statement per session however many leases it holds.
//!
//! A live session still holds every lock it took: only the session itself
//! can unlock them (this crate does, through a release, which forgets the
//! holding only once the unlock ran), and the server frees them all when
//! the session ends. So a session that answers with its own
//! `pg_backend_pid()` proves every lease recorded on it, and `pg_locks` is
//! read only for leases already lost, to tell `stolen` from `expired`.

use std::sync::Arc;

use lock_core::lane::{self, Batch, Lane};
use lock_core::{
    backend::{LeaseStatus, RenewRequest},
    BackendError, BackendErrorKind,
};
use tokio::task::JoinSet;
use tokio_postgres::types::Type;
use tracing::warn;

use crate::attempts::{IN_FLIGHT, MAX_BATCH};
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

/// The liveness proof: one row, the session's server pid.
const ALIVE: &str = "SELECT pg_backend_pid()";

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
        // The sessions answer concurrently, each on its own connection.
        let mut checks = JoinSet::new();
        for (session, idx) in by_session {
            checks.spawn(async move {
                let answer = lane::call::<Alive>(&session, ()).await;
                (session, idx, answer)
            });
        }
        while let Some(joined) = checks.join_next().await {
            let (session, idx, answer) = joined.map_err(|e| {
                BackendError::new(
                    BackendErrorKind::Other,
                    format!("a lock session's liveness check ended abnormally ({e})"),
                )
            })?;
            match answer {
                Ok(forced) => {
                    if !forced.is_empty() {
                        self.forced_on(&session, &forced).await;
                    }
                    for i in idx {
                        out[i] = if forced.contains(&keys[i]) {
                            LeaseStatus::Forced
                        } else {
                            LeaseStatus::Held
                        };
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
        // Leases freed by an operator answer so for as long as it is kept.
        lost.retain(|i| {
            if self.was_forced(&requests[*i].owner) {
                out[*i] = LeaseStatus::Forced;
                false
            } else {
                true
            }
        });
        let lost_keys: Vec<AdvisoryKey> = lost.iter().map(|i| keys[*i]).collect();
        let statuses = self.status_elsewhere(&lost_keys).await;
        for (i, status) in lost.into_iter().zip(statuses) {
            out[i] = status;
        }
        Ok(out)
    }
}

/// Liveness proofs, as a [`Batch`]: renewals and checks on one session that
/// queue in its lane ([`lock_core::lane`]) share the next proof, sent after they all
/// began (so it is younger than each of them). Each gets the keys on the
/// session that an operator marked for a forced release.
#[derive(Debug)]
pub(crate) struct Alive;

impl Batch for Alive {
    type Host = LockSession;
    type Item = ();
    type Answer = Arc<[AdvisoryKey]>;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(session: &LockSession) -> &Lane<Self> {
        &session.lanes().alive
    }

    /// One proof for every call.
    async fn run(
        session: &LockSession,
        items: Vec<()>,
    ) -> Vec<Result<Arc<[AdvisoryKey]>, BackendError>> {
        lane::each(
            prove(session).await.map(|forced| vec![forced; items.len()]),
            items.len(),
        )
    }
}

/// One statement that proves `session` alive and still the same server
/// process. Once the holder tables are known to exist, the same statement
/// records the proof's server time for the session's holder rows and reads
/// which of its keys an operator marked for a forced release.
async fn prove(session: &LockSession) -> Result<Arc<[AdvisoryKey]>, BackendError> {
    let holders = session.lanes().holders.as_ref();
    if holders.ready() {
        let pid = session.pid();
        let answer = session
            .query_prepared(
                "checking the lock session",
                &holders.alive,
                &[(&pid, Type::INT4)],
            )
            .await;
        match answer {
            Err(e) if holders.missing(&e) => {}
            Err(e) => return Err(e),
            Ok(rows) => {
                let row = rows
                    .first()
                    .ok_or_else(|| protocol("pg_backend_pid() returned no row"))?;
                session.check_pid(row)?;
                let key1: Option<Vec<i32>> = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
                let key2: Option<Vec<i32>> = row.try_get(2).map_err(|e| protocol(e.to_string()))?;
                let forced: Vec<AdvisoryKey> = key1
                    .unwrap_or_default()
                    .into_iter()
                    .zip(key2.unwrap_or_default())
                    .map(|(a, b)| AdvisoryKey::new(a, b))
                    .collect();
                return Ok(forced.into());
            }
        }
    }
    let rows = session
        .query_prepared("checking the lock session", ALIVE, &[])
        .await?;
    let row = rows
        .first()
        .ok_or_else(|| protocol("pg_backend_pid() returned no row"))?;
    session.check_pid(row)?;
    Ok(Arc::from([]))
}
