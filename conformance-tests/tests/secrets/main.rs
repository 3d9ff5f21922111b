//! No password in any error text, `Debug` form or log line: a table of
//! connection strings (see `table.rs`) through every parser and connect path
//! of every backend.
//!
//! The tests run one at a time (they share the process environment and the
//! captured log), and every connect attempt is bounded: the URLs that parse
//! point at a closed local port.

mod check;
mod table;

use std::error::Error;
use std::fmt::Debug;
use std::future::Future;
use std::io;
use std::net::TcpListener;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use check::Findings;
use lock_etcd::EtcdBuilder;
use lock_postgres::{PostgresBackend, PostgresBuilder};
use lock_redis::RedisBuilder;
use table::Case;

/// Longer than any connect timeout of the backends' defaults: reaching it
/// means a connect path hangs.
const CONNECT_BOUND: Duration = Duration::from_secs(20);

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs the tests of this binary one at a time.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Everything logged through `tracing` (and the `log` crate) in this process.
fn captured_log() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        let installed = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .with_writer(move || LogSink(Arc::clone(&sink)))
            .try_init();
        if let Err(e) = installed {
            eprintln!("log capture not installed ({e}); log lines are not checked");
        }
        log
    })
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Checks the log captured so far, line by line, and empties it.
fn check_log(findings: &mut Findings, what: &str) {
    let text = {
        let mut log = captured_log()
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&std::mem::take(&mut *log)).into_owned()
    };
    let mut lines = 0;
    for line in text.lines() {
        findings.text(what, "log", "line", line);
        lines += 1;
    }
    eprintln!("{what}: {lines} lines checked");
}

/// A local port nothing listens on.
fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// Checks a parse or connect result: the error chain if it failed, the
/// value's `Debug` if it succeeded (unless the password sits where a user
/// name belongs, which a configuration may show).
fn outcome<T: Debug, E: Error + 'static>(
    findings: &mut Findings,
    what: &str,
    case: &Case,
    result: Result<T, E>,
) -> Option<T> {
    match result {
        Ok(value) => {
            if !case.user_position {
                findings.debug(what, &case.input, &value);
            }
            Some(value)
        }
        Err(e) => {
            findings.error(what, &case.input, &e);
            None
        }
    }
}

fn parse_everywhere(findings: &mut Findings, case: &Case) {
    let input = case.input.as_str();
    outcome(
        findings,
        "RedisBuilder::from_url",
        case,
        RedisBuilder::from_url(input),
    );
    let pg = outcome(
        findings,
        "PostgresBuilder::from_url",
        case,
        PostgresBuilder::from_url(input),
    );
    if let Some(pg) = pg {
        outcome(findings, "PostgresBuilder::config", case, pg.config());
    }
    outcome(
        findings,
        "EtcdBuilder::from_url",
        case,
        EtcdBuilder::from_url(input),
    );
    outcome(
        findings,
        "EtcdBuilder::with_endpoints",
        case,
        EtcdBuilder::new().with_endpoints([input]),
    );
}

/// Runs `check` over the table's inputs (one test at a time, with the log
/// captured), then adds what the log shows and fails on any finding, naming
/// the check `what`.
fn over_the_inputs(what: &str, check: impl FnOnce(&mut Findings, &[Case])) {
    let _serial = serial();
    captured_log();
    let mut findings = Findings::default();
    let cases = table::cases(closed_port());
    check(&mut findings, &cases);
    check_log(&mut findings, &format!("{what} log"));
    findings.assert_none(&format!("{what} over {} inputs", cases.len()));
}

#[test]
fn from_url_hides_passwords() {
    over_the_inputs("from_url", |findings, cases| {
        for case in cases {
            parse_everywhere(findings, case);
        }
    });
}

#[test]
fn from_env_hides_passwords() {
    over_the_inputs("from_env", |findings, cases| {
        let vars = ["REDIS_URL", "DATABASE_URL", "ETCD_ENDPOINTS"];
        let saved: Vec<_> = vars.iter().map(|v| (v, std::env::var_os(v))).collect();
        for case in cases {
            for var in vars {
                std::env::set_var(var, &case.input);
            }
            outcome(
                findings,
                "RedisBuilder::from_env",
                case,
                RedisBuilder::from_env(),
            );
            let pg = outcome(
                findings,
                "PostgresBuilder::from_env",
                case,
                PostgresBuilder::from_env(),
            );
            if let Some(pg) = pg {
                outcome(findings, "PostgresBuilder::config", case, pg.config());
            }
            outcome(
                findings,
                "EtcdBuilder::from_env",
                case,
                EtcdBuilder::from_env(),
            );
        }
        for (var, value) in saved {
            match value {
                Some(value) => std::env::set_var(var, value),
                None => std::env::remove_var(var),
            }
        }
    });
}

/// The runtime the connect tests run their attempts on: two workers, with
/// I/O and timers.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Awaits one connect attempt within [`CONNECT_BOUND`].
async fn bounded<T: Debug, E: Error + 'static>(
    findings: &mut Findings,
    what: &str,
    case: &Case,
    attempt: impl Future<Output = Result<T, E>>,
) {
    if bounded_any(findings, what, case, attempt).await.is_some() {
        findings.problem(
            what,
            format!(
                "{what}({:?}) connected, but nothing listens on that port",
                case.input
            ),
        );
    }
}

#[test]
fn connect_hides_passwords() {
    over_the_inputs("connect", |findings, cases| {
        let rt = runtime();
        let started = Instant::now();
        rt.block_on(async {
            for case in cases {
                let f = &mut *findings;
                let input = case.input.as_str();
                bounded(f, "scheduler::connect", case, scheduler::connect(input)).await;
                if let Ok(config) = RedisBuilder::from_url(input) {
                    bounded(f, "RedisBuilder::connect", case, config.connect()).await;
                }
                let pg = PostgresBuilder::from_url(input).and_then(PostgresBuilder::config);
                if let Ok(config) = pg {
                    bounded(
                        f,
                        "PostgresBackend::connect",
                        case,
                        PostgresBackend::connect(config),
                    )
                    .await;
                }
                if let Ok(builder) = EtcdBuilder::from_url(input) {
                    bounded(f, "EtcdBuilder::connect", case, builder.connect()).await;
                }
                if let Ok(builder) = EtcdBuilder::new().with_endpoints([input]) {
                    bounded(
                        f,
                        "EtcdBuilder::connect (endpoints)",
                        case,
                        builder.connect(),
                    )
                    .await;
                }
            }
        });
        eprintln!("connect: {} inputs in {:?}", cases.len(), started.elapsed());
    });
}

/// The servers in `REDIS_URL` and `DATABASE_URL` with a password added: the
/// server's own refusal (or acceptance) must not bring the password back.
#[test]
fn server_replies_hide_passwords() {
    let _serial = serial();
    captured_log();
    let servers: Vec<(&str, String)> = ["REDIS_URL", "DATABASE_URL"]
        .into_iter()
        .filter_map(|var| std::env::var(var).ok().map(|url| (var, url)))
        .collect();
    if servers.is_empty() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true needs REDIS_URL or DATABASE_URL for this test"
        );
        eprintln!("server replies: REDIS_URL and DATABASE_URL unset; nothing to check");
        return;
    }
    let rt = runtime();
    let mut findings = Findings::default();
    let mut inputs = 0;
    rt.block_on(async {
        for (var, url) in &servers {
            let Some((scheme, rest)) = url.split_once("://") else {
                findings.problem(var, format!("{var} is not a URL"));
                continue;
            };
            // Keep the variable's user (a server that trusts it accepts any
            // password: the success path is checked too); replace its password.
            let (user, rest) = match rest.rsplit_once('@') {
                Some((info, host)) => (info.split(':').next().unwrap_or("u"), host),
                None => ("u", rest),
            };
            for raw in table::PASSWORDS {
                let case = Case {
                    input: format!("{scheme}://{user}:{}@{rest}", table::encode(raw)),
                    user_position: false,
                };
                inputs += 1;
                let f = &mut findings;
                let input = case.input.as_str();
                if *var == "REDIS_URL" {
                    if let Ok(config) = RedisBuilder::from_url(input) {
                        bounded_any(f, "RedisBuilder::connect", &case, config.connect()).await;
                    }
                } else if let Ok(config) =
                    PostgresBuilder::from_url(input).and_then(PostgresBuilder::config)
                {
                    let attempt = PostgresBackend::connect(config);
                    bounded_any(f, "PostgresBackend::connect", &case, attempt).await;
                }
                bounded_any(f, "scheduler::connect", &case, scheduler::connect(input)).await;
            }
        }
    });
    check_log(&mut findings, "server replies log");
    findings.assert_none(&format!("server replies over {inputs} inputs"));
}

/// Awaits one attempt against a live server within [`CONNECT_BOUND`];
/// either outcome is checked (a server may accept any password). Returns
/// what the attempt connected, if it did.
async fn bounded_any<T: Debug, E: Error + 'static>(
    findings: &mut Findings,
    what: &str,
    case: &Case,
    attempt: impl Future<Output = Result<T, E>>,
) -> Option<T> {
    match tokio::time::timeout(CONNECT_BOUND, attempt).await {
        Ok(result) => outcome(findings, what, case, result),
        Err(_) => {
            findings.problem(
                what,
                format!(
                    "{what}({:?}) did not finish within {CONNECT_BOUND:?}",
                    case.input
                ),
            );
            None
        }
    }
}
