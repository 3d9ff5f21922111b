//! Fencing tokens from a sequence, created on first use.

use lock_core::BackendError;
use tokio_postgres::types::Type;

use crate::error::protocol;
use crate::session::LockSession;
use crate::PostgresBackend;

const NEXTVAL: &str = "SELECT pg_backend_pid(), nextval($1::text::regclass)";

impl PostgresBackend {
    /// Draws the next fencing token on `session`, creating the sequence on
    /// first use.
    pub(crate) async fn fencing_token(&self, session: &LockSession) -> Result<u64, BackendError> {
        let cfg = &self.inner.config;
        let seq = cfg.qualified(&cfg.fence_sequence);
        let first = self.nextval(session, &seq).await;
        let value = match first {
            Err(e) if e.message().contains("42P01") => {
                self.create_sequence(session).await?;
                self.nextval(session, &seq).await?
            }
            other => other?,
        };
        u64::try_from(value).map_err(|_| protocol(format!("the fencing sequence returned {value}")))
    }

    async fn nextval(&self, session: &LockSession, seq: &str) -> Result<i64, BackendError> {
        let rows = session
            .query("drawing a fencing token", NEXTVAL, &[(&seq, Type::TEXT)])
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| protocol("nextval returned no row"))?;
        session.check_pid(row)?;
        row.try_get(1).map_err(|e| protocol(e.to_string()))
    }

    async fn create_sequence(&self, session: &LockSession) -> Result<(), BackendError> {
        let ddl = self.inner.config.fencing_ddl();
        match session.batch("creating the fencing sequence", &ddl).await {
            Ok(()) => Ok(()),
            // Two sessions creating it at once: the loser sees a duplicate.
            Err(e) if e.message().contains("23505") || e.message().contains("42P07") => Ok(()),
            Err(e) => {
                Err(BackendError::new(
                    e.kind(),
                    format!(
                    "fencing needs the sequence {}, which could not be created ({}); run `{ddl}` \
                     once as a role with CREATE on the schema and grant USAGE on it, or turn \
                     fencing off",
                    self.inner.config.qualified(&self.inner.config.fence_sequence),
                    e.message()
                ),
                )
                .with_source(e))
            }
        }
    }
}
