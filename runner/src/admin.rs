//! `status`, `ls`, `leader` and `release`: what an on-call engineer asks
//! first (who holds it, since when, until when, with which token) and the
//! one safe way to take a lock away.

use std::time::SystemTime;

use chrono::{DateTime, SecondsFormat, Utc};
use distlock::prometheus::Registry;
use distlock::{ForceOutcome, Holder, LockName, Locker};
use serde_json::{json, Value};

use crate::cli::{AdminCommon, LeaderArgs, LsArgs, ReleaseArgs, StatusArgs};
use crate::exit::{self, Failure};

/// The page size `ls` asks the backend for.
const PAGE: usize = 500;

/// `lockrun status NAME`.
pub(crate) async fn status(args: StatusArgs) -> Result<u8, Failure> {
    let name = lock_name(&args.name)?;
    let locker = locker(&args.common).await?;
    let holder = locker.describe(&name).await.map_err(failure)?;
    print_one(&name, holder.as_ref(), args.common.json, "free");
    Ok(if holder.is_some() { 0 } else { exit::NOT_HELD })
}

/// `lockrun leader [NAME]`: the election lock's holder is the leader.
pub(crate) async fn leader(args: LeaderArgs) -> Result<u8, Failure> {
    let name = lock_name(&args.name)?;
    let locker = locker(&args.common).await?;
    let holder = locker.describe(&name).await.map_err(failure)?;
    print_one(&name, holder.as_ref(), args.common.json, "no leader");
    Ok(if holder.is_some() { 0 } else { exit::NOT_HELD })
}

/// `lockrun ls [PREFIX]`: every page, up to `--max` locks.
pub(crate) async fn ls(args: LsArgs) -> Result<u8, Failure> {
    let locker = locker(&args.common).await?;
    let mut holders = Vec::new();
    let mut cursor: Option<String> = None;
    let mut truncated = false;
    loop {
        let page = locker
            .list(&args.prefix, cursor.as_deref(), PAGE)
            .await
            .map_err(failure)?;
        holders.extend(page.holders);
        if holders.len() >= args.max {
            truncated = page.next.is_some() || holders.len() > args.max;
            holders.truncate(args.max);
            break;
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    holders.sort_by(|a, b| a.name.cmp(&b.name));
    if args.common.json {
        let rows: Vec<Value> = holders.iter().map(holder_json).collect();
        println!(
            "{}",
            json!({ "prefix": args.prefix, "locks": rows, "truncated": truncated })
        );
    } else {
        print_table(&holders);
        let what = if args.prefix.is_empty() {
            String::new()
        } else {
            format!(" under {:?}", args.prefix)
        };
        println!(
            "{} held{what}{}",
            holders.len(),
            if truncated {
                " (stopped at --max; more exist)"
            } else {
                ""
            }
        );
    }
    Ok(0)
}

/// `lockrun release NAME --token T`.
pub(crate) async fn release(args: ReleaseArgs) -> Result<u8, Failure> {
    let name = lock_name(&args.name)?;
    let locker = locker(&args.common).await?;
    let outcome = locker
        .force_release(&name, args.token)
        .await
        .map_err(failure)?;
    let (code, word, text) = match outcome {
        ForceOutcome::Released => (
            0,
            "released",
            format!("{name}: released the lease with token {}; its holder loses it (forced) at its next renewal", args.token),
        ),
        ForceOutcome::NotHeld => (
            exit::NOT_HELD,
            "not_held",
            format!("{name}: nobody holds it; nothing released"),
        ),
        ForceOutcome::TokenMismatch { held } => (
            exit::HELD_ELSEWHERE,
            "token_mismatch",
            match held {
                Some(t) => format!("{name}: held by the lease with token {t}, not {}; nothing released (run `lockrun status {name}`)", args.token),
                None => format!("{name}: held by a lease without a token; nothing released"),
            },
        ),
        _ => (
            exit::INTERNAL,
            "unknown",
            format!("{name}: the backend answered an outcome this runner does not know"),
        ),
    };
    if args.common.json {
        let held = match outcome {
            ForceOutcome::TokenMismatch { held } => json!(held),
            _ => Value::Null,
        };
        println!(
            "{}",
            json!({ "name": name.as_str(), "token": args.token, "outcome": word, "held_token": held })
        );
    } else {
        println!("{text}");
    }
    Ok(code)
}

fn lock_name(text: &str) -> Result<LockName, Failure> {
    LockName::new(text).map_err(|e| Failure::usage(e.to_string()))
}

async fn locker(common: &AdminCommon) -> Result<Locker, Failure> {
    let locks = crate::backend::connect(common.backend.as_deref()).await?;
    // A registry of its own: these commands serve no metrics.
    locks
        .locker_with_registry(&Registry::new())
        .map_err(|e| Failure::internal(e.to_string()))
}

fn failure(e: distlock::Error) -> Failure {
    Failure::from_lock(&e, exit::UNAVAILABLE)
}

fn print_one(name: &LockName, holder: Option<&Holder>, as_json: bool, free: &str) {
    match (holder, as_json) {
        (Some(h), true) => println!("{}", holder_json(h)),
        (None, true) => println!("{}", json!({ "name": name.as_str(), "held": false })),
        (Some(h), false) => print_table(std::slice::from_ref(h)),
        (None, false) => println!("{name}: {free}"),
    }
}

fn holder_json(h: &Holder) -> Value {
    json!({
        "name": h.name.as_str(),
        "held": true,
        "holder": h.identity.as_ref().map(|i| i.as_str()),
        "fencing_token": h.fencing_token,
        "acquired_at": h.acquired_at.map(rfc3339),
        "renewed_at": h.renewed_at.map(rfc3339),
        "expires_at": h.expires_at.map(rfc3339),
    })
}

fn rfc3339(t: SystemTime) -> String {
    DateTime::<Utc>::from(t).to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// When a lease expires, as people read it: `in 4.2s` (or `session` for
/// a lease that lives as long as its holder's session).
fn expires_in(h: &Holder, now: SystemTime) -> String {
    match h.expires_at {
        Some(at) => match at.duration_since(now) {
            Ok(left) => format!("in {:.1}s", left.as_secs_f64()),
            Err(_) => "due".to_owned(),
        },
        None => "session".to_owned(),
    }
}

fn print_table(holders: &[Holder]) {
    let now = SystemTime::now();
    let dash = || "-".to_owned();
    let rows: Vec<[String; 6]> = holders
        .iter()
        .map(|h| {
            [
                h.name.as_str().to_owned(),
                h.identity
                    .as_ref()
                    .map_or_else(|| "(unknown holder)".to_owned(), |i| i.as_str().to_owned()),
                h.fencing_token.map_or_else(dash, |t| t.to_string()),
                h.acquired_at.map_or_else(dash, rfc3339),
                h.renewed_at.map_or_else(dash, rfc3339),
                expires_in(h, now),
            ]
        })
        .collect();
    let header = ["LOCK", "HOLDER", "TOKEN", "ACQUIRED", "RENEWED", "EXPIRES"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        println!("{out}");
    };
    line(header);
    for row in &rows {
        line(row.each_ref().map(String::as_str));
    }
}
