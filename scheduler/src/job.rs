//! Job definitions and their validation.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LockName, LockOptions, MAX_NAME_LEN};

use crate::{Delivery, Error, JobContext, JobError, MissedTicks, Result, Schedule};

/// The longest accepted job name, in bytes: a lock name is
/// `<job>/<tick in Unix ms>`, and the tick takes up to 20 bytes and the slash one.
pub const MAX_JOB_NAME_LEN: usize = MAX_NAME_LEN - 21;

/// The default lock TTL of a job's runs.
pub const DEFAULT_JOB_TTL: Duration = Duration::from_secs(30);

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), JobError>> + Send + 'static>>;
pub(crate) type Handler = Arc<dyn Fn(JobContext) -> BoxFuture + Send + Sync + 'static>;

/// A job: a name, a cron expression, a time zone, lock settings, a
/// missed-tick policy and an async handler.
///
/// The name is also the `job` metric label and the prefix of every per-tick
/// lock name, so it must be a valid lock name of at most
/// [`MAX_JOB_NAME_LEN`] bytes (`[A-Za-z0-9._:/-]`). Nothing is checked until
/// the job is added to a scheduler that is built; see
/// [`SchedulerBuilder::build`](crate::SchedulerBuilder::build).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use scheduler::{Job, MissedTicks};
///
/// let job = Job::new("billing/invoices", "0 30 2 * * *", |ctx| async move {
///     ctx.assert_held()?; // before every unsafe write
///     Ok(())
/// })
/// .with_time_zone("Europe/Berlin")
/// .with_ttl(Duration::from_secs(30))
/// .with_max_hold(Duration::from_secs(600))
/// .with_missed_ticks(MissedTicks::RunOnce);
/// # drop(job);
/// ```
#[derive(Clone)]
pub struct Job {
    name: String,
    cron: String,
    zone: String,
    ttl: Duration,
    max_hold: Option<Duration>,
    missed: MissedTicks,
    delivery: Delivery,
    handler: Handler,
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("name", &self.name)
            .field("cron", &self.cron)
            .field("zone", &self.zone)
            .field("ttl", &self.ttl)
            .field("max_hold", &self.max_hold)
            .field("missed", &self.missed)
            .field("delivery", &self.delivery)
            .finish()
    }
}

impl Job {
    /// A job named `name` running `handler` on the cron expression `cron`
    /// (5 fields, or 6 with seconds first), in UTC, with a 30 s lock TTL, no
    /// maximum hold and [`MissedTicks::Skip`].
    pub fn new<F, Fut>(name: impl Into<String>, cron: impl Into<String>, handler: F) -> Self
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), JobError>> + Send + 'static,
    {
        Self {
            name: name.into(),
            cron: cron.into(),
            zone: "UTC".into(),
            ttl: DEFAULT_JOB_TTL,
            max_hold: None,
            missed: MissedTicks::Skip,
            delivery: Delivery::default(),
            handler: Arc::new(move |ctx| Box::pin(handler(ctx))),
        }
    }

    /// As [`Job::new`], for a handler that already exists as a function with
    /// an error type of its own (`anyhow::Result<()>`, a service's error
    /// enum): any error convertible into [`JobError`] is accepted.
    ///
    /// [`Job::new`] fixes the error type instead, so that a closure using `?`
    /// on several error types needs no annotation.
    ///
    /// # Examples
    ///
    /// ```
    /// use scheduler::{Job, JobContext};
    ///
    /// #[derive(Debug)]
    /// struct ReportError;
    /// impl std::fmt::Display for ReportError {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         f.write_str("the report store refused the write")
    ///     }
    /// }
    /// impl std::error::Error for ReportError {}
    ///
    /// async fn nightly_report(ctx: JobContext) -> Result<(), ReportError> {
    ///     ctx.assert_held().map_err(|_| ReportError)?;
    ///     Ok(())
    /// }
    ///
    /// let job = Job::from_fn("reports/nightly", "0 0 3 * * *", nightly_report);
    /// # drop(job);
    /// ```
    pub fn from_fn<F, Fut, E>(name: impl Into<String>, cron: impl Into<String>, handler: F) -> Self
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<JobError> + 'static,
    {
        Self::new(name, cron, move |ctx| {
            let run = handler(ctx);
            async move { run.await.map_err(Into::into) }
        })
    }

    /// Reads the cron expression in the IANA time zone `zone` (default `UTC`).
    pub fn with_time_zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = zone.into();
        self
    }

    /// The TTL of the per-tick lock: how long a crashed runner blocks the
    /// tick (renewed every `ttl / 3` while the handler runs).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The longest a run may hold its lock; the watchdog then aborts it.
    /// `Duration::MAX` means no limit, the default.
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = (max_hold != Duration::MAX).then_some(max_hold);
        self
    }

    /// What to do with ticks nobody ran (default [`MissedTicks::Skip`]).
    pub fn with_missed_ticks(mut self, policy: MissedTicks) -> Self {
        self.missed = policy;
        self
    }

    /// What a tick promises when its runner stalls or dies after starting
    /// it (default [`Delivery::AtMostOnce`]; see the crate docs, "Why a tick
    /// runs once").
    pub fn with_delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = delivery;
        self
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks every setting and prepares the job to run.
    pub(crate) fn compile(
        self,
        limits: &lock_core::Capabilities,
        metrics: &crate::SchedulerMetrics,
    ) -> Result<JobSpec> {
        let invalid = |reason: String| Error::InvalidJob {
            job: self.name.clone(),
            reason,
        };
        let name = LockName::new(&self.name).map_err(|e| invalid(e.to_string()))?;
        if self.name.len() > MAX_JOB_NAME_LEN {
            return Err(invalid(format!(
                "a job name is at most {MAX_JOB_NAME_LEN} bytes (it prefixes per-tick lock names), this one has {}",
                self.name.len()
            )));
        }
        let schedule = Schedule::parse(&self.name, &self.cron, &self.zone)?;
        let mut options = LockOptions::new(self.ttl).with_metric_label(self.name.clone());
        if let Some(max_hold) = self.max_hold {
            options = options.with_max_hold(max_hold);
        }
        options
            .validate_for(limits)
            .map_err(|e| invalid(e.to_string()))?;
        self.missed.validate().map_err(invalid)?;
        Ok(JobSpec {
            name,
            schedule,
            options,
            missed: self.missed,
            delivery: self.delivery,
            handler: self.handler,
            runs: Mutex::default(),
            last_run: Mutex::default(),
            metrics: metrics.job(&self.name),
        })
    }
}

/// A validated job, shared by the tasks that run it.
pub(crate) struct JobSpec {
    pub(crate) name: LockName,
    pub(crate) schedule: Schedule,
    pub(crate) options: LockOptions,
    pub(crate) missed: MissedTicks,
    pub(crate) delivery: Delivery,
    pub(crate) handler: Handler,
    /// This job's runs in this process: one batch at a time, see `overlap`.
    pub(crate) runs: Mutex<crate::overlap::Runs>,
    /// The last tick that ended on this replica, and how, for
    /// [`Scheduler::status`](crate::Scheduler::status).
    pub(crate) last_run: Mutex<Option<(chrono::DateTime<chrono::Utc>, crate::TickOutcome)>>,
    pub(crate) metrics: crate::metrics::JobMetrics,
}

impl fmt::Debug for JobSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobSpec")
            .field("name", &self.name)
            .field("schedule", &self.schedule)
            .finish()
    }
}

impl JobSpec {
    pub(crate) fn label(&self) -> &str {
        self.name.as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> Job {
        Job::new(name, "* * * * * *", |_| async { Ok(()) })
    }

    fn metrics() -> crate::SchedulerMetrics {
        crate::SchedulerMetrics::register(&prometheus::Registry::new()).expect("a fresh registry")
    }

    fn reason(r: Result<JobSpec>) -> String {
        match r {
            Err(e @ Error::InvalidJob { .. }) => e.to_string(),
            other => panic!("expected InvalidJob, got {other:?}"),
        }
    }

    #[test]
    fn rejects_bad_names_ttls_and_policies() {
        let any = lock_core::Capabilities::new(lock_core::backend::Expiry::Ttl);
        let zero = &any;
        assert!(reason(job("has space").compile(zero, &metrics())).contains("not allowed"));
        assert!(reason(job("").compile(zero, &metrics())).contains("empty"));
        assert!(
            reason(job(&"a".repeat(MAX_JOB_NAME_LEN + 1)).compile(zero, &metrics()))
                .contains("at most")
        );
        assert!(
            reason(job("j").with_ttl(Duration::ZERO).compile(zero, &metrics())).contains("TTL")
        );
        assert!(reason(
            job("j")
                .with_ttl(Duration::from_secs(10))
                .with_max_hold(Duration::from_secs(1))
                .compile(zero, &metrics())
        )
        .contains("max_hold"));
        let bounded = lock_core::Capabilities::new(lock_core::backend::Expiry::Session)
            .with_min_ttl(Duration::from_secs(1))
            .with_max_ttl(Duration::from_secs(2));
        assert!(reason(
            job("j")
                .with_ttl(Duration::from_millis(50))
                .compile(&bounded, &metrics())
        )
        .contains("minimum"));
        assert!(reason(
            job("j")
                .with_ttl(Duration::from_secs(30))
                .compile(&bounded, &metrics())
        )
        .contains("maximum"));
        let policy = MissedTicks::RunAll {
            window: Duration::ZERO,
            max: 3,
        };
        assert!(
            reason(job("j").with_missed_ticks(policy).compile(zero, &metrics())).contains("window")
        );
        assert!(job(&"a".repeat(MAX_JOB_NAME_LEN))
            .compile(zero, &metrics())
            .is_ok());
    }

    #[test]
    fn bad_cron_and_zone_surface_their_own_errors() {
        let any = lock_core::Capabilities::new(lock_core::backend::Expiry::Ttl);
        let bad_cron =
            Job::new("j", "every minute", |_| async { Ok(()) }).compile(&any, &metrics());
        assert!(matches!(bad_cron, Err(Error::InvalidCron { .. })));
        let bad_zone = job("j")
            .with_time_zone("Europe/Atlantis")
            .compile(&any, &metrics());
        assert!(matches!(bad_zone, Err(Error::InvalidTimeZone { .. })));
    }
}
