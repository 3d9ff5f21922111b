//! The tick store's batch calls on a server where its tables do not exist
//! yet: reads answer "nothing recorded", the first batch of records creates
//! the tables and lands every record.

use std::sync::Arc;
use std::time::Duration;

use lock_core::TickStore;

use super::saboteur::plain_session;
use super::specific::add;
use super::PostgresFactory;
use crate::{BoxError, Suite};

/// How long the records' marks last: past the case's end.
const KEEP: Duration = Duration::from_secs(60);

pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    add(suite, f, "tick_batch_creates_missing_tables", |f| {
        Box::pin(tick_batch_creates_missing_tables(f))
    });
}

async fn tick_batch_creates_missing_tables(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let table = format!("ct_ticks_{:08x}", getrandom::u32().unwrap_or(0));
    let store = f
        .builder_for(&url)?
        .with_tick_table(table.clone())
        .connect()
        .await?;
    let outcome = check(&store).await;
    let inspector = plain_session(&url, "lock-ct-inspector").await?;
    inspector
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {table}_marks"
        ))
        .await?;
    outcome
}

async fn check(store: &dyn TickStore) -> Result<(), BoxError> {
    let (a, b) = (name_of("a"), name_of("b"));
    let latest = store.last_completed_many(&[a.clone(), b.clone()]).await;
    if !matches!(latest.as_slice(), [Ok(None), Ok(None)]) {
        return Err(format!("without tables, latest ticks read {latest:?}").into());
    }
    let marks = store.is_completed_many(&[(a.clone(), 1_000)]).await;
    if !matches!(marks.as_slice(), [Ok(false)]) {
        return Err(format!("without tables, a mark read {marks:?}").into());
    }
    let recorded = store
        .record_completed_many(
            &[(a.clone(), 1_000), (b.clone(), 2_000), (a.clone(), 3_000)],
            KEEP,
        )
        .await;
    if let Some(e) = recorded.iter().find_map(|r| r.as_ref().err()) {
        return Err(format!("the first records did not create the tables: {e}").into());
    }
    let latest = store.last_completed_many(&[a.clone(), b.clone()]).await;
    if !matches!(latest.as_slice(), [Ok(Some(3_000)), Ok(Some(2_000))]) {
        return Err(format!("after the first records, latest ticks read {latest:?}").into());
    }
    let marks = store
        .is_completed_many(&[(a.clone(), 1_000), (a, 3_000), (b.clone(), 2_000), (b, 1)])
        .await;
    let got: Vec<bool> = marks.into_iter().collect::<Result<_, _>>()?;
    if got != [true, true, true, false] {
        return Err(format!("after the first records, marks read {got:?}").into());
    }
    Ok(())
}

fn name_of(job: &str) -> lock_core::LockName {
    lock_core::LockName::new(format!("tick-tables/{job}")).expect("a valid name")
}
