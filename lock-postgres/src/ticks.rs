//! [`TickStore`] for [`PostgresBackend`]: a small table next to the locks.

use std::time::Duration;

use lock_core::{
    async_trait, BackendError, LockName, StartCheck, StartVerdict, TickAnswer, TickRecord,
    TickStore, TickWrite,
};
use tokio_postgres::types::Type;

use crate::error::protocol;
use crate::tick_runs_batch::repeats_a_tick;
use crate::PostgresBackend;

impl PostgresBackend {
    pub(crate) fn tick_table(&self) -> String {
        let cfg = &self.inner.config;
        cfg.qualified(&cfg.tick_table)
    }

    /// Marks of single completed ticks live beside the latest ones.
    pub(crate) fn mark_table(&self) -> String {
        let cfg = &self.inner.config;
        cfg.qualified(&format!("{}_marks", cfg.tick_table))
    }

    /// The DDL the tick store runs once, on its first write: the latest
    /// completed tick per job, the marks of single completed ticks, and the
    /// records of started ticks.
    pub fn tick_table_ddl(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (namespace text NOT NULL, job text NOT NULL, \
             tick bigint NOT NULL, PRIMARY KEY (namespace, job)); \
             CREATE TABLE IF NOT EXISTS {} (namespace text NOT NULL, job text NOT NULL, \
             tick bigint NOT NULL, PRIMARY KEY (namespace, job, tick)); \
             CREATE TABLE IF NOT EXISTS {} (namespace text NOT NULL, job text NOT NULL, \
             tick bigint NOT NULL, state text NOT NULL, token bigint NOT NULL, \
             replica text NOT NULL, at bigint NOT NULL, PRIMARY KEY (namespace, job, tick))",
            self.tick_table(),
            self.mark_table(),
            self.run_table()
        )
    }

    /// One statement: prune the job's marks more than `keep_ms` older than
    /// `tick`, mark `tick`, and raise the latest completed tick.
    async fn upsert_tick(
        &self,
        job: &LockName,
        tick: i64,
        keep_ms: i64,
    ) -> Result<(), BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "WITH pruned AS (DELETE FROM {m} WHERE namespace = $1 AND job = $2 AND tick < $4), \
             marked AS (INSERT INTO {m} (namespace, job, tick) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING) \
             INSERT INTO {t} AS t (namespace, job, tick) VALUES ($1, $2, $3) \
             ON CONFLICT (namespace, job) DO UPDATE SET tick = GREATEST(t.tick, EXCLUDED.tick)",
            t = self.tick_table(),
            m = self.mark_table()
        );
        let ns = self.inner.config.namespace.as_str();
        let cut = tick.saturating_sub(keep_ms);
        session
            .query(
                "recording a completed tick",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&job.as_str(), Type::TEXT),
                    (&tick, Type::INT8),
                    (&cut, Type::INT8),
                ],
            )
            .await
            .map(drop)
    }
}

impl PostgresBackend {
    /// Creates the tick tables after a write found them missing.
    pub(crate) async fn create_tick_tables(&self) -> Result<(), BackendError> {
        let session = self.session().await?;
        match session
            .batch("creating the tick table", &self.tick_table_ddl())
            .await
        {
            // A concurrent creator won the race; the table is there.
            Err(e) if !e.message().contains("23505") && !e.message().contains("42P07") => Err(e),
            _ => Ok(()),
        }
    }
}

pub(crate) fn missing_table(e: &BackendError) -> bool {
    e.message().contains("42P01")
}

#[async_trait]
impl TickStore for PostgresBackend {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "SELECT tick FROM {} WHERE namespace = $1 AND job = $2",
            self.tick_table()
        );
        let ns = self.inner.config.namespace.as_str();
        let rows = match session
            .query(
                "reading the last completed tick",
                &sql,
                &[(&ns, Type::TEXT), (&job.as_str(), Type::TEXT)],
            )
            .await
        {
            Ok(rows) => rows,
            // Nothing was ever recorded: the table is created on first write.
            Err(e) if missing_table(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        match rows.first() {
            Some(row) => row
                .try_get::<_, i64>(0)
                .map(Some)
                .map_err(|e| protocol(e.to_string())),
            None => Ok(None),
        }
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        let session = self.session().await?;
        let rows = session
            .query(
                "reading the server time",
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
                &[],
            )
            .await?;
        match rows.first() {
            Some(row) => row
                .try_get::<_, i64>(0)
                .map(Some)
                .map_err(|e| protocol(e.to_string())),
            None => Err(protocol("SELECT clock_timestamp() returned no row")),
        }
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        match self.upsert_tick(job, tick, keep_ms).await {
            Err(e) if missing_table(&e) => {
                self.create_tick_tables().await?;
                self.upsert_tick(job, tick, keep_ms).await
            }
            other => other,
        }
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        self.write_tick_record(job, tick, write, keep).await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        self.read_tick_record(job, tick).await
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        // A lone write keeps its one-row statement; a batch goes as one
        // statement per kind of write, not one transaction per tick.
        if writes.len() < 2 || repeats_a_tick(writes) {
            let mut out = Vec::with_capacity(writes.len());
            for (job, tick, write) in writes {
                out.push(self.write_tick_record(job, *tick, write, keep).await);
            }
            return out;
        }
        each(
            self.write_tick_records_batch(writes, keep).await,
            writes.len(),
        )
    }

    fn checks_starts_in_one_step(&self) -> bool {
        true
    }

    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        if starts.is_empty() {
            return Vec::new();
        }
        self.start_checked_batch(starts, keep).await
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        if jobs.is_empty() {
            return Vec::new();
        }
        each(self.last_completed_batch(jobs).await, jobs.len())
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        if ticks.is_empty() {
            return Vec::new();
        }
        each(self.is_completed_batch(ticks).await, ticks.len())
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        if ticks.is_empty() {
            return Vec::new();
        }
        let done = self.record_completed_batch(ticks, keep).await;
        each(done.map(|()| vec![(); ticks.len()]), ticks.len())
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE namespace = $1 AND job = $2 AND tick = $3)",
            self.mark_table()
        );
        let ns = self.inner.config.namespace.as_str();
        let rows = match session
            .query(
                "reading a tick mark",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&job.as_str(), Type::TEXT),
                    (&tick, Type::INT8),
                ],
            )
            .await
        {
            Ok(rows) => rows,
            // Nothing was ever recorded: the tables are created on first write.
            Err(e) if missing_table(&e) => return Ok(false),
            Err(e) => return Err(e),
        };
        match rows.first() {
            Some(row) => row
                .try_get::<_, bool>(0)
                .map_err(|e| protocol(e.to_string())),
            None => Err(protocol("SELECT EXISTS returned no row")),
        }
    }
}

/// One result per item of a batch of `len` that one statement answered: its
/// answers, or its error for each.
fn each<T>(batch: Result<Vec<T>, BackendError>, len: usize) -> Vec<Result<T, BackendError>> {
    match batch {
        Ok(answers) => answers.into_iter().map(Ok).collect(),
        Err(e) => e.for_each(len),
    }
}
