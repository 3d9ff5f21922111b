//! The printed table and its JSON copy under `target/`.

use std::fmt::Write as _;

/// One row of the results table.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) backend: String,
    pub(crate) measure: String,
    pub(crate) setting: String,
    /// Named figures, in print order: ("ops/s", "1234"), ("p50 ms", "0.5"), …
    pub(crate) figures: Vec<(String, String)>,
}

impl Row {
    pub(crate) fn new(backend: &str, measure: &str, setting: impl Into<String>) -> Self {
        Self {
            backend: backend.to_owned(),
            measure: measure.to_owned(),
            setting: setting.into(),
            figures: Vec::new(),
        }
    }

    pub(crate) fn figure(mut self, name: &str, value: impl Into<String>) -> Self {
        self.figures.push((name.to_owned(), value.into()));
        self
    }
}

pub(crate) fn print_table(rows: &[Row]) {
    let head = ["backend", "measure", "setting", "figures"];
    let cells: Vec<[String; 4]> = rows
        .iter()
        .map(|r| {
            let figs = r
                .figures
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join("  ");
            [
                r.backend.clone(),
                r.measure.clone(),
                r.setting.clone(),
                figs,
            ]
        })
        .collect();
    let width = |i: usize| {
        cells
            .iter()
            .map(|c| c[i].len())
            .chain([head[i].len()])
            .max()
            .unwrap_or(0)
    };
    let widths = [width(0), width(1), width(2)];
    // The last column is left unpadded, as Markdown allows.
    let line = |c: &[&str]| {
        println!(
            "| {:w0$} | {:w1$} | {:w2$} | {} |",
            c[0],
            c[1],
            c[2],
            c[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    };
    line(&head);
    println!(
        "|{}|{}|{}|---|",
        "-".repeat(widths[0] + 2),
        "-".repeat(widths[1] + 2),
        "-".repeat(widths[2] + 2)
    );
    for c in &cells {
        line(&c.each_ref().map(String::as_str));
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub(crate) fn to_json(rows: &[Row]) -> String {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            let figs: Vec<String> = r
                .figures
                .iter()
                .map(|(k, v)| format!("{}: {}", json_str(k), json_str(v)))
                .collect();
            format!(
                "  {{\"backend\": {}, \"measure\": {}, \"setting\": {}, \"figures\": {{{}}}}}",
                json_str(&r.backend),
                json_str(&r.measure),
                json_str(&r.setting),
                figs.join(", ")
            )
        })
        .collect();
    format!("[\n{}\n]\n", items.join(",\n"))
}
