//! The example service over loopback, driven by a real HTTP/1 client.

#![cfg(feature = "tower")]

#[path = "../examples/axum_service.rs"]
mod example;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{MemoryStore, Store, SwitchStore};
use distlock_ratelimit::{
    Decision, Limit, Limiter, OnStoreError, Quota, RateLimitConfig, RateLimitMetrics,
};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::Request;
use prometheus::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const CASE: Duration = Duration::from_secs(30);

async fn serve(app: axum::Router) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    Ok(addr)
}

/// One GET on a new connection: status, headers, body.
async fn get(
    addr: SocketAddr,
    forwarded: Option<&str>,
) -> Result<(u16, http::HeaderMap, String), Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = Request::get("/").header("host", "localhost");
    if let Some(f) = forwarded {
        req = req.header("x-forwarded-for", f);
    }
    let response = sender
        .send_request(req.body(Empty::<Bytes>::new())?)
        .await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, headers, String::from_utf8_lossy(&body).into_owned()))
}

fn header(h: &http::HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

#[tokio::test]
async fn over_the_limit_is_429_with_headers_and_forged_addresses_do_not_help() -> TestResult {
    timeout(CASE, async {
        let config = RateLimitConfig::from_values(|name| match name {
            "RATE_LIMIT_URL" => Some(Ok("memory://".to_owned())),
            _ => None,
        })?;
        let limiter = example::limiter(&config)?;
        let addr = serve(example::app(limiter)).await?;
        for left in (0..5).rev() {
            // A different forged X-Forwarded-For each time: ignored.
            let forged = format!("198.51.100.{left}");
            let (status, h, body) = get(addr, Some(&forged)).await?;
            assert_eq!(status, 200);
            assert_eq!(
                body,
                format!("hello; {left} left\n"),
                "the decision is in the extensions"
            );
            assert_eq!(
                header(&h, "ratelimit-policy"),
                "\"minute\";q=5;w=60, \"day\";q=100;w=86400"
            );
            assert!(header(&h, "ratelimit").starts_with(&format!("\"minute\";r={left};t=")));
        }
        let (status, h, _) = get(addr, Some("203.0.113.99")).await?;
        assert_eq!(status, 429);
        assert_eq!(header(&h, "retry-after"), "12");
        assert_eq!(header(&h, "ratelimit"), "\"minute\";r=0;t=60");
        Ok(())
    })
    .await?
}

#[tokio::test]
async fn a_failing_store_under_deny_is_503_with_retry_after_never_500() -> TestResult {
    timeout(CASE, async {
        let store = SwitchStore::new(Arc::new(MemoryStore::new()));
        store.refuse();
        let limiter = Limiter::builder("deny")
            .with_limit(Limit::new("minute", Quota::per_minute(5)?)?)
            .with_store(Arc::new(store) as Arc<dyn Store>)
            .with_on_store_error(OnStoreError::Deny)
            .with_metrics(RateLimitMetrics::register(&Registry::new())?)
            .build()?;
        let addr = serve(example::app(limiter)).await?;
        for _ in 0..5 {
            let (status, h, _) = get(addr, None).await?;
            assert_eq!(status, 503);
            assert!(header(&h, "retry-after").parse::<u64>()? >= 1);
        }
        Ok(())
    })
    .await?
}

#[tokio::test]
async fn decision_type_is_what_handlers_extract() {
    // The handler in the example extracts `Extension<Decision>`: a type
    // change here would break it at compile time, not at run time.
    fn assert_extension<T: Clone + Send + Sync + 'static>() {}
    assert_extension::<Decision>();
}
