//! The tick store's batch calls on a server where its tables do not exist
//! yet: reads answer "nothing recorded", the first batch of records creates
//! the tables and lands every record. And the records a job's newer ticks
//! leave behind are pruned, by a batch and by a lone write alike.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{OnStale, StartCheck, StartVerdict, TickAnswer, TickStore, TickWrite};

use super::saboteur::plain_session;
use super::specific::add;
use super::PostgresFactory;
use crate::{BoxError, Suite};

/// How long the records' marks last: past the case's end.
const KEEP: Duration = Duration::from_secs(60);

pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    let table = crate::trial_table![
        "tick_batch_creates_missing_tables" => tick_batch_creates_missing_tables,
        "tick_records_old_ones_pruned" => tick_records_old_ones_pruned,
    ];
    add(suite, f, &table);
}

/// A store on tables of a name of its own, and a session that drops them
/// after `case` has run on it.
async fn on_own_tables<F, Fut>(f: &PostgresFactory, case: F) -> Result<(), BoxError>
where
    F: FnOnce(Arc<dyn TickStore>, tokio_postgres::Client, String) -> Fut,
    Fut: std::future::Future<Output = Result<(), BoxError>>,
{
    let url = tokio::task::block_in_place(|| f.url())?;
    let table = format!("ct_ticks_{:08x}", getrandom::u32().unwrap_or(0));
    let store: Arc<dyn TickStore> = Arc::new(
        f.builder_for(&url)?
            .with_tick_table(table.clone())
            .connect()
            .await?,
    );
    let inspector = plain_session(&url, "lock-ct-inspector").await?;
    let outcome = case(store, inspector, table.clone()).await;
    let cleaner = plain_session(&url, "lock-ct-inspector").await?;
    cleaner
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; DROP TABLE IF EXISTS {table}_marks; \
             DROP TABLE IF EXISTS {table}_runs"
        ))
        .await?;
    outcome
}

async fn tick_batch_creates_missing_tables(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    on_own_tables(&f, |store, _, _| async move { check(store.as_ref()).await }).await
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

/// How long the pruning case keeps records: ticks this far apart and more
/// leave the older one to be pruned.
const PRUNE_KEEP: Duration = Duration::from_secs(1);

/// Two ticks of two jobs `PRUNE_KEEP` and more apart, started and completed
/// in batches, then a third tick of each job started alone (by a write,
/// and by a checked start): only the newest ticks' records and marks remain.
async fn tick_records_old_ones_pruned(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    on_own_tables(&f, |store, inspector, table| async move {
        let (a, b) = (name_of("prune-a"), name_of("prune-b"));
        let keep_ms = i64::try_from(PRUNE_KEEP.as_millis())?;
        let (t1, t2) = (10_000, 10_000 + 2 * keep_ms);
        for tick in [t1, t2] {
            let starts = [(a.clone(), tick, start(1)), (b.clone(), tick, start(1))];
            expect(
                store.write_ticks_many(&starts, PRUNE_KEEP).await,
                TickAnswer::Started,
            )?;
            let completes = [
                (a.clone(), tick, TickWrite::Complete { token: 1 }),
                (b.clone(), tick, TickWrite::Complete { token: 1 }),
            ];
            expect(
                store.write_ticks_many(&completes, PRUNE_KEEP).await,
                TickAnswer::Completed,
            )?;
        }
        let rows = rows_of(&inspector, &table).await?;
        let want = vec![
            (a.as_str().to_owned(), t2, "C"),
            (b.as_str().to_owned(), t2, "C"),
        ];
        if rows.runs != want
            || rows.marks != [(a.as_str().to_owned(), t2), (b.as_str().to_owned(), t2)]
        {
            return Err(
                format!("after batches {t1} and {t2} ms apart, the tables hold {rows:?}").into(),
            );
        }
        let t3 = t2 + 2 * keep_ms;
        let lone = store.write_tick(&a, t3, &start(2), PRUNE_KEEP).await?;
        if lone != TickAnswer::Started {
            return Err(format!("a lone start answered {lone:?}").into());
        }
        let runs = rows_of(&inspector, &table).await?.runs;
        if runs
            != [
                (a.as_str().to_owned(), t3, "S"),
                (b.as_str().to_owned(), t2, "C"),
            ]
        {
            return Err(format!("after a lone start at {t3}, the records are {runs:?}").into());
        }
        // A lone checked start (the scheduler's call on Postgres) prunes
        // alike.
        let check = StartCheck {
            tolerance_ms: 0,
            late: false,
        };
        let checked = store
            .start_checked_many(&[(b.clone(), t3, start(2), check)], PRUNE_KEEP)
            .await;
        if !matches!(
            checked.as_slice(),
            [Ok(StartVerdict::Written(TickAnswer::Started))]
        ) {
            return Err(format!("a lone checked start answered {checked:?}").into());
        }
        let runs = rows_of(&inspector, &table).await?.runs;
        if runs
            != [
                (a.as_str().to_owned(), t3, "S"),
                (b.as_str().to_owned(), t3, "S"),
            ]
        {
            return Err(
                format!("after a lone checked start at {t3}, the records are {runs:?}").into(),
            );
        }
        Ok(())
    })
    .await
}

fn start(token: u64) -> TickWrite {
    TickWrite::Start {
        token,
        replica: "pruner".to_owned(),
        at: 0,
        on_stale: OnStale::Refuse,
    }
}

/// Every answer of a batch is `want`.
fn expect(
    answers: Vec<Result<TickAnswer, lock_core::BackendError>>,
    want: TickAnswer,
) -> Result<(), BoxError> {
    match answers.iter().all(|a| a.as_ref().ok() == Some(&want)) {
        true => Ok(()),
        false => Err(format!("a batch answered {answers:?}, not all {want:?}").into()),
    }
}

/// The rows of a case's record and mark tables, in job and tick order.
#[derive(Debug)]
struct Rows {
    runs: Vec<(String, i64, &'static str)>,
    marks: Vec<(String, i64)>,
}

async fn rows_of(inspector: &tokio_postgres::Client, table: &str) -> Result<Rows, BoxError> {
    let runs = inspector
        .query(
            &format!("SELECT job, tick, state FROM {table}_runs ORDER BY job, tick"),
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            let state: String = r.try_get(2)?;
            let state = match state.as_str() {
                "S" => "S",
                "C" => "C",
                _ => "other",
            };
            Ok((r.try_get(0)?, r.try_get(1)?, state))
        })
        .collect::<Result<_, tokio_postgres::Error>>()?;
    let marks = inspector
        .query(
            &format!("SELECT job, tick FROM {table}_marks ORDER BY job, tick"),
            &[],
        )
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<Result<_, tokio_postgres::Error>>()?;
    Ok(Rows { runs, marks })
}
