//! What the endpoint writes to the log: a warning without a token, never the token.

use std::time::Duration;

use distlock::metrics_http::MetricsServer;
use tokio::time::timeout;

use crate::client::{exchange, get, good_scrape, registry, start, CASE_LIMIT, TOKEN};

/// Log lines written while a test's subscriber is the default.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut buf) = self.0.lock() {
            buf.extend_from_slice(data);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        self.0
            .lock()
            .map(|buf| String::from_utf8_lossy(&buf).into_owned())
            .unwrap_or_default()
    }
}

// Current-thread runtime: the subscriber is the default on this thread only,
// and every log line of these servers is written on it.
#[tokio::test]
async fn start_warns_without_a_token_and_never_logs_the_token() {
    timeout(CASE_LIMIT, async {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let open = MetricsServer::builder(registry())
            .with_bind(([127, 0, 0, 1], 0).into())
            .start()
            .await
            .expect("binds");
        assert!(logs.text().contains("WARN"), "{}", logs.text());
        assert!(logs.text().contains("no bearer token"), "{}", logs.text());
        open.shutdown().await;
        let before = logs.text().len();
        let guarded = start(4, Duration::from_secs(5)).await;
        let addr = guarded.local_addr();
        let _ = exchange(addr, &get("/metrics", Some("Bearer wrong-guess"))).await;
        good_scrape(addr).await;
        guarded.shutdown().await;
        let after = logs.text();
        assert!(!after[before..].contains("WARN"), "{after}");
        assert!(
            !after.contains(TOKEN),
            "the token leaked into the log: {after}"
        );
    })
    .await
    .expect("the case finished in time");
}
