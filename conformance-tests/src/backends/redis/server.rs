//! Private `redis-server`s for the suite: plain, replica and TLS, and the
//! one spec every private Redis process (cluster nodes and sentinels too) is
//! started from. (Containers, for the `docker_redis` row, are in
//! `harness::docker`.)

use std::path::Path;
use std::time::Duration;

use crate::harness::{which, ServerProcess, ServerSpec};
use crate::BoxError;

/// Starts `redis-server` from `PATH` on a free loopback port, without
/// persistence, so a restart loses every key (as a crash would).
pub fn start_plain() -> Result<ServerProcess, BoxError> {
    start_with(&[])
}

/// [`start_plain`] with more `redis-server` arguments, such as
/// `--requirepass`.
pub fn start_with(extra: &[&str]) -> Result<ServerProcess, BoxError> {
    let mut a = vec!["--port", "{port}"];
    a.extend_from_slice(extra);
    ServerProcess::start(spec(without_persistence(&a))?)
}

/// Starts `redis-server` as a replica of the private server on
/// `127.0.0.1:primary`, also without persistence. Replication is
/// asynchronous; wait for [`replica_link_up`] before relying on it.
pub fn start_replica_of(primary: u16) -> Result<ServerProcess, BoxError> {
    start_replica_of_with(primary, &[])
}

/// [`start_replica_of`] with more `redis-server` arguments.
pub fn start_replica_of_with(primary: u16, extra: &[&str]) -> Result<ServerProcess, BoxError> {
    let primary = primary.to_string();
    let mut a = vec!["--replicaof", "127.0.0.1", &primary];
    a.extend_from_slice(extra);
    start_with(&a)
}

/// Waits (at most `within`) until the replica on `127.0.0.1:port` reports
/// `master_link_status:up`.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn replica_link_up(port: u16, within: Duration) -> Result<(), BoxError> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut c = client.get_multiplexed_async_connection().await?;
    let until = tokio::time::Instant::now() + within;
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await?;
        if info.contains("master_link_status:up") {
            return Ok(());
        }
        if tokio::time::Instant::now() >= until {
            return Err(format!("the replica on {port} did not link up within {within:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts a TLS-only `redis-server` with the certificates
/// [`test_certs`](crate::harness::certs::test_certs) wrote into `dir` under `stem`.
pub fn start_tls(dir: &Path, stem: &str) -> Result<ServerProcess, BoxError> {
    let file = |suffix: &str| {
        dir.join(format!("{stem}{suffix}"))
            .to_string_lossy()
            .into_owned()
    };
    let (cert, key, ca) = (file(".pem"), file("-key.pem"), file("-ca.pem"));
    let a = without_persistence(&[
        "--port",
        "0",
        "--tls-port",
        "{port}",
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ]);
    ServerProcess::start(spec(a)?)
}

/// How every private `redis-server` of the suite is started (plain, replica,
/// TLS, cluster node, sentinel): the binary from `PATH` with `args`, ready
/// once its port accepts connections, which takes well under 10 s even on a
/// loaded machine.
pub(super) fn spec(args: Vec<String>) -> Result<ServerSpec, BoxError> {
    Ok(ServerSpec {
        program: which("redis-server").ok_or("redis-server is not on PATH")?,
        args,
        run_as: None,
        ready_timeout: Duration::from_secs(10),
    })
}

/// `extra` and what every private data server adds: it listens on loopback
/// only and keeps no RDB or AOF file (a restart loses every key, as a crash
/// would), with its files in its temp dir.
pub(super) fn without_persistence(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    a.extend(
        [
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "{dir}",
        ]
        .map(String::from),
    );
    a
}
