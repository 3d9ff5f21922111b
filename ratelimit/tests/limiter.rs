//! The limiter on the memory store and a switchable store, under tokio's
//! paused clock: policies, the breaker, several limits, bad input.

use std::future::{ready, Future};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{MemoryStore, Store, StoreRequest, SwitchStore};
use distlock_ratelimit::{
    BreakerConfig, Error, Limit, Limiter, OnStoreError, Quota, RateLimitMetrics, Source,
    StoreErrorKind,
};
use prometheus::Registry;
use tokio::time::{timeout, Instant};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const CASE: Duration = Duration::from_secs(60);

fn metrics() -> RateLimitMetrics {
    RateLimitMetrics::register(&Registry::new()).expect("a fresh registry")
}

fn limit(name: &str, count: u64, period: Duration) -> Limit {
    Limit::new(name, Quota::new(count, period).expect("quota")).expect("limit")
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_by_one_limit_charges_none() -> TestResult {
    timeout(CASE, async {
        let limiter = Limiter::builder("login")
            .with_limit(limit("minute", 5, Duration::from_secs(60)))
            .with_limit(limit("day", 3, Duration::from_secs(86_400)))
            .with_metrics(metrics())
            .build()?;
        // Cost 3 takes all of "day" but only 3 of 5 of "minute".
        let d = limiter.check_cost("alice", 3).await?;
        assert!(d.allowed);
        assert_eq!(
            (d.remaining, limiter.limit_of(&d).map(|l| l.name())),
            (0, Some("day"))
        );
        // Refused by "day": "minute" must not be charged either.
        for _ in 0..10 {
            let d = limiter.check_cost("alice", 2).await?;
            assert!(!d.allowed);
            assert_eq!(limiter.limit_of(&d).map(|l| l.name()), Some("day"));
        }
        // "minute" still has 2 left (of 5, refilled by 1 in 8 h): the next
        // request is admitted as soon as "day" has one unit again.
        tokio::time::advance(Duration::from_secs(86_400 / 3)).await;
        let d = limiter.check("alice").await?;
        assert!(d.allowed, "day refilled one unit, minute had 2 left");
        assert_eq!(limiter.check("bob").await?.remaining, 2);
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .await?
}

#[tokio::test(start_paused = true)]
async fn refusals_do_not_charge_the_other_limit() -> TestResult {
    timeout(CASE, async {
        // Without all-or-none, each refused request below would take a unit
        // from "minute" and the final check would be refused.
        let limiter = Limiter::builder("api")
            .with_limit(limit("second", 1, Duration::from_secs(1)))
            .with_limit(limit("minute", 3, Duration::from_secs(60)))
            .with_metrics(metrics())
            .build()?;
        assert!(limiter.check("k").await?.allowed);
        for _ in 0..5 {
            assert!(!limiter.check("k").await?.allowed);
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(limiter.check("k").await?.allowed);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(limiter.check("k").await?.allowed);
        tokio::time::advance(Duration::from_secs(1)).await;
        let d = limiter.check("k").await?;
        assert!(!d.allowed, "minute's 3 are spent");
        assert_eq!(limiter.limit_of(&d).map(|l| l.name()), Some("minute"));
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .await?
}

#[tokio::test(start_paused = true)]
async fn refusals_carry_retry_and_reset_times() -> TestResult {
    let limiter = Limiter::builder("r")
        .with_limit(limit("s", 2, Duration::from_secs(10)))
        .with_metrics(metrics())
        .build()?;
    assert!(limiter.check("k").await?.allowed);
    let d = limiter.check("k").await?;
    assert!(d.allowed);
    assert_eq!(d.reset_after, Duration::from_secs(10));
    let d = limiter.check("k").await?;
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_secs(5));
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(limiter.check("k").await?.allowed);
    Ok(())
}

#[tokio::test]
async fn bad_input_is_a_typed_error_never_a_panic() -> TestResult {
    let limiter = Limiter::builder("bad")
        .with_limit(limit("s", 2, Duration::from_secs(1)))
        .with_metrics(metrics())
        .build()?;
    assert!(matches!(limiter.check("").await, Err(Error::EmptyKey)));
    let huge = "x".repeat(distlock_ratelimit::MAX_KEY_LEN + 1);
    assert!(matches!(
        limiter.check(&huge).await,
        Err(Error::KeyTooLong { .. })
    ));
    let err = limiter
        .check_cost("k", 3)
        .await
        .expect_err("cost above burst");
    assert!(matches!(
        err,
        Error::CostExceedsBurst {
            cost: 3,
            burst: 2,
            ..
        }
    ));
    assert!(limiter.check_cost("k", u64::MAX).await.is_err());
    // A key that looks like a secret never shows in errors or Debug.
    let secret = "Bearer sk_live_password=hunter2";
    let d = limiter.check(secret).await?;
    assert!(!format!("{d:?}").contains("hunter2"));
    let long_secret = format!("{secret}{}", "y".repeat(5000));
    let err = limiter.check(&long_secret).await.expect_err("too long");
    assert!(!err.to_string().contains("hunter2"));
    for build in [
        Limiter::builder("").with_limit(limit("s", 1, Duration::from_secs(1))),
        Limiter::builder("no-limits"),
        Limiter::builder("dup")
            .with_limit(limit("s", 1, Duration::from_secs(1)))
            .with_limit(limit("s", 2, Duration::from_secs(1))),
        Limiter::builder("p")
            .with_limit(limit("s", 1, Duration::from_secs(1)))
            .with_key_prefix("a{b}"),
        Limiter::builder("t")
            .with_limit(limit("s", 1, Duration::from_secs(1)))
            .with_store_timeout(Duration::ZERO),
        Limiter::builder("t")
            .with_limit(limit("s", 1, Duration::from_secs(1)))
            .with_store_timeout(Duration::MAX),
    ] {
        assert!(matches!(
            build.with_metrics(metrics()).build(),
            Err(Error::Config(_))
        ));
    }
    Ok(())
}

/// Sends `first` a million subjects (its argument 0 to 999 999) and checks
/// that `store`, bounded to 10 000 keys, never held more (read every
/// thousand and at the end); then, once every bucket has refilled so that
/// the next sweep drops them all, sends `again` 10 000 more and checks the
/// bound again.
async fn stays_bounded<A, B>(
    store: &MemoryStore,
    mut first: impl FnMut(u32) -> A,
    mut again: impl FnMut(u32) -> B,
) -> TestResult
where
    A: Future<Output = TestResult>,
    B: Future<Output = TestResult>,
{
    let mut max_len = 0;
    for i in 0..1_000_000u32 {
        first(i).await?;
        if i % 1000 == 0 {
            max_len = max_len.max(store.len());
        }
    }
    max_len = max_len.max(store.len());
    assert!(max_len <= 10_000, "held {max_len} keys");
    tokio::time::advance(Duration::from_secs(61)).await;
    for i in 0..10_000u32 {
        again(i).await?;
    }
    assert!(store.len() <= 10_000, "held {} keys", store.len());
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn memory_stays_bounded_with_a_million_keys() -> TestResult {
    timeout(CASE, async {
        let store = MemoryStore::with_max_keys(10_000);
        let cells = [Quota::per_minute(10)?.cell()];
        let decide = |key: String, subject: String| {
            store.decide_now(&StoreRequest {
                subject: &subject,
                keys: &[key],
                cells: &cells,
                cost: 1,
            })
        };
        stays_bounded(
            &store,
            |i| {
                assert!(decide(format!("k{i}"), format!("{i:x}")).allowed);
                ready(Ok(()))
            },
            |i| {
                let _ = decide(format!("again{i}"), format!("again{i:x}"));
                ready(Ok(()))
            },
        )
        .await
    })
    .await?
}

/// The same bound on the in-process path, where a limiter on the store
/// decides by bucket id (the subject's keyed hash) in the shards' id maps.
#[tokio::test(start_paused = true)]
async fn in_process_buckets_stay_bounded_with_a_million_keys() -> TestResult {
    timeout(CASE, async {
        let store = Arc::new(MemoryStore::with_max_keys(10_000));
        let limiter = Limiter::builder("million")
            .with_limit(limit("m", 10, Duration::from_secs(60)))
            .with_store(Arc::clone(&store) as Arc<dyn Store>)
            .with_metrics(metrics())
            .build()?;
        let limiter = &limiter;
        stays_bounded(
            &store,
            |i| async move {
                assert!(limiter.check(&format!("k{i}")).await?.allowed);
                Ok(())
            },
            // The sweep dropped every bucket, so the subjects seen before
            // start again from a full one.
            |i| async move {
                assert_eq!(limiter.check(&format!("k{i}")).await?.remaining, 9);
                Ok(())
            },
        )
        .await
    })
    .await?
}

fn switched(
    name: &str,
    policy: OnStoreError,
    m: &RateLimitMetrics,
) -> Result<(Limiter, SwitchStore), Error> {
    let store = SwitchStore::new(Arc::new(MemoryStore::new()));
    let limiter = Limiter::builder(name)
        .with_limit(limit("s", 10, Duration::from_secs(10)))
        .with_store(Arc::new(store.clone()) as Arc<dyn Store>)
        .with_on_store_error(policy)
        .with_store_timeout(Duration::from_millis(50))
        .with_breaker(BreakerConfig {
            failures: 3,
            open_for: Duration::from_secs(1),
        })
        .with_metrics(m.clone())
        .build()?;
    Ok((limiter, store))
}

#[tokio::test(start_paused = true)]
async fn deny_refuses_every_request_while_the_store_is_down() -> TestResult {
    let m = metrics();
    let (limiter, store) = switched("deny", OnStoreError::Deny, &m)?;
    store.refuse();
    for _ in 0..20 {
        match limiter.check("k").await {
            Err(Error::StoreUnavailable { retry_after, .. }) => {
                assert!(retry_after >= Duration::from_secs(1));
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(m.decisions("deny", "unavailable", Source::None), 20);
    assert_eq!(m.fallbacks("deny"), 0);
    // Three calls opened the breaker; the rest never reached the store.
    assert_eq!(m.store_errors("deny", StoreErrorKind::Connection), 3);
    assert!(m.breaker_open("deny"));
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_hung_store_costs_at_most_the_timeout_and_the_breaker_recovers() -> TestResult {
    timeout(CASE, async {
        let m = metrics();
        let (limiter, store) = switched("hang", OnStoreError::Deny, &m)?;
        store.hang();
        let mut slow = 0;
        for _ in 0..10 {
            let started = Instant::now();
            assert!(limiter.check("k").await.is_err());
            let took = started.elapsed();
            assert!(took <= Duration::from_millis(50), "took {took:?}");
            if took > Duration::ZERO {
                slow += 1;
            }
        }
        assert_eq!(slow, 3, "only the calls before the breaker opened waited");
        assert_eq!(m.store_errors("hang", StoreErrorKind::Timeout), 3);
        // Still down at the first probe: open again, no state-change noise.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(limiter.check("k").await.is_err());
        assert!(m.breaker_open("hang"));
        store.restore();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            limiter.check("k").await?.allowed,
            "the probe reaches the store"
        );
        assert!(!m.breaker_open("hang"));
        assert_eq!(limiter.check("k").await?.source, Source::Store);
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .await?
}

#[tokio::test(start_paused = true)]
async fn fallback_admits_at_most_its_share_and_counts_every_fallback() -> TestResult {
    let m = metrics();
    let replicas = NonZeroU32::new(4).ok_or("4")?;
    let (limiter, store) = switched("fb", OnStoreError::Fallback { replicas }, &m)?;
    store.refuse();
    let mut admitted = 0;
    for _ in 0..100 {
        let d = limiter.check("k").await?;
        assert_eq!(d.source, Source::Fallback);
        admitted += u64::from(d.allowed);
    }
    // 10 per 10 s over 4 replicas: a burst of 3 (rounded up), no refill in
    // paused time.
    assert_eq!(admitted, 3);
    let fallback_decisions = m.decisions("fb", "allowed", Source::Fallback)
        + m.decisions("fb", "limited", Source::Fallback);
    assert_eq!(fallback_decisions, 100);
    assert_eq!(m.fallbacks("fb"), fallback_decisions);
    // Over 10 s, one replica's share refills by 10 / 4 = 2.5 units: 2 whole.
    tokio::time::advance(Duration::from_secs(10)).await;
    let mut later = 0;
    for _ in 0..100 {
        later += u64::from(limiter.check("k").await?.allowed);
    }
    assert_eq!(later, 2);
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn allow_admits_unchecked_and_counts_fallbacks() -> TestResult {
    let m = metrics();
    let (limiter, store) = switched("allow", OnStoreError::Allow, &m)?;
    store.refuse();
    for _ in 0..50 {
        let d = limiter.check("k").await?;
        assert!(d.allowed);
        assert_eq!(d.source, Source::None);
    }
    assert_eq!(m.fallbacks("allow"), 50);
    assert_eq!(m.decisions("allow", "allowed", Source::None), 50);
    Ok(())
}

/// The scraped `rate_limit_decisions_total` of `limiter` with this outcome
/// label, over every source.
fn scraped_decisions(registry: &Registry, limiter: &str, outcome: &str) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == "rate_limit_decisions_total")
        .flat_map(|f| f.get_metric())
        .filter(|m| {
            let has = |name: &str, value: &str| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == name && l.value() == value)
            };
            has("limiter", limiter) && has("outcome", outcome)
        })
        .map(|m| m.get_counter().get_value())
        .sum()
}

/// Decisions made on several threads at once are counted on each thread
/// and summed when read: a scrape and `decisions` both see every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_made_on_several_threads_are_all_counted() -> TestResult {
    timeout(CASE, async {
        let registry = Registry::new();
        let m = RateLimitMetrics::register(&registry)?;
        // A unit refills every 86 s: the burst is all this case admits.
        let limiter = Limiter::builder("threads")
            .with_limit(limit("s", 1_000, Duration::from_secs(86_400)))
            .with_metrics(m.clone())
            .build()?;
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let limiter = limiter.clone();
                tokio::spawn(async move {
                    let mut allowed = 0u64;
                    for _ in 0..500 {
                        if limiter.check("k").await?.allowed {
                            allowed += 1;
                        }
                    }
                    Ok::<_, Error>(allowed)
                })
            })
            .collect();
        let mut allowed = 0;
        for t in tasks {
            allowed += t.await??;
        }
        assert_eq!(allowed, 1_000);
        assert_eq!(m.decisions("threads", "allowed", Source::Store), 1_000);
        assert_eq!(m.decisions("threads", "limited", Source::Store), 3_000);
        assert_eq!(scraped_decisions(&registry, "threads", "allowed"), 1_000.0);
        assert_eq!(scraped_decisions(&registry, "threads", "limited"), 3_000.0);
        // A second limiter of the name (on a store of its own) counts into
        // the same series.
        let again = Limiter::builder("threads")
            .with_limit(limit("s", 1_000, Duration::from_secs(86_400)))
            .with_metrics(m.clone())
            .build()?;
        assert!(again.check("k").await?.allowed);
        assert_eq!(scraped_decisions(&registry, "threads", "allowed"), 1_001.0);
        Ok::<_, Box<dyn std::error::Error>>(())
    })
    .await?
}

/// The samples of `rate_limit_store_duration_seconds` for `limiter`.
fn latency_samples(registry: &Registry, limiter: &str) -> u64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == "rate_limit_store_duration_seconds")
        .flat_map(|f| f.get_metric())
        .filter(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == "limiter" && l.value() == limiter)
        })
        .map(|m| m.get_histogram().get_sample_count())
        .sum()
}

/// Every way of getting an in-process store (the environment's `memory://`
/// or no URL, `with_store` of a `MemoryStore`, the default) takes the
/// in-process path, which samples no store latency; a store that merely
/// wraps one (to inject failures) takes the general path and samples every
/// call.
#[tokio::test]
async fn every_in_process_limiter_takes_the_in_process_path() -> TestResult {
    let registry = Registry::new();
    let m = RateLimitMetrics::register(&registry)?;
    let from = |url: Option<&'static str>| {
        distlock_ratelimit::RateLimitConfig::from_values(move |name| match (name, url) {
            ("RATE_LIMIT_URL", Some(url)) => Some(Ok(url.to_owned())),
            _ => None,
        })
    };
    let builders = [
        ("env-memory", from(Some("memory://"))?.limiter("env-memory")),
        ("env-none", from(None)?.limiter("env-none")),
        (
            "given",
            Limiter::builder("given").with_store(Arc::new(MemoryStore::new())),
        ),
        ("default", Limiter::builder("default")),
    ];
    for (name, builder) in builders {
        let limiter = builder
            .with_limit(limit("s", 3, Duration::from_secs(60)))
            .with_metrics(m.clone())
            .build()?;
        for i in 0..5 {
            let d = limiter.check("k").await?;
            assert_eq!(d.allowed, i < 3, "{name}: decision {i}");
        }
        assert_eq!(m.decisions(name, "allowed", Source::Store), 3, "{name}");
        assert_eq!(m.decisions(name, "limited", Source::Store), 2, "{name}");
        assert_eq!(latency_samples(&registry, name), 0, "{name}");
    }
    let wrapped = Limiter::builder("wrapped")
        .with_store(Arc::new(SwitchStore::new(Arc::new(MemoryStore::new()))))
        .with_limit(limit("s", 3, Duration::from_secs(60)))
        .with_metrics(m.clone())
        .build()?;
    for _ in 0..5 {
        wrapped.check("k").await?;
    }
    assert_eq!(latency_samples(&registry, "wrapped"), 5);
    Ok(())
}

/// On one in-process store (as every limiter built from one
/// `RateLimitConfig` shares), limiters of different names keep apart
/// buckets, and limiters of one name share theirs, as replicas do on a
/// shared store; a limit is told apart by its name, not its position.
#[tokio::test(start_paused = true)]
async fn limiters_on_one_in_process_store_share_buckets_by_name() -> TestResult {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let build = |name: &str, limits: &[(&str, u64)]| {
        let mut b = Limiter::builder(name)
            .with_store(Arc::clone(&store))
            .with_metrics(metrics());
        for (l, n) in limits {
            b = b.with_limit(limit(l, *n, Duration::from_secs(60)));
        }
        b.build()
    };
    let a1 = build("a", &[("s", 2)])?;
    let a2 = build("a", &[("s", 2)])?;
    let b = build("b", &[("s", 2)])?;
    assert!(a1.check("k").await?.allowed);
    assert!(a2.check("k").await?.allowed);
    assert!(!a1.check("k").await?.allowed, "a's two replicas share");
    assert!(b.check("k").await?.allowed, "b has its own bucket");
    assert!(a1.check("other").await?.allowed, "another subject too");
    // Limits of one name are one bucket whatever their order.
    let c1 = build("c", &[("x", 1), ("y", 5)])?;
    let c2 = build("c", &[("y", 5), ("x", 1)])?;
    assert!(c1.check("k").await?.allowed);
    let d = c2.check("k").await?;
    assert!(!d.allowed);
    assert_eq!(c2.limit_of(&d).map(|l| l.name()), Some("x"));
    Ok(())
}
