//! Three runners, one under libfaketime +2 s, one SIGKILLed mid-command:
//! each tick completes at most once, every tick nobody was killed in
//! exactly once, and the killed runner's command tree dies at once.

use std::collections::BTreeMap;

use super::*;

fn three_runners(backend: Backend) {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let label = backend.label();
    let server = backend.server();
    let dir = tempfile::tempdir().expect("tempdir");
    let job = unique(&format!("lockrun-cron-{label}"));
    let file = write_crontab(
        &dir,
        &format!(
            "# every second, half a second of work in a grandchild\n\
             {job} * * * * * * ttl=3s -- echo \"start $LOCKRUN_SCHEDULED_AT $REPLICA pid=$$\"; \
             sleep 0.5 & echo \"child=$!\"; wait; echo \"done $LOCKRUN_SCHEDULED_AT $REPLICA\"\n"
        ),
    );
    let lib = libfaketime();
    let mut a = start(&server, &file, "a", None, &[]);
    let mut b = start(&server, &file, "b", Some(&lib), &[]);
    let mut c = start(&server, &file, "c", None, &[]);
    let ready = wait_started(&[&a, &b, &c]);

    // Let three ticks complete with all three up, then kill the skewed
    // runner once it has completed a tick and while a command of its runs.
    let all_done = |runners: &[&Spawned]| -> usize {
        runners
            .iter()
            .map(|r| events(&job, &r.stdout.snapshot(), "done").len())
            .sum()
    };
    let waited = Instant::now();
    while all_done(&[&a, &b, &c]) < 3 || events(&job, &b.stdout.snapshot(), "done").is_empty() {
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "{label}: three ticks, one of them on b, did not complete within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (shell, grandchild) = b
        .stdout
        .wait_for(Duration::from_secs(10), running)
        .unwrap_or_else(|| panic!("{label}: b never ran a command"));
    b.signal(Signal::KILL);
    let (killed_at, killed_epoch) = (Instant::now(), epoch());
    let _ = b.wait_bounded(Duration::from_secs(5));
    let gone = wait_all_gone(&[shell, grandchild], Duration::from_secs(3))
        .unwrap_or_else(|| panic!("{label}: the killed runner's command still runs after its TTL"));
    println!(
        "cron {label}: runner SIGKILLed, its command tree gone after {} ms",
        (gone - killed_at).as_millis()
    );
    assert!(
        gone - killed_at < Duration::from_millis(400),
        "{label}: killed by the watchdog, not by finishing"
    );

    // The survivors go on: wait until they completed the fourth tick after
    // the kill, and the sixth after all had started.
    let first = ready.ceil() as i64 + 1;
    let after = (killed_epoch.floor() as i64 + 4).max(first + 6);
    let survivors_done =
        |lines: &[Line]| events(&job, lines, "done").iter().any(|(t, _)| *t >= after);
    let waited = Instant::now();
    while !(survivors_done(&a.stdout.snapshot()) || survivors_done(&c.stdout.snapshot())) {
        assert!(
            waited.elapsed() < Duration::from_secs(15),
            "{label}: no tick completed by a or c after the kill"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ended = epoch();
    for runner in [&a, &c] {
        runner.signal(Signal::TERM);
    }
    assert_eq!(a.finish(Duration::from_secs(40)).code(), Some(0));
    assert_eq!(c.finish(Duration::from_secs(40)).code(), Some(0));

    let mut done: BTreeMap<i64, Vec<&str>> = BTreeMap::new();
    let mut per_runner = Vec::new();
    let b_lines = b.stdout.snapshot();
    let b_running = events(&job, &b_lines, "start").last().map(|(t, _)| *t);
    for (replica, runner) in [("a", &a), ("b", &b), ("c", &c)] {
        let lines = runner.stdout.snapshot();
        let completed = events(&job, &lines, "done");
        per_runner.push(format!("{replica}={}", completed.len()));
        for (tick, _) in completed {
            done.entry(tick).or_default().push(replica);
        }
    }
    let table: String = done
        .iter()
        .map(|(t, r)| format!("{t}:{} ", r.join("+")))
        .collect();
    println!(
        "cron {label}: ticks completed per runner: {}",
        per_runner.join(" ")
    );
    println!("cron {label}: completions per tick: {table}");
    for (tick, replicas) in &done {
        assert_eq!(
            replicas.len(),
            1,
            "{label}: tick {tick} completed on {replicas:?}"
        );
    }
    // Every tick from the second after all had started to two seconds
    // before the stop completed, except the one the kill cut short.
    let last = ended.floor() as i64 - 2;
    assert!(
        last - first >= 4,
        "{label}: a window of at least five ticks: started {ready:.3}, killed {killed_epoch:.3}, \
         stopped {ended:.3}"
    );
    for tick in first..=last {
        if Some(tick) == b_running && !done.contains_key(&tick) {
            continue;
        }
        assert!(
            done.contains_key(&tick),
            "{label}: tick {tick} never completed: {table}"
        );
    }
}

per_backend!(three_runners:
    redis_three_runners_run_each_tick_once,
    postgres_three_runners_run_each_tick_once,
    etcd_three_runners_run_each_tick_once);
