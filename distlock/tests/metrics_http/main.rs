//! The `/metrics` endpoint against raw TCP clients: good scrapes, bad
//! requests, slow and oversized clients, and too many connections. Each bad
//! client must get a quick error while good scrapes keep succeeding.

mod client;
mod logs;

use std::time::{Duration, Instant};

use distlock::metrics_http::MetricsServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use client::{exchange, get, good_scrape, registry, start, status, CASE_LIMIT, TOKEN};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_need_the_token_and_bad_requests_get_quick_errors() {
    timeout(CASE_LIMIT, async {
        let server = start(16, Duration::from_secs(5)).await;
        let addr = server.local_addr();
        good_scrape(addr).await;
        let cases: [(&str, Vec<u8>, &str); 6] = [
            ("no token", get("/metrics", None), "HTTP/1.1 401"),
            ("wrong token", get("/metrics", Some("Bearer nope")), "HTTP/1.1 401"),
            ("basic auth", get("/metrics", Some(&format!("Basic {TOKEN}"))), "HTTP/1.1 401"),
            ("wrong path", get("/admin", Some(&format!("Bearer {TOKEN}"))), "HTTP/1.1 404"),
            (
                "wrong method",
                format!("POST /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").into_bytes(),
                "HTTP/1.1 405",
            ),
            ("not HTTP", b"\x16\x03\x01\x00\xa5hello\r\n\r\n".to_vec(), "HTTP/1.1 400"),
        ];
        for (what, raw, expected) in cases {
            let started = Instant::now();
            let (reply, scrape) = tokio::join!(exchange(addr, &raw), good_scrape(addr));
            let took = started.elapsed();
            println!("{what}: {} in {took:?} (good scrape alongside: {scrape:?})", status(&reply));
            assert!(reply.starts_with(expected), "{what}: {reply}");
            assert!(took < Duration::from_secs(2), "{what} took {took:?}");
            if expected == "HTTP/1.1 401" {
                assert!(reply.contains("www-authenticate: Bearer"), "{reply}");
                assert!(!reply.contains("probe_total"), "{reply}");
            }
            if expected == "HTTP/1.1 405" {
                assert!(reply.contains("allow: GET, HEAD"), "{reply}");
            }
        }
        let head = exchange(
            addr,
            format!("HEAD /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(!head.contains("probe_total"), "HEAD has no body: {head}");
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_refused_quickly() {
    timeout(CASE_LIMIT, async {
        let server = start(16, Duration::from_secs(5)).await;
        let addr = server.local_addr();
        let mut raw = b"GET /metrics HTTP/1.1\r\nHost: t\r\nX-Padding: ".to_vec();
        raw.extend(std::iter::repeat_n(b'a', 64 * 1024));
        raw.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        let started = Instant::now();
        let mut stream = TcpStream::connect(addr).await.expect("connects");
        let (mut rd, mut wr) = stream.split();
        // The server may close before all 64 KiB are sent; a failed write is expected.
        let write = async {
            let _ = wr.write_all(&raw).await;
        };
        let read = async {
            let mut out = Vec::new();
            let _ = timeout(Duration::from_secs(5), rd.read_to_end(&mut out)).await;
            out
        };
        let ((), reply) = tokio::join!(write, read);
        let took = started.elapsed();
        let reply = String::from_utf8_lossy(&reply).into_owned();
        let scrape = good_scrape(addr).await;
        println!(
            "64 KiB header: {:?} in {took:?} (good scrape after: {scrape:?})",
            status(&reply)
        );
        // 431 when the reply wins the race with the client's unsent bytes; a
        // reset (no reply) when it does not. Either way: refused, and fast.
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
            "{reply}"
        );
        assert!(!reply.contains("probe_total"), "{reply}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sending_one_byte_a_second_is_cut_off_at_the_header_deadline() {
    timeout(CASE_LIMIT, async {
        let deadline = Duration::from_secs(2);
        let server = start(16, deadline).await;
        let addr = server.local_addr();
        let started = Instant::now();
        let stream = TcpStream::connect(addr).await.expect("connects");
        let (mut rd, mut wr) = stream.into_split();
        let closed = tokio::spawn(async move {
            let mut buf = [0u8; 256];
            // EOF or a reset both mean the server gave up on us.
            let _ = rd.read(&mut buf).await;
            Instant::now()
        });
        let request = get("/metrics", Some(&format!("Bearer {TOKEN}")));
        let mut scrapes = Vec::new();
        for byte in request.iter().take(20) {
            if closed.is_finished() || wr.write_all(&[*byte]).await.is_err() {
                break;
            }
            // Good scrapes keep working while the slow client trickles.
            scrapes.push(good_scrape(addr).await);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let cut_after = closed.await.expect("reader ends").duration_since(started);
        println!(
            "1 byte/s client: closed after {cut_after:?} (deadline {deadline:?}); \
             good scrapes meanwhile: {scrapes:?}"
        );
        assert!(
            cut_after < deadline + Duration::from_secs(2),
            "{cut_after:?}"
        );
        assert!(!scrapes.is_empty());
        good_scrape(addr).await;
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_over_the_limit_is_refused_at_once() {
    timeout(CASE_LIMIT, async {
        let limit = 3;
        let server = start(limit, Duration::from_secs(10)).await;
        let addr = server.local_addr();
        let mut idle = Vec::new();
        for _ in 0..limit {
            idle.push(TcpStream::connect(addr).await.expect("connects"));
        }
        let started = Instant::now();
        let reply = exchange(addr, &get("/metrics", Some(&format!("Bearer {TOKEN}")))).await;
        let took = started.elapsed();
        println!(
            "connection {} of {limit}: {:?} in {took:?}",
            limit + 1,
            status(&reply)
        );
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 503"),
            "{reply}"
        );
        assert!(!reply.contains("probe_total"), "{reply}");
        assert!(took < Duration::from_secs(2), "took {took:?}");
        // Once the idle clients leave, their slots free up.
        drop(idle);
        let freed = Instant::now();
        loop {
            let reply = exchange(addr, &get("/metrics", Some(&format!("Bearer {TOKEN}")))).await;
            if reply.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(
                freed.elapsed() < Duration::from_secs(5),
                "slots never freed: {reply}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!("slots free again after {:?}", freed.elapsed());
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_and_drop_stop_listening() {
    timeout(CASE_LIMIT, async {
        let server = start(4, Duration::from_secs(5)).await;
        let addr = server.local_addr();
        good_scrape(addr).await;
        server.shutdown().await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "still listening after shutdown"
        );
        let dropped = start(4, Duration::from_secs(5)).await;
        let addr = dropped.local_addr();
        drop(dropped);
        let since = Instant::now();
        while TcpStream::connect(addr).await.is_ok() {
            assert!(
                since.elapsed() < Duration::from_secs(5),
                "still listening after drop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_anyone_can_scrape() {
    timeout(CASE_LIMIT, async {
        let server = MetricsServer::builder(registry())
            .with_token("")
            .with_bind(([127, 0, 0, 1], 0).into())
            .start()
            .await
            .expect("binds");
        let reply = exchange(server.local_addr(), &get("/metrics", None)).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.contains("probe_total 7"), "{reply}");
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connection_is_closed_at_its_lifetime() {
    timeout(CASE_LIMIT, async {
        let lifetime = Duration::from_secs(1);
        let server = MetricsServer::builder(registry())
            .with_token(TOKEN)
            .with_bind(([127, 0, 0, 1], 0).into())
            .with_connection_timeout(lifetime)
            .with_header_read_timeout(Duration::from_secs(20))
            .start()
            .await
            .expect("binds");
        let started = Instant::now();
        let mut stream = TcpStream::connect(server.local_addr())
            .await
            .expect("connects");
        let keep_alive =
            format!("GET /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n\r\n");
        stream
            .write_all(keep_alive.as_bytes())
            .await
            .expect("sends");
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            // Ends with EOF (or a reset) when the server closes the connection.
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        let closed_after = started.elapsed();
        let seen = String::from_utf8_lossy(&seen);
        println!("keep-alive connection closed after {closed_after:?} (lifetime {lifetime:?})");
        assert!(
            seen.starts_with("HTTP/1.1 200"),
            "the scrape was answered first: {seen}"
        );
        assert!(closed_after >= lifetime, "closed early: {closed_after:?}");
        assert!(
            closed_after < lifetime + Duration::from_secs(3),
            "{closed_after:?}"
        );
        server.shutdown().await;
    })
    .await
    .expect("the case finished in time");
}
