//! Durations and sizes as people write them in the config file, the environment and API fields.
//!
//! The one parser of each, shared by the config and the HTTP API.

/// One second in milliseconds.
pub const SECOND_MS: u64 = 1000;
/// One minute in milliseconds.
pub const MINUTE_MS: u64 = 60 * SECOND_MS;
/// One hour in milliseconds.
pub const HOUR_MS: u64 = 60 * MINUTE_MS;
/// One day in milliseconds.
pub const DAY_MS: u64 = 24 * HOUR_MS;

/// Formats milliseconds the way the config accepts them back (`90s` becomes `90s`, `3600000` becomes `1h`).
pub fn fmt_ms(ms: u64) -> String {
    for (unit, size) in [("d", DAY_MS), ("h", HOUR_MS), ("m", MINUTE_MS), ("s", SECOND_MS)] {
        if ms >= size && ms.checked_rem(size) == Some(0) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

pub(crate) fn parse_u64(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim().replace('_', "");
    s.parse::<u64>().map_err(|_| format!("{s:?} is not a non-negative integer"))
}

/// Parses `500ms`, `10s`, `1m`, `1h`, `1d` or a plain number of milliseconds.
pub fn parse_duration(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '_').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!("{s:?} is not a duration like 500ms, 10s, 1m, 1h, 1d or a number of ms"));
    }
    let n = parse_u64(num)?;
    let mult = match unit.trim() {
        "" | "ms" => 1,
        "s" => 1000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => DAY_MS,
        other => return Err(format!("unknown duration unit {other:?} in {s:?} (use ms, s, m, h or d)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses a list of durations separated by commas and/or whitespace.
pub fn parse_duration_list(s: &str) -> std::result::Result<Vec<u64>, String> {
    s.split(|c: char| c == ',' || c.is_whitespace()).filter(|p| !p.is_empty()).map(parse_duration).collect()
}

/// Parses a byte size: a plain number, or a number with `KiB`, `MiB`, `GiB` (also `k`, `m`, `g`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '_').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!("{s:?} is not a size like 4MiB or a number of bytes"));
    }
    let n = parse_u64(num)?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} in {s:?} (use KiB, MiB or GiB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_parse() {
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("10s"), Ok(10_000));
        assert_eq!(parse_duration("1m"), Ok(60_000));
        assert_eq!(parse_duration("1h"), Ok(3_600_000));
        assert_eq!(parse_duration("1d"), Ok(DAY_MS));
        assert_eq!(parse_duration("250"), Ok(250));
        assert!(parse_duration("1.5s").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("5 fortnights").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
        assert_eq!(parse_duration_list("1s 5s,1m  2h"), Ok(vec![1000, 5000, 60_000, 7_200_000]));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("4 parsecs").is_err());
        assert_eq!(fmt_ms(3_600_000), "1h");
        assert_eq!(fmt_ms(90_000), "90s");
        assert_eq!(fmt_ms(1500), "1500ms");
    }
}
