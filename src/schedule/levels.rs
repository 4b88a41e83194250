//! Delay levels and how a delay is split into hops across them.

use crate::error::{Error, Result};
use crate::storage::format::Route;

/// The default levels, as RocketMQ ships them.
pub const DEFAULT_LEVELS: &str = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h";

/// Parses a duration such as `250ms`, `5s`, `10m`, `2h`, `30d` or a plain number of milliseconds.
///
/// ```
/// use delayd::schedule::levels::parse_duration_ms;
/// assert_eq!(parse_duration_ms("1500").unwrap(), 1500);
/// assert_eq!(parse_duration_ms("2h").unwrap(), 7_200_000);
/// assert!(parse_duration_ms("-5s").is_err());
/// ```
pub fn parse_duration_ms(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| Error::invalid("duration", format!("{s:?} is not a duration")))?;
    let mul = match unit {
        "" | "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(Error::invalid("duration", format!("{s:?} has an unknown unit (use ms, s, m, h, d)")))
        }
    };
    n.checked_mul(mul).ok_or_else(|| Error::invalid("duration", format!("{s:?} is too large")))
}

/// Formats milliseconds the way levels are written (`1s`, `2m`, `1h`, or `1500ms`).
pub fn format_duration_ms(ms: u64) -> String {
    for (unit, mul) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms >= mul && ms % mul == 0 {
            return format!("{}{unit}", ms / mul);
        }
    }
    format!("{ms}ms")
}

/// Parses a list of durations separated by spaces or commas.
pub fn parse_list_ms(s: &str) -> Result<Vec<u64>> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(parse_duration_ms)
        .collect()
}

/// Checks a level list: non-empty, strictly ascending, every level at least 1 ms.
pub fn validate_levels(levels: &[u64]) -> Result<()> {
    if levels.is_empty() {
        return Err(Error::Config("levels: at least one delay level is required".into()));
    }
    if levels[0] == 0 {
        return Err(Error::Config("levels: a level must be at least 1ms".into()));
    }
    if levels.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Config("levels: must be strictly ascending".into()));
    }
    Ok(())
}

/// The next hop for a timer with `remaining_ms` to go: the largest level that fits, or, for a
/// remainder shorter than every level, the smallest level with the exact due time.
pub fn plan_hop(levels: &[u64], now_ms: u64, remaining_ms: u64) -> Route {
    match levels.iter().rev().find(|l| **l <= remaining_ms) {
        Some(l) => Route::Level { level_ms: *l, due_ms: now_ms + l },
        None => Route::Level { level_ms: levels[0], due_ms: now_ms + remaining_ms },
    }
}

/// The level nearest to `delay_ms` (the first on ties), for the `round` policy.
pub fn nearest_level(levels: &[u64], delay_ms: u64) -> u64 {
    let mut best = levels[0];
    for l in levels {
        if l.abs_diff(delay_ms) < best.abs_diff(delay_ms) {
            best = *l;
        }
    }
    best
}

/// The full list of hop durations a chained delay takes if every hop fires on time.
///
/// ```
/// use delayd::schedule::levels::{chain, parse_list_ms, DEFAULT_LEVELS};
/// let levels = parse_list_ms(DEFAULT_LEVELS).unwrap();
/// // 1h 2m 5.25s: three full levels, then the 250 ms remainder, exact to the millisecond.
/// assert_eq!(chain(&levels, 3_725_250), vec![3_600_000, 120_000, 5_000, 250]);
/// ```
pub fn chain(levels: &[u64], delay_ms: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut left = delay_ms;
    while left > 0 {
        let Route::Level { due_ms, .. } = plan_hop(levels, 0, left) else { break };
        out.push(due_ms);
        left -= due_ms;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Vec<u64> {
        parse_list_ms(DEFAULT_LEVELS).unwrap()
    }

    #[test]
    fn parses_durations_and_lists() {
        assert_eq!(parse_duration_ms("250ms").unwrap(), 250);
        assert_eq!(parse_duration_ms("1500").unwrap(), 1500);
        assert_eq!(parse_duration_ms("2h").unwrap(), 7_200_000);
        assert_eq!(parse_duration_ms("30d").unwrap(), 2_592_000_000);
        assert!(parse_duration_ms("-5s").is_err());
        assert!(parse_duration_ms("5x").is_err());
        assert!(parse_duration_ms("99999999999999999999d").is_err());
        assert_eq!(defaults().len(), 18);
        assert_eq!(parse_list_ms("1s, 5s,10s").unwrap(), vec![1000, 5000, 10_000]);
        assert_eq!(format_duration_ms(3_600_000), "1h");
        assert_eq!(format_duration_ms(1500), "1500ms");
    }

    #[test]
    fn validates_levels() {
        assert!(validate_levels(&[]).is_err());
        assert!(validate_levels(&[0, 5]).is_err());
        assert!(validate_levels(&[5, 5]).is_err());
        assert!(validate_levels(&[5, 10]).is_ok());
    }

    #[test]
    fn chains_greedily_with_an_exact_remainder() {
        let l = defaults();
        // 1h 2m 5s = 1h + 2m + 5s.
        assert_eq!(chain(&l, 3_725_000), vec![3_600_000, 120_000, 5_000]);
        // 1h59m59s: 1h 30m 20m 9m 30s 10s 10s 5s 1s 1s 1s 1s.
        assert_eq!(
            chain(&l, 7_199_000),
            vec![
                3_600_000, 1_800_000, 1_200_000, 540_000, 30_000, 10_000, 10_000, 5_000, 1000, 1000, 1000,
                1000
            ]
        );
        // Sub-second remainders ride the smallest level with their exact length.
        assert_eq!(chain(&l, 1_250), vec![1000, 250]);
        assert_eq!(chain(&l, 40), vec![40]);
        assert_eq!(chain(&l, 7_199_999).iter().sum::<u64>(), 7_199_999);
    }

    #[test]
    fn rounds_to_the_nearest_level() {
        let l = defaults();
        assert_eq!(nearest_level(&l, 4_000), 5_000);
        assert_eq!(nearest_level(&l, 100), 1_000);
        assert_eq!(nearest_level(&l, 86_400_000), 7_200_000);
    }
}
