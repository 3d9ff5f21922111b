//! A minimal HTTP/1.0 GET over loopback and the Prometheus API answers the test reads.

use std::time::{Duration, Instant};

use conformance_tests::BoxError;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// GETs `path` from `127.0.0.1:port`; returns the status code and the body.
pub(crate) async fn get(port: u16, path: &str) -> Result<(u16, String), BoxError> {
    let exchange = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, BoxError>(raw)
    };
    let raw = timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("GET {path} took over 10 s"))??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET {path}: no header end in {text:?}"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("GET {path}: no status in {head:?}"))?;
    Ok((code, body.to_owned()))
}

/// GETs a Prometheus API path and returns its `data`.
pub(crate) async fn api(port: u16, path: &str) -> Result<Value, BoxError> {
    let (code, body) = get(port, path).await?;
    let json: Value = serde_json::from_str(&body)?;
    if code != 200 || json["status"] != "success" {
        return Err(format!("GET {path}: HTTP {code}: {body}").into());
    }
    Ok(json["data"].clone())
}

/// Percent-encodes a PromQL expression for a query string.
pub(crate) fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The instant-query result vector of `query`.
pub(crate) async fn query(port: u16, query: &str) -> Result<Vec<Value>, BoxError> {
    let data = api(port, &format!("/api/v1/query?query={}", encode(query))).await?;
    Ok(data["result"].as_array().cloned().unwrap_or_default())
}

/// The sample value of a query result entry.
pub(crate) fn value_of(sample: &Value) -> Option<f64> {
    sample["value"][1].as_str()?.parse().ok()
}

/// Polls `probe` every 200 ms until it returns `Some`, for at most `within`.
pub(crate) async fn poll<T, F, Fut>(
    what: &str,
    within: Duration,
    mut probe: F,
) -> Result<T, BoxError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, BoxError>>,
{
    let start = Instant::now();
    let mut last_error = String::new();
    while start.elapsed() < within {
        match probe().await {
            Ok(Some(found)) => return Ok(found),
            Ok(None) => {}
            Err(e) => last_error = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(format!("{what}: not seen within {within:?} (last error: {last_error:?})").into())
}
