//! The router driven in-process with tower's `oneshot`, no sockets: limits, auth and shutdown behaviour.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use delayd::config::Config;
use delayd::http::{router, AppState, Limits};
use delayd::Broker;
use serde_json::{json, Value};
use tower::ServiceExt;

struct App {
    router: Router,
    state: AppState,
    broker: Broker,
    _dir: tempfile::TempDir,
}

fn app(auth_token: Option<&str>) -> App {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config {
        data_dir: dir.path().join("data"),
        segment_bytes: 1 << 20,
        max_body_bytes: 1024,
        cq_entries_per_file: 1024,
        index_initial_slots: 1024,
        auth_token: auth_token.map(str::to_string),
        ..Config::default()
    };
    cfg.validate().unwrap();
    let broker = Broker::open(cfg.broker_config()).unwrap();
    let state = AppState::new(broker.clone(), Limits::from_config(&cfg));
    App { router: router(state.clone()), state, broker, _dir: dir }
}

async fn send(router: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

fn post_json(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(body.into()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn produce_and_look_up_in_process() {
    let a = app(None);
    let (st, v) =
        send(&a.router, post_json("/v1/topics/t/messages", r#"{"id":"i-1","body":"b","delay_ms":60000}"#))
            .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert_eq!(v["id"], "i-1");
    let (st, v) = send(&a.router, Request::get("/v1/messages/i-1").body(Body::empty()).unwrap()).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["state"], "delayed");
    a.broker.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_requests_get_413_json_before_reaching_the_broker() {
    let a = app(None);
    // Over the request limit (max_body_bytes + 64KiB envelope): refused while reading the body.
    let huge = format!(r#"{{"body":"{}"}}"#, "x".repeat(100 * 1024));
    let (st, v) = send(&a.router, post_json("/v1/topics/t/messages", huge)).await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["error"]["code"], "too_large");
    // Within the request limit but the body field is over max_body_bytes.
    let big = json!({"body": "x".repeat(1025)}).to_string();
    let (st, v) = send(&a.router, post_json("/v1/topics/t/messages", big)).await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(v["error"]["message"].as_str().unwrap().contains("max_body_bytes"), "{v}");
    // The compat API reads raw bodies under the same limit, and answers as its original does: HTTP 200, code 1.
    let (st, v) = send(&a.router, post_json("/push", "y".repeat(100 * 1024))).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["code"], 1, "{v}");
    assert!(v["message"].as_str().unwrap().contains("limit"), "{v}");
    let (st, v) = send(&a.router, Request::get("/v1/stats").body(Body::empty()).unwrap()).await;
    assert_eq!(st, StatusCode::OK);
    assert!(v["topics"].as_array().unwrap().iter().all(|t| t["topic"] != "t"), "nothing was stored: {v}");
    a.broker.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn auth_is_checked_before_the_body_is_read() {
    let a = app(Some("tok"));
    let (st, v) = send(&a.router, post_json("/v1/topics/t/messages", "not even json")).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "{v}");
    assert_eq!(v["error"]["code"], "unauthorized");
    let req = Request::post("/v1/topics/t/messages")
        .header("content-type", "application/json")
        .header("authorization", "Bearer tok")
        .body(Body::from(r#"{"body":"b"}"#))
        .unwrap();
    assert_eq!(send(&a.router, req).await.0, StatusCode::CREATED);
    let (st, _) = send(&a.router, Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!(st, StatusCode::OK);
    a.broker.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_releases_waiting_long_polls() {
    let a = app(None);
    let router = a.router.clone();
    let native = tokio::spawn(async move {
        send(&router, Request::post("/v1/topics/idle/pop?wait_ms=60000").body(Body::empty()).unwrap()).await
    });
    let router = a.router.clone();
    let compat = tokio::spawn(async move { send(&router, post_json("/pop", r#"{"topic":"idle"}"#)).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!native.is_finished() && !compat.is_finished(), "the pops should be waiting");
    a.state.begin_shutdown();
    let (st, v) =
        tokio::time::timeout(Duration::from_secs(10), native).await.expect("pop still waiting").unwrap();
    assert_eq!((st, v), (StatusCode::OK, json!({"messages": []})));
    let (st, v) =
        tokio::time::timeout(Duration::from_secs(10), compat).await.expect("pop still waiting").unwrap();
    assert_eq!((st, v), (StatusCode::OK, json!({"code": 0, "message": "ok", "data": null})));
    a.broker.shutdown().await.unwrap();
}

/// Pops on made-up topic names leave nothing behind once they end (timed out, answered, or
/// dropped): the wake-up map follows the pops waiting now.
#[tokio::test(flavor = "multi_thread")]
async fn long_polls_on_many_topics_leave_no_wake_up_handles_behind() {
    let a = app(None);
    let mut polls = Vec::new();
    for i in 0..200 {
        let router = a.router.clone();
        polls.push(tokio::spawn(async move {
            send(
                &router,
                Request::post(format!("/v1/topics/made-up-{i}/pop?wait_ms=300")).body(Body::empty()).unwrap(),
            )
            .await
        }));
    }
    // One waiting pop that the test drops (as a client going away would).
    let router = a.router.clone();
    let dropped = tokio::spawn(async move {
        send(&router, Request::post("/v1/topics/abandoned/pop?wait_ms=60000").body(Body::empty()).unwrap())
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(a.broker.waiting_topics() > 100, "the pops should be waiting: {}", a.broker.waiting_topics());
    dropped.abort();
    for p in polls {
        assert_eq!(p.await.unwrap().0, StatusCode::OK);
    }
    let _ = dropped.await;
    assert_eq!(a.broker.waiting_topics(), 0, "wake-up handles left behind");
    a.broker.shutdown().await.unwrap();
}
