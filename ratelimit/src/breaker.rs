//! The circuit breaker in front of a limiter's store.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// When to stop calling a failing store, and for how long.
///
/// After `failures` consecutive failed calls the breaker opens: for
/// `open_for`, requests go straight to the limiter's
/// [`OnStoreError`](crate::OnStoreError) policy without touching the store,
/// so an outage costs no latency per request. Then one request probes the
/// store; its success closes the breaker, its failure opens it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (at least 1).
    pub failures: u32,
    /// How long it stays open before a probe.
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    /// Opens after 3 consecutive failures, probes after 1 s.
    fn default() -> Self {
        Self {
            failures: 3,
            open_for: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    Probing { since: Instant },
}

/// What the breaker lets a request do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permit {
    Call,
    Skip,
}

/// A change worth a log line and the gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    Opened,
    Closed,
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    /// A probe that has not answered in this long is presumed abandoned
    /// (its request was dropped) and another may start.
    probe_patience: Duration,
    state: Mutex<State>,
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig, store_timeout: Duration) -> Self {
        Self {
            config: BreakerConfig {
                failures: config.failures.max(1),
                ..config
            },
            probe_patience: store_timeout.saturating_mul(2),
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn permit(&self) -> Permit {
        let now = Instant::now();
        let mut state = self.state();
        match *state {
            State::Closed { .. } => Permit::Call,
            State::Open { until } if now >= until => {
                *state = State::Probing { since: now };
                Permit::Call
            }
            State::Open { .. } => Permit::Skip,
            State::Probing { since } if now.duration_since(since) > self.probe_patience => {
                *state = State::Probing { since: now };
                Permit::Call
            }
            State::Probing { .. } => Permit::Skip,
        }
    }

    pub(crate) fn success(&self) -> Option<Change> {
        let mut state = self.state();
        let change = match *state {
            State::Closed { .. } => None,
            State::Open { .. } | State::Probing { .. } => Some(Change::Closed),
        };
        *state = State::Closed { failures: 0 };
        change
    }

    pub(crate) fn failure(&self) -> Option<Change> {
        let now = Instant::now();
        let mut state = self.state();
        let open = State::Open {
            until: now + self.config.open_for,
        };
        match *state {
            State::Closed { failures } if failures + 1 >= self.config.failures => {
                *state = open;
                Some(Change::Opened)
            }
            State::Closed { failures } => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                None
            }
            // Still open: no news.
            State::Open { .. } | State::Probing { .. } => {
                *state = open;
                None
            }
        }
    }

    /// How long until the next probe, for a `Retry-After` (the open period
    /// when closed or probing).
    pub(crate) fn retry_after(&self) -> Duration {
        match *self.state() {
            State::Open { until } => until.saturating_duration_since(Instant::now()),
            _ => self.config.open_for,
        }
    }
}
