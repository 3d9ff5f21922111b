//! Cron expressions evaluated in a time zone.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::parser::CronParser;
use croner::Cron;

use crate::{Error, Result};

/// Most ticks one query returns; bounds work on a clock jump of years.
const MAX_TICKS_PER_QUERY: usize = 10_000;

/// Zones whose offset is zero at every instant: UTC and its aliases. A
/// schedule in one of them is evaluated on chrono's `Utc`, with no zone
/// lookups (each lookup is a search of the zone's transitions, and croner
/// makes several per evaluation); any other zone takes the general path.
const ALWAYS_UTC: &[Tz] = &[
    Tz::UTC,
    Tz::Etc__UTC,
    Tz::UCT,
    Tz::Etc__UCT,
    Tz::Universal,
    Tz::Etc__Universal,
    Tz::Zulu,
    Tz::Etc__Zulu,
    Tz::GMT,
    Tz::Etc__GMT,
    Tz::GMT0,
    Tz::Etc__GMT0,
    Tz::Etc__GMTPlus0,
    Tz::Etc__GMTMinus0,
    Tz::Greenwich,
    Tz::Etc__Greenwich,
];

/// A parsed cron expression and the time zone it is read in.
///
/// Expressions have 5 fields (`minute hour day month weekday`) or 6 with
/// seconds first (`second minute hour day month weekday`).
///
/// # Daylight saving time
///
/// Ticks are computed on the zone's wall clock, as `cron` does:
/// - **Spring forward** (a wall-clock hour does not exist): a job at a fixed
///   time inside the gap, such as `0 30 2 * * *` in `Europe/Berlin` on the last
///   Sunday of March, runs once, at the first instant after the gap (03:00
///   local); a job with a wildcard or step in its second, minute or hour
///   field simply has no ticks inside the gap.
/// - **Fall back** (a wall-clock hour happens twice): a fixed-time job runs
///   once, on the first pass (02:30 CEST, not again at 02:30 CET); a
///   wildcard or step job runs on both passes.
///
/// Either way every tick is a distinct UTC instant, and the per-tick lock
/// and the completed-tick record are keyed by that instant, so no tick is
/// ever run twice because of a zone change.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use scheduler::Schedule;
///
/// let s = Schedule::parse("nightly", "0 30 2 * * *", "Europe/Berlin")?;
/// let after = chrono::DateTime::parse_from_rfc3339("2026-03-28T12:00:00Z")?.to_utc();
/// // 2026-03-29 is the spring-forward day: 02:30 does not exist, 03:00 CEST = 01:00 UTC.
/// let next = s.next_after(after).ok_or("no next tick")?;
/// assert_eq!(next.to_rfc3339(), "2026-03-29T01:00:00+00:00");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Schedule {
    cron: Cron,
    tz: Tz,
    /// `tz` is one of [`ALWAYS_UTC`].
    utc: bool,
    expr: String,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("expr", &self.expr)
            .field("tz", &self.tz.name())
            .finish()
    }
}

impl Schedule {
    /// Parses `expr` for `job`, read in the IANA time zone `zone`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCron`] for an expression that is not 5 or 6 valid
    /// fields, or that never matches; [`Error::InvalidTimeZone`] for an
    /// unknown zone.
    pub fn parse(job: &str, expr: &str, zone: &str) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidCron {
            job: job.to_owned(),
            expr: expr.to_owned(),
            reason,
        };
        let fields = expr.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(invalid(format!("it has {fields} fields")));
        }
        let cron = CronParser::builder()
            .build()
            .parse(expr)
            .map_err(|e| invalid(e.to_string()))?;
        let tz = Tz::from_str(zone).map_err(|_| Error::InvalidTimeZone {
            job: job.to_owned(),
            zone: zone.to_owned(),
        })?;
        let schedule = Self {
            cron,
            utc: ALWAYS_UTC.contains(&tz),
            tz,
            expr: expr.to_owned(),
        };
        // A pattern such as `0 0 30 2 *` (February 30th) parses but never fires.
        let probe = DateTime::from_timestamp(0, 0).unwrap_or_default();
        if schedule.next_after(probe).is_none() {
            return Err(invalid("it never matches any date".into()));
        }
        Ok(schedule)
    }

    /// The expression as given.
    pub fn expression(&self) -> &str {
        &self.expr
    }

    /// The time zone's IANA name.
    pub fn time_zone(&self) -> &'static str {
        self.tz.name()
    }

    /// The first tick strictly after `after`, or `None` if there is none
    /// (before the year 5000).
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        if self.utc {
            return self.cron.find_next_occurrence(&after, false).ok();
        }
        let local = after.with_timezone(&self.tz);
        self.cron
            .find_next_occurrence(&local, false)
            .ok()
            .map(|t| t.with_timezone(&Utc))
    }

    /// The latest tick at or before `at`, if any.
    pub fn latest_at_or_before(&self, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        if self.utc {
            return self.cron.find_previous_occurrence(&at, true).ok();
        }
        let local = at.with_timezone(&self.tz);
        self.cron
            .find_previous_occurrence(&local, true)
            .ok()
            .map(|t| t.with_timezone(&Utc))
    }

    /// The ticks in `(after, upto]`, oldest first, at most 10,000 (the newest
    /// are kept when there are more).
    pub fn ticks_between(&self, after: DateTime<Utc>, upto: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        match self.next_after(after) {
            Some(first) if first <= upto => self.due_from(first, upto).0,
            _ => Vec::new(),
        }
    }

    /// The ticks in `[first, upto]` for a tick `first` at or before `upto`,
    /// oldest first (at most 10,000, the newest kept), and the first tick
    /// after `upto`, if any. One evaluation per tick: a loop that waits for
    /// the returned next tick never evaluates the schedule twice for one
    /// tick (with many jobs firing every second, evaluations showed in
    /// profiles).
    pub(crate) fn due_from(
        &self,
        first: DateTime<Utc>,
        upto: DateTime<Utc>,
    ) -> (Vec<DateTime<Utc>>, Option<DateTime<Utc>>) {
        let mut ticks = std::collections::VecDeque::from([first]);
        let mut cursor = first;
        loop {
            match self.next_after(cursor) {
                Some(next) if next <= upto => {
                    if ticks.len() == MAX_TICKS_PER_QUERY {
                        ticks.pop_front();
                    }
                    ticks.push_back(next);
                    cursor = next;
                }
                following => return (ticks.into(), following),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("rfc3339").to_utc()
    }

    fn iso(t: Option<DateTime<Utc>>) -> String {
        t.map(|t| t.to_rfc3339()).unwrap_or_default()
    }

    #[test]
    fn five_and_six_fields_with_utc_default() {
        let five = Schedule::parse("j", "*/5 * * * *", "UTC").expect("5 fields");
        assert_eq!(
            iso(five.next_after(at("2026-01-01T00:01:00Z"))),
            "2026-01-01T00:05:00+00:00"
        );
        let six = Schedule::parse("j", "*/2 * * * * *", "UTC").expect("6 fields");
        assert_eq!(
            six.ticks_between(at("2026-01-01T00:00:00Z"), at("2026-01-01T00:00:06Z")),
            vec![
                at("2026-01-01T00:00:02Z"),
                at("2026-01-01T00:00:04Z"),
                at("2026-01-01T00:00:06Z")
            ]
        );
    }

    #[test]
    fn due_from_gives_the_due_ticks_and_the_one_after() {
        let s = Schedule::parse("j", "*/2 * * * * *", "UTC").expect("valid");
        let first = at("2026-01-01T00:00:02Z");
        assert_eq!(
            s.due_from(first, at("2026-01-01T00:00:03Z")),
            (vec![first], Some(at("2026-01-01T00:00:04Z")))
        );
        assert_eq!(
            s.due_from(first, at("2026-01-01T00:00:06Z")),
            (
                s.ticks_between(at("2026-01-01T00:00:00Z"), at("2026-01-01T00:00:06Z")),
                Some(at("2026-01-01T00:00:08Z"))
            )
        );
    }

    #[test]
    fn bad_expressions_and_zones_are_named_in_the_error() {
        for expr in [
            "",
            "* * *",
            "61 * * * *",
            "* * * * * * * *",
            "x y z a b",
            "0 0 30 2 *",
        ] {
            match Schedule::parse("report", expr, "UTC") {
                Err(Error::InvalidCron { job, expr: e, .. }) => {
                    assert_eq!((job.as_str(), e.as_str()), ("report", expr));
                }
                other => panic!("{expr:?}: expected InvalidCron, got {other:?}"),
            }
        }
        let err = Schedule::parse("report", "* * * * *", "Mars/Olympus").expect_err("bad zone");
        assert!(matches!(err, Error::InvalidTimeZone { ref zone, .. } if zone == "Mars/Olympus"));
        assert!(err.to_string().contains("IANA"), "{err}");
    }

    #[test]
    fn a_time_zone_moves_the_tick() {
        let s = Schedule::parse("j", "0 0 9 * * *", "America/New_York").expect("valid");
        assert_eq!(
            iso(s.next_after(at("2026-01-15T00:00:00Z"))),
            "2026-01-15T14:00:00+00:00"
        );
    }

    /// The zones taken as UTC have offset zero at every instant sampled,
    /// 1900 to 2100 (so the list holds no zone with a history).
    #[test]
    fn the_zones_taken_as_utc_never_leave_offset_zero() {
        use chrono::{Offset, TimeZone};
        use chrono_tz::OffsetComponents;
        for tz in ALWAYS_UTC {
            let mut t = at("1900-01-01T00:00:00Z");
            while t < at("2100-01-01T00:00:00Z") {
                let offset = tz.offset_from_utc_datetime(&t.naive_utc());
                assert_eq!(offset.fix().local_minus_utc(), 0, "{} at {t}", tz.name());
                assert!(offset.dst_offset().is_zero(), "{} at {t}", tz.name());
                t += chrono::TimeDelta::days(97);
            }
        }
    }

    /// A schedule in a zone taken as UTC gives the ticks the general path
    /// gives, forwards and backwards, on both sides of every kind of field.
    #[test]
    fn the_utc_path_agrees_with_the_zone_path() {
        for expr in [
            "* * * * * *",
            "*/7 * * * * *",
            "0 */5 * * * *",
            "0 30 2 * * *",
            "0 0 9 * * MON-FRI",
            "0 0 0 29 2 *",
            "0 0 12 L * *",
        ] {
            for zone in ["UTC", "Etc/GMT", "Zulu"] {
                let fast = Schedule::parse("j", expr, zone).expect("valid");
                assert!(fast.utc, "{zone}");
                let general = Schedule {
                    utc: false,
                    ..fast.clone()
                };
                let mut t = at("2023-12-31T23:59:58Z");
                for step in 0..400 {
                    assert_eq!(
                        fast.next_after(t),
                        general.next_after(t),
                        "{expr} in {zone} after {t}"
                    );
                    assert_eq!(
                        fast.latest_at_or_before(t),
                        general.latest_at_or_before(t),
                        "{expr} in {zone} at or before {t}"
                    );
                    // Irregular steps, from a second to a few months.
                    t += chrono::TimeDelta::seconds(1 + (step * step * 7_919) % 9_000_000);
                }
            }
        }
        let berlin = Schedule::parse("j", "* * * * * *", "Europe/Berlin").expect("valid");
        assert!(!berlin.utc, "a zone with a history takes the general path");
    }

    /// Europe/Berlin, 2026-03-29: 02:00 CET jumps to 03:00 CEST.
    #[test]
    fn spring_forward_runs_a_fixed_time_job_once_after_the_gap() {
        let s = Schedule::parse("j", "0 30 2 * * *", "Europe/Berlin").expect("valid");
        let ticks = s.ticks_between(at("2026-03-27T12:00:00Z"), at("2026-03-31T12:00:00Z"));
        assert_eq!(
            ticks,
            vec![
                at("2026-03-28T01:30:00Z"), // 02:30 CET
                at("2026-03-29T01:00:00Z"), // the gap: 03:00 CEST, once
                at("2026-03-30T00:30:00Z"), // 02:30 CEST
                at("2026-03-31T00:30:00Z"),
            ]
        );
        let every_15 = Schedule::parse("j", "0 */15 2 * * *", "Europe/Berlin").expect("valid");
        let on_the_day =
            every_15.ticks_between(at("2026-03-28T23:00:00Z"), at("2026-03-29T23:00:00Z"));
        assert!(
            on_the_day.is_empty(),
            "no 02:xx exists that day: {on_the_day:?}"
        );
    }

    /// Europe/Berlin, 2026-10-25: 03:00 CEST falls back to 02:00 CET.
    #[test]
    fn fall_back_runs_a_fixed_time_job_once_and_a_wildcard_job_on_both_passes() {
        let s = Schedule::parse("j", "0 30 2 * * *", "Europe/Berlin").expect("valid");
        let ticks = s.ticks_between(at("2026-10-24T12:00:00Z"), at("2026-10-26T12:00:00Z"));
        assert_eq!(
            ticks,
            vec![
                at("2026-10-25T00:30:00Z"), // 02:30 CEST, the first pass only
                at("2026-10-26T01:30:00Z"), // 02:30 CET the next day
            ]
        );
        let every_30 = Schedule::parse("j", "0 */30 2 * * *", "Europe/Berlin").expect("valid");
        let on_the_day =
            every_30.ticks_between(at("2026-10-24T23:00:00Z"), at("2026-10-25T23:00:00Z"));
        assert_eq!(
            on_the_day,
            vec![
                at("2026-10-25T00:00:00Z"),
                at("2026-10-25T00:30:00Z"),
                at("2026-10-25T01:00:00Z"),
                at("2026-10-25T01:30:00Z"),
            ]
        );
    }
}
