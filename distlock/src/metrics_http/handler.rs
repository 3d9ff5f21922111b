//! One request in, one response out: routing, the token check and the exposition.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::WWW_AUTHENTICATE;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::{Method, Request, Response, StatusCode};
use prometheus::{Encoder, Registry, TextEncoder};
use tracing::warn;

use super::auth::BearerToken;
use super::config::MetricsHttpError;

/// The `Content-Type` of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Encodes every metric in `registry` in Prometheus's text format, for a
/// handler in another HTTP framework.
///
/// # Errors
///
/// [`MetricsHttpError::Encode`] if a collector produced a family the text
/// format cannot hold.
pub fn render(registry: &Registry) -> Result<String, MetricsHttpError> {
    let mut buf = Vec::with_capacity(4096);
    TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .map_err(|e| MetricsHttpError::Encode(e.to_string()))?;
    String::from_utf8(buf).map_err(|e| MetricsHttpError::Encode(e.to_string()))
}

/// A hyper service that answers `GET`/`HEAD /metrics` with the registry's
/// exposition and everything else with 404, 405 or 401. Cheap to clone.
///
/// Mount it with `hyper::server::conn::http1::Builder::serve_connection` or
/// wrap it for another server; it never reads the request body.
#[derive(Debug, Clone)]
pub struct MetricsService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    token: Option<BearerToken>,
}

impl MetricsService {
    /// Serves `registry`, requiring `token` when one is given.
    pub fn new(registry: Registry, token: Option<BearerToken>) -> Self {
        Self {
            inner: Arc::new(Inner { registry, token }),
        }
    }

    /// The response to a request with this method, path and `Authorization`
    /// header value.
    pub fn respond(
        &self,
        method: &Method,
        path: &str,
        authorization: Option<&[u8]>,
    ) -> Response<Full<Bytes>> {
        if path != "/metrics" {
            return plain(
                StatusCode::NOT_FOUND,
                "not found; metrics are at /metrics\n",
            );
        }
        if method != Method::GET && method != Method::HEAD {
            let mut res = plain(StatusCode::METHOD_NOT_ALLOWED, "use GET or HEAD\n");
            res.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return res;
        }
        if let Some(token) = &self.inner.token {
            if !token.authorize(authorization) {
                let mut res = plain(
                    StatusCode::UNAUTHORIZED,
                    "a bearer token is required: Authorization: Bearer <token>\n",
                );
                res.headers_mut().insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"metrics\""),
                );
                return res;
            }
        }
        match render(&self.inner.registry) {
            Ok(body) => {
                let mut res = Response::new(Full::new(Bytes::from(body)));
                res.headers_mut()
                    .insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
                res
            }
            Err(e) => {
                warn!(error = %e, "metrics scrape failed");
                plain(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n")
            }
        }
    }
}

impl<B> hyper::service::Service<Request<B>> for MetricsService {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn call(&self, req: Request<B>) -> Self::Future {
        let auth = req.headers().get(AUTHORIZATION).map(HeaderValue::as_bytes);
        ready(Ok(self.respond(req.method(), req.uri().path(), auth)))
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE_HEADER,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(token: Option<&str>) -> MetricsService {
        let registry = Registry::new();
        let counter = prometheus::IntCounter::new("probe_total", "A probe.").expect("valid");
        counter.inc();
        registry.register(Box::new(counter)).expect("registers");
        MetricsService::new(registry, token.and_then(BearerToken::new))
    }

    #[test]
    fn routes_by_path_then_method_then_token() {
        let s = service(Some("tok"));
        let ok = s.respond(&Method::GET, "/metrics", Some(b"Bearer tok"));
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(ok.headers()[CONTENT_TYPE_HEADER], CONTENT_TYPE);
        assert_eq!(
            s.respond(&Method::HEAD, "/metrics", Some(b"Bearer tok"))
                .status(),
            StatusCode::OK
        );
        assert_eq!(
            s.respond(&Method::GET, "/", None).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            s.respond(&Method::GET, "/metrics/", Some(b"Bearer tok"))
                .status(),
            StatusCode::NOT_FOUND
        );
        let post = s.respond(&Method::POST, "/metrics", Some(b"Bearer tok"));
        assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(post.headers()[ALLOW], "GET, HEAD");
        let denied = s.respond(&Method::GET, "/metrics", Some(b"Bearer nope"));
        assert_eq!(denied.status(), StatusCode::UNAUTHORIZED);
        assert!(denied.headers()[WWW_AUTHENTICATE]
            .to_str()
            .expect("ascii")
            .starts_with("Bearer"));
        assert_eq!(
            s.respond(&Method::GET, "/metrics", None).status(),
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn without_a_token_anyone_may_scrape_and_the_body_is_the_exposition() {
        let s = service(None);
        assert_eq!(
            s.respond(&Method::GET, "/metrics", None).status(),
            StatusCode::OK
        );
        let text = render(&s.inner.registry).expect("encodes");
        assert!(text.contains("probe_total 1"), "{text}");
    }
}
