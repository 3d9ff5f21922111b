//! One cron entry as a scheduler job: `/bin/sh -c COMMAND` in a process
//! group of its own, supervised under the tick's lock.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use distlock::scheduler::chrono::SecondsFormat;
use distlock::scheduler::{Job, JobContext, JobError};
use distlock::CancellationToken;
use tokio::time::Instant;
use tracing::warn;

use super::file::Entry;
use crate::exit;
use crate::group::Group;
use crate::keeper::Keeper;
use crate::reaper::Reaper;
use crate::supervise::{supervise, Cause, KillTiming};

/// The longest output line passed through whole; longer ones are split.
const MAX_LINE: u64 = 64 * 1024;

/// What every run of one entry needs.
#[derive(Debug)]
struct Spec {
    name: String,
    command: String,
    timing: KillTiming,
    max_hold: Option<Duration>,
    reaper: Reaper,
    keeper: Arc<Keeper>,
}

/// The scheduler job for `entry`.
pub(super) fn job(entry: &Entry, timing: KillTiming, reaper: &Reaper, keeper: &Arc<Keeper>) -> Job {
    let spec = Arc::new(Spec {
        name: entry.name.clone(),
        command: entry.command.clone(),
        timing,
        max_hold: entry.max_hold,
        reaper: reaper.clone(),
        keeper: Arc::clone(keeper),
    });
    // No max hold on the tick's lease: the supervisor enforces it, so that
    // the tick's lock is let go only once the group is gone (see supervise).
    Job::new(entry.name.clone(), entry.schedule.clone(), move |ctx| {
        let spec = Arc::clone(&spec);
        async move { spec.run(ctx).await }
    })
    .with_time_zone(entry.tz.clone())
    .with_ttl(entry.ttl)
    .with_missed_ticks(entry.missed)
    .with_delivery(entry.delivery)
}

impl Spec {
    /// One run. The group is supervised by a task of its own, so that it is
    /// stopped properly even when the scheduler drops this future: on a loss
    /// the scheduler aborts the run and frees the tick's lock at once, so the
    /// drop sends SIGKILL right away rather than after a grace.
    async fn run(&self, ctx: JobContext) -> Result<(), JobError> {
        let started = Instant::now();
        let hard = CancellationToken::new();
        let _kill_on_drop = hard.clone().drop_guard();
        let lease = ctx.lease().clone();
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(&self.command)
            .env("LOCK_NAME", lease.name().as_str())
            .env("LOCKRUN_JOB", &self.name)
            .env(
                "LOCKRUN_SCHEDULED_AT",
                ctx.scheduled_at()
                    .to_rfc3339_opts(SecondsFormat::Millis, true),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match lease.fencing_token() {
            Some(t) => command.env("LOCK_FENCING_TOKEN", t.to_string()),
            None => command.env_remove("LOCK_FENCING_TOKEN"),
        };
        let (group, mut child) = Group::spawn(&self.reaper, &self.keeper, &mut command)
            .map_err(|e| format!("cannot run /bin/sh: {e}"))?;
        if let Some(out) = child.stdout.take() {
            pass_through(out, self.name.clone(), false);
        }
        if let Some(err) = child.stderr.take() {
            pass_through(err, self.name.clone(), true);
        }
        let (timing, soft) = (self.timing, ctx.cancellation_token());
        let max_hold_at = self.max_hold.and_then(|m| started.checked_add(m));
        let supervisor = tokio::spawn(async move {
            supervise(group, &lease, timing, max_hold_at, None, &soft, &hard).await
        });
        let ended = supervisor
            .await
            .map_err(|e| format!("the supervisor of the command failed: {e}"))?;
        match ended.cause {
            Cause::Exited => match ended.status.map(exit::status_code) {
                Some(0) => Ok(()),
                Some(code) => Err(format!("the command exited with status {code}").into()),
                None => Err("the command's status could not be collected".into()),
            },
            cause => Err(format!("the command was stopped: {cause:?}").into()),
        }
    }
}

/// Copies a command's output to the runner's, `[NAME] ` before each line,
/// on a thread of its own until every process holding the pipe is gone.
fn pass_through(pipe: impl Read + Send + 'static, name: String, stderr: bool) {
    let job = name.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("output {name}"))
        .spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let written = if stderr {
                    write_line(&mut std::io::stderr().lock(), &name, &line)
                } else {
                    write_line(&mut std::io::stdout().lock(), &name, &line)
                };
                if written.is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        warn!(%job, error = %e, "cannot pass the command's output through; it is dropped");
    }
}

fn write_line(out: &mut impl Write, name: &str, line: &[u8]) -> std::io::Result<()> {
    write!(out, "[{name}] ")?;
    out.write_all(line)?;
    out.flush()
}
