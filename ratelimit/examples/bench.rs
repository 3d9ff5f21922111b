//! Decisions per second: the limiter against its store called alone (Redis:
//! one EVALSHA of the script; Postgres: one prepared function call) and, in
//! memory, against governor's GCRA; at concurrency 1 and 16, on one key.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run --release -p distlock-ratelimit --all-features --example bench
//! ```

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_ratelimit::store::{MemoryStore, PostgresStore, RedisStore, Store, StoreRequest};
use distlock_ratelimit::{Limit, Limiter, OnStoreError, Quota, RateLimitMetrics};
use prometheus::Registry;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const RUN: Duration = Duration::from_secs(2);

/// Calls `op` from `tasks` tasks for `RUN`; decisions per second.
async fn rate<F, Fut>(tasks: usize, op: F) -> Result<f64, BoxError>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let op = Arc::clone(&op);
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            while started.elapsed() < RUN {
                op().await?;
                n += 1;
                if n.is_multiple_of(64) {
                    tokio::task::yield_now().await;
                }
            }
            Ok::<_, BoxError>(n)
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

fn limiter(store: Arc<dyn Store>) -> Result<Limiter, BoxError> {
    Ok(Limiter::builder("bench")
        .with_limit(Limit::new("s", Quota::per_second(1_000_000)?)?)
        .with_store(store)
        .with_on_store_error(OnStoreError::Deny)
        .with_store_timeout(Duration::from_secs(5))
        .with_metrics(RateLimitMetrics::register(&Registry::new())?)
        .build()?)
}

/// The store called alone, with the request the limiter would build.
fn bare(
    store: Arc<dyn Store>,
) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BoxError>> + Send>>
       + Send
       + Sync
       + 'static {
    let keys = Arc::new([format!("rl-bench:{}:{{k}}:s", std::process::id())]);
    let cell = Quota::per_second(1_000_000).map(|q| q.cell()).ok();
    move || {
        let store = Arc::clone(&store);
        let keys = Arc::clone(&keys);
        Box::pin(async move {
            let cells = [cell.ok_or("quota")?];
            store
                .decide(&StoreRequest {
                    subject: "k",
                    keys: &keys[..],
                    cells: &cells,
                    cost: 1,
                })
                .await?;
            Ok(())
        })
    }
}

fn through(
    l: Limiter,
) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BoxError>> + Send>>
       + Send
       + Sync
       + 'static {
    move || {
        let l = l.clone();
        Box::pin(async move {
            l.check("203.0.113.7").await?;
            Ok(())
        })
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    println!("| backend | what | concurrency 1 (/s) | concurrency 16 (/s) | limiter / floor |");
    println!("|---|---|---|---|---|");
    let row = |backend: &str, what: &str, one: f64, sixteen: f64, floor: Option<(f64, f64)>| {
        let ratio = floor.map_or(String::new(), |(f1, f16)| {
            format!("{:.2} / {:.2}", one / f1, sixteen / f16)
        });
        println!("| {backend} | {what} | {one:.0} | {sixteen:.0} | {ratio} |");
    };

    // Memory: governor's direct limiter on the same quota is the yardstick.
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000).ok_or("n")?);
    let gov = Arc::new(governor::RateLimiter::direct(quota));
    let g = Arc::clone(&gov);
    let g1 = rate(1, move || {
        let _ = g.check();
        async { Ok(()) }
    })
    .await?;
    let g = Arc::clone(&gov);
    let g16 = rate(16, move || {
        let _ = g.check();
        async { Ok(()) }
    })
    .await?;
    row("memory", "governor (floor)", g1, g16, None);
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let l = limiter(Arc::clone(&memory))?;
    let (m1, m16) = (
        rate(1, through(l.clone())).await?,
        rate(16, through(l)).await?,
    );
    row("memory", "limiter", m1, m16, Some((g1, g16)));

    if let Ok(url) = std::env::var("REDIS_URL") {
        let store: Arc<dyn Store> = Arc::new(RedisStore::connect(&url)?);
        let f1 = rate(1, bare(Arc::clone(&store))).await?;
        let f16 = rate(16, bare(Arc::clone(&store))).await?;
        row("redis", "store alone: one EVALSHA (floor)", f1, f16, None);
        let l = limiter(store)?;
        let (r1, r16) = (
            rate(1, through(l.clone())).await?,
            rate(16, through(l)).await?,
        );
        row("redis", "limiter", r1, r16, Some((f1, f16)));
    }
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let pg = PostgresStore::connect(&url, "rl_bench_limits")?;
        pg.setup().await?;
        let store: Arc<dyn Store> = Arc::new(pg);
        let f1 = rate(1, bare(Arc::clone(&store))).await?;
        let f16 = rate(16, bare(Arc::clone(&store))).await?;
        row(
            "postgres",
            "store alone: one function call (floor)",
            f1,
            f16,
            None,
        );
        let l = limiter(store)?;
        let (p1, p16) = (
            rate(1, through(l.clone())).await?,
            rate(16, through(l)).await?,
        );
        row("postgres", "limiter", p1, p16, Some((f1, f16)));
    }
    Ok(())
}
