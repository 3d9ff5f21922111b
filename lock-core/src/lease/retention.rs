//! The ends of retained holds ([`LockGuard::retain_for`](super::LockGuard::retain_for)):
//! one task per `Locker` keeps every retained lease in a deadline heap and
//! ends each when its hold is over.
//!
//! A scheduler retains the lock of every tick it runs, so a task and a timer
//! per retained lease made a thousand jobs a second keep thousands of tasks
//! alive, each spawned, timed and freed once.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::future::Future;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::LeaseState;
use crate::Expiry;

/// A retained lease and the end of its hold.
pub(crate) struct Retained {
    pub(crate) until: Instant,
    pub(crate) state: Arc<LeaseState>,
}

// Ordered by the end of the hold, earliest greatest: `BinaryHeap` pops it
// first.
impl PartialEq for Retained {
    fn eq(&self, other: &Self) -> bool {
        self.until == other.until
    }
}

impl Eq for Retained {}

impl PartialOrd for Retained {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Retained {
    fn cmp(&self, other: &Self) -> Ordering {
        other.until.cmp(&self.until)
    }
}

/// Ends every lease `rx` hands over when its hold is over: a session
/// backend releases it then; a TTL backend's server forgets it by itself.
///
/// When `closing` is cancelled (the `Locker` shuts down) every hold ends
/// early: a session backend's lock would go with the process anyway, so it
/// is released now; a TTL backend's server keeps the mark until the hold is
/// over, as intended. Returns once closing has ended every hold, or once
/// every sender is gone and no hold is left.
pub(crate) async fn run(mut rx: UnboundedReceiver<Retained>, closing: CancellationToken) {
    let mut held: BinaryHeap<Retained> = BinaryHeap::new();
    let mut releases = FuturesUnordered::new();
    let closed = closing.cancelled();
    tokio::pin!(closed);
    let nap = sleep_until(Instant::now());
    tokio::pin!(nap);
    let mut armed: Option<Instant> = None;
    let mut senders_gone = false;
    loop {
        let earliest = held.peek().map(|r| r.until);
        if earliest != armed {
            if let Some(at) = earliest {
                nap.as_mut().reset(at);
            }
            armed = earliest;
        }
        tokio::select! {
            biased;
            () = &mut closed => {
                rx.close();
                while let Ok(r) = rx.try_recv() {
                    held.push(r);
                }
                for Retained { state, .. } in held.drain() {
                    let _ = state.finish(Instant::now());
                    releases.extend(end_session(state));
                }
                break;
            }
            got = rx.recv(), if !senders_gone => match got {
                Some(r) => held.push(r),
                None => senders_gone = true,
            },
            Some(()) = releases.next(), if !releases.is_empty() => {}
            () = &mut nap, if armed.is_some() => {
                let now = Instant::now();
                while held.peek().is_some_and(|r| r.until <= now) {
                    if let Some(Retained { state, .. }) = held.pop() {
                        let _ = state.check_valid(now);
                        releases.extend(end_session(state));
                    }
                }
                armed = None;
            }
        }
        if senders_gone && held.is_empty() && releases.is_empty() {
            return;
        }
    }
    while releases.next().await.is_some() {}
}

/// The release of a session backend's retained lock, if it has one to send.
fn end_session(state: Arc<LeaseState>) -> Option<impl Future<Output = ()>> {
    let session = state
        .backend
        .as_ref()
        .is_some_and(|b| b.capabilities().expiry == Expiry::Session);
    session.then_some(async move {
        let Some(backend) = &state.backend else {
            return;
        };
        if let Err(e) = (**backend).release(&state.name, &state.owner).await {
            warn!(lock = %state.name, error = %e, "releasing a retained lock failed; it ends with its session");
        }
    })
}
