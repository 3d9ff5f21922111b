//! Every interleaving of the lease cell's operations, checked with loom.
//!
//! The cell (`src/lease/cell.rs`) is the one place a lease's deadlines and
//! its end live; handles, the guard, the heartbeat and the loss feed all go
//! through it. This test compiles that file against loom's `Mutex` and runs
//! small models of the races that once broke the lease contract: a release
//! against a renewal reply, a loss against a release, a retained hold against
//! a late renewal reply, the watchdog against a release. Each asserts:
//! a lease ends exactly once; nobody sees it held after it ended; its
//! validity deadline never moves back through a renewal.

// The cell names its lock, clock and reasons through its parent module.
#[allow(dead_code)]
#[path = "../src/lease/cell.rs"]
mod cell;

use std::time::Duration;

use cell::{LeaseCell, Validity};
use lock_core::LossReason;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use tokio::time::Instant;

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

/// Counts the calls that ended the lease; exactly one may.
#[derive(Default)]
struct Enders(AtomicUsize);

impl Enders {
    fn note(&self, v: Validity) -> Validity {
        if matches!(v, Validity::Ended { now: true, .. }) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        v
    }

    fn note_end(&self, ended: bool) {
        if ended {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// `finish` ends a valid lease as released and says `Valid`: an ending too.
fn note_finish(enders: &Enders, v: Validity) -> Validity {
    if v == Validity::Valid {
        enders.0.fetch_add(1, Ordering::SeqCst);
    }
    enders.note(v)
}

#[test]
fn release_races_a_renewal_reply_and_a_reader() {
    loom::model(|| {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 10)), None));
        let enders = Arc::new(Enders::default());
        let release = {
            let (cell, enders) = (Arc::clone(&cell), Arc::clone(&enders));
            thread::spawn(move || note_finish(&enders, cell.finish(at(base, 5))))
        };
        let renewal = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || cell.extend(at(base, 20)))
        };
        let seen = enders.note(cell.check(at(base, 6)));
        let released = release.join().expect("release thread");
        renewal.join().expect("renewal thread");
        assert_eq!(
            released,
            Validity::Valid,
            "a valid lease must release cleanly"
        );
        // Once release returned, no reader may see the lease held, even at an
        // instant inside a deadline a late renewal reply could have moved.
        assert_eq!(
            cell.check(at(base, 7)),
            Validity::Ended {
                reason: LossReason::Released,
                now: false
            }
        );
        // The reader may have run before the release; if after, it saw it.
        if seen != Validity::Valid {
            assert!(matches!(
                seen,
                Validity::Ended {
                    reason: LossReason::Released,
                    ..
                }
            ));
        }
        assert_eq!(enders.count(), 1, "the lease must end exactly once");
        assert_eq!(cell.ended(), Some(LossReason::Released));
    });
}

#[test]
fn a_pushed_loss_races_a_release() {
    loom::model(|| {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 10)), None));
        let enders = Arc::new(Enders::default());
        let loss = {
            let (cell, enders) = (Arc::clone(&cell), Arc::clone(&enders));
            thread::spawn(move || enders.note_end(cell.end(LossReason::Stolen)))
        };
        let released = note_finish(&enders, cell.finish(at(base, 5)));
        loss.join().expect("loss thread");
        assert_eq!(enders.count(), 1, "the lease must end exactly once");
        match cell.ended() {
            Some(LossReason::Released) => assert_eq!(released, Validity::Valid),
            Some(LossReason::Stolen) => assert_eq!(
                released,
                Validity::Ended {
                    reason: LossReason::Stolen,
                    now: false
                }
            ),
            other => panic!("unexpected end {other:?}"),
        }
    });
}

#[test]
fn renewal_replies_never_move_the_deadline_back() {
    loom::model(|| {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 10)), None));
        let late = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || cell.extend(at(base, 12)))
        };
        let early = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || cell.extend(at(base, 15)))
        };
        let before = cell.valid_until();
        late.join().expect("thread");
        early.join().expect("thread");
        let after = cell.valid_until();
        assert!(after >= before, "the deadline moved back");
        assert_eq!(after, Some(at(base, 15)));
    });
}

#[test]
fn a_late_renewal_reply_cannot_extend_a_retained_hold() {
    loom::model(|| {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 10)), Some(at(base, 50))));
        let renewal = {
            let cell = Arc::clone(&cell);
            thread::spawn(move || cell.extend(at(base, 30)))
        };
        assert!(cell.retain_until(at(base, 8)));
        renewal.join().expect("thread");
        assert_eq!(cell.valid_until(), Some(at(base, 8)));
        assert_eq!(cell.check(at(base, 7)), Validity::Valid);
        assert_eq!(
            cell.check(at(base, 8)),
            Validity::Ended {
                reason: LossReason::Released,
                now: true
            }
        );
    });
}

#[test]
fn the_watchdog_races_a_release_past_max_hold() {
    loom::model(|| {
        let base = Instant::now();
        // Renewed far ahead, but max_hold is at 5.
        let cell = Arc::new(LeaseCell::new(Some(at(base, 30)), Some(at(base, 5))));
        let enders = Arc::new(Enders::default());
        let watchdog = {
            let (cell, enders) = (Arc::clone(&cell), Arc::clone(&enders));
            thread::spawn(move || enders.note(cell.check(at(base, 6))))
        };
        let released = note_finish(&enders, cell.finish(at(base, 6)));
        let fired = watchdog.join().expect("thread");
        assert_eq!(enders.count(), 1, "the lease must end exactly once");
        for v in [released, fired] {
            assert!(
                matches!(
                    v,
                    Validity::Ended {
                        reason: LossReason::MaxHoldExceeded,
                        ..
                    }
                ),
                "past max_hold nobody may see the lease valid: {v:?}"
            );
        }
    });
}

#[test]
fn no_renewal_starts_after_a_retained_hold_stopped_them() {
    loom::model(|| {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 10)), None));
        let started = Arc::new(AtomicUsize::new(0));
        let heartbeat = {
            let (cell, started) = (Arc::clone(&cell), Arc::clone(&started));
            thread::spawn(move || {
                if cell.begin_renewal() {
                    started.fetch_add(1, Ordering::SeqCst);
                    cell.end_renewal();
                }
            })
        };
        let in_flight = cell.stop_renewals();
        let started_before = started.load(Ordering::SeqCst);
        if !in_flight {
            // Nothing was in flight when renewals stopped: the one renewal
            // either finished before, or never starts.
            heartbeat.join().expect("thread");
            assert_eq!(started.load(Ordering::SeqCst), started_before);
        } else {
            heartbeat.join().expect("thread");
            assert!(!cell.renewal_in_flight());
        }
        assert!(!cell.begin_renewal(), "a renewal started after the stop");
    });
}
