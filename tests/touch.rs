//! `POST /v1/touch` against the real binary: a touched reservation is not redelivered at its old
//! end, comes back after its new one when not acked, keeps its receipt, and all of it survives
//! SIGKILL; a stale or unknown receipt is refused as ack refuses it.

mod common;

use std::time::{Duration, Instant};

use common::{now_ms, Server};
use serde_json::json;

#[test]
fn a_touched_reservation_ends_at_its_new_time_across_sigkill() {
    let mut s = Server::start(&[]);
    s.produce("long", &json!({"id": "a", "body": "a"}));
    s.produce("long", &json!({"id": "b", "body": "b"}));
    let (msgs, popped_at) = s.pop("long", 2, 5_000, Some(2_000));
    assert_eq!(msgs.len(), 2);
    let receipt = |id: &str| {
        msgs.iter().find(|m| m["id"] == id).expect("popped")["receipt"].as_str().unwrap().to_string()
    };
    let (ra, rb) = (receipt("a"), receipt("b"));
    let sent = now_ms();
    let mut expires = 0;
    for r in [&ra, &rb] {
        let (st, v) = s.post("/v1/touch", &json!({"receipt": r, "ttr_ms": 6_000}));
        assert_eq!(st, 200, "{v}");
        expires = v["expires_at_ms"].as_u64().expect("expires_at_ms");
        assert!(expires >= sent + 6_000 && expires <= now_ms() + 6_000, "{v}");
    }
    s.kill9();
    s.respawn();
    // Past the old end (2 s after the pop): nothing came back.
    let (early, at) = s.pop("long", 2, 3_000, None);
    assert!(early.is_empty(), "redelivered at {at}, the touch said {expires}: {early:?}");
    assert!(at >= popped_at + 2_500, "the wait covered the old end");
    // The receipt stayed valid across the touch and the restart.
    assert_eq!(s.ack(&ra), 200);
    let mut back = vec![];
    let until = Instant::now() + Duration::from_secs(15);
    while back.is_empty() && Instant::now() < until {
        let (m, at) = s.pop("long", 2, 1_000, None);
        back.extend(m.into_iter().map(|m| (m, at)));
    }
    assert_eq!(back.len(), 1, "{back:?}");
    let (m, at) = &back[0];
    assert_eq!((m["id"].as_str(), m["attempt"].as_u64()), (Some("b"), Some(2)));
    assert!(*at >= expires, "b came back at {at}, before its touched end {expires}");
    // The first delivery's receipt ended with it: touch refuses it as ack does.
    let (st, v) = s.post("/v1/touch", &json!({"receipt": rb, "ttr_ms": 1_000}));
    Server::assert_error(st, &v, 404, "not_found");
    let (st_ack, v_ack) = s.post("/v1/ack", &json!({"receipt": rb}));
    assert_eq!((st_ack, &v_ack["error"]["code"]), (404, &v["error"]["code"]));
    for bad in ["", "nope", "0123"] {
        let (st, v) = s.post("/v1/touch", &json!({"receipt": bad, "ttr_ms": 1_000}));
        let (st_ack, v_ack) = s.post("/v1/ack", &json!({"receipt": bad}));
        assert_eq!((st, &v["error"]["code"]), (st_ack, &v_ack["error"]["code"]), "{v} vs {v_ack}");
        assert!(st >= 400, "{v}");
    }
    let (st, v) = s.post("/v1/touch", &json!({"receipt": m["receipt"], "ttr_ms": 0}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.post("/v1/touch", &json!({"receipt": m["receipt"]}));
    assert_eq!(st, 400, "ttr_ms is required: {v}");
    let (_, metrics) = s.get_text("/metrics");
    assert!(metrics.lines().any(|l| l == "delayd_touched_total 0"), "counted since the restart only");
}
