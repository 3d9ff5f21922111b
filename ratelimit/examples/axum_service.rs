//! An axum service behind the rate-limit layer, limits from the environment.
//!
//! ```text
//! RATE_LIMIT_URL=redis://127.0.0.1:6379 cargo run -p distlock-ratelimit --features tower,redis --example axum_service
//! curl -i http://127.0.0.1:3000/
//! ```

use std::net::SocketAddr;

use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::{Extension, Router};
use distlock_ratelimit::layer::RateLimitLayer;
use distlock_ratelimit::{Decision, Limit, Limiter, Quota, RateLimitConfig};

/// The routes, each request limited per client address.
pub(crate) fn app(limiter: Limiter) -> Router {
    Router::new()
        .route("/", get(hello))
        .layer(RateLimitLayer::new(limiter).with_peer(|parts| {
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip())
        }))
}

async fn hello(Extension(decision): Extension<Decision>) -> String {
    format!("hello; {} left\n", decision.remaining)
}

/// 5 a minute and 100 a day per client.
pub(crate) fn limiter(config: &RateLimitConfig) -> distlock_ratelimit::Result<Limiter> {
    config
        .limiter("hello")
        .with_limit(Limit::new("minute", Quota::per_minute(5)?)?)
        .with_limit(Limit::new("day", Quota::per_day(100)?)?)
        .build()
}

#[allow(dead_code)] // the tests include this file for `app` and `limiter`
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let limiter = limiter(&RateLimitConfig::from_env()?)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(
        listener,
        app(limiter).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
