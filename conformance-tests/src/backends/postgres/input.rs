//! Postgres trials of configuration and bad input: TLS, credentials,
//! missing database, unreachable or silent server, missing privileges.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{backend::AcquireAttempt, BackendErrorKind, LockBackend, LockOptions, OwnerToken};
use lock_postgres::{PostgresBackend, SslMode};
use tokio::time::Instant;

use super::server::{PASSWORD, ROLE_NO_CREATE, ROLE_WITH_PASSWORD};
use super::specific::{locker, name, private_url};
use super::{holder_pid, plain_session, PostgresFactory, TTL};
use crate::BoxError;

/// `sslmode=verify-full` with the test CA connects over TLS (the server
/// reports it in `pg_stat_ssl`); an untrusted certificate is refused.
pub(super) async fn tls_verify_full(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let started = tokio::task::block_in_place(|| f.private_started())?;
    let url = started.url("postgres");
    let ca = started.ca_file().to_path_buf();
    let tls_url = format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display());
    let backend = f.builder_for(&tls_url)?.connect().await?;
    let locker = locker(Arc::new(backend.clone()))?;
    locker
        .try_lock(&name(&f, "tls"), &LockOptions::new(TTL))
        .await?
        .release()
        .await?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let pid = backend.session_pid().await?;
    let row = inspector
        .query_one(
            "SELECT ssl, version FROM pg_stat_ssl WHERE pid = $1",
            &[&pid],
        )
        .await?;
    let (ssl, version): (bool, Option<String>) = (row.get(0), row.get(1));
    if !ssl {
        return Err("the verify-full session is not encrypted".into());
    }
    println!(
        "postgres: verify-full lock session uses {}",
        version.unwrap_or_default()
    );
    // Encryption without verification needs no CA.
    let require = PostgresBackend::connect(
        f.builder_for(&url)?
            .with_ssl_mode(SslMode::Require)
            .config()?,
    );
    require.await?;
    // Without the test CA the self-signed certificate is untrusted.
    let untrusted = f
        .builder_for(&url)?
        .with_ssl_mode(SslMode::VerifyFull)
        .config()?;
    match PostgresBackend::connect(untrusted).await {
        Err(e) if e.kind() == BackendErrorKind::Config => Ok(()),
        Err(e) => Err(format!("an untrusted certificate gave {e} (kind {:?})", e.kind()).into()),
        Ok(_) => Err("an untrusted certificate was accepted".into()),
    }
}

/// `sslmode=require` with a root certificate verifies the chain, as libpq
/// does (it then behaves like `verify-ca`): a server certificate signed by
/// another CA is refused, by URL and by builder; the right CA is accepted;
/// plain `require` (no root certificate) still encrypts without verifying.
pub(super) async fn tls_require_with_root_verifies(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let started = tokio::task::block_in_place(|| f.private_started())?;
    let url = started.url("postgres");
    let (ca, other) = (started.ca_file(), started.other_ca_file());
    let refused = |what: &str, r: Result<PostgresBackend, lock_core::BackendError>| match r {
        Err(e) if e.kind() == BackendErrorKind::Config => Ok(()),
        Err(e) => Err(format!("{what}: gave {e} (kind {:?})", e.kind())),
        Ok(_) => Err(format!("{what}: a certificate of another CA was accepted")),
    };

    let wrong = format!("{url}?sslmode=require&sslrootcert={}", other.display());
    let by_url = f.builder_for(&wrong)?.connect().await;
    refused("require + sslrootcert of another CA (URL)", by_url)?;
    let config = f
        .builder_for(&url)?
        .with_ssl_mode(SslMode::Require)
        .with_root_certificate_file(other)
        .config()?;
    refused(
        "require + a root certificate of another CA (builder)",
        PostgresBackend::connect(config).await,
    )?;

    let right = format!("{url}?sslmode=require&sslrootcert={}", ca.display());
    f.builder_for(&right)?
        .connect()
        .await
        .map_err(|e| format!("require + the server's CA was refused: {e}"))?;
    let plain = format!("{url}?sslmode=require");
    let backend = f
        .builder_for(&plain)?
        .connect()
        .await
        .map_err(|e| format!("plain require was refused: {e}"))?;
    let inspector = plain_session(&url, f.application_name()).await?;
    let pid = backend.session_pid().await?;
    let ssl: bool = inspector
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&pid])
        .await?
        .get(0);
    if !ssl {
        return Err("the plain require session is not encrypted".into());
    }
    Ok(())
}

/// Malformed URL, wrong credentials, missing database, server down or
/// silent, role without CREATE for the fencing sequence, TTL above the
/// bound: each a typed error naming the problem, never a hang.
pub(super) async fn bad_input_gets_typed_errors(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let port = tokio::task::block_in_place(|| f.private_started())?.port();
    let kind_of = |r: Result<PostgresBackend, lock_core::BackendError>| match r {
        Ok(_) => None,
        Err(e) => Some((e.kind(), e.to_string())),
    };
    let check = |what: &str,
                 got: Option<(BackendErrorKind, String)>,
                 want: BackendErrorKind,
                 words: &str|
     -> Result<(), BoxError> {
        match got {
            Some((kind, msg)) if kind == want && msg.contains(words) => Ok(()),
            Some((kind, msg)) => Err(format!("{what}: got {kind:?}: {msg}").into()),
            None => Err(format!("{what}: was accepted").into()),
        }
    };

    match lock_postgres::PostgresBuilder::from_url("postgres://u:pw@host:99999999/db") {
        Err(e) if e.kind() == BackendErrorKind::Config && e.to_string().contains("malformed") => {}
        other => return Err(format!("malformed URL: {other:?}").into()),
    }

    let wrong = format!("postgres://{ROLE_WITH_PASSWORD}:not-{PASSWORD}@127.0.0.1:{port}/postgres");
    let r = f.builder_for(&wrong)?.connect().await;
    check(
        "wrong password",
        kind_of(r),
        BackendErrorKind::Auth,
        "password",
    )?;
    let right = format!("postgres://{ROLE_WITH_PASSWORD}:{PASSWORD}@127.0.0.1:{port}/postgres");
    let config = f.builder_for(&right)?.with_fencing_tokens(false).config()?;
    if format!("{config:?}").contains(PASSWORD) {
        return Err("Debug shows the password".into());
    }
    PostgresBackend::connect(config).await?;

    let nodb = format!("postgres://postgres@127.0.0.1:{port}/no_such_database");
    let r = f.builder_for(&nodb)?.connect().await;
    check(
        "missing database",
        kind_of(r),
        BackendErrorKind::Config,
        "no_such_database",
    )?;

    let closed = crate::harness::free_port()?;
    let down = format!("postgres://postgres@127.0.0.1:{closed}/postgres");
    let started = Instant::now();
    let r = f.builder_for(&down)?.connect().await;
    check(
        "server down",
        kind_of(r),
        BackendErrorKind::Unavailable,
        "connecting",
    )?;
    if started.elapsed() > Duration::from_secs(2) {
        return Err(format!("a closed port took {:?}", started.elapsed()).into());
    }

    // Accepts connections and never answers, like a frozen server.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let silent_port = silent.local_addr()?.port();
    let keeper = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let frozen = format!("postgres://postgres@127.0.0.1:{silent_port}/postgres");
    let config = f
        .builder_for(&frozen)?
        .with_connect_timeout(Duration::from_millis(500))
        .config()?;
    let started = Instant::now();
    let r = PostgresBackend::connect(config).await;
    keeper.abort();
    check(
        "silent server",
        kind_of(r),
        BackendErrorKind::Timeout,
        "no answer",
    )?;
    if started.elapsed() > Duration::from_millis(500 + 400) {
        return Err(format!("a silent server took {:?}", started.elapsed()).into());
    }

    let seq = format!("ct_fence_{:08x}", getrandom::u32().unwrap_or(0));
    let nocreate = private_url(&f, ROLE_NO_CREATE)?;
    let backend = f
        .builder_for(&nocreate)?
        .with_fence_sequence(seq)
        .connect()
        .await?;
    let n = name(&f, "no-create");
    let token = OwnerToken::generate()?;
    match backend.try_acquire(&n, &token, TTL).await {
        Err(e)
            if e.kind() == BackendErrorKind::Auth && e.to_string().contains("CREATE SEQUENCE") => {}
        other => return Err(format!("role without CREATE: {other:?}").into()),
    }
    let inspector = plain_session(&url, f.application_name()).await?;
    if holder_pid(&inspector, backend.config().key_for(&n))
        .await?
        .is_some()
    {
        return Err("a failed fencing acquire left the lock held".into());
    }
    let read_only = f
        .builder_for(&nocreate)?
        .with_fencing_tokens(false)
        .connect()
        .await?;
    match read_only.try_acquire(&n, &token, TTL).await? {
        AcquireAttempt::Acquired(lease) if lease.fencing_token.is_none() => {}
        other => return Err(format!("fencing off: {other:?}").into()),
    }
    read_only.release(&n, &token).await?;

    match backend
        .try_acquire(&n, &token, Duration::from_secs(60))
        .await
    {
        Err(e) if e.kind() == BackendErrorKind::Config && e.to_string().contains("max_ttl") => {
            Ok(())
        }
        other => Err(format!("TTL above max_ttl: {other:?}").into()),
    }
}
