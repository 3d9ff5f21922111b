//! What the replicas ran, as a table and a summary.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use scheduler::{RunReport, TickOutcome};
use tokio::time::Instant;

/// One handler run as the handler saw it.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) replica: usize,
    pub(crate) tick: DateTime<Utc>,
    pub(crate) started: Instant,
    pub(crate) finished: bool,
}

/// Everything one mode's replicas ran and reported.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    runs: Mutex<Vec<Run>>,
    reports: Mutex<Vec<(usize, RunReport)>>,
}

impl Journal {
    pub(crate) fn started(&self, replica: usize, tick: DateTime<Utc>) -> usize {
        let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        runs.push(Run {
            replica,
            tick,
            started: Instant::now(),
            finished: false,
        });
        runs.len() - 1
    }

    pub(crate) fn finished(&self, index: usize) {
        if let Some(run) = self
            .runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(index)
        {
            run.finished = true;
        }
    }

    pub(crate) fn reported(&self, replica: usize, report: &RunReport) {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((replica, report.clone()));
    }

    pub(crate) fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The outcome a replica reported for a tick it started; a run with no
    /// report was cut off by the kill.
    fn outcome(&self, replica: usize, tick: DateTime<Utc>) -> String {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(r, rep)| {
                *r == replica && rep.scheduled == tick && rep.outcome != TickOutcome::Skipped
            })
            .map_or_else(
                || "killed mid-run".to_owned(),
                |(_, rep)| {
                    if rep.catch_up {
                        format!("{} (catch-up)", rep.outcome)
                    } else {
                        rep.outcome.to_string()
                    }
                },
            )
    }

    /// How many ticks `replica` reported skipped (held or done elsewhere).
    pub(crate) fn skipped(&self, replica: usize) -> usize {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(r, rep)| *r == replica && rep.outcome == TickOutcome::Skipped)
            .count()
    }
}

/// Prints the per-tick table and the summary line of one mode, and returns
/// the summary line.
pub(crate) fn print(
    mode: &str,
    journal: &Journal,
    origin: Instant,
    period: Duration,
    failover: Option<Duration>,
) -> String {
    let mut runs = journal.runs();
    runs.sort_by_key(|r| (r.tick, r.started));
    println!("\n{mode}: tick (UTC)   ran on   at (s)  outcome");
    for run in &runs {
        println!(
            "{mode}: {}  r{}       {:>6.2}  {}",
            run.tick.format("%H:%M:%S%.3f"),
            run.replica,
            run.started.duration_since(origin).as_secs_f64(),
            journal.outcome(run.replica, run.tick),
        );
    }
    let mut completed: BTreeMap<DateTime<Utc>, usize> = BTreeMap::new();
    for run in runs.iter().filter(|r| r.finished) {
        *completed.entry(run.tick).or_default() += 1;
    }
    let duplicates = completed.values().filter(|n| **n > 1).count();
    let (ticks, missed) = match (completed.keys().next(), completed.keys().next_back()) {
        (Some(first), Some(last)) => {
            let step = chrono::TimeDelta::from_std(period).unwrap_or(chrono::TimeDelta::MAX);
            let mut expected = 0;
            let mut missed = 0;
            let mut t = *first;
            while t <= *last {
                expected += 1;
                if !completed.contains_key(&t) {
                    missed += 1;
                }
                t += step;
            }
            (expected, missed)
        }
        _ => (0, 0),
    };
    let cut_short = runs.iter().filter(|r| !r.finished).count();
    if cut_short > 0 {
        println!("{mode}: {cut_short} run(s) cut short by the kill (not completed; their tick counts once, when it completed)");
    }
    let failover = failover.map_or_else(|| "none".to_owned(), |d| format!("{} ms", d.as_millis()));
    let summary =
        format!("ticks: {ticks}, duplicates: {duplicates}, missed: {missed}, failover: {failover}");
    println!("{mode}: {summary}");
    summary
}
