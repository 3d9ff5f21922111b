//! The batcher's lanes: coalescing, fresh clock readings, failures.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};

use lock_core::async_trait;
use tokio::sync::Semaphore;

use super::*;

/// A store whose every batch (and server reading) waits for a permit,
/// and which logs each batch's size.
#[derive(Debug)]
struct Gated {
    gate: Semaphore,
    batches: Mutex<Vec<usize>>,
    readings: AtomicI64,
    fail: bool,
}

impl Gated {
    fn new(fail: bool) -> Self {
        Self {
            gate: Semaphore::new(0),
            batches: Mutex::default(),
            readings: AtomicI64::default(),
            fail,
        }
    }

    async fn pass(&self, size: usize) -> Result<(), BackendError> {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(size);
        let permit = self
            .gate
            .acquire()
            .await
            .map_err(|_| BackendError::unavailable("closed"))?;
        permit.forget();
        if self.fail {
            return Err(BackendError::unavailable("the store is down"));
        }
        Ok(())
    }

    fn batches(&self) -> Vec<usize> {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[async_trait]
impl TickStore for Gated {
    async fn last_completed(&self, _job: &LockName) -> Result<Option<i64>, BackendError> {
        Err(BackendError::unavailable("single calls are not used"))
    }

    async fn record_completed(
        &self,
        _: &LockName,
        _: i64,
        _: Duration,
    ) -> Result<(), BackendError> {
        Err(BackendError::unavailable("single calls are not used"))
    }

    async fn is_completed(&self, _: &LockName, _: i64) -> Result<bool, BackendError> {
        Err(BackendError::unavailable("single calls are not used"))
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        self.pass(1).await?;
        Ok(Some(self.readings.fetch_add(1, Ordering::SeqCst) + 1))
    }

    /// A `Started` write answers at once; a `Completed` one waits at the
    /// gate like every batch.
    async fn write_tick(
        &self,
        _: &LockName,
        _: i64,
        write: &TickWrite,
        _: Duration,
    ) -> Result<TickAnswer, BackendError> {
        match write {
            TickWrite::Start { .. } => Ok(TickAnswer::Started),
            TickWrite::Complete { .. } => {
                self.pass(1).await?;
                Ok(TickAnswer::Completed)
            }
        }
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        match self.pass(jobs.len()).await {
            Ok(()) => jobs
                .iter()
                .map(|j| Ok(Some(j.as_str().len() as i64)))
                .collect(),
            Err(e) => jobs.iter().map(|_| Err(e.copied())).collect(),
        }
    }
}

/// Yields until `done` holds, at most 1,000 times.
async fn until(done: impl Fn() -> bool) {
    for _ in 0..1_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the condition did not hold after 1,000 yields");
}

fn name(s: &str) -> LockName {
    LockName::new(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[tokio::test]
async fn calls_during_a_batch_go_together_in_the_next() {
    let store = Arc::new(Gated::new(false));
    let ticks = Arc::new(Ticks::new(store.clone()));
    let t = Arc::clone(&ticks);
    let first = tokio::spawn(async move { t.last_completed(&name("a")).await });
    until(|| store.batches() == [1]).await;
    let mut rest = Vec::new();
    for job in ["bb", "ccc", "dddd"] {
        let t = Arc::clone(&ticks);
        rest.push(tokio::spawn(
            async move { t.last_completed(&name(job)).await },
        ));
    }
    until(|| ticks.lanes.latest.queued() == 3).await;
    store.gate.add_permits(2);
    let first = first
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    assert_eq!(first, Ok(Some(1)));
    for (task, want) in rest.into_iter().zip([2, 3, 4]) {
        let got = task
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        assert_eq!(got, Ok(Some(want)), "each caller gets its own answer");
    }
    assert_eq!(
        store.batches(),
        [1, 3],
        "a lone call at once, the rest as one batch"
    );
    assert!(
        ticks.lanes.latest.in_flight() == 0,
        "the lane is idle again"
    );
}

#[tokio::test]
async fn a_server_reading_is_never_older_than_its_call() {
    let store = Arc::new(Gated::new(false));
    let ticks = Arc::new(Ticks::new(store.clone()));
    let t = Arc::clone(&ticks);
    let first = tokio::spawn(async move { t.server_time().await });
    until(|| store.batches() == [1]).await;
    // These began while reading 1 was in flight: they share reading 2.
    let later: Vec<_> = (0..3)
        .map(|_| {
            let t = Arc::clone(&ticks);
            tokio::spawn(async move { t.server_time().await })
        })
        .collect();
    until(|| ticks.lanes.clock.queued() == 3).await;
    store.gate.add_permits(2);
    let first = first
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    assert_eq!(first, Ok(Some(1)));
    for task in later {
        let got = task
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        assert_eq!(got, Ok(Some(2)), "a reading taken after the call began");
    }
    assert_eq!(store.batches(), [1, 1], "one reading per batch");
}

#[tokio::test]
async fn a_failed_batch_fails_every_call_in_it() {
    let store = Arc::new(Gated::new(true));
    store.gate.add_permits(10);
    let ticks = Arc::new(Ticks::new(store.clone()));
    let calls: Vec<_> = ["a", "b", "c"]
        .into_iter()
        .map(|job| {
            let t = Arc::clone(&ticks);
            tokio::spawn(async move { t.last_completed(&name(job)).await })
        })
        .collect();
    for task in calls {
        match task.await {
            Ok(Err(e)) => assert!(e.to_string().contains("the store is down"), "{e}"),
            other => panic!("expected the store's error, got {other:?}"),
        }
    }
    // And a later call starts a new batch.
    let again = ticks.last_completed(&name("d")).await;
    assert!(again.is_err());
    assert!(ticks.lanes.latest.in_flight() == 0);
}

#[tokio::test(start_paused = true)]
async fn a_started_write_does_not_wait_behind_completions_in_flight() {
    let store = Arc::new(Gated::new(false));
    let ticks = Arc::new(Ticks::new(store.clone()));
    let t = Arc::clone(&ticks);
    let complete = tokio::spawn(async move {
        t.write_tick(
            &name("a"),
            1_000,
            TickWrite::Complete { token: 7 },
            Duration::from_secs(60),
        )
        .await
    });
    until(|| store.batches() == [1]).await;
    let start = TickWrite::Start {
        token: 8,
        replica: "r".to_owned(),
        at: 2_000,
        on_stale: lock_core::OnStale::Refuse,
    };
    // The completion is held at the gate for as long as this test runs;
    // a start queued behind it would never answer.
    let started = tokio::time::timeout(
        Duration::from_secs(10),
        ticks.write_tick(&name("b"), 2_000, start, Duration::from_secs(60)),
    )
    .await;
    assert!(
        matches!(started, Ok(Ok(TickAnswer::Started))),
        "a start goes out beside a completion in flight: {started:?}"
    );
    store.gate.add_permits(1);
    let completed = complete.await.map_err(|e| e.to_string());
    assert!(
        matches!(completed, Ok(Ok(TickAnswer::Completed))),
        "{completed:?}"
    );
}
