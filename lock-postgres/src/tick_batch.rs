//! The batch calls of [`TickStore`](lock_core::TickStore) on Postgres: each
//! one statement over arrays of jobs and ticks (`unnest`), whatever the
//! batch's size, reaching its rows by one index lookup per tick (why: see
//! `tick_runs_batch.rs`).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use lock_core::{BackendError, LockName};
use tokio_postgres::types::Type;

use crate::error::protocol;
use crate::ticks::missing_table;
use crate::PostgresBackend;

/// How often a batch statement is tried when Postgres picks it as a deadlock
/// victim: two replicas' batches may touch the same jobs' rows in another
/// order, and the statement was rolled back whole, so trying again is safe.
const RECORD_ATTEMPTS: usize = 3;

impl PostgresBackend {
    /// The latest completed tick of each of `jobs`, in one statement.
    pub(crate) async fn last_completed_batch(
        &self,
        jobs: &[LockName],
    ) -> Result<Vec<Option<i64>>, BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "SELECT job, tick FROM {} WHERE namespace = $1 AND job = ANY($2)",
            self.tick_table()
        );
        let ns = self.inner.config.namespace.as_str();
        let names: Vec<&str> = jobs.iter().map(LockName::as_str).collect();
        let rows = match session
            .query(
                "reading the last completed ticks",
                &sql,
                &[(&ns, Type::TEXT), (&names, Type::TEXT_ARRAY)],
            )
            .await
        {
            Ok(rows) => rows,
            // Nothing was ever recorded: the table is created on first write.
            Err(e) if missing_table(&e) => return Ok(vec![None; jobs.len()]),
            Err(e) => return Err(e),
        };
        let mut found: HashMap<String, i64> = HashMap::with_capacity(rows.len());
        for row in rows {
            let job: String = row.try_get(0).map_err(|e| protocol(e.to_string()))?;
            let tick: i64 = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
            found.insert(job, tick);
        }
        Ok(jobs
            .iter()
            .map(|j| found.get(j.as_str()).copied())
            .collect())
    }

    /// Whether each `(job, tick)` is marked, in one statement.
    pub(crate) async fn is_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Result<Vec<bool>, BackendError> {
        let session = self.session().await?;
        let sql = self.marks_read_sql();
        let ns = self.inner.config.namespace.as_str();
        let (names, at) = columns(ticks);
        let rows = match session
            .query(
                "reading tick marks",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&names, Type::TEXT_ARRAY),
                    (&at, Type::INT8_ARRAY),
                ],
            )
            .await
        {
            Ok(rows) => rows,
            // Nothing was ever recorded: the tables are created on first write.
            Err(e) if missing_table(&e) => return Ok(vec![false; ticks.len()]),
            Err(e) => return Err(e),
        };
        let mut found: HashSet<(String, i64)> = HashSet::with_capacity(rows.len());
        for row in rows {
            let job: String = row.try_get(0).map_err(|e| protocol(e.to_string()))?;
            let tick: i64 = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
            found.insert((job, tick));
        }
        Ok(ticks
            .iter()
            .map(|(job, tick)| found.contains(&(job.as_str().to_owned(), *tick)))
            .collect())
    }

    /// Records every `(job, tick)`, in one statement: prunes each job's
    /// marks more than `keep` older than its latest tick in the batch, marks
    /// every tick, and raises each job's latest completed tick.
    pub(crate) async fn record_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.retried("recording completed ticks", || {
            self.record_once(ticks, keep)
        })
        .await
    }

    /// Sends a batch statement, creating the tick tables if they are
    /// missing, and again, up to [`RECORD_ATTEMPTS`] in all, when Postgres
    /// picked it as a deadlock victim or failed it for serialization:
    /// nothing of it was written, and the batch statements are safe to send
    /// again.
    pub(crate) async fn retried<T, F, Fut>(&self, what: &str, attempt: F) -> Result<T, BackendError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, BackendError>>,
    {
        let mut last = None;
        for _ in 0..RECORD_ATTEMPTS {
            match attempt().await {
                Err(e) if missing_table(&e) => {
                    self.create_tick_tables().await?;
                    last = Some(e);
                }
                Err(e) if e.message().contains("40P01") || e.message().contains("40001") => {
                    last = Some(e);
                }
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| protocol(format!("{what} was not attempted"))))
    }

    async fn record_once(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Result<(), BackendError> {
        let session = self.session().await?;
        // Rows are written in job order, so two batches over the same jobs
        // lock them in the same order; a job's several ticks raise its row
        // once (one statement cannot update a row twice).
        let sql = self.record_sql();
        let ns = self.inner.config.namespace.as_str();
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let (names, at) = columns(ticks);
        let cuts: Vec<i64> = at.iter().map(|t| t.saturating_sub(keep_ms)).collect();
        session
            .query(
                "recording completed ticks",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&names, Type::TEXT_ARRAY),
                    (&at, Type::INT8_ARRAY),
                    (&cuts, Type::INT8_ARRAY),
                ],
            )
            .await
            .map(drop)
    }
}

/// The jobs and the ticks of `ticks`, as two arrays.
fn columns(ticks: &[(LockName, i64)]) -> (Vec<&str>, Vec<i64>) {
    ticks
        .iter()
        .map(|(job, tick)| (job.as_str(), *tick))
        .unzip()
}

/// The batch statements' texts, apart so that a test can read their plans.
impl PostgresBackend {
    /// The read of marks: `$1` namespace, `$2` jobs, `$3` ticks.
    pub(crate) fn marks_read_sql(&self) -> String {
        format!(
            "SELECT m.job, m.tick FROM unnest($2::text[], $3::int8[]) AS q(job, tick) \
             CROSS JOIN LATERAL (SELECT x.job, x.tick FROM {} x WHERE x.namespace = $1 \
             AND x.job = q.job AND x.tick = q.tick LIMIT 1) m",
            self.mark_table()
        )
    }

    /// The record of completed ticks: `$1` namespace, `$2` jobs, `$3`
    /// ticks, `$4` each tick's cut (marks before it go).
    pub(crate) fn record_sql(&self) -> String {
        format!(
            "WITH q AS (SELECT * FROM unnest($2::text[], $3::int8[], $4::int8[]) AS q(job, tick, cut)), \
             pruned AS (DELETE FROM {m} WHERE ctid = ANY(ARRAY(SELECT l.id \
             FROM (SELECT job, max(cut) AS cut FROM q GROUP BY job) c CROSS JOIN LATERAL \
             (SELECT m.ctid AS id FROM {m} m WHERE m.namespace = $1 AND m.job = c.job \
             AND m.tick < c.cut OFFSET 0) l))), \
             marked AS (INSERT INTO {m} (namespace, job, tick) \
             SELECT $1, job, tick FROM q ORDER BY job, tick ON CONFLICT DO NOTHING) \
             INSERT INTO {t} AS t (namespace, job, tick) \
             SELECT $1, job, max(tick) FROM q GROUP BY job ORDER BY job \
             ON CONFLICT (namespace, job) DO UPDATE SET tick = GREATEST(t.tick, EXCLUDED.tick)",
            t = self.tick_table(),
            m = self.mark_table()
        )
    }
}
