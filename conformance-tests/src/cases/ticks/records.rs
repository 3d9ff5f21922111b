//! The tick records of the fenced start protocol: every transition one step
//! conditional on the token, as lock-core's `TickWrite::apply` says, on
//! every backend's tick store.

use std::sync::Arc;

use lock_core::{LockName, OnStale, TickAnswer, TickRecord, TickStore, TickWrite};

use super::{store, within, KEEP};
use crate::Ctx;

fn start(token: u64, replica: &str, on_stale: OnStale) -> TickWrite {
    TickWrite::Start {
        token,
        replica: replica.into(),
        at: 1_700_000_000_000,
        on_stale,
    }
}

fn started(token: u64, replica: &str) -> TickRecord {
    TickRecord::Started {
        token,
        replica: replica.into(),
        at: 1_700_000_000_000,
    }
}

/// `write_ticks_many`, every item answered.
async fn write_many(
    store: &Arc<dyn TickStore>,
    writes: &[(LockName, i64, TickWrite)],
) -> Vec<TickAnswer> {
    within("write_ticks_many", store.write_ticks_many(writes, KEEP))
        .await
        .into_iter()
        .map(|r| r.expect("write_ticks_many answers"))
        .collect()
}

/// `write_tick` of one write to one tick, answered.
async fn write_one(
    store: &Arc<dyn TickStore>,
    job: &LockName,
    tick: i64,
    w: TickWrite,
) -> TickAnswer {
    within("write_tick", store.write_tick(job, tick, &w, KEEP))
        .await
        .expect("write_tick answers")
}

/// `tick_record` of one tick, answered.
async fn record(store: &Arc<dyn TickStore>, job: &LockName, tick: i64) -> Option<TickRecord> {
    within("tick_record", store.tick_record(job, tick))
        .await
        .expect("tick_record answers")
}

/// `is_completed` of one tick, answered.
async fn is_completed(store: &Arc<dyn TickStore>, job: &LockName, tick: i64) -> bool {
    within("is_completed", store.is_completed(job, tick))
        .await
        .expect("is_completed answers")
}

/// Start onto nothing wins; a lower token, another replica's write with the
/// same token, and a start onto a completed record are refused; the same
/// write sent again is a no-op that answers as the first did; Complete with
/// a lower token is fenced out, with its own token completes, marks the tick
/// and raises the latest completed tick, and answers the same when retried.
pub(in crate::cases) async fn tick_records_transitions_follow_the_token(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (job, tick) = (ctx.name("records-transitions"), 5_000_000);
    let write = |w: TickWrite| write_one(&store, &job, tick, w);
    let read = || record(&store, &job, tick);
    assert_eq!(read().await, None, "no record before the first write");
    assert_eq!(
        write(start(5, "a", OnStale::Abandon)).await,
        TickAnswer::Started
    );
    assert_eq!(read().await, Some(started(5, "a")));
    assert_eq!(
        write(start(5, "a", OnStale::Abandon)).await,
        TickAnswer::Started,
        "the same write again answers as the first did"
    );
    assert_eq!(
        write(start(4, "b", OnStale::TakeOver)).await,
        TickAnswer::Refused(Some(started(5, "a"))),
        "a lower token is refused"
    );
    assert_eq!(
        write(start(5, "b", OnStale::TakeOver)).await,
        TickAnswer::Refused(Some(started(5, "a"))),
        "the same token from another replica is no retry"
    );
    assert_eq!(
        write(TickWrite::Complete { token: 4 }).await,
        TickAnswer::Refused(Some(started(5, "a"))),
        "a Completed with a lower token is fenced out"
    );
    assert!(
        !is_completed(&store, &job, tick).await,
        "a refused Completed marks nothing"
    );
    assert_eq!(
        write(TickWrite::Complete { token: 5 }).await,
        TickAnswer::Completed
    );
    assert_eq!(
        write(TickWrite::Complete { token: 5 }).await,
        TickAnswer::Completed,
        "a retried Completed answers as the first did"
    );
    assert_eq!(read().await, Some(TickRecord::Completed { token: 5 }));
    assert!(is_completed(&store, &job, tick).await);
    assert_eq!(
        within("last_completed", store.last_completed(&job))
            .await
            .expect("last_completed answers"),
        Some(tick),
        "Completed records the tick as the latest completed"
    );
    assert_eq!(
        write(start(9, "c", OnStale::TakeOver)).await,
        TickAnswer::Refused(Some(TickRecord::Completed { token: 5 })),
        "a completed tick is never started again"
    );
}

/// At least once: a Started record of a lower token is taken over by a
/// higher one; the first runner's late Completed is refused (fenced out);
/// exactly one Completed survives, the highest token's.
pub(in crate::cases) async fn tick_records_take_over_and_fence_out(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (job, tick) = (ctx.name("records-takeover"), 6_000_000);
    let write = |w: TickWrite| write_one(&store, &job, tick, w);
    assert_eq!(
        write(start(1, "a", OnStale::TakeOver)).await,
        TickAnswer::Started
    );
    assert_eq!(
        write(start(2, "b", OnStale::Refuse)).await,
        TickAnswer::Refused(Some(started(1, "a"))),
        "Refuse leaves a stale record"
    );
    assert_eq!(
        write(start(2, "b", OnStale::TakeOver)).await,
        TickAnswer::Started
    );
    assert_eq!(
        write(start(2, "b", OnStale::TakeOver)).await,
        TickAnswer::Started,
        "a retried takeover answers as the first did"
    );
    assert_eq!(
        write(TickWrite::Complete { token: 1 }).await,
        TickAnswer::Refused(Some(started(2, "b"))),
        "the first runner's late Completed is fenced out"
    );
    assert_eq!(
        write(TickWrite::Complete { token: 2 }).await,
        TickAnswer::Completed
    );
    assert_eq!(
        write(TickWrite::Complete { token: 1 }).await,
        TickAnswer::Refused(Some(TickRecord::Completed { token: 2 })),
        "and stays fenced out after the takeover completed"
    );
    assert_eq!(
        record(&store, &job, tick).await,
        Some(TickRecord::Completed { token: 2 })
    );
}

/// At most once: a Started record of a lower token is marked Abandoned, the
/// mark answers the same when retried, the first runner's Completed is
/// refused, and nothing starts the tick again.
pub(in crate::cases) async fn tick_records_abandon(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (job, tick) = (ctx.name("records-abandon"), 7_000_000);
    let write = |w: TickWrite| write_one(&store, &job, tick, w);
    assert_eq!(
        write(start(1, "a", OnStale::Abandon)).await,
        TickAnswer::Started
    );
    assert_eq!(
        write(start(2, "b", OnStale::Abandon)).await,
        TickAnswer::Abandoned
    );
    assert_eq!(
        write(start(2, "b", OnStale::Abandon)).await,
        TickAnswer::Abandoned,
        "a retried abandon answers as the first did"
    );
    let abandoned = Some(TickRecord::Abandoned { token: 2 });
    assert_eq!(
        write(TickWrite::Complete { token: 1 }).await,
        TickAnswer::Refused(abandoned.clone()),
        "the abandoned runner's late Completed is fenced out"
    );
    assert_eq!(
        write(start(3, "c", OnStale::TakeOver)).await,
        TickAnswer::Refused(abandoned.clone()),
        "an abandoned tick is never started again"
    );
    assert!(!is_completed(&store, &job, tick).await);
    assert_eq!(record(&store, &job, tick).await, abandoned);
}

/// Concurrent starts of one tick (each with its own token, as holders of
/// successive locks would have) and concurrent takeovers: exactly one wins
/// each round, and a batch answers each write as the single call would.
pub(in crate::cases) async fn tick_records_one_start_wins(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    let (job, tick) = (ctx.name("records-race"), 8_000_000);
    let racers: Vec<_> = (1..=8u64)
        .map(|token| {
            let (store, job) = (Arc::clone(&store), job.clone());
            tokio::spawn(async move {
                let w = start(token, &format!("r{token}"), OnStale::Refuse);
                write_one(&store, &job, tick, w).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.expect("a racer finishes"));
    }
    let won = answers
        .iter()
        .filter(|a| **a == TickAnswer::Started)
        .count();
    assert_eq!(won, 1, "exactly one start wins: {answers:?}");

    let other = ctx.name("records-batch");
    // A batch is not a transaction: its items touch distinct ticks.
    write_one(&store, &other, 2, start(3, "a", OnStale::Abandon)).await;
    let writes = vec![
        (other.clone(), 1, start(3, "a", OnStale::Abandon)),
        (other.clone(), 2, TickWrite::Complete { token: 2 }),
        (other.clone(), 3, TickWrite::Complete { token: 3 }),
        (job.clone(), 9, start(1, "a", OnStale::Abandon)),
    ];
    let got = write_many(&store, &writes).await;
    assert_eq!(
        got,
        vec![
            TickAnswer::Started,
            TickAnswer::Refused(Some(started(3, "a"))),
            TickAnswer::Refused(None),
            TickAnswer::Started,
        ]
    );
    batch_of_distinct_jobs(&ctx, &store).await;
}

/// A batch whose items are all different jobs (the scheduler's usual one:
/// many jobs firing at once), which stores may send as one statement or
/// transaction: every transition answers as its single write would, and
/// leaves the record, the mark and the latest tick it would.
async fn batch_of_distinct_jobs(ctx: &Ctx, store: &Arc<dyn TickStore>) {
    let tick = 1_000;
    let jobs: Vec<_> = (0..6)
        .map(|i| ctx.name(&format!("records-many-{i}")))
        .collect();
    let before = [
        None,
        Some(start(2, "a", OnStale::Refuse)),
        Some(start(2, "a", OnStale::Refuse)),
        Some(start(2, "a", OnStale::Refuse)),
        Some(start(3, "a", OnStale::Refuse)),
        Some(start(3, "a", OnStale::Refuse)),
    ];
    for (job, w) in jobs.iter().zip(&before) {
        if let Some(w) = w {
            write_one(store, job, tick, w.clone()).await;
        }
    }
    let batch = [
        start(5, "b", OnStale::Refuse),
        TickWrite::Complete { token: 2 },
        start(4, "b", OnStale::TakeOver),
        start(4, "b", OnStale::Abandon),
        TickWrite::Complete { token: 2 },
        start(2, "b", OnStale::Refuse),
    ];
    let writes: Vec<_> = jobs
        .iter()
        .zip(batch)
        .map(|(job, w)| (job.clone(), tick, w))
        .collect();
    let got = write_many(store, &writes).await;
    assert_eq!(
        got,
        vec![
            TickAnswer::Started,
            TickAnswer::Completed,
            TickAnswer::Started,
            TickAnswer::Abandoned,
            TickAnswer::Refused(Some(started(3, "a"))),
            TickAnswer::Refused(Some(started(3, "a"))),
        ]
    );
    let mut records = Vec::new();
    for job in &jobs {
        records.push(record(store, job, tick).await);
    }
    assert_eq!(
        records,
        vec![
            Some(started(5, "b")),
            Some(TickRecord::Completed { token: 2 }),
            Some(started(4, "b")),
            Some(TickRecord::Abandoned { token: 4 }),
            Some(started(3, "a")),
            Some(started(3, "a")),
        ]
    );
    let jobs_ref = &jobs;
    let completed = is_completed(store, &jobs_ref[1], tick).await;
    assert!(completed, "the batch's completion marks its tick");
    let latest = within("last_completed", store.last_completed(&jobs_ref[1]))
        .await
        .expect("last_completed answers");
    assert_eq!(latest, Some(tick), "and raises its job's latest tick");
}
