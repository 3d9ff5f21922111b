//! `lockrun status`, `ls`, `leader` and `release` on real processes, on
//! every server backend: a runner holding a lock is described by its host,
//! pid and token; a release naming another token is refused; one naming its
//! token makes the holder kill its command and exit 76.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Runs a `lockrun` inspection command to completion (each is one backend
/// call or a few); returns its exit code and stdout.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let (status, out, _err) = output_bounded(lockrun(args), Duration::from_secs(20));
    (status.code(), out)
}

fn json_of(out: &str) -> Value {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// `status --json` until the lock shows as held with its holder and token,
/// for at most 20 s. On Postgres the holder's row (and then its token)
/// follows the lock by a statement on a process's first acquire, so a
/// lock can show held by an unknown holder for a round trip.
fn wait_held(url: &str, name: &str) -> Value {
    let start = Instant::now();
    loop {
        let (code, out) = run(&["status", "--backend", url, "--json", name]);
        if code == Some(0) {
            let held = json_of(&out);
            if held["holder"].is_string() && held["fencing_token"].is_u64() {
                return held;
            }
        } else {
            assert_eq!(code, Some(1), "status of a free lock exits 1: {out}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{name} never held"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn holder_runs_under_a_lock(backend: Backend) {
    let server = backend.server();
    let label = backend.label();
    let url = server.url.as_str();
    let prefix = unique(&format!("lockrun/admin-{label}"));
    let name = format!("{prefix}/held");
    let mut holder = Spawned::start(
        exec(url, &name, &["--ttl", "3s", "--", "sleep", "60"]),
        "holder",
    );
    let held = wait_held(url, &name);
    let identity = held["holder"].as_str().expect("a holder identity");
    assert!(
        identity.contains(&format!("/{}/", holder.id())),
        "{label}: the identity names the runner's pid {}: {identity}",
        holder.id()
    );
    let token = held["fencing_token"].as_u64().expect("a fencing token");
    println!("{label} status --json: {held}");

    let (code, table) = run(&["status", "--backend", url, &name]);
    assert_eq!(code, Some(0));
    assert!(
        table.starts_with("LOCK") && table.contains(identity),
        "{table}"
    );
    println!("{label} status:\n{table}");

    let (code, out) = run(&["ls", "--backend", url, "--json", &prefix]);
    assert_eq!(code, Some(0));
    let listed = json_of(&out);
    let names: Vec<&str> = listed["locks"]
        .as_array()
        .expect("locks")
        .iter()
        .filter_map(|l| l["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [name.as_str()],
        "{label}: ls lists exactly the held lock"
    );
    let (_, table) = run(&["ls", "--backend", url, &prefix]);
    println!("{label} ls:\n{table}");

    // A stale token frees nothing.
    let wrong = (token + 1).to_string();
    let (code, out) = run(&["release", "--backend", url, &name, "--token", &wrong]);
    assert_eq!(code, Some(75), "{label}: {out}");
    assert!(
        out.contains(&token.to_string()),
        "names the holder's token: {out}"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        alive(holder.id()),
        "{label}: a refused release stopped the holder"
    );

    let tok = token.to_string();
    let (code, out) = run(&[
        "release",
        "--backend",
        url,
        "--json",
        &name,
        "--token",
        &tok,
    ]);
    let released = Instant::now();
    assert_eq!(code, Some(0), "{label}: {out}");
    assert_eq!(json_of(&out)["outcome"], "released");
    let status = holder.wait_bounded(Duration::from_secs(10));
    println!(
        "{label}: lockrun release to the holder's exit: {} ms (TTL 3000 ms)",
        released.elapsed().as_millis()
    );
    assert_eq!(
        status.code(),
        Some(76),
        "{label}: the holder exits 'lock lost'"
    );
    let start = Instant::now();
    loop {
        let (code, _) = run(&["status", "--backend", url, &name]);
        if code == Some(1) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{label}: still held"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, out) = run(&["release", "--backend", url, &name, "--token", &tok]);
    assert_eq!(code, Some(1), "{label}: releasing a free lock: {out}");
}

per_backend!(holder_runs_under_a_lock:
    redis_status_ls_and_release,
    postgres_status_ls_and_release,
    etcd_status_ls_and_release);

#[test]
fn bad_input_is_refused_with_usage() {
    let url = redis_url();
    for args in [
        vec!["ls", "--backend", &url, "jobs/*"],
        vec!["ls", "--backend", &url, "a\nb"],
        vec!["status", "--backend", &url, "has space"],
        vec!["release", "--backend", &url, "jobs/x"],
        vec!["release", "--backend", &url, "jobs/x", "--token", "-1"],
        vec![
            "release",
            "--backend",
            &url,
            "jobs/x",
            "--token",
            "18446744073709551616",
        ],
    ] {
        let (code, out) = run(&args);
        assert_eq!(code, Some(64), "{args:?}: {out}");
    }
}

/// Three `lockrun cron` runners with a leader-mode entry: `leader` names
/// one of them, and `ls` shows the election lock.
#[test]
fn leader_names_one_of_three_runners() {
    let url = redis_url();
    let election = unique("lockrun/admin-election");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("cron");
    std::fs::write(&file, "tick * * * * * * mode=leader ttl=3s -- true\n").expect("cron file");
    let file = file.to_str().expect("utf-8 path").to_owned();
    let runners: Vec<Spawned> = (0..3)
        .map(|i| {
            let mut c: Command = lockrun(&[
                "cron",
                "--backend",
                &url,
                "--election-name",
                &election,
                "--election-ttl",
                "3s",
                "--election-interval",
                "1s",
                &file,
            ]);
            c.env("REPLICA", i.to_string());
            Spawned::start(c, "cron")
        })
        .collect();
    let held = wait_held(&url, &election);
    let leader = held["holder"].as_str().expect("a leader identity");
    let pids: Vec<u32> = runners.iter().map(Spawned::id).collect();
    assert!(
        pids.iter().any(|p| leader.contains(&format!("/{p}/"))),
        "the leader {leader} is one of the runners {pids:?}"
    );
    let (code, table) = run(&["leader", "--backend", &url, &election]);
    assert_eq!(code, Some(0));
    println!("leader of three runners {pids:?}:\n{table}");
    for r in &runners {
        r.signal(rustix::process::Signal::TERM);
    }
    for mut r in runners {
        r.wait_bounded(Duration::from_secs(40));
    }
    let start = Instant::now();
    loop {
        let (code, _) = run(&["leader", "--backend", &url, &election]);
        if code == Some(1) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a leader outlived every runner"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
