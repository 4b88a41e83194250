//! A nack's `error` against the real binary: kept as the message's `last_error` with the attempt
//! that failed, across SIGKILL, in its history, on the dead letter it became and in browse items;
//! a nack without one keeps the last; a reason over 2048 bytes is cut at a character boundary.

mod common;

use common::Server;
use serde_json::{json, Value};

/// Pops `id` from `topic` (the only message there) and nacks it, with `error` when given.
fn pop_and_nack(s: &Server, topic: &str, id: &str, error: Option<&str>) -> Value {
    let (msgs, _) = s.pop(topic, 1, 5_000, None);
    assert_eq!(msgs.len(), 1, "{id} is ready");
    assert_eq!(msgs[0]["id"], id);
    let mut body = json!({"receipt": msgs[0]["receipt"], "delay_ms": 0});
    if let Some(e) = error {
        body["error"] = json!(e);
    }
    let (st, v) = s.post("/v1/nack", &body);
    assert_eq!(st, 200, "{v}");
    v
}

#[test]
fn a_nack_error_is_kept_across_sigkill_and_names_the_dead_letter() {
    let mut s = Server::start(&[]);
    s.produce("jobs", &json!({"id": "j", "body": "x", "max_attempts": 3}));
    let (st, v) = s.get("/v1/messages/j");
    assert_eq!(st, 200);
    assert!(v.get("last_error").is_none(), "no error before a failure: {v}");
    let before = common::now_ms();
    pop_and_nack(&s, "jobs", "j", Some("ValueError: bad input\n  at line 3"));
    s.kill9();
    s.respawn();
    let (_, v) = s.get("/v1/messages/j");
    let e = &v["last_error"];
    assert_eq!(
        (e["message"].as_str(), e["attempt"].as_u64()),
        (Some("ValueError: bad input\n  at line 3"), Some(1))
    );
    assert!(e["time_ms"].as_u64().unwrap() >= before, "{v}");
    // A nack without an error leaves the last one in place.
    pop_and_nack(&s, "jobs", "j", None);
    assert_eq!(s.get("/v1/messages/j").1["last_error"], *e);
    // The third failure uses the last attempt: the dead letter says why it died.
    let v = pop_and_nack(&s, "jobs", "j", Some("gave up: upstream 503"));
    assert_eq!(v["state"], "dead", "{v}");
    s.kill9();
    s.respawn();
    let (_, v) = s.get("/v1/messages/j");
    assert_eq!(v["state"], "dead");
    let e = &v["last_error"];
    assert_eq!((e["message"].as_str(), e["attempt"].as_u64()), (Some("gave up: upstream 503"), Some(3)));
    // Browse shows it on the dead letter's item, the history on the records that recorded one.
    let (st, b) = s.get("/v1/topics/jobs/messages?state=dead");
    assert_eq!(st, 200, "{b}");
    let item = b["messages"].as_array().unwrap().iter().find(|m| m["id"] == "j").cloned();
    assert_eq!(item.map(|m| m["last_error"].clone()), Some(e.clone()), "{b}");
    let (_, h) = s.get("/v1/messages/j/history");
    let events: Vec<(&str, Option<u64>)> = h["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ev| (ev["event"].as_str().unwrap(), ev["last_error"]["attempt"].as_u64()))
        .collect();
    assert_eq!(
        events,
        [
            ("dead_letter", Some(3)),
            ("reserve", None),
            ("nack", None),
            ("reserve", None),
            ("nack", Some(1)),
            ("reserve", None),
            ("produced", None)
        ],
        "{h}"
    );
}

#[test]
fn a_long_error_is_cut_at_a_character_boundary_and_an_empty_one_records_nothing() {
    let s = Server::start(&[]);
    s.produce("long", &json!({"id": "l", "body": "x"}));
    pop_and_nack(&s, "long", "l", Some(""));
    assert!(s.get("/v1/messages/l").1.get("last_error").is_none(), "an empty error is none");
    // 2047 ASCII bytes and then two-byte characters: the first one would end past 2048 bytes.
    let long = format!("{}{}", "x".repeat(2047), "é".repeat(500));
    pop_and_nack(&s, "long", "l", Some(&long));
    let kept = s.get("/v1/messages/l").1["last_error"]["message"].as_str().unwrap().to_string();
    assert_eq!(kept, "x".repeat(2047));
    let long = format!("{}{}", "é".repeat(1024), "tail");
    pop_and_nack(&s, "long", "l", Some(&long));
    let kept = s.get("/v1/messages/l").1["last_error"]["message"].as_str().unwrap().to_string();
    assert_eq!(kept, "é".repeat(1024), "2048 bytes exactly are kept whole");
    let (st, v) = s.post("/v1/nack", &json!({"receipt": "0".repeat(40), "error": 5}));
    Server::assert_error(st, &v, 400, "invalid_argument");
}
