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
fn every_route_that_makes_a_topic_obeys_max_topics_across_a_restart() {
    let mut s = Server::start(&[("DELAYD_MAX_TOPICS", "3")]);
    let put_push = |s: &Server, topic: &str| {
        let r = s
            .http()
            .put(s.url(&format!("/v1/topics/{topic}/push")))
            .json(&json!({ "url": "http://127.0.0.1:9/hook" }))
            .send();
        common::answer(r)
    };
    s.produce("a", &json!({ "body": "x", "delay_ms": 3_600_000 }));
    assert_eq!(s.post("/v1/topics/b/pause", &json!({})).0, 200, "a second topic, by a pause");
    assert_eq!(put_push(&s, "c").0, 200, "a third, by a push subscription");
    for _ in 0..2 {
        let (st, v) = s.post("/v1/topics/d/pause", &json!({}));
        Server::assert_error(st, &v, 429, "too_many_topics");
        let (st, v) = put_push(&s, "e");
        Server::assert_error(st, &v, 429, "too_many_topics");
        let (st, v) = s.post("/v1/topics/f/messages", &json!({ "body": "x" }));
        Server::assert_error(st, &v, 429, "too_many_topics");
        // Topics that exist take every change.
        assert_eq!(s.post("/v1/topics/a/pause", &json!({})).0, 200);
        assert_eq!(s.post("/v1/topics/a/resume", &json!({})).0, 200);
        assert_eq!(put_push(&s, "a").0, 200);
        assert_eq!(s.post("/v1/topics/c/messages", &json!({ "body": "x", "delay_ms": 3_600_000 })).0, 201);
        assert_eq!(s.post("/v1/topics/b/messages", &json!({ "body": "x", "delay_ms": 3_600_000 })).0, 201);
        let (st, v) = s.delete("/v1/topics/a/push");
        assert_eq!(st, 200, "{v}");
        // The count is rebuilt from the log.
        s.restart();
    }
    let (_, v) = s.get("/v1/topics");
    let names: Vec<&str> =
        v["topics"].as_array().unwrap().iter().filter_map(|t| t["topic"].as_str()).collect();
    assert!(!names.contains(&"d") && !names.contains(&"e") && !names.contains(&"f"), "{names:?}");
}

#[test]
fn bad_topics_are_refused_with_the_json_shape() {
    let s = Server::start(&[]);
    // Any name is a topic; one longer than 128 bytes once escaped is not (`/` takes 3).
    for path in
        [format!("/v1/topics/{}/pause", "t".repeat(129)), format!("/v1/topics/{}/resume", "%2F".repeat(43))]
    {
        let (st, v) = s.post(&path, &json!({}));
        Server::assert_error(st, &v, 400, "invalid_argument");
    }
    // `..` and `/` percent-encoded name a topic like any other, stored escaped: no path is walked.
    let (st, v) = s.post("/v1/topics/%2E%2E%2Fx/pause", &json!({}));
    assert_eq!((st, &v), (200, &json!({"topic": "../x", "paused": true})));
    let (_, v) = s.get("/v1/topics");
    assert!(v["topics"].as_array().unwrap().iter().any(|t| t["topic"] == "../x"), "{v}");
    let (st, v) = s.get("/v1/topics/x/pause");
    Server::assert_error(st, &v, 405, "method_not_allowed");
}

/// Pages of `GET /v1/topics/{topic}/messages?state=...`, following `next_cursor` to the end.
fn browse_all(s: &Server, topic: &str, state: &str, limit: usize) -> (Vec<Value>, usize) {
    let (mut out, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
    loop {
        let mut path = format!("/v1/topics/{topic}/messages?state={state}&limit={limit}");
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let (st, v) = s.get(&path);
        assert_eq!(st, 200, "{path}: {v}");
        let page = v["messages"].as_array().expect("messages");
        assert!(page.len() <= limit, "{path}: more than the limit");
        out.extend(page.iter().cloned());
        pages += 1;
        match &v["next_cursor"] {
            Value::Null => return (out, pages),
            Value::String(c) => cursor = Some(c.clone()),
            other => panic!("next_cursor {other}"),
        }
    }
}

fn ids(msgs: &[Value]) -> Vec<String> {
    let mut v: Vec<String> = msgs.iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    v.sort();
    v
}

#[test]
fn browse_pages_through_each_state() {
    let s = Server::start(&[]);
    for i in 0..7 {
        s.produce("b", &json!({"id": format!("r{i}"), "body": format!("ready {i}")}));
        s.produce("b", &json!({"id": format!("d{i}"), "body": "later", "delay_ms": 3_600_000 + i * 1000}));
    }
    s.produce("other", &json!({"id": "o1", "body": "x", "delay_ms": 3_600_000}));
    s.produce("b", &json!({"id": "x1", "body": "dies", "max_attempts": 1}));
    eventually("ready", || counts(&s, "b").0 == 8);
    let (popped, _) = s.pop("b", 3, 5000, None);
    let dead = popped.iter().find(|m| m["id"] == "x1").cloned();
    let reserved: Vec<_> = popped.iter().filter(|m| m["id"] != "x1").cloned().collect();
    if let Some(x) = &dead {
        s.post("/v1/nack", &json!({"receipt": x["receipt"]}));
    }

    let (delayed, pages) = browse_all(&s, "b", "delayed", 3);
    assert_eq!(ids(&delayed), (0..7).map(|i| format!("d{i}")).collect::<Vec<_>>());
    assert!(pages >= 3, "7 delayed messages in pages of 3 took {pages} pages");
    let d3 = delayed.iter().find(|m| m["id"] == "d3").unwrap();
    assert_eq!((&d3["state"], &d3["attempt"], &d3["body"]), (&json!("delayed"), &json!(0), &json!("later")));
    assert!(d3["deliver_at_ms"].as_u64().unwrap() > common::now_ms());
    let (ready, _) = browse_all(&s, "b", "ready", 2);
    let (res, _) = browse_all(&s, "b", "reserved", 10);
    assert_eq!(ids(&res), ids(&reserved));
    // 7 r* and x1 were ready; 3 were popped (x1 maybe among them, then dead-lettered).
    assert_eq!(ready.len() + res.len() + usize::from(dead.is_some()), 8);
    assert!(ready.iter().all(|m| m["state"] == "ready"));
    let (dl, _) = browse_all(&s, "b", "dead", 10);
    assert_eq!(ids(&dl), if dead.is_some() { vec!["x1".to_string()] } else { vec![] });
    // Another topic's messages never show.
    assert!(browse_all(&s, "b", "delayed", 50).0.iter().all(|m| m["id"] != "o1"));
    assert!(browse_all(&s, "nothing-here", "ready", 5).0.is_empty());

    for (q, field) in [
        ("state=soon", "state"),
        ("limit=0", "limit"),
        ("limit=abc", "limit"),
        ("cursor=zz", "cursor"),
        ("cursor=1.", "cursor"),
        ("cursor=99.0&state=ready", "cursor"),
        ("colour=red", "colour"),
    ] {
        let (st, v) = s.get(&format!("/v1/topics/b/messages?{q}"));
        Server::assert_error(st, &v, 400, "invalid_argument");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.starts_with(&format!("invalid {field}")), "{q}: {v}");
    }
}

#[test]
fn redrive_moves_dead_letters_back_and_purge_cancels_a_topic() {
    let mut s = Server::start(&[]);
    // Redrive of an empty dead-letter topic moves nothing.
    assert_eq!(s.post("/v1/topics/jobs/redrive", &json!({})), (200, json!({"moved": 0})));
    for i in 0..4 {
        s.produce("jobs", &json!({"id": format!("j{i}"), "body": "b", "max_attempts": 1}));
    }
    let (popped, _) = s.pop("jobs", 4, 5000, None);
    assert_eq!(popped.len(), 4);
    for m in &popped {
        assert_eq!(s.post("/v1/nack", &json!({"receipt": m["receipt"]})).1["state"], "dead");
    }
    assert_eq!(counts(&s, "jobs").3, 4);
    // By ids: one moves; an unknown id and a live message are left alone.
    let (st, v) = s.post("/v1/topics/jobs/redrive", &json!({"ids": ["j1", "nope"]}));
    assert_eq!((st, v), (200, json!({"moved": 1})));
    let j1 = s.get("/v1/messages/j1").1;
    assert_eq!((&j1["state"], &j1["attempt"]), (&json!("ready"), &json!(0)), "{j1}");
    assert!(j1.get("dead_letter_topic").is_none(), "{j1}");
    // All the rest, with no body at all.
    let r = common::client().post(s.url("/v1/topics/jobs/redrive")).send().unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().unwrap(), json!({"moved": 3}));
    assert_eq!(counts(&s, "jobs"), (4, 0, 0, 0, false));
    let (again, _) = s.pop("jobs", 10, 5000, None);
    assert_eq!(again.len(), 4, "redriven messages are delivered again");
    assert!(again.iter().all(|m| m["attempt"] == 1), "attempts were reset");

    // Purge: everything not final in the topic, whatever its state.
    s.produce("jobs", &json!({"id": "later", "body": "b", "delay_ms": 3_600_000}));
    s.produce("jobs", &json!({"id": "now", "body": "b"}));
    eventually("now is ready", || s.get("/v1/messages/now").1["state"] == "ready");
    assert_eq!(s.ack(again[0]["receipt"].as_str().unwrap()), 200);
    let (st, v) = s.post("/v1/topics/jobs/purge", &json!({}));
    assert_eq!((st, v), (200, json!({"cancelled": 5})), "3 reserved, 1 delayed, 1 ready");
    assert_eq!(counts(&s, "jobs"), (0, 0, 0, 0, false));
    assert_eq!(s.get("/v1/messages/later").1["state"], "cancelled");
    assert_eq!(s.get(&format!("/v1/messages/{}", again[0]["id"].as_str().unwrap())).1["state"], "done");
    let (st, v) = s.post("/v1/ack", &json!({"receipt": again[1]["receipt"]}));
    Server::assert_error(st, &v, 404, "not_found");
    assert!(s.pop("jobs", 10, 300, None).0.is_empty());
    s.restart();
    assert_eq!(counts(&s, "jobs"), (0, 0, 0, 0, false));
    assert_eq!(s.get("/v1/messages/later").1["state"], "cancelled", "the purge is durable");
    // Bad bodies are refused.
    let (st, v) = s.post("/v1/topics/jobs/redrive", &json!({"ids": "j1"}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.post("/v1/topics/jobs/redrive", &json!({"idz": []}));
    Server::assert_error(st, &v, 400, "invalid_argument");
}
