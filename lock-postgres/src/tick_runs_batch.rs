//! The tick records' writes of many ticks at once: the `Started` writes of a
//! batch in one statement and its `Completed` writes in another (`unnest`
//! over arrays), each row its own conditional step as in `tick_runs.rs`,
//! instead of one statement, and so one transaction, per tick.
//!
//! Every statement over a batch reaches its rows by one index lookup per
//! tick (a `LATERAL` subquery the planner cannot flatten, `LIMIT 1` or
//! `OFFSET 0`), and a write reaches them by the `ctid`s those lookups found.
//! Written as joins, the planner was free to read every record of the
//! namespace and hash them, and did whenever the table's statistics lagged
//! behind it (a new namespace, a table grown since the last `ANALYZE`): 20 to
//! 30 ms a statement over a minute's records of 1,000 jobs, growing with the
//! records kept, where the lookups cost a few.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use lock_core::{BackendError, LockName, TickAnswer, TickRecord, TickWrite};
use tokio_postgres::types::Type;
use tokio_postgres::Row;
use tracing::warn;

use crate::error::protocol;
use crate::tick_runs::{record, stale_code, token_param};
use crate::ticks::missing_table;
use crate::PostgresBackend;

/// One tick's record as a statement returned it, by job and tick.
pub(crate) type Written = HashMap<(String, i64), TickRecord>;

impl PostgresBackend {
    /// Applies every write of `writes` (no two for the same tick), one
    /// statement for the `Started` writes and one for the `Completed`
    /// ones, and answers each from the record it left, or from one read of
    /// the records the statements did not change (refusals and retries).
    pub(crate) async fn write_tick_records_batch(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Result<Vec<TickAnswer>, BackendError> {
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let mut written = Written::new();
        for start in [true, false] {
            let group: Vec<&(LockName, i64, TickWrite)> = writes
                .iter()
                .filter(|(_, _, w)| matches!(w, TickWrite::Start { .. }) == start)
                .collect();
            if group.is_empty() {
                continue;
            }
            let rows = self.write_group(&group, start).await?;
            let rows = by_tick(&rows)?;
            if !start {
                // The records and marks are written: a latest tick left
                // behind costs reads, never a second run, so it fails
                // nothing.
                let latest = latest_of(&rows);
                if let Err(e) = self.raise_latest(&latest).await {
                    warn!(error = %e, "completed ticks recorded; their jobs' latest ticks not raised");
                }
                if let Err(e) = self.prune_older(&latest, keep_ms).await {
                    warn!(error = %e, "completed ticks recorded; their jobs' old records not pruned");
                }
            }
            written.extend(rows);
        }
        let unchanged: Vec<(&str, i64)> = writes
            .iter()
            .filter(|(job, tick, _)| !written.contains_key(&(job.as_str().to_owned(), *tick)))
            .map(|(job, tick, _)| (job.as_str(), *tick))
            .collect();
        if !unchanged.is_empty() {
            written.extend(self.read_records(&unchanged).await?);
        }
        Ok(writes
            .iter()
            .map(|(job, tick, write)| {
                write.answer(written.get(&(job.as_str().to_owned(), *tick)).cloned())
            })
            .collect())
    }

    /// One group's statement, creating the tables on first use and sent
    /// again if it was a deadlock victim.
    async fn write_group(
        &self,
        group: &[&(LockName, i64, TickWrite)],
        start: bool,
    ) -> Result<Vec<Row>, BackendError> {
        self.retried("writing tick records", || async {
            if start {
                self.starts_once(group).await
            } else {
                self.completes_once(group).await
            }
        })
        .await
    }

    /// The `Started` writes: each inserts its record, or on a `Started` of
    /// a lower token does what its own stale rule says (only that row's).
    /// Old records are pruned by the completions, off the path between a
    /// tick's lock and its handler (the single write prunes on start).
    async fn starts_once(
        &self,
        group: &[&(LockName, i64, TickWrite)],
    ) -> Result<Vec<Row>, BackendError> {
        let session = self.session().await?;
        let ns = self.inner.config.namespace.as_str();
        let mut cols = StartColumns::default();
        for (job, tick, write) in group {
            cols.push(job, *tick, write)?;
        }
        let sql = format!(
            "WITH v AS (SELECT * FROM unnest($2::text[], $3::int8[], $4::int8[], $5::text[], \
             $6::int8[], $7::text[]) AS v(job, tick, token, replica, at, stale)), \
             {w} SELECT job, tick, state, token, replica, at FROM w",
            w = start_insert(&self.run_table(), "v")
        );
        session
            .query(
                "writing ticks' start records",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&cols.jobs, Type::TEXT_ARRAY),
                    (&cols.ticks, Type::INT8_ARRAY),
                    (&cols.tokens, Type::INT8_ARRAY),
                    (&cols.replicas, Type::TEXT_ARRAY),
                    (&cols.ats, Type::INT8_ARRAY),
                    (&cols.stales, Type::TEXT_ARRAY),
                ],
            )
            .await
    }

    /// The `Completed` writes: each completes its own `Started` record and,
    /// gated on that, marks the tick. The jobs' latest ticks are raised and
    /// their old marks and records pruned after it, each in a statement of
    /// its own ([`PostgresBackend::raise_latest`], [`PostgresBackend::prune_older`]).
    async fn completes_once(
        &self,
        group: &[&(LockName, i64, TickWrite)],
    ) -> Result<Vec<Row>, BackendError> {
        let session = self.session().await?;
        let ns = self.inner.config.namespace.as_str();
        let (mut jobs, mut ticks, mut tokens) = (vec![], vec![], vec![]);
        for (job, tick, write) in group {
            let TickWrite::Complete { token } = write else {
                continue;
            };
            jobs.push(job.as_str());
            ticks.push(*tick);
            tokens.push(token_param(*token)?);
        }
        let sql = self.complete_sql();
        session
            .query(
                "writing ticks' completed records",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&jobs, Type::TEXT_ARRAY),
                    (&ticks, Type::INT8_ARRAY),
                    (&tokens, Type::INT8_ARRAY),
                ],
            )
            .await
    }

    /// Raises each job's latest completed tick to its tick in `latest`, in a
    /// statement of its own. Every replica's
    /// completions raise the same few rows: inside the completions'
    /// statement their locks were held for all of it, and the replicas'
    /// batches queued behind one another (and timed out). A crash between
    /// the two statements leaves a latest tick behind its marks, which only
    /// costs a catch-up the reads of marks it then finds.
    async fn raise_latest(&self, latest: &[(&str, i64)]) -> Result<(), BackendError> {
        if latest.is_empty() {
            return Ok(());
        }
        let (jobs, ticks): (Vec<&str>, Vec<i64>) = latest.iter().copied().unzip();
        let sql = format!(
            "INSERT INTO {t} AS t (namespace, job, tick) \
             SELECT $1, job, tick FROM unnest($2::text[], $3::int8[]) AS q(job, tick) \
             ON CONFLICT (namespace, job) DO UPDATE SET tick = GREATEST(t.tick, EXCLUDED.tick) \
             WHERE t.tick < EXCLUDED.tick",
            t = self.tick_table()
        );
        let ns = self.inner.config.namespace.as_str();
        self.retried("raising the latest completed ticks", || async {
            self.session()
                .await?
                .query(
                    "raising the latest completed ticks",
                    &sql,
                    &[
                        (&ns, Type::TEXT),
                        (&jobs, Type::TEXT_ARRAY),
                        (&ticks, Type::INT8_ARRAY),
                    ],
                )
                .await
                .map(drop)
        })
        .await
    }

    /// Deletes the marks and records of each job more than `keep_ms`
    /// older than its latest tick in `latest`, in a statement of its own
    /// that skips rows another statement has locked (they go with a later
    /// batch): inside the completions' statement these deletes waited on
    /// other replicas' batches, and in per-tick mode, where every replica
    /// completes the same jobs, those waits ran into the statement timeout.
    async fn prune_older(&self, latest: &[(&str, i64)], keep_ms: i64) -> Result<(), BackendError> {
        if latest.is_empty() {
            return Ok(());
        }
        let (jobs, cuts): (Vec<&str>, Vec<i64>) = latest
            .iter()
            .map(|(job, tick)| (*job, tick.saturating_sub(keep_ms)))
            .unzip();
        let sql = self.prune_sql();
        let ns = self.inner.config.namespace.as_str();
        self.session()
            .await?
            .query(
                "pruning old tick records",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&jobs, Type::TEXT_ARRAY),
                    (&cuts, Type::INT8_ARRAY),
                ],
            )
            .await
            .map(drop)
    }

    /// The records of `ticks` as they stand, in one statement.
    pub(crate) async fn read_records(
        &self,
        ticks: &[(&str, i64)],
    ) -> Result<Written, BackendError> {
        let session = self.session().await?;
        let sql = self.read_records_sql();
        let ns = self.inner.config.namespace.as_str();
        let (jobs, at): (Vec<&str>, Vec<i64>) = ticks.iter().copied().unzip();
        let rows = match session
            .query(
                "reading tick records",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&jobs, Type::TEXT_ARRAY),
                    (&at, Type::INT8_ARRAY),
                ],
            )
            .await
        {
            Ok(rows) => rows,
            Err(e) if missing_table(&e) => return Ok(Written::new()),
            Err(e) => return Err(e),
        };
        by_tick(&rows)
    }
}

/// The statement part `w AS (...)` that inserts a `Started` record for each
/// row of `source` (columns job, tick, token, replica, at), the parameter
/// `$1` being the namespace. On a conflict only a `Started` record of a
/// lower token changes, as the row's stale rule in `v` (column `stale`)
/// says; `R` leaves it. Returns job, tick, state, token, replica, at of
/// each record written. Rows go in (job, tick) order, so two replicas'
/// batches lock them in the same order; the stale rule is looked up by the
/// row's key because `EXCLUDED` holds only the table's columns.
pub(crate) fn start_insert(runs: &str, source: &str) -> String {
    format!(
        "w AS (INSERT INTO {runs} AS r (namespace, job, tick, state, token, replica, at) \
         SELECT $1, job, tick, 'S', token, replica, at FROM {source} ORDER BY job, tick \
         ON CONFLICT (namespace, job, tick) DO UPDATE \
         SET state = (SELECT v.stale FROM v WHERE v.job = EXCLUDED.job AND v.tick = EXCLUDED.tick), \
         token = EXCLUDED.token, replica = EXCLUDED.replica, at = EXCLUDED.at \
         WHERE r.state = 'S' AND r.token < EXCLUDED.token \
         AND (SELECT v.stale FROM v WHERE v.job = EXCLUDED.job AND v.tick = EXCLUDED.tick) <> 'R' \
         RETURNING job, tick, state, token, replica, at)"
    )
}

/// The `Start` writes of a batch as its statement's parameters, a column
/// each.
#[derive(Default)]
pub(crate) struct StartColumns<'a> {
    pub(crate) jobs: Vec<&'a str>,
    pub(crate) ticks: Vec<i64>,
    pub(crate) tokens: Vec<i64>,
    pub(crate) replicas: Vec<&'a str>,
    pub(crate) ats: Vec<i64>,
    pub(crate) stales: Vec<&'static str>,
}

impl<'a> StartColumns<'a> {
    /// Adds one `Start` write; any other write is a caller's mistake.
    pub(crate) fn push(
        &mut self,
        job: &'a LockName,
        tick: i64,
        write: &'a TickWrite,
    ) -> Result<(), BackendError> {
        let TickWrite::Start {
            token,
            replica,
            at,
            on_stale,
        } = write
        else {
            return Err(protocol(format!(
                "a start of {job} at {tick} carried a Complete write"
            )));
        };
        self.jobs.push(job.as_str());
        self.ticks.push(tick);
        self.tokens.push(token_param(*token)?);
        self.replicas.push(replica.as_str());
        self.ats.push(*at);
        self.stales.push(stale_code(*on_stale));
        Ok(())
    }
}

/// Each job's highest tick among the `Completed` records of `written`, in
/// job order (the order every batch locks rows in).
fn latest_of(written: &Written) -> Vec<(&str, i64)> {
    let mut latest: HashMap<&str, i64> = HashMap::new();
    for ((job, tick), record) in written {
        if matches!(record, TickRecord::Completed { .. }) {
            let at = latest.entry(job.as_str()).or_insert(*tick);
            *at = (*at).max(*tick);
        }
    }
    let mut latest: Vec<(&str, i64)> = latest.into_iter().collect();
    latest.sort_unstable();
    latest
}

/// Rows of job, tick, state, token, replica, at, by job and tick.
fn by_tick(rows: &[Row]) -> Result<Written, BackendError> {
    let mut out = Written::with_capacity(rows.len());
    for row in rows {
        let job: String = row.try_get(0).map_err(|e| protocol(e.to_string()))?;
        let tick: i64 = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
        out.insert((job, tick), record(row, 2)?);
    }
    Ok(out)
}

/// Whether two writes of `writes` are for the same tick: one statement
/// cannot change a row twice, so such a batch is written item by item.
pub(crate) fn repeats_a_tick(writes: &[(LockName, i64, TickWrite)]) -> bool {
    let mut seen = HashSet::with_capacity(writes.len());
    !writes
        .iter()
        .all(|(job, tick, _)| seen.insert((job, *tick)))
}

/// The batch statements' texts, apart so that a test can read their plans.
impl PostgresBackend {
    /// The `Completed` writes of a batch: `$1` namespace, `$2` jobs, `$3`
    /// ticks, `$4` tokens.
    pub(crate) fn complete_sql(&self) -> String {
        format!(
            "WITH v AS (SELECT * FROM unnest($2::text[], $3::int8[], $4::int8[]) \
             AS v(job, tick, token)), \
             f AS MATERIALIZED (SELECT l.id, v.token FROM v CROSS JOIN LATERAL \
             (SELECT x.ctid AS id FROM {r} x WHERE x.namespace = $1 AND x.job = v.job \
             AND x.tick = v.tick LIMIT 1) l), \
             c AS (UPDATE {r} r SET state = 'C' FROM f \
             WHERE r.ctid = ANY(ARRAY(SELECT id FROM f)) AND r.ctid = f.id \
             AND r.state = 'S' AND r.token = f.token \
             RETURNING r.job, r.tick, r.state, r.token, r.replica, r.at), \
             marked AS (INSERT INTO {m} (namespace, job, tick) SELECT $1, job, tick FROM c \
             ORDER BY job, tick ON CONFLICT DO NOTHING) \
             SELECT job, tick, state, token, replica, at FROM c",
            r = self.run_table(),
            m = self.mark_table(),
        )
    }

    /// The pruning of old marks and records: `$1` namespace, `$2` jobs,
    /// `$3` each job's cut (records before it go).
    pub(crate) fn prune_sql(&self) -> String {
        format!(
            "WITH p AS (SELECT * FROM unnest($2::text[], $3::int8[]) AS p(job, cut)), \
             marks AS (DELETE FROM {m} WHERE ctid = ANY(ARRAY(SELECT l.id FROM p CROSS JOIN LATERAL \
             (SELECT m.ctid AS id FROM {m} m WHERE m.namespace = $1 AND m.job = p.job \
             AND m.tick < p.cut FOR UPDATE OF m SKIP LOCKED) l))) \
             DELETE FROM {r} WHERE ctid = ANY(ARRAY(SELECT l.id FROM p CROSS JOIN LATERAL \
             (SELECT r.ctid AS id FROM {r} r WHERE r.namespace = $1 AND r.job = p.job \
             AND r.tick < p.cut FOR UPDATE OF r SKIP LOCKED) l))",
            m = self.mark_table(),
            r = self.run_table()
        )
    }

    /// The read of records: `$1` namespace, `$2` jobs, `$3` ticks.
    pub(crate) fn read_records_sql(&self) -> String {
        format!(
            "SELECT r.job, r.tick, r.state, r.token, r.replica, r.at \
             FROM unnest($2::text[], $3::int8[]) AS q(job, tick) CROSS JOIN LATERAL \
             (SELECT * FROM {} x WHERE x.namespace = $1 AND x.job = q.job AND x.tick = q.tick \
             LIMIT 1) r",
            self.run_table()
        )
    }
}
