//! The native HTTP API, driven over loopback against the real binary.

mod common;

use std::time::{Duration, Instant};

use common::{now_ms, Server};
use serde_json::{json, Value};

fn receipt(m: &Value) -> String {
    m["receipt"].as_str().expect("receipt").to_string()
}

#[test]
fn produce_pop_ack_round_trip() {
    let s = Server::start(&[]);
    let before = now_ms();
    // Long enough that the look-up below sees it delayed on a loaded machine too.
    let v = s.produce("orders", &json!({"body": "hello", "delay_ms": 2000}));
    let after = now_ms();
    let id = v["id"].as_str().expect("generated id").to_string();
    let due = v["deliver_at_ms"].as_u64().expect("deliver_at_ms");
    // The receive time is rounded up to the millisecond: at most one past `after`.
    assert!(
        due >= before + 2000 && due <= after + 2001,
        "due {due} not receive time + 2000 ({before}..{after})"
    );

    let (st, info) = s.get(&format!("/v1/messages/{id}"));
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["state"], "delayed");
    assert_eq!(info["topic"], "orders");
    assert_eq!(info["body"], "hello");
    assert_eq!(info["deliver_at_ms"], due);
    assert_eq!(info["attempt"], 0);

    let (msgs, at) = s.pop("orders", 10, 10_000, None);
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    let m = &msgs[0];
    assert_eq!(m["id"], id.as_str());
    assert_eq!(m["body"], "hello");
    assert_eq!(m["attempt"], 1);
    assert_eq!(m["deliver_at_ms"], due);
    assert!(at >= due, "popped at {at}, before its due time {due}");

    assert_eq!(s.get(&format!("/v1/messages/{id}")).1["state"], "reserved");
    assert_eq!(s.ack(&receipt(m)), 200);
    let info = s.get(&format!("/v1/messages/{id}")).1;
    // A finished message keeps the due time it was delivered for, not the time of the ack.
    assert_eq!((&info["state"], &info["deliver_at_ms"]), (&json!("done"), &json!(due)), "{info}");
    let (st, v) = s.post("/v1/ack", &json!({"receipt": receipt(m)}));
    Server::assert_error(st, &v, 404, "not_found");
    assert!(s.pop("orders", 10, 0, None).0.is_empty());
}

/// Ack and cancel keep `deliver_at_ms` whatever the state they end (delayed, ready, reserved,
/// after a nack), and so does a restart.
#[test]
fn a_final_message_keeps_its_deliver_at() {
    let mut s = Server::start(&[]);
    let at = |s: &Server, id: &str| {
        let v = s.get(&format!("/v1/messages/{id}")).1;
        (v["state"].as_str().unwrap_or_default().to_string(), v["deliver_at_ms"].as_u64())
    };
    let delayed = s.produce("k", &json!({"id": "k-delayed", "body": "d", "delay_ms": 3_600_000}));
    let ready = s.produce("k", &json!({"id": "k-ready", "body": "r"}));
    let reserved = s.produce("k", &json!({"id": "k-reserved", "body": "v", "delay_ms": 50}));
    assert_eq!(s.delete("/v1/messages/k-delayed").0, 200);
    assert_eq!(at(&s, "k-delayed"), ("cancelled".into(), delayed["deliver_at_ms"].as_u64()));
    assert_eq!(s.delete("/v1/messages/k-ready").0, 200);
    assert_eq!(at(&s, "k-ready"), ("cancelled".into(), ready["deliver_at_ms"].as_u64()));
    // Cancelled while reserved: the reservation's expiry was shown, the delivery's due time stays.
    let (msgs, _) = s.pop("k", 1, 5000, Some(600_000));
    assert_eq!(msgs[0]["id"], "k-reserved");
    assert_eq!(at(&s, "k-reserved").0, "reserved");
    assert_eq!(s.delete("/v1/messages/k-reserved").0, 200);
    assert_eq!(at(&s, "k-reserved"), ("cancelled".into(), reserved["deliver_at_ms"].as_u64()));
    // After a nack with a delay, the due time is the retry's.
    s.produce("k", &json!({"id": "k-nacked", "body": "n"}));
    let (msgs, _) = s.pop("k", 1, 5000, None);
    let (st, v) = s.post("/v1/nack", &json!({"receipt": receipt(&msgs[0]), "delay_ms": 100}));
    assert_eq!(st, 200, "{v}");
    let retry_at = v["deliver_at_ms"].as_u64();
    assert!(retry_at.is_some(), "{v}");
    let (msgs, _) = s.pop("k", 1, 5000, None);
    assert_eq!((&msgs[0]["id"], msgs[0]["deliver_at_ms"].as_u64()), (&json!("k-nacked"), retry_at));
    assert_eq!(s.ack(&receipt(&msgs[0])), 200);
    assert_eq!(at(&s, "k-nacked"), ("done".into(), retry_at));

    s.restart();
    assert_eq!(at(&s, "k-delayed"), ("cancelled".into(), delayed["deliver_at_ms"].as_u64()));
    assert_eq!(at(&s, "k-reserved"), ("cancelled".into(), reserved["deliver_at_ms"].as_u64()));
    assert_eq!(at(&s, "k-nacked"), ("done".into(), retry_at));
}

#[test]
fn never_early_across_delays_and_levels() {
    let s = Server::start(&[]);
    let mut due = Vec::new();
    for (i, spec) in [
        json!({"body": "0", "delay_ms": 0}),
        json!({"body": "1", "delay_ms": 150}),
        json!({"body": "2", "delay_ms": 1234}),
        json!({"body": "3", "deliver_at_ms": now_ms() + 700}),
        json!({"body": "4", "deliver_at_ms": now_ms() - 60_000}),
        json!({"body": "5", "level": "1s"}),
        json!({"body": "6", "level": 1}),
        json!({"body": "7"}),
    ]
    .iter()
    .enumerate()
    {
        let v = s.produce("t", spec);
        due.push((i.to_string(), v["deliver_at_ms"].as_u64().unwrap()));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = 0;
    while seen < due.len() {
        assert!(Instant::now() < deadline, "only {seen} of {} delivered", due.len());
        let (msgs, at) = s.pop("t", 10, 2000, None);
        for m in msgs {
            let body = m["body"].as_str().unwrap();
            let (_, d) = due.iter().find(|(b, _)| b == body).unwrap();
            assert!(at >= *d, "message {body} popped at {at}, due {d}");
            assert_eq!(s.ack(&receipt(&m)), 200);
            seen += 1;
        }
    }
}

/// Unix time in microseconds, finer than the server's milliseconds.
fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970").as_micros()
        as u64
}

#[test]
fn deliver_at_is_never_before_the_send_time_plus_the_delay() {
    let s = Server::start(&[]);
    for i in 0..300u64 {
        // The server's clock is this clock; the request leaves after `sent_us`.
        let (spec, delay_ms) = match i % 3 {
            0 => (json!({"body": "d", "delay_ms": 1000 + i}), 1000 + i),
            1 => (json!({"body": "l", "level": "5s"}), 5000),
            _ => (json!({"body": "n", "delay_ms": 7}), 7),
        };
        let sent_us = now_us();
        let due = s.produce("round", &spec)["deliver_at_ms"].as_u64().unwrap();
        assert!(
            due * 1000 >= sent_us + delay_ms * 1000,
            "{spec}: deliver_at_ms {due} is before the send time {sent_us}us + {delay_ms}ms"
        );
    }
    // An absolute time in the past is due now, and the answer says when that is.
    for at in [0, 100_000_000_000, now_us() / 1000 - 60_000] {
        let before = now_ms();
        let due =
            s.produce("round", &json!({"body": "p", "deliver_at_ms": at}))["deliver_at_ms"].as_u64().unwrap();
        let after = now_ms();
        assert!(
            (before..=after).contains(&due),
            "deliver_at_ms {at}: answered {due}, not now ({before}..{after})"
        );
    }
    let due_at = now_ms() + 60_000;
    assert_eq!(s.produce("round", &json!({"body": "f", "deliver_at_ms": due_at}))["deliver_at_ms"], due_at);
}

#[test]
fn pop_takes_up_to_max_batch_messages() {
    let s = Server::start(&[("DELAYD_MAX_BATCH", "1500")]);
    let batch: Vec<Value> = (0..1500).map(|i| json!({"body": i.to_string()})).collect();
    let (st, v) = s.post("/v1/topics/many/messages/batch", &json!({ "messages": batch }));
    assert_eq!(st, 201, "{}", &v.to_string()[..200.min(v.to_string().len())]);
    let (st, v) = s.post_raw("/v1/topics/many/pop?max=1501", None, Vec::new());
    Server::assert_error(st, &v, 400, "invalid_argument");
    assert!(v["error"]["message"].as_str().unwrap().contains("1500"), "{v}");
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < 1500 {
        assert!(Instant::now() < deadline, "only {got} of 1500 ready");
        let (msgs, _) = s.pop("many", 1500, 2000, None);
        assert!(msgs.len() <= 1500);
        got += msgs.len();
    }
    // Ready messages at once: one pop takes all of them, over the old fixed cap of 1,000.
    let batch: Vec<Value> = (0..1200).map(|i| json!({"body": i.to_string()})).collect();
    assert_eq!(s.post("/v1/topics/more/messages/batch", &json!({ "messages": batch })).0, 201);
    let (msgs, _) = s.pop("more", 1500, 2000, None);
    assert_eq!(msgs.len(), 1200);
}

#[test]
fn long_poll_returns_when_a_message_lands() {
    let s = Server::start(&[]);
    let url = s.url("/v1/topics/wake/pop?wait_ms=5000");
    let started = Instant::now();
    let waiter = std::thread::spawn(move || {
        let (st, v) = common::answer(common::client().post(url).send());
        (st, v, started.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    s.produce("wake", &json!({"body": "now"}));
    let (st, v, took) = waiter.join().unwrap();
    assert_eq!(st, 200);
    let msgs = v["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 1, "the waiting pop did not get the message: {v}");
    assert_eq!(msgs[0]["body"], "now");
    assert!(took < Duration::from_millis(5000), "pop waited its full 5s ({took:?}) instead of waking");

    // With nothing to deliver, the wait is honoured and the list is empty.
    let t = Instant::now();
    let (msgs, _) = s.pop("wake", 1, 300, None);
    assert!(msgs.is_empty());
    assert!(t.elapsed() >= Duration::from_millis(290), "returned after {:?}", t.elapsed());
}

#[test]
fn unacked_message_comes_back_after_its_ttr_with_attempt_plus_one() {
    let s = Server::start(&[("DELAYD_DEFAULT_TTR", "400ms")]);
    let id = s.produce("ttr", &json!({"body": "b"}))["id"].as_str().unwrap().to_string();
    let popped_from = now_ms();
    let (first, _) = s.pop("ttr", 1, 2000, Some(300));
    assert_eq!(first.len(), 1);
    assert_eq!(first[0]["attempt"], 1);
    // The redelivery is reserved for long enough that the ack below is in time on a loaded machine.
    let (again, at) = s.pop("ttr", 1, 5000, Some(60_000));
    assert_eq!(again.len(), 1, "not redelivered after its ttr");
    assert_eq!(again[0]["id"], id.as_str());
    assert_eq!(again[0]["attempt"], 2);
    assert!(at >= popped_from + 300, "redelivered {}ms after the pop, ttr was 300", at - popped_from);
    assert_ne!(receipt(&again[0]), receipt(&first[0]), "each delivery gets a new receipt");
    let (st, v) = s.post("/v1/ack", &json!({"receipt": receipt(&first[0])}));
    Server::assert_error(st, &v, 404, "not_found");
    assert_eq!(s.ack(&receipt(&again[0])), 200);

    // The message's own ttr_ms applies when the pop names none.
    s.produce("ttr", &json!({"id": "own-ttr", "body": "b", "ttr_ms": 200}));
    let t0 = now_ms();
    assert_eq!(s.pop("ttr", 1, 2000, None).0.len(), 1);
    let (again, at) = s.pop("ttr", 1, 5000, Some(60_000));
    assert_eq!(again[0]["id"], "own-ttr");
    assert_eq!(again[0]["attempt"], 2);
    assert!(at >= t0 + 200);
    assert_eq!(s.ack(&receipt(&again[0])), 200);

    // Neither sets one: the configured default_ttr (400ms here) applies.
    s.produce("ttr", &json!({"id": "default-ttr", "body": "b"}));
    let t0 = now_ms();
    assert_eq!(s.pop("ttr", 1, 2000, None).0.len(), 1);
    let (again, at) = s.pop("ttr", 1, 5000, Some(60_000));
    assert_eq!(again[0]["id"], "default-ttr");
    assert_eq!(again[0]["attempt"], 2);
    assert!(at >= t0 + 400, "back after {}ms, default_ttr is 400ms", at - t0);
}

#[test]
fn nack_follows_the_backoff_then_dead_letters() {
    let s = Server::start(&[]);
    s.produce("jobs", &json!({"id": "job-1", "body": "work", "max_attempts": 3, "backoff": [100, "200ms"]}));
    let steps = [100u64, 200];
    for attempt in 1..=3u64 {
        let (msgs, _) = s.pop("jobs", 1, 5000, None);
        assert_eq!(msgs.len(), 1, "attempt {attempt} never delivered");
        assert_eq!(msgs[0]["attempt"], attempt);
        let t = now_ms();
        let (st, v) = s.post("/v1/nack", &json!({"receipt": receipt(&msgs[0])}));
        assert_eq!(st, 200, "{v}");
        if attempt < 3 {
            assert_eq!(v["state"], "retry", "{v}");
            let at = v["deliver_at_ms"].as_u64().unwrap();
            let step = steps[attempt as usize - 1];
            assert!(at >= t + step, "retry at {at}, nack at {t}, step {step}");
        } else {
            assert_eq!(v, json!({"state": "dead", "topic": "jobs.dlq"}));
        }
    }
    assert!(s.pop("jobs", 1, 400, None).0.is_empty(), "a dead message is not in its topic any more");
    let (st, info) = s.get("/v1/messages/job-1");
    assert_eq!(st, 200);
    assert_eq!(info["state"], "dead");
    assert_eq!(info["dead_letter_topic"], "jobs.dlq", "a dead message says where it is: {info}");
    let (dead, _) = s.pop("jobs.dlq", 1, 3000, None);
    assert_eq!(dead.len(), 1, "nothing in the dead-letter topic");
    assert_eq!(dead[0]["body"], "work");
    assert_eq!(s.ack(&receipt(&dead[0])), 200);
    let (_, info) = s.get("/v1/messages/job-1");
    assert_eq!((&info["state"], &info["dead_letter_topic"]), (&json!("done"), &json!("jobs.dlq")), "{info}");
    let (_, stats) = s.get("/v1/stats");
    let jobs =
        stats["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "jobs").expect("jobs in stats");
    assert_eq!(jobs["dead_lettered"], 1, "{stats}");

    // An explicit delay_ms overrides the backoff.
    s.produce("jobs", &json!({"id": "job-2", "body": "w"}));
    let (msgs, _) = s.pop("jobs", 1, 2000, None);
    let t = now_ms();
    let (st, v) = s.post("/v1/nack", &json!({"receipt": receipt(&msgs[0]), "delay_ms": 250}));
    assert_eq!(st, 200);
    assert!(v["deliver_at_ms"].as_u64().unwrap() >= t + 250, "{v}");
    let (msgs, at) = s.pop("jobs", 1, 5000, None);
    assert_eq!(msgs[0]["id"], "job-2");
    assert_eq!(msgs[0]["attempt"], 2);
    assert!(at >= t + 250);
    let (st, v) = s.post("/v1/nack", &json!({"receipt": "no-such-receipt"}));
    Server::assert_error(st, &v, 404, "not_found");
}

#[test]
fn expiring_reservations_count_as_attempts_and_dead_letter_too() {
    let s = Server::start(&[]);
    s.produce("exp", &json!({"id": "exp-1", "body": "b", "max_attempts": 2}));
    for attempt in 1..=2 {
        let (msgs, _) = s.pop("exp", 1, 5000, Some(200));
        assert_eq!(msgs.len(), 1, "attempt {attempt} never delivered");
        assert_eq!(msgs[0]["attempt"], attempt);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.get("/v1/messages/exp-1").1["state"] != "dead" {
        assert!(Instant::now() < deadline, "not dead: {}", s.get("/v1/messages/exp-1").1);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (dead, _) = s.pop("exp.dlq", 1, 5000, None);
    assert_eq!(dead.len(), 1, "never reached the dead-letter topic");
    assert_eq!(dead[0]["id"], "exp-1");
    assert!(s.pop("exp", 1, 300, None).0.is_empty(), "a dead message is not in its topic any more");
}

#[test]
fn cancel_and_look_up() {
    let s = Server::start(&[]);
    s.produce("c", &json!({"id": "c-ready", "body": "r"}));
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.get("/v1/messages/c-ready").1["state"] != "ready" {
        assert!(Instant::now() < deadline, "{}", s.get("/v1/messages/c-ready").1);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.delete("/v1/messages/c-ready").0, 200);
    assert_eq!(s.get("/v1/messages/c-ready").1["state"], "cancelled");
    s.produce("c", &json!({"id": "c-1", "body": "x", "delay_ms": 400}));
    let (st, v) = s.delete("/v1/messages/c-1");
    assert_eq!(st, 200, "{v}");
    assert_eq!(s.get("/v1/messages/c-1").1["state"], "cancelled");
    assert!(s.pop("c", 1, 1200, None).0.is_empty(), "a cancelled message was delivered");

    let (st, v) = s.delete("/v1/messages/never-was");
    Server::assert_error(st, &v, 404, "not_found");
    let (st, v) = s.get("/v1/messages/never-was");
    Server::assert_error(st, &v, 404, "not_found");

    s.produce("c", &json!({"id": "c-2", "body": "y"}));
    let (msgs, _) = s.pop("c", 1, 2000, None);
    assert_eq!(s.ack(&receipt(&msgs[0])), 200);
    let (st, v) = s.delete("/v1/messages/c-2");
    Server::assert_error(st, &v, 409, "conflict");

    // Ids are any printable text without whitespace: unicode and URL-special characters work.
    for id in ["заказ№5", "🦀/1?x=y#z"] {
        s.produce("c", &json!({"id": id, "body": "u", "delay_ms": 60_000}));
        let enc: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
        let (st, v) = s.get(&format!("/v1/messages/{enc}"));
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["id"], id);
        assert_eq!(s.delete(&format!("/v1/messages/{enc}")).0, 200);
    }
    let (st, v) = s.get("/v1/messages/has%20space");
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.get(&format!("/v1/messages/{}", "x".repeat(129)));
    Server::assert_error(st, &v, 400, "invalid_argument");
}

#[test]
fn identical_produce_is_idempotent_and_different_content_conflicts() {
    let s = Server::start(&[]);
    let req = json!({"id": "order-42", "body": "pay", "delay_ms": 400});
    let first = s.produce("pay", &req);
    std::thread::sleep(Duration::from_millis(50));
    let (st, again) = s.post("/v1/topics/pay/messages", &req);
    assert_eq!(st, 200, "a repeat is 200: {again}");
    assert_eq!(again, first, "a repeat returns the original deliver_at_ms");

    let at = json!({"id": "at-1", "body": "b", "deliver_at_ms": now_ms() + 500});
    let first_at = s.produce("pay", &at);
    let (st, again) = s.post("/v1/topics/pay/messages", &at);
    assert_eq!((st, again), (200, first_at));

    for (topic, body) in [
        ("pay", json!({"id": "order-42", "body": "other", "delay_ms": 400})),
        ("pay", json!({"id": "order-42", "body": "pay", "delay_ms": 401})),
        ("pay", json!({"id": "order-42", "body": "pay"})),
        ("other", json!({"id": "order-42", "body": "pay", "delay_ms": 400})),
    ] {
        let (st, v) = s.post(&format!("/v1/topics/{topic}/messages"), &body);
        Server::assert_error(st, &v, 409, "conflict");
    }
    let (msgs, _) = s.pop("pay", 10, 3000, None);
    let mut ids: Vec<_> = msgs.iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    if ids.len() < 2 {
        ids.extend(s.pop("pay", 10, 3000, None).0.iter().map(|m| m["id"].as_str().unwrap().to_string()));
    }
    ids.sort();
    assert_eq!(ids, ["at-1", "order-42"], "each id delivered once");
    assert!(s.pop("pay", 10, 300, None).0.is_empty());
}

/// Unix seconds sent as `deliver_at_ms` would be due in 1970, so delivered at once: every produce
/// path refuses a nonzero value below 10^11 and says it looks like seconds.
#[test]
fn deliver_at_in_seconds_is_refused_on_every_produce_path() {
    let s = Server::start(&[]);
    let secs = now_ms() / 1000 + 3600;
    let says_seconds = |m: &str| {
        assert!(m.contains("deliver_at_ms") && m.contains("looks like seconds"), "{m}");
        assert!(m.contains(&secs.to_string()) && m.contains(&(secs * 1000).to_string()), "{m}");
    };
    let (st, v) = s.post("/v1/topics/secs/messages", &json!({"body": "x", "deliver_at_ms": secs}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    says_seconds(v["error"]["message"].as_str().unwrap_or_default());
    let (st, v) = s.post(
        "/v1/topics/secs/messages/batch",
        &json!({"messages": [{"body": "y", "deliver_at_ms": secs}, {"body": "z", "deliver_at_ms": 99_999_999_999u64}]}),
    );
    assert_eq!(st, 201, "{v}");
    for r in v["results"].as_array().expect("results") {
        assert_eq!(r["error"]["code"], "invalid_argument", "{v}");
    }
    says_seconds(v["results"][0]["error"]["message"].as_str().unwrap_or_default());
    assert!(s.pop("secs", 5, 300, None).0.is_empty(), "a refused deliver_at_ms must store nothing");
    // The same instant in ms is taken.
    let (st, v) = s.post("/v1/topics/secs/messages", &json!({"body": "x", "deliver_at_ms": secs * 1000}));
    assert_eq!((st, v["deliver_at_ms"].as_u64()), (201, Some(secs * 1000)), "{v}");
}

#[test]
fn batch_accepts_the_valid_messages_and_reports_each_error() {
    let s = Server::start(&[("DELAYD_MAX_BATCH", "5")]);
    let (st, v) = s.post(
        "/v1/topics/b/messages/batch",
        &json!({"messages": [
            {"body": "one"},
            {"body": "two", "delay_ms": -1},
            {"id": "b-3", "body": "three", "delay_ms": 100},
            {"body": "four", "colour": "red"},
            "not an object"
        ]}),
    );
    assert_eq!(st, 201, "{v}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 5);
    assert!(results[0]["id"].is_string() && results[0]["deliver_at_ms"].is_u64(), "{v}");
    assert_eq!(results[1]["error"]["code"], "invalid_argument");
    assert!(results[1]["error"]["message"].as_str().unwrap().contains("delay_ms"));
    assert_eq!(results[2]["id"], "b-3");
    assert!(results[3]["error"]["message"].as_str().unwrap().contains("colour"));
    assert!(results[4]["error"].is_object());
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < 2 && Instant::now() < deadline {
        got.extend(s.pop("b", 5, 2000, None).0.iter().map(|m| m["body"].as_str().unwrap().to_string()));
    }
    got.sort();
    assert_eq!(got, ["one", "three"]);

    let six: Vec<Value> = (0..6).map(|i| json!({"body": i.to_string()})).collect();
    let (st, v) = s.post("/v1/topics/b/messages/batch", &json!({ "messages": six }));
    Server::assert_error(st, &v, 413, "too_large");
    assert!(s.pop("b", 5, 300, None).0.is_empty(), "a refused batch must have no effect");
    let (st, v) = s.post("/v1/topics/b/messages/batch", &json!({"messages": []}));
    assert_eq!((st, v), (201, json!({"results": []})));
    let (st, v) = s.post("/v1/topics/b/messages/batch", &json!([{"body": "x"}]));
    Server::assert_error(st, &v, 400, "invalid_argument");
}

#[test]
fn every_error_status_has_the_json_shape() {
    let s = Server::start(&[]);
    let p = "/v1/topics/e/messages";
    /// Content-Type, body, expected status, code and a word the message must contain.
    type Case<'a> = (Option<&'a str>, Vec<u8>, u16, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (Some("application/json"), b"{\"body\": ".to_vec(), 400, "invalid_json", "malformed"),
        (Some("application/json"), b"{\"body\":\"x\"} {}".to_vec(), 400, "invalid_json", "malformed"),
        (
            Some("application/json"),
            br#"{"body":"x","dealy_ms":5}"#.to_vec(),
            400,
            "invalid_argument",
            "dealy_ms",
        ),
        (Some("application/json"), br#"{"delay_ms":5}"#.to_vec(), 400, "invalid_argument", "body"),
        (
            Some("application/json"),
            br#"{"body":"x","delay_ms":"5"}"#.to_vec(),
            400,
            "invalid_argument",
            "delay_ms",
        ),
        (
            Some("application/json"),
            br#"{"body":"x","delay_ms":-5}"#.to_vec(),
            400,
            "invalid_argument",
            "delay_ms",
        ),
        (
            Some("application/json"),
            br#"{"body":"x","delay_ms":99999999999999999999999}"#.to_vec(),
            400,
            "",
            "",
        ),
        (
            Some("application/json"),
            br#"{"body":"x","delay_ms":2592000001}"#.to_vec(),
            400,
            "invalid_argument",
            "max_delay",
        ),
        (
            Some("application/json"),
            br#"{"body":"x","delay_ms":1,"level":1}"#.to_vec(),
            400,
            "invalid_argument",
            "",
        ),
        (
            Some("application/json"),
            br#"{"body":"x","level":"3s"}"#.to_vec(),
            400,
            "invalid_argument",
            "level",
        ),
        (Some("application/json"), br#"{"body":"x","ttr_ms":0}"#.to_vec(), 400, "invalid_argument", "ttr_ms"),
        (
            Some("application/json"),
            br#"{"body":"x","max_attempts":0}"#.to_vec(),
            400,
            "invalid_argument",
            "max_",
        ),
        (Some("application/json"), br#"{"body":"x","id":"a b"}"#.to_vec(), 400, "invalid_argument", "id"),
        (Some("application/json"), br#"{"body":{"a":1}}"#.to_vec(), 400, "invalid_argument", "body"),
        (Some("text/plain"), br#"{"body":"x"}"#.to_vec(), 415, "unsupported_media_type", "application/json"),
        (None, br#"{"body":"x"}"#.to_vec(), 415, "unsupported_media_type", "application/json"),
        (
            Some("application/x-www-form-urlencoded"),
            b"body=x".to_vec(),
            415,
            "unsupported_media_type",
            "application/json",
        ),
    ];
    for (ct, body, status, code, needle) in cases {
        let shown = String::from_utf8_lossy(&body).to_string();
        let (st, v) = s.post_raw(p, ct, body);
        assert_eq!(st, status, "{shown} -> {v}");
        if !code.is_empty() {
            assert_eq!(v["error"]["code"], code, "{shown} -> {v}");
        }
        let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{shown} -> {v}"));
        assert!(msg.contains(needle), "{shown}: message {msg:?} should mention {needle:?}");
    }

    // A body over max_body_bytes (64KiB here) is 413, whether the field or the whole request is too big.
    let big = "x".repeat(65 * 1024);
    let (st, v) = s.post(p, &json!({ "body": big }));
    Server::assert_error(st, &v, 413, "too_large");
    let huge = "x".repeat(300 * 1024);
    let (st, v) = s.post(p, &json!({ "body": huge }));
    Server::assert_error(st, &v, 413, "too_large");
    let ok = "x".repeat(64 * 1024);
    assert_eq!(s.post(p, &json!({ "body": ok })).0, 201, "a body of exactly max_body_bytes is accepted");

    // Any name is a topic (compat ones may hold spaces); one too long to store once escaped is not.
    let (st, v) = s.post(&format!("/v1/topics/{}/messages", "%20".repeat(43)), &json!({"body": "x"}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.post(&format!("/v1/topics/{}/messages", "t".repeat(129)), &json!({"body": "x"}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.get("/v1/nothing-here");
    Server::assert_error(st, &v, 404, "no_such_endpoint");
    let (st, v) = s.get("/v1/topics/e/pop");
    Server::assert_error(st, &v, 405, "method_not_allowed");
    for q in ["max=0", "max=abc", "wait_ms=-1", "ttr_ms=0", "colour=red"] {
        let (st, v) = s.post_raw(&format!("/v1/topics/e/pop?{q}"), None, Vec::new());
        Server::assert_error(st, &v, 400, "invalid_argument");
    }
    let (st, v) = s.post("/v1/ack", &json!({"receipt": ""}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.post("/v1/ack", &json!({"receipt": "r", "extra": 1}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let (st, v) = s.post("/v1/nack", &json!({"receipt": "r", "delay_ms": 1e3}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    assert_eq!(s.get("/healthz").0, 200, "the server is still serving");
}

#[test]
fn stats_and_metrics_report_the_counters() {
    let s = Server::start(&[]);
    for i in 0..3 {
        s.produce("m", &json!({"body": i.to_string()}));
    }
    s.produce("m", &json!({"body": "later", "delay_ms": 600_000}));
    let (msgs, _) = s.pop("m", 2, 2000, Some(60_000));
    assert_eq!(msgs.len(), 2);
    assert_eq!(s.ack(&receipt(&msgs[0])), 200);

    let (st, stats) = s.get("/v1/stats");
    assert_eq!(st, 200);
    assert_eq!(stats["levels"].as_array().unwrap().len(), 21, "{stats}");
    let backlog: u64 =
        stats["levels"].as_array().unwrap().iter().map(|l| l["backlog"].as_u64().unwrap()).sum();
    assert!(backlog >= 1, "the 10m message waits on a level: {stats}");
    assert!(stats["levels"].as_array().unwrap().iter().any(|l| l["next_due_ms"].is_u64()), "{stats}");
    let m = stats["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "m").expect("topic m");
    assert_eq!(m["ready"], 1, "{stats}");
    assert_eq!(m["reserved"], 1, "{stats}");
    assert!(stats["disk_bytes"].as_u64().unwrap() > 0);

    let r = s.http().get(s.url("/metrics")).send().unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    let text = r.text().unwrap();
    let value = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '));
        line.unwrap_or_else(|| panic!("{name} missing:\n{text}")).rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("delayd_produced_total"), 4.0);
    assert_eq!(value("delayd_popped_total"), 2.0);
    assert_eq!(value("delayd_acked_total"), 1.0);
    assert_eq!(value("delayd_topic_ready{topic=\"m\"}"), 1.0);
    assert_eq!(value("delayd_topic_reserved{topic=\"m\"}"), 1.0);
    assert!(value("delayd_disk_bytes") > 0.0);
    assert!(value("delayd_lateness_seconds_count") >= 0.0);
    assert!(text.contains("delayd_level_backlog{level=\"1s\"}"), "{text}");
    assert!(text.contains("delayd_flush_duration_seconds_bucket{le=\"+Inf\"}"), "{text}");
}

#[test]
fn bearer_token_guards_everything_but_healthz_and_the_dashboard_page() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", "s3cret")]);
    let c = s.http();
    assert_eq!(c.get(s.url("/healthz")).send().unwrap().status(), 200);
    // The page holds no data: it asks for the token and sends it with its own calls to /v1.
    for path in ["/ui", "/ui/app.js", "/ui/app.css"] {
        assert_eq!(c.get(s.url(path)).send().unwrap().status(), 200, "{path}");
    }
    for (method, path) in [
        ("POST", "/v1/topics/a/messages"),
        ("POST", "/v1/topics/a/messages/batch"),
        ("POST", "/v1/topics/a/pop"),
        ("POST", "/v1/ack"),
        ("POST", "/v1/nack"),
        ("GET", "/v1/messages/x"),
        ("DELETE", "/v1/messages/x"),
        ("GET", "/v1/messages/x/history"),
        ("GET", "/v1/stats"),
        ("GET", "/v1/topics"),
        ("POST", "/v1/topics/a/pause"),
        ("POST", "/v1/topics/a/resume"),
        ("GET", "/v1/topics/a/messages"),
        ("POST", "/v1/topics/a/redrive"),
        ("POST", "/v1/topics/a/purge"),
        ("GET", "/metrics"),
        ("POST", "/push"),
        ("POST", "/pop"),
        ("POST", "/finish"),
        ("POST", "/delete"),
        ("POST", "/get"),
    ] {
        for auth in [None, Some("Bearer wrong"), Some("s3cret"), Some("Basic czNjcmV0")] {
            let mut req =
                c.request(method.parse().unwrap(), s.url(path)).json(&json!({"id": "x", "body": "b"}));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let (st, v) = common::answer(req.send());
            if path.starts_with("/v1") || path == "/metrics" {
                Server::assert_error(st, &v, 401, "unauthorized");
            } else {
                // Compat paths answer in the compat shape (tests/http_compat.rs checks it whole).
                assert_eq!((st, &v["code"]), (401, &json!(1)), "{path}: {v}");
            }
        }
    }
    // A refused produce had no effect.
    let authed = |path: &str| c.get(s.url(path)).bearer_auth("s3cret");
    let (st, _) = common::answer(authed("/v1/messages/x").send());
    assert_eq!(st, 404);
    let (st, v) = common::answer(
        c.post(s.url("/v1/topics/a/messages"))
            .bearer_auth("s3cret")
            .json(&json!({"id": "y", "body": "b"}))
            .send(),
    );
    assert_eq!(st, 201, "{v}");
    assert_eq!(common::answer(authed("/v1/messages/y").send()).0, 200);
    assert_eq!(common::answer(authed("/metrics").send()).0, 200);
}

/// The history lists every recorded change, newest first, back to the produce; it survives a
/// restart (it is read from the log).
#[test]
fn history_lists_each_change_back_to_the_produce() {
    let mut s = Server::start(&[]);
    let produced = s.produce("h", &json!({"id": "h1", "body": "x", "delay_ms": 50}));
    let (m, _) = s.pop("h", 1, 5000, None);
    let (st, v) = s.post("/v1/nack", &json!({"receipt": receipt(&m[0]), "delay_ms": 50}));
    assert_eq!(st, 200, "{v}");
    let (m, _) = s.pop("h", 1, 5000, None);
    assert_eq!(s.ack(&receipt(&m[0])), 200);
    let want = ["ack", "reserve", "due", "nack", "reserve", "due", "produced"];
    for round in 0..2 {
        let (st, v) = s.get("/v1/messages/h1/history");
        assert_eq!(st, 200, "{v}");
        let h = v["history"].as_array().unwrap();
        let events: Vec<&str> = h.iter().map(|e| e["event"].as_str().unwrap()).collect();
        assert_eq!(events, want, "round {round}: {v}");
        assert_eq!((&v["id"], &v["complete"]), (&json!("h1"), &json!(true)));
        let last = h.last().unwrap();
        assert_eq!((&last["state"], &last["deliver_at_ms"]), (&json!("delayed"), &produced["deliver_at_ms"]));
        assert_eq!((&h[0]["state"], &h[0]["attempt"]), (&json!("done"), &json!(2)));
        let times: Vec<u64> = h.iter().map(|e| e["time_ms"].as_u64().unwrap()).collect();
        assert!(times.windows(2).all(|w| w[0] >= w[1]), "newest first: {times:?}");
        s.restart();
    }
    let (st, v) = s.get("/v1/messages/nope/history");
    Server::assert_error(st, &v, 404, "not_found");
}
