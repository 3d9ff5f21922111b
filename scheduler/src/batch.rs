//! [`Ticks`]: the tick store as the scheduler's jobs call it, with the calls
//! of many jobs coalesced into the store's batch methods.
//!
//! Every job's run is a future of its own, so when a thousand jobs fire at
//! the same instant a thousand futures each ask the store the same kinds of
//! question. Each kind of call has a lane ([`lock_core::lane`]): a call that
//! finds its lane idle is sent at once (a lone tick waits for nothing), and
//! calls that arrive while the lane's batch is in flight queue up and go
//! together, as one batch, as soon as it answers.

use std::sync::Arc;
use std::time::Duration;

use lock_core::lane::{self, Batch, Lane};
use lock_core::{
    BackendError, LockName, StartCheck, StartVerdict, TickAnswer, TickStore, TickWrite,
};

/// The tick store of one scheduler, coalescing concurrent calls.
#[derive(Debug)]
pub(crate) struct Ticks {
    lanes: Arc<Lanes>,
}

/// The store, and one lane per kind of call.
#[derive(Debug)]
struct Lanes {
    store: Arc<dyn TickStore>,
    clock: Lane<ServerTime>,
    latest: Lane<Latest>,
    marks: Lane<Marks>,
    starts: Lane<Starts>,
    checked: Lane<CheckedStarts>,
    completes: Lane<Completes>,
    /// Whether the store makes the start checks in the write's own step.
    checks_starts: bool,
}

impl Ticks {
    pub(crate) fn new(store: Arc<dyn TickStore>) -> Self {
        let checks_starts = store.checks_starts_in_one_step();
        Self {
            lanes: Arc::new(Lanes {
                store,
                checks_starts,
                checked: Lane::default(),
                clock: Lane::default(),
                latest: Lane::default(),
                marks: Lane::default(),
                starts: Lane::default(),
                completes: Lane::default(),
            }),
        }
    }

    /// [`TickStore::server_time`], shared: the answer is one reading taken
    /// after this call began (a call that arrives while a reading is in
    /// flight waits for the next one), so it is never older than the
    /// reading a call of its own would have taken. Cancel safe.
    ///
    /// Joining the reading in flight instead would not be unsafe either:
    /// the reading is only used to refuse ticks ahead of the server, and an
    /// older reading makes a tick look further ahead, so staleness could
    /// only refuse a tick a fresh reading would have let run, never the
    /// reverse. Waiting for a fresh one costs at most one round trip.
    pub(crate) async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        lane::call::<ServerTime>(&self.lanes, ()).await
    }

    /// [`TickStore::last_completed`], batched. Cancel safe.
    pub(crate) async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        lane::call::<Latest>(&self.lanes, job.clone()).await
    }

    /// [`TickStore::is_completed`], batched. Cancel safe.
    pub(crate) async fn is_completed(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<bool, BackendError> {
        lane::call::<Marks>(&self.lanes, (job.clone(), tick)).await
    }
}

impl Ticks {
    /// [`TickStore::write_tick`], batched: the `Started` writes of
    /// concurrent ticks go together, and so do their `Completed` writes, in
    /// a lane of their own. A `Started` write stands between a tick's lock
    /// and its handler; queued behind a batch of completions (which also
    /// raise the jobs' latest ticks and prune old records) it would add
    /// their round trips to every tick's lag. A batch keeps every record for
    /// the longest `keep` asked in it. Not cancel safe: a dropped call may
    /// or may not have applied the write (the batch goes on without its
    /// caller).
    pub(crate) async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        let start = matches!(write, TickWrite::Start { .. });
        let item = ((job.clone(), tick, write), keep);
        if start {
            lane::call::<Starts>(&self.lanes, item).await
        } else {
            lane::call::<Completes>(&self.lanes, item).await
        }
    }
}

impl Ticks {
    /// Whether the store makes a start's checks in its write's own step
    /// ([`TickStore::checks_starts_in_one_step`]): then
    /// [`Ticks::start_checked`] saves a round trip over reading apart.
    pub(crate) fn checks_starts(&self) -> bool {
        self.lanes.checks_starts
    }

    /// [`TickStore::start_checked_many`] for one `Started` write, batched
    /// with the concurrent ticks' (a batch keeps every record for the
    /// longest `keep` asked in it). Not cancel safe, like
    /// [`Ticks::write_tick`].
    pub(crate) async fn start_checked(
        &self,
        job: &LockName,
        tick: i64,
        write: TickWrite,
        check: StartCheck,
        keep: Duration,
    ) -> Result<StartVerdict, BackendError> {
        lane::call::<CheckedStarts>(&self.lanes, ((job.clone(), tick, write, check), keep)).await
    }
}

/// One checked `Started` write as its lane carries it, with its `keep`.
type CheckedItem = ((LockName, i64, TickWrite, StartCheck), Duration);

/// The checked `Started` writes' lane.
#[derive(Debug)]
struct CheckedStarts;

impl Batch for CheckedStarts {
    type Host = Lanes;
    type Item = CheckedItem;
    type Answer = StartVerdict;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.checked
    }

    async fn run(host: &Lanes, items: Vec<CheckedItem>) -> Vec<Result<StartVerdict, BackendError>> {
        let (starts, keep) = longest_keep(items);
        host.store.start_checked_many(&starts, keep).await
    }
}

/// One tick-record write as a lane carries it, with how long its record
/// must be kept.
type WriteItem = ((LockName, i64, TickWrite), Duration);

/// A batch's items without their `keep`, and the longest `keep` asked in
/// it: a batch keeps every record for that long.
fn longest_keep<T>(items: Vec<(T, Duration)>) -> (Vec<T>, Duration) {
    let keep = items
        .iter()
        .map(|(_, keep)| *keep)
        .max()
        .unwrap_or_default();
    (items.into_iter().map(|(item, _)| item).collect(), keep)
}

/// Sends one batch of writes, kept for the longest `keep` asked in it.
async fn write_batch(host: &Lanes, items: Vec<WriteItem>) -> Vec<Result<TickAnswer, BackendError>> {
    let (writes, keep) = longest_keep(items);
    host.store.write_ticks_many(&writes, keep).await
}

/// The `Started` writes' lane.
#[derive(Debug)]
struct Starts;

impl Batch for Starts {
    type Host = Lanes;
    type Item = WriteItem;
    type Answer = TickAnswer;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.starts
    }

    async fn run(host: &Lanes, items: Vec<WriteItem>) -> Vec<Result<TickAnswer, BackendError>> {
        write_batch(host, items).await
    }
}

/// The `Completed` writes' lane.
#[derive(Debug)]
struct Completes;

impl Batch for Completes {
    type Host = Lanes;
    type Item = WriteItem;
    type Answer = TickAnswer;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.completes
    }

    async fn run(host: &Lanes, items: Vec<WriteItem>) -> Vec<Result<TickAnswer, BackendError>> {
        write_batch(host, items).await
    }
}

#[derive(Debug)]
struct ServerTime;

impl Batch for ServerTime {
    type Host = Lanes;
    type Item = ();
    type Answer = Option<i64>;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.clock
    }

    async fn run(host: &Lanes, items: Vec<()>) -> Vec<Result<Option<i64>, BackendError>> {
        // One reading serves every caller: they all began before it was taken.
        let reading = host.store.server_time().await;
        lane::each(reading.map(|ms| vec![ms; items.len()]), items.len())
    }
}

#[derive(Debug)]
struct Latest;

impl Batch for Latest {
    type Host = Lanes;
    type Item = LockName;
    type Answer = Option<i64>;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.latest
    }

    async fn run(host: &Lanes, items: Vec<LockName>) -> Vec<Result<Option<i64>, BackendError>> {
        host.store.last_completed_many(&items).await
    }
}

#[derive(Debug)]
struct Marks;

impl Batch for Marks {
    type Host = Lanes;
    type Item = (LockName, i64);
    type Answer = bool;

    fn lane(host: &Lanes) -> &Lane<Self> {
        &host.marks
    }

    async fn run(host: &Lanes, items: Vec<(LockName, i64)>) -> Vec<Result<bool, BackendError>> {
        host.store.is_completed_many(&items).await
    }
}

#[cfg(test)]
mod tests;
