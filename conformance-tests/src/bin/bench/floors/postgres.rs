//! Postgres floor: `pg_try_advisory_lock(a, b)` + `pg_advisory_unlock(a, b)`
//! as prepared statements on one tokio-postgres connection that every task
//! shares (its requests pipelined), the same shape as the library's single
//! lock session, so the ratio measures the library and not the connection
//! shape.

use std::hash::{Hash, Hasher};

use async_trait::async_trait;
use conformance_tests::BoxError;
use lock_core::LockName;
use tokio_postgres::{Client, NoTls, Row, Statement};

use super::Floor;

struct Session {
    client: Client,
    lock: Statement,
    unlock: Statement,
}

pub(super) struct PgFloor {
    session: Session,
}

impl PgFloor {
    pub(super) async fn connect(url: &str) -> Result<Self, BoxError> {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
        tokio::spawn(connection);
        let lock = client
            .prepare("SELECT pg_try_advisory_lock($1::int4, $2::int4)")
            .await?;
        let unlock = client
            .prepare("SELECT pg_advisory_unlock($1::int4, $2::int4)")
            .await?;
        Ok(Self {
            session: Session {
                client,
                lock,
                unlock,
            },
        })
    }
}

/// The size of the server's shared lock table:
/// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`.
pub(crate) async fn lock_table_slots(url: &str) -> Result<usize, BoxError> {
    let row = query_one(
        url,
        "SELECT current_setting('max_locks_per_transaction')::int8 * \
         (current_setting('max_connections')::int8 \
          + current_setting('max_prepared_transactions')::int8)",
    )
    .await?;
    Ok(usize::try_from(row.get::<_, i64>(0))?)
}

/// The one row `sql` answers, on a connection of its own, closed before
/// this returns (so that it is not counted as a session still open).
pub(crate) async fn query_one(url: &str, sql: &str) -> Result<Row, BoxError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    let driver = tokio::spawn(connection);
    let row = client.query_one(sql, &[]).await?;
    drop(client);
    let _ = driver.await;
    Ok(row)
}

/// Two int4 keys from the name (the library derives its own the same size).
fn keys(name: &LockName) -> (i32, i32) {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.as_str().hash(&mut h);
    let v = h.finish();
    ((v >> 32) as u32 as i32, v as u32 as i32)
}

#[async_trait]
impl Floor for PgFloor {
    fn describe(&self) -> String {
        "prepared pg_try_advisory_lock + pg_advisory_unlock; one session shared by every task, pipelined (as the library)".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let s = &self.session;
        let (a, b) = keys(name);
        let got: bool = s.client.query_one(&s.lock, &[&a, &b]).await?.get(0);
        if !got {
            return Err(format!("postgres floor: {name} was taken").into());
        }
        let freed: bool = s.client.query_one(&s.unlock, &[&a, &b]).await?.get(0);
        if !freed {
            return Err(format!("postgres floor: {name} was not held").into());
        }
        Ok(())
    }
}
