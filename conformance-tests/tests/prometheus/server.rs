//! The Debian `prometheus` server, started on loopback with a scrape config
//! for the test's endpoint and the shipped alert rules.

use std::path::{Path, PathBuf};
use std::time::Duration;

use conformance_tests::harness::{self, ServerProcess, ServerSpec};
use conformance_tests::BoxError;
use tempfile::TempDir;

/// The job that scrapes with the bearer token.
pub(crate) const JOB: &str = "locks";
/// The job that scrapes the same endpoint without it.
pub(crate) const JOB_NO_TOKEN: &str = "locks-no-token";

/// The shipped rules file.
pub(crate) fn rules_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/prometheus/alerts.yml")
}

/// A running Prometheus and the directory holding its config.
pub(crate) struct Prometheus {
    pub(crate) process: ServerProcess,
    _config: TempDir,
}

/// The scrape config: 1 s scrapes and rule evaluations, one job with the
/// token, one without, both on `target`.
pub(crate) fn config(target: &str, token: &str, rules: &Path) -> String {
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - {rules}\n\
         scrape_configs:\n\
         \x20 - job_name: {JOB}\n\
         \x20   authorization:\n\
         \x20     credentials: {token}\n\
         \x20   static_configs:\n\
         \x20     - targets: ['{target}']\n\
         \x20 - job_name: {JOB_NO_TOKEN}\n\
         \x20   static_configs:\n\
         \x20     - targets: ['{target}']\n",
        rules = rules.display(),
    )
}

/// Starts `/usr/bin/prometheus` (or whichever is on `PATH`) scraping
/// `target`. `Ok(None)` when the binary is missing outside CI.
pub(crate) fn start(target: &str, token: &str) -> Result<Option<Prometheus>, BoxError> {
    let Some(program) = harness::which("prometheus") else {
        if harness::in_ci() {
            return Err("prometheus is not on PATH (Debian package `prometheus`); \
                        CI=true requires it: run .ci/run or apt-get install prometheus"
                .into());
        }
        eprintln!("SKIPPED: prometheus is not on PATH (apt-get install prometheus)");
        return Ok(None);
    };
    let dir = tempfile::Builder::new()
        .prefix("prometheus-config-")
        .tempdir()?;
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(
        &config_path,
        config(target, token, &rules_file().canonicalize()?),
    )?;
    let process = ServerProcess::start(ServerSpec {
        program,
        args: vec![
            format!("--config.file={}", config_path.display()),
            "--storage.tsdb.path={dir}/data".into(),
            "--web.listen-address=127.0.0.1:{port}".into(),
            "--log.level=warn".into(),
        ],
        run_as: None,
        ready_timeout: Duration::from_secs(30),
    })?;
    Ok(Some(Prometheus {
        process,
        _config: dir,
    }))
}

impl Prometheus {
    /// Its HTTP port.
    pub(crate) fn port(&self) -> u16 {
        self.process.port()
    }

    /// Its log so far, for a failure message.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.process.dir().join("server.log")).unwrap_or_default()
    }
}
