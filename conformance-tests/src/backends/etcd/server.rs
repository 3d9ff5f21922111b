//! Private etcd servers for the tests: own data dir, own client and peer ports.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use lock_core::LockBackend;
use lock_etcd::{EtcdBackend, EtcdBuilder};

use crate::harness::{free_port, which, ServerProcess, ServerSpec};
use crate::BoxError;

/// Heartbeat and election timeout of private servers. etcd's minimum lease
/// TTL is 1.5 × the election timeout rounded up to whole seconds, so 500 ms
/// allows 1 s leases; a single member never holds an election after boot,
/// so short timeouts cannot cause leader churn.
const HEARTBEAT_MS: &str = "100";
const ELECTION_MS: &str = "500";

/// The raft timings and compaction of every private member, a process
/// alone or in a cluster or a container: the short raft timings the
/// suite's TTLs are sized for, and compaction (etcd keeps every revision
/// until compacted; thousands of acquisitions would otherwise slow it down).
pub(crate) const RAFT_TUNING: &[&str] = &[
    "--heartbeat-interval",
    HEARTBEAT_MS,
    "--election-timeout",
    ELECTION_MS,
    "--auto-compaction-mode",
    "revision",
    "--auto-compaction-retention",
    "1000",
];

/// The logs of a member process: warnings only.
pub(super) const QUIET_LOGS: &[&str] = &["--logger", "zap", "--log-level", "warn"];

/// How a private server listens.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerTls<'a> {
    /// PEM certificate and key for an https client URL; plaintext when `None`.
    pub cert_and_key: Option<(&'a Path, &'a Path)>,
}

/// Starts a single-member etcd from `PATH` on free loopback ports.
pub fn start(tls: ServerTls<'_>) -> Result<ServerProcess, BoxError> {
    let scheme = if tls.cert_and_key.is_some() {
        "https"
    } else {
        "http"
    };
    let mut args = member_args(scheme, ELECTION_MS);
    if let Some((cert, key)) = tls.cert_and_key {
        args.extend([
            "--cert-file".to_owned(),
            cert.display().to_string(),
            "--key-file".to_owned(),
            key.display().to_string(),
        ]);
    }
    ServerProcess::start(spec(args)?)
}

/// Starts a plaintext member of its own, for a case that enables auth on
/// it, with a client at its URL that has added what etcd requires before
/// auth can be on: the `root` user (password `rootpw`) with the root role.
/// The case adds its roles and users through that client, then enables
/// auth. Returns the member, its client URL and the client.
///
/// # Cancel safety
///
/// Cancel safe: a dropped call kills the member it started.
pub async fn start_for_auth() -> Result<(ServerProcess, String, Client), BoxError> {
    let srv = start(ServerTls::default())?;
    connect_when_ready(builder(srv.port())).await?;
    let url = format!("http://127.0.0.1:{}", srv.port());
    let mut root = Client::connect([url.as_str()], None).await?;
    root.user_add("root", "rootpw", None).await?;
    root.user_grant_role("root", "root").await?;
    Ok((srv, url, root))
}

/// Starts a single-member plaintext etcd on the client port `port` (and
/// peer port `peer`) with an election timeout of `election_ms`, and waits
/// until it listens. Its minimum lease TTL is 1.5 × that timeout, rounded up
/// to whole seconds: a member that grants longer leases than asked for.
pub fn start_on(port: u16, peer: u16, election_ms: &str) -> Result<ServerProcess, BoxError> {
    let server =
        ServerProcess::launch(spec(member_args("http", election_ms))?, (port, peer), None)?;
    server.wait_ready()?;
    Ok(server)
}

/// The arguments of a single member listening with `scheme`, with the
/// election timeout `election_ms` in place of the suite's.
fn member_args(scheme: &str, election_ms: &str) -> Vec<String> {
    let client = format!("{scheme}://127.0.0.1:{{port}}");
    let peer = "http://127.0.0.1:{port2}".to_owned();
    let mut args: Vec<String> = [
        "--name",
        "lock-test",
        "--data-dir",
        "{dir}/data",
        "--listen-client-urls",
        &client,
        "--advertise-client-urls",
        &client,
        "--listen-peer-urls",
        &peer,
        "--initial-advertise-peer-urls",
        &peer,
        "--initial-cluster",
        &format!("lock-test={peer}"),
    ]
    .iter()
    .chain(RAFT_TUNING)
    .chain(QUIET_LOGS)
    .map(|s| (*s).to_owned())
    .collect();
    if let Some(at) = args.iter().position(|a| a == "--election-timeout") {
        if let Some(value) = args.get_mut(at + 1) {
            *value = election_ms.to_owned();
        }
    }
    args
}

fn spec(args: Vec<String>) -> Result<ServerSpec, BoxError> {
    Ok(ServerSpec {
        program: which("etcd").ok_or("etcd is not on PATH")?,
        args,
        run_as: None,
        ready_timeout: Duration::from_secs(20),
    })
}

/// A replica of a member that is not there (a free port nobody listens
/// on), as the factories hand out for the cases about unreachable servers.
pub fn unreachable() -> Option<Arc<dyn LockBackend>> {
    let port = free_port().ok()?;
    let backend = builder(port).build().ok()?;
    Some(Arc::new(backend))
}

/// A builder for the private server on `port`, with the suite's timeouts.
pub fn builder(port: u16) -> EtcdBuilder {
    EtcdBuilder::from_url(&format!("etcd://127.0.0.1:{port}"))
        .expect("a loopback URL is valid")
        .with_connect_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1))
}

/// Connects with `builder` until the server answers (it listens before it
/// has elected itself leader), for at most 20 s.
///
/// # Cancel safety
///
/// Cancel safe: a dropped attempt leaves at most a probe lease that expires.
pub async fn connect_when_ready(builder: EtcdBuilder) -> Result<EtcdBackend, BoxError> {
    let started = Instant::now();
    loop {
        match builder.clone().connect().await {
            Ok(backend) => return Ok(backend),
            Err(e) if started.elapsed() > Duration::from_secs(20) => {
                return Err(format!("etcd never became ready: {e}").into())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
