//! Latency samples and the figures printed from them.

use std::time::Duration;

/// Latencies of one measured operation, and the wall time they took.
#[derive(Debug, Default, Clone)]
pub(crate) struct Samples {
    latencies: Vec<Duration>,
    wall: Duration,
}

impl Samples {
    pub(crate) fn push(&mut self, d: Duration) {
        self.latencies.push(d);
    }

    pub(crate) fn add_wall(&mut self, d: Duration) {
        self.wall += d;
    }

    pub(crate) fn merge(&mut self, other: Samples) {
        self.latencies.extend(other.latencies);
        self.wall += other.wall;
    }

    pub(crate) fn count(&self) -> usize {
        self.latencies.len()
    }

    /// Operations per second of wall time (concurrent workers overlap).
    pub(crate) fn ops_per_sec(&self) -> f64 {
        if self.wall.is_zero() {
            return 0.0;
        }
        self.latencies.len() as f64 / self.wall.as_secs_f64()
    }

    pub(crate) fn max(&self) -> Duration {
        self.latencies.iter().copied().max().unwrap_or_default()
    }

    pub(crate) fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
        sorted[rank.min(sorted.len() - 1)]
    }
}

/// Formats a duration in milliseconds with three decimals.
pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}
