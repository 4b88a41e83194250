//! Floods against the real binary: many large request bodies at once against the memory budget for
//! bodies (`max_body_memory`).

mod common;

use std::time::{Duration, Instant};

use common::raw::{request, Conn};
use common::{Server, NEVER_HANG};
use serde_json::json;

const TOKEN: &str = "s3cret";
const AUTH: (&str, &str) = ("authorization", "Bearer s3cret");
const JSON: (&str, &str) = ("content-type", "application/json");

/// Polls `/v1/stats` until `ok` holds for its `http` object.
fn wait_for_http_stats(s: &Server, what: &str, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + NEVER_HANG;
    loop {
        let r = s.http().get(s.url("/v1/stats")).bearer_auth(TOKEN).send().expect("stats");
        let v: serde_json::Value = r.json().expect("stats JSON");
        if ok(&v["http"]) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: stats never showed it: {}", v["http"]);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn request_bodies_past_max_body_memory_get_503_with_retry_after() {
    // Room for two bodies of ~60 KB, not three (one request may be up to 64KiB + 64KiB here).
    let s = Server::start(&[
        ("DELAYD_AUTH_TOKEN", TOKEN),
        ("DELAYD_MAX_BODY_MEMORY", "150000"),
        ("DELAYD_HTTP_BODY_TIMEOUT", "1m"),
    ]);
    let body = serde_json::to_vec(&json!({"body": "x".repeat(60_000)})).unwrap();
    let produce = request("POST", "/v1/topics/mem/messages", &[AUTH, JSON], &body);
    let head_len = produce.len() - body.len();
    // Two requests send their heads and part of their bodies, and hold their reservations.
    let mut held: Vec<Conn> = (0..2)
        .map(|_| {
            let mut c = Conn::open(&s.base).expect("connect");
            c.send(&produce[..head_len + 100]).unwrap();
            c
        })
        .collect();
    let v = wait_for_http_stats(&s, "two bodies reserved", |h| {
        h["body_memory_bytes"].as_u64() == Some(2 * body.len() as u64)
    });
    assert_eq!(v["http"]["max_body_memory"], 150_000, "{v}");

    // A third is refused at once, before its body is read, with the JSON error shape.
    let mut third = Conn::open(&s.base).expect("connect");
    let a = third.exchange(&produce, false).expect("an answer");
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(a.header("retry-after"), Some("1"), "{a:?}");
    assert_eq!(a.json()["error"]["code"], "unavailable", "{a:?}");
    assert!(a.json()["error"]["message"].as_str().unwrap().contains("max_body_memory"), "{a:?}");
    // Its body was whole and small, so it was read and the connection goes on.
    assert!(!a.closes(), "{a:?}");
    assert_eq!(third.exchange(&request("GET", "/healthz", &[], b""), false).unwrap().status, 200);

    // A burst meanwhile: every one is refused, none panics the server.
    let burst: Vec<_> = (0..16)
        .map(|_| {
            let (url, body) = (s.url("/v1/topics/mem/messages"), body.clone());
            std::thread::spawn(move || {
                let client = common::client();
                (0..4)
                    .map(|_| {
                        let r = client
                            .post(&url)
                            .bearer_auth(TOKEN)
                            .header("content-type", "application/json")
                            .body(body.clone())
                            .send()
                            .expect("an answer");
                        (r.status().as_u16(), r.headers().get("retry-after").is_some())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (status, retry_after) in burst.into_iter().flat_map(|t| t.join().expect("burst thread")) {
        assert_eq!((status, retry_after), (503, true), "while the budget is full");
    }

    // The held bodies finish: both are served, and their memory is given back.
    for c in &mut held {
        c.send(&produce[head_len + 100..]).unwrap();
        let a = c.answer(false).expect("the held request is answered");
        assert_eq!(a.status, 201, "{a:?}");
    }
    wait_for_http_stats(&s, "reservations given back", |h| h["body_memory_bytes"] == 0);

    // Concurrent bodies with room for two at a time: each is served or refused with 503, nothing else.
    let burst: Vec<_> = (0..16)
        .map(|_| {
            let (url, body) = (s.url("/v1/topics/mem/messages"), body.clone());
            std::thread::spawn(move || {
                let client = common::client();
                (0..4)
                    .map(|_| {
                        client
                            .post(&url)
                            .bearer_auth(TOKEN)
                            .header("content-type", "application/json")
                            .body(body.clone())
                            .send()
                            .expect("an answer")
                            .status()
                            .as_u16()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let statuses: Vec<u16> = burst.into_iter().flat_map(|t| t.join().expect("burst thread")).collect();
    assert!(statuses.iter().all(|s| *s == 201 || *s == 503), "{statuses:?}");
    assert!(statuses.contains(&201), "{statuses:?}");
    let v = wait_for_http_stats(&s, "all given back", |h| h["body_memory_bytes"] == 0);
    let refused = v["http"]["refused_bodies"].as_u64().unwrap();
    assert!(refused >= 65, "the third request and the first burst at least: {v}");

    // The server still serves, and said why it refused, once rather than once per request.
    let (st, _) = s.post("/v1/topics/mem/messages", &json!({"body": "after"}));
    assert_eq!(st, 401, "no token: refused as always");
    let r = s
        .http()
        .post(s.url("/v1/topics/mem/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"body": "after"}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let log = s.log();
    assert!(!log.contains("panicked"), "{log}");
    let warnings = log.matches("fill max_body_memory").count();
    assert_eq!(warnings, 1, "one warning, not one per refusal:\n{log}");
}
