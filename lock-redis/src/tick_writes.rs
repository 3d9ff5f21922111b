//! The batch writes of tick records on Redis: many ticks' writes in one
//! script call, and `Started` writes checked in the same script
//! ([`TickStore::start_checked_many`](lock_core::TickStore::start_checked_many)).
//!
//! Each tick is still its own step, in order: the scripts loop over the
//! ticks with the same function the single write runs. One call instead of
//! one per tick matters to a scheduler whose jobs fire together: every
//! winner of a tick writes `Started` before its handler and `Completed`
//! after, and with the checks in the script, a start costs one round trip
//! instead of three reads and a write.
//!
//! In cluster mode a batch's keys lie in many slots, which one script
//! cannot span: there each write is a script call of its own, and the
//! checks are read apart (the trait's defaults).

use std::time::Duration;

use lock_core::{BackendError, LockName, StartCheck, StartVerdict, TickAnswer, TickWrite};

use crate::error::{config, protocol};
use crate::scripts::{CHECKED_STARTS, WRITE_TICKS};
use crate::ticks::{keep_ms, parse_record, run_write, write_args};
use crate::RedisBackend;

impl RedisBackend {
    /// Whether a batch of tick writes can be one script call: all its keys
    /// on one server.
    pub(crate) fn writes_ticks_in_one_call(&self) -> bool {
        !self.shared().keys.is_cluster()
    }

    /// Every `(job, tick, write)` of `writes` in one script call, one
    /// answer per item in order. Not cancel safe: a dropped call may or may
    /// not have applied the writes.
    pub(crate) async fn write_ticks_batch(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        let shared = self.shared();
        let keep = keep_ms(keep);
        let mut keys = Vec::with_capacity(writes.len() * 3);
        let mut args = Vec::with_capacity(writes.len() * 7);
        for (job, tick, write) in writes {
            keys.extend(self.record_keys(job, *tick));
            args.extend(write_args(write, keep.clone(), *tick));
        }
        let op = "write tick records";
        let after: Vec<Option<String>> =
            match run_write(shared, op, &WRITE_TICKS, &keys, &args).await {
                Ok(after) => after,
                Err(e) => return e.for_each(writes.len()),
            };
        if after.len() != writes.len() {
            let e = counted(op, shared.conn.target(), after.len(), writes.len());
            return e.for_each(writes.len());
        }
        writes
            .iter()
            .zip(after)
            .map(|((_, _, write), after)| {
                Ok(write.answer(parse_record(shared.conn.target(), after)?))
            })
            .collect()
    }

    /// Every checked start of `starts` in one script call, against one
    /// reading of the server's clock, one verdict per item in order. Not
    /// cancel safe, like [`RedisBackend::write_ticks_batch`].
    pub(crate) async fn start_checked_batch(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        let shared = self.shared();
        let target = shared.conn.target();
        let keep = keep_ms(keep);
        let mut keys = Vec::with_capacity(starts.len() * 3);
        let mut args = Vec::with_capacity(starts.len() * 9);
        for (job, tick, write, check) in starts {
            if !matches!(write, TickWrite::Start { .. }) {
                let e = config(
                    "a checked start carries a Started write; send completions with write_tick",
                );
                return e.for_each(starts.len());
            }
            keys.extend(self.record_keys(job, *tick));
            args.extend(write_args(write, keep.clone(), *tick));
            args.extend([
                check.tolerance_ms.to_string(),
                if check.late { "1" } else { "0" }.to_owned(),
            ]);
        }
        let op = "write checked starts";
        let verdicts: Vec<(String, Option<String>)> =
            match run_write(shared, op, &CHECKED_STARTS, &keys, &args).await {
                Ok(verdicts) => verdicts,
                Err(e) => return e.for_each(starts.len()),
            };
        if verdicts.len() != starts.len() {
            let e = counted(op, target, verdicts.len(), starts.len());
            return e.for_each(starts.len());
        }
        starts
            .iter()
            .zip(verdicts)
            .map(|((_, _, write, _), (kind, value))| verdict(target, write, &kind, value))
            .collect()
    }

    /// A tick's record, the job's latest completed tick and the tick's mark:
    /// the keys one tick write reads and writes, in the scripts' order.
    pub(crate) fn record_keys(&self, job: &LockName, tick: i64) -> [String; 3] {
        let keys = &self.shared().keys;
        [
            keys.tick_record(job, tick),
            keys.tick(job),
            keys.tick_mark(job, tick),
        ]
    }
}

/// One checked start's verdict from the script's pair.
fn verdict(
    target: &str,
    write: &TickWrite,
    kind: &str,
    value: Option<String>,
) -> Result<StartVerdict, BackendError> {
    let number = |v: Option<String>| {
        v.as_deref()
            .and_then(|v| v.parse::<i64>().ok())
            .ok_or_else(|| protocol("write checked starts", target, format!("{kind} {v:?}")))
    };
    match kind {
        "H" => Ok(StartVerdict::Ahead {
            server_ms: number(value)?,
        }),
        "M" => Ok(StartVerdict::Marked),
        "V" => Ok(StartVerdict::Covered {
            last: number(value)?,
        }),
        "W" => Ok(StartVerdict::Written(
            write.answer(parse_record(target, value)?),
        )),
        _ => Err(protocol(
            "write checked starts",
            target,
            format!("{kind} {value:?}"),
        )),
    }
}

/// The error of a script that answered `got` items for `sent`.
fn counted(op: &str, target: &str, got: usize, sent: usize) -> BackendError {
    protocol(op, target, format!("{got} answers for {sent} ticks"))
}
