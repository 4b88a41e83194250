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

/// A node to add to the cluster.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
pub(crate) struct AddNode {
    /// The new node's id (1 or more, not a member's).
    node_id: u64,
    /// Where the other nodes reach it: HOST:PORT of its `cluster_listen`.
    cluster_addr: String,
}

/// The members after a change.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ChangeAnswer {
    /// The node changed.
    node_id: u64,
    /// What happened.
    status: &'static str,
}

fn no_cluster() -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "not_a_cluster",
        "this delayd runs as a single node (no peers): it has no members to change",
    )
}

fn change_failed(why: String) -> ApiError {
    let status = if why.contains("in progress") || why.contains("already") {
        StatusCode::CONFLICT
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    ApiError::new(status, if status == StatusCode::CONFLICT { "conflict" } else { "no_leader" }, why)
}

/// `POST /v1/cluster/nodes`
#[utoipa::path(
    post,
    path = "/v1/cluster/nodes",
    tag = "operations",
    operation_id = "cluster_add",
    summary = "Add a node: it joins as a learner and becomes a voter once it has caught up",
    description = "Start the new node first with `cluster_join = true`, its own `node_id`, and `peers` \
                   naming the cluster's nodes and itself. Answered once the change is committed.",
    request_body = AddNode,
    responses(
        (status = 200, description = "Added as a learner", body = ChangeAnswer),
        (status = 400, description = "A bad id or address", body = super::error::ErrorBody),
        (status = 409, description = "Already a member, a single node, or another change in progress", body = super::error::ErrorBody),
        (status = 503, description = "No leader, or the change did not take effect in time", body = super::error::ErrorBody)
    )
)]
pub(crate) async fn add_node(
    State(state): State<AppState>,
    super::extract::JsonBody(req): super::extract::JsonBody<AddNode>,
) -> Result<Json<ChangeAnswer>, ApiError> {
    let cluster = state.cluster().ok_or_else(no_cluster)?;
    if req.node_id == 0 || req.node_id > u64::from(u32::MAX) {
        return Err(ApiError::invalid("node_id", "must be 1 to 4294967295"));
    }
    let addr = req.cluster_addr.trim();
    if !addr.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0)) {
        return Err(ApiError::invalid("cluster_addr", "must be HOST:PORT of the node's cluster_listen"));
    }
    let v = cluster.status_json();
    let known = v["nodes"].as_array().is_some_and(|n| n.iter().any(|n| n["node_id"] == req.node_id));
    if known {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("node {} is already a member", req.node_id),
        ));
    }
    let change = crate::cluster::members::Change::Add { id: req.node_id, addr: addr.to_string() };
    cluster.change(change).await.map_err(change_failed)?;
    Ok(Json(ChangeAnswer {
        node_id: req.node_id,
        status: "added as a learner; it becomes a voter once it has caught up",
    }))
}

/// `DELETE /v1/cluster/nodes/{node_id}`
#[utoipa::path(
    delete,
    path = "/v1/cluster/nodes/{node_id}",
    tag = "operations",
    operation_id = "cluster_remove",
    summary = "Remove a node from the cluster; a removed node stops",
    params(("node_id" = u64, Path, description = "The node to remove")),
    responses(
        (status = 200, description = "Removed", body = ChangeAnswer),
        (status = 404, description = "Not a member", body = super::error::ErrorBody),
        (status = 409, description = "A single node, or another change in progress", body = super::error::ErrorBody),
        (status = 503, description = "No leader, the leader handing over its lead first (retry), or no effect in time", body = super::error::ErrorBody)
    )
)]
pub(crate) async fn remove_node(
    State(state): State<AppState>,
    super::extract::PathParam(id): super::extract::PathParam,
) -> Result<Json<ChangeAnswer>, ApiError> {
    let cluster = state.cluster().ok_or_else(no_cluster)?;
    let id: u64 = id.parse().map_err(|_| ApiError::invalid("node_id", "must be a number"))?;
    let v = cluster.status_json();
    let known = v["nodes"].as_array().is_some_and(|n| n.iter().any(|n| n["node_id"] == id));
    if !known {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("node {id} is not a member")));
    }
    cluster.change(crate::cluster::members::Change::Remove { id }).await.map_err(change_failed)?;
    Ok(Json(ChangeAnswer { node_id: id, status: "removed" }))
}
