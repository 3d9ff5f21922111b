//! Reading a runner's /metrics endpoint.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::Spawned;

/// `GET /metrics` on `addr`, with `Authorization: Bearer TOKEN` if given;
/// returns the status code and the whole response.
pub fn scrape(addr: SocketAddr, token: Option<&str>) -> (u16, String) {
    let limit = Duration::from_secs(5);
    let mut stream = TcpStream::connect_timeout(&addr, limit).expect("connect to /metrics");
    stream.set_read_timeout(Some(limit)).expect("read timeout");
    stream
        .set_write_timeout(Some(limit))
        .expect("write timeout");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"));
    (status, response)
}

/// The /metrics address a runner logged (human-readable logs), waited for
/// at most 10 s.
pub fn metrics_addr(runner: &Spawned) -> SocketAddr {
    runner
        .stderr
        .wait_for(Duration::from_secs(10), |lines| {
            lines
                .iter()
                .filter(|l| l.text.contains("serving /metrics"))
                .find_map(|l| {
                    l.text
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("addr=")?.parse().ok())
                })
        })
        .expect("the runner logged its /metrics address")
}

/// Waits (polling /metrics, at most 10 s) until the lease on `lock` was
/// renewed at least once.
pub fn wait_renewed(addr: SocketAddr, lock: &str) {
    let series = format!("distributed_lock_renewals_total{{lock=\"{lock}\",outcome=\"renewed\"}} ");
    let start = Instant::now();
    loop {
        let (_, body) = scrape(addr, None);
        let renewed = body
            .lines()
            .filter_map(|l| l.strip_prefix(&series)?.trim().parse::<u64>().ok())
            .any(|n| n >= 1);
        if renewed {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{lock} was not renewed within 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
