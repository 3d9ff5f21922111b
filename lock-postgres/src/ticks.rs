//! [`TickStore`] for [`PostgresBackend`]: a small table next to the locks.

use lock_core::{async_trait, BackendError, LockName, TickStore};
use tokio_postgres::types::Type;

use crate::error::protocol;
use crate::PostgresBackend;

impl PostgresBackend {
    fn tick_table(&self) -> String {
        let cfg = &self.inner.config;
        cfg.qualified(&cfg.tick_table)
    }

    /// The DDL the tick store runs once, on its first write.
    pub fn tick_table_ddl(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (namespace text NOT NULL, job text NOT NULL, \
             tick bigint NOT NULL, PRIMARY KEY (namespace, job))",
            self.tick_table()
        )
    }

    async fn upsert_tick(&self, job: &LockName, tick: i64) -> Result<(), BackendError> {
        let session = self.session().await?;
        let sql = format!(
            "INSERT INTO {t} AS t (namespace, job, tick) VALUES ($1, $2, $3) \
             ON CONFLICT (namespace, job) DO UPDATE SET tick = GREATEST(t.tick, EXCLUDED.tick)",
            t = self.tick_table()
        );
        let ns = self.inner.config.namespace.as_str();
        session
            .query(
                "recording a completed tick",
                &sql,
                &[
                    (&ns, Type::TEXT),
                    (&job.as_str(), Type::TEXT),
                    (&tick, Type::INT8),
                ],
            )
            .await
            .map(drop)
    }
}

fn missing_table(e: &BackendError) -> bool {
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

    async fn record_completed(&self, job: &LockName, tick: i64) -> Result<(), BackendError> {
        match self.upsert_tick(job, tick).await {
            Err(e) if missing_table(&e) => {
                let session = self.session().await?;
                match session
                    .batch("creating the tick table", &self.tick_table_ddl())
                    .await
                {
                    // A concurrent creator won the race; the table is there.
                    Err(e) if !e.message().contains("23505") && !e.message().contains("42P07") => {
                        return Err(e)
                    }
                    _ => {}
                }
                self.upsert_tick(job, tick).await
            }
            other => other,
        }
    }
}
