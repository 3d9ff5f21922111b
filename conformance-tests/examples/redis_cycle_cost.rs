//! Runs `N` uncontended acquire + release cycles against the Redis server at
//! `REDIS_URL` (default `redis://127.0.0.1:6379`), for counting the client's
//! instructions per cycle under `valgrind --tool=callgrind`: unlike
//! throughput on a 2-core machine shared with redis-server, they do not move
//! with the load, and at concurrency 16 they are what decides the bench's
//! `lib/rslock` row.
//!
//! ```text
//! cargo build --release -p conformance-tests --example redis_cycle_cost
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/rc.1 target/release/examples/redis_cycle_cost lib 200
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/rc.2 target/release/examples/redis_cycle_cost lib 2200
//! ```
//!
//! The difference of the two totals divided by 2,000 is one cycle. Modes:
//! `lib` (a `Locker` over lock-redis without fencing tokens, like for like
//! with rslock), `lib-fenced` (the default, with fencing tokens), `floor`
//! (`SET NX PX` + a compare-and-delete script on one multiplexed
//! connection, the bench's floor) and `rslock` (rslock 0.10's
//! `LockManager::lock` + `unlock`). A third argument `T` splits the cycles
//! over `T` tasks on names of their own (`N` a multiple of `T`).

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::BoxError;
use lock_core::{LockName, LockOptions, Locker, OwnerToken};
use lock_redis::RedisBuilder;
use prometheus::Registry;
use redis::aio::ConnectionManager;

const TTL: Duration = Duration::from_secs(30);

const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

/// What one cycle runs on.
enum Client {
    Lib(Locker),
    Floor(ConnectionManager, redis::Script),
    Rslock(rslock::LockManager),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "lib".into());
    let cycles: u64 = args.next().map_or(Ok(1000), |n| n.parse())?;
    let tasks: u64 = args.next().map_or(Ok(1), |n| n.parse())?;
    if tasks == 0 || !cycles.is_multiple_of(tasks) {
        return Err(format!("{cycles} cycles do not split over {tasks} tasks").into());
    }
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let prefix = format!("cycle-cost:{}:", std::process::id());
    let client = Arc::new(match mode.as_str() {
        "lib" | "lib-fenced" => {
            let backend = RedisBuilder::from_url(&url)?
                .with_key_prefix(prefix.clone())
                .with_fencing_tokens(mode == "lib-fenced")
                .connect()
                .await?;
            Client::Lib(
                Locker::builder()
                    .with_backend(backend)
                    .with_registry(&Registry::new())
                    .build()?,
            )
        }
        "floor" => Client::Floor(
            ConnectionManager::new(redis::Client::open(url.as_str())?).await?,
            redis::Script::new(COMPARE_AND_DELETE),
        ),
        "rslock" => {
            let mut manager = rslock::LockManager::new(vec![url.clone()]);
            manager.set_retry(1, Duration::from_millis(1));
            Client::Rslock(manager)
        }
        other => {
            return Err(
                format!("unknown mode {other:?}: use lib, lib-fenced, floor or rslock").into(),
            )
        }
    });
    let mut running = Vec::new();
    for t in 0..tasks {
        let (client, key) = (Arc::clone(&client), format!("{prefix}{t}"));
        running.push(tokio::spawn(async move {
            for _ in 0..cycles / tasks {
                cycle(&client, &key).await?;
            }
            Ok::<_, BoxError>(())
        }));
    }
    for task in running {
        task.await??;
    }
    println!("{cycles} {mode} cycles over {tasks} task(s)");
    Ok(())
}

async fn cycle(client: &Client, key: &str) -> Result<(), BoxError> {
    match client {
        Client::Lib(locker) => {
            let name = LockName::new(key)?;
            let guard = locker.try_lock(&name, &LockOptions::new(TTL)).await?;
            guard.release().await?;
        }
        Client::Floor(conn, cad) => {
            let mut conn = conn.clone();
            let token = OwnerToken::generate()?.to_hex();
            let set: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(TTL.as_millis() as u64)
                .query_async(&mut conn)
                .await?;
            if set.is_none() {
                return Err(format!("{key} was taken").into());
            }
            let deleted: i64 = cad.key(key).arg(&token).invoke_async(&mut conn).await?;
            if deleted != 1 {
                return Err(format!("{key} was not ours to delete").into());
            }
        }
        Client::Rslock(manager) => {
            let lock = manager
                .lock(key.as_bytes(), TTL)
                .await
                .map_err(|e| format!("rslock: {key}: {e}"))?;
            manager.unlock(&lock).await;
        }
    }
    Ok(())
}
