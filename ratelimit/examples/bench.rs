//! Decisions per second on one key, at concurrency 1 and 16, each against a
//! floor measured in the same run:
//!
//! - memory: the limiter on a `MemoryStore` against `governor`'s keyed
//!   limiter (its default, `DashMap`-backed store) on the same quota and key
//!   (goal: at least 0.5 × governor). The limiter is keyed, so that is its
//!   peer; `governor`'s direct limiter (one bucket, no map) is a second row,
//!   for information;
//! - redis: the limiter against its store called alone, one `EVALSHA` of the
//!   script per decision (goal: at least 0.9 × the floor);
//! - postgres: the limiter against its store called alone, one prepared
//!   function call per decision (goal: at least 0.9 × the floor).
//!
//! It prints one markdown table. Each figure is the median of seven runs of
//! one second (`BENCH_ROUNDS` sets another odd count), the limiter's and its
//! floor's interleaved, so load that comes and goes on the machine hits both
//! alike. With three rounds one noisy second could decide a server row's
//! ratio; with seven it takes four. A server backend is skipped when
//! its variable is unset.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run --release -p distlock-ratelimit --all-features --example bench
//! ```

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_ratelimit::gcra::Cell;
use distlock_ratelimit::store::{PostgresStore, RedisStore, Store, StoreRequest};
use distlock_ratelimit::{Limit, Limiter, OnStoreError, Quota, RateLimitMetrics};
use prometheus::Registry;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long one measurement runs.
const RUN: Duration = Duration::from_secs(1);
/// Measurements per figure unless `BENCH_ROUNDS` says otherwise; the
/// median is reported.
const ROUNDS: usize = 7;
/// Calls between two looks at the clock (and a yield, so that 16 tasks on
/// two threads take turns even when no call ever waits). Reading the clock
/// on every call would add its cost to every decision measured.
const BATCH: u64 = 64;
/// The quota of every limiter here: high enough that the store's work, not
/// refusals, is what is measured on servers.
const PER_SECOND: u64 = 1_000_000;
/// The one key every decision is about.
const KEY: &str = "203.0.113.7";

/// One decision; cloned once per task, so the harness adds no per-call
/// allocation or reference count to either side of a comparison.
trait Op: Clone + Send + Sync + 'static {
    fn call(&self) -> impl Future<Output = Result<(), BoxError>> + Send;
}

#[derive(Clone)]
struct Governor(Arc<governor::DefaultDirectRateLimiter>);

impl Op for Governor {
    fn call(&self) -> impl Future<Output = Result<(), BoxError>> + Send {
        // Admitted or refused, it is one decision.
        let _ = self.0.check();
        std::future::ready(Ok(()))
    }
}

/// `governor`'s keyed limiter, deciding for [`KEY`] as the limiter does.
#[derive(Clone)]
struct GovernorKeyed {
    limiter: Arc<governor::DefaultKeyedRateLimiter<String>>,
    key: Arc<String>,
}

impl Op for GovernorKeyed {
    fn call(&self) -> impl Future<Output = Result<(), BoxError>> + Send {
        // Admitted or refused, it is one decision.
        let _ = self.limiter.check_key(&self.key);
        std::future::ready(Ok(()))
    }
}

#[derive(Clone)]
struct Through(Limiter);

impl Op for Through {
    async fn call(&self) -> Result<(), BoxError> {
        self.0.check(KEY).await?;
        Ok(())
    }
}

/// The store called alone, with the request the limiter would build.
#[derive(Clone)]
struct Bare {
    store: Arc<dyn Store>,
    keys: Arc<[String; 1]>,
    cells: [Cell; 1],
}

impl Bare {
    fn new(store: Arc<dyn Store>) -> Result<Self, BoxError> {
        Ok(Self {
            store,
            keys: Arc::new([format!("rl-bench:{}:{{k}}:s", std::process::id())]),
            cells: [Quota::per_second(PER_SECOND)?.cell()],
        })
    }
}

impl Op for Bare {
    async fn call(&self) -> Result<(), BoxError> {
        self.store
            .decide(&StoreRequest {
                subject: "k",
                keys: &self.keys[..],
                cells: &self.cells,
                cost: 1,
            })
            .await?;
        Ok(())
    }
}

/// Calls `op` from `tasks` tasks for [`RUN`]; decisions per second.
async fn rate<O: Op>(tasks: usize, op: &O) -> Result<f64, BoxError> {
    let started = Instant::now();
    let stop = started + RUN;
    let mut handles = Vec::with_capacity(tasks);
    for _ in 0..tasks {
        let op = op.clone();
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < stop {
                for _ in 0..BATCH {
                    op.call().await?;
                }
                n += BATCH;
                tokio::task::yield_now().await;
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

/// The medians of [`ROUNDS`] interleaved runs of `limiter` and `floor`.
async fn compare<L: Op, F: Op>(
    tasks: usize,
    limiter: &L,
    floor: &F,
) -> Result<(f64, f64), BoxError> {
    let rounds = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
        .filter(|r| *r > 0)
        .unwrap_or(ROUNDS);
    let (mut ls, mut fs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        fs.push(rate(tasks, floor).await?);
        ls.push(rate(tasks, limiter).await?);
    }
    Ok((median(ls), median(fs)))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The limiter on `store`, or on its own in-process store (the default)
/// when `None`.
fn limiter(store: Option<Arc<dyn Store>>) -> Result<Limiter, BoxError> {
    let mut builder = Limiter::builder("bench");
    if let Some(store) = store {
        builder = builder.with_store(store);
    }
    Ok(builder
        .with_limit(Limit::new("s", Quota::per_second(PER_SECOND)?)?)
        .with_on_store_error(OnStoreError::Deny)
        .with_store_timeout(Duration::from_secs(5))
        .with_metrics(RateLimitMetrics::register(&Registry::new())?)
        .build()?)
}

/// Prints the rows of one backend: both concurrencies against its floor,
/// and whether `goal` is met (`None`: a row for information only).
async fn rows<L: Op, F: Op>(
    backend: &str,
    goal: Option<f64>,
    limiter: L,
    floor: F,
) -> Result<(), BoxError> {
    for tasks in [1, 16] {
        let (l, f) = compare(tasks, &limiter, &floor).await?;
        let ratio = l / f;
        let (goal, met) = match goal {
            Some(goal) if ratio >= goal => (format!("≥ {goal}"), "yes"),
            Some(goal) => (format!("≥ {goal}"), "no"),
            None => ("none".to_owned(), "-"),
        };
        println!("| {backend} | {tasks} | {l:.0} | {f:.0} | {ratio:.2} | {goal} | {met} |");
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    println!(
        "| backend (floor) | concurrency | limiter (decisions/s) | floor (decisions/s) | limiter / floor | goal | met? |"
    );
    println!("|---|---|---|---|---|---|---|");

    let quota =
        governor::Quota::per_second(NonZeroU32::new(u32::try_from(PER_SECOND)?).ok_or("quota")?);
    let keyed = GovernorKeyed {
        limiter: Arc::new(governor::RateLimiter::keyed(quota)),
        key: Arc::new(KEY.to_owned()),
    };
    let direct = Governor(Arc::new(governor::RateLimiter::direct(quota)));
    let memory = Through(limiter(None)?);
    rows("memory (governor keyed)", Some(0.5), memory.clone(), keyed).await?;
    rows("memory (governor direct)", None, memory, direct).await?;

    if let Ok(url) = std::env::var("REDIS_URL") {
        let store: Arc<dyn Store> = Arc::new(RedisStore::connect(&url)?);
        let through = Through(limiter(Some(Arc::clone(&store)))?);
        rows(
            "redis (EVALSHA alone)",
            Some(0.9),
            through,
            Bare::new(store)?,
        )
        .await?;
    }
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let pg = PostgresStore::connect(&url, "rl_bench_limits")?;
        pg.setup().await?;
        let store: Arc<dyn Store> = Arc::new(pg);
        let through = Through(limiter(Some(Arc::clone(&store)))?);
        rows(
            "postgres (function call alone)",
            Some(0.9),
            through,
            Bare::new(store)?,
        )
        .await?;
    }
    Ok(())
}
