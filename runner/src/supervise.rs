//! Runs a process group for as long as its lock is held, and no longer.
//!
//! The group is stopped when the lease ends (stolen, expired, max hold), when
//! the lease's local deadline comes within the kill grace without a renewal
//! (the backend is failing: the loss would otherwise be reported only at the
//! deadline, too late for a grace period), or when the caller cancels. The
//! SIGKILL always lands before the local validity deadline, less a margin,
//! so nothing of the command runs once another holder may have the lock.

use std::time::Duration;

use distlock::{CancellationToken, LeaseHandle, LossReason};
use rustix::process::{Signal, WaitStatus};
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::group::{Group, KILL_WAIT};

/// How the group is stopped: SIGTERM, then SIGKILL after `grace`, and in any
/// case `margin` before the lease's local deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KillTiming {
    pub(crate) grace: Duration,
    pub(crate) margin: Duration,
    /// How often the deadline is re-read while all is well (the renewal
    /// interval: it moves only when a renewal succeeds).
    pub(crate) recheck: Duration,
}

impl KillTiming {
    /// The timing for a lease of `ttl`: the margin is a twentieth of it, and
    /// `grace` (default a quarter, at most 10 s) must leave room for a
    /// renewal to fail once without stopping the command.
    pub(crate) fn for_ttl(ttl: Duration, grace: Option<Duration>) -> Result<Self, String> {
        let margin = ttl / 20;
        let grace = grace.unwrap_or_else(|| (ttl / 4).min(Duration::from_secs(10)));
        if grace > ttl / 2 {
            return Err(format!(
                "--kill-grace {grace:?} is more than half the TTL ({ttl:?}): the command would be \
                 stopped after a single late renewal; lengthen --ttl or shorten --kill-grace"
            ));
        }
        Ok(Self {
            grace,
            margin,
            recheck: (ttl / 3).max(Duration::from_millis(10)),
        })
    }

    /// Stop the group once the local deadline is this close.
    fn threshold(&self) -> Duration {
        self.grace + self.margin
    }
}

/// Why the group stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The command exited by itself.
    Exited,
    /// The lease ended.
    Lost(LossReason),
    /// No renewal succeeded and the local deadline came within the grace.
    Expiring,
    /// The maximum hold time came within the grace: SIGTERM now, SIGKILL
    /// when the hold ends.
    MaxHold,
    /// The caller asked (shutdown, or the scheduler aborted the run).
    Cancelled,
}

/// How a supervised run ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    /// The leader's status; `None` if it could not be collected.
    pub(crate) status: Option<WaitStatus>,
    pub(crate) cause: Cause,
    /// Whether the whole group was seen gone.
    pub(crate) emptied: bool,
}

/// SIGINT, SIGTERM and SIGHUP sent to the runner, to forward to the group.
#[derive(Debug)]
pub(crate) struct Forwarded {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Forwarded {
    /// Starts catching the three signals (they no longer end the runner).
    pub(crate) fn catch() -> std::io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// The next signal caught. Cancel safe.
    pub(crate) async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::INT,
            _ = self.term.recv() => Signal::TERM,
            _ = self.hup.recv() => Signal::HUP,
        }
    }
}

/// What woke the supervisor.
enum Event {
    Exited(Option<WaitStatus>),
    Lost(LossReason),
    Cancelled,
    Signal(Signal),
    Recheck,
}

/// Supervises `group` under `lease` until the group is gone.
///
/// `max_hold_at` is when the run's maximum hold ends, if it has one: the
/// group gets SIGTERM the kill grace before it and SIGKILL at it.
/// Signals from `forward` are passed on to the group, which is then waited
/// for as usual. `cancel` stops the group as a loss does (SIGTERM, then
/// SIGKILL after the grace); `hard` sends SIGKILL at once, at any point.
pub(crate) async fn supervise(
    mut group: Group,
    lease: &LeaseHandle,
    timing: KillTiming,
    max_hold_at: Option<Instant>,
    mut forward: Option<&mut Forwarded>,
    cancel: &CancellationToken,
    hard: &CancellationToken,
) -> Ended {
    // Where the local deadline was last seen; it only moves forward, so a
    // stale value errs early.
    let mut deadline: Option<Instant> = None;
    // The maximum hold is the runner's own, not the lease's: the lease
    // would end (and the lock be let go) at its max hold whatever the
    // group's state, so the group is stopped by then and the lock released
    // only once the group is gone, as after any other stop.
    let term_for_hold = max_hold_at.map(|at| at.checked_sub(timing.grace).unwrap_or(at));
    let cause = loop {
        let now = Instant::now();
        if let Some(reason) = lease.loss_reason() {
            break Cause::Lost(reason);
        }
        if term_for_hold.is_some_and(|at| at <= now) {
            break Cause::MaxHold;
        }
        let wake = match lease.remaining_validity() {
            Some(left) => {
                deadline = Some(now + left);
                if left <= timing.threshold() {
                    break Cause::Expiring;
                }
                now + (left - timing.threshold()).min(timing.recheck)
            }
            None => now + timing.recheck,
        };
        let wake = term_for_hold.map_or(wake, |at| wake.min(at));
        let signal = async {
            match forward.as_deref_mut() {
                Some(f) => f.recv().await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            biased;
            status = group.leader_exit() => Event::Exited(status),
            reason = lease.lost() => Event::Lost(reason),
            _ = hard.cancelled() => Event::Cancelled,
            _ = cancel.cancelled() => Event::Cancelled,
            sig = signal => Event::Signal(sig),
            _ = tokio::time::sleep_until(wake) => Event::Recheck,
        };
        match event {
            Event::Exited(status) => {
                return finish_exited(group, status, deadline, timing, hard).await
            }
            Event::Lost(reason) => break Cause::Lost(reason),
            Event::Cancelled => break Cause::Cancelled,
            Event::Signal(sig) => {
                info!(
                    pgid = group.id(),
                    signal = sig.as_raw(),
                    "forwarding the signal to the command's process group"
                );
                group.signal(sig);
            }
            Event::Recheck => {}
        }
    };
    let now = Instant::now();
    let kill_at = if hard.is_cancelled() {
        now
    } else {
        let at = kill_instant(now, deadline, timing);
        match (cause, max_hold_at) {
            (Cause::MaxHold, Some(hold)) => at.min(hold).max(now),
            _ => at,
        }
    };
    match cause {
        Cause::Lost(reason) if reason.is_loss() => warn!(
            pgid = group.id(), %reason, kill_in_ms = ms(kill_at - now),
            "lock lost; stopping the command's process group"
        ),
        Cause::Expiring => warn!(
            pgid = group.id(), kill_in_ms = ms(kill_at - now),
            "no renewal succeeded and the lock's local deadline is near; stopping the command's process group"
        ),
        Cause::MaxHold => warn!(
            pgid = group.id(), kill_in_ms = ms(kill_at - now),
            "maximum hold time reached; stopping the command's process group"
        ),
        _ => info!(pgid = group.id(), kill_in_ms = ms(kill_at - now), "stopping the command's process group"),
    }
    let emptied = group.terminate(kill_at, hard).await;
    let status = tokio::time::timeout(KILL_WAIT, group.leader_exit())
        .await
        .ok()
        .flatten();
    if emptied {
        info!(
            pgid = group.id(),
            stopped_in_ms = ms(now.elapsed()),
            "the command's process group is gone"
        );
    } else {
        warn!(
            pgid = group.id(),
            "processes of the command survived SIGKILL (stuck in the kernel?)"
        );
    }
    Ended {
        status,
        cause,
        emptied,
    }
}

/// The command exited: whatever it left in its group is stopped as on a loss.
async fn finish_exited(
    mut group: Group,
    status: Option<WaitStatus>,
    deadline: Option<Instant>,
    timing: KillTiming,
    hard: &CancellationToken,
) -> Ended {
    let emptied = if group.wait_empty(Instant::now()).await {
        true
    } else {
        let now = Instant::now();
        warn!(
            pgid = group.id(),
            "the command exited and left processes in its group; stopping them"
        );
        group
            .terminate(kill_instant(now, deadline, timing), hard)
            .await
    };
    Ended {
        status,
        cause: Cause::Exited,
        emptied,
    }
}

/// SIGKILL after the grace, but `margin` before the deadline, never in the past.
fn kill_instant(now: Instant, deadline: Option<Instant>, timing: KillTiming) -> Instant {
    let by_grace = now + timing.grace;
    let by_deadline = deadline
        .and_then(|d| d.checked_sub(timing.margin))
        .unwrap_or(by_grace);
    by_grace.min(by_deadline).max(now)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_bounded_by_the_ttl_and_kills_land_before_the_deadline() {
        let t = KillTiming::for_ttl(Duration::from_secs(3), None).expect("default grace");
        assert_eq!(t.grace, Duration::from_millis(750));
        assert_eq!(t.margin, Duration::from_millis(150));
        assert!(KillTiming::for_ttl(Duration::from_secs(3), Some(Duration::from_secs(2))).is_err());
        let long = KillTiming::for_ttl(Duration::from_secs(3600), None).expect("capped");
        assert_eq!(long.grace, Duration::from_secs(10));

        let now = Instant::now();
        let near = Some(now + Duration::from_millis(400));
        assert_eq!(kill_instant(now, near, t), now + Duration::from_millis(250));
        assert_eq!(kill_instant(now, None, t), now + t.grace);
        let past = Some(now);
        assert_eq!(kill_instant(now, past, t), now);
    }
}
