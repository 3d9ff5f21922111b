//! The checks a scheduler makes between taking a tick's lock and writing
//! its `Started` record, as data: so that a store able to make them in the
//! same server-side step as the write
//! ([`TickStore::start_checked_many`](crate::TickStore::start_checked_many))
//! saves the round trip the reads would cost, and answers exactly as the
//! reads would.
//!
//! The checks only ever refuse a start the record would have let through
//! (a tick ahead of the server's clock, or one already done); they never
//! let through a start the record refuses, so the fenced protocol modelled
//! in `scheduler/model/ticks.pml` is unchanged by where they run.

use crate::tick_record::TickAnswer;

/// What a tick's `Started` write is checked against before it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartCheck {
    /// The clock skew the replicas tolerate, in ms.
    pub tolerance_ms: i64,
    /// Whether the tick is more than the tolerance in the past on the
    /// replica's own clock (read just before the check is sent).
    pub late: bool,
}

/// How a checked `Started` write ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartVerdict {
    /// Not written: the tick lies more than the tolerance ahead of the
    /// server's clock (`server_ms`): the replica's clock is wrong.
    Ahead {
        /// The server's clock, Unix ms.
        server_ms: i64,
    },
    /// Not written: the tick itself is marked completed.
    Marked,
    /// Not written: the job's latest completed tick (`last`) covers it.
    Covered {
        /// The latest completed tick, Unix ms.
        last: i64,
    },
    /// The checks passed and the write was made: the store's answer.
    Written(TickAnswer),
}

impl StartCheck {
    /// The verdict of the checks on `tick` (Unix ms), given the server's
    /// clock (`None`: the store has none), whether the tick is marked
    /// completed and the job's latest completed tick; `None` means the
    /// checks pass (write the record). Every store that makes the checks
    /// itself answers as this does.
    ///
    /// The latest completed tick alone does not prove that `tick` ran: a
    /// replica whose clock is ahead may have finished a later tick while
    /// this one is still due on slower replicas. Within the tolerance the
    /// tick's own lock and mark decide; a later tick only covers this one
    /// once it is older than the tolerance, on the replica's clock (`late`)
    /// or by the later tick itself.
    #[must_use]
    pub fn verdict(
        &self,
        tick: i64,
        server_ms: Option<i64>,
        marked: bool,
        last: Option<i64>,
    ) -> Option<StartVerdict> {
        if let Some(server_ms) = server_ms {
            if tick.saturating_sub(server_ms) > self.tolerance_ms {
                return Some(StartVerdict::Ahead { server_ms });
            }
        }
        if marked {
            return Some(StartVerdict::Marked);
        }
        match last {
            Some(last)
                if last == tick
                    || (last > tick
                        && (self.late || last.saturating_sub(tick) > self.tolerance_ms)) =>
            {
                Some(StartVerdict::Covered { last })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_check_refuses_on_its_own_ground() {
        let c = StartCheck {
            tolerance_ms: 1_000,
            late: false,
        };
        assert_eq!(c.verdict(10_000, Some(10_000), false, None), None);
        assert_eq!(
            c.verdict(11_000, Some(10_000), false, None),
            None,
            "at the tolerance"
        );
        assert_eq!(
            c.verdict(11_001, Some(10_000), true, Some(11_001)),
            Some(StartVerdict::Ahead { server_ms: 10_000 }),
            "the clock check comes first"
        );
        assert_eq!(
            c.verdict(i64::MAX, Some(i64::MIN), false, None),
            Some(StartVerdict::Ahead {
                server_ms: i64::MIN
            })
        );
        assert_eq!(c.verdict(5, None, true, None), Some(StartVerdict::Marked));
        assert_eq!(
            c.verdict(5, None, false, Some(5)),
            Some(StartVerdict::Covered { last: 5 })
        );
        assert_eq!(c.verdict(5, None, false, Some(4)), None, "an older tick");
        assert_eq!(
            c.verdict(5, None, false, Some(1_005)),
            None,
            "later, within the tolerance"
        );
        assert_eq!(
            c.verdict(5, None, false, Some(1_006)),
            Some(StartVerdict::Covered { last: 1_006 })
        );
        let late = StartCheck { late: true, ..c };
        assert_eq!(
            late.verdict(5, None, false, Some(6)),
            Some(StartVerdict::Covered { last: 6 })
        );
        assert_eq!(
            late.verdict(i64::MIN, None, false, Some(i64::MAX)),
            Some(StartVerdict::Covered { last: i64::MAX })
        );
    }
}
