//! HTTP connections against the real binary: keep-alive after early answers, `Connection: close`
//! when the server closes, header, idle and body timeouts, the connection cap, and the JSON shape
//! of the parser's own errors.

mod common;

use std::time::Duration;

use common::raw::{request, Answer, Conn};
use common::{Server, NEVER_HANG};
use serde_json::json;

const TOKEN: &str = "s3cret";
const AUTH: (&str, &str) = ("authorization", "Bearer s3cret");
const JSON: (&str, &str) = ("content-type", "application/json");

/// What one early answer looks like: a name, the request, and the status it must get.
struct Reject {
    name: &'static str,
    req: Vec<u8>,
    status: u16,
    code: &'static str,
}

/// Every kind of answer the server gives before (or without) reading a small request body.
fn early_rejections() -> Vec<Reject> {
    let produce = "/v1/topics/ka/messages";
    let body = serde_json::to_vec(&json!({"body": "x".repeat(300), "delay_ms": 5})).unwrap();
    let r = |name, req, status, code| Reject { name, req, status, code };
    vec![
        r("no token", request("POST", produce, &[JSON], &body), 401, "unauthorized"),
        r(
            "wrong token",
            request("POST", produce, &[JSON, ("authorization", "Bearer nope")], &body),
            401,
            "unauthorized",
        ),
        r(
            "basic scheme",
            request("POST", produce, &[JSON, ("authorization", "Basic czNjcmV0")], &body),
            401,
            "unauthorized",
        ),
        r(
            "not JSON content type",
            request("POST", produce, &[AUTH, ("content-type", "text/plain")], &body),
            415,
            "unsupported_media_type",
        ),
        r("no content type", request("POST", produce, &[AUTH], &body), 415, "unsupported_media_type"),
        r("malformed JSON", request("POST", produce, &[AUTH, JSON], b"{\"body\": "), 400, "invalid_json"),
        r(
            "unknown field",
            request("POST", produce, &[AUTH, JSON], br#"{"body":"x","dealy_ms":5}"#),
            400,
            "invalid_argument",
        ),
        r(
            "bad topic",
            request("POST", &format!("/v1/topics/{}/messages", "t".repeat(129)), &[AUTH, JSON], &body),
            400,
            "invalid_argument",
        ),
        r(
            "bad pop query",
            request("POST", "/v1/topics/ka/pop?max=0", &[AUTH, JSON], &body),
            400,
            "invalid_argument",
        ),
        r(
            "field too large",
            request(
                "POST",
                produce,
                &[AUTH, JSON],
                &serde_json::to_vec(&json!({"body": "x".repeat(1100)})).unwrap(),
            ),
            413,
            "too_large",
        ),
        r(
            "batch too large",
            request(
                "POST",
                "/v1/topics/ka/messages/batch",
                &[AUTH, JSON],
                br#"{"messages":[{"body":"1"},{"body":"2"},{"body":"3"},{"body":"4"}]}"#,
            ),
            413,
            "too_large",
        ),
        r("wrong method", request("PUT", produce, &[AUTH, JSON], &body), 405, "method_not_allowed"),
        r("no such path", request("POST", "/v2/nothing", &[AUTH, JSON], &body), 404, "no_such_endpoint"),
        r("a body nobody reads", request("GET", "/v1/messages/none", &[AUTH, JSON], &body), 404, "not_found"),
    ]
}

fn accepted(i: usize) -> Vec<u8> {
    if i.is_multiple_of(50) {
        let body = serde_json::to_vec(&json!({"body": format!("m{i}")})).unwrap();
        request("POST", "/v1/topics/ok/messages", &[AUTH, JSON], &body)
    } else {
        request("POST", "/v1/topics/ka/pop?max=1", &[AUTH], b"")
    }
}

fn check_error(a: &Answer, status: u16, code: &str, what: &str) {
    assert_eq!(a.status, status, "{what}: {:?}", String::from_utf8_lossy(&a.body));
    assert!(a.header("content-type").is_some_and(|t| t.starts_with("application/json")), "{what}: {a:?}");
    assert_eq!(a.json()["error"]["code"], code, "{what}");
}

#[test]
fn thousands_of_early_rejections_on_one_connection_cost_no_request() {
    let s = Server::start(&[
        ("DELAYD_AUTH_TOKEN", TOKEN),
        ("DELAYD_MAX_BODY_BYTES", "1000"),
        ("DELAYD_MAX_BATCH", "3"),
    ]);
    let rejects = early_rejections();
    let mut conn = Conn::open(&s.base).expect("connect");
    let (mut transport_errors, mut closes, mut produced) = (Vec::new(), 0, 0);
    for i in 0..3000 {
        let reject = &rejects[i % rejects.len()];
        for (req, want) in [(&reject.req, Some(reject)), (&accepted(i), None)] {
            match conn.exchange(req, false) {
                Ok(a) => {
                    match want {
                        Some(r) => check_error(&a, r.status, r.code, r.name),
                        None => {
                            assert!(a.status == 200 || a.status == 201, "accepted request {i}: {a:?}");
                            produced += usize::from(a.status == 201);
                        }
                    }
                    if a.closes() {
                        // A close must be said and then done: nothing more comes on this connection.
                        closes += 1;
                        assert!(conn.closed_within(NEVER_HANG), "said close, stayed open ({i})");
                        conn = Conn::open(&s.base).expect("reconnect");
                    }
                }
                Err(e) => {
                    transport_errors.push(format!("pair {i} ({}): {e}", reject.name));
                    conn = Conn::open(&s.base).expect("reconnect");
                }
            }
        }
    }
    assert!(
        transport_errors.is_empty(),
        "{} transport errors: {:?}",
        transport_errors.len(),
        &transport_errors[..transport_errors.len().min(10)]
    );
    // Every body here is small and sent whole, so the server reads it and keeps the connection.
    assert_eq!(closes, 0, "a small early-rejected body closed the connection");
    assert_eq!(produced, 60, "every accepted produce went through");
}

#[test]
fn a_large_early_rejected_body_closes_and_says_so_every_time() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN)]);
    // Larger than the request limit (64KiB + 64KiB here), and than what is read to keep a connection.
    let big = serde_json::to_vec(&json!({"body": "x".repeat(300 << 10)})).unwrap();
    // Under the request limit, but more than is read to keep a connection.
    let large = serde_json::to_vec(&json!({"body": "x".repeat(100 << 10)})).unwrap();
    let cases = [
        ("too large", request("POST", "/v1/topics/big/messages", &[AUTH, JSON], &big), 413, "too_large"),
        ("no token", request("POST", "/v1/topics/big/messages", &[JSON], &big), 401, "unauthorized"),
        (
            // Within the request limit, or the declared size alone would be refused (413) first.
            "not JSON",
            request("POST", "/v1/topics/big/messages", &[AUTH, ("content-type", "text/plain")], &large),
            415,
            "unsupported_media_type",
        ),
    ];
    for round in 0..20 {
        for (name, req, status, code) in &cases {
            let mut conn = Conn::open(&s.base).expect("connect");
            // The whole body is sent before the answer is read, as simple clients do: the server
            // must read what is sent rather than reset the connection under its answer.
            let a = conn.exchange(req, false).unwrap_or_else(|e| panic!("{name}, round {round}: {e}"));
            check_error(&a, *status, code, name);
            assert!(a.closes(), "{name}: an unread large body must close the connection, and say so: {a:?}");
            assert!(conn.closed_within(NEVER_HANG), "{name}: said close, stayed open");
        }
    }
}

#[test]
fn an_early_answer_to_expect_continue_does_not_wait_for_the_body() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN), ("DELAYD_HTTP_BODY_TIMEOUT", "10m")]);
    let mut conn = Conn::open(&s.base).expect("connect");
    let head = "POST /v1/topics/e/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
                expect: 100-continue\r\ncontent-length: 4000000\r\n\r\n";
    // No body is ever sent: a server that read (or waited for) it first would never answer.
    let a = conn.exchange(head.as_bytes(), false).expect("an answer without the body");
    check_error(&a, 401, "unauthorized", "expect-continue without a token");
    assert!(a.closes(), "the body was never sent, so the connection cannot be reused: {a:?}");
    assert!(conn.closed_within(NEVER_HANG));
}

/// Runs `f` on a thread of its own and returns its result, failing the test if it takes longer
/// than `limit` (a server that waits for a body nobody sends would otherwise hold the test for
/// the client's whole read timeout).
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("{what}: no answer within {limit:?}"))
}

#[test]
fn a_declared_oversize_body_is_refused_at_once_without_100_continue() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN), ("DELAYD_HTTP_BODY_TIMEOUT", "10m")]);
    for path in ["/v1/topics/big/messages", "/v1/topics/big/messages/batch", "/push"] {
        for expect in [true, false] {
            let what = format!("{path}, expect 100-continue: {expect}");
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {TOKEN}\r\n\
                 content-type: application/json\r\n{}content-length: 1000000000\r\n\r\n",
                if expect { "expect: 100-continue\r\n" } else { "" }
            );
            let mut conn = Conn::open(&s.base).expect("connect");
            // Only the head goes out, and a few body bytes when the client does not wait for
            // `100 Continue`: a server that reads the body before refusing never answers.
            let mut req = head.into_bytes();
            if !expect {
                req.extend_from_slice(b"{\"body\": \"xxxx");
            }
            let (a, mut conn) = within(Duration::from_secs(1), &what, move || {
                let a = conn.exchange(&req, false);
                (a, conn)
            });
            let a = a.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_ne!(a.status, 100, "{what}: the server invited a body it will refuse");
            if path == "/push" {
                // A compat client parses {code, message, data}, as with its 401.
                assert_eq!(a.status, 413, "{what}: {a:?}");
                assert_eq!(a.json()["code"], 1, "{what}: {a:?}");
            } else {
                check_error(&a, 413, "too_large", &what);
            }
            let message = a.json().to_string();
            assert!(
                message.contains("1000000000") && message.contains("max_body_bytes"),
                "{what}: {message}"
            );
            assert!(a.closes(), "{what}: the body never came whole, so the connection cannot go on: {a:?}");
            if expect {
                // Without `Expect`, what the client sends is read and dropped until the body's
                // deadline, so the close does not reset the connection under the answer.
                assert!(conn.closed_within(NEVER_HANG), "{what}: said close, stayed open");
            }
        }
    }
    // A declared length within the limit is still read and served.
    let body = serde_json::to_vec(&json!({"body": "x".repeat(60_000)})).unwrap();
    let mut conn = Conn::open(&s.base).expect("connect");
    let a = conn.exchange(&request("POST", "/v1/topics/big/messages", &[AUTH, JSON], &body), false).unwrap();
    assert_eq!(a.status, 201, "{a:?}");
}

#[test]
fn auth_is_checked_before_the_body_arrives() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN), ("DELAYD_HTTP_BODY_TIMEOUT", "10m")]);
    for auth in ["", "authorization: Bearer wrong\r\n"] {
        let mut conn = Conn::open(&s.base).expect("connect");
        let head = format!(
            "POST /v1/topics/a/messages HTTP/1.1\r\nhost: t\r\n{auth}content-type: application/json\r\n\
             content-length: 4194304\r\n\r\n{{\"body\": \"xxxx"
        );
        // 4 MiB announced, a few bytes sent: the 401 comes without the rest (a server buffering
        // the body first would wait for it, past this client's read timeout).
        let a = conn.exchange(head.as_bytes(), false).expect("401 before the body");
        check_error(&a, 401, "unauthorized", auth);
        assert!(a.closes(), "{a:?}");
    }
}

#[test]
fn header_timeout_closes_silent_and_half_sent_requests() {
    let s = Server::start(&[("DELAYD_HTTP_HEADER_TIMEOUT", "1s"), ("DELAYD_HTTP_IDLE_TIMEOUT", "10m")]);
    let mut silent = Conn::open(&s.base).expect("connect");
    let mut half = Conn::open(&s.base).expect("connect");
    half.send(b"POST /v1/topics/h/messages HTTP/1.1\r\nhost: t\r\ncontent-type: appl").unwrap();
    assert!(silent.closed_within(NEVER_HANG), "a connection that never sent a request stayed open");
    assert!(half.closed_within(NEVER_HANG), "a connection with half a request head stayed open");
    // A request sent in time is served.
    let mut ok = Conn::open(&s.base).expect("connect");
    assert_eq!(ok.exchange(&request("GET", "/healthz", &[], b""), false).unwrap().status, 200);
}

#[test]
fn idle_timeout_closes_a_kept_alive_connection_but_not_a_long_poll() {
    let s = Server::start(&[("DELAYD_HTTP_IDLE_TIMEOUT", "1s"), ("DELAYD_HTTP_HEADER_TIMEOUT", "10m")]);
    let mut conn = Conn::open(&s.base).expect("connect");
    // A long-poll longer than the idle timeout is a request being served, not idleness.
    let a = conn.exchange(&request("POST", "/v1/topics/idle/pop?wait_ms=2500", &[], b""), false).unwrap();
    assert_eq!((a.status, a.json()), (200, json!({"messages": []})));
    assert!(!a.closes());
    assert_eq!(conn.exchange(&request("GET", "/healthz", &[], b""), false).unwrap().status, 200);
    assert!(conn.closed_within(NEVER_HANG), "an idle kept-alive connection stayed open");
    assert!(conn.unread().is_empty(), "the server closed an idle connection with bytes: {:?}", conn.unread());
}

#[test]
fn body_timeout_answers_408_and_closes() {
    let s = Server::start(&[("DELAYD_HTTP_BODY_TIMEOUT", "1s"), ("DELAYD_HTTP_IDLE_TIMEOUT", "10m")]);
    for path in ["/v1/topics/slow/messages", "/push"] {
        let mut conn = Conn::open(&s.base).expect("connect");
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"bo"
        );
        let a = conn.exchange(head.as_bytes(), false).expect("an answer once the body is late");
        if path == "/push" {
            // The compat API answers every failure with HTTP 200 and code 1, as the original does.
            assert_eq!((a.status, a.json()["code"].clone()), (200, json!(1)), "{a:?}");
            assert!(a.json()["message"].as_str().unwrap().contains("http_body_timeout"), "{a:?}");
        } else {
            check_error(&a, 408, "request_timeout", path);
        }
        assert!(a.closes(), "{path}: the rest of the body may still come, so the connection closes: {a:?}");
        assert!(conn.closed_within(NEVER_HANG));
    }
    assert_eq!(s.get("/v1/stats").0, 200, "the server is unharmed");
}

#[test]
fn connections_past_max_connections_wait_while_every_one_is_busy() {
    // Three slots, all for this address. The harness's own client keeps one idle (it checked
    // /healthz at start): at the cap it makes room for the third request below.
    let s = Server::start(&[
        ("DELAYD_MAX_CONNECTIONS", "3"),
        ("DELAYD_MAX_CONNECTIONS_PER_IP", "10"),
        ("DELAYD_HTTP_IDLE_TIMEOUT", "10m"),
        ("DELAYD_HTTP_BODY_TIMEOUT", "10m"),
    ]);
    // Busy with something other than a long poll (which would be cut short): a body on its way.
    let body = br#"{"body":"slow"}"#;
    let produce = request("POST", "/v1/topics/busy/messages", &[JSON], body);
    let head = produce.len() - body.len();
    let mut busy: Vec<Conn> = (0..3)
        .map(|_| {
            let mut c = Conn::open(&s.base).expect("connect");
            c.send(&produce[..head + 3]).unwrap();
            c
        })
        .collect();
    let health = request("GET", "/healthz", &[], b"");
    let mut waiting = Conn::open(&s.base).expect("the kernel still completes the handshake");
    waiting.send(&health).unwrap();
    // Every connection is serving a request: nothing can make room until one ends.
    assert!(!waiting.closed_within(Duration::from_millis(1000)), "the connection past the cap was dropped");
    assert!(waiting.unread().is_empty(), "a connection past max_connections was served");
    // One body ends; its connection, idle once answered, makes room for the waiting one.
    busy[0].send(&produce[head + 3..]).unwrap();
    assert_eq!(busy[0].answer(false).expect("the produce's answer").status, 201);
    let a = waiting.answer(false).expect("served once a connection is idle");
    assert_eq!(a.status, 200);
    assert!(busy[0].closed_within(NEVER_HANG), "the idle connection was closed to make room");
    for c in &mut busy[1..] {
        c.send(&produce[head + 3..]).unwrap();
        assert_eq!(c.answer(false).expect("the other produces are served").status, 201);
    }
}

#[test]
fn parser_errors_have_the_json_shape() {
    let s = Server::start(&[]);
    let many_headers: String = (0..200).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("garbage request line", b"GARBAGE\r\n\r\n".to_vec(), 400, "bad_request"),
        ("bad version", b"GET /healthz HTTP/9.9\r\nhost: t\r\n\r\n".to_vec(), 400, "bad_request"),
        ("bad header", b"GET /healthz HTTP/1.1\r\nhost t\r\n\r\n".to_vec(), 400, "bad_request"),
        (
            "two different Content-Lengths",
            b"POST /push HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}".to_vec(),
            400,
            "bad_request",
        ),
        (
            "too many headers",
            format!("GET /healthz HTTP/1.1\r\nhost: t\r\n{many_headers}\r\n").into_bytes(),
            431,
            "headers_too_large",
        ),
        (
            "uri too long",
            format!("GET /v1/messages/{} HTTP/1.1\r\nhost: t\r\n\r\n", "x".repeat(70_000)).into_bytes(),
            414,
            "uri_too_long",
        ),
    ];
    for (name, req, status, code) in cases {
        let mut conn = Conn::open(&s.base).expect("connect");
        let a = conn.exchange(&req, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        check_error(&a, status, code, name);
        assert!(!a.json()["error"]["message"].as_str().unwrap().is_empty(), "{name}");
        assert!(a.closes(), "{name}: {a:?}");
        assert!(conn.closed_within(NEVER_HANG), "{name}");
    }
    assert_eq!(s.get("/healthz").0, 200);
}

#[test]
fn head_never_changes_state() {
    let s = Server::start(&[]);
    let push = |id: &str| {
        serde_json::to_vec(&json!({"topic": "hd", "id": id, "delay": 0, "ttr": 30, "body": "b"})).unwrap()
    };
    let mut conn = Conn::open(&s.base).expect("connect");
    for path in ["/push", "/pop", "/finish", "/delete", "/get"] {
        let a = conn.exchange(&request("HEAD", path, &[JSON], &push("h-1")), true).unwrap();
        assert_eq!(a.status, 405, "HEAD {path}: {a:?}");
        assert!(a.body.is_empty());
    }
    let (_, v) = s.post("/get", &json!({"id": "h-1"}));
    assert_eq!(v, json!({"code": 0, "message": "ok", "data": null}), "HEAD /push created a job");
    // A ready job is not popped (or finished, or deleted) by a HEAD either.
    assert_eq!(s.post_raw("/push", None, push("h-2")).1["code"], 0);
    for path in ["/pop", "/finish", "/delete"] {
        let a =
            conn.exchange(&request("HEAD", path, &[JSON], br#"{"topic":"hd","id":"h-2"}"#), true).unwrap();
        assert_eq!(a.status, 405, "HEAD {path}");
    }
    let (_, v) = s.post("/pop", &json!({"topic": "hd"}));
    assert_eq!(v["data"]["id"], "h-2", "{v}");
    // HEAD on a look-up stays a harmless look-up.
    let a = conn.exchange(&request("HEAD", "/v1/stats", &[], b""), true).unwrap();
    assert_eq!(a.status, 200);
}

#[test]
fn the_bearer_scheme_is_matched_in_any_case() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN)]);
    let mut conn = Conn::open(&s.base).expect("connect");
    for auth in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR  s3cret"] {
        let a = conn.exchange(&request("GET", "/v1/stats", &[("authorization", auth)], b""), false).unwrap();
        assert_eq!(a.status, 200, "{auth:?}");
    }
    for auth in ["Bearer S3CRET", "Bearers3cret", "s3cret"] {
        let a = conn.exchange(&request("GET", "/v1/stats", &[("authorization", auth)], b""), false).unwrap();
        check_error(&a, 401, "unauthorized", auth);
    }
}
