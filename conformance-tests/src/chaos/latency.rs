//! X5: the proxy delays every reply by 0.3 × TTL. The holder's local
//! deadline must never be later than the server's expiry, sampled after
//! every renewal; and a grant that arrives after its own validity ran out
//! must be refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{Error, LockBackend, LockName, LossReason};
use tokio::time::{sleep, Instant};

use super::cases::replica_through;
use super::figures::{self, Row};
use super::holder::{Holder, Resource};
use super::Target;
use crate::backends::{etcd, redis};
use crate::proxy::FaultProxy;
use crate::Ctx;

/// Renewal samples per trial in smoke; `CHAOS_SOAK` multiplies them.
const SMOKE_SAMPLES: usize = 15;
/// How often the sampler looks for a renewal that moved the deadline.
const POLL: Duration = Duration::from_millis(10);
/// Smallest move of the local deadline counted as a renewal.
const RENEWAL_MOVES: Duration = Duration::from_millis(20);

/// How the case reads the server's own view of a lease.
#[derive(Debug, Clone)]
pub(super) enum Probe {
    /// Redis, with the key prefix of the factory's replicas: `PTTL`.
    Redis(String),
    /// etcd, with the default key prefix: the key's lease `TimeToLive`.
    Etcd,
}

impl Probe {
    /// Sequential round trips in one renewal: Redis runs one script; etcd
    /// sends a keep-alive, then reads the key to confirm it is still ours.
    fn renewal_round_trips(&self) -> u32 {
        match self {
            Self::Redis(_) => 1,
            Self::Etcd => 2,
        }
    }

    /// Sequential round trips in one acquire of a free name: Redis runs one
    /// script; etcd grants a lease, then puts the key on it (a name is read
    /// first only once an attempt on it was denied).
    fn acquire_round_trips(&self) -> u32 {
        match self {
            Self::Redis(_) => 1,
            Self::Etcd => 2,
        }
    }
}

/// A connection that reads the server's expiry of one lock directly.
enum Reader {
    Redis(::redis::aio::MultiplexedConnection, String),
    Etcd(Box<etcd_client::Client>, String),
}

impl Reader {
    async fn connect(probe: &Probe, server: SocketAddr, name: &LockName) -> Self {
        match probe {
            Probe::Redis(prefix) => {
                let client = ::redis::Client::open(format!("redis://{server}")).expect("url");
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("the sampler connects");
                Self::Redis(conn, format!("{prefix}{}", name.as_str()))
            }
            Probe::Etcd => {
                let client = etcd_client::Client::connect([format!("http://{server}")], None)
                    .await
                    .expect("the sampler connects");
                Self::Etcd(
                    Box::new(client),
                    format!("{}{}", lock_etcd::DEFAULT_PREFIX, name.as_str()),
                )
            }
        }
    }

    /// The latest instant the server can expire the lease at, as far as one
    /// direct read can tell: the read's reply time plus the remaining TTL
    /// it reported, plus that TTL's granularity (1 ms for Redis, 1 s for
    /// etcd, whose `TimeToLive` truncates to whole seconds). `None` if the
    /// lock is gone.
    async fn expiry_at_most(&mut self) -> Option<Instant> {
        match self {
            Self::Redis(conn, key) => {
                let ms: i64 = ::redis::cmd("PTTL")
                    .arg(&*key)
                    .query_async(conn)
                    .await
                    .expect("PTTL");
                let replied = Instant::now();
                let ms = u64::try_from(ms).ok()?;
                Some(replied + Duration::from_millis(ms + 1))
            }
            Self::Etcd(client, key) => {
                let got = client.kv_client().get(key.as_str(), None).await.ok()?;
                let lease = got.kvs().first()?.lease();
                let ttl = client
                    .lease_client()
                    .time_to_live(lease, None)
                    .await
                    .expect("TimeToLive");
                let replied = Instant::now();
                let secs = u64::try_from(ttl.ttl()).ok()?;
                Some(replied + Duration::from_secs(secs + 1))
            }
        }
    }
}

/// A backend reaching the server through `proxy` with an operation timeout
/// of `op_timeout`, longer than the TTL, so that only the late-grant rule
/// can refuse a slow acquire.
async fn patient_replica(
    probe: &Probe,
    proxy: SocketAddr,
    op_timeout: Duration,
) -> Arc<dyn LockBackend> {
    match probe {
        Probe::Redis(prefix) => Arc::new(
            redis::config_for(&format!("redis://{proxy}"))
                .expect("config")
                .with_operation_timeout(op_timeout)
                .with_key_prefix(prefix)
                .connect()
                .await
                .expect("connects through the proxy"),
        ),
        Probe::Etcd => Arc::new(
            etcd::server::connect_when_ready(
                etcd::server::builder(proxy.port()).with_request_timeout(op_timeout),
            )
            .await
            .expect("connects through the proxy"),
        ),
    }
}

/// X5 on the backend behind `ctx`; `probe` reads its server's expiry.
pub(super) async fn latency(ctx: Ctx, target: Target, probe: Probe) {
    let timing = ctx.timing();
    let (ttl, tol) = (timing.ttl, timing.tolerance);
    let opts = ctx.opts();
    let server = ctx.factory().server_addr().expect("a loopback server");
    let proxy = FaultProxy::start(server).await.expect("proxy starts");
    let holder_rep = replica_through(&ctx, &proxy).await;
    let patient = ctx.replica_over(patient_replica(&probe, proxy.addr(), ttl * 4).await);
    let direct = ctx.replica().await;
    let delay = ttl * 3 / 10;
    let samples = figures::iterations(SMOKE_SAMPLES);
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case: "chaos_latency".to_owned(),
        faults: 1,
        ..Row::default()
    };

    // Warm connections (and the server's script cache) first: a cold
    // connect under the delay is a connect timeout, not this case.
    for (i, rep) in [&holder_rep, &patient].into_iter().enumerate() {
        let warm = ctx.name(&format!("latency-warm-{i}"));
        let g = rep
            .locker
            .try_lock(&warm, &opts)
            .await
            .expect("warm-up acquire");
        // Across a renewal too, so that the renewal script is cached.
        sleep(opts.renew_interval() * 3 / 2).await;
        g.release().await.expect("warm-up release");
    }

    // An acquire through replies delayed by 0.3 × TTL either succeeds or
    // fails closed, within the operation timeout.
    proxy.set_response_delay(delay);
    let name = ctx.name("latency");
    let resource = Arc::new(Resource::default());
    let asked = Instant::now();
    let first = holder_rep.locker.try_lock(&name, &opts).await;
    let acquire_took = asked.elapsed();
    assert!(
        acquire_took >= delay && acquire_took <= target.op_timeout + tol,
        "the acquire took {acquire_took:?} with a {delay:?} reply delay"
    );
    let acquire_under_delay = match first {
        Ok(g) => {
            g.release().await.expect("release under delay");
            "granted".to_owned()
        }
        Err(Error::Unavailable { source, .. }) => format!("failed closed: {source}"),
        Err(e) => panic!("the acquire under delay failed with {e}"),
    };
    // The holder renews through the delay (taken without it if the acquire
    // failed closed above, since renewals are what this case samples).
    let name = ctx.name("latency-held");
    proxy.set_response_delay(Duration::ZERO);
    let holder = Holder::start(&holder_rep, &name, &opts, Arc::clone(&resource)).await;
    proxy.set_response_delay(delay);
    // Renewals keep the lease only if all their round trips fit in the
    // operation timeout; otherwise the lease must end at its local deadline
    // as a backend error, with no write after it.
    let keeps = delay * probe.renewal_round_trips() < target.op_timeout;
    let mut reader = Reader::connect(&probe, server, &name).await;
    let (mut taken, mut worst_margin) = (0, None::<Duration>);
    let handle = holder.handle.clone();
    let deadline_now = || {
        handle
            .remaining_validity()
            .map(|r| Instant::now() + r)
            .expect("a deadline")
    };
    let mut last = None;
    let last_deadline = deadline_now();
    let sampling_until =
        Instant::now() + opts.renew_interval() * 3 * u32::try_from(samples).unwrap_or(u32::MAX);
    let mut polls = 0usize;
    while taken < samples && Instant::now() < sampling_until && polls < 100_000 {
        polls += 1;
        sleep(POLL).await;
        let deadline = deadline_now();
        if handle.assert_held().is_err() {
            break;
        }
        // Sample after every renewal (a move of the deadline; `now +
        // remaining` itself jitters by the time between two reads) and,
        // where renewals cannot succeed, every few polls until the loss.
        let renewed = last.is_none_or(|l| deadline > l + RENEWAL_MOVES);
        if !renewed && (keeps || !polls.is_multiple_of(5)) {
            continue;
        }
        last = Some(deadline);
        let Some(expiry) = reader.expiry_at_most().await else {
            assert!(!keeps, "the server dropped a lease that was being renewed");
            break;
        };
        taken += 1;
        assert!(
            deadline <= expiry,
            "sample {taken}: the local deadline is {:?} past the server's expiry",
            deadline - expiry
        );
        let margin = expiry - deadline;
        worst_margin = Some(worst_margin.map_or(margin, |w| w.min(margin)));
    }
    let Holder { guard, .. } = holder;
    let kept = if keeps {
        assert!(
            handle.assert_held().is_ok(),
            "the lease was lost ({:?}) under a {delay:?} reply delay after {taken} samples",
            handle.loss_reason()
        );
        assert_eq!(taken, samples, "renewal samples taken");
        let released = guard.release().await;
        assert!(released.is_ok(), "release under delay: {released:?}");
        "kept".to_owned()
    } else {
        let reason = tokio::time::timeout(ttl + tol, handle.lost())
            .await
            .expect("the unrenewable lease ends by its deadline");
        assert_eq!(
            reason,
            LossReason::BackendError,
            "lost as {reason} with renewals timing out"
        );
        assert!(taken > 0, "no sample before the loss");
        assert!(
            Instant::now() >= last_deadline,
            "lost before the deadline it had when the delay began"
        );
        drop(guard);
        format!(
            "lost at its deadline ({reason}): a renewal takes {} round trips of {delay:?}, over the {:?} operation timeout",
            probe.renewal_round_trips(),
            target.op_timeout
        )
    };
    let writes = resource.log.writes();
    row.writes = writes;
    row.after_deadline = resource.log.after_deadline();

    // A grant that arrives after its validity ran out is refused, and its
    // key does not outlive the refusal by more than a TTL.
    // Spread over the acquire's round trips, so that on etcd the lease is
    // still alive when the key is put on it and only the late reply is wrong.
    proxy.set_response_delay((ttl + delay) / probe.acquire_round_trips());
    let late = ctx.name("latency-late");
    let asked = Instant::now();
    let refused = patient.locker.try_lock(&late, &opts).await;
    let took = asked.elapsed();
    row.max_blocked = Some(acquire_took);
    let late_refusal = match refused {
        Err(Error::Unavailable { source, .. })
            if source
                .message()
                .contains("acquire took longer than the TTL") =>
        {
            source.to_string()
        }
        other => panic!("a grant arriving after {took:?} (TTL {ttl:?}) was not refused: {other:?}"),
    };
    proxy.set_response_delay(Duration::ZERO);
    let probe_guard = direct
        .locker
        .lock(&late, &opts.clone().with_acquire_timeout(ttl + tol))
        .await
        .expect("the refused grant's key is gone within a TTL");
    probe_guard.release().await.expect("probe releases");
    row.iterations = taken;
    let summary = format!(
        "{row:?}; lease {kept}; acquire under delay {acquire_under_delay} after {acquire_took:?}; late grant after {took:?} refused: {late_refusal}; smallest expiry - deadline margin {worst_margin:?}"
    );
    eprintln!("{} chaos_latency: {summary}", row.backend);
    figures::record(row.clone());
    assert_eq!(
        row.after_deadline, 0,
        "writes after the deadline: {summary}"
    );
}
