//! A private three-primary Redis Cluster on loopback (redis-server and
//! redis-cli from PATH): one subject's limits share a slot, so the script
//! stays atomic and never meets CROSSSLOT, and the bound holds across
//! replicas. Skipped with a printed reason without redis-server, except
//! under CI=true.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_ratelimit::store::{RedisStore, Store};
use distlock_ratelimit::{Limit, Limiter, OnStoreError, Quota, RateLimitMetrics};
use prometheus::Registry;

mod common;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Kills (by PID) and reaps the nodes it started when dropped.
struct Nodes {
    children: Vec<Child>,
    ports: Vec<u16>,
    _dir: tempdir::Dir,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

mod tempdir {
    /// A directory removed when dropped.
    pub(crate) struct Dir(pub(crate) std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn on_path(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A free port whose cluster bus port (+10000) is free too.
fn free_port() -> std::io::Result<u16> {
    for _ in 0..100 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::other("no free port pair"))
}

fn start_cluster() -> Result<Nodes, Box<dyn std::error::Error + Send + Sync>> {
    let dir = std::env::temp_dir().join(format!("rl-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut nodes = Nodes {
        children: Vec::new(),
        ports: Vec::new(),
        _dir: tempdir::Dir(dir.clone()),
    };
    for _ in 0..3 {
        let port = free_port()?;
        let node_dir = dir.join(port.to_string());
        std::fs::create_dir_all(&node_dir)?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&node_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        nodes.children.push(child);
        nodes.ports.push(port);
    }
    let ready = |args: &[&str], want: &str| -> bool {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            let ok = Command::new("redis-cli")
                .args(args)
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(want));
            if ok {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    };
    for p in &nodes.ports {
        if !ready(&["-p", &p.to_string(), "PING"], "PONG") {
            return Err(format!("node {p} did not answer PING").into());
        }
    }
    let mut create = Command::new("redis-cli");
    create.args(["--cluster", "create"]);
    for p in &nodes.ports {
        create.arg(format!("127.0.0.1:{p}"));
    }
    let out = create
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        )
        .into());
    }
    for p in &nodes.ports {
        if !ready(
            &["-p", &p.to_string(), "CLUSTER", "INFO"],
            "cluster_state:ok",
        ) {
            return Err(format!("node {p} never reported cluster_state:ok").into());
        }
    }
    Ok(nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keeps_a_subjects_limits_in_one_slot_and_the_bound() -> TestResult {
    if !(on_path("redis-server") && on_path("redis-cli")) {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "redis-server/redis-cli not on PATH and CI=true"
        );
        eprintln!("skipped: redis-server or redis-cli is not on PATH");
        return Ok(());
    }
    let nodes = tokio::task::spawn_blocking(start_cluster).await??;
    tokio::time::timeout(common::case_limit(Duration::from_secs(57)), async {
        let seeds: Vec<String> = nodes
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        let mut stores: Vec<Arc<dyn Store>> = Vec::new();
        for _ in 0..3 {
            let connection = redis::cluster::ClusterClient::new(seeds.clone())?
                .get_async_connection()
                .await?;
            stores.push(Arc::new(RedisStore::with_connection(connection)));
        }
        // Several limits of many subjects through the limiter: their keys
        // land on different slots across subjects, one slot per subject.
        let limiter = Limiter::builder("cluster")
            .with_limit(Limit::new("second", Quota::per_second(2)?)?)
            .with_limit(Limit::new("hour", Quota::per_hour(3)?)?)
            .with_store(Arc::clone(&stores[0]))
            .with_on_store_error(OnStoreError::Deny)
            .with_store_timeout(Duration::from_secs(2))
            .with_metrics(RateLimitMetrics::register(&Registry::new())?)
            .with_key_prefix(format!("rl-test:{}", std::process::id()))
            .build()?;
        for subject in 0..50 {
            let key = format!("user-{subject}");
            assert!(
                limiter.check_cost(&key, 2).await?.allowed,
                "CROSSSLOT or a store error would be Err"
            );
            let d = limiter.check_cost(&key, 2).await?;
            assert!(!d.allowed);
            assert_eq!(limiter.limit_of(&d).map(|l| l.name()), Some("hour"));
        }
        // The same cluster named by a URL, as RATE_LIMIT_URL would.
        let url = format!(
            "redis+cluster://{}",
            nodes
                .ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let by_url = Limiter::builder("cluster-url")
            .with_limit(Limit::new("second", Quota::per_second(2)?)?)
            .with_store(distlock_ratelimit::store_from_url(&url)?)
            .with_on_store_error(OnStoreError::Deny)
            .with_store_timeout(Duration::from_secs(2))
            .with_metrics(RateLimitMetrics::register(&Registry::new())?)
            .build()?;
        assert!(by_url.check("someone").await?.allowed);
        assert!(by_url.check("someone").await?.allowed);
        assert!(!by_url.check("someone").await?.allowed);
        // Over-admission across 3 connections x 16 tasks on one key for
        // `RATE_LIMIT_SOAK_SECS` (3 s unless set).
        let h = common::hammer(stores, async {}).await?;
        common::check_hammered("redis_cluster", &h);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await??;
    drop(nodes);
    Ok(())
}

/// `redis-cli -p port args...`, its output trimmed, or an error naming the
/// command when it did not run or answered an error.
fn cli(port: u16, args: &[&str]) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || text.starts_with("ERR") || text.starts_with("(error)") {
        return Err(format!("redis-cli -p {port} {args:?}: {text}").into());
    }
    Ok(text)
}

/// The sum over `ports` of the `errorstat_<code>` counts in `INFO
/// errorstats` (the replies a node sent with that error code).
fn error_replies(ports: &[u16], code: &str) -> u64 {
    let prefix = format!("errorstat_{code}:count=");
    ports
        .iter()
        .filter_map(|p| cli(*p, &["INFO", "errorstats"]).ok())
        .flat_map(|info| {
            info.lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .filter_map(|n| n.split(',').next()?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Moves `slot` from the node on `from` to the node on `to` the way
/// `redis-cli --cluster reshard` does: IMPORTING on the target, MIGRATING
/// on the source, MIGRATE of its keys in batches, then SETSLOT NODE on
/// every node. Returns the keys moved.
fn migrate_slot(
    slot: u16,
    from: u16,
    to: u16,
    all: &[u16],
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let slot = slot.to_string();
    let from_id = cli(from, &["CLUSTER", "MYID"])?;
    let to_id = cli(to, &["CLUSTER", "MYID"])?;
    cli(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])?;
    cli(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])?;
    let mut moved = 0;
    for _ in 0..1_000 {
        let keys = cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"])?;
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            break;
        }
        let port = to.to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(&keys);
        cli(from, &args)?;
        moved += keys.len();
    }
    // The target first, then the source, then the others, as reshard does.
    cli(to, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?;
    cli(from, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?;
    for p in all.iter().filter(|p| **p != from && **p != to) {
        cli(*p, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?;
    }
    Ok(moved)
}

/// The port of the primary that owns `slot`, from `CLUSTER SHARDS`-free
/// `CLUSTER SLOTS` as redis-cli prints it: ranges, then the owner's address.
fn owner(port: u16, slot: u16) -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    let out = cli(port, &["CLUSTER", "SLOTS"])?;
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    // Each range prints as: start, end, ip, port, id (then replicas).
    let mut i = 0;
    while i + 3 < lines.len() {
        if let (Ok(start), Ok(end)) = (lines[i].parse::<u16>(), lines[i + 1].parse::<u16>()) {
            if lines[i + 2] == "127.0.0.1" && (start..=end).contains(&slot) {
                return Ok(lines[i + 3].parse()?);
            }
        }
        i += 1;
    }
    Err(format!("no owner of slot {slot} in CLUSTER SLOTS").into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_slot_migrated_under_load_keeps_the_bound() -> TestResult {
    if !(on_path("redis-server") && on_path("redis-cli")) {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "redis-server/redis-cli not on PATH and CI=true"
        );
        eprintln!("skipped: redis-server or redis-cli is not on PATH");
        return Ok(());
    }
    let nodes = tokio::task::spawn_blocking(start_cluster).await??;
    let ports = nodes.ports.clone();
    tokio::time::timeout(common::case_limit(Duration::from_secs(57)), async {
        let url = format!(
            "redis+cluster://{}",
            ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let stores: Vec<Arc<dyn Store>> = (0..3)
            .map(|_| distlock_ratelimit::store_from_url(&url))
            .collect::<Result<_, _>>()?;
        let key = format!("rl-test:{}:{{one}}:m", common::run_id());
        let slot: u16 = cli(ports[0], &["CLUSTER", "KEYSLOT", &key])?.parse()?;
        let from = owner(ports[0], slot)?;
        let to = *ports.iter().find(|p| **p != from).ok_or("one node")?;
        let (moved_before, asked_before) =
            (error_replies(&ports, "MOVED"), error_replies(&ports, "ASK"));
        let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let all = ports.clone();
        let side = async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let started = std::time::Instant::now();
            let r = tokio::task::spawn_blocking(move || migrate_slot(slot, from, to, &all)).await;
            let took = started.elapsed();
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop_tx.send_replace(true);
            (r, took)
        };
        let (times, (migrated, took)) =
            tokio::join!(common::tolerant_admissions(&stores, &key, &stop, &errors), side);
        let keys_moved = migrated??;
        let (admitted, bound) = common::bound(&times?)?;
        let moved = error_replies(&ports, "MOVED") - moved_before;
        let asked = error_replies(&ports, "ASK") - asked_before;
        eprintln!(
            "redis_cluster slot {slot} migrated {from} -> {to} under load in {took:?} ({keys_moved} keys): admitted {admitted}, bound {bound}; {moved} MOVED and {asked} ASK replies, {} failed calls",
            errors.load(std::sync::atomic::Ordering::Relaxed)
        );
        assert_eq!(owner(ports[0], slot)?, to, "the slot moved");
        // MIGRATE moves a bucket atomically: nothing is lost, the bound holds.
        assert!(admitted <= bound, "admitted {admitted} > {bound}");
        assert!(admitted * 100 >= bound * 80, "admitted only {admitted} of {bound}");
        assert!(moved + asked > 0, "the clients were redirected");
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await??;
    drop(nodes);
    Ok(())
}
