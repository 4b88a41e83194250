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
    assert_eq!(job, json!({"id": "15702398321", "body": r#"{"uid": 10829378, "created": 1498657365}"#}));

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
        ("/push", r#"{"topic":"t t","id":"i","delay":1,"ttr":1,"body":"x"}"#, "topic"),
        ("/push", r#"{"topic":"t","id":"i j","delay":1,"ttr":1,"body":"x"}"#, "id"),
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
    // Pushing an id again with different content is refused; the same content is a safe retry.
    let push = r#"{"topic":"t","id":"dup","delay":5,"ttr":1,"body":"x"}"#;
    assert_eq!(call(&s, "/push", JSON, push)["code"], 0);
    assert_eq!(call(&s, "/push", JSON, push)["code"], 0);
    assert_eq!(
        call(&s, "/push", JSON, r#"{"topic":"t","id":"dup","delay":5,"ttr":1,"body":"y"}"#)["code"],
        1
    );
    assert_eq!(s.get("/healthz").0, 200);
}
