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
            assert_eq!(d.limit.name(), "hour");
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
        let (admitted, bound) = common::hammer(stores, async {}).await?;
        common::check_bound("redis_cluster", admitted, bound);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await??;
    drop(nodes);
    Ok(())
}
