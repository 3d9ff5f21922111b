//! Turns cases × backends into libtest trials named `backend::case`.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, ColorSetting, Completion, Failed, Trial};
use lock_core::Capabilities;

use crate::harness::{in_ci, Availability};
use crate::{cases, BackendFactory, Ctx};

/// What a case needs from a backend to be meaningful.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requires {
    /// Nothing beyond the trait.
    Nothing,
    /// Fencing tokens.
    Fencing,
    /// Cases run on tokio's paused clock (the model test advances time).
    PausedClock,
    /// A URL that `distlock::connect` reaches the backend's server by.
    ConnectUrl,
}

impl Requires {
    fn met_by(self, caps: &Capabilities, paused: bool, has_url: bool) -> bool {
        match self {
            Self::Nothing => true,
            Self::Fencing => caps.fencing,
            Self::PausedClock => paused,
            Self::ConnectUrl => has_url,
        }
    }
}

/// How a case runs.
#[derive(Clone, Copy, Debug)]
pub enum CaseFn {
    /// In a runtime the suite builds (paused for paused-clock backends).
    Async(fn(Ctx) -> Pin<Box<dyn Future<Output = ()> + Send>>),
    /// On the trial's thread, building its own runtimes.
    Blocking(fn(Ctx)),
}

/// One conformance case.
#[derive(Clone, Copy)]
pub struct Case {
    /// Its name, the part after `backend::`.
    pub name: &'static str,
    /// What it needs.
    pub requires: Requires,
    /// Its body.
    pub run: CaseFn,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("requires", &self.requires)
            .finish()
    }
}

/// Longest a real-time case may run before it counts as hung.
const CASE_TIMEOUT: Duration = Duration::from_secs(180);

/// The trials of a run: every case for every backend that could be had.
#[derive(Default)]
pub struct Suite {
    trials: Vec<Trial>,
    run_id: String,
}

impl std::fmt::Debug for Suite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Suite")
            .field("trials", &self.trials.len())
            .finish()
    }
}

impl Suite {
    /// An empty suite with a random run id for name prefixes.
    pub fn new() -> Self {
        let run_id = format!("{:08x}", getrandom::u32().unwrap_or(0));
        Self {
            trials: Vec::new(),
            run_id,
        }
    }

    /// Adds every case for `factory`.
    pub fn add(&mut self, factory: Arc<dyn BackendFactory>) {
        self.add_cases(factory, cases::ALL.iter());
    }

    /// Adds the cases named in `names` for `factory`: for a variant of a
    /// backend that differs in a few calls, where the whole suite would
    /// test the rest twice. A name that is no case becomes a failing trial,
    /// so the list cannot rot unseen.
    pub fn add_named(&mut self, factory: Arc<dyn BackendFactory>, names: &[&str]) {
        for missing in names
            .iter()
            .filter(|n| !cases::ALL.iter().any(|c| c.name == **n))
        {
            let msg = format!("{missing} is not a conformance case");
            self.trials.push(Trial::test(
                format!("{}::{missing}", factory.name()),
                move || Err(msg.into()),
            ));
        }
        self.add_cases(
            factory,
            cases::ALL.iter().filter(|c| names.contains(&c.name)),
        );
    }

    fn add_cases<'a>(
        &mut self,
        factory: Arc<dyn BackendFactory>,
        chosen: impl Iterator<Item = &'a Case>,
    ) {
        let caps = factory.capabilities();
        let timing = factory.timing();
        let has_url = factory.has_connect_url();
        for case in chosen {
            let name = format!("{}::{}", factory.name(), case.name);
            let met = case.requires.met_by(&caps, timing.paused_clock, has_url);
            let factory = Arc::clone(&factory);
            let run_id = self.run_id.clone();
            let case = *case;
            let trial = Trial::test(name, move || run_case(factory, &run_id, case));
            self.trials.push(trial.with_ignored_flag(!met));
        }
    }

    /// Adds a backend whose server may be missing: its cases if it is there;
    /// otherwise a failing `backend::server_available` trial under `CI=true`,
    /// or one loud line on stderr elsewhere.
    pub fn add_server_backend(
        &mut self,
        backend: &str,
        found: Availability<Arc<dyn BackendFactory>>,
    ) {
        match found {
            Availability::Ready(factory) => self.add(factory),
            Availability::Missing(why) if in_ci() => {
                let msg = format!("{backend}: no server ({why}); CI must test every backend");
                self.trials.push(Trial::test(
                    format!("{backend}::server_available"),
                    move || Err(msg.into()),
                ));
            }
            Availability::Missing(why) => {
                eprintln!("!!! SKIPPING EVERY {backend} CASE: no server ({why}). Set CI=true to make this a failure.");
            }
        }
    }

    /// Adds a trial of its own (backend-specific tests).
    pub fn push(&mut self, trial: Trial) {
        self.trials.push(trial);
    }

    /// Adds, for trials that cannot run here because `why`, what
    /// [`unavailable`](crate::harness::unavailable) stands in for them.
    pub fn push_unavailable(&mut self, name: &str, why: &str) {
        self.trials.extend(crate::harness::unavailable(name, why));
    }

    /// Whether `binary` is on `PATH`; if not, adds what
    /// [`Suite::push_unavailable`] stands in for the trials of `name`.
    pub fn has_binary(&mut self, binary: &str, name: &str) -> bool {
        if crate::harness::which(binary).is_some() {
            return true;
        }
        self.push_unavailable(name, &format!("{binary} is not on PATH; CI must test it"));
        false
    }

    /// The random id of this run.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Runs the trials with libtest's command-line arguments.
    pub fn run(self, args: &Arguments) -> ExitCode {
        libtest_mimic::run(args, timed("conformance", self.trials)).exit_code()
    }
}

/// The environment variable naming the file [`timed`] appends to.
pub const TIMES_ENV: &str = "CONFORMANCE_TIMES";

/// Makes each trial append `seconds\t[suite] name` to the file that
/// `CONFORMANCE_TIMES` names once it has run, so CI can list the slowest
/// cases; returns the trials unchanged when the variable is unset.
///
/// libtest-mimic keeps a trial's body private, so each trial is wrapped in
/// a one-trial run of its own whose report goes to a scratch file: the
/// wrapper passes, fails (with the inner report as its message) or is
/// ignored as the inner trial was.
pub fn timed(suite: &'static str, trials: Vec<Trial>) -> Vec<Trial> {
    match std::env::var_os(TIMES_ENV) {
        Some(path) => timed_into(suite, trials, std::path::PathBuf::from(path)),
        None => trials,
    }
}

fn timed_into(suite: &'static str, trials: Vec<Trial>, path: std::path::PathBuf) -> Vec<Trial> {
    let path = Arc::new(path);
    trials
        .into_iter()
        .map(|inner| {
            if !inner.is_test() {
                return inner;
            }
            let name = inner.name().to_owned();
            let kind = inner.kind().to_owned();
            let ignored = inner.has_ignored_flag();
            let path = Arc::clone(&path);
            let label = name.clone();
            Trial::ignorable_test(name, move || run_timed(suite, &label, inner, &path))
                .with_kind(kind)
                .with_ignored_flag(ignored)
        })
        .collect()
}

fn run_timed(
    suite: &str,
    name: &str,
    inner: Trial,
    times: &std::path::Path,
) -> Result<Completion, Failed> {
    let report = tempfile::NamedTempFile::new()?;
    let args = Arguments {
        // The outer run already chose this trial; the inner one runs it.
        include_ignored: true,
        test_threads: Some(1),
        logfile: Some(report.path().to_string_lossy().into_owned()),
        color: Some(ColorSetting::Never),
        ..Arguments::default()
    };
    let started = std::time::Instant::now();
    let conclusion = libtest_mimic::run(&args, vec![inner]);
    let line = format!("{:.3}\t[{suite}] {name}\n", started.elapsed().as_secs_f64());
    // One write per line on an append-mode file: parallel trials do not
    // interleave within a line.
    if let Err(e) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(times)
        .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()))
    {
        eprintln!("cannot append to {}: {e}", times.display());
    }
    if conclusion.num_failed > 0 {
        let text = std::fs::read_to_string(report.path()).unwrap_or_default();
        let header = format!("---- {name} ----\n");
        let message = text
            .split_once(&header)
            .and_then(|(_, rest)| rest.split_once("\n\nfailures:").map(|(m, _)| m))
            .unwrap_or(&text);
        return Err(Failed::from(message.trim_end()));
    }
    if conclusion.num_passed == 0 {
        return Ok(Completion::ignored());
    }
    Ok(Completion::Completed)
}

/// Wall-clock slack past [`CASE_TIMEOUT`] before a case counts as hung even
/// if it never yields to its runtime (a busy loop, a blocked thread).
const HUNG_SLACK: Duration = Duration::from_secs(30);

/// Wall-clock bound of a paused-clock case.
const PAUSED_WALL_BOUND: Duration = Duration::from_secs(60);

/// Runs a case on its own thread and fails it if it has not finished within
/// its time bound, so a broken lock fails one case quickly instead of hanging
/// the run. A case that hangs is left running on its thread.
fn run_case(factory: Arc<dyn BackendFactory>, run_id: &str, case: Case) -> Result<(), Failed> {
    // Paused-clock cases take milliseconds of real time; a minute means hung.
    let bound = if factory.timing().paused_clock {
        PAUSED_WALL_BOUND
    } else {
        CASE_TIMEOUT + HUNG_SLACK
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let run_id = run_id.to_owned();
    std::thread::Builder::new()
        .name(format!("case-{}", case.name))
        .spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_case_here(factory, &run_id, case)
            }));
            let _ = tx.send(outcome);
        })?;
    match rx.recv_timeout(bound) {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(Failed::from(format!(
            "case did not finish within {bound:?} of wall-clock time"
        ))),
    }
}

fn run_case_here(factory: Arc<dyn BackendFactory>, run_id: &str, case: Case) -> Result<(), Failed> {
    let ctx = Ctx::new(Arc::clone(&factory), run_id, case.name);
    match case.run {
        CaseFn::Blocking(body) => {
            body(ctx);
            Ok(())
        }
        CaseFn::Async(body) => {
            let paused = factory.timing().paused_clock;
            let rt = if paused {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .start_paused(true)
                    .build()?
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?
            };
            // On the paused clock the bound is virtual time: a case waiting
            // for something that never comes (a watchdog that never fires)
            // reaches it at once instead of hanging.
            let clock = if paused { "virtual" } else { "real" };
            let outcome = rt.block_on(async move {
                tokio::time::timeout(CASE_TIMEOUT, body(ctx))
                    .await
                    .map_err(|_| {
                        Failed::from(format!(
                            "case did not finish within {CASE_TIMEOUT:?} of {clock} time"
                        ))
                    })
            });
            rt.shutdown_timeout(Duration::from_secs(5));
            outcome
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(trial: Trial, times: &std::path::Path) -> Result<Completion, Failed> {
        run_timed("unit", trial.name().to_owned().as_str(), trial, times)
    }

    fn failure(trial: Trial, times: &std::path::Path) -> Failed {
        match one(trial, times) {
            Err(failed) => failed,
            Ok(_) => panic!("the trial should have failed"),
        }
    }

    #[test]
    fn timed_trials_keep_their_outcome_and_append_one_line_each() {
        let dir = tempfile::tempdir().expect("temp dir");
        let times = dir.path().join("times.tsv");
        assert!(matches!(
            one(Trial::test("a::passes", || Ok(())), &times),
            Ok(Completion::Completed)
        ));
        let failed = failure(Trial::test("a::fails", || Err("boom here".into())), &times);
        assert_eq!(failed.message(), Some("boom here"));
        let panicked = failure(Trial::test("a::panics", || panic!("it broke")), &times);
        assert!(panicked.message().is_some_and(|m| m.contains("it broke")));
        assert!(matches!(
            one(
                Trial::ignorable_test("a::skips", || Ok(Completion::ignored())),
                &times
            ),
            Ok(Completion::Ignored { .. })
        ));
        let text = std::fs::read_to_string(&times).expect("times file");
        let names: Vec<&str> = text
            .lines()
            .map(|l| {
                let (secs, name) = l.split_once('\t').expect("a tab");
                assert!(secs.parse::<f64>().is_ok(), "seconds first: {l}");
                name
            })
            .collect();
        assert_eq!(
            names,
            [
                "[unit] a::passes",
                "[unit] a::fails",
                "[unit] a::panics",
                "[unit] a::skips"
            ]
        );
    }

    #[test]
    fn wrapped_trials_keep_name_and_ignored_flag() {
        let dir = tempfile::tempdir().expect("temp dir");
        let trials = vec![
            Trial::test("b::plain", || Ok(())),
            Trial::test("b::ignored", || Ok(())).with_ignored_flag(true),
        ];
        let wrapped = timed_into("unit", trials, dir.path().join("t.tsv"));
        let seen: Vec<(&str, bool)> = wrapped
            .iter()
            .map(|t| (t.name(), t.has_ignored_flag()))
            .collect();
        assert_eq!(seen, [("b::plain", false), ("b::ignored", true)]);
    }
}
