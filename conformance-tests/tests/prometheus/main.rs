//! A real Prometheus scrapes a service that embeds the `/metrics` endpoint
//! and holds a Redis lock. A stock client steals the lock; the shipped
//! `DistributedLockStolen` rule must go active through Prometheus's own API,
//! the stolen counter must move, and a scrape without the token must show
//! the target down with 401.
//!
//! Needs `prometheus` and `redis-cli` on `PATH` (Debian packages
//! `prometheus`, `redis-tools`) and Redis (`REDIS_URL` or `redis-server`).
//! Under `CI=true` a missing piece fails the test instead of skipping it.

mod api;
mod server;

use std::time::{Duration, Instant};

use conformance_tests::backends::redis;
use conformance_tests::harness::{self, Availability};
use conformance_tests::BoxError;
use distlock::metrics_http::MetricsServer;
use distlock::prometheus::Registry;
use lock_core::{LockName, LockOptions, Locker, LossReason};
use serde_json::Value;
use tokio::time::timeout;

use api::{api, poll, query, value_of};

/// Everything, Prometheus's start included, ends within this.
const CASE_LIMIT: Duration = Duration::from_secs(180);
const LOCK: &str = "nightly-report";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stolen_lock_raises_the_stolen_alert_in_a_real_prometheus() {
    match timeout(CASE_LIMIT, run()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{e}"),
        Err(_) => panic!("the case did not finish within {CASE_LIMIT:?}"),
    }
}

async fn run() -> Result<(), BoxError> {
    let run_id = format!(
        "{:08x}",
        getrandom::u32().map_err(|e| format!("no randomness: {e}"))?
    );
    let factory = match redis::factory(&format!("promtest:{run_id}:")) {
        Availability::Ready(f) => f,
        Availability::Missing(why) if harness::in_ci() => {
            return Err(format!("no Redis for the Prometheus test: {why}").into())
        }
        Availability::Missing(why) => {
            eprintln!("SKIPPED: no Redis: {why}");
            return Ok(());
        }
    };
    if harness::which("redis-cli").is_none() && harness::in_ci() {
        return Err("redis-cli is not on PATH (Debian package redis-tools)".into());
    }

    let registry = Registry::new();
    let backend = factory.backend()?;
    let name = LockName::new(LOCK)?;
    let key = backend.key_for(&name);
    let fence = backend.fence_key();
    let locker = Locker::builder()
        .with_backend(backend)
        .with_registry(&registry)
        .build()?;
    let token = format!("scrape-{run_id}");
    let endpoint = MetricsServer::builder(registry.clone())
        .with_token(token.clone())
        .with_bind(([127, 0, 0, 1], 0).into())
        .start()
        .await?;
    let target = endpoint.local_addr().to_string();
    let Some(prometheus) =
        tokio::task::spawn_blocking(move || server::start(&target, &token)).await??
    else {
        return Ok(());
    };
    let port = prometheus.port();
    let outcome = observe_theft(&locker, &name, &key, factory.url(), port).await;
    // Leave nothing behind on a shared server.
    let _ = redis_cli(factory.url(), &["DEL", &key, &fence]).await;
    endpoint.shutdown().await;
    outcome.map_err(|e| format!("{e}\nprometheus log:\n{}", prometheus.log()).into())
}

async fn observe_theft(
    locker: &Locker,
    name: &LockName,
    key: &str,
    redis_url: &str,
    port: u16,
) -> Result<(), BoxError> {
    poll("Prometheus ready", Duration::from_secs(30), || async {
        Ok((api::get(port, "/-/ready").await?.0 == 200).then_some(()))
    })
    .await?;

    // A short TTL and renewal interval so the heartbeat meets the thief soon.
    let opts =
        LockOptions::new(Duration::from_secs(3)).with_renew_interval(Duration::from_millis(300));
    let guard = locker.try_lock(name, &opts).await?;

    // The steal must come after Prometheus holds the stolen series at 0:
    // increase() needs a sample before the rise.
    let stolen_series = format!(
        "distributed_lock_lost_total{{job=\"{}\",lock=\"{LOCK}\",reason=\"stolen\"}}",
        server::JOB
    );
    poll(
        "the stolen series at 0 in Prometheus",
        Duration::from_secs(30),
        || {
            let q = format!("count_over_time({stolen_series}[1m]) >= 2 and {stolen_series} == 0");
            async move { Ok(query(port, &q).await?.first().map(|_| ())) }
        },
    )
    .await?;

    let reply = redis_cli(redis_url, &["SET", key, "thief"]).await?;
    let stolen_at = Instant::now();
    if reply.trim() != "OK" {
        return Err(format!("redis-cli SET answered {reply:?}").into());
    }
    let reason = timeout(Duration::from_secs(10), guard.handle().lost())
        .await
        .map_err(|_| "the holder did not notice the theft within 10 s")?;
    let noticed = stolen_at.elapsed();
    if reason != LossReason::Stolen {
        return Err(format!("the holder saw {reason}, not stolen").into());
    }

    let alert = poll(
        "DistributedLockStolen active",
        Duration::from_secs(60),
        || async {
            let data = api(port, "/api/v1/alerts").await?;
            Ok(data["alerts"]
                .as_array()
                .and_then(|alerts| {
                    alerts.iter().find(|a| {
                        a["labels"]["alertname"] == "DistributedLockStolen"
                            && a["labels"]["lock"] == LOCK
                            && a["labels"]["job"] == server::JOB
                    })
                })
                .cloned())
        },
    )
    .await?;
    let to_alert = stolen_at.elapsed();
    let state = alert["state"].as_str().unwrap_or_default().to_owned();
    println!("holder saw the theft after {noticed:?}");
    println!(
        "steal to alert {state} in Prometheus: {to_alert:?}\n/api/v1/alerts entry:\n{}",
        serde_json::to_string_pretty(&alert)?
    );
    if state != "pending" && state != "firing" {
        return Err(format!("alert state {state:?}, want pending or firing").into());
    }
    if alert["labels"]["severity"] != "critical" || alert["annotations"]["summary"].is_null() {
        return Err(format!("alert without the rule's labels: {alert}").into());
    }

    let moved = poll(
        "the stolen counter at 1 in Prometheus",
        Duration::from_secs(30),
        || {
            let stolen_series = stolen_series.clone();
            async move {
                let result = query(port, &stolen_series).await?;
                Ok(result.first().filter(|s| value_of(s) == Some(1.0)).cloned())
            }
        },
    )
    .await?;
    println!("/api/v1/query {stolen_series}: {moved}");

    let targets = poll(
        "the no-token target down with 401",
        Duration::from_secs(30),
        || async {
            let data = api(port, "/api/v1/targets").await?;
            let pools: Vec<Value> = data["activeTargets"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let pool = |name: &str| pools.iter().find(|t| t["scrapePool"] == name).cloned();
            let (Some(with), Some(without)) = (pool(server::JOB), pool(server::JOB_NO_TOKEN))
            else {
                return Ok(None);
            };
            let refused = without["health"] == "down"
                && without["lastError"]
                    .as_str()
                    .is_some_and(|e| e.contains("401"));
            Ok((refused && with["health"] == "up").then_some((with, without)))
        },
    )
    .await?;
    println!(
        "targets: {} {} / {} {} ({})",
        server::JOB,
        targets.0["health"],
        server::JOB_NO_TOKEN,
        targets.1["health"],
        targets.1["lastError"]
    );
    Ok(())
}

/// Runs the stock `redis-cli` against `url`, as an operator would.
async fn redis_cli(url: &str, args: &[&str]) -> Result<String, BoxError> {
    let output = timeout(
        Duration::from_secs(10),
        tokio::process::Command::new("redis-cli")
            .arg("-u")
            .arg(url)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| "redis-cli took over 10 s")??;
    if !output.status.success() {
        return Err(format!(
            "redis-cli {} failed: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
