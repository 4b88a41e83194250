//! Floods against the real binary: thousands of idle connections and long polls that must not
//! keep a new client out, one address that must not take every connection, and many large
//! request bodies at once against the memory budget for bodies (`max_body_memory`).

mod common;

use std::net::Ipv4Addr;
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
        assert!(Instant::now() < deadline, "{what}: stats never showed it: {}\n{}", v["http"], s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// 16 clients sending 4 authenticated produces of `body` each, at once: every answer's status and
/// whether it carried `Retry-After`.
fn produce_burst(s: &Server, body: &[u8]) -> Vec<(u16, bool)> {
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let (url, body) = (s.url("/v1/topics/mem/messages"), body.to_vec());
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
    threads.into_iter().flat_map(|t| t.join().expect("burst thread")).collect()
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
    let burst = produce_burst(&s, &body);
    for (status, retry_after) in burst {
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
    let statuses: Vec<u16> = produce_burst(&s, &body).into_iter().map(|(status, _)| status).collect();
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

/// Sets this process' soft limit on open files (children inherit it) to `soft`, or to the hard
/// limit; returns the limit set.
fn set_open_files(soft: Option<u64>) -> u64 {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read or write one `rlimit` through a pointer to a live one.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl), 0, "getrlimit");
        rl.rlim_cur = soft.unwrap_or(rl.rlim_max).min(rl.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &rl), 0, "setrlimit");
    }
    rl.rlim_cur
}

/// A native long poll on `topic` with the token, sent and left waiting.
fn long_poll(s: &Server, topic: &str) -> Conn {
    let mut c = Conn::open(&s.base).expect("connect");
    c.send(&request("POST", &format!("/v1/topics/{topic}/pop?wait_ms=20000"), &[AUTH], b"")).unwrap();
    c
}

/// A connection that sent one `/healthz` (no token), got its answer and stays open.
fn idle(s: &Server) -> Conn {
    let mut c = Conn::open(&s.base).expect("connect");
    let a = c.exchange(&request("GET", "/healthz", &[], b""), false).expect("healthz on a new connection");
    assert_eq!(a.status, 200);
    c
}

/// A produce with the token on a connection of its own; its status and how long it took.
fn timed_produce(s: &Server, topic: &str) -> (u16, Duration) {
    let body = serde_json::to_vec(&json!({"body": "through"})).unwrap();
    let started = Instant::now();
    let mut c = Conn::open(&s.base).expect("connect");
    let a = c
        .exchange(&request("POST", &format!("/v1/topics/{topic}/messages"), &[AUTH, JSON], &body), false)
        .expect("an answer to the produce");
    (a.status, started.elapsed())
}

#[test]
fn idle_connections_and_long_polls_do_not_keep_out_a_new_produce() {
    // The server starts with the soft limit many systems give a service (1024), under a hard
    // limit with room for 4,000 connections: it must raise its own to serve them.
    set_open_files(Some(1024));
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN)]);
    let hard = set_open_files(None);
    assert!(
        hard >= 10_000,
        "this test needs 10000 open files (4,000 connections on both sides); the hard limit is {hard} (ulimit -Hn)"
    );
    let polls: Vec<Conn> = (0..2000).map(|_| long_poll(&s, "parked")).collect();
    let mut idles: Vec<Conn> = (0..2000).map(|_| idle(&s)).collect();
    let (status, took) = timed_produce(&s, "fresh");
    assert_eq!(status, 201);
    assert!(took < Duration::from_secs(1), "a produce from a new connection took {took:?}");
    let v = wait_for_http_stats(&s, "every connection counted", |h| h["connections"].as_u64() >= Some(4001));
    assert_eq!(v["http"]["max_connections"], 10_000, "{}", v["http"]);
    assert_eq!(v["nofile_soft"], hard, "the server raised its soft limit to the hard one: {v}");
    assert_eq!(v["nofile_hard"], hard, "{v}");
    let log = s.log();
    assert!(log.contains("open file limit (RLIMIT_NOFILE)") && log.contains("soft_at_start=1024"), "{log}");
    // Below the pressure mark nothing was closed: the idle ones still serve, the polls still wait.
    assert_eq!(v["http"]["closed_idle_connections"], 0, "{}", v["http"]);
    for c in idles.iter_mut().step_by(250) {
        assert_eq!(c.exchange(&request("GET", "/healthz", &[], b""), false).unwrap().status, 200);
    }
    s.http()
        .post(s.url("/v1/topics/parked/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"body": "for a poll"}))
        .send()
        .expect("produce");
    drop(idles);
    drop(polls);
}

#[test]
fn at_the_cap_idle_connections_make_room_and_idle_only_briefly() {
    let s = Server::start(&[
        ("DELAYD_AUTH_TOKEN", TOKEN),
        ("DELAYD_MAX_CONNECTIONS", "20"),
        // Every client here is 127.0.0.1; its share must not be what limits it.
        ("DELAYD_MAX_CONNECTIONS_PER_IP", "100"),
        ("DELAYD_HTTP_IDLE_TIMEOUT", "10m"),
        ("DELAYD_HTTP_HEADER_TIMEOUT", "10m"),
    ]);
    // With the harness's own connection, 10 long polls and 9 idle connections fill all 20.
    let mut polls: Vec<Conn> = (0..10).map(|_| long_poll(&s, "parked")).collect();
    let mut idles: Vec<Conn> = (0..9).map(|_| idle(&s)).collect();
    let (status, took) = timed_produce(&s, "fresh");
    assert_eq!(status, 201);
    assert!(took < Duration::from_secs(1), "at the cap, a produce from a new connection took {took:?}");
    let v =
        wait_for_http_stats(&s, "an idle one closed", |h| h["closed_idle_connections"].as_u64() >= Some(1));
    assert_eq!(v["http"]["max_connections"], 20, "{}", v["http"]);
    // Under pressure the idle ones close after a brief idle time, not the 10 minutes configured.
    for (i, c) in idles.iter_mut().enumerate() {
        assert!(c.closed_within(NEVER_HANG), "idle connection {i} stayed open under pressure");
        assert!(c.unread().is_empty(), "closed with bytes: {:?}", c.unread());
    }
    // The long polls were never cut: one of them gets the next message.
    s.http()
        .post(s.url("/v1/topics/parked/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"body": "for a poll"}))
        .send()
        .expect("produce");
    let got = polls.iter_mut().find_map(|c| {
        if c.closed_within(Duration::from_millis(200)) {
            panic!("a long poll was closed");
        }
        (!c.unread().is_empty()).then(|| c.answer(false).expect("the poll's answer"))
    });
    let a = got.expect("a long poll got the message");
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["messages"][0]["body"], "for a poll");
}

#[test]
fn one_address_gets_only_its_share_of_the_connections() {
    let s = Server::start(&[("DELAYD_MAX_CONNECTIONS_PER_IP", "5"), ("DELAYD_HTTP_IDLE_TIMEOUT", "10m")]);
    let greedy = Ipv4Addr::new(127, 0, 0, 2);
    let health = request("GET", "/healthz", &[], b"");
    let mut held: Vec<Conn> = (0..5)
        .map(|_| {
            let mut c = Conn::open_from(&s.base, greedy).expect("connect");
            assert_eq!(c.exchange(&health, false).unwrap().status, 200);
            c
        })
        .collect();
    for _ in 0..3 {
        let mut c = Conn::open_from(&s.base, greedy).expect("the kernel completes the handshake");
        let a = c.exchange(&health, false).expect("a refusal, not silence");
        assert_eq!(a.status, 503, "{a:?}");
        assert_eq!(a.json()["error"]["code"], "too_many_connections", "{a:?}");
        assert_eq!(a.header("retry-after"), Some("1"), "{a:?}");
        assert!(a.closes() && c.closed_within(NEVER_HANG), "{a:?}");
    }
    // Another address is served, and so are the greedy one's open connections.
    let mut other = Conn::open_from(&s.base, Ipv4Addr::new(127, 0, 0, 3)).expect("connect");
    assert_eq!(other.exchange(&health, false).unwrap().status, 200);
    assert_eq!(held[0].exchange(&health, false).unwrap().status, 200);
    // A connection closed gives its place back.
    drop(held.pop());
    let v = wait_for_http_stats(&s, "the close counted", |h| h["connections"].as_u64() <= Some(6));
    assert_eq!(v["http"]["refused_connections"], 3, "{}", v["http"]);
    assert_eq!(v["http"]["max_connections_per_ip"], 5, "{}", v["http"]);
    let mut again = Conn::open_from(&s.base, greedy).expect("connect");
    assert_eq!(again.exchange(&health, false).unwrap().status, 200);
    let log = s.log();
    assert_eq!(log.matches("holds its share of connections").count(), 1, "one warning for three:\n{log}");
    assert!(log.contains("127.0.0.2"), "the warning names the address:\n{log}");
}

#[test]
fn at_the_cap_with_none_idle_the_longest_waiting_poll_makes_room() {
    let s = Server::start(&[
        ("DELAYD_AUTH_TOKEN", TOKEN),
        ("DELAYD_MAX_CONNECTIONS", "10"),
        ("DELAYD_MAX_CONNECTIONS_PER_IP", "100"),
        ("DELAYD_COMPAT_MAX_WAIT", "20s"),
    ]);
    // A compat long poll first, then native ones: with the harness's own connection, 10.
    let mut compat = Conn::open(&s.base).expect("connect");
    compat.send(&request("POST", "/pop", &[AUTH, JSON], br#"{"topic":"parked"}"#)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut polls: Vec<Conn> = (0..8).map(|_| long_poll(&s, "parked")).collect();
    // Counted over the harness's connection, which is idle again once answered.
    wait_for_http_stats(&s, "ten connections", |h| h["connections"] == 10);
    // One more poll: the harness's idle connection makes room for it.
    polls.push(long_poll(&s, "parked"));
    // Every connection waits in a poll now; a produce from a new one is answered at once.
    let body = serde_json::to_vec(&json!({"body": "through"})).unwrap();
    let started = Instant::now();
    let mut producer = Conn::open(&s.base).expect("connect");
    let a = producer
        .exchange(&request("POST", "/v1/topics/fresh/messages", &[AUTH, JSON], &body), false)
        .expect("an answer to the produce");
    let took = started.elapsed();
    assert_eq!(a.status, 201, "{a:?}");
    assert!(took < Duration::from_secs(1), "with every connection in a poll, a produce took {took:?}");
    // The poll that waited longest ended as if its wait had run out, and said close.
    let a = compat.answer(false).expect("the compat poll's answer");
    assert_eq!((a.status, a.json()), (200, json!({"code": 0, "message": "ok", "data": null})), "{a:?}");
    assert!(a.closes(), "{a:?}");
    assert!(compat.closed_within(NEVER_HANG));
    for (i, c) in polls.iter_mut().enumerate() {
        assert!(!c.closed_within(Duration::from_millis(20)), "native poll {i} was closed");
        assert!(
            c.unread().is_empty(),
            "native poll {i} was answered: {:?}",
            String::from_utf8_lossy(c.unread())
        );
    }
    // A look at the stats on a new connection takes the producer's idle one, not another poll.
    let mut look = Conn::open(&s.base).expect("connect");
    let v = look.exchange(&request("GET", "/v1/stats", &[AUTH], b""), false).expect("stats").json();
    assert_eq!(v["http"]["cut_long_polls"], 1, "{}", v["http"]);
    assert_eq!(v["http"]["closed_idle_connections"], 2, "the harness's and the producer's: {}", v["http"]);
    assert!(producer.closed_within(NEVER_HANG), "the idle producer made room");
}
