//! The record of one scheduled tick's run, and the transitions a
//! [`TickStore`](crate::TickStore) applies to it: absent →
//! [`TickRecord::Started`] → [`TickRecord::Completed`] or
//! [`TickRecord::Abandoned`], each one server-side step conditional on the
//! fencing token of the tick's lock.
//!
//! The protocol is modelled and checked in `scheduler/model/ticks.pml`; a
//! change here changes the model too.

use std::fmt;

/// Where one tick's run stands in the tick store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickRecord {
    /// A replica holding the tick's lock with `token` is running it (or
    /// was, if it died: its lock then expires and the record stays).
    Started {
        /// The fencing token of the lock the run holds.
        token: u64,
        /// Who runs it: a scheduler instance's id, for people reading it.
        replica: String,
        /// When the run started, Unix ms, on the runner's clock.
        at: i64,
    },
    /// The run holding `token` finished (its handler returned, whatever it
    /// returned).
    Completed {
        /// The token of the run that completed.
        token: u64,
    },
    /// A run was started but its lock expired before it completed, and the
    /// replica holding the lock with `token` marked the tick abandoned
    /// instead of running it again (at most once). The first run may or may
    /// not have done its work.
    Abandoned {
        /// The token of the replica that marked it.
        token: u64,
    },
}

impl TickRecord {
    /// The token the record was last written under.
    pub fn token(&self) -> u64 {
        match self {
            Self::Started { token, .. } | Self::Completed { token } | Self::Abandoned { token } => {
                *token
            }
        }
    }
}

/// What to do with a [`TickRecord::Started`] record of a lower token than
/// one's own: its runner's lock has expired (this replica holds the lock
/// now, with a higher token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnStale {
    /// Leave it: the start is refused.
    Refuse,
    /// Mark the tick [`TickRecord::Abandoned`] (at most once).
    Abandon,
    /// Take it over: `Started` with this token, and run it again (at least
    /// once).
    TakeOver,
}

/// One write to a tick's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickWrite {
    /// absent → `Started { token, replica, at }`; onto a `Started` record
    /// with a lower token, what `on_stale` says; anything else is refused.
    /// The same write sent again (a retry after a lost reply) finds its own
    /// record and answers as the first did.
    Start {
        /// The fencing token of the tick's lock, as this replica holds it.
        token: u64,
        /// Who runs it (see [`TickRecord::Started`]).
        replica: String,
        /// Now, Unix ms.
        at: i64,
        /// What to do with a stale `Started` record.
        on_stale: OnStale,
    },
    /// `Started { token, .. }` → `Completed { token }`, and in the same step
    /// what [`TickStore::record_completed`](crate::TickStore::record_completed)
    /// does for the tick (the latest completed tick and the tick's mark).
    /// Refused (fenced out) on any other record, except `Completed` with
    /// this token (a retry).
    Complete {
        /// The token the run holds.
        token: u64,
    },
}

/// A store's answer to a [`TickWrite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickAnswer {
    /// This write's `Started` record is in place: run the handler.
    Started,
    /// A stale `Started` record was marked `Abandoned` by this write.
    Abandoned,
    /// This write's `Completed` record is in place.
    Completed,
    /// Refused; the record as it stands (`None`: there is none).
    Refused(Option<TickRecord>),
}

impl TickWrite {
    /// The record this write leaves when it applies to `current`, or `None`
    /// when it is refused or changes nothing (a retry). Every store applies
    /// these rules in one server-side step; this is their reference.
    pub fn apply(&self, current: Option<&TickRecord>) -> Option<TickRecord> {
        match (self, current) {
            (
                Self::Start {
                    token, replica, at, ..
                },
                None,
            ) => Some(TickRecord::Started {
                token: *token,
                replica: replica.clone(),
                at: *at,
            }),
            (
                Self::Start {
                    token,
                    replica,
                    at,
                    on_stale,
                },
                Some(TickRecord::Started { token: held, .. }),
            ) if held < token => match on_stale {
                OnStale::Refuse => None,
                OnStale::Abandon => Some(TickRecord::Abandoned { token: *token }),
                OnStale::TakeOver => Some(TickRecord::Started {
                    token: *token,
                    replica: replica.clone(),
                    at: *at,
                }),
            },
            (Self::Complete { token }, Some(TickRecord::Started { token: held, .. }))
                if held == token =>
            {
                Some(TickRecord::Completed { token: *token })
            }
            _ => None,
        }
    }

    /// The answer to this write, given the record as it stands after the
    /// store's step (`after`): the write won if the record is the one it
    /// leaves, whether this step or an earlier try of the same write put it
    /// there (tokens are unique per acquisition, and the replica tells
    /// apart runs of one replica where there are no tokens).
    pub fn answer(&self, after: Option<TickRecord>) -> TickAnswer {
        match (self, &after) {
            (
                Self::Start { token, replica, .. },
                Some(TickRecord::Started {
                    token: t,
                    replica: r,
                    ..
                }),
            ) if t == token && r == replica => TickAnswer::Started,
            (
                Self::Start {
                    token,
                    on_stale: OnStale::Abandon,
                    ..
                },
                Some(TickRecord::Abandoned { token: t }),
            ) if t == token => TickAnswer::Abandoned,
            (Self::Complete { token }, Some(TickRecord::Completed { token: t })) if t == token => {
                TickAnswer::Completed
            }
            _ => TickAnswer::Refused(after),
        }
    }
}

impl fmt::Display for TickRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Started { token, replica, at } => {
                write!(f, "Started{{token {token}, replica {replica}, at {at}}}")
            }
            Self::Completed { token } => write!(f, "Completed{{token {token}}}"),
            Self::Abandoned { token } => write!(f, "Abandoned{{token {token}}}"),
        }
    }
}

/// The compact text form stores keep a record in: `S:<token>:<at>:<replica>`,
/// `C:<token>`, `A:<token>` (the replica last: it may hold colons).
pub fn encode(record: &TickRecord) -> String {
    match record {
        TickRecord::Started { token, replica, at } => format!("S:{token}:{at}:{replica}"),
        TickRecord::Completed { token } => format!("C:{token}"),
        TickRecord::Abandoned { token } => format!("A:{token}"),
    }
}

/// Reads [`encode`]'s form back; `None` for anything else.
pub fn decode(text: &str) -> Option<TickRecord> {
    let (kind, rest) = text.split_once(':')?;
    match kind {
        "S" => {
            let (token, rest) = rest.split_once(':')?;
            let (at, replica) = rest.split_once(':')?;
            Some(TickRecord::Started {
                token: token.parse().ok()?,
                replica: replica.to_owned(),
                at: at.parse().ok()?,
            })
        }
        "C" => Some(TickRecord::Completed {
            token: rest.parse().ok()?,
        }),
        "A" => Some(TickRecord::Abandoned {
            token: rest.parse().ok()?,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(token: u64, replica: &str, on_stale: OnStale) -> TickWrite {
        TickWrite::Start {
            token,
            replica: replica.into(),
            at: 5,
            on_stale,
        }
    }

    #[test]
    fn transitions_follow_the_token() {
        let s2 = start(2, "a", OnStale::Abandon).apply(None);
        assert_eq!(
            s2,
            Some(TickRecord::Started {
                token: 2,
                replica: "a".into(),
                at: 5
            })
        );
        let rec = s2.as_ref();
        assert_eq!(
            start(1, "b", OnStale::TakeOver).apply(rec),
            None,
            "lower token"
        );
        assert_eq!(start(2, "a", OnStale::Abandon).apply(rec), None, "a retry");
        assert_eq!(
            start(2, "a", OnStale::Abandon).answer(s2.clone()),
            TickAnswer::Started
        );
        assert_eq!(
            start(2, "b", OnStale::Abandon).answer(s2.clone()),
            TickAnswer::Refused(s2.clone()),
            "same token, another replica (no fencing)"
        );
        assert_eq!(
            start(3, "b", OnStale::Abandon).apply(rec),
            Some(TickRecord::Abandoned { token: 3 })
        );
        assert_eq!(start(3, "b", OnStale::Refuse).apply(rec), None);
        let taken = start(3, "b", OnStale::TakeOver).apply(rec);
        assert_eq!(
            TickWrite::Complete { token: 2 }.apply(taken.as_ref()),
            None,
            "fenced out"
        );
        assert_eq!(
            TickWrite::Complete { token: 3 }.apply(taken.as_ref()),
            Some(TickRecord::Completed { token: 3 })
        );
        let done = Some(TickRecord::Completed { token: 3 });
        assert_eq!(
            TickWrite::Complete { token: 3 }.answer(done.clone()),
            TickAnswer::Completed
        );
        assert_eq!(start(4, "c", OnStale::TakeOver).apply(done.as_ref()), None);
    }

    #[test]
    fn text_form_round_trips() {
        for r in [
            TickRecord::Started {
                token: u64::MAX,
                replica: "host:1:x".into(),
                at: i64::MIN,
            },
            TickRecord::Completed { token: 0 },
            TickRecord::Abandoned { token: 7 },
        ] {
            assert_eq!(decode(&encode(&r)), Some(r));
        }
        for bad in ["", "S:1", "X:1", "C:x", "S:1:y:r"] {
            assert_eq!(decode(bad), None);
        }
    }
}
