//! The Postgres store: one function call per decision, on the server's clock.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Statement};

use super::{Store, StoreDecision, StoreRequest};
use crate::error::{StoreError, StoreErrorKind};

/// The table [`PostgresStore`] keeps buckets in unless told otherwise.
pub const DEFAULT_TABLE: &str = "distlock_rate_limits";

/// Buckets in an UNLOGGED Postgres table, shared by every replica that uses
/// the same database and table.
///
/// A decision is one call of a PL/pgSQL function (created at the first
/// connection, idempotently) that locks each key's row in key order with
/// `INSERT … ON CONFLICT DO UPDATE … RETURNING`, reads `clock_timestamp()`
/// once the rows are locked, and writes the new arrival times only when
/// every limit admits: several limits are one atomic step and one round
/// trip. The table is UNLOGGED (rate-limit state is not worth a WAL write;
/// a crash empties it, which refills every bucket, and it is not replicated
/// to standbys). A row's arrival time is its expiry: calls delete a few rows
/// whose buckets have been full for a minute, now and then.
pub struct PostgresStore {
    url: Option<String>,
    table: String,
    client: Mutex<Option<(Arc<Client>, Statement)>>,
    given: std::sync::Mutex<Option<Client>>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

fn ddl(table: &str) -> String {
    format!(
        r"
CREATE UNLOGGED TABLE IF NOT EXISTS {table} (key text PRIMARY KEY, tat bigint NOT NULL);
CREATE OR REPLACE FUNCTION {table}_decide(p_keys text[], p_intervals bigint[], p_capacities bigint[], p_cost bigint)
RETURNS bigint[] LANGUAGE plpgsql AS $fn$
DECLARE
  n int := coalesce(array_length(p_keys, 1), 0);
  tats bigint[] := '{{}}';
  news bigint[] := '{{}}';
  cur bigint;
  now_us bigint;
  full_at bigint;
  allowed boolean := true;
  retry bigint := 0;
  refused_by int := 1;
  remaining bigint := -1;
  least_i int := 1;
  resets bigint[] := '{{}}';
  after_us bigint;
  left_units bigint;
BEGIN
  -- Keys arrive sorted: concurrent calls lock rows in one order.
  FOR i IN 1..n LOOP
    INSERT INTO {table} AS r (key, tat) VALUES (p_keys[i], 0)
      ON CONFLICT (key) DO UPDATE SET tat = r.tat RETURNING r.tat INTO cur;
    tats[i] := cur;
  END LOOP;
  now_us := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
  FOR i IN 1..n LOOP
    full_at := now_us + p_capacities[i];
    tats[i] := least(greatest(tats[i], now_us), full_at);
    news[i] := tats[i] + p_cost * p_intervals[i];
    IF news[i] > full_at THEN
      allowed := false;
      IF news[i] - full_at > retry THEN
        retry := news[i] - full_at;
        refused_by := i;
      END IF;
    END IF;
  END LOOP;
  FOR i IN 1..n LOOP
    after_us := CASE WHEN allowed THEN news[i] ELSE tats[i] END;
    left_units := (now_us + p_capacities[i] - after_us) / p_intervals[i];
    IF remaining < 0 OR left_units < remaining THEN
      remaining := left_units;
      least_i := i;
    END IF;
    resets[i] := after_us - now_us;
    IF allowed THEN
      UPDATE {table} SET tat = after_us WHERE key = p_keys[i];
    END IF;
  END LOOP;
  IF random() < 0.01 THEN
    DELETE FROM {table} WHERE key IN (
      SELECT key FROM {table} WHERE tat < now_us - 60000000 LIMIT 100 FOR UPDATE SKIP LOCKED);
  END IF;
  IF NOT allowed THEN
    least_i := refused_by;
  END IF;
  RETURN ARRAY[allowed::int::bigint, greatest(remaining, 0), retry, coalesce(resets[least_i], 0),
    least_i - 1, now_us];
END
$fn$;
"
    )
}

fn map_error(e: &tokio_postgres::Error) -> StoreError {
    let kind = if e.is_closed() {
        StoreErrorKind::Connection
    } else if e.as_db_error().is_some() {
        StoreErrorKind::Server
    } else {
        StoreErrorKind::Connection
    };
    // A driver error's text names the failing step, never the connection
    // string.
    StoreError::new(kind, e.to_string())
}

impl PostgresStore {
    /// A store connecting to `url` (`postgres://`, without TLS) at the first
    /// decision and again after the connection breaks, so a server down at
    /// start does not stop the service. `table` must be a plain identifier
    /// (`[a-z_][a-z0-9_]*`, at most 48 bytes); the function beside it is
    /// named `<table>_decide`.
    ///
    /// # Errors
    ///
    /// [`StoreError`] (kind `Protocol`) for a malformed URL or table name.
    pub fn connect(url: &str, table: &str) -> Result<Self, StoreError> {
        check_table(table)?;
        let shown = lock_core::redact::redact_url(url);
        let config = url.parse::<tokio_postgres::Config>().map_err(|_| {
            StoreError::new(
                StoreErrorKind::Protocol,
                format!("cannot use Postgres URL {shown}"),
            )
        })?;
        // This constructor connects without TLS; a URL that demands it
        // would fail at every decision, so refuse it at start instead.
        if !matches!(
            config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable | tokio_postgres::config::SslMode::Prefer
        ) {
            return Err(StoreError::new(
                StoreErrorKind::Protocol,
                format!(
                    "{shown} requires TLS, which PostgresStore::connect does not make: connect a \
                     client with TLS and pass it to PostgresStore::with_client"
                ),
            ));
        }
        Ok(Self {
            url: Some(url.to_owned()),
            table: table.to_owned(),
            client: Mutex::new(None),
            given: std::sync::Mutex::new(None),
        })
    }

    /// A store over a client the caller connected (with TLS, say); it does
    /// not reconnect. The schema is created at the first decision, or by
    /// [`setup`](Self::setup).
    ///
    /// # Errors
    ///
    /// [`StoreError`] (kind `Protocol`) for a malformed table name.
    pub fn with_client(client: Client, table: &str) -> Result<Self, StoreError> {
        check_table(table)?;
        Ok(Self {
            url: None,
            table: table.to_owned(),
            client: Mutex::new(None),
            given: std::sync::Mutex::new(Some(client)),
        })
    }

    /// Creates the table and the function if they do not exist (several
    /// replicas may run this at once: it serialises on an advisory lock).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the server cannot be reached or refuses the DDL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the DDL runs in one transaction.
    pub async fn setup(&self) -> Result<(), StoreError> {
        self.client().await.map(|_| ())
    }

    /// The connection and the prepared decision statement, connecting (and
    /// creating the schema) first when there is none or it broke.
    async fn client(&self) -> Result<(Arc<Client>, Statement), StoreError> {
        let mut slot = self.client.lock().await;
        if let Some((client, statement)) = slot.as_ref().filter(|(c, _)| !c.is_closed()) {
            return Ok((Arc::clone(client), statement.clone()));
        }
        let given = self
            .given
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let client = match (given, &self.url) {
            (Some(client), _) => client,
            (None, Some(url)) => {
                let (client, connection) = tokio_postgres::connect(url, NoTls)
                    .await
                    .map_err(|e| map_error(&e))?;
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::warn!(error = %e, "rate-limit Postgres connection ended");
                    }
                });
                client
            }
            (None, None) => {
                return Err(StoreError::new(
                    StoreErrorKind::Connection,
                    "the Postgres connection closed and this store was given a client, so it cannot reconnect",
                ))
            }
        };
        create(&client, &self.table).await?;
        let sql = format!("SELECT {}_decide($1, $2, $3, $4)", self.table);
        let statement = client.prepare(&sql).await.map_err(|e| map_error(&e))?;
        let client = Arc::new(client);
        *slot = Some((Arc::clone(&client), statement.clone()));
        Ok((client, statement))
    }
}

async fn create(client: &Client, table: &str) -> Result<(), StoreError> {
    let sql = format!(
        "BEGIN; SELECT pg_advisory_xact_lock(hashtext('{table}_decide')); {} COMMIT;",
        ddl(table)
    );
    client.batch_execute(&sql).await.map_err(|e| map_error(&e))
}

fn check_table(table: &str) -> Result<(), StoreError> {
    let ok = !table.is_empty()
        && table.len() <= 48
        && table.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && table
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(StoreError::new(
            StoreErrorKind::Protocol,
            "a rate-limit table name must be 1 to 48 characters of [a-z0-9_], not starting with a digit",
        ))
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError> {
        // Rows are locked in key order, so sort the keys and remember where
        // each came from.
        let mut order: Vec<usize> = (0..request.keys.len()).collect();
        order.sort_by(|&a, &b| request.keys[a].cmp(&request.keys[b]));
        let keys: Vec<&str> = order.iter().map(|&i| request.keys[i].as_str()).collect();
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let intervals: Vec<i64> = order
            .iter()
            .map(|&i| to_i64(request.cells[i].interval))
            .collect();
        let capacities: Vec<i64> = order
            .iter()
            .map(|&i| to_i64(request.cells[i].capacity))
            .collect();
        let (client, statement) = self.client().await?;
        let row = client
            .query_one(
                &statement,
                &[&keys, &intervals, &capacities, &to_i64(request.cost)],
            )
            .await
            .map_err(|e| map_error(&e))?;
        let reply: Vec<i64> = row.try_get(0).map_err(|e| map_error(&e))?;
        let bad = || StoreError::new(StoreErrorKind::Protocol, "unexpected function reply");
        let field = |i: usize| {
            reply
                .get(i)
                .and_then(|v| u64::try_from(*v).ok())
                .ok_or_else(bad)
        };
        let sorted_index = usize::try_from(field(4)?).map_err(|_| bad())?;
        Ok(StoreDecision {
            allowed: field(0)? == 1,
            remaining: field(1)?,
            retry_after_us: field(2)?,
            reset_after_us: field(3)?,
            limiting: order.get(sorted_index).copied().ok_or_else(bad)?,
            now_us: field(5)?,
        })
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }
}
