//! The host's monotonic clock as plain nanoseconds, comparable across
//! processes on one host (I1): `std::time::Instant` reads the same clock but
//! cannot be sent to another process.

use rustix::time::{clock_gettime, ClockId};

/// Nanoseconds of `CLOCK_MONOTONIC` now. libfaketime leaves this clock alone
/// when started with `FAKETIME_DONT_FAKE_MONOTONIC=1`, which is how the clock
/// cases step a holder's wall clock without touching its timers.
pub fn now_ns() -> u64 {
    let t = clock_gettime(ClockId::Monotonic);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}
