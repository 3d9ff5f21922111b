//! The warnings this process logged about given locks: for cases that check
//! that routine events (an attempt or a release its caller gave up) alarm
//! no operator.
//!
//! [`install`] sets a process-wide `tracing` subscriber that keeps every
//! event at `WARN` or above carrying a `lock` field (the field every
//! library log line about one lock has). Cases run in parallel, so a case
//! reads back only the events naming its own locks, with [`about`].

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};

use lock_core::LockName;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// One kept event: its level, its `lock` field and its message with the
/// other fields.
#[derive(Debug, Clone)]
pub struct Warning {
    /// `WARN` or `ERROR`.
    pub level: Level,
    /// The `lock` field, as logged.
    pub lock: String,
    /// The message and every other field, as `key=value`.
    pub text: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} lock={}: {}", self.level, self.lock, self.text)
    }
}

static KEPT: OnceLock<Mutex<Vec<Warning>>> = OnceLock::new();

/// Installs the capture as the process's global subscriber. Returns an
/// error if another subscriber was installed first.
pub fn install() -> Result<(), String> {
    if KEPT.set(Mutex::new(Vec::new())).is_err() {
        return Ok(());
    }
    tracing_subscriber::registry()
        .with(Keep.with_filter(LevelFilter::WARN))
        .try_init()
        .map_err(|e| format!("the warning capture could not be installed: {e}"))
}

/// The kept warnings that name one of `names`. Panics if [`install`] was not
/// called, so a case relying on it cannot pass by seeing nothing.
pub fn about(names: &[LockName]) -> Vec<Warning> {
    let kept = KEPT
        .get()
        .expect("conformance_tests::warnings::install was not called in this test binary");
    let names: HashSet<&str> = names.iter().map(LockName::as_str).collect();
    kept.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .filter(|w| names.contains(w.lock.as_str()))
        .cloned()
        .collect()
}

struct Keep;

impl<S: Subscriber> Layer<S> for Keep {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let (Some(lock), Some(kept)) = (fields.lock, KEPT.get()) else {
            return;
        };
        kept.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Warning {
                level: *event.metadata().level(),
                lock,
                text: fields.text,
            });
    }
}

#[derive(Default)]
struct Fields {
    lock: Option<String>,
    text: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        match field.name() {
            "lock" => self.lock = Some(format!("{value:?}")),
            "message" => self.text.insert_str(0, &format!("{value:?}")),
            other => self.text.push_str(&format!(" {other}={value:?}")),
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "lock" => self.lock = Some(value.to_owned()),
            _ => self.record_debug(field, &value),
        }
    }
}
