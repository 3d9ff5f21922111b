//! A private Sentinel deployment on loopback (a primary, a replica and three
//! sentinels, redis-server from PATH) named by a `redis+sentinel://` URL, as
//! `RATE_LIMIT_URL` would: the bound holds across three instances, and a
//! failover under load moves the decisions to the new primary. Skipped with
//! a printed reason without redis-server, except under CI=true.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{Store, StoreRequest};
use tokio::time::Instant;

mod common;
use common::procs::{self, Dir, Server};
use common::BoxError;

const MASTER: &str = "rlprimary";

struct Deployment {
    data: Vec<Server>,
    sentinels: Vec<Server>,
    _dir: Dir,
}

impl Deployment {
    fn start() -> Result<Self, BoxError> {
        let dir = Dir::new("sentinel")?;
        for sub in ["p", "r"] {
            std::fs::create_dir_all(dir.0.join(sub))?;
        }
        let primary_port = procs::free_port()?;
        let primary = Server::start(&dir.0.join("p"), primary_port, &[])?;
        let replica_port = procs::free_port()?;
        let replica = Server::start(
            &dir.0.join("r"),
            replica_port,
            &[
                "--replicaof".into(),
                "127.0.0.1".into(),
                primary_port.to_string(),
            ],
        )?;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let sdir = dir.0.join(format!("s{i}"));
            std::fs::create_dir_all(&sdir)?;
            let config = sdir.join("sentinel.conf");
            std::fs::write(
                &config,
                format!(
                    "sentinel monitor {MASTER} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {MASTER} 1000\n\
                     sentinel failover-timeout {MASTER} 4000\n"
                ),
            )?;
            sentinels.push(Server::start_sentinel(&sdir, procs::free_port()?, &config)?);
        }
        let d = Self {
            data: vec![primary, replica],
            sentinels,
            _dir: dir,
        };
        d.wait_settled(primary_port, Duration::from_secs(30))?;
        Ok(d)
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{MASTER}", hosts.join(","))
    }

    /// `SENTINEL MASTER` as one sentinel sees it.
    fn master(sentinel: u16) -> Result<HashMap<String, String>, BoxError> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{sentinel}"))?;
        let mut c = client.get_connection_with_timeout(Duration::from_secs(1))?;
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        Ok(redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER)
            .query(&mut c)?)
    }

    /// Every sentinel names `primary`, knows the replica and the two other
    /// sentinels, and the replica's link is up (at most `within`).
    fn wait_settled(&self, primary: u16, within: Duration) -> Result<(), BoxError> {
        let until = std::time::Instant::now() + within;
        loop {
            let settled = self.sentinels.iter().all(|s| {
                Self::master(s.port()).is_ok_and(|m| {
                    let f = |k: &str| m.get(k).cloned().unwrap_or_default();
                    f("port") == primary.to_string()
                        && f("num-slaves") == "1"
                        && f("num-other-sentinels") == "2"
                })
            }) && self.data.iter().filter(|d| d.port() != primary).all(|d| {
                procs::cli(d.port(), &["INFO", "replication"]).contains("master_link_status:up")
            });
            if settled {
                return Ok(());
            }
            if std::time::Instant::now() >= until {
                return Err(
                    format!("the Sentinel deployment did not settle within {within:?}").into(),
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn primary(&self) -> Result<u16, BoxError> {
        let m = Self::master(self.sentinels[0].port())?;
        Ok(m.get("port").ok_or("no port")?.parse()?)
    }

    /// `SENTINEL FAILOVER`, then waits (at most `within`) until every
    /// sentinel names another server that answers `ROLE` as master.
    /// Returns (old, new) ports.
    fn failover(&self, within: Duration) -> Result<(u16, u16), BoxError> {
        let old = self.primary()?;
        let asked = self.sentinels[0].port();
        let until = std::time::Instant::now() + within;
        let mut requested = false;
        loop {
            if !requested {
                let out = procs::cli(asked, &["SENTINEL", "FAILOVER", MASTER]);
                requested = out.contains("OK") || out.contains("INPROG");
            }
            let named: Vec<Option<String>> = self
                .sentinels
                .iter()
                .map(|s| {
                    Self::master(s.port())
                        .ok()
                        .and_then(|m| m.get("port").cloned())
                })
                .collect();
            if let Some(Some(p)) = named.first() {
                let p: u16 = p.parse()?;
                if p != old
                    && named.iter().all(|n| n.as_deref() == Some(&p.to_string()))
                    && procs::cli(p, &["ROLE"]).starts_with("master")
                {
                    return Ok((old, p));
                }
            }
            if std::time::Instant::now() >= until {
                return Err(
                    format!("no failover within {within:?} (sentinels name {named:?})").into(),
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn stores(url: &str) -> Result<Vec<Arc<dyn Store>>, BoxError> {
    (0..3)
        .map(|_| distlock_ratelimit::store_from_url(url).map_err(Into::into))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_url_holds_the_bound_and_follows_a_failover_under_load() -> Result<(), BoxError> {
    if !procs::redis_on_path() {
        return Ok(());
    }
    let deployment = Arc::new(tokio::task::spawn_blocking(Deployment::start).await??);
    let url = deployment.url();
    tokio::time::timeout(common::case_limit(Duration::from_secs(50)), async {
        // Over-admission across 3 instances, each its own link.
        let h = common::hammer(stores(&url)?, async {}).await?;
        common::check_hammered("redis_sentinel", &h);

        // A failover under load: one new key, 1 s before, then until 2 s
        // after every sentinel names the new primary.
        let stores = stores(&url)?;
        let key = format!("rl-test:{}:{{one}}:f", common::run_id());
        let errors = Arc::new(AtomicU64::new(0));
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let d = Arc::clone(&deployment);
        let side = async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let started = Instant::now();
            let switched =
                tokio::task::spawn_blocking(move || d.failover(Duration::from_secs(30))).await;
            let took = started.elapsed();
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop_tx.send_replace(true);
            (switched, took)
        };
        let (times, (switched, took)) =
            tokio::join!(common::tolerant_admissions(&stores, &key, &stop, &errors), side);
        let (old, new) = switched??;
        let times = times?;
        let (admitted, bound) = common::bound(&times)?;
        let burst = common::cell().capacity / common::cell().interval;
        let over = admitted.saturating_sub(bound);
        eprintln!(
            "redis_sentinel failover {old} -> {new} in {took:?} under load: admitted {admitted}, bound {bound} (+ one burst {burst} allowed across the failover), over the bound by {over}, {} failed calls",
            errors.load(Ordering::Relaxed)
        );
        // Replication is asynchronous: the new primary lacks what the old
        // one admitted after the promotion, at worst the whole bucket, one
        // burst; plus 1 for the two servers' separate rounding.
        assert!(
            admitted <= bound + burst + 1,
            "admitted {admitted} > {bound} + {burst} + 1"
        );
        assert!(admitted * 100 >= bound * 80, "admitted only {admitted} of {bound}");

        // Every store decides on the new primary: a decision writes its key
        // there (the old primary may answer for a moment as a stale
        // primary, until the sentinels demote it and it drops its clients).
        // One a second, a minute's burst: the key lives a second.
        let cell = distlock_ratelimit::gcra::Cell {
            interval: 1_000_000,
            capacity: 60_000_000,
        };
        let switched_at = Instant::now();
        let mut moved = Vec::new();
        for (n, s) in stores.iter().enumerate() {
            let probe = format!("rl-test:{}:{{p}}:after{n}", common::run_id());
            let until = Instant::now() + Duration::from_secs(15);
            loop {
                let r = s
                    .decide(&StoreRequest {
                        subject: "p",
                        keys: std::slice::from_ref(&probe),
                        cells: &[cell],
                        cost: 1,
                    })
                    .await;
                if matches!(r, Ok(d) if d.allowed)
                    && procs::cli(new, &["EXISTS", &probe]).trim() == "1"
                {
                    moved.push(switched_at.elapsed());
                    break;
                }
                if Instant::now() >= until {
                    return Err(format!(
                        "store {n} did not decide on the new primary {new} within 15 s (last {r:?}; old {old} says ROLE {:?}, EXISTS {:?})",
                        procs::cli(old, &["ROLE"]),
                        procs::cli(old, &["EXISTS", &probe])
                    )
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        eprintln!("redis_sentinel: every store decided on the new primary within {moved:?} of the end of the run");
        Ok::<_, BoxError>(())
    })
    .await??;
    drop(deployment);
    Ok(())
}
