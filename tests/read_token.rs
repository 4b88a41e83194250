//! `read_token` against the real binary: it reads everything a reader needs and changes nothing.
//! The routes come from the served OpenAPI document, which documents every route the router
//! serves (tests/openapi.rs), so a new route is checked here without being named.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::{Server, NEVER_HANG};
use serde_json::{json, Value};

const FULL: &str = "full-token";
const READ: &str = "read-only-token";

/// The operations a read-only token may call: they change no state. Kept here apart from the
/// server's own list, so a route the server wrongly opens to readers fails this test. Compat
/// paths are served for any method; `/get` only looks a job up.
const READS: &[(&str, &str)] = &[
    ("GET", "/v1/topics"),
    ("GET", "/v1/topics/{topic}/messages"),
    ("GET", "/v1/topics/{topic}/push"),
    ("GET", "/v1/topics/{topic}/flow"),
    ("GET", "/v1/messages/{id}"),
    ("GET", "/v1/messages/{id}/history"),
    ("GET", "/v1/stats"),
    ("GET", "/v1/stats/history"),
    ("GET", "/v1/cluster"),
    ("GET", "/metrics"),
    ("*", "/get"),
];

const COMPAT: [&str; 5] = ["/push", "/pop", "/finish", "/delete", "/get"];

fn is_read(method: &str, path: &str) -> bool {
    READS.iter().any(|(m, p)| *p == path && (*m == "*" || *m == method))
}

/// Every (METHOD, path template, operation) behind the token, from the served document.
fn protected_operations(s: &Server) -> Vec<(String, String, Value)> {
    let doc: Value = s.http().get(s.url("/openapi.json")).send().expect("GET /openapi.json").json().unwrap();
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let open = op.get("security").and_then(Value::as_array).is_some_and(|s| s.is_empty());
            if !open && ["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                out.push((method.to_uppercase(), path.clone(), op.clone()));
            }
        }
    }
    assert!(out.len() >= 20, "too few operations in the document: {out:?}");
    out
}

/// A concrete path for a template: the topic and message the test made.
fn concrete(template: &str) -> String {
    template.replace("{topic}", "t").replace("{id}", "m1").replace("{node_id}", "2")
}

fn call(s: &Server, method: &str, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut req = s
        .http()
        .request(method.parse().unwrap(), s.url(path))
        .json(&json!({"id": "m1", "topic": "t", "body": "b", "receipt": "x", "url": "http://127.0.0.1:9/h"}));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    common::answer(req.send())
}

/// What a write, wrongly let through, would have changed: the message, the topic, the counts.
fn state(s: &Server) -> Value {
    let get = |path: &str| call(s, "GET", path, Some(FULL)).1;
    json!({
        "message": get("/v1/messages/m1")["state"],
        "history": get("/v1/messages/m1/history")["history"].as_array().map(Vec::len),
        "topics": get("/v1/topics"),
        "push": call(s, "GET", "/v1/topics/t/push", Some(FULL)).0,
        "flow": call(s, "GET", "/v1/topics/t/flow", Some(FULL)).0,
    })
}

#[test]
fn the_read_only_token_is_refused_on_every_write_and_allowed_on_every_read() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", FULL), ("DELAYD_READ_TOKEN", READ)]);
    // A due message a wrongly allowed pop would reserve, and one that stays delayed.
    for body in [json!({"id": "m1", "body": "b"}), json!({"id": "m2", "body": "b", "delay_ms": 3_600_000})] {
        let (st, v) = common::answer(
            s.http().post(s.url("/v1/topics/t/messages")).bearer_auth(FULL).json(&body).send(),
        );
        assert_eq!(st, 201, "{v}");
    }
    let before = state(&s);

    let ops = protected_operations(&s);
    let mut writes = 0;
    for (method, template, op) in &ops {
        let path = concrete(template);
        let read = is_read(method, template);
        assert_eq!(
            op["responses"].get("403").is_some(),
            !read,
            "{method} {template}: the document's 403 answer says whether the route writes"
        );
        // Compat paths take any method; a client may use GET for a pop.
        let methods: Vec<&str> =
            if COMPAT.contains(&template.as_str()) { vec![method, "GET", "PUT"] } else { vec![method] };
        for m in methods {
            let (st, v) = call(&s, m, &path, Some(READ));
            if read {
                assert!(![401, 403].contains(&st), "{m} {path} is a read, refused with {st}: {v}");
            } else {
                writes += 1;
                assert_eq!(st, 403, "{m} {path} writes; the read-only token must get 403: {v}");
                assert_eq!(v["error"]["code"], "forbidden", "{m} {path}: {v}");
                assert!(v["error"]["message"].as_str().is_some_and(|t| t.contains("read-only")), "{v}");
                if COMPAT.contains(&template.as_str()) {
                    // The compat shape as well, for the clients of the original API.
                    assert_eq!(v["code"], 1, "{m} {path}: {v}");
                }
            }
            // No token and a wrong one stay 401, reads or writes.
            for token in [None, Some("wrong")] {
                assert_eq!(call(&s, m, &path, token).0, 401, "{m} {path} with {token:?}");
            }
        }
    }
    assert!(writes >= 17, "only {writes} writes checked");
    assert_eq!(state(&s), before, "nothing the read-only token called changed anything");

    // Each read, with a real answer.
    let read = |path: &str| call(&s, "GET", path, Some(READ));
    assert_eq!(read("/v1/messages/m1").1["id"], "m1");
    assert_eq!(read("/v1/topics/t/messages").0, 200);
    assert_eq!(read("/v1/stats").0, 200);
    assert_eq!(read("/v1/topics").0, 200);
    assert_eq!(read("/v1/cluster").0, 200);
    assert_eq!(read("/v1/topics/t/push").0, 404, "no subscription, but not refused");
    assert_eq!(read("/v1/topics/t/flow").0, 404, "no flow control, but not refused");
    let (st, v) = call(&s, "POST", "/get", Some(READ));
    assert_eq!((st, &v["code"]), (200, &json!(0)), "{v}");
    let head = s.http().head(s.url("/v1/stats")).bearer_auth(READ).send().unwrap();
    assert_eq!(head.status(), 200, "HEAD of a read");
    let metrics = s.http().get(s.url("/metrics")).bearer_auth(READ).send().unwrap();
    assert_eq!(metrics.status(), 200);
    assert!(metrics.text().unwrap().contains("delayd_produced_total"), "metrics with the read token");
}

#[test]
fn a_read_token_without_auth_token_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let (status, log) = common::run_binary(
        &["--listen", "127.0.0.1:0", "--data-dir", data.to_str().unwrap()],
        &[("DELAYD_READ_TOKEN", READ)],
        tmp.path(),
    );
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("read_token") && log.contains("needs auth_token"), "{log}");
}

/// Runs the binary on `listen` (a port the test holds, so the bind fails and nothing is ever
/// served beyond loopback) and returns its log.
fn start_log(listen: &str, env: &[(&str, &str)]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let started = Instant::now();
    let (status, log) =
        common::run_binary(&["--listen", listen, "--data-dir", data.to_str().unwrap()], env, tmp.path());
    assert!(started.elapsed() < NEVER_HANG);
    assert!(!status.success(), "the port is held: the bind must fail: {log}");
    assert!(log.contains("cannot listen on"), "{log}");
    log
}

#[test]
fn listening_beyond_loopback_without_a_token_is_warned_about() {
    // Held on 127.0.0.1: binding 0.0.0.0 to the same port fails (EADDRINUSE), after the warning.
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let everywhere = format!("0.0.0.0:{port}");
    let log = start_log(&everywhere, &[]);
    let line = log
        .lines()
        .find(|l| l.contains("without auth_token"))
        .unwrap_or_else(|| panic!("no warning; log:\n{log}"));
    assert!(line.contains("WARN") && line.contains(&everywhere), "{line}");
    let log = start_log(&everywhere, &[("DELAYD_AUTH_TOKEN", FULL)]);
    assert!(!log.contains("without auth_token"), "a token is set: {log}");
    let log = start_log(&format!("127.0.0.1:{port}"), &[]);
    assert!(!log.contains("without auth_token"), "loopback only: {log}");
    drop(held);
    // And a server that runs on loopback says nothing of it either.
    let s = Server::start(&[]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!s.log().contains("without auth_token"), "{}", s.log());
}
