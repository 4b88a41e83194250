//! Durations and sizes as people write them in the config file, the environment, flags and API fields.
//!
//! The one parser of each, shared by the config, the HTTP API and the delay levels; it sits below
//! all of them and imports nothing of the crate. A plain number is milliseconds or
//! bytes; anything else goes to a well-kept crate so the units mean what they say everywhere:
//! `humantime` for durations (`500ms`, `10s`, `1h30m`, `2days`) and `bytesize` for sizes, where
//! decimal units are powers of 1000 (`4MB` = 4,000,000 bytes) and binary units powers of 1024
//! (`4MiB` = 4,194,304 bytes).

use std::time::Duration;

use bytesize::ByteSize;

/// One second in milliseconds.
pub const SECOND_MS: u64 = 1000;
/// One minute in milliseconds.
pub const MINUTE_MS: u64 = 60 * SECOND_MS;
/// One hour in milliseconds.
pub const HOUR_MS: u64 = 60 * MINUTE_MS;
/// One day in milliseconds.
pub const DAY_MS: u64 = 24 * HOUR_MS;

/// What the parsers' errors say a duration looks like.
pub const DURATION_SYNTAX: &str = "a duration like 500ms, 10s, 1h30m, 2d or a number of milliseconds";
/// What the parsers' errors say a size looks like.
pub const SIZE_SYNTAX: &str = "a size like 64KiB, 4MB, 4MiB, 1GiB or a number of bytes";

/// Formats milliseconds the way the parser reads them back (`90000` becomes `90s`, `3600000` `1h`).
pub fn fmt_ms(ms: u64) -> String {
    for (unit, size) in [("d", DAY_MS), ("h", HOUR_MS), ("m", MINUTE_MS), ("s", SECOND_MS)] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Formats bytes the way the parser reads them back: the largest binary unit that divides them
/// exactly (`67108864` becomes `64MiB`), else plain bytes.
pub fn fmt_size(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        let size = 1u64 << shift;
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

/// Parses a non-negative integer; `_` may group digits (`300_000`).
pub fn parse_u64(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits = s.replace('_', "");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} is not a non-negative integer"));
    }
    digits.parse::<u64>().map_err(|_| format!("{s:?} is too large"))
}

/// A plain number (digits and `_` only), which every parser here takes as the base unit.
fn is_plain_number(s: &str) -> bool {
    s.bytes().any(|b| b.is_ascii_digit()) && s.bytes().all(|b| b.is_ascii_digit() || b == b'_')
}

/// Parses a duration into milliseconds: a plain number of milliseconds, or humantime's syntax,
/// where `ms`, `s`, `m` (minutes), `h`, `d`, `w`, `M` (months of 30.44 days) and `y` combine
/// (`1h30m`, `1h 30m`) and may carry a fraction (`1.5s`). Sub-millisecond remainders are refused.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if is_plain_number(s) {
        return parse_u64(s);
    }
    // humantime 2.4 panics in `Duration::new` when its running sum lands on u64::MAX seconds with a
    // full second of nanoseconds left to carry (`18446744073709551615s 500ms 500ms`); parsing each
    // number-and-unit part alone and adding with `checked_add` keeps bad input an error.
    let mut d = Duration::ZERO;
    for part in duration_parts(s) {
        let p =
            humantime::parse_duration(part).map_err(|e| format!("{s:?} is not {DURATION_SYNTAX} ({e})"))?;
        d = d.checked_add(p).ok_or_else(|| format!("{s:?} is too large"))?;
    }
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(format!("{s:?} is not a whole number of milliseconds"));
    }
    u64::try_from(d.as_millis()).map_err(|_| format!("{s:?} is too large"))
}

/// Splits `1h 30m`, `1h30m` or `2 days 3h` into its number-and-unit parts; a part starts at a
/// digit or point that follows a unit letter.
fn duration_parts(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut after_unit) = (0, false);
    for (i, c) in s.char_indices() {
        if c.is_ascii_digit() || c == '.' {
            if after_unit {
                parts.push(s[start..i].trim());
                start = i;
                after_unit = false;
            }
        } else if !c.is_whitespace() {
            after_unit = true;
        }
    }
    parts.push(s[start..].trim());
    parts
}

/// Parses a list of durations separated by commas and/or whitespace (so an item with several
/// units is written without spaces: `1h30m`).
pub fn parse_duration_list(s: &str) -> Result<Vec<u64>, String> {
    s.split(|c: char| c == ',' || c.is_whitespace()).filter(|p| !p.is_empty()).map(parse_duration).collect()
}

/// Parses a size into bytes: a plain number of bytes, or a number (a fraction allowed, rounded
/// down to whole bytes) and a unit, case-insensitive, an optional space between: `B`; decimal
/// `KB`/`K`, `MB`/`M`, `GB`/`G`, `TB`/`T` (powers of 1000); binary `KiB`, `MiB`, `GiB`, `TiB`
/// (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if is_plain_number(s) {
        return parse_u64(s);
    }
    let size: ByteSize = s.parse().map_err(|e| format!("{s:?} is not {SIZE_SYNTAX} ({e})"))?;
    // bytesize saturates instead of failing on overflow.
    if size.as_u64() == u64::MAX {
        return Err(format!("{s:?} is too large"));
    }
    Ok(size.as_u64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn durations_parse_with_humantime_and_plain_numbers_are_ms() {
        assert_eq!(parse_duration("500ms"), Ok(500));
        assert_eq!(parse_duration("10s"), Ok(10_000));
        assert_eq!(parse_duration("1m"), Ok(60_000));
        assert_eq!(parse_duration("1h"), Ok(3_600_000));
        assert_eq!(parse_duration("1d"), Ok(DAY_MS));
        assert_eq!(parse_duration("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration("1h 30m"), Ok(5_400_000));
        assert_eq!(parse_duration("2days"), Ok(2 * DAY_MS));
        assert_eq!(parse_duration("1w"), Ok(7 * DAY_MS));
        assert_eq!(parse_duration("1.5s"), Ok(1500));
        assert_eq!(parse_duration("250"), Ok(250));
        assert_eq!(parse_duration(" 1_000 "), Ok(1000));
        assert_eq!(parse_duration("0"), Ok(0));
        for bad in ["", "-1s", "5 fortnights", "1.5", "10 s s", "99999999999999999999d", "1500us", "ms"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(&format!("{:?}", bad.trim())), "{bad}: {e}");
        }
        assert!(parse_duration("99999999999999999999").unwrap_err().contains("too large"));
        // A sum humantime itself would panic on.
        assert!(parse_duration("18446744073709551615s 500ms 500ms").unwrap_err().contains("too large"));
        assert_eq!(duration_parts("1h30m"), ["1h", "30m"]);
        assert_eq!(duration_parts("2 days 3h"), ["2 days", "3h"]);
        assert_eq!(parse_duration_list("1s 5s,1m  2h"), Ok(vec![1000, 5000, 60_000, 7_200_000]));
        assert_eq!(parse_duration_list("1h30m, 90"), Ok(vec![5_400_000, 90]));
        assert!(parse_duration_list("1s soon").unwrap_err().contains("\"soon\""));
    }

    #[test]
    fn sizes_mean_what_their_units_say() {
        assert_eq!(parse_size("4MB"), Ok(4_000_000));
        assert_eq!(parse_size("4MiB"), Ok(4_194_304));
        assert_eq!(parse_size("4 mib"), Ok(4 << 20));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("64kB"), Ok(64_000));
        assert_eq!(parse_size("64k"), Ok(64_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5MiB"), Ok(1_572_864));
        assert_eq!(parse_size("100B"), Ok(100));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("1_048_576"), Ok(1 << 20));
        for bad in ["", "4 parsecs", "-1MB", "MiB", "1.2.3MB", "4MiBs", "20000000EiB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(&format!("{:?}", bad.trim())), "{bad}: {e}");
        }
    }

    #[test]
    fn formats_read_back() {
        assert_eq!(fmt_ms(3_600_000), "1h");
        assert_eq!(fmt_ms(90_000), "90s");
        assert_eq!(fmt_ms(1500), "1500ms");
        assert_eq!(fmt_ms(0), "0ms");
        assert_eq!(fmt_size(64 << 20), "64MiB");
        assert_eq!(fmt_size(4_000_000), "4000000");
        assert_eq!(fmt_size(0), "0");
    }

    proptest! {
        #[test]
        fn durations_round_trip(ms in 0u64..=u64::MAX / 1_000_000) {
            prop_assert_eq!(parse_duration(&fmt_ms(ms)), Ok(ms));
            prop_assert_eq!(parse_duration(&ms.to_string()), Ok(ms));
        }

        #[test]
        fn duration_units_multiply(n in 0u64..1_000_000) {
            prop_assert_eq!(parse_duration(&format!("{n}s")), Ok(n * SECOND_MS));
            prop_assert_eq!(parse_duration(&format!("{n}m")), Ok(n * MINUTE_MS));
            prop_assert_eq!(parse_duration(&format!("{n}h{n}m")), Ok(n * HOUR_MS + n * MINUTE_MS));
            prop_assert_eq!(parse_duration(&format!("{n}d")), Ok(n * DAY_MS));
        }

        #[test]
        fn sizes_round_trip(bytes in any::<u64>().prop_map(|b| b >> 1)) {
            prop_assert_eq!(parse_size(&fmt_size(bytes)), Ok(bytes));
            prop_assert_eq!(parse_size(&bytes.to_string()), Ok(bytes));
        }

        #[test]
        fn size_units_are_decimal_or_binary(n in 0u64..1_000_000) {
            prop_assert_eq!(parse_size(&format!("{n}KB")), Ok(n * 1000));
            prop_assert_eq!(parse_size(&format!("{n}MB")), Ok(n * 1_000_000));
            prop_assert_eq!(parse_size(&format!("{n}GB")), Ok(n * 1_000_000_000));
            prop_assert_eq!(parse_size(&format!("{n}KiB")), Ok(n << 10));
            prop_assert_eq!(parse_size(&format!("{n}MiB")), Ok(n << 20));
            prop_assert_eq!(parse_size(&format!("{n}GiB")), Ok(n << 30));
        }

        #[test]
        fn any_input_is_a_value_or_an_error_never_a_panic(s in "\\PC{0,24}") {
            let _ = parse_duration(&s);
            let _ = parse_duration_list(&s);
            let _ = parse_size(&s);
            let _ = parse_u64(&s);
        }

        #[test]
        fn number_like_garbage_never_panics(s in "[0-9._ a-zA-Zµ-]{0,24}") {
            let _ = parse_duration(&s);
            let _ = parse_size(&s);
        }
    }
}
