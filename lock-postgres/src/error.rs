//! Turns `tokio-postgres` errors into [`BackendError`]s of the right kind.

use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind};
use tokio_postgres::error::SqlState;

/// Converts a client error, saying what was being done (`context`).
///
/// The kind follows what the caller should do about it: a server that cannot
/// be reached or a session that broke is `Unavailable`; a server-side
/// `statement_timeout` is `Timeout`; refused credentials or privileges are
/// `Auth`; a database that does not exist or a bad TLS setup is `Config`.
pub(crate) fn convert(context: &str, err: tokio_postgres::Error) -> BackendError {
    if let Some(db) = err.as_db_error() {
        if *db.code() == SqlState::OUT_OF_MEMORY && db.message().contains("shared memory") {
            return lock_table_full(context, db.message()).with_source(err);
        }
    }
    let kind = kind_of(&err);
    let detail = match err.as_db_error() {
        // The db error's own text names the problem ("permission denied for
        // schema public"); the generic "db error" display does not.
        Some(db) => format!("{context}: {} ({})", db.message(), db.code().code()),
        None => format!("{context}: {err}"),
    };
    BackendError::new(kind, detail).with_source(err)
}

fn kind_of(err: &tokio_postgres::Error) -> BackendErrorKind {
    if err.is_closed() {
        return BackendErrorKind::Unavailable;
    }
    if let Some(code) = err.code() {
        return kind_of_state(code);
    }
    // Kinds without a SQLSTATE are only visible through their display text.
    let text = err.to_string();
    if text.starts_with("error connecting") || text.starts_with("error communicating") {
        BackendErrorKind::Unavailable
    } else if text.starts_with("timeout") {
        BackendErrorKind::Timeout
    } else if text.starts_with("error performing TLS")
        || text.starts_with("invalid connection string")
        || text.starts_with("invalid configuration")
    {
        BackendErrorKind::Config
    } else if text.starts_with("authentication") {
        BackendErrorKind::Auth
    } else if text.starts_with("unexpected message") || text.starts_with("error parsing") {
        BackendErrorKind::Protocol
    } else {
        BackendErrorKind::Other
    }
}

fn kind_of_state(code: &SqlState) -> BackendErrorKind {
    let class = &code.code()[..2.min(code.code().len())];
    if *code == SqlState::QUERY_CANCELED || *code == SqlState::LOCK_NOT_AVAILABLE {
        BackendErrorKind::Timeout
    } else if *code == SqlState::INSUFFICIENT_PRIVILEGE
        || *code == SqlState::INVALID_PASSWORD
        || class == "28"
    {
        BackendErrorKind::Auth
    } else if *code == SqlState::INVALID_CATALOG_NAME || class == "42" {
        BackendErrorKind::Config
    } else if class == "57" || class == "08" || class == "53" {
        // Operator intervention (terminated, shutting down, starting up),
        // connection exceptions and insufficient resources (too many clients).
        BackendErrorKind::Unavailable
    } else {
        BackendErrorKind::Other
    }
}

/// The server's shared lock table is full (`53200 out of shared memory`).
///
/// Every session's advisory locks share one table of about
/// `max_locks_per_transaction × (max_connections + max_prepared_transactions)`
/// slots (6,400 with the defaults). It is a server setting that is too low
/// for the number of locks held, so the kind is `Config`; the session itself
/// is unharmed and keeps the locks it holds.
pub(crate) fn lock_table_full(context: &str, server_message: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Config,
        format!(
            "{context}: the server's shared lock table is full ({server_message}, 53200): all \
             sessions' locks share max_locks_per_transaction × (max_connections + \
             max_prepared_transactions) slots; raise max_locks_per_transaction on the server \
             (takes a restart) or hold fewer locks at once"
        ),
    )
}

/// The lock session landed on a standby (`standby`) or a read-only session.
///
/// Advisory locks live in the memory of the server the session is on and
/// are not replicated, so a lock taken there would exclude nothing on the
/// primary. The kind is `Config`: the URL points at the wrong server.
pub(crate) fn read_only_session(standby: bool) -> BackendError {
    let what = if standby {
        "the server is a standby (pg_is_in_recovery() is true)"
    } else {
        "the session is read-only (transaction_read_only is on)"
    };
    config(format!(
        "refusing to take locks: {what}; advisory locks are not replicated, so locks taken \
         there exclude nothing on the primary. Point the URL at the primary, or list every \
         host with target_session_attrs=read-write \
         (postgres://h1:5432,h2:5432/db?target_session_attrs=read-write)"
    ))
}

/// The error for a call that did not finish within `limit`.
pub(crate) fn timed_out(context: &str, limit: Duration) -> BackendError {
    BackendError::timeout(format!("{context}: no answer within {limit:?}"))
}

/// A configuration error.
pub(crate) fn config(message: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Config, message)
}

/// An answer of an unexpected shape.
pub(crate) fn protocol(message: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, message)
}

/// A statement ran on a different server process than the session's:
/// a pooler in transaction mode sits between us and the server.
pub(crate) fn pooler(expected: i32, actual: i32) -> BackendError {
    config(format!(
        "pg_backend_pid() changed from {expected} to {actual} on one connection: a \
         transaction-mode pooler (such as PgBouncer with pool_mode=transaction) sits in front \
         of the server; session advisory locks need a direct connection or a session-mode pool"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_map_to_what_the_caller_should_do() {
        let cases = [
            ("28P01", BackendErrorKind::Auth),        // wrong password
            ("28000", BackendErrorKind::Auth),        // no such role / rejected by pg_hba
            ("42501", BackendErrorKind::Auth),        // no CREATE on the schema
            ("3D000", BackendErrorKind::Config),      // no such database
            ("42P01", BackendErrorKind::Config),      // no such relation
            ("57014", BackendErrorKind::Timeout),     // statement_timeout
            ("57P01", BackendErrorKind::Unavailable), // pg_terminate_backend
            ("57P05", BackendErrorKind::Unavailable), // idle_session_timeout
            ("57P03", BackendErrorKind::Unavailable), // starting up
            ("53300", BackendErrorKind::Unavailable), // too many connections
            ("22012", BackendErrorKind::Other),       // division by zero
        ];
        for (code, kind) in cases {
            assert_eq!(kind_of_state(&SqlState::from_code(code)), kind, "{code}");
        }
    }

    #[test]
    fn a_full_lock_table_names_the_setting() {
        let e = lock_table_full("pg_try_advisory_lock", "out of shared memory");
        assert_eq!(e.kind(), BackendErrorKind::Config);
        assert!(e.message().contains("max_locks_per_transaction"));
    }

    #[test]
    fn the_pooler_error_names_the_problem() {
        let e = pooler(10, 11);
        assert_eq!(e.kind(), BackendErrorKind::Config);
        assert!(e.message().contains("transaction-mode pooler"));
        assert!(e.message().contains("10") && e.message().contains("11"));
    }
}
