//! The availability policy a service takes from its environment: which
//! backend, and what to do without one or while it is down.

use std::fmt;

use lock_core::redact::redact_url;
use tracing::warn;

use crate::connect::{connect_with, split_scheme, Start};
use crate::{Backend, Error, LockMode, Result};

/// The variable holding the lock backend's URL (any scheme [`connect`]
/// knows). Unset or empty means no backend: jobs run unlocked.
///
/// [`connect`]: crate::connect
pub const LOCK_URL: &str = "LOCK_URL";

/// The variable that, set to `true`, refuses to start without [`LOCK_URL`]
/// instead of running unlocked. Accepts `true`/`false`, `1`/`0`, `yes`/`no`
/// in any case; unset or empty means `false`.
pub const SCHEDULER_LOCK_REQUIRED: &str = "SCHEDULER_LOCK_REQUIRED";

/// What a service does about locking, as its environment sets it.
///
/// | [`LOCK_URL`] | [`SCHEDULER_LOCK_REQUIRED`] | at start | while running |
/// |---|---|---|---|
/// | unset | unset or false | starts, warns | every run goes ahead unlocked, warned, counted `unlocked` |
/// | unset | true | refuses, naming the variable | |
/// | set, server answers | any | starts | ticks run under their lock |
/// | set, server down | any | starts, warns | ticks are skipped as `unavailable` until the server answers, then run |
/// | malformed, or refused by the server (password, database, TLS) | any | refuses | |
///
/// Build it from the environment with [`Policy::from_env`], or from values
/// with [`Policy::from_vars`] (tests, other configuration sources).
#[derive(Clone, PartialEq, Eq)]
pub struct Policy {
    url: Option<String>,
    lock_required: bool,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("lock_required", &self.lock_required)
            .finish()
    }
}

impl Policy {
    /// Reads [`LOCK_URL`] and [`SCHEDULER_LOCK_REQUIRED`] from the process
    /// environment and checks them as [`Policy::from_vars`] does.
    ///
    /// # Errors
    ///
    /// As [`Policy::from_vars`]; also [`Error::InvalidVariable`] for a value
    /// that is not valid Unicode.
    pub fn from_env() -> Result<Self> {
        let url = read_var(LOCK_URL)?;
        let required = read_var(SCHEDULER_LOCK_REQUIRED)?;
        Self::from_vars(url.as_deref(), required.as_deref())
    }

    /// The policy for these values of [`LOCK_URL`] and
    /// [`SCHEDULER_LOCK_REQUIRED`] (`None` or empty: unset). Touches neither
    /// the environment nor the network: the URL's scheme is checked here,
    /// the rest of it by [`Policy::connect`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidVariable`] for a [`SCHEDULER_LOCK_REQUIRED`] that is
    /// not a boolean; [`Error::LockRequired`] when it is true and no URL is
    /// set; [`Error::InvalidUrl`] for a URL without a valid `scheme://`.
    pub fn from_vars(url: Option<&str>, required: Option<&str>) -> Result<Self> {
        let lock_required = parse_bool(SCHEDULER_LOCK_REQUIRED, required)?;
        let url = url.map(str::trim).filter(|u| !u.is_empty());
        match url {
            None if lock_required => Err(Error::LockRequired {
                variable: SCHEDULER_LOCK_REQUIRED,
                url_variable: LOCK_URL,
            }),
            None => Ok(Self {
                url: None,
                lock_required,
            }),
            Some(url) => {
                split_scheme(url)?;
                Ok(Self {
                    url: Some(url.to_owned()),
                    lock_required,
                })
            }
        }
    }

    /// The backend URL, if one is set.
    pub fn url(&self) -> Option<&str> {
        self.url.as_deref()
    }

    /// Whether a backend is required ([`SCHEDULER_LOCK_REQUIRED`]).
    pub fn lock_required(&self) -> bool {
        self.lock_required
    }

    /// Whether jobs will run under distributed locks.
    pub fn mode(&self) -> LockMode {
        if self.url.is_some() {
            LockMode::Locked
        } else {
            LockMode::Unlocked
        }
    }

    /// Builds the backend this policy names.
    ///
    /// Without a URL: [`Backend::unlocked`], with a warning now and on
    /// every run. With one: the backend, as [`connect`](crate::connect)
    /// builds it, except that a server that does not answer (refused,
    /// timed out) does not stop the start. The backend then connects on
    /// demand, one attempt at a time, and every lock attempt fails closed
    /// with an `unavailable` error until the server answers: the scheduler
    /// skips those ticks (counted `unavailable`) and runs the next one
    /// after the server is back.
    ///
    /// # Errors
    ///
    /// As [`connect`](crate::connect), except for an unreachable server:
    /// a malformed URL, a backend this build leaves out, or a server that
    /// answers and refuses (a wrong password, a missing database, a TLS
    /// mismatch) still fail here.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call leaves no connection behind.
    pub async fn connect(&self) -> Result<Backend> {
        match &self.url {
            Some(url) => connect_with(url, Start::Deferred).await,
            None => {
                warn!(
                    "{LOCK_URL} is not set: jobs run without a distributed lock, which is \
                     safe for a single replica only; set {LOCK_URL} (or \
                     {SCHEDULER_LOCK_REQUIRED}=true to refuse to start without it)"
                );
                Ok(Backend::unlocked())
            }
        }
    }
}

/// Builds the backend the environment names: [`Policy::from_env`], then
/// [`Policy::connect`]. The entry point for a service.
///
/// # Errors
///
/// As [`Policy::from_env`] and [`Policy::connect`].
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn connect_from_env() -> Result<Backend> {
    Policy::from_env()?.connect().await
}

/// The value of `name`; unset or empty is `None`.
fn read_var(name: &'static str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::InvalidVariable {
            variable: name,
            reason: "the value is not valid Unicode".into(),
        }),
    }
}

/// `true`/`false`, `1`/`0`, `yes`/`no` in any case; unset or empty is `false`.
fn parse_bool(name: &'static str, value: Option<&str>) -> Result<bool> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(false);
    };
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => {
            // A flag carries no secret, but something pasted into it by
            // mistake might: a long value is not shown.
            let shown = if value.chars().count() <= 16 {
                format!("{value:?}")
            } else {
                format!("a value of {} characters", value.chars().count())
            };
            Err(Error::InvalidVariable {
                variable: name,
                reason: format!("{shown} is not a boolean; use true/false, 1/0 or yes/no"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lock_core::AcquireOutcome;
    use prometheus::Registry;

    use super::*;
    use crate::{Job, Scheduler};

    #[test]
    fn values_map_to_a_mode_or_a_start_error() -> Result<()> {
        let unlocked = Policy::from_vars(None, None)?;
        assert_eq!(
            (unlocked.mode(), unlocked.url(), unlocked.lock_required()),
            (LockMode::Unlocked, None, false)
        );
        assert_eq!(Policy::from_vars(Some("  "), Some(""))?, unlocked);
        for yes in ["true", "TRUE", "1", "yes", " Yes "] {
            let p = Policy::from_vars(Some("redis://h:6379"), Some(yes))?;
            assert!(p.lock_required(), "{yes:?}");
            assert_eq!(p.mode(), LockMode::Locked);
            assert_eq!(p.url(), Some("redis://h:6379"));
        }
        for no in ["false", "False", "0", "no", "NO"] {
            assert!(
                !Policy::from_vars(None, Some(no))?.lock_required(),
                "{no:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn required_without_a_url_names_both_variables() {
        for url in [None, Some(""), Some(" ")] {
            let err = Policy::from_vars(url, Some("true")).expect_err("refused");
            assert!(matches!(err, Error::LockRequired { .. }), "{err:?}");
            let text = err.to_string();
            assert!(
                text.contains(SCHEDULER_LOCK_REQUIRED) && text.contains(LOCK_URL),
                "{text}"
            );
        }
    }

    #[test]
    fn a_bad_flag_names_the_variable_and_the_accepted_values() {
        for bad in ["maybe", "2", "on", "truee", "y"] {
            let err = Policy::from_vars(Some("redis://h"), Some(bad)).expect_err(bad);
            let text = err.to_string();
            assert!(
                matches!(err, Error::InvalidVariable { .. }),
                "{bad}: {err:?}"
            );
            assert!(text.starts_with(SCHEDULER_LOCK_REQUIRED), "{text}");
            assert!(text.contains("true/false, 1/0 or yes/no"), "{text}");
            assert!(text.contains(bad), "shows a short value: {text}");
        }
        let pasted = "redis://u:s3cretpassword@host:6379";
        let text = Policy::from_vars(None, Some(pasted))
            .expect_err("not a flag")
            .to_string();
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[test]
    fn a_url_without_a_scheme_fails_and_hides_its_password() {
        for bad in ["u:s3cret@host:6379", "://u:s3cret@h", "1redis://u:s3cret@h"] {
            let err = Policy::from_vars(Some(bad), None).expect_err(bad);
            assert!(matches!(err, Error::InvalidUrl { .. }), "{bad}: {err:?}");
            assert!(!format!("{err} {err:?}").contains("s3cret"), "{err}");
        }
        let policy =
            Policy::from_vars(Some("redis://u:s3cret@h:6379"), None).expect("a well-formed URL");
        assert!(!format!("{policy:?}").contains("s3cret"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_url_runs_every_tick_unlocked_and_counts_it() -> Result<()> {
        let backend = Policy::from_vars(None, Some("no"))?.connect().await?;
        assert_eq!(backend.mode(), LockMode::Unlocked);
        assert!(backend.lock_backend().is_none());
        let registry = Registry::new();
        let locker = backend.locker(&registry)?;
        assert!(locker.backend().is_none(), "an unlocked Locker");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job::new("unlocked/every-second", "* * * * * *", move |_| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(());
                Ok(())
            }
        });
        let scheduler = Scheduler::builder(locker.clone(), backend.tick_store())
            .with_registry(&registry)
            .with_job(job)
            .build()?;
        let scheduler = scheduler.start()?;
        // Two runs: each tick is counted, and the tick store lets the second
        // one through after the first was recorded.
        let runs = tokio::time::timeout(Duration::from_secs(10), async {
            rx.recv().await;
            rx.recv().await;
        })
        .await;
        scheduler.shutdown(Duration::from_secs(5)).await?;
        assert!(runs.is_ok(), "two ticks did not run within 10 s");
        let job = "unlocked/every-second";
        assert!(locker.metrics().acquisitions(job, AcquireOutcome::Unlocked) >= 2);
        assert_eq!(
            locker
                .metrics()
                .acquisitions(job, AcquireOutcome::Unavailable),
            0
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_url_is_checked_before_anything_connects() {
        let err = Policy::from_vars(Some("ftp://h"), None)
            .expect("the scheme is well-formed")
            .connect()
            .await
            .expect_err("no backend handles ftp");
        assert!(matches!(err, Error::UnknownScheme { .. }), "{err:?}");
    }
}
