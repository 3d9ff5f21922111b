//! Bad input, RBAC limited to the key prefix, and TLS with a test certificate.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, Permission};
use libtest_mimic::Failed;
use lock_core::{
    backend::{AcquireAttempt, ReleaseOutcome},
    BackendErrorKind, Error, LockBackend, LockOptions, Locker, OwnerToken, RunOutcome, SkipReason,
    TickStore,
};
use lock_etcd::EtcdBuilder;
use tokio::time::Instant;

use super::ensure;
use crate::backends::etcd::{server, EtcdFactory, EtcdSaboteur};
use crate::harness::free_port;
use crate::Ctx;

fn expect_kind<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, lock_core::BackendError>,
    kind: BackendErrorKind,
    mentions: &str,
) -> Result<(), Failed> {
    match got {
        Err(e) if e.kind() == kind && e.to_string().contains(mentions) => Ok(()),
        other => Err(format!(
            "{what}: expected a {kind:?} error mentioning {mentions:?}, got {other:?}"
        )
        .into()),
    }
}

/// Malformed endpoints, a TTL below the minimum, TLS without a CA and a
/// cluster that is down: each a typed error that names the problem, and
/// never a hang.
pub(super) async fn bad_input_gives_typed_errors(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    for (url, mentions) in [
        ("etcd://", "no etcd endpoint"),
        ("etcd://host", "host:port"),
        ("etcd://host:port", "not a port number"),
        ("etcd://host:70000", "not a port"),
        ("etcd://:2379", "empty host"),
        ("redis://host:6379", "etcd://"),
        ("etcd://user@host:2379", "user:password"),
    ] {
        expect_kind(
            url,
            EtcdBuilder::from_url(url),
            BackendErrorKind::Config,
            mentions,
        )?;
    }
    expect_kind(
        "an empty list",
        EtcdBuilder::new().with_endpoints([" , "]),
        BackendErrorKind::Config,
        "no etcd endpoint",
    )?;
    expect_kind(
        "TLS without a CA",
        EtcdBuilder::from_url("etcds://127.0.0.1:1")?.build(),
        BackendErrorKind::Config,
        "CA certificate",
    )?;

    let backend = f.connect().await?;
    ensure(backend.min_ttl() == Duration::from_secs(1), || {
        format!(
            "measured minimum TTL {:?}, the server allows 1 s",
            backend.min_ttl()
        )
    })?;
    let name = ctx.name("short");
    let owner = OwnerToken::generate()?;
    expect_kind(
        "TTL below the minimum",
        backend
            .try_acquire(&name, &owner, Duration::from_millis(500))
            .await,
        BackendErrorKind::Config,
        "minimum lease TTL",
    )?;
    let locker = Locker::new(backend.clone())?;
    let short = LockOptions::new(Duration::from_millis(500));
    ensure(
        matches!(locker.try_lock(&name, &short).await, Err(Error::Config(_))),
        || "the Locker accepted a TTL below the minimum".into(),
    )?;
    // 1.5 s is a valid TTL; the server's lease is rounded up to 2 s.
    let got = backend
        .try_acquire(&name, &owner, Duration::from_millis(1500))
        .await?;
    ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
        format!("{got:?}")
    })?;
    let sab = EtcdSaboteur::connect_default(&f.endpoints()?).await?;
    let lease = sab.lease_of(&name).await?.ok_or("no key")?;
    let granted = sab
        .client()
        .lease_client()
        .time_to_live(lease, None)
        .await?
        .granted_ttl();
    ensure(granted == 2, || {
        format!("a 1.5 s TTL was granted as {granted} s")
    })?;
    ensure(
        backend.release(&name, &owner).await? == ReleaseOutcome::Released,
        || "release failed".into(),
    )?;

    // Down: a closed port. Connecting and every call fail as unavailable, fast.
    let closed = free_port()?;
    let started = Instant::now();
    expect_kind(
        "connect to a closed port",
        server::builder(closed).connect().await,
        BackendErrorKind::Unavailable,
        "unreachable",
    )?;
    ensure(started.elapsed() < Duration::from_secs(4), || {
        format!("connect took {:?}", started.elapsed())
    })?;
    let lazy = server::builder(closed).build()?;
    let started = Instant::now();
    expect_kind(
        "acquire on a closed port",
        lazy.try_acquire(&name, &owner, Duration::from_secs(2))
            .await,
        BackendErrorKind::Unavailable,
        "unreachable",
    )?;
    ensure(started.elapsed() < Duration::from_secs(2), || {
        format!("acquire took {:?}", started.elapsed())
    })?;
    let outcome = Locker::new(lazy)?
        .with_lock(&name, &ctx.opts(), |_| async {})
        .await?;
    ensure(
        matches!(outcome, RunOutcome::Skipped(SkipReason::Unavailable(_))),
        || format!("a down cluster gave {outcome:?}"),
    )?;
    Ok(())
}

/// A user whose role only covers `/locks/` locks, renews, waits and records
/// ticks there; it is refused elsewhere, and wrong or missing credentials
/// are refused as `Auth` errors.
pub(super) async fn rbac_user_limited_to_prefix(
    _f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let (srv, url, mut root) = server::start_for_auth().await?;
    root.role_add("lockrole").await?;
    root.role_grant_permission("lockrole", Permission::read_write("/locks/").with_prefix())
        .await?;
    root.user_add("locksvc", "svcpw", None).await?;
    root.user_grant_role("locksvc", "lockrole").await?;
    root.auth_enable().await?;

    let svc = server::builder(srv.port()).with_credentials("locksvc", "svcpw");
    let backend = svc.clone().connect().await?;
    let locker = Locker::new(backend.clone())?;
    let name = ctx.name("rbac");
    let guard = locker.try_lock(&name, &ctx.opts()).await?;
    guard.renew().await?;
    guard.handle().verify().await?;
    ensure(backend.subscribe_release(&name).await?.is_some(), || {
        "no watch".into()
    })?;
    guard.release().await?;
    backend
        .record_completed(&name, 42, std::time::Duration::from_secs(60))
        .await?;
    ensure(backend.last_completed(&name).await? == Some(42), || {
        "tick not stored".into()
    })?;

    let outside = svc.clone().with_prefix("/other/").connect().await?;
    expect_kind(
        "acquire outside the prefix",
        outside
            .try_acquire(&name, &OwnerToken::generate()?, ctx.timing().ttl)
            .await,
        BackendErrorKind::Auth,
        "refused",
    )?;
    let opts = ConnectOptions::new().with_user("locksvc", "svcpw");
    let mut raw = Client::connect([url.as_str()], Some(opts)).await?;
    ensure(raw.put("/other", "x", None).await.is_err(), || {
        "put outside the prefix allowed".into()
    })?;
    expect_kind(
        "wrong password",
        server::builder(srv.port())
            .with_credentials("locksvc", "wrong")
            .connect()
            .await,
        BackendErrorKind::Auth,
        "refused",
    )?;
    let anonymous = server::builder(srv.port()).build()?;
    expect_kind(
        "no credentials",
        anonymous
            .try_acquire(&name, &OwnerToken::generate()?, ctx.timing().ttl)
            .await,
        BackendErrorKind::Auth,
        "refused",
    )?;
    Ok(())
}

/// An https-only server with a self-signed certificate: trusted through its
/// CA it works; plaintext and a wrong CA fail, within the timeouts.
pub(super) async fn tls_with_test_certificate(
    _f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let certs = tempfile::tempdir()?;
    let c = crate::harness::certs::test_certs(certs.path(), "server")?;
    let srv = server::start(server::ServerTls {
        cert_and_key: Some((&c.cert, &c.key)),
    })?;
    let https = format!("https://127.0.0.1:{}", srv.port());
    let tls = EtcdBuilder::new()
        .with_endpoints([https.as_str()])?
        .with_ca_file(&c.ca)
        .with_connect_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1));
    let backend = server::connect_when_ready(tls.clone()).await?;
    let locker = Locker::new(backend)?;
    let guard = locker.try_lock(&ctx.name("tls"), &ctx.opts()).await?;
    guard.release().await?;

    let bound = Duration::from_secs(2 + 1) + ctx.timing().tolerance;
    let started = Instant::now();
    let wrong_ca = tls.with_ca_file(&c.other_ca).connect().await;
    ensure(wrong_ca.is_err(), || {
        "a certificate from another CA was trusted".into()
    })?;
    ensure(started.elapsed() <= bound, || {
        format!("wrong CA took {:?}", started.elapsed())
    })?;
    let started = Instant::now();
    let plain = EtcdBuilder::new()
        .with_endpoints([format!("http://127.0.0.1:{}", srv.port())])?
        .with_connect_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1))
        .connect()
        .await;
    match plain {
        Err(e) if e.kind().is_unavailable() => {}
        other => return Err(format!("plaintext to a TLS server gave {other:?}").into()),
    }
    ensure(started.elapsed() <= bound, || {
        format!("plaintext took {:?}", started.elapsed())
    })?;
    Ok(())
}
