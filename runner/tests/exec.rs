//! `lockrun exec` on real processes: a lock stolen by a stock client while
//! the command (a shell that ignores SIGTERM and started a grandchild) runs;
//! exit codes; signal forwarding; `--wait --timeout`.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

/// Short enough for a fast test, long enough for a loaded 2-core machine.
const TTL: Duration = Duration::from_secs(3);

/// A shell that ignores SIGTERM (and so does its grandchild), prints both
/// pids, and waits: only SIGKILL ends it.
const STUBBORN: &str = r#"trap '' TERM; sleep 60 & echo "$$ $!"; wait"#;

/// Starts `lockrun exec` on `backend` and returns it with the tree's pids.
fn start_holder(backend: &str, name: &str) -> (std::process::Child, Vec<u32>) {
    let mut child = lockrun(&[
        "exec",
        "--backend",
        backend,
        "--name",
        name,
        "--ttl",
        "3s",
        "--",
    ])
    .args(["sh", "-c", STUBBORN])
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("spawn lockrun");
    let out = child.stdout.take().expect("stdout");
    let (line, _out) = read_line(out, Duration::from_secs(20));
    let pids: Vec<u32> = line
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(pids.len(), 2, "shell and grandchild pids, got {line:?}");
    (child, pids)
}

/// Steals through `steal`, then measures until the last process of the
/// tree is gone; asserts that happens before the runner's local deadline
/// (at least 2/3 of the TTL, less the drift, after the steal: the runner
/// renews every TTL/3) and that the runner exits "lock lost".
fn steal_and_measure(
    backend_label: &str,
    mut holder: std::process::Child,
    pids: Vec<u32>,
    steal: impl FnOnce(),
) {
    // Let a renewal or two pass, so the lock is held in steady state.
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        pids.iter().all(|p| alive(*p)),
        "the tree runs while the lock is held"
    );
    steal();
    let stolen = Instant::now();
    let gone = wait_all_gone(&pids, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("{backend_label}: processes still alive 10 s after the steal"));
    let took = gone - stolen;
    let status = wait_bounded(&mut holder, Duration::from_secs(10));
    println!(
        "steal-to-last-death {backend_label}: {} ms (TTL {} ms)",
        took.as_millis(),
        TTL.as_millis()
    );
    let deadline_floor = TTL * 2 / 3 - (TTL / 100 + Duration::from_millis(2));
    assert!(
        took < deadline_floor,
        "{backend_label}: the tree outlived the earliest possible local deadline: {took:?}"
    );
    assert_eq!(
        status.code(),
        Some(76),
        "{backend_label}: exit code 'lock lost'"
    );
}

#[test]
fn redis_steal_kills_the_whole_tree_before_the_deadline() {
    let url = redis_url();
    let name = unique("lockrun/steal-redis");
    let (holder, pids) = start_holder(&url, &name);
    steal_and_measure("redis", holder, pids, || {
        client(
            "redis-cli",
            &["-u", &url, "SET", &format!("lock:{name}"), "stolen"],
        );
    });
}

#[test]
fn postgres_session_kill_kills_the_whole_tree_before_the_deadline() {
    let app = unique("lockrun-steal");
    let base = database_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}application_name={app}");
    let name = unique("lockrun/steal-postgres");
    let (holder, pids) = start_holder(&url, &name);
    steal_and_measure("postgres", holder, pids, || {
        let killed = client(
            "psql",
            &[
                &base,
                "-Atc",
                &format!(
                    "select count(pg_terminate_backend(l.pid)) from pg_locks l \
                     join pg_stat_activity a using (pid) \
                     where l.locktype = 'advisory' and a.application_name = '{app}'"
                ),
            ],
        );
        assert_eq!(killed, "1", "exactly the holder's session was terminated");
    });
}

#[test]
fn etcd_lease_revoke_kills_the_whole_tree_before_the_deadline() {
    use conformance_tests::backends::etcd::server;
    let etcd = server::start(server::ServerTls::default()).expect("a private etcd");
    let endpoint = format!("127.0.0.1:{}", etcd.port());
    let ready = Instant::now();
    while std::process::Command::new("etcdctl")
        .args(["--endpoints", &endpoint, "put", "/ready", "1"])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        assert!(
            ready.elapsed() < Duration::from_secs(20),
            "etcd never became ready"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let name = unique("lockrun/steal-etcd");
    let (holder, pids) = start_holder(&format!("etcd://{endpoint}"), &name);
    steal_and_measure("etcd", holder, pids, || {
        let json = client(
            "etcdctl",
            &[
                "--endpoints",
                &endpoint,
                "get",
                &format!("/locks/{name}"),
                "-w",
                "json",
            ],
        );
        let v: serde_json::Value = serde_json::from_str(&json).expect("etcdctl json");
        let lease = v["kvs"][0]["lease"]
            .as_i64()
            .expect("the lock key has a lease");
        client(
            "etcdctl",
            &[
                "--endpoints",
                &endpoint,
                "lease",
                "revoke",
                &format!("{lease:x}"),
            ],
        );
    });
}

#[test]
fn exit_codes_are_the_documented_ones() {
    let url = redis_url();
    let name = unique("lockrun/codes");
    let run = |args: &[&str]| {
        output_bounded(lockrun(args), Duration::from_secs(20))
            .status
            .code()
    };
    // The command's own status, and its environment.
    let mut own = lockrun(&["exec", "--backend", &url, "--name", &name, "--", "sh", "-c"]);
    own.arg("echo \"$LOCK_NAME $LOCK_FENCING_TOKEN\"; exit 7");
    let out = output_bounded(own, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(7));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut words = stdout.split_whitespace();
    assert_eq!(words.next(), Some(name.as_str()));
    assert!(
        words.next().and_then(|t| t.parse::<u64>().ok()).is_some(),
        "{stdout}"
    );
    // Bad arguments; no backend; backend unreachable; command not found.
    assert_eq!(run(&["exec", "--name", &name]), Some(64));
    assert_eq!(run(&["exec", "--bogus"]), Some(64));
    assert_eq!(
        run(&[
            "exec",
            "--backend",
            &url,
            "--name",
            "bad name",
            "--",
            "true"
        ]),
        Some(64)
    );
    assert_eq!(run(&["exec", "--name", &name, "--", "true"]), Some(64));
    assert_eq!(
        run(&[
            "exec",
            "--backend",
            "redis://127.0.0.1:1",
            "--name",
            &name,
            "--",
            "true"
        ]),
        Some(69)
    );
    assert_eq!(
        run(&[
            "exec",
            "--backend",
            &url,
            "--name",
            &name,
            "--",
            "/nonexistent/cmd"
        ]),
        Some(127)
    );
    // Held elsewhere: 75, or the code -E asks for.
    let (mut holder, pids) = start_holder(&url, &name);
    assert_eq!(
        run(&["exec", "--backend", &url, "--name", &name, "--", "true"]),
        Some(75)
    );
    assert_eq!(
        run(&[
            "exec",
            "--backend",
            &url,
            "--name",
            &name,
            "-E",
            "3",
            "--",
            "true"
        ]),
        Some(3)
    );
    // --wait --timeout gives up after the timeout, not before.
    let started = Instant::now();
    assert_eq!(
        run(&[
            "exec",
            "--backend",
            &url,
            "--name",
            &name,
            "--wait",
            "--timeout",
            "500ms",
            "--",
            "true"
        ]),
        Some(75)
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    // The holder's command exits by itself (its grandchild killed, `wait`
    // returns): the runner exits with the shell's status, then releases.
    let runner = holder.id().to_string();
    client("kill", &["-KILL", &pids[1].to_string()]);
    // SIGTERM to the runner is forwarded; the shell ignores it.
    client("kill", &["-TERM", &runner]);
    // `wait` without operands returns 0 once the grandchild is gone.
    let status = wait_bounded(&mut holder, Duration::from_secs(10));
    assert_eq!(status.code(), Some(0));
    assert!(wait_all_gone(&pids, Duration::from_secs(2)).is_some());
    // Released after the group exited: the lock is free again.
    assert_eq!(
        run(&["exec", "--backend", &url, "--name", &name, "--", "true"]),
        Some(0)
    );
}

#[test]
fn signals_are_forwarded_to_the_whole_group() {
    let url = redis_url();
    let name = unique("lockrun/signals");
    let mut holder = lockrun(&[
        "exec",
        "--backend",
        &url,
        "--name",
        &name,
        "--ttl",
        "3s",
        "--",
    ])
    .args(["sh", "-c", r#"sleep 60 & echo "$$ $!"; wait"#])
    .stdout(Stdio::piped())
    .spawn()
    .expect("spawn");
    let (line, _out) = read_line(
        holder.stdout.take().expect("stdout"),
        Duration::from_secs(20),
    );
    let pids: Vec<u32> = line
        .split_whitespace()
        .map(|p| p.parse().expect("pid"))
        .collect();
    client("kill", &["-INT", &holder.id().to_string()]);
    let status = wait_bounded(&mut holder, Duration::from_secs(10));
    // sh dies of the forwarded SIGINT: 128 + 2.
    assert_eq!(status.code(), Some(130));
    assert!(
        wait_all_gone(&pids, Duration::from_secs(2)).is_some(),
        "grandchild reaped too"
    );
}
