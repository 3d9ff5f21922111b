//! The scheduler's error type.

use std::time::Duration;

/// `Result` with this crate's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error a job handler returns; the run is then counted as `failure`.
pub type JobError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong when building, starting or stopping a scheduler.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A job's cron expression could not be parsed.
    #[error("job {job:?}: invalid cron expression {expr:?}: {reason}; use 5 fields (minute hour day month weekday) or 6 with seconds first")]
    InvalidCron {
        /// The job.
        job: String,
        /// The rejected expression.
        expr: String,
        /// What the parser reported.
        reason: String,
    },
    /// A job's time zone is not an IANA zone name.
    #[error("job {job:?}: unknown time zone {zone:?}; use an IANA name such as \"Europe/Berlin\" or \"UTC\"")]
    InvalidTimeZone {
        /// The job.
        job: String,
        /// The rejected zone name.
        zone: String,
    },
    /// A job definition is inconsistent (bad name, TTL, max hold, missed-tick policy).
    #[error("job {job:?}: {reason}")]
    InvalidJob {
        /// The job.
        job: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A scheduler-wide setting is out of range (zero interval, zero tolerance, duplicate job).
    #[error("invalid scheduler configuration: {0}")]
    Config(String),
    /// The scheduler's metrics could not be registered.
    #[error("cannot register scheduler metrics: {0}")]
    Metrics(String),
    /// `start` was called on a scheduler that is already running or was shut down.
    #[error("the scheduler was already started; build a new one to start again")]
    AlreadyStarted,
    /// Shutdown's deadline passed while some jobs were still running; their
    /// runs were aborted and their locks released.
    #[error("{still_running} job(s) were still running {deadline:?} after shutdown began and were aborted; have handlers watch JobContext::cancellation_token to stop in time")]
    ShutdownTimedOut {
        /// The deadline given to `shutdown`.
        deadline: Duration,
        /// Jobs with a run still going when it passed.
        still_running: usize,
    },
    /// A backend URL could not be parsed.
    #[error("invalid backend URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL, its credentials masked by [`lock_core::redact::redact_url`].
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A backend URL names a scheme no backend handles.
    #[error("unknown backend scheme `{scheme}`; supported: memory://, redis://, rediss://, postgres://, postgresql://, etcd://")]
    UnknownScheme {
        /// The scheme.
        scheme: String,
    },
    /// A backend URL names a backend this build does not include.
    #[error("backend `{backend}` is not compiled in; enable the `{feature}` feature")]
    BackendNotCompiled {
        /// The backend.
        backend: &'static str,
        /// The cargo feature that adds it.
        feature: &'static str,
    },
    /// A server backend named by [`connect`](crate::connect) could not be set up.
    #[error("cannot connect to the {backend} backend: {source}")]
    Connect {
        /// The backend (`redis`, `postgres`, `etcd`).
        backend: &'static str,
        /// What the backend reported.
        #[source]
        source: lock_core::BackendError,
    },
    /// An environment variable of the availability policy has a value that
    /// cannot be used.
    #[error("{variable}: {reason}")]
    InvalidVariable {
        /// The variable.
        variable: &'static str,
        /// What is wrong with its value and what it accepts.
        reason: String,
    },
    /// A lock backend is required ([`SCHEDULER_LOCK_REQUIRED`](crate::SCHEDULER_LOCK_REQUIRED))
    /// but none is configured.
    #[error("{variable} is true but {url_variable} is not set: set {url_variable} to the lock backend's URL (redis://, postgres://, etcd://, memory://), or unset {variable} to run unlocked on a single replica")]
    LockRequired {
        /// The variable that requires a backend.
        variable: &'static str,
        /// The variable that names the backend.
        url_variable: &'static str,
    },
    /// An error from the lock layer (names, options, backend).
    #[error(transparent)]
    Lock(#[from] lock_core::Error),
}
