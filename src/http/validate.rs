//! Field rules shared by the native and compat APIs.
//!
//! Topics: a name of 1 to 128 characters from `[A-Za-z0-9._-]` is stored as it is (any other is
//! stored escaped, see `topic_name`). Ids: 1 to 128 bytes of UTF-8 with no whitespace
//! and no control characters (so any printable id, an order number or a UUID, fits in a URL path
//! segment once percent-encoded, and cannot be confused in logs). `.` and `..` alone are refused:
//! URL clients treat them as path navigation.

use serde_json::Value;

use super::error::ApiError;
use super::Limits;
use crate::limits::{MAX_BACKOFF_STEPS, MAX_ID_BYTES, MAX_TOPIC_LEN};
use crate::units::{fmt_ms, parse_duration, parse_duration_list};

/// Whether a topic name is its own storage name.
pub fn topic(t: &str) -> Result<(), ApiError> {
    if t.is_empty() || t.len() > MAX_TOPIC_LEN {
        return Err(ApiError::invalid("topic", format!("must be 1 to {MAX_TOPIC_LEN} characters")));
    }
    if let Some(c) = t.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(ApiError::invalid(
            "topic",
            format!("character {c:?} is not allowed (use A-Z a-z 0-9 . _ -)"),
        ));
    }
    Ok(())
}

/// Checks a message id.
pub fn id(field: &str, id: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(ApiError::invalid(field, format!("must be 1 to {MAX_ID_BYTES} bytes of UTF-8")));
    }
    if let Some(c) = id.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(ApiError::invalid(
            field,
            format!("must not contain whitespace or control characters, found {c:?}"),
        ));
    }
    if id == "." || id == ".." {
        // URL clients rewrite such path segments, so the message could never be looked up or cancelled.
        return Err(ApiError::invalid(field, "must not be \".\" or \"..\""));
    }
    Ok(())
}

/// Checks a message body's size.
pub fn body(limits: &Limits, body: &str) -> Result<(), ApiError> {
    if body.len() > limits.max_body_bytes {
        return Err(ApiError::too_large(format!(
            "body is {} bytes, more than max_body_bytes {}",
            body.len(),
            limits.max_body_bytes
        )));
    }
    Ok(())
}

/// Checks a delay in ms against `max_delay`.
pub fn delay(limits: &Limits, field: &str, ms: u64) -> Result<u64, ApiError> {
    if ms > limits.max_delay_ms {
        return Err(ApiError::invalid(
            field,
            format!("{ms}ms exceeds max_delay {} ({}ms)", fmt_ms(limits.max_delay_ms), limits.max_delay_ms),
        ));
    }
    Ok(ms)
}

/// The smallest `deliver_at_ms` taken as milliseconds (1973-03-03): below it, a nonzero value is
/// almost surely unix seconds, which would otherwise be delivered at once instead of when meant.
pub const MIN_DELIVER_AT_MS: u64 = 100_000_000_000;

/// Checks an absolute due time in unix ms: 0 (now) or at least [`MIN_DELIVER_AT_MS`], and at most
/// `max_delay` after `now_ms`.
pub fn deliver_at(limits: &Limits, field: &str, at: u64, now_ms: u64) -> Result<u64, ApiError> {
    if at != 0 && at < MIN_DELIVER_AT_MS {
        return Err(ApiError::invalid(
            field,
            format!(
                "{at} looks like seconds, not milliseconds: unix ms is at least {MIN_DELIVER_AT_MS} \
                 (for {at} seconds send {}); 0 means now",
                at.saturating_mul(1000)
            ),
        ));
    }
    let latest = now_ms.saturating_add(limits.max_delay_ms);
    if at > latest {
        return Err(ApiError::invalid(
            field,
            format!("{at} is more than max_delay ({}ms) in the future", limits.max_delay_ms),
        ));
    }
    Ok(at)
}

/// Checks a time-to-run in ms: at least 1, at most `max_delay`.
pub fn ttr(limits: &Limits, field: &str, ms: u64) -> Result<u64, ApiError> {
    if ms == 0 {
        return Err(ApiError::invalid(field, "must be at least 1"));
    }
    delay(limits, field, ms)
}

/// Resolves `level`: a 1-based index, or a duration equal to one configured level.
pub fn level(limits: &Limits, v: &Value) -> Result<u32, ApiError> {
    let n = limits.levels_ms.len();
    let names = || limits.levels_ms.iter().map(|l| fmt_ms(*l)).collect::<Vec<_>>().join(" ");
    match v {
        Value::Number(num) => match num.as_u64() {
            Some(i) if i >= 1 && i <= n as u64 => Ok(i as u32),
            _ => Err(ApiError::invalid("level", format!("{num} is not a level index from 1 to {n}"))),
        },
        Value::String(s) => {
            let ms = parse_duration(s).map_err(|e| ApiError::invalid("level", e))?;
            match limits.levels_ms.iter().position(|l| *l == ms) {
                Some(i) => Ok(i as u32 + 1),
                None => {
                    Err(ApiError::invalid("level", format!("{s:?} is not a configured level ({})", names())))
                }
            }
        }
        _ => Err(ApiError::invalid("level", "expected a level index or a duration string such as \"1m\"")),
    }
}

/// Parses a per-message backoff: an array of ms numbers or duration strings, or one string list.
pub fn backoff(limits: &Limits, v: &Value) -> Result<Vec<u64>, ApiError> {
    let steps: Vec<u64> = match v {
        Value::String(s) => parse_duration_list(s).map_err(|e| ApiError::invalid("backoff", e))?,
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::Number(n) => n.as_u64().ok_or_else(|| {
                    ApiError::invalid(
                        &format!("backoff[{i}]"),
                        format!("{n} is not a non-negative integer of ms"),
                    )
                }),
                Value::String(s) => {
                    parse_duration(s).map_err(|e| ApiError::invalid(&format!("backoff[{i}]"), e))
                }
                _ => {
                    Err(ApiError::invalid(&format!("backoff[{i}]"), "expected a duration or a number of ms"))
                }
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(ApiError::invalid(
                "backoff",
                "expected a list of durations such as [\"2m\", \"10m\"]",
            ))
        }
    };
    if steps.is_empty() || steps.len() > MAX_BACKOFF_STEPS {
        return Err(ApiError::invalid("backoff", format!("needs 1 to {MAX_BACKOFF_STEPS} steps")));
    }
    for s in &steps {
        delay(limits, "backoff", *s)?;
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> Limits {
        Limits {
            auth_token: None,
            read_token: None,
            max_body_bytes: 10,
            max_batch: 5,
            max_wait_ms: 1000,
            compat_max_wait_ms: 1000,
            compat_max_attempts: None,
            max_delay_ms: 86_400_000,
            levels_ms: vec![1000, 5000, 60_000],
            push_allowed_hosts: None,
        }
    }

    #[test]
    fn topics() {
        for ok in ["a", "orders", "orders.dlq", "A-b_c.9", &"x".repeat(128)] {
            assert!(topic(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "ü", "a\n", &"x".repeat(129)] {
            assert_eq!(topic(bad).unwrap_err().code, "invalid_argument", "{bad:?}");
        }
    }

    #[test]
    fn ids() {
        for ok in ["1", "order-15702398321", "заказ№5", "🦀", "a/b?c", &"é".repeat(64)] {
            assert!(id("id", ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a b", "tab\t", "nl\n", "nbsp\u{a0}", "\u{7f}", &"é".repeat(65)] {
            let e = id("id", bad).unwrap_err();
            assert!(e.message.starts_with("invalid id"), "{bad:?}: {}", e.message);
        }
    }

    #[test]
    fn bodies_and_delays() {
        let l = limits();
        assert!(body(&l, "0123456789").is_ok());
        assert_eq!(body(&l, "0123456789a").unwrap_err().status.as_u16(), 413);
        assert_eq!(delay(&l, "delay_ms", 86_400_000), Ok(86_400_000));
        assert!(delay(&l, "delay_ms", 86_400_001).unwrap_err().message.contains("max_delay"));
        assert!(ttr(&l, "ttr_ms", 0).is_err());
    }

    #[test]
    fn deliver_at_refuses_seconds_and_far_futures() {
        let l = limits();
        let now = 1_795_660_000_000;
        assert_eq!(deliver_at(&l, "deliver_at_ms", 0, now), Ok(0));
        assert_eq!(deliver_at(&l, "deliver_at_ms", MIN_DELIVER_AT_MS, now), Ok(MIN_DELIVER_AT_MS));
        assert_eq!(deliver_at(&l, "deliver_at_ms", now + 86_400_000, now), Ok(now + 86_400_000));
        for secs in [1, 1_795_660_000, MIN_DELIVER_AT_MS - 1] {
            let m = deliver_at(&l, "deliver_at_ms", secs, now).unwrap_err().message;
            assert!(m.starts_with("invalid deliver_at_ms") && m.contains("looks like seconds"), "{m}");
            assert!(m.contains(&secs.to_string()) && m.contains(&(secs * 1000).to_string()), "{m}");
        }
        let m = deliver_at(&l, "deliver_at_ms", now + 86_400_001, now).unwrap_err().message;
        assert!(m.contains("max_delay"), "{m}");
    }

    #[test]
    fn levels() {
        let l = limits();
        assert_eq!(level(&l, &json!(1)), Ok(1));
        assert_eq!(level(&l, &json!(3)), Ok(3));
        assert_eq!(level(&l, &json!("5s")), Ok(2));
        assert_eq!(level(&l, &json!("1m")), Ok(3));
        assert_eq!(level(&l, &json!("60000")), Ok(3));
        for bad in
            [json!(0), json!(4), json!(-1), json!(1.5), json!("2s"), json!("soon"), json!(null), json!([1])]
        {
            assert!(level(&l, &bad).unwrap_err().message.contains("level"), "{bad}");
        }
    }

    #[test]
    fn backoffs() {
        let l = limits();
        assert_eq!(backoff(&l, &json!(["2m", 500, "1h"])), Ok(vec![120_000, 500, 3_600_000]));
        assert_eq!(backoff(&l, &json!("2m 10m")), Ok(vec![120_000, 600_000]));
        assert!(backoff(&l, &json!([])).is_err());
        assert!(backoff(&l, &json!(["2m", -1])).unwrap_err().message.contains("backoff[1]"));
        assert!(backoff(&l, &json!(["2d"])).unwrap_err().message.contains("max_delay"));
        assert!(backoff(&l, &json!({"a": 1})).is_err());
    }
}
