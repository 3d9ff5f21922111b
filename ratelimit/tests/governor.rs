//! A second opinion: governor's GCRA on its fake clock admits exactly the
//! requests `gcra::decide` admits, for any arrival pattern and costs.

use std::num::NonZeroU32;
use std::time::Duration;

use distlock_ratelimit::gcra::{decide, Cell};
use governor::clock::FakeRelativeClock;
use governor::{Quota as GovernorQuota, RateLimiter};
use proptest::prelude::*;

proptest! {
    #[test]
    fn decide_agrees_with_governor(
        interval in 1u64..5_000,
        burst in 1u32..20,
        steps in prop::collection::vec((0u64..10_000, 1u32..20), 1..300),
    ) {
        let clock = FakeRelativeClock::default();
        let quota = GovernorQuota::with_period(Duration::from_micros(interval))
            .ok_or_else(|| TestCaseError::fail("period"))?
            .allow_burst(NonZeroU32::new(burst).ok_or_else(|| TestCaseError::fail("burst"))?);
        let governor = RateLimiter::direct_with_clock(quota, clock.clone());
        let cell = Cell { interval, capacity: interval * u64::from(burst) };
        let mut tat = None;
        let mut now = 0;
        for (gap, cost) in steps {
            now += gap;
            clock.advance(Duration::from_micros(gap));
            let cost = cost.min(burst);
            let n = NonZeroU32::new(cost).ok_or_else(|| TestCaseError::fail("cost"))?;
            let theirs = matches!(governor.check_n(n), Ok(Ok(_)));
            let ours = decide(now, &[tat], &[cell], u64::from(cost));
            prop_assert_eq!(ours.allowed, theirs, "at {} µs, cost {}", now, cost);
            if let Some(t) = ours.new_tats {
                tat = Some(t[0]);
            }
        }
    }
}
