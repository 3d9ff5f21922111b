//! `distlock::from_env` and `scheduler::connect_from_env` through the real
//! process environment. The only test in its binary: it sets and removes
//! `LOCK_URL` and `SCHEDULER_LOCK_REQUIRED`, which no other test may see.

use std::time::Duration;

use conformance_tests::backends::redis::server::start_plain;
use conformance_tests::harness::free_port;
use conformance_tests::BoxError;
use distlock::{
    AcquireOutcome, Error, LockMode, LockName, LockOptions, LOCK_URL, SCHEDULER_LOCK_REQUIRED,
};
use prometheus::Registry;

fn set(url: Option<&str>, required: Option<&str>) {
    match url {
        Some(v) => std::env::set_var(LOCK_URL, v),
        None => std::env::remove_var(LOCK_URL),
    }
    match required {
        Some(v) => std::env::set_var(SCHEDULER_LOCK_REQUIRED, v),
        None => std::env::remove_var(SCHEDULER_LOCK_REQUIRED),
    }
}

fn config_message(r: distlock::Result<distlock::Locks>) -> Result<String, BoxError> {
    match r {
        Err(Error::Config(m)) => Ok(m),
        other => Err(format!("expected a configuration error, got {other:?}").into()),
    }
}

/// One attempt at `name`, and how it was counted.
async fn attempt(locks: &distlock::Locks, name: &str) -> Result<(bool, AcquireOutcome), BoxError> {
    let locker = locks.locker_with_registry(&Registry::new())?;
    let name = LockName::new(name)?;
    let got = locker
        .try_lock(&name, &LockOptions::new(Duration::from_secs(5)))
        .await;
    let held = match got {
        Ok(guard) => {
            guard.release().await?;
            true
        }
        Err(Error::Unavailable { .. }) => false,
        Err(e) => return Err(format!("unexpected {e}").into()),
    };
    let outcome = [
        AcquireOutcome::Acquired,
        AcquireOutcome::Unlocked,
        AcquireOutcome::Unavailable,
    ]
    .into_iter()
    .find(|o| locker.metrics().acquisitions(name.as_str(), *o) == 1)
    .ok_or("the attempt was not counted")?;
    Ok((held, outcome))
}

async fn walk_the_policy() -> Result<(), BoxError> {
    // Required without a URL: refused, naming both variables.
    set(None, Some("TRUE"));
    let message = config_message(distlock::from_env().await)?;
    assert!(
        message.contains(SCHEDULER_LOCK_REQUIRED) && message.contains(LOCK_URL),
        "{message}"
    );
    assert!(matches!(
        scheduler::connect_from_env().await,
        Err(scheduler::Error::LockRequired { .. })
    ));

    // A flag that is not a boolean: refused, naming the variable and the values.
    set(Some("memory://"), Some("perhaps"));
    let message = config_message(distlock::from_env().await)?;
    assert!(
        message.contains(SCHEDULER_LOCK_REQUIRED) && message.contains("true/false"),
        "{message}"
    );

    // No URL (unset or empty): unlocked, granted and counted `unlocked`.
    for url in [None, Some("")] {
        set(url, Some("no"));
        let locks = distlock::from_env().await?;
        assert_eq!(locks.mode(), LockMode::Unlocked);
        assert!(locks.lock_backend().is_none());
        assert_eq!(
            attempt(&locks, "env/unlocked").await?,
            (true, AcquireOutcome::Unlocked)
        );
        assert_eq!(
            scheduler::connect_from_env().await?.mode(),
            LockMode::Unlocked
        );
    }

    // A malformed URL: refused.
    set(Some("localhost:6379"), None);
    let message = config_message(distlock::from_env().await)?;
    assert!(message.contains("scheme://"), "{message}");

    // A server that is down: starts, and fails closed.
    let port = free_port()?;
    set(Some(&format!("redis://127.0.0.1:{port}")), Some("1"));
    let locks = distlock::from_env().await?;
    assert_eq!(locks.mode(), LockMode::Locked);
    assert_eq!(
        attempt(&locks, "env/down").await?,
        (false, AcquireOutcome::Unavailable)
    );

    // A server that answers: locked.
    let server = start_plain()?;
    set(
        Some(&format!("redis://127.0.0.1:{}", server.port())),
        Some("yes"),
    );
    let locks = distlock::from_env().await?;
    assert_eq!(
        attempt(&locks, "env/up").await?,
        (true, AcquireOutcome::Acquired)
    );
    set(None, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_picks_the_mode() -> Result<(), BoxError> {
    tokio::time::timeout(Duration::from_secs(60), walk_the_policy())
        .await
        .map_err(|_| "the walk through the policy took over 60 s")?
}
