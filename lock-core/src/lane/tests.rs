//! The lane on its own: a host whose batches wait for a gate and log their
//! sizes, with kinds of different bounds.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Semaphore;

use super::*;

struct Gated {
    gate: Semaphore,
    batches: Mutex<Vec<usize>>,
    /// The task each batch ran in.
    tasks: Mutex<Vec<Option<tokio::task::Id>>>,
    /// The items the lane said were queued.
    queued: Mutex<Vec<u32>>,
    fail: AtomicBool,
    /// Answer one item too few.
    short: AtomicBool,
    one: Lane<One>,
    two: Lane<Two>,
    small: Lane<Small>,
    bounded: Lane<Bounded>,
}

impl Default for Gated {
    fn default() -> Self {
        Self {
            gate: Semaphore::new(0),
            batches: Mutex::default(),
            tasks: Mutex::default(),
            queued: Mutex::default(),
            fail: AtomicBool::default(),
            short: AtomicBool::default(),
            one: Lane::default(),
            two: Lane::default(),
            small: Lane::default(),
            bounded: Lane::default(),
        }
    }
}

impl Gated {
    fn batches(&self) -> Vec<usize> {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn tasks(&self) -> Vec<Option<tokio::task::Id>> {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Logs the batch, waits for a permit, then doubles each item.
    async fn pass(&self, items: Vec<u32>) -> Vec<Result<u32, BackendError>> {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(items.len());
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(tokio::task::try_id());
        let result = match self.gate.acquire().await {
            Ok(permit) => {
                permit.forget();
                if self.fail.load(Ordering::SeqCst) {
                    Err(BackendError::unavailable("the host is down"))
                } else {
                    Ok(items.iter().map(|n| n * 2).collect())
                }
            }
            Err(_) => Err(BackendError::unavailable("closed")),
        };
        let mut answers = each(result, items.len());
        if self.short.load(Ordering::SeqCst) {
            answers.pop();
        }
        answers
    }
}

/// One batch in flight.
struct One;
/// Two batches in flight.
struct Two;
/// One in flight, at most three calls a batch.
struct Small;

/// A kind on [`Gated`]: its lane field and its bounds.
macro_rules! kind {
    ($kind:ident, $field:ident, $in_flight:expr, $max_batch:expr) => {
        impl Batch for $kind {
            type Host = Gated;
            type Item = u32;
            type Answer = u32;
            const IN_FLIGHT: usize = $in_flight;
            const MAX_BATCH: usize = $max_batch;
            fn lane(host: &Gated) -> &Lane<Self> {
                &host.$field
            }
            fn queued(host: &Gated, item: &mut u32) {
                host.queued
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(*item);
            }
            async fn run(host: &Gated, items: Vec<u32>) -> Vec<Result<u32, BackendError>> {
                host.pass(items).await
            }
        }
    };
}

kind!(One, one, 1, 1024);
kind!(Two, two, 2, 1024);
kind!(Small, small, 1, 3);

/// One in flight; a queued call waits at most [`BOUND`].
struct Bounded;

const BOUND: std::time::Duration = std::time::Duration::from_secs(1);

impl Batch for Bounded {
    type Host = Gated;
    type Item = u32;
    type Answer = u32;
    fn lane(host: &Gated) -> &Lane<Self> {
        &host.bounded
    }
    fn queued_limit(_: &Gated) -> Option<std::time::Duration> {
        Some(BOUND)
    }
    async fn run(host: &Gated, items: Vec<u32>) -> Vec<Result<u32, BackendError>> {
        host.pass(items).await
    }
}

type Answered = tokio::task::JoinHandle<Result<u32, BackendError>>;

fn spawn<B: Batch<Host = Gated, Item = u32, Answer = u32>>(host: &Arc<Gated>, n: u32) -> Answered {
    let host = Arc::clone(host);
    tokio::spawn(async move { call::<B>(&host, n).await })
}

/// Yields until `done` holds, at most 1,000 times.
async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..1_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{what}: not so after 1,000 yields");
}

/// The call's answer; an error if it has none within 10 s (a lane that
/// lost a call).
async fn answer(task: Answered) -> Result<u32, String> {
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
}

#[tokio::test]
async fn a_lone_call_is_sent_at_once() {
    let host = Arc::new(Gated::default());
    host.gate.add_permits(1);
    assert_eq!(
        call::<One>(&host, 21).await.map_err(|e| e.to_string()),
        Ok(42)
    );
    assert_eq!(host.batches(), [1]);
    assert_eq!(host.one.in_flight(), 0, "the lane is idle again");
}

#[tokio::test]
async fn calls_during_a_batch_go_together_in_the_next() {
    let host = Arc::new(Gated::default());
    let first = spawn::<One>(&host, 1);
    until("the first batch is sent", || host.batches() == [1]).await;
    let rest: Vec<_> = (2..=4).map(|n| spawn::<One>(&host, n)).collect();
    until("three calls queue", || host.one.queued() == 3).await;
    assert_eq!(host.batches(), [1], "nothing joins the batch in flight");
    host.gate.add_permits(2);
    assert_eq!(answer(first).await, Ok(2));
    for (task, n) in rest.into_iter().zip(2..) {
        assert_eq!(
            answer(task).await,
            Ok(n * 2),
            "each call gets its own answer"
        );
    }
    assert_eq!(host.batches(), [1, 3]);
    assert_eq!((host.one.queued(), host.one.in_flight()), (0, 0));
}

#[tokio::test]
async fn up_to_in_flight_batches_go_at_once_and_the_rest_wait() {
    let host = Arc::new(Gated::default());
    let mut calls = vec![spawn::<Two>(&host, 1)];
    until("a batch is sent", || host.batches() == [1]).await;
    calls.push(spawn::<Two>(&host, 2));
    until("a second batch is sent beside it", || {
        host.batches() == [1, 1]
    })
    .await;
    let later: Vec<_> = (3..=6).map(|n| spawn::<Two>(&host, n)).collect();
    until("four calls queue", || host.two.queued() == 4).await;
    assert_eq!(
        host.two.in_flight(),
        2,
        "no third batch while two are in flight"
    );
    host.gate.add_permits(3);
    for (task, n) in calls.into_iter().chain(later).zip(1..) {
        assert_eq!(answer(task).await, Ok(n * 2));
    }
    assert_eq!(host.batches(), [1, 1, 4], "the queue goes as one batch");
}

#[tokio::test]
async fn a_long_queue_goes_in_batches_of_at_most_max_batch() {
    let host = Arc::new(Gated::default());
    let first = spawn::<Small>(&host, 0);
    until("the first batch is sent", || host.batches() == [1]).await;
    let rest: Vec<_> = (1..=7).map(|n| spawn::<Small>(&host, n)).collect();
    until("seven calls queue", || host.small.queued() == 7).await;
    host.gate.add_permits(4);
    assert_eq!(answer(first).await, Ok(0));
    for (task, n) in rest.into_iter().zip(1..) {
        assert_eq!(answer(task).await, Ok(n * 2));
    }
    assert_eq!(host.batches(), [1, 3, 3, 1]);
}

/// Sends one call, then two more while it is in flight (so the batches
/// are of 1 and 2), and returns the three answers.
async fn three_calls_in_two_batches(host: &Arc<Gated>) -> Vec<Result<u32, String>> {
    let first = spawn::<One>(host, 1);
    until("the first batch is sent", || host.batches() == [1]).await;
    let rest: Vec<_> = (2..=3).map(|n| spawn::<One>(host, n)).collect();
    until("two calls queue", || host.one.queued() == 2).await;
    host.gate.add_permits(2);
    let mut answers = Vec::new();
    for task in std::iter::once(first).chain(rest) {
        answers.push(answer(task).await);
    }
    answers
}

#[tokio::test]
async fn a_failed_batch_fails_every_call_in_it_and_the_next_call_starts_afresh() {
    let host = Arc::new(Gated::default());
    host.fail.store(true, Ordering::SeqCst);
    for got in three_calls_in_two_batches(&host).await {
        assert!(
            got.as_ref().is_err_and(|e| e.contains("the host is down")),
            "{got:?}"
        );
    }
    host.fail.store(false, Ordering::SeqCst);
    host.gate.add_permits(1);
    assert_eq!(
        call::<One>(&host, 5).await.map_err(|e| e.to_string()),
        Ok(10)
    );
}

#[tokio::test]
async fn a_batch_with_too_few_answers_fails_every_call_in_it() {
    let host = Arc::new(Gated::default());
    host.short.store(true, Ordering::SeqCst);
    for got in three_calls_in_two_batches(&host).await {
        assert!(
            got.as_ref()
                .is_err_and(|e| e.contains("answers to a batch of")),
            "no call takes another's answer: {got:?}"
        );
    }
}

#[tokio::test]
async fn a_call_sent_at_once_runs_in_its_callers_task_and_queued_ones_in_the_lanes() {
    let host = Arc::new(Gated::default());
    let first = spawn::<One>(&host, 1);
    let caller = first.id();
    until("the first batch is sent", || host.batches() == [1]).await;
    let rest: Vec<_> = (2..=3).map(|n| spawn::<One>(&host, n)).collect();
    let queued_callers: Vec<_> = rest.iter().map(|t| t.id()).collect();
    until("two calls queue", || host.one.queued() == 2).await;
    host.gate.add_permits(2);
    assert_eq!(answer(first).await, Ok(2));
    for (task, n) in rest.into_iter().zip(2..) {
        assert_eq!(answer(task).await, Ok(n * 2));
    }
    let tasks = host.tasks();
    assert_eq!(
        tasks.first(),
        Some(&Some(caller)),
        "no task for a lone call"
    );
    let queued = host.queued.lock().map(|q| q.clone()).unwrap_or_default();
    assert_eq!(queued, [2, 3], "the kind hears of queued calls only");
    let lane_task = tasks.get(1).copied().flatten();
    assert!(
        lane_task.is_some_and(|t| t != caller && !queued_callers.contains(&t)),
        "the queued batch runs in a task of its own: {tasks:?}"
    );
}

#[tokio::test]
async fn a_caller_that_gives_up_stops_nobody_else() {
    let host = Arc::new(Gated::default());
    let first = spawn::<One>(&host, 1);
    until("the first batch is sent", || host.batches() == [1]).await;
    let quitter = spawn::<One>(&host, 2);
    let stayer = spawn::<One>(&host, 3);
    until("two calls queue", || host.one.queued() == 2).await;
    // The first caller's own batch goes with it; the queue goes at once.
    first.abort();
    until("the queue is sent", || host.batches() == [1, 2]).await;
    quitter.abort();
    host.gate.add_permits(1);
    assert_eq!(answer(stayer).await, Ok(6));
    assert_eq!(
        host.batches(),
        [1, 2],
        "the batch of two went on without one of its callers"
    );
    until("the lane is idle", || host.one.in_flight() == 0).await;
}

#[tokio::test]
async fn a_lone_caller_that_gives_up_leaves_the_lane_idle() {
    let host = Arc::new(Gated::default());
    let lone = spawn::<Two>(&host, 1);
    until("its batch is sent", || host.batches() == [1]).await;
    assert_eq!(host.two.in_flight(), 1);
    lone.abort();
    until("the lane is idle", || host.two.in_flight() == 0).await;
    host.gate.add_permits(1);
    assert_eq!(
        call::<Two>(&host, 4).await.map_err(|e| e.to_string()),
        Ok(8)
    );
    assert_eq!(host.batches(), [1, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_queued_call_waits_at_most_its_kinds_bound_and_a_call_sent_at_once_its_batchs() {
    let host = Arc::new(Gated::default());
    let started = tokio::time::Instant::now();
    let first = spawn::<Bounded>(&host, 1);
    until("the first batch is sent", || host.batches() == [1]).await;
    let queued = spawn::<Bounded>(&host, 2);
    until("a call queues", || host.bounded.queued() == 1).await;
    let got = tokio::time::timeout(BOUND * 3, queued)
        .await
        .map_err(|_| "still waiting at three times the bound".to_string())
        .and_then(|task| task.map_err(|e| e.to_string()));
    assert!(
        got.as_ref().is_ok_and(|r| r
            .as_ref()
            .is_err_and(|e| e.kind() == BackendErrorKind::Timeout)),
        "{got:?}"
    );
    assert_eq!(started.elapsed(), BOUND, "given up at the bound");
    assert!(
        !first.is_finished(),
        "the call sent at once has no bound of the lane's"
    );
    host.gate.add_permits(2);
    assert_eq!(answer(first).await, Ok(2));
    until("the queued call is sent all the same", || {
        host.batches() == [1, 1]
    })
    .await;
}

#[test]
fn calls_queued_when_the_runtime_goes_get_an_error_and_the_lane_recovers() {
    let host = Arc::new(Gated::default());
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap_or_else(|e| panic!("a runtime: {e}"))
    };
    let first = runtime();
    first.block_on(async {
        let _in_flight = spawn::<One>(&host, 1);
        until("the first batch is sent", || host.batches() == [1]).await;
        let _queued = spawn::<One>(&host, 2);
        until("a call queues", || host.one.queued() == 1).await;
    });
    drop(first);
    assert_eq!(
        (host.one.queued(), host.one.in_flight()),
        (0, 0),
        "the dropped flusher left the lane and dropped what was queued"
    );
    let second = runtime();
    second.block_on(async {
        host.gate.add_permits(1);
        assert_eq!(
            call::<One>(&host, 4).await.map_err(|e| e.to_string()),
            Ok(8)
        );
    });
}
