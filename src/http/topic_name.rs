//! Topic names as clients write them and as they are stored: ONE mapping for the native API, the
//! compat API, the CLI and the dashboard.
//!
//! Storage takes `[A-Za-z0-9._-]` (a topic names a directory). A name made only of those is its
//! own storage name. Any other (an ouqiang-style `order:close`, which the original API takes) is
//! stored with each byte outside that set written as `%XX`: `order%3Aclose`. `%` is never part of
//! a name that is its own storage name, so the mapping is reversible, and every answer shows the
//! name the client wrote. A `/v1/topics/{topic}` path takes that name percent-encoded
//! (`order%3Aclose`) or, where URL rules allow, as it is (`order:close`).

use super::error::ApiError;
use super::validate;

/// Longest storage name (it names a directory, `t-<name>.dlq` included).
const MAX_STORED: usize = crate::limits::MAX_TOPIC_LEN;

/// The storage name of the topic a client calls `name`, or why there is none.
pub(crate) fn stored(name: &str) -> Result<String, String> {
    if name.is_empty() {
        return Err("topic must not be empty".into());
    }
    if validate::topic(name).is_ok() {
        return Ok(name.to_string());
    }
    let mut out = String::with_capacity(name.len() * 3);
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.len() > MAX_STORED {
        return Err(format!(
            "topic is too long: {} bytes once stored (each byte outside A-Z a-z 0-9 . _ - takes 3), \
             the most is {MAX_STORED}",
            out.len()
        ));
    }
    Ok(out)
}

/// [`stored`] for a native route: a 400 naming the field.
pub(crate) fn stored_or_400(name: &str) -> Result<String, ApiError> {
    stored(name).map_err(|why| ApiError::invalid("topic", why))
}

/// The name a client wrote, from its storage name.
pub(crate) fn shown(stored: &str) -> String {
    if !stored.contains('%') {
        return stored.to_string();
    }
    let b = stored.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (other, _) => {
                out.push(other);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_topic_maps_to_a_storage_name_and_back() {
        for t in
            ["order", "order:close", "订单", "names with spaces", "50%", "a%20b", ".", "emoji 🚀", "x/../y"]
        {
            let stored = stored(t).unwrap();
            assert!(crate::engine::validate_topic(&stored).is_ok(), "{t:?} stored as {stored:?}");
            assert_eq!(shown(&stored), t, "{t:?} stored as {stored:?}");
        }
        assert_eq!(stored("order.close").unwrap(), "order.close", "a native name is its own");
        assert_eq!(stored("order:close").unwrap(), "order%3Aclose");
        assert_ne!(stored("a%20b").unwrap(), stored("a b").unwrap());
        assert!(stored(&"订".repeat(43)).is_err(), "129 bytes once escaped");
        assert!(stored(&"订".repeat(14)).is_ok());
    }

    #[test]
    fn an_empty_name_is_refused() {
        assert!(stored("").is_err());
    }
}
