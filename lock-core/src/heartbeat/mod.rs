//! The heartbeat: one task per `Locker` that renews every lease it holds,
//! enforces validity deadlines and runs the `max_hold` watchdog.
//!
//! One task rather than one per lease so that a backend with batch renewal
//! renews thousands of leases in a handful of round trips: leases due within
//! an eighth of an interval of each other are renewed together, after which their
//! schedules stay aligned. When each lease next needs attention is kept in a
//! deadline heap ([`schedule`]), so a wake-up looks only at the leases due;
//! while a batch's renewal is in flight, the heap holds one entry for the
//! whole batch (its earliest deadline), not one per lease.

mod schedule;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};
use tracing::{debug, warn};

use crate::background::Background;
use crate::lease::LeaseState;
use crate::metrics::RenewalOutcome;
use crate::{BackendErrorKind, LeaseStatus, LockBackend, LossReason, RenewRequest};
use schedule::{Key, Schedule};

/// Most leases renewed in one `renew_many` call.
const MAX_BATCH: usize = 1000;

enum Command {
    /// Renew and watch a lease.
    Track(Arc<LeaseState>),
    Forget {
        id: u64,
        release: Option<Arc<LeaseState>>,
    },
}

/// Sends leases to the heartbeat task. Cloned into every guard.
///
/// Commands queue in a shared list; the task is woken only when one cannot
/// wait for its next scheduled wake (a lease due earlier, a release to run,
/// a long queue). An uncontended acquire + release then costs no task switch.
#[derive(Clone, Debug)]
pub(crate) struct HeartbeatHandle {
    /// One reference count per clone (every acquire takes one).
    inner: Arc<HandleInner>,
}

/// Dropped with the last handle, and with it the sender: the task then ends.
#[derive(Debug)]
struct HandleInner {
    tx: mpsc::UnboundedSender<()>,
    shared: Arc<Shared>,
}

/// Queued commands, drained by the task before every sweep.
const MAX_QUEUED: usize = 1024;

/// How far back from the end of the queue a release looks for its lease's
/// own `Track` command. A short hold finds it among the last few (one per
/// hold taken since); a longer search would make releasing many leases in
/// the order they were taken quadratic.
const WITHDRAW_SEARCH: usize = 64;

struct Shared {
    pending: Mutex<Queue>,
    /// The shortest time from a grant to its first attention of any lease
    /// tracked so far, in nanoseconds (`u64::MAX`: none yet): how long the
    /// task sleeps when it holds nothing ([`Heartbeat::idle_wake`]). Kept
    /// here, not learnt by the task from the queue, because most short holds
    /// leave the queue before the task ever sees them.
    idle_span: AtomicU64,
}

/// The commands not yet drained, and when the task next wakes by itself.
/// Both under one lock, so a lease tracked at any moment either is drained
/// before the task sleeps or sees the wake-up the task will sleep until.
#[derive(Default)]
struct Queue {
    commands: Vec<Command>,
    /// `None` while the task is awake (it drains the queue before sleeping).
    wake_at: Option<Instant>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = self.pending();
        f.debug_struct("Shared")
            .field("queued", &queue.commands.len())
            .field("wake_at", &queue.wake_at)
            .finish()
    }
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Queue> {
        // One push or take per critical section: poison carries no half-state.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records when the task next wakes by itself (`None`: it is awake).
    fn set_wake(&self, at: Option<Instant>) {
        self.pending().wake_at = at;
    }

    /// Takes lease `id`'s `Track` command back out of the queue, if the task
    /// has not drained it yet; returns whether it did. A lease withdrawn so
    /// is never entered into the task's table, so it needs no `Forget`.
    fn withdraw(pending: &mut Vec<Command>, id: u64) -> bool {
        let from = pending.len().saturating_sub(WITHDRAW_SEARCH);
        let found = pending[from..]
            .iter()
            .rposition(|c| matches!(c, Command::Track(lease) if lease.id == id));
        match found {
            Some(i) => {
                // Commands for different leases commute: order is kept only
                // between one lease's Track and Forget, and this lease has
                // no other command.
                pending.swap_remove(from + i);
                true
            }
            None => false,
        }
    }

    /// Shortens the idle sleep to `span` if it is the shortest seen.
    fn learn_span(&self, span: Duration) {
        let nanos = u64::try_from(span.as_nanos())
            .unwrap_or(u64::MAX)
            .max(1_000_000);
        if nanos < self.idle_span.load(Ordering::Relaxed) {
            self.idle_span.fetch_min(nanos, Ordering::Relaxed);
        }
    }

    fn idle_span(&self) -> Option<Duration> {
        match self.idle_span.load(Ordering::Relaxed) {
            u64::MAX => None,
            nanos => Some(Duration::from_nanos(nanos)),
        }
    }
}

impl HeartbeatHandle {
    /// Starts the heartbeat task on the current tokio runtime.
    pub(crate) fn spawn(backend: Arc<dyn LockBackend>, background: &Background) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let batch = backend.capabilities().batch_renew;
        let shared = Arc::new(Shared {
            pending: Mutex::new(Queue::default()),
            idle_span: AtomicU64::new(u64::MAX),
        });
        let task = Heartbeat::new(backend, batch, Arc::clone(&shared), background.clone());
        background.spawn(task.run(rx));
        Self {
            inner: Arc::new(HandleInner { tx, shared }),
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.inner.tx.is_closed()
    }

    fn wake(&self) -> bool {
        self.inner.tx.send(()).is_ok()
    }

    /// Starts renewing and watching `lease`. Returns false if the task is gone.
    pub(crate) fn track(&self, lease: Arc<LeaseState>) -> bool {
        let due = lease.first_attention();
        self.inner.shared.learn_span(lease.attention_span);
        let mut queue = self.inner.shared.pending();
        queue.commands.push(Command::Track(lease));
        // Under the lock that the task sets its wake-up under: either the
        // task drains this command before it sleeps, or this reads the
        // instant it sleeps until.
        let wake = queue.wake_at.is_none_or(|at| due < at) || queue.commands.len() >= MAX_QUEUED;
        drop(queue);
        if wake {
            return self.wake();
        }
        !self.is_closed()
    }

    /// Stops renewing lease `id`; the caller releases it. The task learns
    /// it before its next sweep, so the lease is never renewed again. A lease
    /// the task has not seen yet (a short hold) is taken back out of the
    /// queue instead, which costs the task nothing.
    pub(crate) fn forget(&self, id: u64) {
        let mut queue = self.inner.shared.pending();
        if Shared::withdraw(&mut queue.commands, id) {
            return;
        }
        queue.commands.push(Command::Forget { id, release: None });
        let queued = queue.commands.len();
        drop(queue);
        if queued >= MAX_QUEUED {
            self.wake();
        }
    }

    /// Stops renewing `lease` and releases it in the background. Never blocks,
    /// so it is safe from `Drop`, even outside a runtime.
    pub(crate) fn forget_and_release(&self, lease: Arc<LeaseState>) {
        let id = lease.id;
        let mut queue = self.inner.shared.pending();
        // The release still goes through the task (there may be no runtime
        // here to spawn it on); only the table insert and removal are saved.
        let _ = Shared::withdraw(&mut queue.commands, id);
        queue.commands.push(Command::Forget {
            id,
            release: Some(lease),
        });
        drop(queue);
        self.wake();
    }
}

/// The leases tracked, by id (looked up twice per lease even when it is
/// released before the heartbeat ever looks at it: hashed with foldhash).
type Entries = HashMap<u64, Entry, foldhash::fast::RandomState>;

/// The renewal calls in flight, by batch id: the leases each one renews
/// that have not ended since it was sent. Removed when the call answers.
type Batches = HashMap<u64, Vec<u64>, foldhash::fast::RandomState>;

struct Entry {
    lease: Arc<LeaseState>,
    next_renew: Instant,
    in_flight: bool,
    /// Which of this lease's entries in the schedule is current.
    generation: u64,
}

impl Entry {
    /// The earliest instant this lease needs the heartbeat: its renewal
    /// (unless one is in flight), its local deadline or its `max_hold`.
    fn attention(&self) -> Option<Instant> {
        let renew = (self.lease.auto_renew && !self.in_flight).then_some(self.next_renew);
        [renew, self.lease.valid_until(), self.lease.hold_deadline]
            .into_iter()
            .flatten()
            .min()
    }
}

type RenewResult = (
    u64,
    Instant,
    Result<LeaseStatus, (BackendErrorKind, String)>,
);

/// One renewal call's answers, with the id of its batch.
type BatchResult = (u64, Vec<RenewResult>);

struct Heartbeat {
    backend: Arc<dyn LockBackend>,
    batch: bool,
    entries: Entries,
    batches: Batches,
    schedule: Schedule,
    next_generation: u64,
    next_batch: u64,
    /// The largest batching slack of any lease tracked so far: a sweep looks
    /// at leases due up to this far ahead.
    max_slack: Duration,
    /// Timer wake-ups in a row that found nothing held and nothing queued;
    /// each one doubles the idle sleep.
    idle_rounds: u32,
    /// Buffers kept between drains of the command queue.
    spare: Vec<Command>,
    tracked: Vec<u64>,
    in_flight: JoinSet<BatchResult>,
    shared: Arc<Shared>,
    background: Background,
}

impl Heartbeat {
    fn new(
        backend: Arc<dyn LockBackend>,
        batch: bool,
        shared: Arc<Shared>,
        background: Background,
    ) -> Self {
        Self {
            backend,
            batch,
            entries: Entries::default(),
            batches: Batches::default(),
            schedule: Schedule::default(),
            next_generation: 1,
            next_batch: 0,
            max_slack: Duration::ZERO,
            idle_rounds: 0,
            spare: Vec::new(),
            tracked: Vec::new(),
            in_flight: JoinSet::new(),
            shared,
            background,
        }
    }

    /// Applies every queued command. Returns false if there was none.
    fn drain(&mut self) -> bool {
        let any = self.drain_queue();
        if any {
            self.idle_rounds = 0;
        }
        any
    }

    fn drain_queue(&mut self) -> bool {
        // The queue and this buffer swap places, so neither is reallocated
        // once both have grown to the usual queue length.
        let mut commands = std::mem::take(&mut self.spare);
        std::mem::swap(&mut commands, &mut self.shared.pending().commands);
        let any = !commands.is_empty();
        let mut tracked = std::mem::take(&mut self.tracked);
        for command in commands.drain(..) {
            if let Command::Track(lease) = &command {
                tracked.push(lease.id);
            }
            self.apply_command(command);
        }
        self.spare = commands;
        // Scheduled after the whole queue: a lease taken and released
        // between two wake-ups never enters the heap.
        for id in tracked.drain(..) {
            self.reschedule(id);
        }
        self.tracked = tracked;
        let (entries, batches) = (&self.entries, &self.batches);
        self.schedule
            .compact(entries.len() + batches.len(), |key, g| {
                is_current(entries, batches, key, g)
            });
        any
    }

    /// When to wake with no lease to look after. A lease tracked while the
    /// task sleeps wakes it only if it needs attention before the task's own
    /// wake-up; sleeping no longer than the shortest time from a grant to its
    /// first attention seen so far means a lease like the earlier ones never
    /// does, so a stream of short holds costs no task switch each. Once the
    /// stream stops, the sleep doubles at every empty wake-up
    /// ([`idle_sleep`]): a `Locker` that once held a 1 ms lease does not
    /// wake a thousand times a second for the rest of its life.
    fn idle_wake(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(idle_sleep(self.shared.idle_span(), self.idle_rounds))
            .unwrap_or(now)
    }

    /// Puts lease `id`'s next attention in the schedule (superseding the
    /// one there, if any).
    fn reschedule(&mut self, id: u64) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1);
        entry.generation = generation;
        if let Some(at) = entry.attention() {
            self.schedule.push(at, Key::Lease(id), generation);
        }
    }

    /// Starts watching the renewal call that renews `ids`, all now in
    /// flight: one schedule entry at the earliest of their deadlines.
    /// Returns the batch's id.
    fn watch_batch(&mut self, ids: Vec<u64>) -> u64 {
        let batch = self.next_batch;
        self.next_batch = self.next_batch.wrapping_add(1);
        self.batches.insert(batch, ids);
        self.reschedule_batch(batch);
        batch
    }

    /// Puts batch `batch`'s earliest deadline in the schedule, or stops
    /// watching it if none of its leases is left.
    fn reschedule_batch(&mut self, batch: u64) {
        let Some(ids) = self.batches.get(&batch) else {
            return;
        };
        let earliest = ids
            .iter()
            .filter_map(|id| self.entries.get(id).and_then(Entry::attention))
            .min();
        if ids.is_empty() {
            self.batches.remove(&batch);
        } else if let Some(at) = earliest {
            self.schedule.push(at, Key::Batch(batch), 0);
        }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<()>) {
        loop {
            let wake = self.next_wake().unwrap_or_else(|| self.idle_wake());
            self.shared.set_wake(Some(wake));
            // A command queued before the store above may have seen the task
            // awake and not woken it: look once more before sleeping.
            if self.drain() {
                continue;
            }
            tokio::select! {
                biased;
                woken = rx.recv() => {
                    self.shared.set_wake(None);
                    // A lease needed attention before this sleep would have
                    // ended: holds are being taken, so the idle sleep starts
                    // over from the shortest span (the lease that woke us
                    // may have been released before this drain sees it).
                    self.idle_rounds = 0;
                    while rx.try_recv().is_ok() {}
                    // Tracking or forgetting a lease makes nothing due now;
                    // skipping the sweep keeps bulk acquires linear.
                    self.drain();
                    if woken.is_none() {
                        break;
                    }
                    continue;
                }
                Some(done) = self.in_flight.join_next(), if !self.in_flight.is_empty() => {
                    self.shared.set_wake(None);
                    // A lease forgotten (released, retained) while its renewal
                    // was in flight takes no result: apply the queue first.
                    self.drain();
                    match done {
                        Ok((batch, results)) => {
                            self.batches.remove(&batch);
                            results.into_iter().for_each(|r| self.apply_result(r));
                        }
                        Err(e) => warn!(error = %e, "a renewal task failed"),
                    }
                }
                _ = sleep_until(wake) => {
                    self.shared.set_wake(None);
                    if self.entries.is_empty() && self.shared.pending().commands.is_empty() {
                        self.idle_rounds = self.idle_rounds.saturating_add(1);
                    }
                }
                () = self.background.closing() => {
                    self.shared.set_wake(None);
                    self.shut_down();
                    break;
                }
            }
            // Forgotten leases must not be renewed: apply the queue first.
            self.drain();
            self.sweep(Instant::now());
        }
        debug!("heartbeat stopped: no Locker or guard is left");
    }

    fn apply_command(&mut self, cmd: Command) {
        match cmd {
            Command::Track(lease) => {
                let next_renew = lease.first_renew_due();
                if self.batch {
                    self.max_slack = self.max_slack.max(lease.interval / 8);
                }
                self.entries.insert(
                    lease.id,
                    Entry {
                        lease,
                        next_renew,
                        in_flight: false,
                        generation: 0,
                    },
                );
            }
            Command::Forget { id, release } => {
                self.entries.remove(&id);
                if let Some(lease) = release {
                    if lease.loss_reason() != Some(LossReason::Stolen) {
                        self.release_in_background(lease);
                    }
                }
            }
        }
    }

    /// The earliest instant at which some lease needs attention.
    fn next_wake(&mut self) -> Option<Instant> {
        let (entries, batches) = (&self.entries, &self.batches);
        self.schedule
            .next(|key, g| is_current(entries, batches, key, g))
    }

    /// Handles every lease whose attention is due: ends the ones past a
    /// deadline and renews the ones due (with the batching slack), then
    /// schedules each one's next attention.
    fn sweep(&mut self, now: Instant) {
        let mut ended = Vec::new();
        let mut due = Vec::new();
        let mut later = Vec::new();
        let mut watched = Vec::new();
        let bound = now.checked_add(self.max_slack).unwrap_or(now);
        loop {
            let (entries, batches) = (&self.entries, &self.batches);
            let Some(key) = self
                .schedule
                .pop_due(bound, |key, g| is_current(entries, batches, key, g))
            else {
                break;
            };
            let id = match key {
                Key::Lease(id) => id,
                Key::Batch(batch) => {
                    self.sweep_batch(batch, now, &mut ended);
                    // Back into the schedule once this sweep is over, at
                    // the earliest deadline of the leases left in it.
                    watched.push(batch);
                    continue;
                }
            };
            let Some(e) = self.entries.get(&id) else {
                continue;
            };
            let lease = &e.lease;
            // Ends the lease at its local deadline or its max_hold (the watchdog).
            if lease.check_valid(now).is_err() {
                ended.push(id);
                continue;
            }
            // Batching slack: renew a little early to share a round trip. It
            // must stay below the retry delay, or a failed renewal would be due
            // again in the same sweep and spin.
            let slack = if self.batch {
                lease.interval / 8
            } else {
                Duration::ZERO
            };
            if lease.auto_renew && !e.in_flight && e.next_renew <= now + slack {
                due.push(id);
            } else {
                // Popped within the largest slack but not due with its own:
                // back into the schedule once this sweep is over.
                later.push(id);
            }
        }
        for id in ended {
            if let Some(e) = self.entries.remove(&id) {
                // A stolen lock is someone else's now; a released one is
                // being released by its holder.
                if !matches!(
                    e.lease.loss_reason(),
                    Some(LossReason::Stolen | LossReason::Released)
                ) {
                    self.release_in_background(e.lease);
                }
            }
        }
        if !due.is_empty() {
            // The leases whose renewal was sent are watched through their
            // batch; the others go back into the schedule as they are.
            let unsent = self.dispatch(due);
            later.extend(unsent);
        }
        for id in later {
            self.reschedule(id);
        }
        for batch in watched {
            self.reschedule_batch(batch);
        }
    }

    /// Ends the leases of in-flight batch `batch` that are past a deadline,
    /// and drops them (and the ones forgotten or answered) from the batch.
    fn sweep_batch(&mut self, batch: u64, now: Instant, ended: &mut Vec<u64>) {
        let Some(ids) = self.batches.get_mut(&batch) else {
            return;
        };
        let entries = &self.entries;
        ids.retain(|id| match entries.get(id) {
            Some(e) if e.in_flight => {
                let valid = e.lease.check_valid(now).is_ok();
                if !valid {
                    ended.push(*id);
                }
                valid
            }
            _ => false,
        });
    }

    /// Sends the renewals of `due`, in batches if the backend takes them.
    /// Returns the leases whose renewal could not begin.
    fn dispatch(&mut self, due: Vec<u64>) -> Vec<u64> {
        let mut leases = Vec::with_capacity(due.len());
        let mut unsent = Vec::new();
        for id in due {
            match self.entries.get_mut(&id) {
                Some(e) if e.lease.begin_renewal() => {
                    e.in_flight = true;
                    leases.push(Arc::clone(&e.lease));
                }
                Some(_) => unsent.push(id),
                None => {}
            }
        }
        if self.batch {
            for chunk in leases.chunks(MAX_BATCH) {
                let chunk = chunk.to_vec();
                let batch = self.watch_batch(chunk.iter().map(|l| l.id).collect());
                let backend = Arc::clone(&self.backend);
                self.in_flight
                    .spawn(async move { (batch, renew_batch(backend, chunk).await) });
            }
        } else {
            for lease in leases {
                let batch = self.watch_batch(vec![lease.id]);
                let backend = Arc::clone(&self.backend);
                self.in_flight.spawn(async move {
                    let sent_at = Instant::now();
                    let r = (*backend)
                        .renew(&lease.name, &lease.owner, lease.ttl)
                        .await
                        .map_err(|e| (e.kind(), e.to_string()));
                    lease.end_renewal();
                    (batch, vec![(lease.id, sent_at, r)])
                });
            }
        }
        unsent
    }

    fn apply_result(&mut self, (id, sent_at, result): RenewResult) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        entry.in_flight = false;
        let lease = Arc::clone(&entry.lease);
        let metrics = lease.metrics();
        match result {
            Ok(LeaseStatus::Held) => {
                metrics.renewal(RenewalOutcome::Renewed);
                lease.extend(sent_at);
                entry.next_renew = lease.renew_due_after(sent_at).unwrap_or(sent_at);
                self.reschedule(id);
            }
            Ok(status) => {
                let (outcome, reason) = match status {
                    LeaseStatus::Stolen => (RenewalOutcome::Stolen, LossReason::Stolen),
                    LeaseStatus::Forced => (RenewalOutcome::Forced, LossReason::Forced),
                    _ => (RenewalOutcome::Expired, LossReason::Expired),
                };
                metrics.renewal(outcome);
                lease.mark_lost(reason);
                self.entries.remove(&id);
            }
            Err((BackendErrorKind::Config | BackendErrorKind::Auth, message)) => {
                // Misconfiguration or lost permission does not heal by retrying
                // (a detected pooler, a revoked ACL): the lease cannot be proven.
                metrics.renewal(RenewalOutcome::Error);
                warn!(lock = %lease.name, error = %message, "renewal refused; giving the lease up");
                lease.set_renew_failing();
                lease.mark_lost(LossReason::BackendError);
                self.entries.remove(&id);
                self.release_in_background(lease);
            }
            Err((_, message)) => {
                metrics.renewal(RenewalOutcome::Error);
                lease.set_renew_failing();
                warn!(lock = %lease.name, error = %message, "renewal failed; retrying while the lease is valid");
                let retry = (lease.interval / 4).max(Duration::from_millis(5));
                entry.next_renew = Instant::now() + retry;
                self.reschedule(id);
            }
        }
    }

    /// The `Locker` is shutting down: every lease tracked here (and every
    /// one still queued) ends as released for all its handles, and its
    /// release starts as a tracked task. Renewals in flight are dropped.
    fn shut_down(&mut self) {
        self.drain();
        let now = Instant::now();
        self.schedule.clear();
        self.batches.clear();
        for (_, entry) in self.entries.drain() {
            let lease = entry.lease;
            if lease.finish(now) != Err(LossReason::Stolen) {
                release_in_background(&self.backend, &self.background, lease);
            }
        }
        debug!("heartbeat stopped: the Locker is shutting down");
    }

    fn release_in_background(&self, lease: Arc<LeaseState>) {
        release_in_background(&self.backend, &self.background, lease);
    }
}

/// The longest the heartbeat sleeps while it holds nothing.
const MAX_IDLE_SLEEP: Duration = Duration::from_secs(3600);

/// How long an idle heartbeat sleeps: the shortest grant-to-attention span
/// seen (an hour if none), doubled for each of `rounds` empty wake-ups in a
/// row, never more than an hour unless the span itself is longer.
fn idle_sleep(span: Option<Duration>, rounds: u32) -> Duration {
    let Some(span) = span else {
        return MAX_IDLE_SLEEP;
    };
    let grown = 2u32
        .checked_pow(rounds)
        .and_then(|factor| span.checked_mul(factor))
        .unwrap_or(Duration::MAX);
    grown.min(MAX_IDLE_SLEEP.max(span))
}

/// Whether an entry for `key` at `generation` is still current: its lease's
/// latest, or a batch whose call has not answered.
fn is_current(entries: &Entries, batches: &Batches, key: Key, generation: u64) -> bool {
    match key {
        Key::Lease(id) => entries.get(&id).is_some_and(|e| e.generation == generation),
        Key::Batch(batch) => batches.contains_key(&batch),
    }
}

/// Releases `lease` in a task the `Locker`'s shutdown waits for.
pub(crate) fn release_in_background(
    backend: &Arc<dyn LockBackend>,
    background: &Background,
    lease: Arc<LeaseState>,
) {
    let backend = Arc::clone(backend);
    background.spawn(async move {
        if let Err(e) = (*backend).release(&lease.name, &lease.owner).await {
            warn!(lock = %lease.name, error = %e, "background release failed; the lease ends at its TTL");
        }
    });
}

async fn renew_batch(
    backend: Arc<dyn LockBackend>,
    leases: Vec<Arc<LeaseState>>,
) -> Vec<RenewResult> {
    let requests: Vec<RenewRequest> = leases
        .iter()
        .map(|l| RenewRequest {
            name: l.name.clone(),
            owner: l.owner,
            ttl: l.ttl,
        })
        .collect();
    let sent_at = Instant::now();
    let answer = (*backend).renew_many(&requests).await;
    leases.iter().for_each(|l| l.end_renewal());
    let statuses: Vec<Result<LeaseStatus, (BackendErrorKind, String)>> = match answer {
        Ok(statuses) if statuses.len() == leases.len() => statuses.into_iter().map(Ok).collect(),
        Ok(statuses) => {
            let msg = format!(
                "backend answered {} statuses for {} leases",
                statuses.len(),
                leases.len()
            );
            vec![Err((BackendErrorKind::Protocol, msg)); leases.len()]
        }
        Err(e) => vec![Err((e.kind(), e.to_string())); leases.len()],
    };
    leases
        .iter()
        .zip(statuses)
        .map(|(l, s)| (l.id, sent_at, s))
        .collect()
}

#[cfg(test)]
mod tests;
