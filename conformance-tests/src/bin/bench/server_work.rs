//! What the server did for a scheduler row, read from the server's own
//! counters before the replicas start and after they are gone: the calls the
//! bench counts in the client say nothing of how many of them shared one
//! command or statement (the lanes join concurrent calls), this does.
//!
//! - Redis: commands processed (`INFO commandstats`), the commands a script
//!   runs included, and the script calls among them.
//! - Postgres: transactions committed or rolled back in the database
//!   (`pg_stat_database`); each statement outside an explicit transaction
//!   is one. A session reports its counts when idle, at most once a second
//!   and at the latest when it ends, so the second reading waits until the
//!   replicas' sessions have ended.
//! - etcd: gRPC messages received (`grpc_server_msg_received_total` on
//!   the first endpoint's `/metrics`), keep-alives on a lease's stream
//!   included; a single member, or the figure covers one member only.
//! - memory: not counted.
//!
//! Both readings include everything else the server did meanwhile, so run
//! the bench against a server nothing else uses.

use std::time::Duration;

use crate::floors::{postgres_query_one, FloorSource};
use conformance_tests::BoxError;
use tokio::time::Instant;

/// How long the replicas' Postgres sessions may take to end after their
/// schedulers are dropped.
const SESSIONS_END_WITHIN: Duration = Duration::from_secs(10);

/// One reading of a server's counters.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Reading {
    /// Commands (Redis) or transactions (Postgres).
    total: u64,
    /// Script calls (Redis), if the server tells them apart.
    scripts: Option<u64>,
    /// Sessions other than the reader's (Postgres), to see the replicas'
    /// end.
    sessions: u64,
}

/// Where to read a backend's server counters.
pub(crate) enum ServerWork {
    Redis(String),
    Postgres(String),
    /// `host:port` of a plain-text etcd endpoint.
    Etcd(String),
    NotCounted,
}

impl ServerWork {
    /// The counters of `source`'s server.
    pub(crate) fn of(source: &FloorSource) -> Self {
        match source {
            FloorSource::Redis { url, .. } => Self::Redis(url.clone()),
            FloorSource::Postgres { url } => Self::Postgres(url.clone()),
            FloorSource::Etcd { endpoints } => endpoints
                .first()
                .and_then(|e| e.strip_prefix("http://"))
                .map_or(Self::NotCounted, |e| Self::Etcd(e.to_owned())),
            FloorSource::Trait => Self::NotCounted,
        }
    }

    /// Reads the counters now.
    pub(crate) async fn read(&self) -> Result<Reading, BoxError> {
        match self {
            Self::Redis(url) => {
                let client = redis::Client::open(url.as_str())?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                let info: String = redis::cmd("INFO")
                    .arg("commandstats")
                    .query_async(&mut conn)
                    .await?;
                Ok(redis_reading(&info))
            }
            Self::Postgres(url) => {
                let row = postgres_query_one(
                    url,
                    "SELECT (SELECT xact_commit + xact_rollback FROM pg_stat_database \
                             WHERE datname = current_database()), \
                            (SELECT count(*) FROM pg_stat_activity \
                             WHERE datname = current_database() AND pid <> pg_backend_pid())",
                )
                .await?;
                Ok(Reading {
                    total: u64::try_from(row.get::<_, i64>(0))?,
                    scripts: None,
                    sessions: u64::try_from(row.get::<_, i64>(1))?,
                })
            }
            Self::Etcd(addr) => Ok(Reading {
                total: etcd_messages(&metrics_page(addr).await?),
                ..Reading::default()
            }),
            Self::NotCounted => Ok(Reading::default()),
        }
    }

    /// Deletes the tick tables' rows of `jobs` (Postgres; elsewhere
    /// nothing): a job's old rows are pruned only by its own later
    /// completions, and every run names new jobs, so without this the
    /// tables grow run after run and later runs measure a larger table.
    /// The tables are the default ones; none of them yet is no error.
    pub(crate) async fn clear_ticks(&self, jobs: &[String]) -> Result<(), BoxError> {
        let Self::Postgres(url) = self else {
            return Ok(());
        };
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        let driver = tokio::spawn(connection);
        for table in ["lock_ticks", "lock_ticks_marks", "lock_ticks_runs"] {
            let sql = format!(
                "DO $$ BEGIN IF to_regclass('{table}') IS NOT NULL THEN \
                 DELETE FROM {table} WHERE job = ANY(ARRAY[{}]::text[]); END IF; END $$",
                jobs.iter()
                    .map(|j| format!("'{}'", j.replace('\'', "''")))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            client.batch_execute(&sql).await?;
        }
        drop(client);
        let _ = driver.await;
        Ok(())
    }

    /// Reads the counters once the sessions opened since `before` have
    /// ended (Postgres: their last counts are reported as they end), or
    /// right away where counts are immediate.
    pub(crate) async fn read_after(&self, before: &Reading) -> Result<Reading, BoxError> {
        let deadline = Instant::now() + SESSIONS_END_WITHIN;
        loop {
            let now = self.read().await?;
            if !matches!(self, Self::Postgres(_)) || now.sessions <= before.sessions {
                return Ok(now);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} sessions still open {} s after the replicas stopped",
                    now.sessions - before.sessions,
                    SESSIONS_END_WITHIN.as_secs()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The row's figures between two readings, per tick run and per
    /// replica: none where nothing is counted.
    pub(crate) fn per_tick(
        &self,
        before: &Reading,
        after: &Reading,
        ticks: usize,
        replicas: usize,
    ) -> Vec<(&'static str, String)> {
        let unit = ticks.saturating_mul(replicas).max(1) as f64;
        let per = |a: u64, b: u64| format!("{:.2}", b.saturating_sub(a) as f64 / unit);
        let total = match self {
            Self::Redis(_) => "server commands/tick/replica",
            Self::Postgres(_) => "server transactions/tick/replica",
            Self::Etcd(_) => "server gRPC messages/tick/replica",
            Self::NotCounted => return Vec::new(),
        };
        let mut out = vec![(total, per(before.total, after.total))];
        if let (Some(a), Some(b)) = (before.scripts, after.scripts) {
            out.push(("of them scripts", per(a, b)));
        }
        out
    }
}

/// The `/metrics` page of the etcd member at `addr` (`host:port`), over a
/// plain HTTP/1.0 request: one page, read to the end.
async fn metrics_page(addr: &str) -> Result<String, BoxError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut page = String::new();
        stream.read_to_string(&mut page).await?;
        Ok::<_, std::io::Error>(page)
    };
    let page = tokio::time::timeout(SESSIONS_END_WITHIN, read)
        .await
        .map_err(|_| format!("etcd {addr} /metrics did not answer"))??;
    Ok(page)
}

/// gRPC messages received, summed over every method, from a Prometheus
/// text page.
fn etcd_messages(page: &str) -> u64 {
    page.lines()
        .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Commands and script calls from `INFO commandstats` (lines like
/// `cmdstat_evalsha:calls=12,usec=…`).
fn redis_reading(info: &str) -> Reading {
    let mut reading = Reading {
        scripts: Some(0),
        ..Reading::default()
    };
    for line in info.lines() {
        let Some((name, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls = stats
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        reading.total += calls;
        if matches!(
            name,
            "eval" | "evalsha" | "eval_ro" | "evalsha_ro" | "fcall" | "fcall_ro"
        ) {
            reading.scripts = reading.scripts.map(|s| s + calls);
        }
    }
    reading
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_are_summed_and_scripts_told_apart() {
        let info = "# Commandstats\r\n\
            cmdstat_set:calls=10,usec=20,usec_per_call=2.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_evalsha:calls=3,usec=9,usec_per_call=3.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_info:calls=2,usec=1,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n";
        let r = redis_reading(info);
        assert_eq!(r.total, 15);
        assert_eq!(r.scripts, Some(3));
    }

    #[test]
    fn grpc_messages_are_summed_over_methods() {
        let page = "# HELP grpc_server_msg_received_total Total ...\n\
            grpc_server_msg_received_total{grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 12\n\
            grpc_server_msg_received_total{grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"} 3\n\
            grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Txn\"} 12\n";
        assert_eq!(etcd_messages(page), 15);
    }
}
