//! Durations on the command line and in cron files: `500ms`, `30s`, `10m`,
//! `2h`, `1d`, and sums such as `1m30s`.

use std::time::Duration;

/// Parses `text`; a bare number is seconds.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("an empty duration; write 500ms, 30s, 10m, 2h or 1d".into());
    }
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!(
                "{text:?} is not a duration; write 500ms, 30s, 10m, 2h or 1d"
            ));
        }
        let value: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{text:?}: the number is too large"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let part = match unit {
            "ms" => Some(Duration::from_millis(value)),
            "s" => Some(Duration::from_secs(value)),
            "m" => value.checked_mul(60).map(Duration::from_secs),
            "h" => value.checked_mul(3600).map(Duration::from_secs),
            "d" => value.checked_mul(86_400).map(Duration::from_secs),
            other => {
                return Err(format!(
                    "{text:?}: unknown unit {other:?}; use ms, s, m, h or d"
                ))
            }
        };
        total = part
            .and_then(|p| total.checked_add(p))
            .ok_or_else(|| format!("{text:?} is too long"))?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_sums_and_errors() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse("1d"), Ok(Duration::from_secs(86_400)));
        for bad in ["", "s", "10x", "1.5s", "-1s", "99999999999999999999999s"] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(parse("18446744073709551615d").is_err());
    }
}
