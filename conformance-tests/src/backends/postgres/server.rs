//! A private Postgres for the suite: `initdb` once per run, then `postgres`
//! as the `postgres` user on a free loopback port, with TLS on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::harness::{ServerProcess, ServerSpec};
use crate::BoxError;

/// A role of the private server that logs in with a password (SCRAM).
pub const ROLE_WITH_PASSWORD: &str = "ct_pw";
/// The password of [`ROLE_WITH_PASSWORD`].
pub const PASSWORD: &str = "ct-secret";
/// A role without CREATE on schema `public` (the Postgres 15 default).
pub const ROLE_NO_CREATE: &str = "ct_nocreate";
/// A role whose sessions end after 300 ms idle (`idle_session_timeout`).
pub const ROLE_IDLER: &str = "ct_idler";

/// Where the Postgres server binaries are, if installed.
pub fn bindir() -> Option<PathBuf> {
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    dir.join("postgres").is_file().then_some(dir)
}

/// The uid and gid of the `postgres` user, which runs the servers.
///
/// # Errors
///
/// If there is no such user.
pub fn postgres_ids() -> Result<(u32, u32), BoxError> {
    Ok((id_of("-u")?, id_of("-g")?))
}

fn id_of(flag: &str) -> Result<u32, BoxError> {
    let out = Command::new("id").args([flag, "postgres"]).output()?;
    if !out.status.success() {
        return Err("there is no `postgres` user to run the server as".into());
    }
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

/// A started private server.
#[derive(Debug)]
pub struct Started {
    server: ServerProcess,
    ca: PathBuf,
    other_ca: PathBuf,
    _cluster: TempDir,
}

impl Started {
    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// A URL for `user` on database `postgres`.
    pub fn url(&self, user: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/postgres", self.port())
    }

    /// The server process, to kill and restart it.
    pub fn process(&self) -> &ServerProcess {
        &self.server
    }

    /// The CA that signed the certificate the server presents.
    pub fn ca_file(&self) -> &Path {
        &self.ca
    }

    /// A CA that signed nothing the server presents.
    pub fn other_ca_file(&self) -> &Path {
        &self.other_ca
    }
}

/// Started on first use, so runs that filter Postgres out pay nothing.
#[derive(Debug, Default)]
pub struct PrivatePostgres {
    started: OnceLock<Result<Started, String>>,
}

impl PrivatePostgres {
    /// The server, starting it on the first call.
    ///
    /// # Errors
    ///
    /// Why it could not be started (the same answer on every call).
    pub fn get(&self) -> Result<&Started, BoxError> {
        self.started
            .get_or_init(|| Self::start().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| format!("private Postgres: {e}").into())
    }

    fn start() -> Result<Started, BoxError> {
        let bin = bindir().ok_or("pg_config --bindir found no Postgres server")?;
        let (uid, gid) = postgres_ids()?;
        let cluster = tempfile::Builder::new().prefix("lock-pg-").tempdir()?;
        std::os::unix::fs::chown(cluster.path(), Some(uid), Some(gid))?;
        let data = cluster.path().join("data");
        let initdb = Command::new(bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .args(["--locale", "C"])
            .current_dir(cluster.path())
            .stdin(Stdio::null())
            .uid_gid(uid, gid)
            .output()?;
        if !initdb.status.success() {
            return Err(
                format!("initdb failed: {}", String::from_utf8_lossy(&initdb.stderr)).into(),
            );
        }
        // The password role authenticates by SCRAM; everyone else is trusted.
        let hba = data.join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba)?;
        std::fs::write(
            &hba,
            format!("host all {ROLE_WITH_PASSWORD} 127.0.0.1/32 scram-sha-256\n{old}"),
        )?;
        let certs = make_certificate(cluster.path(), &data, uid, gid)?;
        let settings = [
            "ssl=on",
            "max_connections=300",
            "shared_buffers=32MB",
            // The shared lock table holds max_locks_per_transaction ×
            // (max_connections + max_prepared_transactions) locks of all
            // sessions: 76,800 here, so one session can hold the bench's
            // 10,000 leases (and their floor's 10,000) at once.
            "max_locks_per_transaction=256",
        ];
        let spec = server_spec(&bin, &data, (uid, gid), &settings);
        let server = ServerProcess::start(spec)?;
        let started = Started {
            server,
            ca: certs.ca,
            other_ca: certs.other_ca,
            _cluster: cluster,
        };
        wait_accepting(&bin, started.port(), Duration::from_secs(30))?;
        let setup = format!(
            "CREATE ROLE {ROLE_WITH_PASSWORD} LOGIN PASSWORD '{PASSWORD}'; \
             CREATE ROLE {ROLE_NO_CREATE} LOGIN; \
             CREATE ROLE {ROLE_IDLER} LOGIN SUPERUSER; \
             ALTER ROLE {ROLE_IDLER} SET idle_session_timeout = '300ms';"
        );
        psql(&bin, started.port(), &setup)?;
        Ok(started)
    }
}

/// How to start `postgres` from `bin` on the data dir `data` as `run_as`:
/// on the spec's port, loopback only, its socket in the spec's dir, without
/// fsync (nothing of a test server needs to survive a crash), and with
/// `settings` (`name=value`) on top.
pub(super) fn server_spec(
    bin: &Path,
    data: &Path,
    run_as: (u32, u32),
    settings: &[&str],
) -> ServerSpec {
    let mut args: Vec<String> = ["-D", &data.to_string_lossy(), "-p", "{port}", "-k", "{dir}"]
        .map(str::to_owned)
        .to_vec();
    for setting in ["listen_addresses=127.0.0.1", "fsync=off"]
        .iter()
        .chain(settings)
    {
        args.push("-c".to_owned());
        args.push((*setting).to_owned());
    }
    ServerSpec {
        program: bin.join("postgres"),
        args,
        run_as: Some(run_as),
        ready_timeout: Duration::from_secs(30),
    }
}

trait UidGid {
    fn uid_gid(&mut self, uid: u32, gid: u32) -> &mut Self;
}

impl UidGid for Command {
    fn uid_gid(&mut self, uid: u32, gid: u32) -> &mut Self {
        use std::os::unix::process::CommandExt;
        self.uid(uid).gid(gid)
    }
}

/// A CA-signed certificate for 127.0.0.1/localhost, installed as the
/// server's; returns the test certificates (the CA for clients to trust,
/// and an unrelated CA).
fn make_certificate(
    dir: &Path,
    data: &Path,
    uid: u32,
    gid: u32,
) -> Result<crate::harness::certs::TestCerts, BoxError> {
    let certs = crate::harness::certs::test_certs(dir, "server")?;
    let (crt, key) = (data.join("server.crt"), data.join("server.key"));
    std::fs::copy(&certs.cert, &crt)?;
    std::fs::copy(&certs.key, &key)?;
    for f in [&crt, &key] {
        std::os::unix::fs::chown(f, Some(uid), Some(gid))?;
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
    Ok(certs)
}

/// Waits up to `within` until the Postgres on `port` accepts connections, as
/// `pg_isready` from `bin` sees it: a listening port alone is not enough, a
/// server still starting up (or a standby not yet consistent) refuses
/// sessions.
pub(super) fn wait_accepting(bin: &Path, port: u16, within: Duration) -> Result<(), BoxError> {
    let start = Instant::now();
    while start.elapsed() < within {
        let ok = Command::new(bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "1"])
            .stdout(Stdio::null())
            .status()?
            .success();
        if ok {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("postgres on port {port} did not accept connections within {within:?}").into())
}

/// Runs SQL as `postgres` through `psql`.
pub fn psql(bin: &Path, port: u16, sql: &str) -> Result<String, BoxError> {
    let out = Command::new(bin.join("psql"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        // Bounded: a server that stopped answering fails the caller in
        // seconds instead of hanging it.
        .env("PGCONNECT_TIMEOUT", "10")
        .env("PGOPTIONS", "-c statement_timeout=30000")
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(format!("psql: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(String::from_utf8(out.stdout)?)
}
