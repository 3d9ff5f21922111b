//! The tick store's batch calls: each item answered as its single call
//! answers it, in order, whether the backend overrides them or not.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockName, TickStore};

use crate::Ctx;

mod checked;
mod records;
pub(super) use checked::tick_starts_checked_as_the_verdict_says;
pub(super) use records::{
    tick_records_abandon, tick_records_one_start_wins, tick_records_take_over_and_fence_out,
    tick_records_transitions_follow_the_token,
};

const KEEP: Duration = Duration::from_secs(60);
/// Every store call of these cases answers within this, or the case fails.
const CALL_WITHIN: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(CALL_WITHIN, call)
        .await
        .unwrap_or_else(|_| panic!("{what} did not answer within {CALL_WITHIN:?}"))
}

/// The row's tick store, or `None` where the backend keeps none.
async fn store(ctx: &Ctx) -> Option<Arc<dyn TickStore>> {
    within("tick_store", ctx.factory().tick_store())
        .await
        .expect("tick store connects")
}

/// Batches of reads over jobs with and without marks (and a job never
/// recorded) answer item by item what the single calls answer, in order;
/// an empty batch answers nothing.
pub(super) async fn tick_store_batch_reads_match_single_calls(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (a, b, never) = (
        ctx.name("batch-read-a"),
        ctx.name("batch-read-b"),
        ctx.name("batch-read-never"),
    );
    within("record", store.record_completed(&a, 10_000, KEEP))
        .await
        .expect("record a");
    within("record", store.record_completed(&a, 9_000, KEEP))
        .await
        .expect("record a again");
    within("record", store.record_completed(&b, 20_000, KEEP))
        .await
        .expect("record b");

    let jobs = vec![a.clone(), never.clone(), b.clone(), a.clone()];
    let latest: Vec<Option<i64>> = within("last_completed_many", store.last_completed_many(&jobs))
        .await
        .into_iter()
        .map(|r| r.expect("last_completed_many answers"))
        .collect();
    assert_eq!(latest, vec![Some(10_000), None, Some(20_000), Some(10_000)]);
    for (job, want) in jobs.iter().zip(&latest) {
        let single = within("last_completed", store.last_completed(job))
            .await
            .expect("last_completed answers");
        assert_eq!(
            single, *want,
            "the batch and the single call agree on {job}"
        );
    }

    let ticks: Vec<(LockName, i64)> = vec![
        (a.clone(), 9_000),
        (a.clone(), 9_500),
        (never.clone(), 9_000),
        (b.clone(), 20_000),
        (b.clone(), 10_000),
        (a.clone(), 10_000),
    ];
    let marked: Vec<bool> = within("is_completed_many", store.is_completed_many(&ticks))
        .await
        .into_iter()
        .map(|r| r.expect("is_completed_many answers"))
        .collect();
    assert_eq!(marked, vec![true, false, false, true, false, true]);
    for ((job, tick), want) in ticks.iter().zip(&marked) {
        let single = within("is_completed", store.is_completed(job, *tick))
            .await
            .expect("is_completed answers");
        assert_eq!(
            single, *want,
            "the batch and the single call agree on {job} at {tick}"
        );
    }

    assert!(within("empty", store.last_completed_many(&[]))
        .await
        .is_empty());
    assert!(within("empty", store.is_completed_many(&[]))
        .await
        .is_empty());
    assert!(within("empty", store.record_completed_many(&[], KEEP))
        .await
        .is_empty());
}

/// A batch of records over several jobs, one of them with several ticks
/// and one older than its stored latest, marks every tick and only ever
/// raises each job's latest completed tick, as the single calls would.
pub(super) async fn tick_store_batch_records_match_single_calls(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (a, b, c) = (
        ctx.name("batch-rec-a"),
        ctx.name("batch-rec-b"),
        ctx.name("batch-rec-c"),
    );
    within("record", store.record_completed(&b, 50_000, KEEP))
        .await
        .expect("record b");
    let ticks: Vec<(LockName, i64)> = vec![
        (a.clone(), 2_000),
        (b.clone(), 40_000),
        (a.clone(), 3_000),
        (c.clone(), -5),
        (a.clone(), 1_000),
    ];
    let done = within(
        "record_completed_many",
        store.record_completed_many(&ticks, KEEP),
    )
    .await;
    assert_eq!(done.len(), ticks.len(), "one result per item");
    for r in done {
        r.expect("record_completed_many records");
    }
    for (job, want) in [(&a, Some(3_000)), (&b, Some(50_000)), (&c, Some(-5))] {
        let latest = within("last_completed", store.last_completed(job))
            .await
            .expect("last_completed answers");
        assert_eq!(latest, want, "the latest of {job} only rises");
    }
    for (job, tick) in &ticks {
        assert!(
            within("is_completed", store.is_completed(job, *tick))
                .await
                .expect("is_completed answers"),
            "{job} at {tick} is marked"
        );
    }
    assert!(
        !within("is_completed", store.is_completed(&a, 2_500))
            .await
            .expect("is_completed answers"),
        "an unrecorded tick between recorded ones is not marked"
    );
    // Recording the same batch again changes nothing.
    for r in within(
        "record_completed_many",
        store.record_completed_many(&ticks, KEEP),
    )
    .await
    {
        r.expect("a repeated batch records");
    }
    let latest = within("last_completed_many", store.last_completed_many(&[a, b, c])).await;
    let latest: Vec<Option<i64>> = latest.into_iter().map(|r| r.expect("answers")).collect();
    assert_eq!(latest, vec![Some(3_000), Some(50_000), Some(-5)]);
}

/// Batches larger than a backend's single request (etcd: 128 operations a
/// transaction) and holding a job twice answer every item, in order, as the
/// single calls would.
pub(super) async fn tick_store_batches_past_one_request(ctx: Ctx) {
    const JOBS: usize = 200;
    const TWICE: usize = 100;
    let Some(store) = store(&ctx).await else {
        return;
    };
    let jobs: Vec<LockName> = (0..JOBS)
        .map(|i| ctx.name(&format!("batch-big-{i}")))
        .collect();
    let tick_of = |i: usize| 1_000 * i as i64;
    // Every job once, then the first TWICE jobs again with a later tick.
    let ticks: Vec<(LockName, i64)> = jobs
        .iter()
        .enumerate()
        .map(|(i, job)| (job.clone(), tick_of(i)))
        .chain(
            jobs.iter()
                .take(TWICE)
                .enumerate()
                .map(|(i, job)| (job.clone(), tick_of(i) + 500)),
        )
        .collect();
    let done = within(
        "record_completed_many",
        store.record_completed_many(&ticks, KEEP),
    )
    .await;
    assert_eq!(done.len(), ticks.len(), "one result per item");
    for (r, (job, tick)) in done.into_iter().zip(&ticks) {
        r.unwrap_or_else(|e| panic!("{job} at {tick} was not recorded: {e}"));
    }

    let latest = within("last_completed_many", store.last_completed_many(&jobs)).await;
    assert_eq!(latest.len(), JOBS, "one answer per job");
    for (i, r) in latest.into_iter().enumerate() {
        let want = if i < TWICE {
            tick_of(i) + 500
        } else {
            tick_of(i)
        };
        assert_eq!(
            r.expect("last_completed_many answers"),
            Some(want),
            "the latest of job {i}"
        );
    }

    // Every recorded tick, and as many that were not, interleaved.
    let asked: Vec<(LockName, i64)> = ticks
        .iter()
        .flat_map(|(job, tick)| [(job.clone(), *tick), (job.clone(), tick + 1)])
        .collect();
    let marked = within("is_completed_many", store.is_completed_many(&asked)).await;
    assert_eq!(marked.len(), asked.len(), "one answer per tick");
    for (k, (r, (job, tick))) in marked.into_iter().zip(&asked).enumerate() {
        assert_eq!(
            r.expect("is_completed_many answers"),
            k % 2 == 0,
            "{job} at {tick}: only recorded ticks are marked"
        );
    }
}
