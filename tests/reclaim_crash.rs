//! Reclaim under SIGKILL, on the real binary: kills land right after messages were carried forward
//! (before the segment they left is deleted) and right after segments were deleted, and nothing
//! acknowledged is lost, nothing acked comes back, nothing is delivered early.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{now_ms, Server};
use serde_json::json;

const SETTINGS: [(&str, &str); 4] = [
    ("DELAYD_SEGMENT_BYTES", "64KiB"),
    ("DELAYD_CQ_ENTRIES_PER_FILE", "64"),
    ("DELAYD_DONE_RETENTION", "1s"),
    ("DELAYD_MAX_BODY_BYTES", "8KiB"),
];

fn metric(s: &Server, name: &str) -> u64 {
    let (status, text) = s.get_text("/metrics");
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

fn body(id: &str) -> String {
    format!("{id} {}", ".".repeat(900))
}

/// Produces, pops and acks short-lived messages on `churn` until the counter `name` grows; returns
/// the ids whose ack got a 200.
///
/// Under this churn (hundreds of KiB a second into 64 KiB segments) reclaim frees about one
/// segment per checkpoint, since each deletion waits for a checkpoint captured after its decision;
/// the head catches up with the carried messages only in the burst right after a start, before
/// anything new is appended. A timer falling due at that moment (one planned by a carry made
/// right after the previous start is due one checkpoint interval later, when the next kill lands)
/// appends first and cuts the burst short. So when nothing happens for a while, kill once more
/// (another crash at an arbitrary point, which the checks after every cycle cover as well) and
/// hold the churn for a moment, so the burst after that start is not cut short by it either.
fn churn_until(s: &mut Server, next: &mut u64, acked: &mut HashSet<String>, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut since = Instant::now();
    let mut before = metric(s, name);
    while metric(s, name) <= before {
        assert!(Instant::now() < deadline, "reclaim did not act within 40 s; log:\n{}", s.log());
        if since.elapsed() > Duration::from_secs(12) {
            eprintln!("reclaim stuck behind the churn for 12 s: one more kill");
            s.restart();
            std::thread::sleep(Duration::from_secs(1));
            since = Instant::now();
            // A new process counts from zero.
            before = 0;
        }
        let msgs: Vec<_> = (0..20)
            .map(|_| {
                *next += 1;
                let id = format!("c-{next}");
                json!({"id": id, "body": body(&id)})
            })
            .collect();
        let (status, v) = s.post("/v1/topics/churn/messages/batch", &json!({ "messages": msgs }));
        assert!(status == 200 || status == 201, "batch -> {status} {v}");
        let (got, _) = s.pop("churn", 100, 0, None);
        for m in got {
            assert!(!acked.contains(m["id"].as_str().unwrap()), "acked message {m} delivered again");
            if s.ack(m["receipt"].as_str().unwrap()) == 200 {
                acked.insert(m["id"].as_str().unwrap().to_string());
            }
        }
    }
}

#[test]
fn sigkill_while_carrying_forward_and_deleting_segments_loses_nothing() {
    let mut s = Server::start(&SETTINGS);
    // The early segments hold messages that outlive them: far-off timers, timers due during the
    // test, and ready messages nobody pops yet.
    let mut due: HashMap<String, u64> = HashMap::new();
    for i in 0..120 {
        let (id, delay) = if i % 3 == 0 {
            (format!("soon-{i}"), 20_000 + i * 100)
        } else {
            (format!("far-{i}"), 3_600_000)
        };
        let v = s.produce("later", &json!({"id": id, "body": body(&id), "delay_ms": delay}));
        due.insert(id, v["deliver_at_ms"].as_u64().unwrap());
    }
    for i in 0..60 {
        let id = format!("idle-{i}");
        s.produce("idle", &json!({"id": id, "body": body(&id)}));
    }
    let mut acked = HashSet::new();
    let mut next = 0;
    let mut carried_seen = 0;
    let mut deleted_seen = 0;
    for cycle in 0..6 {
        // Odd cycles kill right after a carry (the old segment still exists, the checkpoint that
        // allows deleting it is at most five seconds away); even ones right after a deletion.
        let name = if cycle % 2 == 0 { "delayd_carried_total" } else { "delayd_segments_deleted_total" };
        churn_until(&mut s, &mut next, &mut acked, name);
        carried_seen += metric(&s, "delayd_carried_total");
        deleted_seen += metric(&s, "delayd_segments_deleted_total");
        s.restart();
        // Everything acknowledged is there, in the state it had, with its due time unchanged.
        for (id, at) in &due {
            let (status, v) = s.get(&format!("/v1/messages/{id}"));
            assert_eq!(status, 200, "{id} lost after kill {cycle}: {v}");
            if v["state"] == "delayed" {
                assert_eq!(v["deliver_at_ms"].as_u64(), Some(*at), "{id}: {v}");
            } else {
                assert_eq!(v["state"], "ready", "{id}: {v}");
                assert!(now_ms() >= *at, "{id} ready before its time: {v}");
            }
        }
        for i in 0..60 {
            let (status, v) = s.get(&format!("/v1/messages/idle-{i}"));
            assert_eq!(
                (status, v["state"].as_str()),
                (200, Some("ready")),
                "idle-{i} after kill {cycle}: {v}"
            );
        }
    }
    assert!(
        carried_seen > 0 && deleted_seen > 0,
        "reclaim ran: carried {carried_seen}, deleted {deleted_seen}"
    );
    let first = std::fs::read_dir(s.data_dir().join("commitlog"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .min()
        .unwrap();
    assert!(first > 0, "the oldest segments are gone");

    // Every message is delivered exactly once, never early: the idle ones now, the soon ones when due.
    let mut delivered = HashSet::new();
    let mut first_seen: HashMap<String, String> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let soon = due.keys().filter(|k| k.starts_with("soon-")).count();
    while delivered.len() < 60 + soon {
        assert!(Instant::now() < deadline, "only {} of {} delivered", delivered.len(), 60 + soon);
        for topic in ["idle", "later"] {
            let (got, at) = s.pop(topic, 100, 200, None);
            for m in got {
                let id = m["id"].as_str().unwrap().to_string();
                if let Some(d) = due.get(&id) {
                    assert!(at >= *d, "{id} delivered at {at}, due {d}");
                    assert!(id.starts_with("soon-"), "{id} delivered an hour early");
                }
                if !delivered.insert(id.clone()) {
                    let mut m2 = m.clone();
                    m2["body"] = json!("");
                    panic!("{id} delivered twice: {m2} first {}", first_seen[&id]);
                }
                let mut m2 = m.clone();
                m2["body"] = json!("");
                first_seen.insert(id.clone(), format!("{m2} at {at}"));
                assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
            }
        }
    }
    // And nothing acked before a kill ever came back on the churn topic.
    let (got, _) = s.pop("churn", 1000, 0, None);
    for m in got {
        assert!(!acked.contains(m["id"].as_str().unwrap()), "acked {m} came back");
    }
}

#[test]
fn done_ids_expire_after_done_retention_and_topics_are_capped() {
    let s = Server::start(&[("DELAYD_DONE_RETENTION", "2s"), ("DELAYD_MAX_TOPICS", "3")]);
    s.produce("t", &json!({"id": "order-1", "body": "first"}));
    let (got, _) = s.pop("t", 1, 0, None);
    assert_eq!(s.ack(got[0]["receipt"].as_str().unwrap()), 200);
    let (status, v) = s.get("/v1/messages/order-1");
    assert_eq!((status, v["state"].as_str()), (200, Some("done")));
    // Within the retention a retry with other content is a conflict; the same content is idempotent.
    let (status, _) = s.post("/v1/topics/t/messages", &json!({"id": "order-1", "body": "second"}));
    assert_eq!(status, 409);
    let (status, v) = s.post("/v1/topics/t/messages", &json!({"id": "order-1", "body": "first"}));
    assert_eq!(status, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _) = s.get("/v1/messages/order-1");
        if status == 404 {
            break;
        }
        assert!(Instant::now() < deadline, "order-1 still visible long after done_retention");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Forgotten: the same id is a new message with the new content.
    let (status, v) = s.post("/v1/topics/t/messages", &json!({"id": "order-1", "body": "second"}));
    assert_eq!(status, 201, "{v}");
    let (got, _) = s.pop("t", 10, 1000, None);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["body"], "second");
    assert_eq!(got[0]["attempt"], 1);

    // max_topics: "t" plus two more; the fourth is refused, an existing one still works.
    s.produce("u", &json!({"body": "x"}));
    s.produce("v", &json!({"body": "x"}));
    let (status, v) = s.post("/v1/topics/w/messages", &json!({"body": "x"}));
    Server::assert_error(status, &v, 429, "too_many_topics");
    s.produce("u", &json!({"body": "y"}));
}
