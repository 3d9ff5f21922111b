//! Servers in containers (the `docker` feature), driven through the `docker`
//! command-line client.
//!
//! Why not testcontainers: every testcontainers-rs release from 0.16 on talks
//! to the engine through bollard with a fixed API version (1.44 and up) that
//! it never negotiates down, so an engine older than the client (Debian
//! bookworm's 20.10, API 1.41) refuses every call. The CLI negotiates.
//!
//! Images come from `.ci/images` (built from Debian packages, no registry);
//! nothing here pulls. Every container and network carries the [`LABEL`]
//! label with this process's run id, publishes its ports on the host's
//! loopback only, and is removed when its handle drops; [`remove_leftovers`]
//! is the backstop for handles that never drop (a hung case's thread).

use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::backends::etcd::server::RAFT_TUNING;
use crate::BoxError;

/// The label every container and network of the suite carries; its value
/// is the run id. `docker ps -a --filter label=distlock.conformance` lists
/// what a run left behind.
pub const LABEL: &str = "distlock.conformance";

/// Set to `1` to make a missing engine or image a failure instead of a skip
/// (`.ci/run` sets it).
pub const REQUIRE_VAR: &str = "DISTLOCK_REQUIRE_DOCKER";

/// The script that builds the images.
pub const IMAGES_SCRIPT: &str = ".ci/images";

/// How long a container may take to print its readiness line.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether a missing engine or image must fail the run ([`REQUIRE_VAR`]).
pub fn required() -> bool {
    std::env::var(REQUIRE_VAR).is_ok_and(|v| v == "1" || v == "true")
}

/// This process's run id, the value of [`LABEL`] on what it starts.
pub fn run_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        format!(
            "{}-{:08x}",
            std::process::id(),
            getrandom::u32().unwrap_or(0)
        )
    })
}

fn label_arg() -> String {
    format!("{LABEL}={}", run_id())
}

/// Set by a caller that runs several test processes and checks afterwards
/// that they left nothing (`.ci/run`): its value goes on everything this
/// process starts as the label [`BATCH_LABEL`], so the check finds its own
/// leftovers and never another run's live containers on the same engine.
pub const BATCH_VAR: &str = "DISTLOCK_DOCKER_BATCH";
/// The label that carries [`BATCH_VAR`]'s value.
pub const BATCH_LABEL: &str = "distlock.conformance.batch";

/// `--label` arguments for what this process starts.
fn label_args() -> Vec<String> {
    let mut args = vec!["--label".to_owned(), label_arg()];
    if let Ok(batch) = std::env::var(BATCH_VAR) {
        args.extend(["--label".to_owned(), format!("{BATCH_LABEL}={batch}")]);
    }
    args
}

/// Runs `docker args…` and returns its trimmed stdout.
fn docker(args: &[&str]) -> Result<String, BoxError> {
    let out = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run the docker client ({e}); is it installed?"))?;
    if !out.status.success() {
        return Err(format!(
            "`docker {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The engine's version and API version, e.g. `20.10.24 (API 1.41)`.
///
/// # Errors
///
/// When no engine answers.
pub fn engine() -> Result<String, BoxError> {
    docker(&[
        "version",
        "--format",
        "{{.Server.Version}} (API {{.Server.APIVersion}})",
    ])
    .map_err(|e| format!("no Docker engine answers: {e}").into())
}

/// Checks that `image` is on the machine.
///
/// # Errors
///
/// Names the script that builds it: nothing here pulls from a registry.
pub fn ensure_image(image: &str) -> Result<(), BoxError> {
    docker(&["image", "inspect", "--format", "{{.Id}}", image]).map_err(|_| {
        format!("image {image} is not on this machine: build it with `bash {IMAGES_SCRIPT}` (no registry is used)")
    })?;
    Ok(())
}

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct Spec {
    /// The image, built by [`IMAGES_SCRIPT`].
    pub image: &'static str,
    /// Container ports to publish on a random loopback port of the host.
    pub publish: Vec<u16>,
    /// A network of the suite's to attach to (else the default bridge).
    pub network: Option<String>,
    /// The container's host name, also its name on `network`.
    pub hostname: Option<String>,
    /// More networks of the suite's to attach to before the start, each
    /// with the container's name there.
    pub also_on: Vec<(String, String)>,
    /// Paths to mount a tmpfs on (data dirs that need no disk).
    pub tmpfs: Vec<&'static str>,
    /// The command; the image's own when empty.
    pub command: Vec<String>,
    /// The log line (stdout or stderr) that says the server accepts clients.
    pub ready: &'static str,
}

/// A running container of the suite's; removed (with its volumes) on drop.
#[derive(Debug)]
pub struct Container {
    id: String,
}

impl Container {
    /// Starts `spec` and waits until its readiness line is logged.
    ///
    /// # Errors
    ///
    /// No engine, a missing image, or a server that exits or stays silent
    /// for a minute (its last log lines are in the error). The container is
    /// removed on every error path.
    pub fn run(spec: &Spec) -> Result<Self, BoxError> {
        let container = Self::create(spec)?;
        container.start()?;
        container.wait_for_log(spec.ready, READY_TIMEOUT)?;
        Ok(container)
    }

    /// Creates `spec`'s container, attached to its networks, without
    /// starting it: members of a cluster must all be up before any of them
    /// reports ready.
    ///
    /// # Errors
    ///
    /// No engine, or a missing image. The container is removed on every
    /// error path.
    pub fn create(spec: &Spec) -> Result<Self, BoxError> {
        ensure_image(spec.image)?;
        let labels = label_args();
        let publish: Vec<String> = spec
            .publish
            .iter()
            .map(|p| format!("127.0.0.1::{p}"))
            .collect();
        let mut args: Vec<&str> = vec!["create"];
        args.extend(labels.iter().map(String::as_str));
        for p in &publish {
            args.extend(["--publish", p]);
        }
        for t in &spec.tmpfs {
            args.extend(["--tmpfs", t]);
        }
        if let Some(n) = &spec.network {
            args.extend(["--network", n]);
        }
        if let Some(h) = &spec.hostname {
            args.extend(["--hostname", h, "--network-alias", h]);
        }
        args.push(spec.image);
        args.extend(spec.command.iter().map(String::as_str));
        let id = docker(&args)?;
        // From here on the handle's drop removes the container.
        let container = Self { id };
        for (network, alias) in &spec.also_on {
            container.connect(network, alias)?;
        }
        Ok(container)
    }

    /// Starts a created container.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn start(&self) -> Result<(), BoxError> {
        docker(&["start", &self.id]).map(drop)
    }

    /// The container's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The loopback port of the host that `inner` is published on.
    ///
    /// # Errors
    ///
    /// If `inner` is not published.
    pub fn host_port(&self, inner: u16) -> Result<u16, BoxError> {
        let out = docker(&["port", &self.id, &format!("{inner}/tcp")])?;
        out.lines()
            .filter_map(|l| l.rsplit_once(':'))
            .find_map(|(_, port)| port.trim().parse().ok())
            .ok_or_else(|| format!("container port {inner} is not published ({out:?})").into())
    }

    /// The container's address on `network`.
    ///
    /// # Errors
    ///
    /// If it is not attached to `network`.
    pub fn ip(&self, network: &str) -> Result<String, BoxError> {
        let format = format!("{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}");
        let ip = docker(&["inspect", "--format", &format, &self.id])?;
        if ip.is_empty() {
            return Err(format!("container {} has no address on {network}", self.id).into());
        }
        Ok(ip)
    }

    /// Everything the container logged so far, stdout and stderr.
    ///
    /// # Errors
    ///
    /// If the engine cannot say.
    pub fn logs(&self) -> Result<String, BoxError> {
        let out = Command::new("docker")
            .args(["logs", &self.id])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(format!(
                "docker logs {}: {}",
                self.id,
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        let mut all = String::from_utf8_lossy(&out.stdout).into_owned();
        all.push_str(&String::from_utf8_lossy(&out.stderr));
        Ok(all)
    }

    /// Waits until `line` appears in the logs.
    ///
    /// # Errors
    ///
    /// If the container stops first, or `timeout` passes.
    pub fn wait_for_log(&self, line: &str, timeout: Duration) -> Result<(), BoxError> {
        let start = Instant::now();
        loop {
            let logs = self.logs()?;
            if logs.contains(line) {
                return Ok(());
            }
            let running = docker(&["inspect", "--format", "{{.State.Running}}", &self.id])?;
            let why = if running != "true" {
                Some("exited")
            } else if start.elapsed() > timeout {
                Some("did not become ready in time")
            } else {
                None
            };
            if let Some(why) = why {
                let tail: Vec<&str> = logs.lines().rev().take(10).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                return Err(format!(
                    "container {} {why} (waited {:?} for {line:?}); its last log lines:\n{}",
                    self.id,
                    start.elapsed(),
                    tail.join("\n")
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `command` in the container and returns its trimmed stdout.
    ///
    /// # Errors
    ///
    /// If the engine refuses or the command fails.
    pub fn exec(&self, command: &[&str]) -> Result<String, BoxError> {
        let mut args = vec!["exec", self.id.as_str()];
        args.extend(command);
        docker(&args)
    }

    /// Detaches the container from `network`: every packet to or from its
    /// address there stops at once, and the name stops resolving.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn disconnect(&self, network: &str) -> Result<(), BoxError> {
        docker(&["network", "disconnect", "--force", network, &self.id]).map(drop)
    }

    /// Attaches the container to `network` again, under `alias`.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn connect(&self, network: &str, alias: &str) -> Result<(), BoxError> {
        docker(&["network", "connect", "--alias", alias, network, &self.id]).map(drop)
    }

    /// Attaches the container to `network` again at address `ip`, the one
    /// it had there: peers that know it by address find it again. Needs a
    /// network with a configured subnet ([`Network::create_pinned`]).
    ///
    /// # Errors
    ///
    /// If the engine refuses (the address taken, or no configured subnet).
    pub fn connect_at(&self, network: &str, ip: &str) -> Result<(), BoxError> {
        docker(&["network", "connect", "--ip", ip, network, &self.id]).map(drop)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Err(e) = docker(&["rm", "--force", "--volumes", &self.id]) {
            tracing::warn!(container = %self.id, error = %e, "could not remove a test container");
        }
    }
}

/// A user-defined bridge network of the suite's; removed on drop (after the
/// containers on it, which must drop first).
#[derive(Debug)]
pub struct Network {
    name: String,
}

impl Network {
    /// Creates a network named after `purpose` and this run.
    ///
    /// # Errors
    ///
    /// If the engine refuses (no engine, no free address range).
    pub fn create(purpose: &str) -> Result<Self, BoxError> {
        let name = format!("distlock-{purpose}-{}", run_id());
        let labels = label_args();
        let mut args = vec!["network", "create"];
        args.extend(labels.iter().map(String::as_str));
        args.push(&name);
        docker(&args)?;
        Ok(Self { name })
    }

    /// A network like [`Network::create`]'s whose subnet is configured
    /// rather than only allocated, so that a container can be attached
    /// again at the address it had ([`Container::connect_at`]). The subnet
    /// is the one the engine picks for a plain network (made, read and
    /// removed first), so it overlaps nothing; another network made in
    /// between may take it, and then it is tried again, three times in all.
    ///
    /// # Errors
    ///
    /// If the engine refuses three times.
    pub fn create_pinned(purpose: &str) -> Result<Self, BoxError> {
        let mut last: BoxError = "no attempt".into();
        for _ in 0..3 {
            let picked = Self::create(purpose)?;
            let subnet = docker(&[
                "network",
                "inspect",
                "--format",
                "{{range .IPAM.Config}}{{.Subnet}} {{.Gateway}}{{end}}",
                &picked.name,
            ])?;
            let name = picked.name.clone();
            // Removed here, so the same name and subnet can be made again.
            drop(picked);
            let Some((subnet, gateway)) = subnet.split_once(' ') else {
                return Err(format!("network {name} has no IPv4 subnet ({subnet:?})").into());
            };
            let labels = label_args();
            let mut args = vec!["network", "create"];
            args.extend(labels.iter().map(String::as_str));
            args.extend(["--subnet", subnet, "--gateway", gateway, &name]);
            match docker(&args) {
                Ok(_) => return Ok(Self { name }),
                Err(e) => last = e,
            }
        }
        Err(format!("cannot make a network with a configured subnet: {last}").into())
    }

    /// Its name, for [`Spec::network`].
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Err(e) = docker(&["network", "rm", &self.name]) {
            tracing::warn!(network = %self.name, error = %e, "could not remove a test network");
        }
    }
}

/// Removes every container and network this process started that is still
/// there: the backstop for handles that never drop. Returns how many
/// containers it removed.
///
/// # Errors
///
/// If the engine cannot list or remove them.
pub fn remove_leftovers() -> Result<usize, BoxError> {
    let filter = format!("label={}", label_arg());
    let ids = docker(&["ps", "--all", "--quiet", "--filter", &filter])?;
    let ids: Vec<&str> = ids.lines().filter(|l| !l.is_empty()).collect();
    if !ids.is_empty() {
        let mut args = vec!["rm", "--force", "--volumes"];
        args.extend(ids.iter().copied());
        docker(&args)?;
    }
    let nets = docker(&["network", "ls", "--quiet", "--filter", &filter])?;
    for net in nets.lines().filter(|l| !l.is_empty()) {
        docker(&["network", "rm", net])?;
    }
    Ok(ids.len())
}

/// Which server a [`DockerServer`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Redis 7 from Debian, without persistence.
    Redis,
    /// PostgreSQL 15 from Debian, trust for everyone, database `test`.
    Postgres,
    /// etcd 3.4 from Debian, one member, with the suite's raft timings.
    Etcd,
}

impl Kind {
    /// The image `.ci/images` builds for it.
    pub fn image(self) -> &'static str {
        match self {
            Self::Redis => "distlock-test/redis:bookworm",
            Self::Postgres => "distlock-test/postgres:bookworm",
            Self::Etcd => "distlock-test/etcd:bookworm",
        }
    }

    /// The port the server listens on inside its container.
    pub fn port(self) -> u16 {
        match self {
            Self::Redis => 6379,
            Self::Postgres => 5432,
            Self::Etcd => 2379,
        }
    }

    /// The line the server logs once it accepts clients (checked against
    /// what the images print).
    pub fn ready_line(self) -> &'static str {
        match self {
            Self::Redis => "Ready to accept connections",
            // One start only: the image's cluster was made at build time.
            Self::Postgres => "database system is ready to accept connections",
            // etcd 3.4 with the zap logger, at info level.
            Self::Etcd => "serving client traffic insecurely",
        }
    }
}

/// etcd's flags in the suite's containers: the private servers' raft timings
/// (1 s leases allowed) and compaction, and the info level the readiness
/// line is logged at.
pub fn etcd_flags() -> Vec<String> {
    RAFT_TUNING
        .iter()
        .chain(&["--logger", "zap", "--log-level", "info"])
        .map(|s| (*s).to_owned())
        .collect()
}

/// A single server in a container, published on the host's loopback.
#[derive(Debug)]
pub struct DockerServer {
    kind: Kind,
    port: u16,
    container: Container,
}

impl DockerServer {
    /// Starts a `kind` server and waits until it accepts clients.
    ///
    /// # Errors
    ///
    /// When there is no engine, the image is missing (the error names
    /// [`IMAGES_SCRIPT`]), or the server does not become ready.
    pub fn start(kind: Kind) -> Result<Self, BoxError> {
        let command = match kind {
            Kind::Etcd => {
                let mut c: Vec<String> = [
                    "etcd",
                    "--name",
                    "default",
                    "--data-dir",
                    "/var/lib/etcd/default",
                    "--listen-client-urls",
                    "http://0.0.0.0:2379",
                    "--advertise-client-urls",
                    "http://127.0.0.1:2379",
                ]
                .map(str::to_owned)
                .to_vec();
                c.extend(etcd_flags());
                c
            }
            Kind::Redis | Kind::Postgres => Vec::new(),
        };
        let container = Container::run(&Spec {
            image: kind.image(),
            publish: vec![kind.port()],
            command,
            ready: kind.ready_line(),
            ..Spec::default()
        })
        .map_err(|e| format!("docker: cannot start a {kind:?} container: {e}"))?;
        let port = container.host_port(kind.port())?;
        Ok(Self {
            kind,
            port,
            container,
        })
    }

    /// The host port the server is published on (loopback).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The container.
    pub fn container(&self) -> &Container {
        &self.container
    }

    /// The server's URL: `redis://…`, `postgres://postgres@…/test` or
    /// `http://…` (an etcd endpoint).
    pub fn url(&self) -> String {
        match self.kind {
            Kind::Redis => format!("redis://127.0.0.1:{}", self.port),
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{}/test", self.port),
            Kind::Etcd => format!("http://127.0.0.1:{}", self.port),
        }
    }
}
