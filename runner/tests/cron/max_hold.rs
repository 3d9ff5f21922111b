//! An entry's max-hold: its command's group gets SIGTERM the kill grace
//! before the hold ends and SIGKILL when it ends, and the runner goes on.

use super::*;

#[test]
fn max_hold_stops_the_command_with_sigterm_then_sigkill() {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let server = Backend::Redis.server();
    let dir = tempfile::tempdir().expect("tempdir");
    let job = unique("lockrun-max-hold");
    // A shell that reports SIGTERM and waits on, with a child that ignores
    // it: only SIGKILL ends the group.
    let file = write_crontab(
        &dir,
        &format!(
            "{job} */4 * * * * * ttl=3s max-hold=3s -- \
             trap 'echo term' TERM; (trap '' TERM; exec sleep 60) & \
             echo \"start $LOCKRUN_SCHEDULED_AT pid=$$ child=$!\"; \
             while kill -0 $! 2>/dev/null; do wait $!; done\n"
        ),
    );
    let (max_hold, grace) = (Duration::from_secs(3), Duration::from_secs(1));
    let mut runner = start(&server, &file, "a", None, &["--kill-grace", "1s"]);
    wait_started(&[&runner]);
    let (started, shell, child) = runner
        .stdout
        .wait_for(Duration::from_secs(10), |lines| {
            let (_, l) = *events(&job, lines, "start").first()?;
            Some((l.at, field(&l.text, "pid")?, field(&l.text, "child")?))
        })
        .expect("a tick ran within 10 s");
    // The command's lines carry the `[job] ` prefix.
    let termed = termed_at(&runner, max_hold, |l| l.ends_with("] term"));
    let gone =
        wait_all_gone(&[shell, child], Duration::from_secs(5)).expect("the group was killed");
    check_max_hold("cron max-hold", (max_hold, grace), started, termed, gone);
    assert_max_hold_logged(&runner);
    runner.signal(Signal::TERM);
    assert_eq!(runner.finish(Duration::from_secs(40)).code(), Some(0));
}
