//! The series of one `lock` label, looked up once per lease instead of on
//! every update.
//!
//! Finding a series by its label values hashes them and takes the metric's
//! lock; an acquire and a release used to do that five times. A lease now
//! holds its label's [`LabelMetrics`] and counts straight into the series.

use std::sync::{Arc, OnceLock};

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use super::{AcquireOutcome, RenewalOutcome};
use crate::LossReason;

/// Every series of one `lock` label. The acquisition and loss series exist
/// from the label's first sight (at 0, so that `increase()` sees the first
/// rise); the others are created on first use, as before.
pub(crate) struct LabelMetrics {
    label: Arc<str>,
    acquisitions: [IntCounter; AcquireOutcome::ALL.len()],
    lost: [IntCounter; LossReason::LOSSES.len()],
    renewals: [OnceLock<IntCounter>; 5],
    held: OnceLock<IntGauge>,
    held_seconds: OnceLock<Histogram>,
    lost_vec: IntCounterVec,
    renewals_vec: IntCounterVec,
    held_vec: IntGaugeVec,
    held_seconds_vec: HistogramVec,
}

impl std::fmt::Debug for LabelMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabelMetrics")
            .field("label", &self.label)
            .finish()
    }
}

/// The families a [`LabelMetrics`] takes its series from.
pub(super) struct Families<'a> {
    pub(super) acquisitions: &'a IntCounterVec,
    pub(super) renewals: &'a IntCounterVec,
    pub(super) lost: &'a IntCounterVec,
    pub(super) held: &'a IntGaugeVec,
    pub(super) held_seconds: &'a HistogramVec,
}

impl LabelMetrics {
    /// Resolves (and so creates at 0) the acquisition and loss series of `label`.
    pub(super) fn new(label: Arc<str>, f: &Families<'_>) -> Self {
        let acquisitions =
            AcquireOutcome::ALL.map(|o| f.acquisitions.with_label_values(&[&*label, o.as_str()]));
        let lost = LossReason::LOSSES.map(|r| f.lost.with_label_values(&[&*label, r.as_str()]));
        Self {
            label,
            acquisitions,
            lost,
            renewals: Default::default(),
            held: OnceLock::new(),
            held_seconds: OnceLock::new(),
            lost_vec: f.lost.clone(),
            renewals_vec: f.renewals.clone(),
            held_vec: f.held.clone(),
            held_seconds_vec: f.held_seconds.clone(),
        }
    }

    pub(crate) fn acquisition(&self, outcome: AcquireOutcome) {
        self.acquisitions[acquire_index(outcome)].inc();
    }

    pub(crate) fn renewal(&self, outcome: RenewalOutcome) {
        let slot = &self.renewals[renewal_index(outcome)];
        slot.get_or_init(|| {
            self.renewals_vec
                .with_label_values(&[&*self.label, outcome.as_str()])
        })
        .inc();
    }

    pub(crate) fn lost(&self, reason: LossReason) {
        match LossReason::LOSSES.iter().position(|r| *r == reason) {
            Some(i) => self.lost[i].inc(),
            // Not a loss (a release): counted as asked, though no caller does.
            None => self
                .lost_vec
                .with_label_values(&[&*self.label, reason.as_str()])
                .inc(),
        }
    }

    fn held(&self) -> &IntGauge {
        self.held
            .get_or_init(|| self.held_vec.with_label_values(&[&*self.label]))
    }

    pub(crate) fn held_start(&self) {
        self.held().inc();
    }

    pub(crate) fn held_end(&self, seconds: f64) {
        self.held().dec();
        self.held_seconds
            .get_or_init(|| self.held_seconds_vec.with_label_values(&[&*self.label]))
            .observe(seconds);
    }
}

const fn acquire_index(outcome: AcquireOutcome) -> usize {
    match outcome {
        AcquireOutcome::Acquired => 0,
        AcquireOutcome::HeldElsewhere => 1,
        AcquireOutcome::HeldLocally => 2,
        AcquireOutcome::Unavailable => 3,
        AcquireOutcome::Unlocked => 4,
        AcquireOutcome::Error => 5,
    }
}

const fn renewal_index(outcome: RenewalOutcome) -> usize {
    match outcome {
        RenewalOutcome::Renewed => 0,
        RenewalOutcome::Stolen => 1,
        RenewalOutcome::Expired => 2,
        RenewalOutcome::Error => 3,
        RenewalOutcome::Forced => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_the_label_order() {
        for (i, o) in AcquireOutcome::ALL.into_iter().enumerate() {
            assert_eq!(acquire_index(o), i, "{o:?}");
        }
    }
}
