//! `lockrun cron` with three runner processes on one Redis: one under
//! libfaketime +2 s, one killed with SIGKILL midway. Every tick's command
//! completes at most once, every tick nobody was killed in completes
//! exactly once, and the killed runner's command tree is gone at once.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use distlock::scheduler::chrono::DateTime;

type Lines = Arc<Mutex<Vec<String>>>;

fn libfaketime() -> String {
    let out = client("dpkg", &["-L", "libfaketime"]);
    out.lines()
        .find(|l| l.ends_with("libfaketime.so.1"))
        .expect("libfaketime.so.1 (apt-get install libfaketime)")
        .to_owned()
}

fn start(file: &str, replica: &str, faketime: Option<&str>) -> (Child, Lines) {
    let mut command = lockrun(&["cron", "--backend", &redis_url(), file]);
    command
        .env("REPLICA", replica)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(lib) = faketime {
        command
            .env("LD_PRELOAD", lib)
            .env("FAKETIME", "+2")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    let mut child = command.spawn().expect("spawn lockrun cron");
    let lines: Lines = Arc::default();
    let sink = Arc::clone(&lines);
    let out = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().expect("lines").push(line);
        }
    });
    (child, lines)
}

fn epoch() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[test]
fn three_runners_run_each_tick_once_and_a_killed_one_leaves_nothing_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let job = unique("lockrun-cron");
    let file = dir.path().join("crontab");
    std::fs::write(
        &file,
        format!(
            "# every second, half a second of work in a grandchild\n\
             {job} * * * * * * ttl=3s -- echo \"start $LOCKRUN_SCHEDULED_AT $REPLICA $$\"; \
             sleep 0.5 & echo \"child $!\"; wait; echo \"done $LOCKRUN_SCHEDULED_AT $REPLICA\"\n"
        ),
    )
    .expect("write the cron file");
    let file = file.to_str().expect("utf-8 path").to_owned();
    let lib = libfaketime();
    let began = epoch();
    let (mut a, a_lines) = start(&file, "a", None);
    let (mut b, b_lines) = start(&file, "b", Some(&lib));
    let (mut c, c_lines) = start(&file, "c", None);

    // Kill the skewed runner (it fires first, so it runs most ticks) while
    // one of its commands runs: the last line it printed is a `child` line.
    std::thread::sleep(Duration::from_secs(4));
    let waited = Instant::now();
    let (shell, grandchild, killed_at) = loop {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "b never ran a command"
        );
        let lines = b_lines.lock().expect("lines").clone();
        let n = lines.len();
        if n >= 2 && lines[n - 1].contains("] child ") && lines[n - 2].contains("] start ") {
            let shell: u32 = lines[n - 2]
                .rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .expect("pid");
            let grandchild: u32 = lines[n - 1]
                .rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .expect("pid");
            if alive(shell) {
                client("kill", &["-KILL", &b.id().to_string()]);
                break (shell, grandchild, Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = wait_bounded(&mut b, Duration::from_secs(5));
    let gone = wait_all_gone(&[shell, grandchild], Duration::from_secs(3))
        .expect("the killed runner's command still runs after its TTL");
    println!(
        "runner SIGKILLed: its command tree was gone after {} ms",
        (gone - killed_at).as_millis()
    );
    assert!(
        gone - killed_at < Duration::from_millis(400),
        "killed by the watchdog, not by finishing"
    );

    std::thread::sleep(Duration::from_secs(5));
    let ended = epoch();
    for runner in [&mut a, &mut c] {
        client("kill", &["-TERM", &runner.id().to_string()]);
    }
    assert_eq!(
        wait_bounded(&mut a, Duration::from_secs(40)).code(),
        Some(0)
    );
    assert_eq!(
        wait_bounded(&mut c, Duration::from_secs(40)).code(),
        Some(0)
    );
    std::thread::sleep(Duration::from_millis(100));

    let mut done: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    let mut b_running: Option<i64> = None;
    for (replica, lines) in [("a", &a_lines), ("b", &b_lines), ("c", &c_lines)] {
        for line in lines.lock().expect("lines").iter() {
            let mut words = line.split_whitespace();
            assert_eq!(words.next(), Some(format!("[{job}]").as_str()), "{line}");
            let kind = words.next();
            if kind == Some("done") || kind == Some("start") {
                let tick = DateTime::parse_from_rfc3339(words.next().expect("tick"))
                    .expect("rfc3339")
                    .timestamp();
                if kind == Some("done") {
                    done.entry(tick).or_default().push(replica.to_owned());
                } else if replica == "b" {
                    b_running = Some(tick);
                }
            }
        }
    }
    let mut table = String::new();
    for (tick, replicas) in &done {
        assert_eq!(replicas.len(), 1, "tick {tick} completed on {replicas:?}");
        table.push_str(&format!("{tick}:{} ", replicas[0]));
    }
    println!("completions per tick: {table}");
    // Every tick while all were up (after a 2 s start-up margin, before a
    // 2 s stop margin) completed once, except the one the kill cut short.
    let first = began.ceil() as i64 + 2;
    let last = ended.floor() as i64 - 2;
    for tick in first..=last {
        if Some(tick) == b_running && !done.contains_key(&tick) {
            continue;
        }
        assert!(
            done.contains_key(&tick),
            "tick {tick} never completed: {table}"
        );
    }
}
