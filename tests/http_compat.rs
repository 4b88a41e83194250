//! The ouqiang/delay-queue compatible API, driven over loopback against the real binary.

mod common;

use std::time::{Duration, Instant};

use common::{now_ms, Server};
use serde_json::{json, Value};

/// POSTs a compat call; every answer must be HTTP 200 with the `{code, message, data}` shape.
fn call(s: &Server, path: &str, ct: Option<&str>, body: &str) -> Value {
    let (st, v) = s.post_raw(path, ct, body.as_bytes().to_vec());
    assert_eq!(st, 200, "{path} {body} -> {v}");
    assert!(v["code"] == 0 || v["code"] == 1, "{v}");
    assert!(v["message"].is_string(), "{v}");
    assert!(v.get("data").is_some(), "{v}");
    v
}

const JSON: Option<&str> = Some("application/json");
const FORM: Option<&str> = Some("application/x-www-form-urlencoded");

#[test]
fn push_get_pop_finish_round_trip() {
    let s = Server::start(&[]);
    let body = r#"{\"uid\": 10829378, \"created\": 1498657365}"#;
    let pushed_at = now_ms();
    let v = call(
        &s,
        "/push",
        JSON,
        &format!(r#"{{"topic":"order","id":"15702398321","delay":1,"ttr":2,"body":"{body}"}}"#),
    );
    assert_eq!(v, json!({"code": 0, "message": "ok", "data": null}));

    let v = call(&s, "/get", JSON, r#"{"id":"15702398321"}"#);
    assert_eq!(v["code"], 0);
    let d = &v["data"];
    assert_eq!(d["topic"], "order");
    assert_eq!(d["id"], "15702398321");
    assert_eq!(d["ttr"], 2);
    assert_eq!(d["body"], r#"{"uid": 10829378, "created": 1498657365}"#);
    let delay_s = d["delay"].as_u64().unwrap();
    assert!(delay_s * 1000 >= pushed_at + 1000 && delay_s * 1000 <= pushed_at + 3000, "delay {delay_s}");

    // A pop long-polls (1s cap here) until the job is due; never before push time + delay.
    let deadline = Instant::now() + Duration::from_secs(10);
    let job = loop {
        let v = call(&s, "/pop", JSON, r#"{"topic":"order"}"#);
        assert_eq!(v["code"], 0, "{v}");
        if !v["data"].is_null() {
            break v["data"].clone();
        }
        assert!(Instant::now() < deadline, "job never popped");
    };
    let popped_at = now_ms();
    assert!(popped_at >= pushed_at + 1000, "popped {}ms after push, delay was 1s", popped_at - pushed_at);
    assert_eq!(
        job,
        json!({"id": "15702398321", "body": r#"{"uid": 10829378, "created": 1498657365}"#, "topic": "order"})
    );

    let v = call(&s, "/finish", JSON, r#"{"id":"15702398321"}"#);
    assert_eq!(v["code"], 0, "{v}");
    assert_eq!(call(&s, "/get", JSON, r#"{"id":"15702398321"}"#)["data"], Value::Null);
    assert_eq!(s.get("/v1/messages/15702398321").1["state"], "done");
    // Nothing comes back after its ttr once finished.
    let v = call(&s, "/pop", JSON, r#"{"topic":"order"}"#);
    assert_eq!(v["data"], Value::Null);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(call(&s, "/pop", JSON, r#"{"topic":"order"}"#)["data"], Value::Null);
}

#[test]
fn any_content_type_and_form_bodies_are_accepted() {
    let s = Server::start(&[]);
    // curl -d sends a form content type with a JSON body.
    let v = call(&s, "/push", FORM, r#"{"topic":"a","id":"f-1","delay":0,"ttr":5,"body":"from curl"}"#);
    assert_eq!(v["code"], 0, "{v}");
    let v = call(&s, "/push", FORM, "topic=b&id=f-2&delay=0&ttr=5&body=%7B%22k%22%3A1%7D");
    assert_eq!(v["code"], 0, "{v}");
    let v = call(&s, "/push", Some("text/plain"), r#"{"topic":"b","id":"f-3","delay":0,"ttr":5,"body":"t"}"#);
    assert_eq!(v["code"], 0, "{v}");
    let v = call(&s, "/push", None, r#"{"topic":"b","id":"f-4","delay":0,"ttr":5,"body":"n"}"#);
    assert_eq!(v["code"], 0, "{v}");
    // The original answers on these paths whatever the method.
    let (st, v) = common::answer(s.http().put(s.url("/get")).body(r#"{"id":"f-4"}"#).send());
    assert_eq!((st, &v["data"]["id"]), (200, &json!("f-4")), "{v}");

    // Comma-separated topics pop from either.
    let mut got = Vec::new();
    for _ in 0..4 {
        let v = call(&s, "/pop", FORM, "topic=a,%20b");
        got.push(v["data"]["id"].as_str().expect("a job").to_string());
    }
    got.sort();
    assert_eq!(got, ["f-1", "f-2", "f-3", "f-4"]);
    assert_eq!(s.get("/v1/messages/f-2").1["body"], r#"{"k":1}"#);
}

#[test]
fn delete_removes_and_unfinished_jobs_come_back_after_ttr() {
    let s = Server::start(&[]);
    call(&s, "/push", JSON, r#"{"topic":"d","id":"del-1","delay":1,"ttr":1,"body":"x"}"#);
    assert_eq!(call(&s, "/delete", JSON, r#"{"id":"del-1"}"#)["code"], 0);
    assert_eq!(call(&s, "/get", JSON, r#"{"id":"del-1"}"#)["data"], Value::Null);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1500) {
        assert_eq!(call(&s, "/pop", JSON, r#"{"topic":"d"}"#)["data"], Value::Null, "deleted job delivered");
    }
    // As in the original API, deleting or finishing an unknown job is not an error.
    assert_eq!(call(&s, "/delete", JSON, r#"{"id":"never"}"#)["code"], 0);
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"never"}"#)["code"], 0);

    call(&s, "/push", JSON, r#"{"topic":"d","id":"ttr-1","delay":0,"ttr":1,"body":"y"}"#);
    let first = now_ms();
    assert_eq!(call(&s, "/pop", JSON, r#"{"topic":"d"}"#)["data"]["id"], "ttr-1");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = call(&s, "/pop", JSON, r#"{"topic":"d"}"#);
        if !v["data"].is_null() {
            assert_eq!(v["data"]["id"], "ttr-1");
            assert!(now_ms() >= first + 1000, "redelivered before its 1s ttr");
            break;
        }
        assert!(Instant::now() < deadline, "unfinished job never came back");
    }
    assert_eq!(s.get("/v1/messages/ttr-1").1["attempt"], 2);
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"ttr-1"}"#)["code"], 0);
    assert_eq!(s.get("/v1/messages/ttr-1").1["state"], "done");

    // Finishing a job that was never popped removes it, as the original API does.
    call(&s, "/push", JSON, r#"{"topic":"d","id":"early-finish","delay":1,"ttr":1,"body":"z"}"#);
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"early-finish"}"#)["code"], 0);
    assert_eq!(call(&s, "/get", JSON, r#"{"id":"early-finish"}"#)["data"], Value::Null);
}

#[test]
fn bad_requests_get_code_1_with_http_200() {
    let s = Server::start(&[]);
    for (path, body, needle) in [
        ("/push", r#"{"topic":"t","delay":1,"ttr":1,"body":"x"}"#, "id"),
        ("/push", r#"{"id":"i","delay":1,"ttr":1,"body":"x"}"#, "topic"),
        ("/push", r#"{"topic":"t","id":"i","delay":-1,"ttr":1,"body":"x"}"#, "delay"),
        ("/push", r#"{"topic":"t","id":"i","delay":99999999999,"ttr":1,"body":"x"}"#, "delay"),
        ("/push", r#"{"topic":"t","id":"i","delay":"soon","ttr":1,"body":"x"}"#, "delay"),
        ("/push", r#"{"topic":"t","id":"i","delay":1,"ttr":0,"body":"x"}"#, "ttr"),
        ("/push", r#"{"topic":"t","id":"i","delay":1,"ttr":86401,"body":"x"}"#, "ttr"),
        ("/push", r#"{"topic":"t","id":"i","delay":1,"body":"x"}"#, "ttr"),
        ("/push", r#"{"topic":"t","id":"i\u0007","delay":1,"ttr":1,"body":"x"}"#, "control"),
        ("/push", r#"{"topic":"t","id":"i","delay":1,"ttr":1,"body":5}"#, "body"),
        ("/push", "not json at all", "parse"),
        ("/push", "[1,2,3]", "object"),
        ("/pop", "{}", "topic"),
        ("/pop", r#"{"topic":" , "}"#, "topic"),
        ("/finish", "{}", "id"),
        ("/delete", r#"{"id":""}"#, "id"),
        ("/get", r#"{"id":7}"#, "id"),
    ] {
        let v = call(&s, path, JSON, body);
        assert_eq!(v["code"], 1, "{path} {body} -> {v}");
        assert_eq!(v["data"], Value::Null);
        let msg = v["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{path} {body}: {msg:?} should mention {needle:?}");
    }
    assert_eq!(s.get("/healthz").0, 200);
}

/// Pops one job from `topics` (a compat pop long-polls up to compat_max_wait, 1 s in these tests).
fn pop(s: &Server, topics: &str) -> Value {
    call(s, "/pop", JSON, &json!({ "topic": topics }).to_string())["data"].clone()
}

fn push(s: &Server, topic: &str, id: &str, delay: u64, ttr: u64, body: &str) {
    let v = call(
        s,
        "/push",
        JSON,
        &json!({"topic": topic, "id": id, "delay": delay, "ttr": ttr, "body": body}).to_string(),
    );
    assert_eq!(v["code"], 0, "push {id}: {v}");
}

#[test]
fn push_of_an_existing_id_replaces_the_job_as_the_original_does() {
    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s")]);
    // Pending: the new topic, delay and body win; the old job never arrives.
    push(&s, "a", "r1", 2, 5, "old");
    push(&s, "b", "r1", 0, 5, "new");
    assert_eq!(pop(&s, "b"), json!({"id": "r1", "body": "new", "topic": "b"}));
    // Reserved: the consumer's job is replaced; the old reservation never redelivers it.
    push(&s, "c", "r2", 0, 1, "first");
    assert_eq!(pop(&s, "c")["body"], "first");
    push(&s, "c", "r2", 0, 1, "second");
    assert_eq!(pop(&s, "c")["body"], "second");
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"r2"}"#)["code"], 0);
    // Finished and deleted: a push starts a new job.
    push(&s, "c", "r3", 0, 5, "one");
    assert_eq!(pop(&s, "c")["body"], "one");
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"r3"}"#)["code"], 0);
    push(&s, "c", "r3", 0, 5, "two");
    push(&s, "c", "r4", 1, 5, "gone");
    assert_eq!(call(&s, "/delete", JSON, r#"{"id":"r4"}"#)["code"], 0);
    push(&s, "c", "r4", 0, 5, "back");
    let mut got = vec![pop(&s, "c")["body"].clone(), pop(&s, "c")["body"].clone()];
    got.sort_by_key(|v| v.to_string());
    assert_eq!(got, [json!("back"), json!("two")]);
    // Nothing else ever arrives: not the replaced r1 (due after 2 s), nor r2's first delivery.
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_millis(3000) {
        assert_eq!(pop(&s, "a,b,c"), Value::Null, "a replaced job was delivered");
    }
    // The native API sees one message per id: the latest.
    let (_, v) = s.get("/v1/messages/r1");
    assert_eq!((&v["topic"], &v["body"]), (&json!("b"), &json!("new")));
}

#[test]
fn a_client_test_sequence_passes_twice_against_one_server() {
    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s")]);
    for round in 0..2 {
        // The sequence of the official client's own tests: push, get, pop, finish; push, delete.
        push(&s, "order", "15702398321", 1, 5, r#"{"uid": 10829378}"#);
        let v = call(&s, "/get", JSON, r#"{"id":"15702398321"}"#);
        assert_eq!(
            (v["code"].clone(), v["data"]["body"].clone()),
            (json!(0), json!(r#"{"uid": 10829378}"#)),
            "round {round}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let job = loop {
            let job = pop(&s, "order");
            if !job.is_null() {
                break job;
            }
            assert!(Instant::now() < deadline, "round {round}: never popped");
        };
        assert_eq!(job["id"], "15702398321", "round {round}");
        assert_eq!(call(&s, "/finish", JSON, r#"{"id":"15702398321"}"#)["code"], 0);
        push(&s, "order", "15702398322", 10, 5, "to delete");
        assert_eq!(call(&s, "/delete", JSON, r#"{"id":"15702398322"}"#)["code"], 0);
        assert_eq!(call(&s, "/get", JSON, r#"{"id":"15702398322"}"#)["data"], Value::Null, "round {round}");
        assert_eq!(call(&s, "/get", JSON, r#"{"id":"15702398321"}"#)["data"], Value::Null, "round {round}");
    }
}

#[test]
fn any_non_empty_topic_and_id_work() {
    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s")]);
    let cases = [
        ("order:close", "id with spaces"),
        ("订单", "订单-1"),
        ("names with spaces", "x/y?z#1"),
        ("50%", "%41"),
    ];
    for (topic, id) in cases {
        push(&s, topic, id, 0, 5, &format!("{topic}|{id}"));
        let v = call(&s, "/get", JSON, &json!({ "id": id }).to_string());
        assert_eq!((&v["data"]["topic"], &v["data"]["id"]), (&json!(topic), &json!(id)), "{v}");
        assert_eq!(pop(&s, topic), json!({"id": id, "body": format!("{topic}|{id}"), "topic": topic}));
        assert_eq!(call(&s, "/finish", JSON, &json!({ "id": id }).to_string())["code"], 0);
    }
    // A native topic name is shared by both APIs; an escaped one never collides with it.
    push(&s, "plain", "p1", 0, 5, "x");
    let (_, v) = s.post_raw("/v1/topics/plain/pop?max=1", None, vec![]);
    assert_eq!(v["messages"][0]["id"], "p1", "{v}");
    // Limits that remain: control characters, and topics past 128 bytes once escaped.
    let v = call(
        &s,
        "/push",
        JSON,
        &json!({"topic": "订".repeat(43), "id": "i", "delay": 0, "ttr": 1, "body": "x"}).to_string(),
    );
    assert_eq!(v["code"], 1, "{v}");
}

#[test]
fn compat_jobs_are_redelivered_forever_unless_compat_max_attempts_is_set() {
    // The native default would dead-letter after one delivery here; a compat job keeps coming.
    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s"), ("DELAYD_MAX_ATTEMPTS", "1")]);
    push(&s, "f", "forever", 0, 1, "x");
    let mut deliveries = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while deliveries < 3 {
        assert!(Instant::now() < deadline, "only {deliveries} deliveries");
        if !pop(&s, "f").is_null() {
            deliveries += 1;
        }
    }
    assert_eq!(s.get("/v1/messages/forever").1["state"], "reserved");

    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s"), ("DELAYD_COMPAT_MAX_ATTEMPTS", "1")]);
    push(&s, "f", "limited", 0, 1, "x");
    assert_eq!(pop(&s, "f")["id"], "limited");
    let deadline = Instant::now() + Duration::from_secs(20);
    while s.get("/v1/messages/limited").1["state"] != "dead" {
        assert!(Instant::now() < deadline, "never dead-lettered");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(pop(&s, "f"), Value::Null);
}

#[test]
fn a_refused_token_on_a_compat_path_answers_in_the_compat_shape() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", "s3cret")]);
    let job = r#"{"topic":"t","id":"a1","delay":0,"ttr":5,"body":"x"}"#;
    for path in ["/push", "/pop", "/finish", "/delete", "/get"] {
        let r = s.http().post(s.url(path)).body(job).send().unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
        assert_eq!(r.headers()["www-authenticate"], "Bearer", "{path}");
        let v: Value = r.json().unwrap();
        assert_eq!((&v["code"], &v["data"]), (&json!(1), &Value::Null), "{path}: {v}");
        assert!(v["message"].as_str().unwrap().contains("bearer token"), "{path}: {v}");
    }
    // The native API keeps its own error shape.
    let (st, v) = s.get("/v1/stats");
    assert_eq!((st, &v["error"]["code"]), (401, &json!("unauthorized")), "{v}");
    let r = s.http().post(s.url("/push")).bearer_auth("s3cret").body(job).send().unwrap();
    let v: Value = r.json().unwrap();
    assert_eq!(v["code"], 0, "{v}");
}

/// A compat topic named as ouqiang users name them, driven through every `/v1/topics/{topic}`
/// route: its name percent-encoded, and as it is where the URL allows (`:` does).
#[test]
fn compat_topic_names_work_through_every_v1_route() {
    let s = Server::start(&[("DELAYD_COMPAT_MAX_WAIT", "1s")]);
    push(&s, "order:close", "c-now", 0, 60, "now");
    push(&s, "order:close", "c-later", 3600, 60, "later");
    let (enc, raw) = ("/v1/topics/order%3Aclose", "/v1/topics/order:close");

    // Listed, counted and measured under the name the client gave.
    let listed = |s: &Server| {
        let (st, v) = s.get("/v1/topics");
        assert_eq!(st, 200, "{v}");
        v["topics"].as_array().unwrap().clone()
    };
    let topics = listed(&s);
    let t = topics.iter().find(|t| t["topic"] == "order:close").unwrap_or_else(|| panic!("{topics:?}"));
    assert_eq!((&t["ready"], &t["delayed"]), (&json!(1), &json!(1)), "{t}");
    assert!(!format!("{topics:?}").contains('%'), "the storage name never shows: {topics:?}");
    let (_, stats) = s.get("/v1/stats");
    assert!(stats["topics"].as_array().unwrap().iter().any(|t| t["topic"] == "order:close"), "{stats}");
    let (_, metrics) = s.get_text("/metrics");
    assert!(metrics.contains("delayd_topic_ready{topic=\"order:close\"} 1"), "{metrics}");
    assert_eq!(s.get("/v1/messages/c-now").1["topic"], "order:close");

    // Browse, both spellings.
    for base in [enc, raw] {
        let (st, v) = s.get(&format!("{base}/messages?state=delayed"));
        assert_eq!(st, 200, "{base}: {v}");
        assert_eq!(v["messages"][0]["id"], "c-later", "{base}: {v}");
        assert_eq!(v["messages"][0]["topic"], "order:close", "{base}: {v}");
    }

    // Pause stops the compat pop; resume lets it through.
    let (st, v) = s.post(&format!("{enc}/pause"), &json!({}));
    assert_eq!((st, &v), (200, &json!({"topic": "order:close", "paused": true})));
    assert_eq!(listed(&s).iter().find(|t| t["topic"] == "order:close").unwrap()["paused"], true);
    assert_eq!(pop(&s, "order:close"), Value::Null, "paused");
    let (st, v) = s.post(&format!("{raw}/resume"), &json!({}));
    assert_eq!((st, &v), (200, &json!({"topic": "order:close", "paused": false})));
    assert_eq!(pop(&s, "order:close")["id"], "c-now");
    assert_eq!(call(&s, "/finish", JSON, r#"{"id":"c-now"}"#)["code"], 0);

    // Produce, pop and nack natively; the dead letter is redriven back.
    let (st, v) = s.post(&format!("{enc}/messages"), &json!({"id": "n1", "body": "b", "max_attempts": 1}));
    assert_eq!(st, 201, "{v}");
    let (st, v) = s.post_raw(&format!("{raw}/pop?max=1"), None, vec![]);
    assert_eq!((st, &v["messages"][0]["id"]), (200, &json!("n1")), "{v}");
    let receipt = v["messages"][0]["receipt"].as_str().unwrap().to_string();
    let (st, v) = s.post("/v1/nack", &json!({ "receipt": receipt }));
    assert_eq!((st, &v), (200, &json!({"state": "dead", "topic": "order:close.dlq"})));
    assert!(listed(&s).iter().any(|t| t["topic"] == "order:close.dlq"));
    assert_eq!(s.get("/v1/messages/n1").1["dead_letter_topic"], "order:close.dlq");
    let (_, v) = s.get(&format!("{enc}/messages?state=dead"));
    assert_eq!(v["messages"][0]["id"], "n1", "{v}");
    let (st, v) = s.post(&format!("{enc}/redrive"), &json!({}));
    assert_eq!((st, &v), (200, &json!({"moved": 1})));
    assert_eq!(s.get("/v1/messages/n1").1["state"], "ready");

    // A push subscription on another such topic (no messages, so nothing is delivered).
    let (st, v) = s
        .http()
        .put(s.url("/v1/topics/hook%3Aonly/push"))
        .json(&json!({"url": "http://127.0.0.1:9/h"}))
        .send()
        .map(|r| (r.status().as_u16(), r.json::<Value>().unwrap()))
        .unwrap();
    assert_eq!((st, &v["topic"]), (200, &json!("hook:only")), "{v}");
    assert_eq!(s.get("/v1/topics/hook:only/push").1["topic"], "hook:only");
    let (st, v) = s.delete("/v1/topics/hook%3Aonly/push");
    assert_eq!((st, &v), (200, &json!({"topic": "hook:only", "removed": true})));

    // Purge, then the compat API sees it gone.
    let (st, v) = s.post(&format!("{enc}/purge"), &json!({}));
    assert_eq!((st, &v), (200, &json!({"cancelled": 2})), "c-later and n1");
    assert_eq!(call(&s, "/get", JSON, r#"{"id":"c-later"}"#)["data"], Value::Null);
    // The storage spelling is a name of its own (`%` is escaped too), never the same topic.
    let (_, v) = s.get("/v1/topics/order%253Aclose/messages?state=delayed");
    assert_eq!(v["messages"], json!([]), "{v}");
}
