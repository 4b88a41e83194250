//! `PATCH /v1/messages/{id}` against the real binary: a reschedule holds across SIGKILL, is never
//! early, never fires at the old time, delivers now when asked, and refuses what it must.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{answer, now_ms, Server};
use serde_json::{json, Value};

fn patch(s: &Server, id: &str, body: &Value) -> (u16, Value) {
    answer(s.http().patch(s.url(&format!("/v1/messages/{id}"))).json(body).send())
}

/// Pops `topic` until `want` messages came or `limit` passed; returns each id with the time the
/// pop answer that held it arrived.
fn pop_all(s: &Server, topic: &str, want: usize, limit: Duration) -> HashMap<String, u64> {
    let mut got = HashMap::new();
    let deadline = Instant::now() + limit;
    while got.len() < want && Instant::now() < deadline {
        let (msgs, at) = s.pop(topic, 10, 1000, None);
        for m in msgs {
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
            let id = m["id"].as_str().unwrap().to_string();
            assert!(got.insert(id.clone(), at).is_none(), "{id} delivered twice");
        }
    }
    got
}

/// Later, earlier and now, each one record: after a SIGKILL right after the answers, every
/// message comes at its new time, never before it, and the later one's old time (which passes
/// while the restarted broker runs) fires nothing.
#[test]
fn reschedules_survive_sigkill_and_are_never_early_nor_at_the_old_time() {
    let mut s = Server::start(&[]);
    let t0 = now_ms();
    s.produce("r", &json!({"id": "later", "body": "l", "delay_ms": 2_500}));
    s.produce("r", &json!({"id": "earlier", "body": "e", "delay_ms": 3_600_000}));
    s.produce("r", &json!({"id": "now", "body": "n", "delay_ms": 3_600_000}));
    let (st, later) = patch(&s, "later", &json!({"delay_ms": 7_000}));
    assert_eq!(st, 200, "{later}");
    assert_eq!(later["state"], "delayed");
    assert_eq!(later["id"], "later");
    let later_at = later["deliver_at_ms"].as_u64().unwrap();
    assert!(later_at >= t0 + 7_000, "{later}");
    let earlier_at = now_ms() + 4_000;
    let (st, earlier) = patch(&s, "earlier", &json!({"deliver_at_ms": earlier_at}));
    assert_eq!((st, earlier["deliver_at_ms"].as_u64()), (200, Some(earlier_at)), "{earlier}");
    let (st, now) = patch(&s, "now", &json!({"deliver_at_ms": 0}));
    assert_eq!((st, now["state"].as_str()), (200, Some("ready")), "{now}");

    s.kill9();
    s.respawn();
    for (id, at) in [("later", later_at), ("earlier", earlier_at)] {
        let (_, m) = s.get(&format!("/v1/messages/{id}"));
        assert_eq!((m["state"].as_str(), m["deliver_at_ms"].as_u64()), (Some("delayed"), Some(at)), "{m}");
    }
    let (_, h) = s.get("/v1/messages/later/history");
    assert_eq!(h["history"][0]["event"], "reschedule", "{h}");

    let got = pop_all(&s, "r", 3, Duration::from_secs(20));
    assert_eq!(got.len(), 3, "all three came back: {got:?}");
    assert!(got["later"] >= later_at, "later popped at {} before {later_at}", got["later"]);
    assert!(got["earlier"] >= earlier_at, "earlier popped at {} before {earlier_at}", got["earlier"]);
    assert!(got["earlier"] < t0 + 60_000, "earlier came near its new time, not its old one");
    assert!(got["now"] <= got["earlier"], "now came first");
    // Nothing more: the old timers of all three are stale.
    let (more, _) = s.pop("r", 10, 1_500, None);
    assert!(more.is_empty(), "{more:?}");
}

#[test]
fn refusals_and_force() {
    let s = Server::start(&[("DELAYD_DEFAULT_TTR", "1h")]);
    let (st, v) = patch(&s, "nope", &json!({"delay_ms": 1000}));
    Server::assert_error(st, &v, 404, "not_found");

    s.produce("f", &json!({"id": "done", "body": "d"}));
    let (m, _) = s.pop("f", 1, 0, None);
    assert_eq!(s.ack(m[0]["receipt"].as_str().unwrap()), 200);
    let (st, v) = patch(&s, "done", &json!({"delay_ms": 1000}));
    Server::assert_error(st, &v, 409, "conflict");

    s.produce("f", &json!({"id": "gone", "body": "g", "delay_ms": 60_000}));
    assert_eq!(s.delete("/v1/messages/gone").0, 200);
    let (st, v) = patch(&s, "gone", &json!({"delay_ms": 1000}));
    Server::assert_error(st, &v, 409, "conflict");

    s.produce("f", &json!({"id": "held", "body": "h"}));
    let (m, _) = s.pop("f", 1, 0, None);
    let receipt = m[0]["receipt"].as_str().unwrap().to_string();
    let (st, v) = patch(&s, "held", &json!({"deliver_at_ms": 0}));
    Server::assert_error(st, &v, 409, "conflict");
    assert!(v["error"]["message"].as_str().unwrap().contains("force"), "{v}");
    let (st, v) = patch(&s, "held", &json!({"deliver_at_ms": 0, "force": true}));
    assert_eq!((st, v["state"].as_str()), (200, Some("ready")), "{v}");
    assert_eq!(s.ack(&receipt), 404, "the forced-off consumer's receipt no longer works");
    let (m, _) = s.pop("f", 1, 0, None);
    assert_eq!(m[0]["id"], "held", "delivered again at once");
    let (_, metrics) = s.get_text("/metrics");
    assert!(metrics.lines().any(|l| l == "delayd_rescheduled_total 1"), "one reschedule counted");

    s.produce("f", &json!({"id": "x", "body": "x", "delay_ms": 60_000}));
    for bad in [
        json!({}),
        json!({"delay_ms": 1, "deliver_at_ms": 0}),
        json!({"deliver_at_ms": 1_795_660_000u64}),
        json!({"delay_ms": 1, "ttr_ms": 0}),
        json!({"delay_ms": 1, "max_attempts": 0}),
        json!({"delay_ms": 1, "dealy": 1}),
        json!({"delay_ms": 1u64 << 50}),
    ] {
        let (st, v) = patch(&s, "x", &bad);
        Server::assert_error(st, &v, 400, "invalid_argument");
    }
    let (_, m) = s.get("/v1/messages/x");
    assert_eq!(m["state"], "delayed", "a refused reschedule changed nothing: {m}");
}

/// `ttr_ms` and `max_attempts` replace the message's own: a one-second reservation that runs out
/// with no attempt left dead-letters it.
#[test]
fn new_ttr_and_max_attempts_apply_to_later_deliveries() {
    let s = Server::start(&[("DELAYD_DEFAULT_TTR", "1h")]);
    s.produce("k", &json!({"id": "k1", "body": "k", "delay_ms": 60_000}));
    let (st, v) = patch(&s, "k1", &json!({"deliver_at_ms": 0, "ttr_ms": 1_000, "max_attempts": 1}));
    assert_eq!(st, 200, "{v}");
    let (m, _) = s.pop("k", 1, 0, None);
    assert_eq!(m.len(), 1);
    let (msgs, _) = s.pop("k.dlq", 1, 10_000, None);
    assert_eq!(msgs.len(), 1, "its one-second reservation ran out and it was dead-lettered");
    assert_eq!(msgs[0]["id"], "k1");
}
