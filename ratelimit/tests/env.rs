//! Defaults from the environment, read through `RateLimitConfig::from_values`.

use std::num::NonZeroU32;

use distlock_ratelimit::{Error, OnStoreError, RateLimitConfig};

fn config(vars: &[(&str, &str)]) -> Result<RateLimitConfig, Error> {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    RateLimitConfig::from_values(move |name| {
        vars.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| Ok(v.clone()))
    })
}

#[test]
fn no_url_keeps_limits_in_process_and_fails_open_by_default() -> Result<(), Error> {
    let c = config(&[])?;
    assert_eq!(c.store().kind(), "memory");
    assert_eq!(c.on_store_error(), OnStoreError::FALLBACK);
    Ok(())
}

#[test]
fn the_locks_url_is_used_unless_the_rate_limit_url_is_set() -> Result<(), Error> {
    let c = config(&[("LOCK_URL", "redis://127.0.0.1:6379")])?;
    assert_eq!(c.store().kind(), "redis");
    let c = config(&[("LOCK_URL", "redis+cluster://127.0.0.1:7000,127.0.0.1:7001")])?;
    assert_eq!(c.store().kind(), "redis");
    let c = config(&[("LOCK_URL", "redis+sentinel://127.0.0.1:26379/locks")])?;
    assert_eq!(c.store().kind(), "redis");
    let e = config(&[("LOCK_URL", "redis+sentinel://u:hunter2@127.0.0.1:26379")])
        .expect_err("no master name");
    assert!(e.to_string().contains("master-name"), "{e}");
    assert!(!e.to_string().contains("hunter2"), "{e}");
    let c = config(&[
        ("LOCK_URL", "redis://127.0.0.1:6379"),
        ("RATE_LIMIT_URL", "postgres://postgres@127.0.0.1:5432/test"),
    ])?;
    assert_eq!(c.store().kind(), "postgres");
    // Locks on etcd, limits on Redis: fine; limits on etcd: refused.
    let c = config(&[
        ("LOCK_URL", "etcd://127.0.0.1:2379"),
        ("RATE_LIMIT_URL", "redis://127.0.0.1:6379"),
    ])?;
    assert_eq!(c.store().kind(), "redis");
    assert!(matches!(
        config(&[("LOCK_URL", "etcd://127.0.0.1:2379")]),
        Err(Error::Unsupported(_))
    ));
    Ok(())
}

#[test]
fn fail_open_false_denies_and_replicas_set_the_share() -> Result<(), Error> {
    let c = config(&[
        ("LOCK_URL", "memory://"),
        ("RATE_LIMIT_REDIS_FAIL_OPEN", "false"),
    ])?;
    assert_eq!(c.on_store_error(), OnStoreError::Deny);
    let c = config(&[("RATE_LIMIT_FALLBACK_REPLICAS", "3")])?;
    assert_eq!(
        c.on_store_error(),
        OnStoreError::Fallback {
            replicas: NonZeroU32::new(3).ok_or(Error::EmptyKey)?
        }
    );
    for bad in [
        ("RATE_LIMIT_REDIS_FAIL_OPEN", "yes please"),
        ("RATE_LIMIT_FALLBACK_REPLICAS", "0"),
        ("RATE_LIMIT_FALLBACK_REPLICAS", "-1"),
        ("RATE_LIMIT_URL", "ftp://example"),
    ] {
        assert!(matches!(config(&[bad]), Err(Error::Config(_))), "{bad:?}");
    }
    Ok(())
}

#[test]
fn a_postgres_url_that_requires_tls_is_refused_at_start() {
    let err = config(&[(
        "RATE_LIMIT_URL",
        "postgres://app:hunter2@db/x?sslmode=require",
    )])
    .expect_err("TLS required");
    assert!(err.to_string().contains("with_client"), "{err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

#[test]
fn a_password_in_a_bad_url_is_never_repeated() {
    let err = config(&[("RATE_LIMIT_URL", "redis://app:hunter2@[::1")]).expect_err("bad URL");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = config(&[("RATE_LIMIT_URL", "redis+cluster://app:hunter2@")]).expect_err("no hosts");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let err = config(&[("RATE_LIMIT_URL", "postgres://app:hunter2@host:notaport/db")])
        .expect_err("bad URL");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}
