//! `rate_limit_decisions_total`, counted per thread and summed when read.
//!
//! One shared counter per series costs every decision an atomic add on a
//! cache line that every thread deciding for the limiter writes: under
//! concurrency the line moves between cores on each call, and that add cost
//! as much as the decision itself. Here each thread adds to a stripe of its
//! own (a cache line no other thread of the process writes while there are
//! at most [`STRIPES`] of them), and the exported counters are brought up to
//! the stripes' sum whenever the series are gathered or read, so a scrape
//! or [`RateLimitMetrics::decisions`](super::RateLimitMetrics::decisions)
//! still sees every decision made before it.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::{proto, IntCounter, IntCounterVec};

use super::{Outcome, Source};

/// Stripes per limiter name: more than the worker threads of most services,
/// few enough that a limiter's stripes take 4 KiB.
const STRIPES: usize = 32;
/// Series per limiter: every outcome by every source.
const SERIES: usize = Outcome::ALL.len() * Source::ALL.len();

/// One thread's counts of one limiter name, alone on its cache lines (128
/// bytes: adjacent-line prefetch pairs 64-byte lines on x86).
#[repr(align(128))]
#[derive(Default)]
struct Stripe([AtomicU64; SERIES]);

/// The per-thread counts of one limiter name; limiters of one name share
/// them, as they share series.
pub(crate) struct Counts {
    stripes: Box<[Stripe]>,
}

impl fmt::Debug for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Counts")
    }
}

impl Counts {
    fn new() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
        }
    }

    /// Counts one decision on this thread's stripe.
    pub(crate) fn add(&self, outcome: Outcome, source: Source) {
        let series = outcome as usize * Source::ALL.len() + source as usize;
        let stripe = self
            .stripes
            .get(stripe_of_thread())
            .and_then(|s| s.0.get(series));
        if let Some(counter) = stripe {
            // Relaxed: a count orders nothing; gathering sums under a lock.
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The sum over the stripes of one series.
    fn sum(&self, series: usize) -> u64 {
        self.stripes
            .iter()
            .filter_map(|s| s.0.get(series))
            .fold(0u64, |sum, c| sum.wrapping_add(c.load(Ordering::Relaxed)))
    }
}

/// This thread's stripe: threads take stripes in turn as they first count,
/// so up to [`STRIPES`] threads never share one.
fn stripe_of_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
            s.set(i);
        }
        i
    })
}

/// One limiter name's counts and the exported counters they are summed into.
struct Named {
    counts: Arc<Counts>,
    exported: Vec<IntCounter>,
}

/// The `rate_limit_decisions_total` collector: the counter vector that is
/// exported, and the per-thread counts of every limiter name it exports.
#[derive(Clone)]
pub(crate) struct Decisions {
    vec: IntCounterVec,
    named: Arc<Mutex<HashMap<String, Named>>>,
}

impl Decisions {
    pub(crate) fn new(vec: IntCounterVec) -> Self {
        Self {
            vec,
            named: Arc::default(),
        }
    }

    /// The counts of `limiter`, its series created at 0 on first use.
    pub(crate) fn counts(&self, limiter: &str) -> Arc<Counts> {
        let mut named = self.named.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = named.get(limiter) {
            return Arc::clone(&n.counts);
        }
        let exported = Outcome::ALL
            .iter()
            .flat_map(|(_, outcome)| {
                Source::ALL
                    .iter()
                    .map(|source| {
                        self.vec
                            .with_label_values(&[limiter, outcome, source.as_str()])
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let counts = Arc::new(Counts::new());
        named.insert(
            limiter.to_owned(),
            Named {
                counts: Arc::clone(&counts),
                exported,
            },
        );
        counts
    }

    /// Brings every exported counter up to its stripes' sum. Under the lock,
    /// so two readers never add the same decisions twice; a stripe only
    /// grows, so the sum never falls below what was exported.
    fn sync(&self) {
        let named = self.named.lock().unwrap_or_else(PoisonError::into_inner);
        for n in named.values() {
            for (series, counter) in n.exported.iter().enumerate() {
                let behind = n.counts.sum(series).saturating_sub(counter.get());
                if behind > 0 {
                    counter.inc_by(behind);
                }
            }
        }
    }

    /// The count of one series, exact for the decisions made before the call.
    pub(crate) fn get(&self, limiter: &str, outcome: &str, source: Source) -> u64 {
        self.sync();
        self.vec
            .with_label_values(&[limiter, outcome, source.as_str()])
            .get()
    }
}

impl Collector for Decisions {
    fn desc(&self) -> Vec<&Desc> {
        self.vec.desc()
    }

    fn collect(&self) -> Vec<proto::MetricFamily> {
        self.sync();
        self.vec.collect()
    }
}
