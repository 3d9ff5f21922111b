//! What counts as a leak, and a collector that reports every one found.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Debug;

use crate::table::MARKER;

/// The leaks found so far, by the call that showed them.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    leaks: BTreeMap<String, Vec<String>>,
    checked: usize,
}

/// Whether `text` shows a password or any fragment of one. Hosts may come
/// back lowercased, so the match ignores case.
fn leaks(text: &str) -> bool {
    text.to_ascii_lowercase().contains(MARKER)
}

impl Findings {
    /// Checks `Display` and `Debug` of `err` and of every error in its
    /// `source()` chain.
    pub(crate) fn error(&mut self, what: &str, input: &str, err: &(dyn Error + 'static)) {
        let mut next = Some(err);
        let mut depth = 0;
        while let Some(e) = next {
            self.text(what, input, &format!("Display#{depth}"), &e.to_string());
            self.text(what, input, &format!("Debug#{depth}"), &format!("{e:?}"));
            next = e.source();
            depth += 1;
        }
    }

    /// Checks the `Debug` form of a parsed configuration or built backend.
    pub(crate) fn debug(&mut self, what: &str, input: &str, value: &dyn Debug) {
        self.text(what, input, "Debug", &format!("{value:?}"));
    }

    /// Checks any text, such as captured log output.
    pub(crate) fn text(&mut self, what: &str, input: &str, form: &str, text: &str) {
        self.checked += 1;
        if leaks(text) {
            self.leaks
                .entry(what.to_owned())
                .or_default()
                .push(format!("{what}({input:?}) {form}: {text}"));
        }
    }

    /// A failure that is not a leak (a hang, an unexpected success).
    pub(crate) fn problem(&mut self, what: &str, message: String) {
        self.leaks.entry(what.to_owned()).or_default().push(message);
    }

    /// Panics with the number of leaks per call and the first few of each,
    /// or reports how many texts were checked.
    pub(crate) fn assert_none(self, what: &str) {
        const SHOWN: usize = 3;
        if self.leaks.is_empty() {
            eprintln!("{what}: {} texts checked, no password shown", self.checked);
            return;
        }
        let total: usize = self.leaks.values().map(Vec::len).sum();
        let mut report = format!(
            "{what}: {total} of {} texts show a password (or failed otherwise)\n",
            self.checked
        );
        for (call, leaks) in &self.leaks {
            report.push_str(&format!("{call}: {}\n", leaks.len()));
            for leak in leaks.iter().take(SHOWN) {
                report.push_str(&format!("  - {leak}\n"));
            }
        }
        panic!("{report}");
    }
}
