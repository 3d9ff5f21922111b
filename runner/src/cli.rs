//! The command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::duration;

/// Runs commands under a distributed lock (Redis, Postgres, etcd) and kills
/// their whole process tree when the lock is lost.
#[derive(Debug, Parser)]
#[command(name = "lockrun", version, after_long_help = crate::exit::TABLE)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Acquires a lock, runs CMD in its own process group while renewing the
    /// lock, and kills the group if the lock is lost.
    #[command(after_long_help = crate::exit::TABLE)]
    Exec(ExecArgs),
    /// Runs the entries of a crontab-like FILE, each tick once across every
    /// runner started with the same file and backend.
    #[command(after_long_help = CRON_HELP)]
    Cron(CronArgs),
    /// Shows who holds a lock: identity, fencing token, when taken, renewed
    /// and due to expire. Exits 0 when held, 1 when free.
    #[command(after_long_help = crate::exit::ADMIN_TABLE)]
    Status(StatusArgs),
    /// Lists the held locks whose names start with PREFIX (every lock
    /// without one). Exits 0, also when none is held.
    #[command(after_long_help = crate::exit::ADMIN_TABLE)]
    Ls(LsArgs),
    /// Shows which runner leads an election (the leader-mode cron entries'
    /// election lock by default). Exits 0 when there is a leader, 1 when none.
    #[command(after_long_help = crate::exit::ADMIN_TABLE)]
    Leader(LeaderArgs),
    /// Frees a lock by force, only if its holder still has fencing token
    /// --token (read it with `status`); the holder sees its lock lost
    /// (forced) at its next renewal and kills its command. Exits 0 when
    /// released, 1 when nobody held it, 75 when another lease holds it.
    #[command(after_long_help = crate::exit::ADMIN_TABLE)]
    Release(ReleaseArgs),
    /// The watchdog process each runner starts (internal).
    #[command(name = "__keeper", hide = true)]
    Keeper,
}

/// Options of every subcommand that talks to a backend.
#[derive(Debug, Args)]
pub(crate) struct Common {
    /// The backend URL: redis://, rediss://, redis+sentinel://, redis+cluster://, postgres://, etcd://, etcds://
    /// (or memory:// to try things out). Default: the LOCK_URL variable.
    #[arg(long, value_name = "URL")]
    pub(crate) backend: Option<String>,
    /// Serves Prometheus metrics at http://ADDR/metrics; a METRICS_TOKEN
    /// variable requires `Authorization: Bearer <token>`.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// Logs as JSON lines instead of human-readable text (on stderr; the
    /// RUST_LOG variable sets the level, default info).
    #[arg(long)]
    pub(crate) log_json: bool,
    /// SIGTERM to the command's group, then SIGKILL after this grace
    /// (default: a quarter of the TTL, at most 10s; at most half the TTL).
    /// SIGKILL lands before the lock's local deadline in any case.
    #[arg(long, value_name = "D", value_parser = duration::parse)]
    pub(crate) kill_grace: Option<Duration>,
}

/// Options of the inspection and release commands.
#[derive(Debug, Args)]
pub(crate) struct AdminCommon {
    /// The backend URL, as for `exec`. Default: the LOCK_URL variable.
    #[arg(long, value_name = "URL")]
    pub(crate) backend: Option<String>,
    /// Prints JSON on stdout instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) common: AdminCommon,
    /// The lock's name.
    pub(crate) name: String,
}

#[derive(Debug, Args)]
pub(crate) struct LsArgs {
    #[command(flatten)]
    pub(crate) common: AdminCommon,
    /// Lists only names that start with this ([A-Za-z0-9._:/-], no wildcards).
    #[arg(default_value = "")]
    pub(crate) prefix: String,
    /// Stops after this many locks (the listing says when it stopped early).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub(crate) max: usize,
}

#[derive(Debug, Args)]
pub(crate) struct LeaderArgs {
    #[command(flatten)]
    pub(crate) common: AdminCommon,
    /// The election's lock name (`lockrun cron --election-name`).
    #[arg(default_value = "lockrun/leader")]
    pub(crate) name: String,
}

#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    pub(crate) common: AdminCommon,
    /// The lock's name.
    pub(crate) name: String,
    /// The fencing token of the lease to free, as `status` shows it; a
    /// successor with another token is never freed.
    #[arg(long, value_name = "T", required = true)]
    pub(crate) token: u64,
}

#[derive(Debug, Args)]
pub(crate) struct ExecArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// The lock's name ([A-Za-z0-9._:/-], at most 512 bytes).
    #[arg(long)]
    pub(crate) name: String,
    /// The lock's TTL: how long a crashed runner blocks others.
    #[arg(long, value_name = "D", value_parser = duration::parse, default_value = "30s")]
    pub(crate) ttl: Duration,
    /// Waits for the lock while it is held elsewhere, instead of exiting.
    #[arg(long)]
    pub(crate) wait: bool,
    /// With --wait: gives up after this long.
    #[arg(long, value_name = "D", value_parser = duration::parse, requires = "wait")]
    pub(crate) timeout: Option<Duration>,
    /// Stops the command once it has held the lock this long: SIGTERM to its
    /// group the kill grace before, SIGKILL at it; then the lock is released
    /// and the runner exits 76. At least the TTL.
    #[arg(long, value_name = "D", value_parser = duration::parse)]
    pub(crate) max_hold: Option<Duration>,
    /// The exit code when the lock is held elsewhere (default 75).
    #[arg(long, short = 'E', value_name = "N", default_value_t = crate::exit::HELD_ELSEWHERE)]
    pub(crate) conflict_exit_code: u8,
    /// The command and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub(crate) command: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct CronArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// The cron file.
    pub(crate) file: PathBuf,
    /// How far replicas' clocks may differ.
    #[arg(long, value_name = "D", value_parser = duration::parse, default_value = "5s")]
    pub(crate) skew_tolerance: Duration,
    /// The lock leader-mode entries elect their leader with.
    #[arg(long, value_name = "NAME", default_value = "lockrun/leader")]
    pub(crate) election_name: String,
    /// The election lock's TTL: a runner that dies while leader is replaced
    /// within this plus --election-interval.
    #[arg(long, value_name = "D", value_parser = duration::parse, default_value = "15s")]
    pub(crate) election_ttl: Duration,
    /// How often the other runners try to become leader.
    #[arg(long, value_name = "D", value_parser = duration::parse, default_value = "5s")]
    pub(crate) election_interval: Duration,
    /// On SIGTERM or SIGINT, how long running commands get to finish before
    /// they are killed.
    #[arg(long, value_name = "D", value_parser = duration::parse, default_value = "30s")]
    pub(crate) shutdown_timeout: Duration,
}

const CRON_HELP: &str = "\
The cron file: one entry per line, `#` starts a comment.

  NAME  SCHEDULE  [OPTION=VALUE ...]  --  SHELL COMMAND

  NAME      the job's name, also its lock's prefix ([A-Za-z0-9._:/-])
  SCHEDULE  5 fields (minute hour day month weekday), or 6 with seconds first
  OPTIONS   tz=Europe/Berlin    the schedule's time zone (default UTC)
            ttl=30s             the tick lock's TTL (default 30s)
            max-hold=10m        stop the command after this long: SIGTERM the kill
                                grace before, SIGKILL at it (default: none)
            missed=skip         or run-once, or run-all:WINDOW:MAX (e.g. run-all:1h:5)
            mode=per-tick       or leader (one elected runner fires every tick)
            delivery=at-most-once  or at-least-once: a tick whose runner stalled
                                or died after starting it is marked abandoned
                                (default), or taken over and run again
  COMMAND   run by /bin/sh -c, in a process group of its own; its output is
            printed with `[NAME] ` in front

A line of OPTION=VALUE words alone sets defaults for the entries below it.
The command sees LOCK_NAME, LOCK_FENCING_TOKEN, LOCKRUN_JOB and
LOCKRUN_SCHEDULED_AT (the tick, RFC 3339 UTC) in its environment.

Example:
  tz=Europe/Berlin ttl=30s
  reports/nightly  30 2 * * *      max-hold=1h missed=run-once -- /usr/local/bin/report --all
  cache/refresh    */10 * * * * *  mode=leader ttl=5s          -- curl -fsS http://localhost/refresh

Exit codes: 64 for a malformed file (with the line number), 69 if the
backend refuses the runner at start, 0 after a graceful stop on SIGINT or
SIGTERM (running commands get SIGTERM, then SIGKILL after the kill grace).";
