//! What the scheduler-at-scale rows count: handler runs per (job, tick)
//! inside the measured window, and tick-store round trips.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use lock_core::{BackendError, LockName, TickStore};
use scheduler::TickOutcome;

/// One handler run, as the handler saw it start.
#[derive(Debug, Clone)]
pub(crate) struct Started {
    /// The job's index.
    pub(crate) job: usize,
    /// The scheduled tick.
    pub(crate) tick: DateTime<Utc>,
    /// Which replica ran it.
    pub(crate) replica: usize,
    /// The wall clock when the handler started.
    pub(crate) at: DateTime<Utc>,
}

/// One tick's outcome on one replica, as the scheduler reported it.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    /// The job's name.
    pub(crate) job: String,
    /// The scheduled tick, Unix ms.
    pub(crate) tick_ms: i64,
    /// Which replica reported it.
    pub(crate) replica: usize,
    /// How it ended there.
    pub(crate) outcome: TickOutcome,
}

/// Runs counted per (job, tick) over the ticks of a window.
#[derive(Debug)]
pub(crate) struct Tally {
    /// Jobs times whole-second ticks in the window.
    pub(crate) expected: usize,
    /// Handler runs of those ticks.
    pub(crate) ran: usize,
    /// (job, tick) pairs run more than once.
    pub(crate) duplicates: usize,
    /// (job, tick) pairs never run.
    pub(crate) missed: usize,
    /// (job, tick) pairs that ended `Success` on more than one replica: a
    /// duplicate that is not a documented re-run of a run cut short.
    pub(crate) double_success: usize,
    /// Runs the scheduler reported `Aborted` (lock lost mid-run).
    pub(crate) aborted: usize,
    /// The first duplicate, described, if any.
    pub(crate) example: Option<String>,
    /// Start minus scheduled tick, in ms, sorted.
    lags_ms: Vec<f64>,
    /// Each tick second's own lag p99, in ms, sorted: a window's p99 is its
    /// worst 1 %, which one bad second can fill; these say how many seconds
    /// were bad.
    second_p99s_ms: Vec<f64>,
}

impl Tally {
    /// Counts `runs` of `jobs` jobs (named `names`), and the outcomes
    /// `ended`, whose tick lies in `[from, until)`.
    pub(crate) fn of(
        runs: &[Started],
        ended: &[Ended],
        names: &[String],
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Self {
        let (from_ms, until_ms) = (from.timestamp_millis(), until.timestamp_millis());
        let in_window = |t: &DateTime<Utc>| (from_ms..until_ms).contains(&t.timestamp_millis());
        // Whole seconds in [from, until): the ticks of an every-second cron.
        let first = from_ms.div_euclid(1000) + i64::from(from_ms.rem_euclid(1000) != 0);
        let end = until_ms.div_euclid(1000) + i64::from(until_ms.rem_euclid(1000) != 0);
        let ticks = usize::try_from(end.saturating_sub(first)).unwrap_or(0);
        let mut per: HashMap<(usize, i64), Vec<usize>> = HashMap::new();
        let mut lags_ms = Vec::new();
        let mut by_second: HashMap<i64, Vec<f64>> = HashMap::new();
        for r in runs.iter().filter(|r| in_window(&r.tick)) {
            per.entry((r.job, r.tick.timestamp_millis()))
                .or_default()
                .push(r.replica);
            let lag_us = (r.at - r.tick).num_microseconds().unwrap_or(i64::MAX);
            lags_ms.push(lag_us as f64 / 1000.0);
            by_second
                .entry(r.tick.timestamp_millis().div_euclid(1000))
                .or_default()
                .push(lag_us as f64 / 1000.0);
        }
        lags_ms.sort_by(f64::total_cmp);
        let mut second_p99s_ms: Vec<f64> = by_second
            .into_values()
            .map(|mut lags| {
                lags.sort_by(f64::total_cmp);
                percentile(&lags, 99.0)
            })
            .collect();
        second_p99s_ms.sort_by(f64::total_cmp);
        let mut outcomes: HashMap<(&str, i64), Vec<(usize, TickOutcome)>> = HashMap::new();
        for e in ended
            .iter()
            .filter(|e| (from_ms..until_ms).contains(&e.tick_ms))
        {
            outcomes
                .entry((e.job.as_str(), e.tick_ms))
                .or_default()
                .push((e.replica, e.outcome));
        }
        let successes = |o: &Vec<(usize, TickOutcome)>| {
            o.iter().filter(|(_, o)| *o == TickOutcome::Success).count()
        };
        let example = per
            .iter()
            .filter(|(_, r)| r.len() > 1)
            .min_by_key(|((job, tick), _)| (*tick, *job))
            .map(|((job, tick), replicas)| {
                let name = names.get(*job).map_or("", String::as_str);
                let ran = runs
                    .iter()
                    .filter(|r| r.job == *job && r.tick.timestamp_millis() == *tick)
                    .map(|r| format!("replica {} lag {} ms", r.replica, (r.at - r.tick).num_milliseconds()))
                    .collect::<Vec<_>>()
                    .join(", ");
                let ended = outcomes.get(&(name, *tick)).cloned().unwrap_or_default();
                format!("e.g. job {job} tick {tick} started on replicas {replicas:?} ({ran}), outcomes {ended:?}")
            });
        let expected = names.len() * ticks;
        Self {
            expected,
            ran: lags_ms.len(),
            duplicates: per.values().filter(|r| r.len() > 1).count(),
            missed: expected.saturating_sub(per.len()),
            double_success: outcomes.values().filter(|o| successes(o) > 1).count(),
            aborted: ended
                .iter()
                .filter(|e| {
                    (from_ms..until_ms).contains(&e.tick_ms) && e.outcome == TickOutcome::Aborted
                })
                .count(),
            example,
            lags_ms,
            second_p99s_ms,
        }
    }

    /// The `p`th percentile of the lag in ms (0 without runs).
    pub(crate) fn lag_ms(&self, p: f64) -> f64 {
        percentile(&self.lags_ms, p)
    }

    /// Tick seconds with at least one run in the window.
    pub(crate) fn seconds(&self) -> usize {
        self.second_p99s_ms.len()
    }

    /// Tick seconds whose own lag p99 exceeds `bound_ms`.
    pub(crate) fn seconds_over(&self, bound_ms: f64) -> usize {
        self.second_p99s_ms
            .iter()
            .filter(|p| **p > bound_ms)
            .count()
    }

    /// The `p`th percentile, over the window's seconds, of each second's
    /// lag p99 in ms (0 without runs).
    pub(crate) fn second_p99_ms(&self, p: f64) -> f64 {
        percentile(&self.second_p99s_ms, p)
    }
}

/// The `p`th percentile of `sorted` (0 if empty), by nearest rank.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = ((p / 100.0) * last as f64).round() as usize;
    sorted.get(rank.min(last)).copied().unwrap_or(0.0)
}

/// Passes tick-store calls through, counting them: they are backend round
/// trips too. A batch counts once: every store answers one in a single
/// round trip up to its request limit (on etcd 124 records or 128 reads a
/// transaction, more than the scheduler rows' 100 jobs). Clones share the
/// count.
#[derive(Debug, Clone)]
pub(crate) struct CountingTicks {
    inner: Arc<dyn TickStore>,
    calls: Arc<AtomicU64>,
}

impl CountingTicks {
    pub(crate) fn new(inner: Arc<dyn TickStore>) -> Self {
        Self {
            inner,
            calls: Arc::default(),
        }
    }

    /// Counts a batch of `items`: one round trip, none for an empty batch.
    fn count_batch(&self, items: usize) {
        if items > 0 {
            self.count();
        }
    }

    /// How many calls went through.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl TickStore for CountingTicks {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.count();
        self.inner.last_completed(job).await
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.count();
        self.inner.record_completed(job, tick, keep).await
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        self.count();
        self.inner.is_completed(job, tick).await
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        self.count_batch(jobs.len());
        self.inner.last_completed_many(jobs).await
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        self.count_batch(ticks.len());
        self.inner.is_completed_many(ticks).await
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        self.count_batch(ticks.len());
        self.inner.record_completed_many(ticks, keep).await
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &lock_core::TickWrite,
        keep: Duration,
    ) -> Result<lock_core::TickAnswer, BackendError> {
        self.count();
        self.inner.write_tick(job, tick, write, keep).await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<lock_core::TickRecord>, BackendError> {
        self.count();
        self.inner.tick_record(job, tick).await
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, lock_core::TickWrite)],
        keep: Duration,
    ) -> Vec<Result<lock_core::TickAnswer, BackendError>> {
        self.count_batch(writes.len());
        self.inner.write_ticks_many(writes, keep).await
    }

    fn checks_starts_in_one_step(&self) -> bool {
        self.inner.checks_starts_in_one_step()
    }

    /// One round trip where the store makes the checks itself; a scheduler
    /// only calls it then (it reads and writes apart otherwise).
    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, lock_core::TickWrite, lock_core::StartCheck)],
        keep: Duration,
    ) -> Vec<Result<lock_core::StartVerdict, BackendError>> {
        self.count_batch(starts.len());
        self.inner.start_checked_many(starts, keep).await
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        let answer = self.inner.server_time().await;
        // A store without a server clock answers `None` without asking
        // anyone (the trait's default): no round trip to count.
        if !matches!(answer, Ok(None)) {
            self.count();
        }
        answer
    }
}
