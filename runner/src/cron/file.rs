//! The cron file: parsed and checked line by line, so a mistake is reported
//! with its line number before anything runs.

use std::collections::HashMap;
use std::time::Duration;

use distlock::scheduler::{Delivery, MissedTicks, Schedule, DEFAULT_JOB_TTL, MAX_JOB_NAME_LEN};
use distlock::LockName;

use crate::duration;

/// One entry of the file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Entry {
    pub(crate) line: usize,
    pub(crate) name: String,
    pub(crate) schedule: String,
    pub(crate) tz: String,
    pub(crate) ttl: Duration,
    pub(crate) max_hold: Option<Duration>,
    pub(crate) missed: MissedTicks,
    pub(crate) delivery: Delivery,
    pub(crate) leader: bool,
    pub(crate) command: String,
}

/// The options in force for the entries below a defaults line.
#[derive(Debug, Clone)]
struct Options {
    tz: String,
    ttl: Duration,
    max_hold: Option<Duration>,
    missed: MissedTicks,
    delivery: Delivery,
    leader: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            tz: "UTC".into(),
            ttl: DEFAULT_JOB_TTL,
            max_hold: None,
            missed: MissedTicks::Skip,
            delivery: Delivery::AtMostOnce,
            leader: false,
        }
    }
}

/// Parses the whole file; the error names the line and what is wrong.
pub(crate) fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let mut defaults = Options::default();
    let mut entries = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let at = |what: String| format!("line {line}: {what}");
        let content = raw.trim();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let Some((head, command)) = split_command(content) else {
            // Only OPTION=VALUE words: defaults for the entries below.
            let words: Vec<&str> = content.split_whitespace().collect();
            if let Some(w) = words.iter().find(|w| !w.contains('=')) {
                return Err(at(format!(
                    "{w:?} is neither an option nor part of an entry; an entry is \
                     `NAME SCHEDULE [OPTION=VALUE ...] -- COMMAND`"
                )));
            }
            for word in words {
                apply(&mut defaults, word).map_err(at)?;
            }
            continue;
        };
        if command.is_empty() {
            return Err(at("nothing after `--`; put the shell command there".into()));
        }
        let mut words = head.split_whitespace();
        let name = words
            .next()
            .ok_or_else(|| at("an entry starts with its name, before `--`".into()))?;
        if name.contains('=') {
            return Err(at(format!(
                "the entry starts with {name:?}; it must start with the job's name"
            )));
        }
        let mut fields = Vec::new();
        let mut options = defaults.clone();
        let mut in_options = false;
        for word in words {
            if word.contains('=') {
                in_options = true;
                apply(&mut options, word).map_err(at)?;
            } else if in_options {
                return Err(at(format!(
                    "{word:?} comes after the options; the schedule goes right after the name"
                )));
            } else {
                fields.push(word);
            }
        }
        check_name(name).map_err(at)?;
        if !(5..=6).contains(&fields.len()) {
            return Err(at(format!(
                "the schedule of {name:?} has {} fields; write 5 (minute hour day month \
                 weekday) or 6 (seconds first)",
                fields.len()
            )));
        }
        let schedule = fields.join(" ");
        Schedule::parse(name, &schedule, &options.tz).map_err(|e| at(e.to_string()))?;
        if options.ttl.is_zero() {
            return Err(at("ttl must be greater than zero".into()));
        }
        if options.max_hold.is_some_and(|m| m < options.ttl) {
            return Err(at("max-hold must be at least the ttl".into()));
        }
        if let Some(first) = seen.insert(name.to_owned(), line) {
            return Err(at(format!(
                "the job name {name:?} is already used on line {first}; names must be unique"
            )));
        }
        entries.push(Entry {
            line,
            name: name.to_owned(),
            schedule,
            tz: options.tz,
            ttl: options.ttl,
            max_hold: options.max_hold,
            missed: options.missed,
            delivery: options.delivery,
            leader: options.leader,
            command: command.to_owned(),
        });
    }
    Ok(entries)
}

/// Splits `NAME SCHEDULE OPTIONS -- COMMAND` at the first `--` word.
fn split_command(line: &str) -> Option<(&str, &str)> {
    let bytes = line.as_bytes();
    let mut from = 0;
    while let Some(pos) = line[from..].find("--").map(|p| p + from) {
        let before = pos == 0 || bytes[pos - 1].is_ascii_whitespace();
        let after = bytes.get(pos + 2).is_none_or(|b| b.is_ascii_whitespace());
        if before && after {
            return Some((&line[..pos], line[pos + 2..].trim()));
        }
        from = pos + 2;
    }
    None
}

fn check_name(name: &str) -> Result<(), String> {
    LockName::new(name).map_err(|e| e.to_string())?;
    if name.len() > MAX_JOB_NAME_LEN {
        return Err(format!(
            "the job name is {} bytes; at most {MAX_JOB_NAME_LEN} are allowed",
            name.len()
        ));
    }
    Ok(())
}

fn apply(options: &mut Options, word: &str) -> Result<(), String> {
    let (key, value) = word.split_once('=').unwrap_or((word, ""));
    let time = |v: &str| duration::parse(v).map_err(|e| format!("{key}: {e}"));
    match key {
        "tz" => options.tz = value.to_owned(),
        "ttl" => options.ttl = time(value)?,
        "max-hold" => {
            options.max_hold = if value == "none" {
                None
            } else {
                Some(time(value)?)
            }
        }
        "missed" => options.missed = missed(value)?,
        "delivery" => options.delivery = value.parse().map_err(|e| format!("delivery: {e}"))?,
        "mode" => {
            options.leader = match value {
                "per-tick" => false,
                "leader" => true,
                other => return Err(format!("mode {other:?}: use per-tick or leader")),
            }
        }
        other => {
            return Err(format!(
                "unknown option {other:?}; the options are tz, ttl, max-hold, missed, delivery and mode"
            ))
        }
    }
    Ok(())
}

fn missed(value: &str) -> Result<MissedTicks, String> {
    let bad = || {
        format!("missed={value:?}: use skip, run-once or run-all:WINDOW:MAX (e.g. run-all:1h:5)")
    };
    match value {
        "skip" => Ok(MissedTicks::Skip),
        "run-once" => Ok(MissedTicks::RunOnce),
        _ => {
            let rest = value.strip_prefix("run-all:").ok_or_else(bad)?;
            let (window, max) = rest.split_once(':').ok_or_else(bad)?;
            let window = duration::parse(window).map_err(|e| format!("missed: {e}"))?;
            let max: usize = max.parse().map_err(|_| bad())?;
            if window.is_zero() || max == 0 {
                return Err(format!(
                    "missed={value:?}: the window and the count must be above zero; use skip to run nothing"
                ));
            }
            Ok(MissedTicks::RunAll { window, max })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_defaults_and_commands() {
        let text = "\
# comment
tz=Europe/Berlin ttl=10s

reports/nightly 30 2 * * * max-hold=1h missed=run-once -- /usr/bin/report --all -- x
tick  */2 * * * * *  mode=leader ttl=3s missed=run-all:1m:3 delivery=at-least-once -- echo \"a -- b\" | tr a b
";
        let entries = parse(text).expect("valid");
        assert_eq!(entries.len(), 2);
        let (a, b) = (&entries[0], &entries[1]);
        assert_eq!((a.line, a.name.as_str()), (4, "reports/nightly"));
        assert_eq!(a.schedule, "30 2 * * *");
        assert_eq!(a.tz, "Europe/Berlin");
        assert_eq!(a.ttl, Duration::from_secs(10));
        assert_eq!(a.max_hold, Some(Duration::from_secs(3600)));
        assert_eq!(a.missed, MissedTicks::RunOnce);
        assert_eq!(a.command, "/usr/bin/report --all -- x");
        assert_eq!(a.delivery, Delivery::AtMostOnce, "the default");
        assert_eq!(b.delivery, Delivery::AtLeastOnce);
        assert!(!a.leader);
        assert_eq!(b.schedule, "*/2 * * * * *");
        assert!(b.leader);
        assert_eq!(b.ttl, Duration::from_secs(3));
        assert_eq!(
            b.missed,
            MissedTicks::RunAll {
                window: Duration::from_secs(60),
                max: 3
            }
        );
        assert_eq!(b.command, "echo \"a -- b\" | tr a b");
    }

    #[test]
    fn mistakes_name_their_line() {
        let cases = [
            (
                "job * * * * -- true",
                "the schedule of \"job\" has 4 fields",
            ),
            ("job * * * * * * * -- true", "has 7 fields"),
            ("job 61 * * * * -- true", "invalid cron expression"),
            ("job * * * * * tz=Mars/Base -- true", "unknown time zone"),
            (
                "job * * * * * ttl=0s -- true",
                "ttl must be greater than zero",
            ),
            (
                "job * * * * * ttl=10s max-hold=1s -- true",
                "max-hold must be at least the ttl",
            ),
            (
                "job * * * * * ttl=ten -- true",
                "ttl: \"ten\" is not a duration",
            ),
            (
                "job * * * * * color=red -- true",
                "unknown option \"color\"",
            ),
            ("job * * * * * missed=run-all:0s:2 -- true", "above zero"),
            (
                "job * * * * * missed=sometimes -- true",
                "use skip, run-once",
            ),
            ("job * * * * * mode=all -- true", "use per-tick or leader"),
            (
                "job * * * * * delivery=twice -- true",
                "use at-most-once or at-least-once",
            ),
            ("job * * * * * --", "nothing after `--`"),
            ("job * * * * *", "neither an option nor part of an entry"),
            ("bad name * * * * * -- true", "invalid cron expression"),
            ("ba$d * * * * * -- true", "invalid lock name"),
            ("job * * * ttl=1s * * -- true", "comes after the options"),
            ("ttl=1s * * * * * -- true", "must start with the job's name"),
        ];
        for (text, expected) in cases {
            let text = format!("# header\n{text}\n");
            let err = parse(&text).expect_err(text.as_str());
            assert!(err.starts_with("line 2: "), "{text:?}: {err}");
            assert!(err.contains(expected), "{text:?}: {err}");
        }
        let duplicate =
            parse("a * * * * * -- x\nb * * * * * -- x\na 0 * * * * -- y\n").expect_err("duplicate");
        assert_eq!(
            duplicate,
            "line 3: the job name \"a\" is already used on line 1; names must be unique"
        );
    }
}
