//! Redis-specific tests of transport and access: TLS with a self-signed
//! certificate, a least-privilege ACL user, and bad configuration.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{BackendErrorKind, LockBackend, LockName, LockOptions, OwnerToken, TickStore};
use lock_redis::RedisBuilder;
use tokio::time::{timeout, Instant};

use super::specific::{ensure, locker_over, plain, tracing_line};
use super::{config_for, server, RedisFactory, CONNECT_TIMEOUT, TTL};
use crate::harness::free_port;
use crate::BoxError;

/// The ACL rules the crate documents, for a user limited to `prefix`.
pub fn acl_rules(prefix: &str) -> Vec<String> {
    let mut rules = vec![
        "on".to_owned(),
        "resetkeys".to_owned(),
        format!("~{prefix}*"),
        "resetchannels".to_owned(),
        format!("&{prefix}*"),
        "-@all".to_owned(),
    ];
    for cmd in [
        "get",
        "set",
        "exists",
        "incr",
        "pexpire",
        "del",
        "publish",
        "subscribe",
        "unsubscribe",
        "evalsha",
        "eval",
        "ping",
        "time",
    ] {
        rules.push(format!("+{cmd}"));
    }
    rules
}

fn expect_kind(
    what: &str,
    got: Result<impl std::fmt::Debug, lock_core::BackendError>,
    kind: BackendErrorKind,
    needle: &str,
) -> Result<(), BoxError> {
    match got {
        Err(e) if e.kind() == kind && e.to_string().contains(needle) => {
            tracing_line(&format!("{what}: {e}"));
            Ok(())
        }
        other => Err(
            format!("{what}: expected a {kind:?} error naming {needle:?}, got {other:?}").into(),
        ),
    }
}

pub(super) async fn tls_self_signed(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let certs = crate::harness::certs::test_certs(dir.path(), "server")?;
    let ca = certs.ca_pem()?;
    let wrong_ca = std::fs::read(&certs.other_ca)?;
    let srv = server::start_tls(dir.path(), "server")?;
    let port = srv.port();
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("rediss://{host}:{port}");
        let backend = config_for(&url)?
            .with_key_prefix(f.prefix())
            .with_ca_certificate_pem(ca.clone())
            .connect()
            .await?;
        let (locker, _) = locker_over(Arc::new(backend.clone()))?;
        let name = LockName::new(format!("specific/tls-{host}"))?;
        let guard = locker.try_lock(&name, &LockOptions::new(TTL)).await?;
        tokio::time::sleep(TTL / 2).await;
        guard.assert_held()?;
        // The first subscription opens its own TLS connection within the
        // operation timeout, or falls back to polling (documented); on a
        // loaded machine the handshake may miss it once.
        let mut signal = None;
        for _ in 0..3 {
            signal = backend.subscribe_release(&name).await?;
            if signal.is_some() {
                break;
            }
        }
        ensure(signal.is_some(), "no release notification over TLS")?;
        guard.release().await?;
        timeout(Duration::from_millis(500), async {
            if let Some(s) = signal {
                s.await;
            }
        })
        .await
        .map_err(|_| "release not announced over TLS")?;
    }
    let url = format!("rediss://127.0.0.1:{port}");
    expect_kind(
        "wrong CA",
        config_for(&url)?
            .with_ca_certificate_pem(wrong_ca)
            .connect()
            .await,
        BackendErrorKind::Config,
        "TLS",
    )?;
    expect_kind(
        "system roots only",
        config_for(&url)?.connect().await,
        BackendErrorKind::Config,
        "TLS",
    )?;
    expect_kind(
        "plaintext to the TLS port",
        config_for(&format!("redis://127.0.0.1:{port}"))?
            .connect()
            .await,
        BackendErrorKind::Unavailable,
        "rediss://",
    )?;
    let plain_port = f.url().rsplit(':').next().unwrap_or_default().to_owned();
    expect_kind(
        "TLS to a plaintext port",
        config_for(&format!("rediss://127.0.0.1:{plain_port}"))?
            .with_ca_certificate_pem(ca)
            .connect()
            .await,
        BackendErrorKind::Timeout,
        "TLS handshake",
    )?;
    drop(srv);
    Ok(())
}

pub(super) async fn acl_user_limited_to_prefix(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let mut admin = plain(f.url()).await?;
    let user = format!("locksvc-{}", OwnerToken::generate()?.to_hex());
    let allowed = format!("{}acl:", f.prefix());
    let mut setuser = redis::cmd("ACL");
    setuser
        .arg("SETUSER")
        .arg(&user)
        .arg(">locksvc-pw")
        .arg(acl_rules(&allowed));
    let () = setuser.query_async(&mut admin).await?;
    tracing_line(&format!(
        "ACL SETUSER {user} >*** {}",
        acl_rules(&allowed).join(" ")
    ));
    let result = acl_body(&f, &user, &allowed).await;
    let _: i64 = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await?;
    result
}

async fn acl_body(f: &RedisFactory, user: &str, allowed: &str) -> Result<(), BoxError> {
    let url = f
        .url()
        .replacen("redis://", &format!("redis://{user}:locksvc-pw@"), 1);
    let backend = config_for(&url)?.with_key_prefix(allowed).connect().await?;
    let waiter_backend = config_for(&url)?.with_key_prefix(allowed).connect().await?;
    let (a, _) = locker_over(Arc::new(backend.clone()))?;
    let (b, _) = locker_over(Arc::new(waiter_backend))?;
    let name = LockName::new("specific/acl")?;
    let opts = LockOptions::new(TTL);
    let guard = a.try_lock(&name, &opts).await?;
    ensure(guard.fencing_token().is_some(), "no fencing token")?;
    let waiter = {
        let (b, name, opts) = (
            b.clone(),
            name.clone(),
            opts.clone().with_acquire_timeout(TTL * 5),
        );
        tokio::spawn(async move {
            let g = b.lock(&name, &opts).await;
            (Instant::now(), g)
        })
    };
    tokio::time::sleep(TTL / 2 + TTL / 3).await;
    guard.assert_held()?;
    let released = Instant::now();
    guard.release().await?;
    let (at, g) = waiter.await?;
    let g = g?;
    ensure(
        at - released < Duration::from_millis(100),
        format!("the waiter took {:?} after the release", at - released),
    )?;
    g.release().await?;
    backend
        .record_completed(&name, 42, std::time::Duration::from_secs(60))
        .await?;
    ensure(backend.last_completed(&name).await? == Some(42), "ticks")?;
    ensure(
        backend.server_time().await?.is_some(),
        "the server's clock is readable",
    )?;
    // Outside its prefix, every operation is refused.
    let outside = config_for(&url)?
        .with_key_prefix(format!("{}other:", f.prefix()))
        .connect()
        .await?;
    expect_kind(
        "acquire outside the prefix",
        outside
            .try_acquire(&name, &OwnerToken::generate()?, TTL)
            .await,
        BackendErrorKind::Auth,
        "ACL",
    )?;
    // A refused subscription means "poll instead", not a failure.
    ensure(
        outside.subscribe_release(&name).await?.is_none(),
        "a refused subscription was reported as active",
    )?;
    let wrong = f
        .url()
        .replacen("redis://", &format!("redis://{user}:wrong-pw@"), 1);
    expect_kind(
        "wrong password",
        config_for(&wrong)?.connect().await,
        BackendErrorKind::Auth,
        "password",
    )?;
    Ok(())
}

pub(super) async fn bad_input_errors(_f: Arc<RedisFactory>) -> Result<(), BoxError> {
    expect_kind(
        "no scheme",
        RedisBuilder::from_url("127.0.0.1:6379"),
        BackendErrorKind::Config,
        "malformed",
    )?;
    expect_kind(
        "unknown scheme",
        RedisBuilder::from_url("http://127.0.0.1:6379"),
        BackendErrorKind::Config,
        "\"http\"",
    )?;
    expect_kind(
        "bad port",
        RedisBuilder::from_url("redis://127.0.0.1:99999"),
        BackendErrorKind::Config,
        "malformed",
    )?;
    expect_kind(
        "CA with a plaintext URL",
        RedisBuilder::new()
            .with_ca_certificate_pem(b"-----".to_vec())
            .build(),
        BackendErrorKind::Config,
        "rediss://",
    )?;
    expect_kind(
        "unreadable CA",
        RedisBuilder::from_url("rediss://127.0.0.1:1")?
            .with_ca_certificate_pem(b"not a pem".to_vec())
            .build(),
        BackendErrorKind::Config,
        "certificate",
    )?;
    let port = free_port()?;
    let started = Instant::now();
    expect_kind(
        "unreachable server",
        config_for(&format!("redis://127.0.0.1:{port}"))?
            .connect()
            .await,
        BackendErrorKind::Unavailable,
        "refused",
    )?;
    let took = started.elapsed();
    ensure(
        took <= CONNECT_TIMEOUT + Duration::from_millis(100),
        format!("the unreachable server took {took:?} to report"),
    )?;
    Ok(())
}
