//! The figures of a chaos run: one row per backend and case, printed as a
//! table at the end and written under `target/`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use crate::Ctx;

/// What one case measured over its iterations.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// Backend name.
    pub backend: String,
    /// Case name.
    pub case: String,
    /// Iterations run.
    pub iterations: usize,
    /// Faults injected.
    pub faults: usize,
    /// Guarded writes made by holders.
    pub writes: usize,
    /// I2: writes under an older token accepted after a successor acquired.
    pub stale_accepts: usize,
    /// I5: guarded writes allowed at or after the holder's local deadline.
    pub after_deadline: usize,
    /// I1: critical sections (as the holders report them, on the monotonic
    /// clock every process on the host shares) that overlapped another
    /// holder's. Expected where a paused holder is involved; reported, not
    /// hidden.
    pub overlaps: usize,
    /// Time from fault injection to the holder's abort, per iteration.
    pub abort: Vec<Duration>,
    /// Time from the loss as the server saw it (expiry, kill, successor's
    /// acquire) to the holder's abort, per iteration, where the case knows
    /// when the loss happened.
    pub detection: Vec<Duration>,
    /// How long renewals stalled across a fault, per holder and fault: from
    /// the last renewal before the fault to the first after it (or to the
    /// loss, when none came), where the case watches renewals.
    pub stall: Vec<Duration>,
    /// Longest single backend call the case timed (`None`: it timed none).
    pub max_blocked: Option<Duration>,
    /// Largest deviation of a timer (renewal, watchdog) from its nominal
    /// instant, where the case measures one (the clock-step cases).
    pub timing_error: Option<Duration>,
    /// Locks still held after every holder and successor let go.
    pub leaked: usize,
    /// Time from the start of a failover (the old primary told to stop) to
    /// a holder's first successful acquire on the promoted server, per
    /// holder and failover, where the case fails a server over.
    pub reconnect: Vec<Duration>,
}

impl Row {
    /// Counts one more fault and what came of it: the guarded writes, those
    /// made after a deadline, the stale ones accepted, and locks left held.
    pub(crate) fn count_fault(&mut self, writes: usize, late: usize, stale: usize, leaked: usize) {
        self.faults += 1;
        self.writes += writes;
        self.after_deadline += late;
        self.stale_accepts += stale;
        self.leaked += leaked;
    }

    /// An empty row for `case` on the backend `ctx` runs against.
    pub(crate) fn of(ctx: &Ctx, case: &str) -> Self {
        Self {
            backend: ctx.factory().name().to_owned(),
            case: case.to_owned(),
            ..Self::default()
        }
    }

    /// Records the finished row, then fails the case if it counted a stale
    /// write accepted (I2), a guarded write after a deadline (I5) or a lock
    /// left behind: recorded first, so the table shows the failing row too.
    pub(crate) fn finish(self) {
        let ok = self.stale_accepts == 0 && self.after_deadline == 0 && self.leaked == 0;
        let summary = format!("{self:?}");
        record(self);
        assert!(ok, "unsafe writes or leaks: {summary}");
    }
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Adds a finished case's row.
pub fn record(row: Row) {
    if let Ok(mut rows) = ROWS.lock() {
        rows.push(row);
    }
}

/// Records a case's row after saying `summary` of it on stderr, then fails
/// the case if a holder wrote unsafely (a stale write accepted, a write
/// after its deadline) or a lock was left behind.
pub fn record_safe(case: &str, row: Row, summary: &str) {
    eprintln!("{} {case}: {summary}", row.backend);
    let safe = row.stale_accepts == 0 && row.after_deadline == 0 && row.leaked == 0;
    record(row);
    assert!(safe, "unsafe writes or leaks: {summary}");
}

/// Records a case's row, then fails the case if `verdict` names any
/// violation; `what` leads the failure message.
pub fn record_verdict(row: Row, verdict: &[String], what: &str) {
    let summary = format!("{row:?} {verdict:?}");
    record(row);
    assert!(
        verdict.is_empty(),
        "{what}: {}\n{summary}",
        verdict.join("; ")
    );
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// `min/p50/p99/max` in milliseconds, or `-` for no samples.
fn spread(samples: &[Duration]) -> String {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let at = |q: f64| {
        // Nearest rank: the smallest sample with at least q of them at or below.
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        ms(sorted[rank - 1])
    };
    if sorted.is_empty() {
        return "-".to_owned();
    }
    format!(
        "{}/{}/{}/{}",
        ms(sorted[0]),
        at(0.5),
        at(0.99),
        ms(sorted[sorted.len() - 1])
    )
}

/// The table of every recorded row, sorted by backend and case.
pub fn table() -> String {
    let mut rows = ROWS.lock().map(|r| r.clone()).unwrap_or_default();
    rows.sort_by(|a, b| (&a.backend, &a.case).cmp(&(&b.backend, &b.case)));
    let mut out = String::from(
        "| backend | case | iterations | faults | writes | stale accepts | writes after deadline | raw overlaps | abort ms min/p50/p99/max | detection ms min/p50/p99/max | renewal stall ms min/p50/p99/max | max blocked call ms | max timer error ms | leaked locks | reconnect ms min/p50/p99/max |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.case,
            r.iterations,
            r.faults,
            r.writes,
            r.stale_accepts,
            r.after_deadline,
            r.overlaps,
            spread(&r.abort),
            spread(&r.detection),
            spread(&r.stall),
            r.max_blocked
                .map_or_else(|| "-".to_owned(), |d| ms(d).to_string()),
            r.timing_error
                .map_or_else(|| "-".to_owned(), |d| ms(d).to_string()),
            r.leaked,
            spread(&r.reconnect)
        ));
    }
    out
}

/// Where the table is written: `target/chaos-figures.txt` of the workspace
/// (or of `CARGO_TARGET_DIR`).
pub fn path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    target.join("chaos-figures.txt")
}

/// Iterations per case: `smoke`, times `CHAOS_SOAK` when it is a number
/// (`CHAOS_SOAK=1` means ×10).
pub fn iterations(smoke: usize) -> usize {
    match std::env::var("CHAOS_SOAK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(0) | None => smoke,
        Some(1) => smoke * 10,
        Some(n) => smoke * n,
    }
}
