//! Fuzz-style tests of the HTTP layer: random and malformed input against one real server. Each request
//! gets a 4xx JSON error (or, for input that happens to be valid, a success), never a 5xx, a hang or a
//! crash, and the server keeps serving.

mod common;

use common::Server;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

fn is_error_shape(v: &Value) -> bool {
    v["error"]["code"].as_str().is_some_and(|c| !c.is_empty())
        && v["error"]["message"].as_str().is_some_and(|m| !m.is_empty())
}

fn check_error(status: u16, v: &Value, allowed: &[u16], input: &str) -> Result<(), TestCaseError> {
    prop_assert!(allowed.contains(&status), "{input} -> {status} {v}");
    prop_assert!(is_error_shape(v), "{input} -> {status} not the error shape: {v}");
    Ok(())
}

/// A value of the wrong JSON type (or out of range) for each known produce field.
fn wrong_value(field: &'static str) -> BoxedStrategy<Value> {
    let common = prop_oneof![
        Just(json!(null)).boxed(),
        any::<bool>().prop_map(Value::from).boxed(),
        Just(json!([[1], {"a": 2}])).boxed(),
        Just(json!({"nested": true})).boxed(),
    ];
    match field {
        "body" | "id" => prop_oneof![
            common,
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ]
        .prop_filter("null body/id is valid or missing", move |v| !(v.is_null() && field == "id"))
        .boxed(),
        _ => prop_oneof![
            common,
            "[a-z ]{0,10}".prop_map(Value::from),
            (i64::MIN..0).prop_map(Value::from),
            (0.5f64..1e9).prop_map(|f| json!(f + 0.25)),
        ]
        .prop_filter("null optional is valid", |v| !v.is_null())
        .boxed(),
    }
}

#[test]
fn random_and_malformed_input_gets_4xx_json_and_the_server_keeps_serving() {
    let s = Server::start(&[("DELAYD_MAX_BATCH", "20")]);
    let produce = "/v1/topics/f/messages";

    // 1. Arbitrary bytes declared as JSON.
    runner(200)
        .run(&proptest::collection::vec(any::<u8>(), 0..300), |bytes| {
            let shown = format!("{:?}", String::from_utf8_lossy(&bytes));
            let (st, v) = s.post_raw(produce, Some("application/json"), bytes);
            check_error(st, &v, &[400], &shown)
        })
        .unwrap();

    // 2. Text that is almost JSON: truncations of a valid request.
    let valid = r#"{"id":"trunc","body":"hello","delay_ms":10,"ttr_ms":500,"backoff":["1s",200]}"#;
    for cut in 0..valid.len() {
        let (st, v) = s.post_raw(produce, Some("application/json"), valid.as_bytes()[..cut].to_vec());
        check_error(st, &v, &[400], &valid[..cut]).unwrap();
    }

    // 3. Each known field with a value of the wrong type or range.
    let fields = ["id", "body", "delay_ms", "deliver_at_ms", "level", "ttr_ms", "max_attempts", "backoff"];
    let strategy = proptest::sample::select(fields.to_vec()).prop_flat_map(|f| (Just(f), wrong_value(f)));
    runner(300)
        .run(&strategy, |(field, bad)| {
            let mut body = json!({"body": "x"});
            body[field] = bad;
            let (st, v) = s.post(produce, &body);
            check_error(st, &v, &[400], &body.to_string())?;
            let msg = v["error"]["message"].as_str().unwrap();
            prop_assert!(msg.contains(field), "{body}: message {msg:?} does not name {field}");
            Ok(())
        })
        .unwrap();

    // 4. Giant and odd numbers, written as raw JSON text.
    let number = prop_oneof![
        "[1-9][0-9]{20,400}",
        "-[1-9][0-9]{0,30}",
        "[0-9]{1,5}\\.[0-9]{1,5}",
        "[0-9]{1,3}[eE][+-]?[0-9]{1,4}",
        Just("1e999999".to_string()),
    ];
    let num_fields = ["delay_ms", "deliver_at_ms", "ttr_ms", "max_attempts"];
    runner(300)
        .run(&(proptest::sample::select(num_fields.to_vec()), number), |(field, n)| {
            let text = format!(r#"{{"body":"x","{field}":{n}}}"#);
            let (st, v) = s.post_raw(produce, Some("application/json"), text.clone().into_bytes());
            // Exponents such as 1e2 are floats for serde, not integers: all of these are refused.
            check_error(st, &v, &[400], &text)
        })
        .unwrap();

    // 5. Unicode ids: valid ones round-trip through produce and look-up, the rest are 400.
    runner(200)
        .run(&"\\PC{1,40}|.{1,8}|[ \\t\\n\\u{a0}\\u{2028}a-z]{1,6}", |id| {
            let ok = id.len() <= 128
                && !id.chars().any(|c| c.is_whitespace() || c.is_control())
                && id != "."
                && id != "..";
            let (st, v) = s.post(produce, &json!({"id": id, "body": "u", "delay_ms": 600_000}));
            if ok {
                prop_assert!(st == 201 || st == 200, "{id:?} -> {st} {v}");
                prop_assert_eq!(&v["id"], &json!(id));
                let enc: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
                let (st, got) = s.get(&format!("/v1/messages/{enc}"));
                prop_assert_eq!(st, 200, "{:?} -> {}", id, got);
                prop_assert_eq!(&got["id"], &json!(id));
            } else {
                check_error(st, &v, &[400], &format!("{id:?}"))?;
            }
            Ok(())
        })
        .unwrap();

    // 6. Random topics in the path and random pop query strings.
    runner(200)
        .run(
            &("[a-zA-Z0-9._~%!$&'()*+,;=:@-]{0,140}", "[a-z_]{0,8}=[a-z0-9-]{0,6}(&[a-z_]{0,8}=[0-9]{0,3})?"),
            |(topic, query)| {
                let query = query.replace("wait_ms", "w");
                let (st, v) = s.post_raw(&format!("/v1/topics/{topic}/pop?{query}"), None, Vec::new());
                prop_assert!(st != 500 && st < 503, "{topic} {query} -> {st} {v}");
                if st >= 400 {
                    check_error(st, &v, &[400, 404, 405], &format!("{topic}?{query}"))?;
                }
                Ok(())
            },
        )
        .unwrap();

    // 7. Random batches: every slot gets a result or an error, in order.
    let item = prop_oneof![
        Just(json!({"body": "ok"})),
        Just(json!({"body": "later", "delay_ms": 600_000})),
        wrong_value("delay_ms").prop_map(|v| json!({"body": "x", "delay_ms": v})),
        any::<i32>().prop_map(Value::from),
        "[a-z]{0,5}".prop_map(|k| json!({ k: 1 })),
    ];
    runner(100)
        .run(&proptest::collection::vec(item, 0..25), |items| {
            let n = items.len();
            let (st, v) = s.post("/v1/topics/f/messages/batch", &json!({ "messages": items }));
            if n > 20 {
                check_error(st, &v, &[413], "batch")?;
                return Ok(());
            }
            prop_assert_eq!(st, 201, "{}", v);
            let results = v["results"].as_array().unwrap();
            prop_assert_eq!(results.len(), n);
            for (item, r) in items.iter().zip(results) {
                let good = item.get("body").is_some_and(|b| b == "ok" || b == "later");
                prop_assert_eq!(good, r["id"].is_string(), "{} -> {}", item, r);
                prop_assert_eq!(!good, is_error_shape(r), "{} -> {}", item, r);
            }
            Ok(())
        })
        .unwrap();

    // 8. The compat API answers anything with HTTP 200 and code 0 or 1.
    let compat_body = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..200).boxed(),
        "[a-z]{1,6}=[^&]{0,10}(&[a-z]{1,6}=[^&]{0,10}){0,4}".prop_map(String::into_bytes).boxed(),
        (any::<i64>(), any::<i64>(), "\\PC{0,20}")
            .prop_map(|(d, t, id)| json!({"topic": "cf", "id": id, "delay": d, "ttr": t, "body": "b"}))
            .prop_map(|v| v.to_string().into_bytes())
            .boxed(),
    ];
    let paths = proptest::sample::select(vec!["/push", "/finish", "/delete", "/get"]);
    runner(300)
        .run(&(paths, compat_body), |(path, body)| {
            let shown = String::from_utf8_lossy(&body).to_string();
            let (st, v) = s.post_raw(path, Some("application/x-www-form-urlencoded"), body);
            prop_assert_eq!(st, 200, "{} {} -> {}", path, shown, v);
            prop_assert!(v["code"] == 0 || v["code"] == 1, "{path} {shown} -> {v}");
            Ok(())
        })
        .unwrap();

    // After all that, the server still does real work.
    assert_eq!(s.get("/healthz").0, 200);
    let id = s.produce("after", &json!({"body": "still here"}))["id"].as_str().unwrap().to_string();
    let (msgs, _) = s.pop("after", 1, 5000, None);
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs[0]["id"], id.as_str());
    assert_eq!(s.ack(msgs[0]["receipt"].as_str().unwrap()), 200);
    assert!(!s.log().contains("panicked"), "the server panicked:\n{}", s.log());
}
