//! The figures of a chaos run: one row per backend and case, printed as a
//! table at the end and written under `target/`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

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
    /// Time from fault injection to the holder's abort, per iteration.
    pub abort: Vec<Duration>,
    /// Longest single backend call the case timed (`None`: it timed none).
    pub max_blocked: Option<Duration>,
    /// Locks still held after every holder and successor let go.
    pub leaked: usize,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Adds a finished case's row.
pub fn record(row: Row) {
    if let Ok(mut rows) = ROWS.lock() {
        rows.push(row);
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The table of every recorded row, sorted by backend and case.
pub fn table() -> String {
    let mut rows = ROWS.lock().map(|r| r.clone()).unwrap_or_default();
    rows.sort_by(|a, b| (&a.backend, &a.case).cmp(&(&b.backend, &b.case)));
    let mut out = String::from(
        "| backend | case | iterations | faults | writes | stale accepts | writes after deadline | abort ms min/p50/max | max blocked call ms | leaked locks |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let mut abort = r.abort.clone();
        abort.sort();
        let abort = match (abort.first(), abort.get(abort.len() / 2), abort.last()) {
            (Some(lo), Some(mid), Some(hi)) => format!("{}/{}/{}", ms(*lo), ms(*mid), ms(*hi)),
            _ => "-".to_owned(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.case,
            r.iterations,
            r.faults,
            r.writes,
            r.stale_accepts,
            r.after_deadline,
            abort,
            r.max_blocked
                .map_or_else(|| "-".to_owned(), |d| ms(d).to_string()),
            r.leaked
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
