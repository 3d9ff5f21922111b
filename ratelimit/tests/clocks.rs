//! Replica processes whose clocks are an hour behind and an hour ahead
//! (libfaketime) share one Redis key with this process: the bound holds as
//! if every clock agreed, because only the server's clock is read. Skipped
//! with a printed reason without REDIS_URL or libfaketime, except under
//! CI=true.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{RedisStore, Store};

mod common;
use common::BoxError;

/// Set in a child: the key to decide on.
const CHILD_KEY: &str = "RL_CLOCK_CHILD_KEY";
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";
const TEST: &str = "replicas_with_clocks_an_hour_apart_change_nothing";

fn skip(why: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{why} and CI=true"
    );
    eprintln!("skipped: {why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_clocks_an_hour_apart_change_nothing() -> Result<(), BoxError> {
    let Ok(url) = std::env::var("REDIS_URL") else {
        skip("REDIS_URL is not set");
        return Ok(());
    };
    let store: Arc<dyn Store> = Arc::new(RedisStore::connect(&url)?);
    if let Ok(key) = std::env::var(CHILD_KEY) {
        // A replica under libfaketime: report its admissions and stop.
        let times = common::admissions(vec![store], &key).await?;
        let text: Vec<String> = times.iter().map(u64::to_string).collect();
        println!("RLCHILD {}", text.join(","));
        return Ok(());
    }
    if !std::path::Path::new(LIBFAKETIME).exists() {
        skip("libfaketime is not installed");
        return Ok(());
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        let key = format!("rl-test:{}:{{clock}}:s", common::run_id());
        let started = tokio::time::Instant::now();
        let mut children = Vec::new();
        for offset in ["-1h", "+1h"] {
            let child = tokio::process::Command::new(std::env::current_exe()?)
                .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
                .env(CHILD_KEY, &key)
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME", offset)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()?;
            children.push(child);
        }
        let mine = common::admissions(vec![store], &key).await?;
        let mut times = mine.clone();
        for child in children {
            let out = child.wait_with_output().await?;
            let text = String::from_utf8_lossy(&out.stdout);
            // The harness may print the test's name on the same line first.
            let line = text
                .lines()
                .find_map(|l| l.split_once("RLCHILD ").map(|(_, times)| times))
                .ok_or("a child reported nothing")?;
            let theirs: Vec<u64> = line
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::parse)
                .collect::<Result<_, _>>()?;
            assert!(!theirs.is_empty(), "every replica was admitted sometimes");
            times.extend(theirs);
        }
        let wall = started.elapsed();
        let (admitted, bound) = common::bound(&times)?;
        // The times above are what the store reported; were a replica's own
        // clock in play they would be skewed too. This process's monotonic
        // clock, around every replica's whole run, bounds them independently.
        let cell = common::cell();
        let wall_bound =
            cell.capacity / cell.interval + u64::try_from(wall.as_micros())? / cell.interval;
        assert!(
            admitted <= wall_bound,
            "admitted {admitted} > {wall_bound} over {wall:?}"
        );
        eprintln!(
            "redis, replicas at -1 h, 0, +1 h: admitted {admitted} ({} here), bound {bound}",
            mine.len()
        );
        common::check_bound("redis (clocks ±1 h)", admitted, bound);
        Ok::<_, BoxError>(())
    })
    .await?
}
