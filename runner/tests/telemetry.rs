//! What operators read from a running `lockrun exec`: `/metrics` behind the
//! bearer token while the command runs, and JSON log lines with `--log-json`.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use rustix::process::Signal;

#[test]
fn metrics_need_the_token_and_show_the_held_lock_and_logs_are_json_lines() {
    let url = redis_url();
    let name = unique("lockrun/metrics");
    let token = unique("token");
    let mut command = exec(
        &url,
        &name,
        &[
            "--metrics-addr",
            "127.0.0.1:0",
            "--log-json",
            "--",
            "sh",
            "-c",
            "echo pid=$$; exec sleep 30",
        ],
    );
    command.env("METRICS_TOKEN", &token);
    let mut runner = Spawned::start(command, &name);
    runner
        .stdout
        .wait_for(Duration::from_secs(20), |lines| lines.first().map(|_| ()))
        .expect("the command started");

    // The address the runner bound, from its JSON log.
    let addr: SocketAddr = runner
        .stderr
        .wait_for(Duration::from_secs(10), |lines| {
            lines.iter().find_map(|l| {
                let v: serde_json::Value = serde_json::from_str(&l.text).ok()?;
                if v["fields"]["message"] != "serving /metrics" {
                    return None;
                }
                v["fields"]["addr"].as_str()?.parse().ok()
            })
        })
        .expect("a JSON log line with the /metrics address");
    // The acquisition is logged once the command is spawned, so it may
    // come after the command's first line.
    runner
        .stderr
        .wait_for(Duration::from_secs(10), |lines| {
            lines
                .iter()
                .find(|l| {
                    l.text.contains("\"lock acquired; command started\"") && l.text.contains(&name)
                })
                .map(|_| ())
        })
        .expect("the acquisition is logged with the lock's name");
    let logged = runner.stderr.snapshot();
    for line in &logged {
        let v: serde_json::Value = serde_json::from_str(&line.text)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {:?}", line.text));
        assert!(v["timestamp"].is_string(), "{}", line.text);
        assert!(v["level"].is_string(), "{}", line.text);
        assert!(v["fields"]["message"].is_string(), "{}", line.text);
        assert!(!line.text.contains(&token), "the token is never logged");
    }

    assert_eq!(scrape(addr, None).0, 401, "no token");
    assert_eq!(scrape(addr, Some("wrong")).0, 401, "a wrong token");
    let (status, body) = scrape(addr, Some(&token));
    assert_eq!(status, 200, "{body}");
    for series in [
        format!("distributed_locks_held{{lock=\"{name}\"}} 1"),
        format!("distributed_lock_acquisitions_total{{lock=\"{name}\",outcome=\"acquired\"}} 1"),
    ] {
        assert!(
            body.lines().any(|l| l == series),
            "{series} while the command runs"
        );
    }

    runner.signal(Signal::TERM);
    // sleep dies of the forwarded SIGTERM: 128 + 15.
    assert_eq!(
        runner.wait_bounded(Duration::from_secs(10)).code(),
        Some(143)
    );
}
