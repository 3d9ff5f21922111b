//! Serves a Prometheus [`Registry`](prometheus::Registry) as `GET /metrics`
//! over HTTP/1, with an optional bearer token (cargo feature `metrics-http`).
//!
//! Run it on its own port with [`MetricsServer::builder`], or mount it in a
//! server you already have: [`MetricsService`] is a hyper service, and
//! [`render`] with [`BearerToken::authorize`] are the two steps any other
//! framework's handler needs.
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), distlock::metrics_http::MetricsHttpError> {
//! use distlock::metrics_http::MetricsServer;
//!
//! let server = MetricsServer::builder(distlock::prometheus::default_registry().clone())
//!     .with_token_from_env() // METRICS_TOKEN; without one, anyone who can connect may scrape
//!     .with_bind(([0, 0, 0, 0], 9464).into())
//!     .start()
//!     .await?;
//! // ... run the service ...
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Requests other than `GET`/`HEAD /metrics` get 404 or 405; a missing or
//! wrong token gets 401 with `WWW-Authenticate: Bearer`. A client that is
//! slow to send its headers, sends oversized ones, or arrives over the
//! connection limit is cut off quickly and never holds up other scrapes.

mod auth;
mod config;
mod handler;
mod server;

pub use auth::BearerToken;
pub use config::{MetricsHttpError, MetricsServerBuilder, METRICS_TOKEN_ENV};
pub use handler::{render, MetricsService, CONTENT_TYPE};
pub use server::{MetricsServer, MetricsServerHandle};

/// The HTTP library the service speaks, so a user can mount
/// [`MetricsService`] without naming a version of their own.
pub use hyper;
