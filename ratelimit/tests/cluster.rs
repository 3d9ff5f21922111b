//! A private three-primary Redis Cluster on loopback (redis-server and
//! redis-cli from PATH): one subject's limits share a slot, so the script
//! stays atomic and never meets CROSSSLOT, and the bound holds across
//! replicas. Skipped with a printed reason without redis-server, except
//! under CI=true.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{RedisStore, Store};
use distlock_ratelimit::{Limit, Limiter, OnStoreError, Quota, RateLimitMetrics};
use prometheus::Registry;

mod common;

use common::procs::{self, Dir, Server};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Three cluster nodes, each in its own directory under one removed when
/// dropped; the servers are killed (by PID) first.
struct Nodes {
    _servers: Vec<Server>,
    ports: Vec<u16>,
    _dir: Dir,
}

/// Starts three primaries and joins them with `redis-cli --cluster create`
/// (bounded: it waits for the nodes to meet without a limit of its own),
/// then waits up to 30 s for every node to report `cluster_state:ok`.
fn start_cluster() -> Result<Nodes, Box<dyn std::error::Error + Send + Sync>> {
    let dir = Dir::new("cluster")?;
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..3 {
        let port = procs::free_port()?;
        let node_dir = dir.0.join(port.to_string());
        std::fs::create_dir_all(&node_dir)?;
        let extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"];
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        servers.push(Server::start(&node_dir, port, &extra)?);
        ports.push(port);
    }
    let nodes = Nodes {
        _servers: servers,
        ports,
        _dir: dir,
    };
    let mut args = vec!["--cluster".to_owned(), "create".to_owned()];
    args.extend(nodes.ports.iter().map(|p| format!("127.0.0.1:{p}")));
    args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = procs::redis_cli(nodes.ports[0], &args)
        .stderr(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(format!(
            "cluster create failed or did not finish ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        )
        .into());
    }
    for p in &nodes.ports {
        let info = ["CLUSTER", "INFO"];
        if !procs::wait_for(*p, &info, "cluster_state:ok", Duration::from_secs(30)) {
            return Err(format!("node {p} never reported cluster_state:ok").into());
        }
    }
    Ok(nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keeps_a_subjects_limits_in_one_slot_and_the_bound() -> TestResult {
    if !procs::redis_on_path() {
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
    let out = procs::redis_cli(port, args).output()?;
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
    if !procs::redis_on_path() {
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
