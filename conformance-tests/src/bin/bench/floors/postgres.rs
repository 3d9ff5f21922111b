//! Postgres floor: `pg_try_advisory_lock(a, b)` + `pg_advisory_unlock(a, b)`
//! as prepared statements, one tokio-postgres connection per task.
//!
//! One connection per task, unlike the library (whose `Locker` shares one
//! session per backend, so 16 tasks queue on one server process): this is the
//! floor the protocol allows, so at concurrency 16 the ratio includes the
//! cost of the library's one-session design.

use std::hash::{Hash, Hasher};

use async_trait::async_trait;
use conformance_tests::BoxError;
use lock_core::LockName;
use tokio_postgres::{Client, NoTls, Statement};

use super::Floor;

struct Session {
    client: Client,
    lock: Statement,
    unlock: Statement,
}

pub(super) struct PgFloor {
    sessions: Vec<Session>,
}

impl PgFloor {
    pub(super) async fn connect(url: &str, tasks: usize) -> Result<Self, BoxError> {
        let mut sessions = Vec::with_capacity(tasks);
        for _ in 0..tasks.max(1) {
            let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
            tokio::spawn(connection);
            let lock = client
                .prepare("SELECT pg_try_advisory_lock($1::int4, $2::int4)")
                .await?;
            let unlock = client
                .prepare("SELECT pg_advisory_unlock($1::int4, $2::int4)")
                .await?;
            sessions.push(Session {
                client,
                lock,
                unlock,
            });
        }
        Ok(Self { sessions })
    }
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
        "prepared pg_try_advisory_lock + pg_advisory_unlock; floor: own connection per task, lib: one shared session".into()
    }

    async fn cycle(&self, task: usize, name: &LockName) -> Result<(), BoxError> {
        let s = &self.sessions[task % self.sessions.len()];
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
