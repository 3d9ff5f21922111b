//! The tick records of the fenced start protocol (lock-core's
//! [`TickWrite`]): one row per started tick beside the marks, each
//! transition one statement conditional on the token.

use std::time::Duration;

use lock_core::{BackendError, LockName, OnStale, TickAnswer, TickRecord, TickWrite};
use tokio_postgres::types::Type;
use tokio_postgres::Row;

use crate::error::protocol;
use crate::ticks::missing_table;
use crate::PostgresBackend;

const RETURNING: &str = "RETURNING state, token, replica, at";

impl PostgresBackend {
    /// Tick records live beside the latest ticks and the marks.
    pub(crate) fn run_table(&self) -> String {
        let cfg = &self.inner.config;
        cfg.qualified(&format!("{}_runs", cfg.tick_table))
    }

    /// Applies `write` in one statement (creating the tables on first use),
    /// then answers from the record it left, or from a read of the record
    /// when the statement changed nothing (a refusal or a retry).
    pub(crate) async fn write_tick_record(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        let written = match self.write_once(job, tick, write, keep).await {
            Err(e) if missing_table(&e) => {
                self.create_tick_tables().await?;
                self.write_once(job, tick, write, keep).await?
            }
            other => other?,
        };
        let after = match written {
            Some(record) => Some(record),
            None => self.read_tick_record(job, tick).await?,
        };
        Ok(write.answer(after))
    }

    async fn write_once(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<Option<TickRecord>, BackendError> {
        let session = self.session().await?;
        let ns = self.inner.config.namespace.as_str();
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let cut = tick.saturating_sub(keep_ms);
        let rows = match write {
            TickWrite::Start {
                token,
                replica,
                at,
                on_stale,
            } => {
                // The update on conflict is the stale-record rule: only a
                // Started of a lower token is replaced, and only if asked.
                // The prune skips rows another statement holds (a later
                // write prunes them): waiting on them would add to the
                // lag of the tick about to run.
                let stale = stale_code(*on_stale);
                let sql = format!(
                    "WITH w AS (INSERT INTO {r} AS r (namespace, job, tick, state, token, replica, at) \
                     VALUES ($1, $2, $3, 'S', $4, $5, $6) \
                     ON CONFLICT (namespace, job, tick) DO UPDATE \
                     SET state = $7, token = EXCLUDED.token, replica = EXCLUDED.replica, at = EXCLUDED.at \
                     WHERE r.state = 'S' AND r.token < EXCLUDED.token AND $7 <> 'R' {RETURNING}), \
                     pruned AS (DELETE FROM {r} WHERE ctid IN (SELECT ctid FROM {r} \
                     WHERE namespace = $1 AND job = $2 AND tick < $8 AND EXISTS (SELECT 1 FROM w) \
                     FOR UPDATE SKIP LOCKED)) \
                     SELECT state, token, replica, at FROM w",
                    r = self.run_table()
                );
                let token = token_param(*token)?;
                session
                    .query(
                        "writing a tick's start record",
                        &sql,
                        &[
                            (&ns, Type::TEXT),
                            (&job.as_str(), Type::TEXT),
                            (&tick, Type::INT8),
                            (&token, Type::INT8),
                            (&replica.as_str(), Type::TEXT),
                            (at, Type::INT8),
                            (&stale, Type::TEXT),
                            (&cut, Type::INT8),
                        ],
                    )
                    .await?
            }
            TickWrite::Complete { token } => {
                // Completed, the mark and the latest tick in one statement,
                // all gated on the conditional update; old marks other
                // statements hold are left for a later completion.
                let sql = format!(
                    "WITH c AS (UPDATE {r} SET state = 'C' WHERE namespace = $1 AND job = $2 \
                     AND tick = $3 AND state = 'S' AND token = $4 {RETURNING}), \
                     pruned AS (DELETE FROM {m} WHERE ctid IN (SELECT ctid FROM {m} \
                     WHERE namespace = $1 AND job = $2 AND tick < $5 AND EXISTS (SELECT 1 FROM c) \
                     FOR UPDATE SKIP LOCKED)), \
                     marked AS (INSERT INTO {m} (namespace, job, tick) SELECT $1, $2, $3 FROM c \
                     ON CONFLICT DO NOTHING), \
                     latest AS (INSERT INTO {t} AS t (namespace, job, tick) SELECT $1, $2, $3 FROM c \
                     ON CONFLICT (namespace, job) DO UPDATE SET tick = GREATEST(t.tick, EXCLUDED.tick)) \
                     SELECT state, token, replica, at FROM c",
                    r = self.run_table(),
                    m = self.mark_table(),
                    t = self.tick_table()
                );
                let token = token_param(*token)?;
                session
                    .query(
                        "writing a tick's completed record",
                        &sql,
                        &[
                            (&ns, Type::TEXT),
                            (&job.as_str(), Type::TEXT),
                            (&tick, Type::INT8),
                            (&token, Type::INT8),
                            (&cut, Type::INT8),
                        ],
                    )
                    .await?
            }
        };
        rows.first().map(|r| record(r, 0)).transpose()
    }

    /// The record of `tick` of `job`, if any (none before the table exists).
    pub(crate) async fn read_tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "SELECT state, token, replica, at FROM {} WHERE namespace = $1 AND job = $2 AND tick = $3",
            self.run_table()
        );
        let ns = self.inner.config.namespace.as_str();
        match session
            .query(
                "reading a tick record",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&job.as_str(), Type::TEXT),
                    (&tick, Type::INT8),
                ],
            )
            .await
        {
            Ok(rows) => rows.first().map(|r| record(r, 0)).transpose(),
            Err(e) if missing_table(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The state a `Start` write leaves on a stale `Started` record, as the
/// records' `state` column spells it (`R`: refuse, keep it).
pub(crate) fn stale_code(on_stale: OnStale) -> &'static str {
    match on_stale {
        OnStale::Refuse => "R",
        OnStale::Abandon => "A",
        OnStale::TakeOver => "S",
    }
}

pub(crate) fn token_param(token: u64) -> Result<i64, BackendError> {
    i64::try_from(token).map_err(|_| {
        protocol(format!(
            "fencing token {token} does not fit the tick record's bigint column"
        ))
    })
}

/// The record in `row`'s columns from `first` on: state, token, replica, at.
pub(crate) fn record(row: &Row, first: usize) -> Result<TickRecord, BackendError> {
    let bad = |e: tokio_postgres::Error| protocol(e.to_string());
    let state: String = row.try_get(first).map_err(bad)?;
    let token: i64 = row.try_get(first + 1).map_err(bad)?;
    let token =
        u64::try_from(token).map_err(|_| protocol(format!("a tick record holds token {token}")))?;
    match state.as_str() {
        "S" => Ok(TickRecord::Started {
            token,
            replica: row.try_get(first + 2).map_err(bad)?,
            at: row.try_get(first + 3).map_err(bad)?,
        }),
        "C" => Ok(TickRecord::Completed { token }),
        "A" => Ok(TickRecord::Abandoned { token }),
        other => Err(protocol(format!("a tick record in state {other:?}"))),
    }
}
