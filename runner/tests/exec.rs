//! `lockrun exec` on real processes: a lock stolen by a stock client while
//! the command (a shell that ignores SIGTERM and started a grandchild) runs;
//! exit codes; signal forwarding; `--wait --timeout`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rustix::process::Signal;

/// Short enough for a fast test, long enough for a loaded 2-core machine.
const TTL: Duration = Duration::from_secs(3);

/// A shell that ignores SIGTERM (and so does its grandchild), prints both
/// pids, and waits: only SIGKILL ends it.
const STUBBORN: &str = r#"trap '' TERM; sleep 60 & echo "pid=$$ child=$!"; wait"#;

/// The `pid=` and `child=` a command printed first, waited for at most 20 s.
fn tree_pids(runner: &Spawned) -> Vec<u32> {
    runner
        .stdout
        .wait_for(Duration::from_secs(20), |lines| {
            let l = lines.first()?;
            Some(vec![field(&l.text, "pid")?, field(&l.text, "child")?])
        })
        .expect("the command printed its pids")
}

/// The runner's watchdog: its child that is not the command.
fn watchdog_of(runner: &Spawned, command: u32) -> u32 {
    let others: Vec<u32> = children(runner.id())
        .into_iter()
        .filter(|p| *p != command)
        .collect();
    assert_eq!(
        others.len(),
        1,
        "one watchdog beside the command: {others:?}"
    );
    others[0]
}

/// The kill grace of the steal cases. The steal comes just after a
/// renewal, so the loss is seen at the next one (TTL/3 later) and the tree
/// dies a grace after that; the default grace (TTL/4) would leave only
/// ~220 ms to the earliest possible local deadline the case asserts
/// against, which a late timer on a loaded 2-core machine can eat.
const STEAL_GRACE: &str = "300ms";

/// Starts `lockrun exec` on `backend` and returns it with the tree's pids.
fn start_holder(backend: &str, name: &str) -> (Spawned, Vec<u32>) {
    let mut command = exec(
        backend,
        name,
        &[
            "--ttl",
            "3s",
            "--kill-grace",
            STEAL_GRACE,
            "--metrics-addr",
            "127.0.0.1:0",
            "--",
        ],
    );
    command.args(["sh", "-c", STUBBORN]);
    let holder = Spawned::start(command, name);
    let pids = tree_pids(&holder);
    (holder, pids)
}

/// Steals the lock with a stock client while a stubborn tree runs under
/// it, then measures until the last process of the tree is gone; asserts
/// that happens before the runner's local deadline (at least 2/3 of the
/// TTL, less the drift, after the steal: the runner renews every TTL/3),
/// that the runner exits "lock lost", and that its watchdog was reaped
/// before it exited.
fn steal_and_measure(backend: Backend) {
    let server = backend.server();
    let label = backend.label();
    let name = unique(&format!("lockrun/steal-{label}"));
    // Postgres: a session marked by name, to terminate exactly it.
    let app = unique("lockrun-steal");
    let url = match backend {
        Backend::Postgres => {
            let sep = if server.url.contains('?') { '&' } else { '?' };
            format!("{}{sep}application_name={app}", server.url)
        }
        _ => server.url.clone(),
    };
    let (mut holder, pids) = start_holder(&url, &name);
    let watchdog = watchdog_of(&holder, pids[0]);
    // Steal in steady state: once the lease was renewed.
    wait_renewed(metrics_addr(&holder), &name);
    assert!(
        pids.iter().all(|p| alive(*p)),
        "the tree runs while the lock is held"
    );
    steal(&server, &name, &app);
    let stolen = Instant::now();
    let gone = wait_all_gone(&pids, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("{label}: processes still alive 10 s after the steal"));
    let took = gone - stolen;
    let status = holder.wait_bounded(Duration::from_secs(10));
    assert_eq!(
        state(watchdog),
        None,
        "{label}: the watchdog outlived the runner (running or a zombie)"
    );
    println!(
        "steal-to-last-death {label}: {} ms (TTL {} ms)",
        took.as_millis(),
        TTL.as_millis()
    );
    let deadline_floor = TTL * 2 / 3 - (TTL / 100 + Duration::from_millis(2));
    assert!(
        took < deadline_floor,
        "{label}: the tree outlived the earliest possible local deadline: {took:?}"
    );
    assert_eq!(status.code(), Some(76), "{label}: exit code 'lock lost'");
}

/// Takes the lock away from its holder with the backend's stock client.
fn steal(server: &Server, name: &str, app: &str) {
    match server.backend {
        Backend::Redis => {
            client(
                "redis-cli",
                &["-u", &server.url, "SET", &format!("lock:{name}"), "stolen"],
            );
        }
        Backend::Postgres => {
            let killed = client(
                "psql",
                &[
                    &server.url,
                    "-Atc",
                    &format!(
                        "select count(pg_terminate_backend(l.pid)) from pg_locks l \
                         join pg_stat_activity a using (pid) \
                         where l.locktype = 'advisory' and a.application_name = '{app}'"
                    ),
                ],
            );
            assert_eq!(killed, "1", "exactly the holder's session was terminated");
        }
        Backend::Etcd => {
            let endpoint = server.endpoint.as_deref().expect("etcd endpoint");
            let json = client(
                "etcdctl",
                &[
                    "--endpoints",
                    endpoint,
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
                    endpoint,
                    "lease",
                    "revoke",
                    &format!("{lease:x}"),
                ],
            );
        }
    }
}

per_backend!(steal_and_measure:
    redis_steal_kills_the_whole_tree_before_the_deadline,
    postgres_session_kill_kills_the_whole_tree_before_the_deadline,
    etcd_lease_revoke_kills_the_whole_tree_before_the_deadline);

#[test]
fn exit_codes_are_the_documented_ones() {
    let url = redis_url();
    let name = unique("lockrun/codes");
    let code = |command| output_bounded(command, Duration::from_secs(20)).0.code();
    let on = |rest: &[&str]| code(exec(&url, &name, rest));
    // The command's own status, and its environment.
    let mut own = exec(&url, &name, &["--", "sh", "-c"]);
    own.arg("echo \"$LOCK_NAME $LOCK_FENCING_TOKEN\"; exit 7");
    let (status, stdout, _) = output_bounded(own, Duration::from_secs(20));
    assert_eq!(status.code(), Some(7));
    let mut words = stdout.split_whitespace();
    assert_eq!(words.next(), Some(name.as_str()));
    assert!(
        words.next().and_then(|t| t.parse::<u64>().ok()).is_some(),
        "{stdout}"
    );
    // Each command with the code it exits with, in the order run.
    for (what, command, expected) in [
        (
            "no backend and no command",
            lockrun(&["exec", "--name", &name]),
            64,
        ),
        ("an unknown flag", lockrun(&["exec", "--bogus"]), 64),
        ("a bad name", exec(&url, "bad name", &["--", "true"]), 64),
        (
            "no backend",
            lockrun(&["exec", "--name", &name, "--", "true"]),
            64,
        ),
        (
            "a maximum hold shorter than the TTL",
            exec(&url, &name, &["--max-hold", "1s", "--", "true"]),
            64,
        ),
        (
            "the backend unreachable",
            exec("redis://127.0.0.1:1", &name, &["--", "true"]),
            69,
        ),
        (
            "the command not found",
            exec(&url, &name, &["--", "/nonexistent/cmd"]),
            127,
        ),
    ] {
        assert_eq!(code(command), Some(expected), "{what}");
    }
    // Held elsewhere: 75, or the code -E asks for.
    let (mut holder, pids) = start_holder(&url, &name);
    assert_eq!(on(&["--", "true"]), Some(75));
    assert_eq!(on(&["-E", "3", "--", "true"]), Some(3));
    // --wait --timeout gives up after the timeout, not before.
    let started = Instant::now();
    assert_eq!(
        on(&["--wait", "--timeout", "500ms", "--", "true"]),
        Some(75)
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    // The holder's command exits by itself (its grandchild killed, `wait`
    // returns): the runner exits with the shell's status, then releases.
    client("kill", &["-KILL", &pids[1].to_string()]);
    // SIGTERM to the runner is forwarded; the shell ignores it.
    holder.signal(Signal::TERM);
    // `wait` without operands returns 0 once the grandchild is gone.
    let status = holder.wait_bounded(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0));
    assert!(wait_all_gone(&pids, Duration::from_secs(2)).is_some());
    // Released after the group exited: the lock is free again.
    assert_eq!(on(&["--", "true"]), Some(0));
}

#[test]
fn signals_are_forwarded_to_the_whole_group() {
    let url = redis_url();
    let name = unique("lockrun/signals");
    let mut command = exec(&url, &name, &["--ttl", "3s", "--"]);
    command.args(["sh", "-c", r#"sleep 60 & echo "pid=$$ child=$!"; wait"#]);
    let mut holder = Spawned::start(command, &name);
    let pids = tree_pids(&holder);
    let watchdog = watchdog_of(&holder, pids[0]);
    holder.signal(Signal::INT);
    let status = holder.wait_bounded(Duration::from_secs(10));
    // sh dies of the forwarded SIGINT: 128 + 2.
    assert_eq!(status.code(), Some(130));
    assert!(
        wait_all_gone(&pids, Duration::from_secs(2)).is_some(),
        "grandchild reaped too"
    );
    assert_eq!(
        state(watchdog),
        None,
        "the watchdog was reaped before lockrun exited"
    );
}

/// A shell that prints "term" on SIGTERM and waits on, with a child that
/// ignores SIGTERM: only SIGKILL ends the group.
const TERM_LOGGER: &str = r#"trap 'echo term' TERM; (trap '' TERM; exec sleep 60) & echo "pid=$$ child=$!"; while kill -0 $! 2>/dev/null; do wait $!; done"#;

#[test]
fn max_hold_stops_the_group_with_sigterm_then_sigkill_after_the_grace() {
    let url = redis_url();
    let name = unique("lockrun/max-hold");
    // SIGTERM at 3 s, SIGKILL at 4 s; the lock held and renewed until the
    // group is gone.
    let (max_hold, grace) = (Duration::from_secs(4), Duration::from_secs(1));
    let mut command = exec(
        &url,
        &name,
        &[
            "--ttl",
            "4s",
            "--max-hold",
            "4s",
            "--kill-grace",
            "1s",
            "--",
        ],
    );
    command.args(["sh", "-c", TERM_LOGGER]);
    let mut holder = Spawned::start(command, &name);
    let pids = tree_pids(&holder);
    let started = holder.stdout.snapshot()[0].at;
    let termed = termed_at(&holder, max_hold, |l| l == "term");
    // During the grace the lock is still held: nothing else runs while the
    // group does.
    let (during, _, _) =
        output_bounded(exec(&url, &name, &["--", "true"]), Duration::from_secs(20));
    assert!(
        pids.iter().all(|p| alive(*p)),
        "the group outlived the check"
    );
    assert_eq!(during.code(), Some(75), "held while the group runs");
    let gone = wait_all_gone(&pids, Duration::from_secs(5)).expect("the group was killed");
    let status = holder.wait_bounded(Duration::from_secs(10));
    check_max_hold("max-hold", (max_hold, grace), started, termed, gone);
    assert_eq!(status.code(), Some(76), "exit code 'lock lost'");
    assert_max_hold_logged(&holder);
    // The lock was let go: another run takes it at once.
    let (status, _, _) =
        output_bounded(exec(&url, &name, &["--", "true"]), Duration::from_secs(20));
    assert_eq!(status.code(), Some(0));
}
