//! Postgres-only rows: acquire+release with fencing tokens off and on
//! against the raw floor, and 10,000 leases (their acquisition and renewal
//! sweep) for each lock session count asked for (`--pg-sessions 1,2,4`).
//!
//! Always on a private server: 10,000 leases plus the batched floor's
//! 10,000 need a shared lock table larger than a default server's 6,400
//! slots (the harness starts it with `max_locks_per_transaction=256`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance_tests::backends::postgres::PostgresFactory;
use conformance_tests::{BackendFactory, BoxError, Ctx, Saboteur, Timing};
use lock_core::{Capabilities, LockBackend};

use crate::report::Row;
use crate::{floors, measures, Mode};

/// How many leases the session rows hold.
const LEASES: usize = 10_000;

/// The lock session counts measured unless `--pg-sessions` says otherwise.
pub(crate) fn default_sessions(mode: Mode) -> Vec<usize> {
    match mode {
        Mode::Short => vec![4],
        Mode::Full => vec![1, 2, 4, 8, 16],
    }
}

/// Parses `--pg-sessions 1,2,4` (each 1 to 64, as the backend accepts).
pub(crate) fn parse_sessions(list: &str) -> Result<Vec<usize>, BoxError> {
    list.split(',')
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => Ok(n),
            _ => Err(
                format!("--pg-sessions takes counts from 1 to 64, like 1,2,4; got {s:?}").into(),
            ),
        })
        .collect()
}

/// The suite's Postgres factory with the backend's settings changed.
struct Tuned {
    base: Arc<PostgresFactory>,
    label: String,
    sessions: Option<usize>,
    fencing: bool,
    max_ttl: Duration,
    statement_timeout: Option<Duration>,
}

#[async_trait]
impl BackendFactory for Tuned {
    fn name(&self) -> &str {
        &self.label
    }

    fn capabilities(&self) -> Capabilities {
        self.base.capabilities().with_fencing(self.fencing)
    }

    fn timing(&self) -> Timing {
        self.base.timing()
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        // Started before the runtime ran (see main): this only reads it.
        let url = self.base.url()?;
        let mut builder = self
            .base
            .builder_for(&url)?
            .with_fencing_tokens(self.fencing)
            .with_max_ttl(self.max_ttl);
        if let Some(n) = self.sessions {
            builder = builder.with_lock_sessions(n);
        }
        if let Some(t) = self.statement_timeout {
            builder = builder.with_statement_timeout(t);
        }
        Ok(Arc::new(builder.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        self.base.saboteur().await
    }

    fn server_addr(&self) -> Option<SocketAddr> {
        self.base.server_addr()
    }
}

/// The Postgres rows, on `base`'s private server (started by the caller).
pub(crate) async fn rows(
    base: Arc<PostgresFactory>,
    sessions: &[usize],
    mode: Mode,
    acquire_only: bool,
    run_id: &str,
) -> Result<Vec<Row>, BoxError> {
    let url = base.url()?;
    let floor = floors::postgres_floor(&url).await?;
    let mut rows = Vec::new();
    for fencing in [false, true] {
        let tuned = Tuned {
            base: Arc::clone(&base),
            label: format!("postgres fencing {}", if fencing { "on" } else { "off" }),
            sessions: None,
            fencing,
            max_ttl: Duration::from_secs(2),
            statement_timeout: None,
        };
        let ctx = Ctx::new(Arc::new(tuned), run_id, "bench-pg");
        for concurrency in [1, 16] {
            let row = measures::uncontended(&ctx, &floor, "floor", concurrency, mode).await?;
            eprintln!("  {}: {} ({})", row.backend, row.measure, row.setting);
            rows.push(row);
        }
    }
    if acquire_only {
        return Ok(rows);
    }
    for &n in sessions {
        let tuned = Tuned {
            base: Arc::clone(&base),
            label: format!("postgres {n} lock sessions"),
            sessions: Some(n),
            fencing: true,
            // The TTL the other backends' renewal rows use (9 s).
            max_ttl: Duration::from_secs(10),
            // One session with 10,000 locks is the slow case measured here;
            // the suite's 1 s bound would cut it short on a loaded machine.
            statement_timeout: Some(Duration::from_secs(10)),
        };
        let label = tuned.label.clone();
        let ctx = Ctx::new(Arc::new(tuned), run_id, "bench-pg");
        match measures::renewal_at_scale(&ctx, LEASES, mode).await {
            Ok(row) => {
                eprintln!("  {}: {} ({})", row.backend, row.measure, row.setting);
                rows.push(row);
            }
            // The other counts are still worth measuring.
            Err(e) => {
                eprintln!("  {label}: FAILED: {e}");
                rows.push(Row::new(&label, "FAILED", e.to_string()));
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_lists_parse_and_refuse_out_of_range() {
        assert_eq!(parse_sessions("1,2, 16").ok(), Some(vec![1, 2, 16]));
        for bad in ["0", "65", "x", "", "4,"] {
            assert!(parse_sessions(bad).is_err(), "{bad}");
        }
    }
}
