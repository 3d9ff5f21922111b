//! A lock session on a read-only server is refused with a clear error:
//! advisory locks are not replicated, so a lock taken on a standby would
//! exclude nothing on the primary. A session made read-only through the URL
//! (`default_transaction_read_only=on`) takes the same path as a standby.

use std::time::Duration;

use lock_core::{BackendErrorKind, LockBackend, LockName, OwnerToken};
use lock_postgres::{PostgresBuilder, ENV_VAR};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_session_takes_no_lock() {
    let Ok(url) = std::env::var(ENV_VAR) else {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "{ENV_VAR} must be set in CI");
        eprintln!("!!! SKIPPING: {ENV_VAR} is not set");
        return;
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    let read_only = format!("{url}{sep}options=-c%20default_transaction_read_only%3Don");
    let builder = PostgresBuilder::from_url(&read_only).expect("a valid URL");
    let attempt = tokio::time::timeout(Duration::from_secs(20), async {
        let backend = builder.connect().await?;
        let name = LockName::new("read-only/refused").expect("a valid name");
        let owner = OwnerToken::generate().expect("a token");
        backend
            .try_acquire(&name, &owner, Duration::from_secs(5))
            .await
            .map(|_| ())
    })
    .await
    .expect("the attempt ends within 20 s");
    let err = attempt.expect_err("a read-only session takes no lock");
    assert_eq!(err.kind(), BackendErrorKind::Config, "{err}");
    let message = err.to_string();
    assert!(
        message.contains("read-only") && message.contains("target_session_attrs=read-write"),
        "the error says what is wrong and what to do: {message}"
    );
}
