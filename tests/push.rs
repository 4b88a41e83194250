//! Push delivery to a webhook, against the real binary and a real local receiver.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::{now_ms, Server};
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Got {
    at_ms: u64,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

/// How the receiver answers a request, by its `Delayd-Message-Id` and `Delayd-Attempt`.
type Answer = dyn Fn(&str, u32) -> (StatusCode, Duration) + Send + Sync;

#[derive(Clone)]
struct Receiver {
    got: Arc<Mutex<Vec<Got>>>,
    answer: Arc<Mutex<Arc<Answer>>>,
    /// The body of every answer.
    body: Arc<Mutex<String>>,
}

impl Receiver {
    /// Starts a webhook receiver on a free 127.0.0.1 port, on its own runtime thread; returns it
    /// and its URL.
    fn start() -> (Receiver, String) {
        Receiver::start_on(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
    }

    /// Starts a webhook receiver on `listener`.
    fn start_on(listener: std::net::TcpListener) -> (Receiver, String) {
        let r = Receiver {
            got: Arc::default(),
            answer: Arc::new(Mutex::new(Arc::new(|_: &str, _: u32| (StatusCode::OK, Duration::ZERO)))),
            body: Arc::default(),
        };
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let state = r.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let app = axum::Router::new().fallback(receive).with_state(state);
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(l, app).await.unwrap();
            });
        });
        (r, format!("http://{addr}/hook"))
    }

    fn answer(&self, f: impl Fn(&str, u32) -> (StatusCode, Duration) + Send + Sync + 'static) {
        *self.answer.lock().unwrap() = Arc::new(f);
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    fn for_id(&self, id: &str) -> Vec<Got> {
        self.got().into_iter().filter(|g| g.headers["delayd-message-id"] == id).collect()
    }

    fn wait(&self, what: &str, mut done: impl FnMut(&[Got]) -> bool) -> Vec<Got> {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let got = self.got();
            if done(&got) {
                return got;
            }
            assert!(Instant::now() < deadline, "never: {what}; got {} requests", got.len());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> (StatusCode, String) {
    let headers: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect();
    let id = headers.get("delayd-message-id").cloned().unwrap_or_default();
    let attempt = headers.get("delayd-attempt").and_then(|a| a.parse().ok()).unwrap_or(0);
    r.got.lock().unwrap().push(Got { at_ms: now_ms(), headers, body: body.to_vec() });
    let answer = r.answer.lock().unwrap().clone();
    let (status, wait) = answer(&id, attempt);
    tokio::time::sleep(wait).await;
    let body = r.body.lock().unwrap().clone();
    (status, body)
}

fn subscribe(s: &Server, topic: &str, body: Value) -> Value {
    let c = s.http();
    let r = c.put(s.url(&format!("/v1/topics/{topic}/push"))).json(&body).send().unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

fn state(s: &Server, id: &str) -> Value {
    s.get(&format!("/v1/messages/{id}")).1
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(40);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn each_due_message_is_posted_once_with_exact_body_and_headers_and_a_valid_signature() {
    let s = Server::start(&[]);
    let (rx, url) = Receiver::start();
    let v = subscribe(&s, "orders", json!({"url": url, "secret": "whsec_test", "timeout_ms": 5000}));
    assert_eq!(
        v,
        json!({"topic": "orders", "url": url, "has_secret": true, "timeout_ms": 5000, "max_in_flight": 16,
               "created_at_ms": v["created_at_ms"], "last_success_ms": null, "last_error": null,
               "consecutive_failures": 0, "delivered_1m": 0, "failed_1m": 0})
    );
    assert!(v.get("secret").is_none());
    let bodies = ["{\"order\":1}", "plain text, ünïcödé ✓", ""];
    let mut produced = vec![];
    for (i, b) in bodies.iter().enumerate() {
        let p = s.produce("orders", &json!({"id": format!("o{i}"), "body": b, "delay_ms": 300 * i as u64}));
        produced.push(p);
    }
    let got = rx.wait("three deliveries", |g| g.len() >= 3);
    eventually("all done", || (0..3).all(|i| state(&s, &format!("o{i}"))["state"] == "done"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rx.got().len(), 3, "a message was posted twice: {:?}", rx.got());
    let (_, metrics) = s.get_text("/metrics");
    assert!(
        metrics.lines().any(|l| l == "delayd_push_attempts_total{outcome=\"ok\",topic=\"orders\"} 3"),
        "{metrics}"
    );
    for (i, b) in bodies.iter().enumerate() {
        let id = format!("o{i}");
        let g = got.iter().find(|g| g.headers["delayd-message-id"] == id).expect("delivered");
        assert_eq!(g.body, b.as_bytes(), "{id}: body byte for byte");
        let due = produced[i]["deliver_at_ms"].as_u64().unwrap();
        assert_eq!(g.headers["delayd-topic"], "orders");
        assert_eq!(g.headers["delayd-attempt"], "1");
        assert_eq!(g.headers["delayd-deliver-at"], due.to_string());
        assert!(g.at_ms >= due, "{id} posted at {} before its due time {due}", g.at_ms);
        assert!(g.headers["user-agent"].starts_with("delayd/"), "{:?}", g.headers);
        // Verify the signature as a receiver would.
        let sig = &g.headers["delayd-signature"];
        let (t, v1) = sig.strip_prefix("t=").and_then(|r| r.split_once(",v1=")).expect("t=..,v1=..");
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(b"whsec_test").unwrap();
        mac.update(format!("{t}.").as_bytes());
        mac.update(&g.body);
        let want: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(v1, want, "{id}: signature");
        let t: u64 = t.parse().unwrap();
        assert!(t <= g.at_ms && t + 60_000 > g.at_ms, "{id}: signature time {t} vs arrival {}", g.at_ms);
    }
}

/// The subscription of `topic` as `GET /v1/topics/{topic}/push` shows it.
fn push_of(s: &Server, topic: &str) -> Value {
    let (status, v) = s.get(&format!("/v1/topics/{topic}/push"));
    assert_eq!(status, 200, "{v}");
    v
}

/// Lines of `log` that contain `what`.
fn lines_with(log: &str, what: &str) -> usize {
    log.lines().filter(|l| l.contains(what)).count()
}

#[test]
fn push_health_shows_failures_and_recovery_and_the_log_stays_small_and_secret_free() {
    const SECRET: &str = "whsec_never_logged_7c1f93";
    // Debug level: the secret must not appear even there, and per-attempt lines stay below INFO.
    let s = Server::start(&[("DELAYD_LOG_LEVEL", "debug")]);
    // A port nobody listens on: bind one, note it, close it (the receiver takes it back later).
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let url = format!("http://{addr}/hook?token=in-the-query");
    subscribe(&s, "flaky", json!({"url": url, "secret": SECRET, "timeout_ms": 500}));
    let started = now_ms();
    let produce = |n: usize, tag: &str| {
        for i in 0..n {
            s.produce(
                "flaky",
                &json!({"id": format!("{tag}{i}"), "body": "x", "max_attempts": 3, "backoff": [50, 50]}),
            );
        }
    };
    produce(20, "a");
    // 20 messages, 3 attempts each: 60 failures within seconds.
    eventually("60 failures", || push_of(&s, "flaky")["consecutive_failures"] == 60);
    let v = push_of(&s, "flaky");
    assert_eq!(v["last_success_ms"], Value::Null, "{v}");
    assert_eq!((v["failed_1m"].as_u64(), v["delivered_1m"].as_u64()), (Some(60), Some(0)), "{v}");
    let message = v["last_error"]["message"].as_str().unwrap();
    assert!(message.starts_with("connection error") && message.contains("refused"), "{message}");
    let at = v["last_error"]["time_ms"].as_u64().unwrap();
    assert!(at >= started && at <= now_ms(), "{v}");

    // The endpoint comes up, refusing with a long multi-line answer: the message says the status
    // and the start of the answer, cut and on one line.
    let (rx, _) = Receiver::start_on(std::net::TcpListener::bind(addr).unwrap());
    rx.answer(|_, _| (StatusCode::SERVICE_UNAVAILABLE, Duration::ZERO));
    *rx.body.lock().unwrap() = format!("overloaded\r\nretry later {}", "z".repeat(1000));
    produce(1, "b");
    eventually("a 503 recorded", || {
        push_of(&s, "flaky")["last_error"]["message"].as_str().unwrap().contains("503")
    });
    let v = push_of(&s, "flaky");
    let message = v["last_error"]["message"].as_str().unwrap();
    assert!(message.starts_with("HTTP 503 Service Unavailable: overloaded retry later zzz"), "{message}");
    assert!(message.chars().count() <= 240, "{} chars: {message}", message.chars().count());
    assert!(v["consecutive_failures"].as_u64().unwrap() > 60, "{v}");

    // Then it accepts: the failures in a row reset, the success is stamped.
    rx.answer(|_, _| (StatusCode::OK, Duration::ZERO));
    rx.body.lock().unwrap().clear();
    produce(3, "c");
    eventually("recovered", || {
        let v = push_of(&s, "flaky");
        v["consecutive_failures"] == 0 && v["delivered_1m"].as_u64() >= Some(3)
    });
    let v = push_of(&s, "flaky");
    let ok_at = v["last_success_ms"].as_u64().expect("a success time");
    assert!(ok_at >= at && ok_at <= now_ms(), "{v}");
    assert!(v["failed_1m"].as_u64() > Some(60), "failures of the last minute stay counted: {v}");
    assert!(v["last_error"]["message"].as_str().unwrap().contains("503"), "the last error stays shown: {v}");

    let log = s.log();
    assert_eq!(lines_with(&log, "push deliveries started failing"), 1, "{log}");
    // The test runs well under two minutes: at most one reminder.
    assert!(lines_with(&log, "push deliveries still failing") <= 1, "{log}");
    assert_eq!(lines_with(&log, "push deliveries recovered"), 1, "{log}");
    let loud: Vec<&str> = log
        .lines()
        .filter(|l| (l.contains(" WARN ") || l.contains(" INFO ")) && l.contains("delayd::push"))
        .collect();
    assert!(loud.len() <= 4, "more than a few push lines at INFO or above for 60+ failures: {loud:#?}");
    assert!(loud.iter().all(|l| !l.contains("in-the-query")), "a URL's query is logged: {loud:#?}");
    assert!(!log.contains(SECRET), "the push secret is in the log");
}

#[test]
fn failed_deliveries_follow_the_backoff_and_dead_letter_after_max_attempts() {
    let s = Server::start(&[]);
    let (rx, url) = Receiver::start();
    // 500, then a redirect (not followed: also a failure), then a timeout.
    rx.answer(|_, attempt| match attempt {
        1 => (StatusCode::INTERNAL_SERVER_ERROR, Duration::ZERO),
        2 => (StatusCode::FOUND, Duration::ZERO),
        _ => (StatusCode::OK, Duration::from_secs(3)),
    });
    subscribe(&s, "jobs", json!({"url": url, "timeout_ms": 500}));
    s.produce("jobs", &json!({"id": "j", "body": "x", "max_attempts": 3, "backoff": [400, 800]}));
    let got = rx.wait("three attempts", |g| g.len() >= 3);
    let attempts: Vec<&str> = got.iter().map(|g| g.headers["delayd-attempt"].as_str()).collect();
    assert_eq!(attempts, ["1", "2", "3"]);
    // Never early: each retry waits at least its backoff step after the failed attempt.
    assert!(got[1].at_ms >= got[0].at_ms + 400, "second attempt after {} ms", got[1].at_ms - got[0].at_ms);
    assert!(got[2].at_ms >= got[1].at_ms + 800, "third attempt after {} ms", got[2].at_ms - got[1].at_ms);
    eventually("j dead-lettered", || state(&s, "j")["state"] == "dead");
    let (_, metrics) = s.get_text("/metrics");
    for line in [
        "delayd_push_attempts_total{outcome=\"refused\",topic=\"jobs\"} 2",
        "delayd_push_attempts_total{outcome=\"failed\",topic=\"jobs\"} 1",
        "delayd_push_in_flight{topic=\"jobs\"} 0",
        "delayd_push_duration_seconds_count{topic=\"jobs\"} 3",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line:?} in /metrics");
    }
    let j = state(&s, "j");
    assert_eq!(j["dead_letter_topic"], "jobs.dlq");
    // The failure that killed it stays with the dead letter; each failure is in its history.
    let e = &j["last_error"];
    assert_eq!(
        (e["attempt"].as_u64(), e["message"].as_str()),
        (Some(3), Some("timeout: no answer within 500ms"))
    );
    assert!(e["time_ms"].as_u64().unwrap() >= got[2].at_ms, "{j}");
    let (_, h) = s.get("/v1/messages/j/history");
    let errors: Vec<(u64, String)> = h["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|ev| {
            Some((ev["last_error"]["attempt"].as_u64()?, ev["last_error"]["message"].as_str()?.into()))
        })
        .collect();
    assert_eq!(errors.len(), 3, "{h}");
    assert!(errors[2].0 == 1 && errors[2].1.starts_with("HTTP 500"), "{errors:?}");
    assert!(errors[1].0 == 2 && errors[1].1.starts_with("HTTP 302"), "{errors:?}");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rx.got().len(), 3, "a dead letter is not pushed again (jobs.dlq has no subscription)");
}

#[test]
fn a_kill_with_deliveries_in_flight_loses_none_and_the_subscription_survives() {
    let mut s = Server::start(&[]);
    let (rx, url) = Receiver::start();
    // Hold every request: the deliveries are in flight when delayd is killed.
    rx.answer(|_, _| (StatusCode::OK, Duration::from_secs(60)));
    subscribe(&s, "k", json!({"url": url, "timeout_ms": 1000, "max_in_flight": 8}));
    for i in 0..5 {
        s.produce("k", &json!({"id": format!("k{i}"), "body": format!("{i}")}));
    }
    rx.wait("five deliveries in flight", |g| g.len() >= 5);
    s.kill9();
    rx.answer(|_, _| (StatusCode::OK, Duration::ZERO));
    s.respawn();
    let (st, v) = s.get("/v1/topics/k/push");
    assert_eq!((st, &v["url"]), (200, &json!(url)), "{v}");
    eventually("every message done after the restart", || {
        (0..5).all(|i| state(&s, &format!("k{i}"))["state"] == "done")
    });
    for i in 0..5 {
        let tries = rx.for_id(&format!("k{i}"));
        assert!(tries.len() >= 2, "k{i} was delivered again after the kill: {tries:?}");
        assert_eq!(tries.last().unwrap().headers["delayd-attempt"], "2");
    }
}

#[test]
fn a_slow_endpoint_does_not_hold_up_another_topic() {
    let s = Server::start(&[]);
    let (slow_rx, slow_url) = Receiver::start();
    let (fast_rx, fast_url) = Receiver::start();
    slow_rx.answer(|_, _| (StatusCode::OK, Duration::from_secs(20)));
    subscribe(&s, "slow", json!({"url": slow_url, "timeout_ms": 30000, "max_in_flight": 2}));
    subscribe(&s, "fast", json!({"url": fast_url}));
    for i in 0..6 {
        s.produce("slow", &json!({"id": format!("s{i}"), "body": "s"}));
    }
    slow_rx.wait("two slow deliveries", |g| g.len() >= 2);
    for i in 0..20 {
        s.produce("fast", &json!({"id": format!("f{i}"), "body": "f"}));
    }
    fast_rx.wait("all fast deliveries", |g| g.len() >= 20);
    eventually("fast ones done", || (0..20).all(|i| state(&s, &format!("f{i}"))["state"] == "done"));
    assert_eq!(slow_rx.got().len(), 2, "max_in_flight 2 was exceeded on the slow topic");
}

#[test]
fn subscriptions_are_validated_shown_without_the_secret_and_removed() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", "tok")]);
    let c = s.http();
    let put = |body: Value| {
        let r = c.put(s.url("/v1/topics/t/push")).bearer_auth("tok").json(&body).send().unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    };
    for (body, field) in [
        (json!({}), "url"),
        (json!({"url": "ftp://x/y"}), "url"),
        (json!({"url": "not a url"}), "url"),
        (json!({"url": "http://user:pw@host/"}), "url"),
        (json!({"url": "http://h/", "timeout_ms": 0}), "timeout_ms"),
        (json!({"url": "http://h/", "max_in_flight": 0}), "max_in_flight"),
        (json!({"url": "http://h/", "secret": ""}), "secret"),
        (json!({"url": "http://h/", "colour": "red"}), "colour"),
        (json!({"nats": {"url": "http://h:4222", "subject": "a.b"}}), "nats.url"),
        (json!({"nats": {"url": "nats://h:4222", "subject": "a.*"}}), "nats.subject"),
        (json!({"nats": {"url": "nats://h:4222", "subject": "a..b"}}), "nats.subject"),
        (json!({"nats": {"url": "nats://h:4222", "subject": "a.b"}, "url": "http://h/"}), "url"),
        (json!({"nats": {"url": "nats://h:4222", "subject": "a.b"}, "secret": "s"}), "secret"),
    ] {
        let (st, v) = put(body.clone());
        Server::assert_error(st, &v, 400, "invalid_argument");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{body}: {v}");
    }
    let (st, v) = put(json!({"url": "https://example.invalid/hook", "secret": "s3"}));
    assert_eq!(st, 200, "{v}");
    assert!(!v.to_string().contains("s3\""), "the secret is shown: {v}");
    let unauth = c.get(s.url("/v1/topics/t/push")).send().unwrap().status().as_u16();
    assert_eq!(unauth, 401);
    let del = |_: ()| {
        let r = c.delete(s.url("/v1/topics/t/push")).bearer_auth("tok").send().unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    };
    assert_eq!(del(()), (200, json!({"topic": "t", "removed": true})));
    let (st, v) = del(());
    Server::assert_error(st, &v, 404, "not_found");
    let r = c.get(s.url("/v1/topics/t/push")).bearer_auth("tok").send().unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

#[test]
fn push_allowed_hosts_limits_where_deliveries_may_go() {
    let s = Server::start(&[("DELAYD_PUSH_ALLOWED_HOSTS", "hooks.example 127.0.0.1")]);
    let c = s.http();
    let put = |url: &str| {
        let r = c.put(s.url("/v1/topics/t/push")).json(&json!({"url": url})).send().unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    };
    assert_eq!(put("https://HOOKS.example/x").0, 200);
    assert_eq!(put("http://127.0.0.1:9/x").0, 200);
    for url in ["http://169.254.169.254/latest/meta-data", "http://localhost/", "http://hooks.example.evil/"]
    {
        let (st, v) = put(url);
        Server::assert_error(st, &v, 400, "invalid_argument");
        assert!(v["error"]["message"].as_str().unwrap().contains("push_allowed_hosts"), "{url}: {v}");
    }
}

/// A webhook that accepts every connection and never answers: each delivery to it holds a socket
/// until its timeout. Counts the connections open now and the most open at once.
struct Silent {
    url: String,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl Silent {
    fn start() -> Silent {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let most2 = most.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                use tokio::io::AsyncReadExt;
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (mut stream, _) = l.accept().await.unwrap();
                    let (open, most) = (open.clone(), most2.clone());
                    tokio::spawn(async move {
                        // Counted a moment after the accept: the end of a connection delayd
                        // closed just before opening this one may not have been read yet.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        // Read (and ignore) the request; the connection ends when delayd closes it.
                        let mut buf = [0u8; 4096];
                        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                        open.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
        });
        Silent { url, most }
    }

    fn most(&self) -> usize {
        self.most.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Sum of `delayd_push_in_flight` over every topic, and `delayd_push_in_flight_limit`.
fn in_flight(s: &Server) -> (i64, Option<i64>) {
    let (_, metrics) = s.get_text("/metrics");
    let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<i64>().ok()).unwrap_or(0);
    let sum = metrics.lines().filter(|l| l.starts_with("delayd_push_in_flight{")).map(value).sum();
    let limit = metrics.lines().find(|l| l.starts_with("delayd_push_in_flight_limit ")).map(value);
    (sum, limit)
}

#[test]
fn max_in_flight_above_max_batch_still_delivers() {
    // max_batch 10 with the default max_in_flight of 16: each pop used to ask for 16 and be
    // refused, forever.
    let s = Server::start(&[("DELAYD_MAX_BATCH", "10")]);
    let (rx, url) = Receiver::start();
    assert_eq!(subscribe(&s, "small", json!({"url": url}))["max_in_flight"], 16);
    for i in 0..30 {
        s.produce("small", &json!({"id": format!("m{i}"), "body": "x"}));
    }
    rx.wait("30 deliveries with max_batch 10", |g| g.len() >= 30);
    eventually("all 30 done", || (0..30).all(|i| state(&s, &format!("m{i}"))["state"] == "done"));
    drop(s);

    // The documented maximum, 1024, with the default max_batch (1000).
    let s = Server::start(&[]);
    let (rx, url) = Receiver::start();
    subscribe(&s, "wide", json!({"url": url, "max_in_flight": 1024}));
    for i in 0..5 {
        s.produce("wide", &json!({"id": format!("w{i}"), "body": "x"}));
    }
    rx.wait("5 deliveries with max_in_flight 1024", |g| g.len() >= 5);
    eventually("all 5 done", || (0..5).all(|i| state(&s, &format!("w{i}"))["state"] == "done"));
    assert!(!s.log().contains("push cannot take due messages"), "{}", s.log());
}

#[test]
fn deliveries_in_flight_are_bounded_process_wide_and_a_healthy_topic_still_delivers() {
    const CAP: usize = 4;
    const DEAD: usize = 12;
    const HEALTHY: usize = 20;
    let s = Server::start(&[("DELAYD_PUSH_MAX_IN_FLIGHT", "4")]);
    let silent = Silent::start();
    let (rx, url) = Receiver::start();
    // Twelve topics whose endpoint never answers, each allowed 16 deliveries at once, each with
    // four messages due now: 48 sockets without a process-wide bound.
    for t in 0..DEAD {
        let topic = format!("dead{t}");
        subscribe(&s, &topic, json!({"url": silent.url, "timeout_ms": 2000}));
        for i in 0..4 {
            s.produce(
                &topic,
                &json!({"id": format!("d{t}-{i}"), "body": "x", "backoff": [100], "max_attempts": 1000}),
            );
        }
    }
    // A healthy topic gets a slot whenever one is freed, ahead of topics that hold more: its 20
    // deliveries do not each wait behind all twelve silent topics' timeouts (20 x 12 / 4 x 2 s).
    subscribe(&s, "healthy", json!({"url": url}));
    for i in 0..HEALTHY {
        s.produce("healthy", &json!({"id": format!("h{i}"), "body": "x"}));
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(30);
    loop {
        let (now, limit) = in_flight(&s);
        assert_eq!(limit, Some(CAP as i64));
        assert!(now <= CAP as i64, "{now} deliveries in flight, more than push_max_in_flight {CAP}");
        assert!(silent.most() <= CAP, "{} connections open at once to the silent endpoint", silent.most());
        let healthy_done =
            rx.got().len() >= HEALTHY && (0..HEALTHY).all(|i| state(&s, &format!("h{i}"))["state"] == "done");
        if healthy_done && started.elapsed() > Duration::from_secs(5) {
            break;
        }
        assert!(Instant::now() < deadline, "the healthy topic starved: {:?}", rx.got().len());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The bound was reached, not merely never approached.
    assert!(silent.most() >= CAP - 1, "at most {} connections to the silent endpoint", silent.most());
    // The file handles of the whole process stay near what it had: the bound, not 48 sockets.
    let fds = std::fs::read_dir(format!("/proc/{}/fd", s.pid())).unwrap().count();
    assert!(fds < 200, "{fds} file handles open");
}

#[test]
fn a_new_subscription_past_max_push_subscriptions_is_refused_with_429() {
    let s = Server::start(&[("DELAYD_MAX_PUSH_SUBSCRIPTIONS", "2")]);
    let put = |topic: &str| {
        let r = s
            .http()
            .put(s.url(&format!("/v1/topics/{topic}/push")))
            .json(&json!({"url": "http://127.0.0.1:9/h"}))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    };
    assert_eq!(put("a").0, 200);
    assert_eq!(put("b").0, 200);
    let (st, v) = put("c");
    Server::assert_error(st, &v, 429, "too_many_push_subscriptions");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_push_subscriptions"), "{v}");
    // Replacing one that exists is no new subscription.
    assert_eq!(put("a").0, 200);
    assert_eq!(s.delete("/v1/topics/b/push").0, 200);
    assert_eq!(put("c").0, 200);
    assert_eq!(s.get("/v1/topics/c/push").0, 200);
    assert_eq!(s.get("/v1/topics/b/push").0, 404);
}
