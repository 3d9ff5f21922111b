//! The runner's exit codes and the error type that carries one.

use std::process::ExitCode;

/// Bad arguments or a malformed cron file (as `sysexits.h` `EX_USAGE`).
pub(crate) const USAGE: u8 = 64;
/// The backend could not be reached or refused the runner (`EX_UNAVAILABLE`).
pub(crate) const UNAVAILABLE: u8 = 69;
/// The runner itself failed (it could not start its watchdog, say).
pub(crate) const INTERNAL: u8 = 70;
/// The lock is held elsewhere (or was, until `--wait --timeout` ran out);
/// `--conflict-exit-code` changes it, as `flock -E` does.
pub(crate) const HELD_ELSEWHERE: u8 = 75;
/// The lock was lost while the command ran (stolen, expired, the backend
/// failed until the local deadline came near, or `--max-hold` was reached);
/// the command's process group was killed.
pub(crate) const LOCK_LOST: u8 = 76;
/// The command was found but could not be executed (as shells do).
pub(crate) const CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as shells do).
pub(crate) const NOT_FOUND: u8 = 127;

/// The exit-code table `lockrun --help` prints.
pub(crate) const TABLE: &str = "\
Exit codes:
  CMD's own    exec: the command's exit status (128+N if signal N ended it)
  64           bad arguments, or a malformed cron file (line number in the message)
  69           backend unavailable (unreachable, refused credentials, failed while acquiring)
  70           the runner itself failed (could not start its watchdog process)
  75           lock held elsewhere, or still held when --wait --timeout ran out
               (--conflict-exit-code N picks another, as flock -E does)
  76           lock lost while the command ran (stolen, expired, backend down until
               near the local deadline, or --max-hold reached): its process group was killed
  126, 127     the command could not be executed / was not found
  0            cron: stopped gracefully by SIGINT or SIGTERM (its commands stopped first)";

/// The exit-code table of `status`, `ls`, `leader` and `release`.
pub(crate) const ADMIN_TABLE: &str = "\
Exit codes:
  0            status/leader: held; ls: listed; release: released
  1            status: free; leader: no leader; release: nobody held it
  64           bad arguments (a name or prefix no lock can have, a missing --token)
  69           backend unavailable, or it does not offer inspection
  75           release: another lease holds the lock (its token is not --token); nothing freed";

/// `status`: the lock is free; `release`: nobody held it.
pub(crate) const NOT_HELD: u8 = 1;

/// Why the runner stops without a status of the command's own: carries the
/// exit code and a message for the log.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(INTERNAL, message)
    }

    /// The code and message for an error the lock library returned while
    /// connecting or acquiring.
    pub(crate) fn from_lock(e: &distlock::Error, conflict_code: u8) -> Self {
        use distlock::Error as E;
        let code = match e {
            E::HeldElsewhere { .. } | E::HeldLocally { .. } | E::Timeout { .. } => conflict_code,
            E::Config(_) | E::InvalidName { .. } => USAGE,
            E::LockLost { .. } => LOCK_LOST,
            _ => UNAVAILABLE,
        };
        Self::new(code, e.to_string())
    }

    pub(crate) fn exit_code(&self) -> ExitCode {
        ExitCode::from(self.code)
    }
}

/// The shell convention for a status: the exit code, or 128 + the signal.
pub(crate) fn status_code(status: rustix::process::WaitStatus) -> u8 {
    if let Some(code) = status.exit_status() {
        return u8::try_from(code & 0xff).unwrap_or(u8::MAX);
    }
    if let Some(signal) = status.terminating_signal() {
        return u8::try_from((128 + signal) & 0xff).unwrap_or(u8::MAX);
    }
    INTERNAL
}
