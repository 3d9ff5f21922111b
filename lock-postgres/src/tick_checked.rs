//! Ticks' `Started` writes with the scheduler's checks in the same
//! statement ([`TickStore::start_checked_many`](lock_core::TickStore::start_checked_many)):
//! the server's clock, the tick's mark and the job's latest completed tick
//! are read where the record is written, so the path between a tick's lock
//! and its handler is one round trip instead of two.

use std::collections::HashSet;
use std::time::Duration;

use lock_core::{BackendError, LockName, StartCheck, StartVerdict, TickWrite};
use tokio_postgres::types::Type;
use tokio_postgres::Row;

use crate::error::protocol;
use crate::tick_runs::record;
use crate::tick_runs_batch::{start_insert, StartColumns};
use crate::PostgresBackend;

/// One checked start as the scheduler sends it.
pub(crate) type CheckedStart = (LockName, i64, TickWrite, StartCheck);

/// What the statement read and wrote for one tick.
struct Checked {
    server_ms: i64,
    marked: bool,
    last: Option<i64>,
    written: Option<lock_core::TickRecord>,
}

impl PostgresBackend {
    /// Makes each start's checks and, where they pass, its write, in one
    /// statement (item by item where two are for the same tick: a
    /// statement cannot change a row twice).
    pub(crate) async fn start_checked_batch(
        &self,
        starts: &[CheckedStart],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        if repeats_a_tick(starts) {
            let mut out = Vec::with_capacity(starts.len());
            for start in starts {
                out.extend(
                    self.start_checked_group(std::slice::from_ref(start), keep)
                        .await,
                );
            }
            return out;
        }
        self.start_checked_group(starts, keep).await
    }

    async fn start_checked_group(
        &self,
        starts: &[CheckedStart],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        let rows = match self
            .retried("checking ticks and writing their start records", || {
                self.checked_once(starts, keep)
            })
            .await
        {
            Ok(rows) => rows,
            Err(e) => return e.for_each(starts.len()),
        };
        let mut found = match by_tick(&rows) {
            Ok(found) => found,
            Err(e) => return e.for_each(starts.len()),
        };
        // A passing start the statement did not write was refused by the
        // record (or is a retry of this write): its answer is the record as
        // it stands, read in one more statement.
        let mut unchanged = Vec::new();
        let mut verdicts = Vec::with_capacity(starts.len());
        for (job, tick, _, check) in starts {
            let Some(seen) = found.remove(&(job.as_str().to_owned(), *tick)) else {
                verdicts.push(Err(protocol(format!(
                    "the checked start of {job} at {tick} returned no row"
                ))));
                continue;
            };
            let verdict = check.verdict(*tick, Some(seen.server_ms), seen.marked, seen.last);
            if verdict.is_none() && seen.written.is_none() {
                unchanged.push((job.as_str(), *tick));
            }
            verdicts.push(Ok((verdict, seen.written)));
        }
        let mut records = if unchanged.is_empty() {
            Default::default()
        } else {
            match self.read_records(&unchanged).await {
                Ok(records) => records,
                Err(e) => return e.for_each(starts.len()),
            }
        };
        starts
            .iter()
            .zip(verdicts)
            .map(|((job, tick, write, _), seen)| {
                let (verdict, written) = seen?;
                match (verdict, written) {
                    (Some(refused), None) => Ok(refused),
                    (None, Some(record)) => Ok(StartVerdict::Written(write.answer(Some(record)))),
                    (None, None) => {
                        let now = records.remove(&(job.as_str().to_owned(), *tick));
                        Ok(StartVerdict::Written(write.answer(now)))
                    }
                    // The statement's checks are this crate's copy of
                    // `StartCheck::verdict`; a record written for a start
                    // the verdict refuses means the two disagree.
                    (Some(refused), Some(record)) => Err(protocol(format!(
                        "the tick store wrote {record} for {job} at {tick}, which its checks refuse ({refused:?})"
                    ))),
                }
            })
            .collect()
    }

    /// The statement: reads the server's clock once, each tick's mark and
    /// its job's latest tick, and inserts the `Started` record of each tick
    /// whose checks pass, as [`PostgresBackend::write_tick_records_batch`]'s
    /// start statement does. Answers one row per tick: the reads, and the
    /// record if this statement wrote it.
    async fn checked_once(
        &self,
        starts: &[CheckedStart],
        keep: Duration,
    ) -> Result<Vec<Row>, BackendError> {
        let session = self.session().await?;
        let ns = self.inner.config.namespace.as_str();
        let mut cols = Columns::default();
        for (job, tick, write, check) in starts {
            cols.push(job, *tick, write, check)?;
        }
        // A lone start prunes its job's records older than `keep` before
        // it, as a lone write does (a job whose completions never land
        // would otherwise keep every record); batches leave that to the
        // completions, off the path to the handlers. Rows another
        // statement holds are skipped, not waited for.
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let (cut, lone) = match starts {
            [(_, tick, ..)] => (tick.saturating_sub(keep_ms), true),
            // $10 is sent typed and unused: a statement may declare more
            // parameters than it reads.
            _ => (i64::MIN, false),
        };
        let sql = self.checked_sql(lone);
        session
            .query(
                "checking ticks and writing their start records",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&cols.starts.jobs, Type::TEXT_ARRAY),
                    (&cols.starts.ticks, Type::INT8_ARRAY),
                    (&cols.starts.tokens, Type::INT8_ARRAY),
                    (&cols.starts.replicas, Type::TEXT_ARRAY),
                    (&cols.starts.ats, Type::INT8_ARRAY),
                    (&cols.starts.stales, Type::TEXT_ARRAY),
                    (&cols.tolerances, Type::INT8_ARRAY),
                    (&cols.lates, Type::BOOL_ARRAY),
                    (&cut, Type::INT8),
                ],
            )
            .await
    }

    /// The checked start's statement: `$1` namespace, `$2`..`$9` the
    /// columns of [`Columns`], `$10` the cut below which a `lone` start
    /// prunes its job's records.
    pub(crate) fn checked_sql(&self, lone: bool) -> String {
        let prune = if lone {
            format!(
                ", pruned AS (DELETE FROM {r} WHERE ctid IN (SELECT p.ctid FROM {r} p \
                 WHERE p.namespace = $1 AND p.job = ($2::text[])[1] AND p.tick < $10 \
                 AND EXISTS (SELECT 1 FROM w) FOR UPDATE OF p SKIP LOCKED))",
                r = self.run_table()
            )
        } else {
            String::new()
        };
        // Differences are taken in numeric: a bigint one could overflow
        // where the verdict's saturating arithmetic does not. The lookups
        // are scalar subqueries, one index probe per tick (an EXISTS may be
        // planned as a hash of every mark of the namespace).
        format!(
            "WITH v AS (SELECT * FROM unnest($2::text[], $3::int8[], $4::int8[], $5::text[], \
             $6::int8[], $7::text[], $8::int8[], $9::bool[]) \
             AS v(job, tick, token, replica, at, stale, tolerance, late)), \
             c AS (SELECT v.*, n.ms AS server_ms, \
             COALESCE((SELECT true FROM {m} m WHERE m.namespace = $1 AND m.job = v.job \
             AND m.tick = v.tick LIMIT 1), false) AS marked, \
             (SELECT t.tick FROM {t} t WHERE t.namespace = $1 AND t.job = v.job) AS last \
             FROM v CROSS JOIN (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms) n), \
             ok AS (SELECT * FROM c WHERE c.tick::numeric - c.server_ms <= c.tolerance \
             AND NOT c.marked AND (c.last IS NULL OR NOT (c.last = c.tick OR (c.last > c.tick \
             AND (c.late OR c.last::numeric - c.tick > c.tolerance))))), \
             {w}{prune} \
             SELECT c.job, c.tick, c.server_ms, c.marked, c.last, w.state, w.token, w.replica, w.at \
             FROM c LEFT JOIN w ON w.job = c.job AND w.tick = c.tick",
            m = self.mark_table(),
            t = self.tick_table(),
            w = start_insert(&self.run_table(), "ok"),
        )
    }
}

/// The statement's parameters, a column each: the starts', and their
/// checks'.
#[derive(Default)]
struct Columns<'a> {
    starts: StartColumns<'a>,
    tolerances: Vec<i64>,
    lates: Vec<bool>,
}

impl<'a> Columns<'a> {
    fn push(
        &mut self,
        job: &'a LockName,
        tick: i64,
        write: &'a TickWrite,
        check: &StartCheck,
    ) -> Result<(), BackendError> {
        self.starts.push(job, tick, write)?;
        self.tolerances.push(check.tolerance_ms);
        self.lates.push(check.late);
        Ok(())
    }
}

/// The statement's rows by job and tick.
fn by_tick(
    rows: &[Row],
) -> Result<std::collections::HashMap<(String, i64), Checked>, BackendError> {
    let bad = |e: tokio_postgres::Error| protocol(e.to_string());
    let mut out = std::collections::HashMap::with_capacity(rows.len());
    for row in rows {
        let job: String = row.try_get(0).map_err(bad)?;
        let tick: i64 = row.try_get(1).map_err(bad)?;
        let state: Option<String> = row.try_get(5).map_err(bad)?;
        let written = match state {
            Some(_) => Some(record(row, 5)?),
            None => None,
        };
        out.insert(
            (job, tick),
            Checked {
                server_ms: row.try_get(2).map_err(bad)?,
                marked: row.try_get(3).map_err(bad)?,
                last: row.try_get(4).map_err(bad)?,
                written,
            },
        );
    }
    Ok(out)
}

/// Whether two starts of `starts` are for the same tick.
fn repeats_a_tick(starts: &[CheckedStart]) -> bool {
    let mut seen = HashSet::with_capacity(starts.len());
    !starts
        .iter()
        .all(|(job, tick, ..)| seen.insert((job, *tick)))
}
