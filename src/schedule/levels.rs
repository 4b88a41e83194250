//! Delay levels and how a delay is split into hops across them.

use crate::error::{Error, Result};
use crate::storage::format::Route;
use crate::units::{fmt_ms, HOUR_MS as H, MINUTE_MS as M, SECOND_MS as S};

/// Default delay levels: RocketMQ's list (1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h
/// 2h, so its 1-based level numbers mean the same), then 6h 12h 1d, so a delay of days hops about
/// once a day instead of every two hours (docs/benchmarks.md, "Long delays").
#[rustfmt::skip]
pub const DEFAULT_LEVELS_MS: [u64; 21] = [
    S, 5 * S, 10 * S, 30 * S, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M, 8 * M, 9 * M, 10 * M, 20 * M, 30 * M, H, 2 * H,
    6 * H, 12 * H, 24 * H,
];

/// Checks a level list: non-empty, strictly ascending, every level at least 1 ms.
pub fn validate_levels(levels: &[u64]) -> Result<()> {
    if levels.is_empty() {
        return Err(Error::Config("levels: needs at least one level".into()));
    }
    if levels[0] == 0 {
        return Err(Error::Config("levels: a level must be longer than 0ms".into()));
    }
    if let Some(w) = levels.windows(2).find(|w| w[0] >= w[1]) {
        return Err(Error::Config(format!(
            "levels: must be strictly ascending, but {} is followed by {}",
            fmt_ms(w[0]),
            fmt_ms(w[1])
        )));
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
/// use delayd::schedule::levels::{chain, DEFAULT_LEVELS_MS};
/// let levels = DEFAULT_LEVELS_MS;
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
        DEFAULT_LEVELS_MS.to_vec()
    }

    #[test]
    fn validates_levels() {
        assert!(validate_levels(&[]).is_err());
        assert!(validate_levels(&[0, 5]).is_err());
        let e = validate_levels(&[5000, 5000]).unwrap_err().to_string();
        assert!(e.contains("levels") && e.contains("5s is followed by 5s"), "{e}");
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
    fn a_delay_of_days_hops_once_a_day_on_the_defaults() {
        let l = defaults();
        assert_eq!(chain(&l, 3 * 86_400_000), vec![86_400_000; 3]);
        // 30 days and 90 minutes: 30 hops of a day, then 1h and 30m, where 2h levels took 360.
        let c = chain(&l, 30 * 86_400_000 + 5_400_000);
        assert_eq!(c.len(), 32, "{c:?}");
        assert_eq!(c.iter().sum::<u64>(), 30 * 86_400_000 + 5_400_000);
    }

    #[test]
    fn rounds_to_the_nearest_level() {
        let l = defaults();
        assert_eq!(nearest_level(&l, 4_000), 5_000);
        assert_eq!(nearest_level(&l, 100), 1_000);
        assert_eq!(nearest_level(&l, 86_400_000), 86_400_000);
        assert_eq!(nearest_level(&l, 30 * 86_400_000), 86_400_000);
    }
}
