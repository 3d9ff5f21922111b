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
//!
//! The retained-hold models add the server's side of the lock and drive the
//! cell as `retain_for`, `LeaseHandle::renew`, a pushed loss and the
//! shutdown of retained holds do; they assert that a lease ends released
//! (the server holding nothing), retained until its hold's end (the server
//! keeping it at least that long) or lost, and check that the two bugs they
//! were written for are found.

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

/// The server's side of one lock in the retained-hold models: until when
/// it keeps the lock for this owner (`None`: it does not hold it).
struct Server(Mutex<Option<u64>>);

impl Server {
    fn new(until: u64) -> Self {
        Self(Mutex::new(Some(until)))
    }

    /// A renewal: moves the expiry to `until` if the lock is still ours.
    fn renew(&self, until: u64) -> bool {
        let mut held = self.0.lock().expect("server");
        if held.is_some() {
            *held = Some(until);
        }
        held.is_some()
    }

    fn release(&self) {
        *self.0.lock().expect("server") = None;
    }

    fn until(&self) -> Option<u64> {
        *self.0.lock().expect("server")
    }
}

/// The lease's TTL as a renewal sent at 0 sets it, the retained hold's end
/// on the server, and where a handle stops saying held (less the drift).
const RENEWED_UNTIL: u64 = 30;
const HOLD_UNTIL: u64 = 80;
const KEEP_UNTIL: u64 = 75;
const NOW: u64 = 5;

/// How `LockGuard::retain_for` drives the cell and the server, as
/// `src/lease/guard.rs` does: stop renewals, wait for the ones in flight,
/// set the hold; a hold the server fails to set releases the lock when
/// `release_on_failure` (the fix), or only finishes the lease (the bug).
fn retain(cell: &LeaseCell, server: &Server, base: Instant, fails: bool, release_on_failure: bool) {
    cell.stop_renewals();
    while cell.renewal_in_flight() {
        thread::yield_now();
    }
    if cell.check(at(base, NOW)) != Validity::Valid {
        return;
    }
    if fails {
        let _ = cell.finish(at(base, NOW));
        if release_on_failure {
            server.release();
        }
        return;
    }
    if !server.renew(HOLD_UNTIL) {
        cell.end(LossReason::Expired);
    } else {
        // False when a loss arrived meanwhile: the lease ended as that.
        let _ = cell.retain_until(at(base, KEEP_UNTIL));
    }
}

/// `LeaseHandle::renew` on a clone: registered as a renewal in flight
/// (the fix), or sent regardless (the bug).
fn manual_renew(cell: &LeaseCell, server: &Server, base: Instant, registered: bool) {
    if registered {
        if !cell.begin_renewal() {
            return;
        }
        if server.renew(RENEWED_UNTIL) {
            cell.extend(at(base, RENEWED_UNTIL - 5));
        }
        cell.end_renewal();
    } else if server.renew(RENEWED_UNTIL) {
        cell.extend(at(base, RENEWED_UNTIL - 5));
    }
}

/// After every thread is done: a lease ends released (and the server then
/// holds nothing), retained until its hold's end (and the server keeps it
/// at least that long), or lost; never none of them, and no handle says
/// held while the server may have freed the lock.
fn assert_settled(cell: &LeaseCell, server: &Server, base: Instant) {
    match cell.ended() {
        None => {
            assert_eq!(
                cell.valid_until(),
                Some(at(base, KEEP_UNTIL)),
                "the lease neither ended nor was retained"
            );
            let until = server
                .until()
                .expect("the server freed a lock a handle says is held");
            assert!(
                until >= KEEP_UNTIL,
                "the server keeps the lock until {until}, the handles say held until {KEEP_UNTIL}"
            );
        }
        Some(LossReason::Released) => {
            assert_eq!(server.until(), None, "a released lease left the lock held")
        }
        Some(_) => {}
    }
}

/// One retained-hold model: `retain_for` against a clone's manual renewal
/// and, with `loss`, a loss pushed by the backend (the server forgets the
/// lock, then tells the core). `fixed` runs the code as it is; false runs
/// the two bugs it fixed, which the checker must find.
///
/// With `shutdown`, the `Locker` shuts down once the hold is set: its
/// retention task ends the lease and, as on a session backend, releases it.
fn retained_hold_model(fails: bool, loss: bool, shutdown: bool, fixed: bool) {
    let mut checker = loom::model::Builder::new();
    // The wait for renewals in flight spins; three preemptions cover every
    // order of the three actors' steps that matters here.
    checker.preemption_bound = Some(3);
    checker.check(move || {
        let base = Instant::now();
        let cell = Arc::new(LeaseCell::new(Some(at(base, 25)), None));
        let server = Arc::new(Server::new(RENEWED_UNTIL));
        let renewal = {
            let (cell, server) = (Arc::clone(&cell), Arc::clone(&server));
            thread::spawn(move || manual_renew(&cell, &server, base, fixed))
        };
        let lost = loss.then(|| {
            let (cell, server) = (Arc::clone(&cell), Arc::clone(&server));
            thread::spawn(move || {
                server.release();
                cell.end(LossReason::Stolen);
            })
        });
        retain(&cell, &server, base, fails, fixed);
        if shutdown && cell.ended().is_none() && cell.finish(at(base, NOW)) == Validity::Valid {
            server.release();
        }
        renewal.join().expect("renewal thread");
        if let Some(lost) = lost {
            lost.join().expect("loss thread");
        }
        assert_settled(&cell, &server, base);
    });
}

#[test]
fn a_retained_hold_races_a_manual_renewal() {
    retained_hold_model(false, false, false, true);
}

#[test]
fn a_retained_hold_races_a_manual_renewal_and_a_loss() {
    retained_hold_model(false, true, false, true);
}

#[test]
fn a_retained_hold_ended_by_shutdown_races_a_renewal_and_a_loss() {
    retained_hold_model(false, false, true, true);
    retained_hold_model(false, true, true, true);
}

#[test]
fn a_failed_hold_races_a_manual_renewal_and_a_loss() {
    retained_hold_model(true, false, false, true);
    retained_hold_model(true, true, false, true);
}

/// The checker finds the bug of a manual renewal that did not register as
/// in flight: its late reply cut the hold short under a held handle.
#[test]
#[should_panic(expected = "the handles say held")]
fn the_model_catches_an_unregistered_manual_renewal() {
    retained_hold_model(false, false, false, false);
}

/// And the bug of a failed hold that only finished the lease: released
/// locally, held on the server.
#[test]
#[should_panic(expected = "left the lock held")]
fn the_model_catches_a_failed_hold_left_on_the_server() {
    retained_hold_model(true, false, false, false);
}
