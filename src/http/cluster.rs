//! The cluster as clients meet it: `GET /v1/cluster`, and the redirect of every other API request
//! a node that does not lead receives (307 to the leader, or 503 `no_leader`).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::error::ApiError;
use super::AppState;

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
