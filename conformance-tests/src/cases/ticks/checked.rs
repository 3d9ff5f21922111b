//! Checked starts (`TickStore::start_checked_many`): the checks a
//! scheduler makes before a tick's `Started` write answer as
//! `StartCheck::verdict` says for what the store holds, whether the store
//! makes them in the write's own statement (Postgres) or reads them first
//! (the default), and only the starts that pass are written.

use lock_core::{LockName, OnStale, StartCheck, StartVerdict, TickAnswer, TickRecord, TickWrite};

use super::{store, within, KEEP};
use crate::Ctx;

fn start(token: u64) -> TickWrite {
    TickWrite::Start {
        token,
        replica: format!("r{token}"),
        at: 1_700_000_000_000,
        on_stale: OnStale::Abandon,
    }
}

const CHECK: StartCheck = StartCheck {
    tolerance_ms: 1_000,
    late: false,
};

/// A job whose latest completed tick is `LAST` (and so marked), with ticks
/// at every edge of the checks: the mark, a later tick within and past the
/// tolerance and at its edge, the replica's own clock past it, a tick far ahead of the
/// server's clock, the extremes of i64, a job never recorded, a record that
/// refuses the write, a retry, and a stale record to abandon. One batch;
/// every answer is the verdict on the store's own reads, or the write's
/// answer, and no refused start leaves a record.
pub(in crate::cases) async fn tick_starts_checked_as_the_verdict_says(ctx: Ctx) {
    let Some(store) = store(&ctx).await else {
        return;
    };
    const LAST: i64 = 1_000_000_000;
    // A job of its own per far tick: a record written at a tick more than
    // `keep` past another may prune it (the store contract), and on a store
    // without a server clock the far ticks are written.
    let job = ctx.name("checked-start");
    let [ahead, end, fresh] = [
        "checked-start-ahead",
        "checked-start-end",
        "checked-start-fresh",
    ]
    .map(|n| ctx.name(n));
    within("record", store.record_completed(&job, LAST, KEEP))
        .await
        .expect("record the latest tick");
    // A record that refuses a lower token, and a stale one to abandon.
    for (tick, token) in [(LAST + 20, 7), (LAST + 30, 3)] {
        let answer = within(
            "write_tick",
            store.write_tick(&job, tick, &start(token), KEEP),
        )
        .await
        .expect("write_tick answers");
        assert_eq!(answer, TickAnswer::Started, "set-up start of {tick}");
    }
    let server = within("server_time", store.server_time())
        .await
        .expect("server_time answers");
    let far_ahead = server.unwrap_or(LAST).saturating_add(86_400_000);
    let late = StartCheck {
        late: true,
        ..CHECK
    };
    let starts: Vec<(LockName, i64, TickWrite, StartCheck)> = vec![
        (job.clone(), LAST, start(10), CHECK),
        (job.clone(), LAST - 500, start(11), CHECK),
        (job.clone(), LAST - 5_000, start(12), CHECK),
        (job.clone(), LAST - 200, start(13), late),
        (job.clone(), LAST + 10, start(14), CHECK),
        (job.clone(), i64::MIN + 1, start(15), CHECK),
        (job.clone(), LAST + 20, start(5), CHECK),
        (job.clone(), LAST + 30, start(16), CHECK),
        (ahead, far_ahead, start(17), CHECK),
        (end, i64::MAX, start(18), CHECK),
        (fresh, 5, start(19), CHECK),
        // The tolerance's edge: a later tick exactly the tolerance away
        // does not cover this one, a millisecond more does.
        (job.clone(), LAST - 1_000, start(20), CHECK),
        (job.clone(), LAST - 1_001, start(21), CHECK),
    ];
    let got: Vec<StartVerdict> = within(
        "start_checked_many",
        store.start_checked_many(&starts, KEEP),
    )
    .await
    .into_iter()
    .map(|r| r.expect("start_checked_many answers"))
    .collect();
    let written = |token: u64, answer| (token, StartVerdict::Written(answer));
    let mut want = vec![
        (10, StartVerdict::Marked),
        written(11, TickAnswer::Started),
        (12, StartVerdict::Covered { last: LAST }),
        (13, StartVerdict::Covered { last: LAST }),
        written(14, TickAnswer::Started),
        (15, StartVerdict::Covered { last: LAST }),
        written(
            5,
            TickAnswer::Refused(Some(TickRecord::Started {
                token: 7,
                replica: "r7".into(),
                at: 1_700_000_000_000,
            })),
        ),
        written(16, TickAnswer::Abandoned),
    ];
    match server {
        // The store reads the same clock the checks do: a day ahead is
        // ahead, and so is the end of time.
        Some(_) => {
            for (i, token) in [(8, 17), (9, 18)] {
                assert!(
                    matches!(got[i], StartVerdict::Ahead { server_ms } if server_ms >= server.unwrap_or(i64::MAX)),
                    "start {token} far ahead of the server: {:?}",
                    got[i]
                );
            }
            want.push((17, got[8].clone()));
            want.push((18, got[9].clone()));
        }
        None => {
            want.push(written(17, TickAnswer::Started));
            want.push(written(18, TickAnswer::Started));
        }
    }
    want.push(written(19, TickAnswer::Started));
    want.push(written(20, TickAnswer::Started));
    want.push((21, StartVerdict::Covered { last: LAST }));
    let want: Vec<StartVerdict> = want.into_iter().map(|(_, v)| v).collect();
    assert_eq!(got, want, "verdicts in order");

    // What the store holds after: the passing starts' records, and none for
    // a refused one.
    for ((job, tick, write, _), verdict) in starts.iter().zip(&got) {
        let record = within("tick_record", store.tick_record(job, *tick))
            .await
            .expect("tick_record answers");
        let TickWrite::Start { token, .. } = write else {
            unreachable!("every item is a start")
        };
        match verdict {
            StartVerdict::Written(TickAnswer::Started) => assert!(
                matches!(record, Some(TickRecord::Started { token: t, .. }) if t == *token),
                "start {token} at {tick} wrote its record: {record:?}"
            ),
            StartVerdict::Written(TickAnswer::Abandoned) => {
                assert_eq!(record, Some(TickRecord::Abandoned { token: *token }))
            }
            StartVerdict::Written(_) => assert!(
                !matches!(record, Some(TickRecord::Started { token: t, .. }) if t == *token),
                "refused start {token} left no record of its own: {record:?}"
            ),
            _ => assert_eq!(
                record, None,
                "start {token} at {tick} was refused by its checks"
            ),
        }
    }

    // A retry of a written start answers as the first did, and changes
    // nothing; a batch of one is answered like a batch of many.
    let again = vec![starts[1].clone()];
    let retry: Vec<StartVerdict> =
        within("start_checked_many", store.start_checked_many(&again, KEEP))
            .await
            .into_iter()
            .map(|r| r.expect("start_checked_many answers"))
            .collect();
    assert_eq!(
        retry,
        vec![StartVerdict::Written(TickAnswer::Started)],
        "a retry"
    );
}
