//! Flow control per topic (`/v1/topics/{topic}/flow`) against the real binary: a rate limit holds
//! pops and push deliveries to it, never early; `max_reserved` caps reservations; the settings are
//! validated and survive SIGKILL.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use common::{now_ms, Server};
use serde_json::{json, Value};

/// The rate the measurements hold a topic to, per second.
const RATE: f64 = 50.0;

fn put_flow(s: &Server, topic: &str, body: Value) -> (u16, Value) {
    common::answer(s.http().put(s.url(&format!("/v1/topics/{topic}/flow"))).json(&body).send())
}

/// Produces `n` messages due at `due_ms`, in batches; returns each id's due time as stored.
fn produce_due(s: &Server, topic: &str, n: usize, due_ms: u64) -> HashMap<String, u64> {
    let mut due = HashMap::new();
    for chunk in 0..n.div_ceil(100) {
        let messages: Vec<Value> = (chunk * 100..n.min(chunk * 100 + 100))
            .map(|i| json!({"id": format!("{topic}-{i}"), "body": "b", "deliver_at_ms": due_ms}))
            .collect();
        let (st, v) = s.post(&format!("/v1/topics/{topic}/messages/batch"), &json!({"messages": messages}));
        assert_eq!(st, 201, "{v}");
        for r in v["results"].as_array().unwrap() {
            due.insert(r["id"].as_str().expect("stored").to_string(), r["deliver_at_ms"].as_u64().unwrap());
        }
    }
    due
}

/// The rate of the deliveries at `times` (unix ms) beyond the first `burst`: from the first
/// delivery on, a full bucket lets `burst` go at once and then refills at its rate, so
/// `(count - burst) / span` is the rate the limit held them to (a slow consumer can only lower it).
fn steady_rate(mut times: Vec<u64>, burst: usize) -> (f64, u64) {
    times.sort_unstable();
    let span = times[times.len() - 1] - times[0];
    ((times.len() - burst) as f64 * 1000.0 / span as f64, span)
}

fn throttled_seconds(s: &Server, topic: &str) -> f64 {
    let (_, text) = s.get_text("/metrics");
    let want = format!("delayd_topic_throttled_seconds_total{{limit=\"max_per_second\",topic=\"{topic}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {want} in /metrics"))
}

#[test]
fn pops_of_a_topic_limited_to_50_per_second_come_at_50_per_second_never_early() {
    let s = Server::start(&[]);
    let (st, v) = put_flow(&s, "slow", json!({"max_per_second": 50}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v,
        json!({"topic": "slow", "max_per_second": 50, "burst": 50, "updated_at_ms": v["updated_at_ms"]})
    );
    // Due a second from now: every one is ready long before the bucket lets it go.
    let due = produce_due(&s, "slow", 300, now_ms() + 1000);
    let mut times = Vec::new();
    let started = Instant::now();
    while times.len() < due.len() {
        assert!(started.elapsed() < Duration::from_secs(30), "only {} popped", times.len());
        let (got, at) = s.pop("slow", 20, 2000, None);
        for m in got {
            let id = m["id"].as_str().unwrap();
            assert!(at >= due[id], "{id} popped at {at}, before its due time {}", due[id]);
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
            times.push(at);
        }
    }
    let (rate, span) = steady_rate(times, 50);
    assert!(span >= 4000, "measured over {span} ms only");
    println!("pops: {rate:.2}/s beyond the burst, over {span} ms");
    assert!((rate - RATE).abs() <= 5.0, "pops came at {rate:.1}/s, not 50 ± 5");
    let throttled = throttled_seconds(&s, "slow");
    assert!(
        throttled >= 3.0 && throttled <= span as f64 / 1000.0 + 2.0,
        "throttled {throttled} s over {span} ms"
    );
}

/// One webhook request: when it came and which message.
type Hits = Arc<Mutex<Vec<(u64, String)>>>;

fn receiver() -> (Hits, String) {
    let hits: Hits = Arc::default();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let h = hits.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let app = axum::Router::new().fallback(move |headers: HeaderMap| {
                let h = h.clone();
                async move {
                    let id = headers.get("delayd-message-id").and_then(|v| v.to_str().ok()).unwrap_or("");
                    h.lock().unwrap().push((now_ms(), id.to_string()));
                    "ok"
                }
            });
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    (hits, format!("http://{addr}/hook"))
}

#[test]
fn push_deliveries_of_a_topic_limited_to_50_per_second_come_at_50_per_second_never_early() {
    let s = Server::start(&[]);
    let (hits, url) = receiver();
    assert_eq!(put_flow(&s, "hooked", json!({"max_per_second": 50})).0, 200);
    let (st, v) = common::answer(
        s.http().put(s.url("/v1/topics/hooked/push")).json(&json!({"url": url, "max_in_flight": 32})).send(),
    );
    assert_eq!(st, 200, "{v}");
    let due = produce_due(&s, "hooked", 300, now_ms() + 1000);
    let started = Instant::now();
    while hits.lock().unwrap().len() < due.len() {
        assert!(started.elapsed() < Duration::from_secs(30), "only {} delivered", hits.lock().unwrap().len());
        std::thread::sleep(Duration::from_millis(50));
    }
    let hits = hits.lock().unwrap().clone();
    for (at, id) in &hits {
        assert!(*at >= due[id], "{id} pushed at {at}, before its due time {}", due[id]);
    }
    let ids: std::collections::HashSet<&String> = hits.iter().map(|(_, id)| id).collect();
    assert_eq!(ids.len(), due.len(), "each message pushed once");
    let (rate, span) = steady_rate(hits.iter().map(|(at, _)| *at).collect(), 50);
    assert!(span >= 4000, "measured over {span} ms only");
    println!("pushes: {rate:.2}/s beyond the burst, over {span} ms");
    assert!((rate - RATE).abs() <= 5.0, "pushes came at {rate:.1}/s, not 50 ± 5");
}

#[test]
fn max_reserved_caps_reservations_and_a_waiting_pop_gets_the_room_an_ack_makes() {
    let s = Server::start(&[]);
    assert_eq!(put_flow(&s, "capped", json!({"max_reserved": 3})).0, 200);
    produce_due(&s, "capped", 10, now_ms());
    let (got, _) = s.pop("capped", 10, 0, None);
    assert_eq!(got.len(), 3, "{got:?}");
    let (none, _) = s.pop("capped", 10, 0, None);
    assert!(none.is_empty(), "{none:?}");
    // A long poll waits for room, and finds it soon after an ack.
    let base = s.base.clone();
    let waiter = std::thread::spawn(move || {
        let c = common::client();
        let t = Instant::now();
        let (_, v) =
            common::answer(c.post(format!("{base}/v1/topics/capped/pop?max=10&wait_ms=10000")).send());
        (v["messages"].as_array().unwrap().len(), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(s.ack(got[0]["receipt"].as_str().unwrap()), 200);
    let (n, waited) = waiter.join().unwrap();
    assert_eq!(n, 1, "one place freed, one message");
    assert!(waited >= Duration::from_millis(400) && waited < Duration::from_secs(3), "waited {waited:?}");
    let (_, topics) = s.get("/v1/topics");
    let t = topics["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "capped").unwrap().clone();
    assert_eq!(t["reserved"], 3, "{t}");
    assert_eq!(t["flow"]["max_reserved"], 3, "{t}");
}

#[test]
fn settings_are_validated_and_survive_sigkill_and_delete_removes_them() {
    let mut s = Server::start(&[]);
    assert_eq!(s.get("/v1/topics/t/flow").0, 404);
    assert_eq!(s.delete("/v1/topics/t/flow").0, 404);
    for (body, field) in [
        (json!({}), "max_per_second"),
        (json!({"max_per_second": 0}), "max_per_second"),
        (json!({"max_per_second": 1_000_001}), "max_per_second"),
        (json!({"max_per_second": -1}), ""),
        (json!({"max_per_second": "5"}), ""),
        (json!({"burst": 5}), "burst"),
        (json!({"max_per_second": 5, "burst": 0}), "burst"),
        (json!({"max_reserved": 0}), "max_reserved"),
        (json!({"max_reserved": 5, "rate": 1}), ""),
    ] {
        let (st, v) = put_flow(&s, "t", body.clone());
        assert_eq!(st, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(field), "{body}: {v}");
    }
    assert_eq!(s.get("/v1/topics/t/flow").0, 404, "nothing refused was stored");
    let (st, set) = put_flow(&s, "t", json!({"max_per_second": 7, "burst": 2, "max_reserved": 2}));
    assert_eq!(st, 200, "{set}");
    assert_eq!(
        (set["max_per_second"].clone(), set["burst"].clone(), set["max_reserved"].clone()),
        (json!(7), json!(2), json!(2))
    );
    // A compat name too: stored escaped, shown and found as written.
    assert_eq!(put_flow(&s, "order%3Aclose", json!({"max_reserved": 1})).1["topic"], "order:close");
    produce_due(&s, "t", 5, now_ms());
    s.kill9();
    s.respawn();
    assert_eq!(s.get("/v1/topics/t/flow"), (200, set.clone()), "the same settings after SIGKILL");
    assert_eq!(s.get("/v1/topics/order%3Aclose/flow").1["max_reserved"], 1);
    assert_eq!(s.pop("t", 10, 0, None).0.len(), 2, "still capped, and the burst is 2");
    assert_eq!(s.delete("/v1/topics/t/flow").0, 200);
    s.kill9();
    s.respawn();
    assert_eq!(s.get("/v1/topics/t/flow").0, 404, "removed for good");
    assert_eq!(s.pop("t", 10, 0, None).0.len(), 3, "no cap once removed");
}
