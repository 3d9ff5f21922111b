//! A tower layer that rate-limits HTTP requests.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::request::Parts;
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::Error;
use crate::limiter::{Decision, Limiter};

/// `RateLimit-Policy`: every limit, as `"name";q=<count>;w=<seconds>`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: the tightest limit now, as `"name";r=<remaining>;t=<seconds>`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The key of requests whose key cannot be found (no peer address, or the
/// key function returned `None`): they share one bucket, so a
/// misconfiguration throttles them together rather than not at all.
pub const UNKNOWN_KEY: &str = "unknown";

type KeyFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
type PeerFn = Arc<dyn Fn(&Parts) -> Option<IpAddr> + Send + Sync>;

#[derive(Clone)]
enum KeySource {
    /// The peer's address, through this many trusted proxies.
    Peer {
        trusted_hops: usize,
        peer: PeerFn,
    },
    Custom(KeyFn),
}

/// Rate-limits every request through a [`Limiter`]: over the limit, `429 Too
/// Many Requests` with `Retry-After` and the IETF `RateLimit` and
/// `RateLimit-Policy` headers; admitted, the request goes on with the
/// [`Decision`] in its extensions and the same headers on its response; with
/// the store failing under [`OnStoreError::Deny`](crate::OnStoreError::Deny),
/// `503 Service Unavailable` with `Retry-After`. Never a 500.
///
/// The key is the client's address by default: the connection's peer
/// address (a [`SocketAddr`] in the request's extensions, as hyper-util and
/// axum's `ConnectInfo` provide with [`with_peer`](Self::with_peer)), and,
/// only with [`with_trusted_proxies`](Self::with_trusted_proxies), the
/// address that many trusted proxies recorded in `X-Forwarded-For`. A
/// header a client sent is never trusted by default. Or any function of the
/// request: [`with_key`](Self::with_key).
///
/// # Examples
///
/// ```
/// use std::net::SocketAddr;
/// use distlock_ratelimit::{layer::RateLimitLayer, Limit, Limiter, Quota};
///
/// # fn main() -> distlock_ratelimit::Result<()> {
/// let limiter = Limiter::builder("api")
///     .with_limit(Limit::new("second", Quota::per_second(10)?)?)
///     .build()?;
/// // axum: .layer(layer), served with into_make_service_with_connect_info::<SocketAddr>()
/// let layer = RateLimitLayer::new(limiter).with_peer(|parts| {
///     parts.extensions.get::<SocketAddr>().map(SocketAddr::ip)
/// });
/// # let _ = layer;
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    limiter: Limiter,
    key: KeySource,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = match &self.key {
            KeySource::Peer { trusted_hops, .. } => format!("peer, {trusted_hops} trusted hops"),
            KeySource::Custom(_) => "a function".to_owned(),
        };
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .field("key", &key)
            .finish()
    }
}

fn socket_addr_extension(parts: &Parts) -> Option<IpAddr> {
    parts.extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

impl RateLimitLayer {
    /// Limits by the peer address (a [`SocketAddr`] in the extensions), with
    /// no trusted proxy.
    pub fn new(limiter: Limiter) -> Self {
        Self {
            limiter,
            key: KeySource::Peer {
                trusted_hops: 0,
                peer: Arc::new(socket_addr_extension),
            },
        }
    }

    /// Finds the peer address with `peer` (axum:
    /// `parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip())`).
    pub fn with_peer(
        mut self,
        peer: impl Fn(&Parts) -> Option<IpAddr> + Send + Sync + 'static,
    ) -> Self {
        let trusted_hops = match &self.key {
            KeySource::Peer { trusted_hops, .. } => *trusted_hops,
            KeySource::Custom(_) => 0,
        };
        self.key = KeySource::Peer {
            trusted_hops,
            peer: Arc::new(peer),
        };
        self
    }

    /// Trusts `hops` proxies in front of the service: the client is the
    /// address the outermost trusted proxy saw, the `hops`-th entry of
    /// `X-Forwarded-For` from the right (each proxy appends the address it
    /// received from). Entries further left were written by the client and
    /// are ignored. 0 (the default) reads no header.
    pub fn with_trusted_proxies(mut self, hops: usize) -> Self {
        if let KeySource::Peer { trusted_hops, .. } = &mut self.key {
            *trusted_hops = hops;
        } else {
            self.key = KeySource::Peer {
                trusted_hops: hops,
                peer: Arc::new(socket_addr_extension),
            };
        }
        self
    }

    /// Keys requests by `key` (a user id from a verified token, an API key);
    /// `None` puts the request in the [`UNKNOWN_KEY`] bucket.
    pub fn with_key(
        mut self,
        key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = KeySource::Custom(Arc::new(key));
        self
    }
}

impl KeySource {
    fn key(&self, parts: &Parts) -> Option<String> {
        match self {
            Self::Custom(f) => f(parts),
            Self::Peer { trusted_hops, peer } => {
                let peer = peer(parts)?;
                if *trusted_hops == 0 {
                    return Some(peer.to_string());
                }
                let forwarded: Vec<&str> = parts
                    .headers
                    .get_all("x-forwarded-for")
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .flat_map(|v| v.split(','))
                    .map(str::trim)
                    .collect();
                // Fewer entries than trusted hops: every entry was written
                // by a trusted proxy; the leftmost is the outermost one's.
                let index = forwarded.len().saturating_sub(*trusted_hops);
                match forwarded.get(index).map(|e| e.parse::<IpAddr>()) {
                    Some(Ok(ip)) => Some(ip.to_string()),
                    // No header or a malformed entry: the nearest address we
                    // can vouch for is the peer.
                    _ => Some(peer.to_string()),
                }
            }
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`RateLimitLayer`] wraps around another.
#[derive(Clone, Debug)]
pub struct RateLimit<S> {
    inner: S,
    layer: RateLimitLayer,
}

fn seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn policy_header(limiter: &Limiter) -> Option<HeaderValue> {
    let text = limiter
        .limits()
        .iter()
        .map(|l| {
            format!(
                "\"{}\";q={};w={}",
                l.name(),
                l.quota().count(),
                seconds(l.quota().period())
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    HeaderValue::from_str(&text).ok()
}

fn decision_headers<B>(response: &mut Response<B>, limiter: &Limiter, d: &Decision) {
    if d.source == crate::Source::None {
        // Nothing was checked: no numbers to report.
        return;
    }
    let headers = response.headers_mut();
    if let Some(policy) = policy_header(limiter) {
        headers.insert(RATELIMIT_POLICY, policy);
    }
    let name = limiter.limit_of(d).map_or("", |l| l.name());
    let now = format!(
        "\"{}\";r={};t={}",
        name,
        d.remaining,
        seconds(d.reset_after)
    );
    if let Ok(v) = HeaderValue::from_str(&now) {
        headers.insert(RATELIMIT, v);
    }
}

fn refusal<B: Default>(status: StatusCode, retry_after: Duration) -> Response<B> {
    let mut response = Response::new(B::default());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(seconds(retry_after).max(1)));
    response
}

impl<S, B, ResBody> Service<Request<B>> for RateLimit<S>
where
    S: Service<Request<B>, Response = Response<ResBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is awaited on the clone that serves the request, after
        // the limiter decided.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let mut inner = self.inner.clone();
        let layer = self.layer.clone();
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let key = layer
                .key
                .key(&parts)
                .unwrap_or_else(|| UNKNOWN_KEY.to_owned());
            let decision = match layer.limiter.check(&key).await {
                Ok(d) => d,
                Err(Error::StoreUnavailable { retry_after, .. }) => {
                    return Ok(refusal(StatusCode::SERVICE_UNAVAILABLE, retry_after));
                }
                Err(e) => {
                    tracing::warn!(limiter = layer.limiter.name(), error = %e, "rate-limit check failed");
                    return Ok(refusal(
                        StatusCode::SERVICE_UNAVAILABLE,
                        Duration::from_secs(1),
                    ));
                }
            };
            if !decision.allowed {
                let mut response = refusal(StatusCode::TOO_MANY_REQUESTS, decision.retry_after);
                decision_headers(&mut response, &layer.limiter, &decision);
                return Ok(response);
            }
            parts.extensions.insert(decision.clone());
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
            let mut response = inner.call(Request::from_parts(parts, body)).await?;
            decision_headers(&mut response, &layer.limiter, &decision);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(xff: &[&str], peer: Option<&str>) -> Parts {
        let mut b = Request::builder();
        for v in xff {
            b = b.header("x-forwarded-for", *v);
        }
        let (mut parts, ()) = b.body(()).expect("request").into_parts();
        if let Some(p) = peer {
            parts
                .extensions
                .insert(p.parse::<SocketAddr>().expect("addr"));
        }
        parts
    }

    fn peer_key(hops: usize) -> KeySource {
        KeySource::Peer {
            trusted_hops: hops,
            peer: Arc::new(socket_addr_extension),
        }
    }

    #[test]
    fn a_client_sent_header_is_ignored_without_trusted_proxies() {
        let p = parts(&["1.2.3.4"], Some("10.0.0.9:5000"));
        assert_eq!(peer_key(0).key(&p).as_deref(), Some("10.0.0.9"));
    }

    #[test]
    fn trusted_hops_pick_the_entry_the_outermost_proxy_wrote() {
        // Client forged "6.6.6.6"; proxy A saw 203.0.113.7; proxy B saw A.
        let p = parts(&["6.6.6.6, 203.0.113.7", "10.0.0.2"], Some("10.0.0.3:1"));
        assert_eq!(peer_key(1).key(&p).as_deref(), Some("10.0.0.2"));
        assert_eq!(peer_key(2).key(&p).as_deref(), Some("203.0.113.7"));
        // More hops than entries: the leftmost (a proxy's), never past it.
        let p = parts(&["203.0.113.7"], Some("10.0.0.3:1"));
        assert_eq!(peer_key(3).key(&p).as_deref(), Some("203.0.113.7"));
        // Garbage or no header: the peer.
        let p = parts(&["not an ip"], Some("10.0.0.3:1"));
        assert_eq!(peer_key(1).key(&p).as_deref(), Some("10.0.0.3"));
        let p = parts(&[], Some("10.0.0.3:1"));
        assert_eq!(peer_key(1).key(&p).as_deref(), Some("10.0.0.3"));
        // No peer at all: no key (the layer uses the shared unknown bucket).
        assert_eq!(peer_key(1).key(&parts(&["1.1.1.1"], None)), None);
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
        assert_eq!(seconds(Duration::ZERO), 0);
    }
}
