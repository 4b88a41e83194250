//! Topic operations (`/v1/topics`: counts and pause/resume) against the real binary.

mod common;

use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Value};

/// The entry for `topic` in `GET /v1/topics`, if listed.
fn topic(s: &Server, topic: &str) -> Option<Value> {
    let (st, v) = s.get("/v1/topics");
    assert_eq!(st, 200, "{v}");
    v["topics"].as_array().expect("topics array").iter().find(|t| t["topic"] == topic).cloned()
}

fn counts(s: &Server, name: &str) -> (u64, u64, u64, u64, bool) {
    let t = topic(s, name).unwrap_or_else(|| panic!("{name} not listed: {}", s.get("/v1/topics").1));
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} in {t}"));
    (n("ready"), n("reserved"), n("delayed"), n("dead_lettered"), t["paused"].as_bool().expect("paused"))
}

/// Waits until `f` holds, failing with `what` after a generous deadline (no timing asserted).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn topics_list_exact_counts_by_state_and_keep_them_across_a_kill() {
    let mut s = Server::start(&[]);
    let (st, v) = s.get("/v1/topics");
    assert_eq!((st, v), (200, json!({"topics": []})));
    for i in 0..3 {
        s.produce("orders", &json!({"id": format!("r{i}"), "body": "now"}));
    }
    for i in 0..4 {
        s.produce("orders", &json!({"id": format!("d{i}"), "body": "later", "delay_ms": 3_600_000}));
    }
    s.produce("jobs", &json!({"id": "j1", "body": "x", "max_attempts": 1}));
    eventually("3 ready in orders", || counts(&s, "orders").0 == 3);
    assert_eq!(counts(&s, "orders"), (3, 0, 4, 0, false));
    let (popped, _) = s.pop("orders", 2, 5000, None);
    let ids: Vec<&str> = popped.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["r0", "r1"], "a topic queue is read in order");
    assert_eq!(counts(&s, "orders"), (1, 2, 4, 0, false));
    assert_eq!(s.ack(popped[0]["receipt"].as_str().unwrap()), 200);
    assert_eq!(s.delete("/v1/messages/d0").0, 200);
    assert_eq!(s.delete("/v1/messages/r2").0, 200);
    // Acked and cancelled messages count nowhere at once, though their entries are still queued.
    assert_eq!(counts(&s, "orders"), (0, 1, 3, 0, false));
    // A dead-lettered message counts in its topic's dead_lettered and in the .dlq topic.
    let (j, _) = s.pop("jobs", 1, 5000, None);
    let (st, v) = s.post("/v1/nack", &json!({"receipt": j[0]["receipt"]}));
    assert_eq!((st, &v["state"]), (200, &json!("dead")), "{v}");
    assert_eq!(counts(&s, "jobs"), (0, 0, 0, 1, false));
    assert_eq!(counts(&s, "jobs.dlq"), (1, 0, 0, 0, false));

    let before: Vec<_> = ["orders", "jobs", "jobs.dlq"].iter().map(|t| counts(&s, t)).collect();
    s.restart();
    let after: Vec<_> = ["orders", "jobs", "jobs.dlq"].iter().map(|t| counts(&s, t)).collect();
    assert_eq!(before, after, "counts after kill -9 and restart");
    // /v1/stats agrees.
    let stats = s.get("/v1/stats").1;
    let o = stats["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "orders").unwrap().clone();
    assert_eq!(
        (o["ready"].as_u64(), o["reserved"].as_u64(), o["delayed"].as_u64()),
        (Some(0), Some(1), Some(3))
    );
}

#[test]
fn a_paused_topic_delivers_nothing_keeps_its_pause_across_a_kill_and_resumes() {
    let mut s = Server::start(&[]);
    s.produce("p", &json!({"id": "held", "body": "wait for it"}));
    s.produce("p", &json!({"id": "falls-due", "body": "soon", "delay_ms": 200}));
    s.produce("other", &json!({"id": "free", "body": "not paused"}));
    let (st, v) = s.post("/v1/topics/p/pause", &json!({}));
    assert_eq!((st, v), (200, json!({"topic": "p", "paused": true})));
    // Pausing again is fine and changes nothing.
    assert_eq!(s.post("/v1/topics/p/pause", &json!({})).0, 200);
    assert!(s.pop("p", 10, 300, None).0.is_empty(), "a paused topic delivered");
    assert_eq!(s.pop("other", 10, 5000, None).0.len(), 1, "other topics are not paused");
    // Its messages keep falling due meanwhile.
    eventually("falls-due becomes ready", || s.get("/v1/messages/falls-due").1["state"] == "ready");
    assert_eq!(counts(&s, "p"), (2, 0, 0, 0, true));
    // A topic can be paused before it has any message.
    assert_eq!(s.post("/v1/topics/ghost/pause", &json!({})).0, 200);

    s.restart();
    assert!(counts(&s, "p").4, "the pause survived kill -9");
    assert!(counts(&s, "ghost").4);
    assert!(s.pop("p", 10, 200, None).0.is_empty(), "a paused topic delivered after a restart");

    // A long poll waiting on the paused topic gets the messages once it is resumed.
    let url = s.url("/v1/topics/p/pop?max=10&wait_ms=20000");
    let waiter = std::thread::spawn(move || {
        let v: Value = common::client().post(url).send().unwrap().json().unwrap();
        v
    });
    std::thread::sleep(Duration::from_millis(300));
    let (st, v) = s.post("/v1/topics/p/resume", &json!({}));
    assert_eq!((st, v), (200, json!({"topic": "p", "paused": false})));
    // Not woken, the poll would have ended empty at its deadline.
    let v = waiter.join().unwrap();
    let mut ids: Vec<&str> =
        v["messages"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, ["falls-due", "held"], "{v}");
    s.restart();
    assert!(!counts(&s, "p").4, "resumed after a restart too");
}

#[test]
fn bad_topics_are_refused_with_the_json_shape() {
    let s = Server::start(&[]);
    for path in ["/v1/topics/bad%20name/pause", "/v1/topics/%2E%2E%2Fx/resume"] {
        let (st, v) = s.post(path, &json!({}));
        Server::assert_error(st, &v, 400, "invalid_argument");
    }
    let (st, v) = s.get("/v1/topics/x/pause");
    Server::assert_error(st, &v, 405, "method_not_allowed");
}
