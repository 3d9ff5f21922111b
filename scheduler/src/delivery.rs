//! [`Delivery`]: what a job's tick may do when the replica running it stalls
//! or dies between starting it and recording it complete.

use std::fmt;
use std::str::FromStr;

use lock_core::OnStale;

/// What a tick of a job promises when the replica running it stalls past
/// its lock's TTL, or dies, after starting it (see the crate docs, "Why a
/// tick runs once"). Every tick's start is recorded in the tick store under
/// the fencing token of its lock before its handler is called; the mode says
/// what the next replica to fire the tick does with a tick started by a
/// runner whose lock has since expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Delivery {
    /// The tick's handler is called at most once, whatever became of its
    /// runner: a started tick whose runner's lock expired is marked
    /// abandoned (outcome [`TickOutcome::Abandoned`](crate::TickOutcome::Abandoned),
    /// counted and alerted on), never run again. The default: every job of
    /// the reference deployments does damage when run twice (two live
    /// rounds, a double payout, a bet reconciled twice) and little when a
    /// run is lost once and seen by an alert.
    #[default]
    AtMostOnce,
    /// Every tick is completed at least once: a started tick whose runner's
    /// lock expired is taken over with the new lock's higher token and run
    /// again, and the first runner's late completion is refused (outcome
    /// [`TickOutcome::FencedOut`](crate::TickOutcome::FencedOut)). Exactly one
    /// completion is recorded, the highest token's. For idempotent jobs
    /// that must not be lost. Needs fencing tokens: on a backend without
    /// them a stalled run cannot be told apart from its successor, and the
    /// tick is marked abandoned as under `AtMostOnce`.
    AtLeastOnce,
}

impl Delivery {
    /// What the store does with a stale start record under this mode, given
    /// whether this replica's lock carries a fencing token.
    pub(crate) fn on_stale(self, fenced: bool) -> OnStale {
        match self {
            Self::AtLeastOnce if fenced => OnStale::TakeOver,
            _ => OnStale::Abandon,
        }
    }

    /// The name `FromStr` reads: `at-most-once` or `at-least-once`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::AtMostOnce => "at-most-once",
            Self::AtLeastOnce => "at-least-once",
        }
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A [`Delivery`] name that is neither `at-most-once` nor `at-least-once`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown delivery {0:?}: use at-most-once or at-least-once")]
pub struct UnknownDelivery(pub String);

impl FromStr for Delivery {
    type Err = UnknownDelivery;

    /// Reads `at-most-once` or `at-least-once` (also with underscores, any
    /// case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "at-most-once" => Ok(Self::AtMostOnce),
            "at-least-once" => Ok(Self::AtLeastOnce),
            _ => Err(UnknownDelivery(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in [Delivery::AtMostOnce, Delivery::AtLeastOnce] {
            assert_eq!(d.as_str().parse::<Delivery>(), Ok(d));
        }
        assert_eq!("AT_LEAST_ONCE".parse(), Ok(Delivery::AtLeastOnce));
        assert!("once".parse::<Delivery>().is_err());
        assert_eq!(Delivery::default(), Delivery::AtMostOnce);
        assert_eq!(Delivery::AtLeastOnce.on_stale(false), OnStale::Abandon);
    }
}
