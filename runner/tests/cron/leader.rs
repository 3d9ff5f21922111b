//! Leader mode, on every server backend: one elected runner fires every
//! tick. Three runners; the leader is SIGKILLed mid-command; another takes
//! over (once the election lock's TTL runs out, or at once where the lock
//! dies with the leader's session), and no two commands ever overlap (their
//! start and end read from the commands' own clocks).

use super::*;

/// The election lock's TTL the runners use: a dead leader is replaced
/// within it plus the interval.
const ELECTION_TTL: Duration = Duration::from_secs(3);

/// `at=SECONDS` in a command's line (`date +%s.%N`).
fn at(line: &Line) -> f64 {
    line.text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("at=")?.parse().ok())
        .unwrap_or_else(|| panic!("no at= in {:?}", line.text))
}

/// Waits (at most `limit`) until one of `runners` (by index) completed
/// three ticks whose command started after `since`; returns its index.
fn three_ends_after(
    job: &str,
    runners: &[(&str, &Spawned)],
    since: f64,
    limit: Duration,
) -> Option<usize> {
    let started = Instant::now();
    loop {
        for (i, (_, runner)) in runners.iter().enumerate() {
            let lines = runner.stdout.snapshot();
            let starts: Vec<u32> = events(job, &lines, "start")
                .iter()
                .filter(|(_, l)| at(l) > since)
                .filter_map(|(_, l)| field(&l.text, "pid"))
                .collect();
            let ends = events(job, &lines, "end")
                .iter()
                .filter(|(_, l)| field(&l.text, "pid").is_some_and(|p| starts.contains(&p)))
                .count();
            if ends >= 3 {
                return Some(i);
            }
        }
        if started.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn leader_mode(backend: Backend) {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let label = backend.label();
    let server = backend.server();
    let dir = tempfile::tempdir().expect("tempdir");
    let job = unique("lockrun-leader");
    let election = unique("lockrun/leader");
    let file = write_crontab(
        &dir,
        &format!(
            "{job} * * * * * * mode=leader ttl=3s -- \
             echo \"start $LOCKRUN_SCHEDULED_AT $REPLICA pid=$$ at=$(date +%s.%N)\"; \
             sleep 0.3 & echo \"child=$!\"; wait; \
             echo \"end $LOCKRUN_SCHEDULED_AT $REPLICA pid=$$ at=$(date +%s.%N)\"\n"
        ),
    );
    let ttl = format!("{}s", ELECTION_TTL.as_secs());
    let extra = [
        "--election-name",
        &election,
        "--election-ttl",
        &ttl,
        "--election-interval",
        "300ms",
    ];
    let mut runners: Vec<(&str, Spawned)> = ["a", "b", "c"]
        .into_iter()
        .map(|r| (r, start(&server, &file, r, None, &extra)))
        .collect();
    let began = {
        let refs: Vec<&Spawned> = runners.iter().map(|(_, r)| r).collect();
        wait_started(&refs)
    };

    let refs: Vec<(&str, &Spawned)> = runners.iter().map(|(n, r)| (*n, r)).collect();
    let leader = three_ends_after(&job, &refs, began - 1.0, Duration::from_secs(25))
        .expect("a leader completed three ticks within 25 s");
    let (shell, grandchild) = refs[leader]
        .1
        .stdout
        .wait_for(Duration::from_secs(5), running)
        .expect("the leader runs a command");
    drop(refs);
    runners[leader].1.signal(Signal::KILL);
    let (killed_at, killed_epoch) = (Instant::now(), epoch());
    let _ = runners[leader].1.wait_bounded(Duration::from_secs(5));
    let gone = wait_all_gone(&[shell, grandchild], Duration::from_secs(3))
        .expect("the killed leader's command still runs");
    let gone_epoch = killed_epoch + (gone - killed_at).as_secs_f64();
    println!(
        "leader {label}: {} SIGKILLed, its command tree gone after {} ms",
        runners[leader].0,
        (gone - killed_at).as_millis()
    );

    let refs: Vec<(&str, &Spawned)> = runners.iter().map(|(n, r)| (*n, r)).collect();
    let successor = three_ends_after(
        &job,
        &refs,
        killed_epoch,
        ELECTION_TTL + Duration::from_secs(15),
    )
    .expect("another runner took over and completed three ticks");
    assert_ne!(successor, leader, "the dead leader cannot run ticks");
    drop(refs);
    for (i, (_, runner)) in runners.iter().enumerate() {
        if i != leader {
            runner.signal(Signal::TERM);
        }
    }
    let mut stopped = Vec::new();
    for (i, (name, runner)) in runners.iter_mut().enumerate() {
        if i != leader {
            assert_eq!(
                runner.finish(Duration::from_secs(40)).code(),
                Some(0),
                "{name} stops"
            );
            stopped.push((i, epoch()));
        }
    }

    // Every command's interval, from its own clock; a command that printed
    // no end ran at most until its runner was seen gone.
    let mut intervals: Vec<(f64, f64, &str)> = Vec::new();
    let mut first_after_kill: Option<f64> = None;
    for (i, (name, runner)) in runners.iter().enumerate() {
        let lines = runner.stdout.snapshot();
        let ends = events(&job, &lines, "end");
        for (_, start) in events(&job, &lines, "start") {
            let pid = field(&start.text, "pid").expect("pid");
            let end = ends
                .iter()
                .find(|(_, l)| field(&l.text, "pid") == Some(pid))
                .map(|(_, l)| at(l))
                .unwrap_or_else(|| {
                    if i == leader {
                        gone_epoch
                    } else {
                        stopped
                            .iter()
                            .find(|(s, _)| *s == i)
                            .map_or(f64::MAX, |(_, t)| *t)
                    }
                });
            let begun = at(start);
            if begun < killed_epoch {
                assert_eq!(
                    i, leader,
                    "{name} ran a command while {} led",
                    runners[leader].0
                );
            } else {
                assert_eq!(
                    i, successor,
                    "{name} ran a command while {} led",
                    runners[successor].0
                );
                first_after_kill = Some(first_after_kill.map_or(begun, |f: f64| f.min(begun)));
            }
            intervals.push((begun, end, name));
        }
    }
    intervals.sort_by(|x, y| x.0.total_cmp(&y.0));
    for pair in intervals.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "two commands overlapped: {:?} and {:?}",
            pair[0],
            pair[1]
        );
    }
    let takeover = first_after_kill.expect("a command after the kill") - killed_epoch;
    println!(
        "leader {label}: {} commands, none overlapping; {} took over {:.0} ms after the kill \
         (election TTL {} s)",
        intervals.len(),
        runners[successor].0,
        takeover * 1000.0,
        ELECTION_TTL.as_secs()
    );
}

per_backend!(leader_mode:
    redis_leader_mode_runs_one_command_at_a_time_across_a_leader_kill,
    postgres_leader_mode_runs_one_command_at_a_time_across_a_leader_kill,
    etcd_leader_mode_runs_one_command_at_a_time_across_a_leader_kill);
