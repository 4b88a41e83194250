//! The cluster as clients meet it: `GET /v1/cluster`, and what a node that does not lead does
//! with every other API request: a native one gets 307 to the leader (or 503 `no_leader`); a
//! compat one (ouqiang/delay-queue clients, which do not follow redirects) is proxied to the
//! leader and answered as the leader answers.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use std::sync::OnceLock;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::error::ApiError;
use super::AppState;

/// Time a proxied compat request may take beyond its long-poll wait.
const PROXY_SLACK: Duration = Duration::from_secs(10);

type ProxyClient = Client<HttpConnector, axum::body::Body>;

/// One client for every proxied request: its connections to the leader are kept alive.
fn proxy_client() -> &'static ProxyClient {
    static CLIENT: OnceLock<ProxyClient> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(http)
    })
}

/// Sends `req` to `url` (the leader's URL with the same path and query) with its method, headers
/// and body, and gives back the leader's answer; 503 when the leader cannot be reached.
async fn proxy(req: Request, url: &str, wait: Duration, limit: usize) -> Response {
    let unreachable = |why: String| {
        let mut r = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_leader", why).into_response();
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    let (mut parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("cannot read the body: {e}"),
            )
            .into_response()
        }
    };
    let Ok(uri) = url.parse::<axum::http::Uri>() else {
        return unreachable(format!("the leader's URL {url} is not usable"));
    };
    parts.uri = uri;
    // The leader's own Host; the connection-level headers are this hop's.
    parts.headers.remove(header::HOST);
    parts.headers.remove(header::CONNECTION);
    let out = axum::http::Request::from_parts(parts, axum::body::Body::from(body));
    match tokio::time::timeout(wait, proxy_client().request(out)).await {
        Ok(Ok(resp)) => {
            let (parts, body) = resp.into_parts();
            match body.collect().await {
                Ok(b) => Response::from_parts(parts, axum::body::Body::from(b.to_bytes())),
                Err(e) => unreachable(format!("the leader's answer was cut off: {e}")),
            }
        }
        Ok(Err(e)) => unreachable(format!("cannot reach the leader at {url}: {e}")),
        Err(_) => unreachable(format!("the leader at {url} did not answer in time")),
    }
}

/// `GET /v1/cluster`
#[utoipa::path(
    get,
    path = "/v1/cluster",
    tag = "operations",
    operation_id = "cluster",
    summary = "This node's role, term and leader, and every node of the cluster",
    description = "Answered by every node, leader or not, with or without a leader. A single node \
                   answers as the leader of a cluster of one.",
    responses((status = 200, description = "The cluster as this node sees it", body = Object))
)]
pub(crate) async fn status(State(state): State<AppState>, headers: HeaderMap) -> Json<Value> {
    Json(match state.cluster() {
        Some(c) => c.status_json(),
        None => {
            let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("127.0.0.1:9277");
            crate::cluster::single_node_json(&format!("http://{host}"))
        }
    })
}

/// Paths a node answers itself even when it does not lead: its own view of the cluster and its
/// own metrics.
fn answered_here(path: &str) -> bool {
    path == "/v1/cluster" || path == "/metrics"
}

/// Sends a request to the leader when this node does not lead: `307` with the leader's URL and
/// the same path and query (a client resends the same method and body there), or `503
/// no_leader` with `Retry-After` while there is none (an election, a lost majority).
pub(crate) async fn to_leader(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster() else { return next.run(req).await };
    if cluster.leading() || answered_here(req.uri().path()) {
        return next.run(req).await;
    }
    let leader = cluster.leader_id().filter(|id| *id != cluster.node_id).and_then(|_| cluster.leader_url());
    let Some(url) = leader else {
        let mut r = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_leader",
            "the cluster has no leader at the moment (an election, or a majority of nodes unreachable); retry shortly",
        )
        .into_response();
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    };
    let path_and_query = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let location = format!("{}{}", url.trim_end_matches('/'), path_and_query);
    if super::compat_paths::is_compat_path(req.uri().path()) {
        let wait = Duration::from_millis(state.limits().compat_max_wait_ms) + PROXY_SLACK;
        let limit = state.limits().max_body_bytes.saturating_add(super::ENVELOPE_BYTES);
        return proxy(req, &location, wait, limit).await;
    }
    let mut r = (StatusCode::TEMPORARY_REDIRECT, Json(serde_json::json!({
        "error": {"code": "not_leader", "message": format!("this node does not lead; the leader is {url}")},
        "leader_url": url,
    })))
        .into_response();
    match HeaderValue::from_str(&location) {
        Ok(v) => {
            r.headers_mut().insert(header::LOCATION, v);
            r
        }
        Err(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_leader", "the leader's URL is not usable")
                .into_response()
        }
    }
}
