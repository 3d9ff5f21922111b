//! Private etcd servers for the tests: own data dir, own client and peer ports.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lock_etcd::{EtcdBackend, EtcdBuilder};

use crate::harness::{which, ServerProcess, ServerSpec};
use crate::BoxError;

/// Heartbeat and election timeout of private servers. etcd's minimum lease
/// TTL is 1.5 × the election timeout rounded up to whole seconds, so 500 ms
/// allows 1 s leases; a single member never holds an election after boot,
/// so short timeouts cannot cause leader churn.
const HEARTBEAT_MS: &str = "100";
const ELECTION_MS: &str = "500";

/// How a private server listens.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerTls<'a> {
    /// PEM certificate and key for an https client URL; plaintext when `None`.
    pub cert_and_key: Option<(&'a Path, &'a Path)>,
}

/// Starts a single-member etcd from `PATH` on free loopback ports.
pub fn start(tls: ServerTls<'_>) -> Result<ServerProcess, BoxError> {
    let program = which("etcd").ok_or("etcd is not on PATH")?;
    let scheme = if tls.cert_and_key.is_some() {
        "https"
    } else {
        "http"
    };
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
        "--heartbeat-interval",
        HEARTBEAT_MS,
        "--election-timeout",
        ELECTION_MS,
        // etcd keeps every revision until compacted; thousands of
        // acquisitions would otherwise slow it down.
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "1000",
        "--logger",
        "zap",
        "--log-level",
        "warn",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if let Some((cert, key)) = tls.cert_and_key {
        args.extend([
            "--cert-file".to_owned(),
            cert.display().to_string(),
            "--key-file".to_owned(),
            key.display().to_string(),
        ]);
    }
    ServerProcess::start(ServerSpec {
        program,
        args,
        run_as: None,
        ready_timeout: Duration::from_secs(20),
    })
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

/// Test TLS material written by [`test_certs`].
#[derive(Debug)]
pub struct TestCerts {
    /// The CA that signed the server certificate.
    pub ca: PathBuf,
    /// The server certificate (for 127.0.0.1 and localhost).
    pub cert: PathBuf,
    /// The server key.
    pub key: PathBuf,
    /// A second CA that signed nothing the server presents.
    pub other_ca: PathBuf,
}

/// Writes a test CA, a server certificate for 127.0.0.1 and localhost signed
/// by it, and an unrelated CA, into `dir`. (rustls refuses a self-signed CA
/// certificate as a server certificate, so the server needs its own.)
pub fn test_certs(dir: &Path) -> Result<TestCerts, BoxError> {
    let p = |name: &str| dir.join(name);
    let openssl = |args: &[&str]| -> Result<(), BoxError> {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("cannot run openssl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into())
        }
    };
    for ca in ["ca", "other-ca"] {
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN=lock-test {ca}"),
            "-keyout",
            &format!("{ca}-key.pem"),
            "-out",
            &format!("{ca}.pem"),
        ])?;
    }
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server-key.pem",
        "-out",
        "server.csr",
    ])?;
    std::fs::write(
        p("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ])?;
    Ok(TestCerts {
        ca: p("ca.pem"),
        cert: p("server.pem"),
        key: p("server-key.pem"),
        other_ca: p("other-ca.pem"),
    })
}
