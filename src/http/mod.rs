//! The HTTP front end: the native JSON API under `/v1`, the ouqiang/delay-queue compatible API,
//! `/healthz`, `/metrics` and the dashboard at `/ui`. `router` builds an `axum::Router` that tests can drive in-process.

mod admin;
mod cluster;
mod compat;
mod compat_paths;
mod error;
mod extract;
mod flow;
mod history;
mod json;
pub mod metrics;
mod native;
mod openapi;
mod process;
mod push;
mod server;
mod topic_name;
mod topics;
mod ui;
mod validate;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::{Extension, Json, Router};
use serde::Serialize;
use tokio::sync::watch;
use utoipa::ToSchema;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::broker::Broker;
use crate::config::Config;
use crate::schedule::clock::{Clock, SystemClock};
pub use error::ApiError;
/// The process's open-file limit, read and raised at start-up.
pub use process::{file_limit, raise_file_limit, FileLimit};
/// The connection-level server the router runs under, and its settings.
pub use server::{serve, ServeConfig};

use crate::limits::ENVELOPE_BYTES;

/// Limits and switches the handlers need from the configuration.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Bearer token required when set.
    pub auth_token: Option<String>,
    /// Bearer token that may call the routes of [`READ_ROUTES`] only.
    pub read_token: Option<String>,
    /// Largest message body.
    pub max_body_bytes: usize,
    /// Most messages in one batch.
    pub max_batch: usize,
    /// Cap on a native pop's wait.
    pub max_wait_ms: u64,
    /// Wait of a compat pop.
    pub compat_max_wait_ms: u64,
    /// Deliveries before a compat job is dead-lettered; `None`: never.
    pub compat_max_attempts: Option<u32>,
    /// Longest accepted delay.
    pub max_delay_ms: u64,
    /// Configured levels, for `level` given as a duration.
    pub levels_ms: Vec<u64>,
    /// Hosts a push subscription may target; `None`: any.
    pub push_allowed_hosts: Option<Vec<String>>,
}

impl Limits {
    /// Takes the HTTP-relevant keys out of a full configuration.
    pub fn from_config(cfg: &Config) -> Limits {
        Limits {
            auth_token: cfg.auth_token.clone(),
            read_token: cfg.read_token.clone(),
            max_body_bytes: usize::try_from(cfg.max_body_bytes).unwrap_or(usize::MAX),
            max_batch: cfg.max_batch,
            max_wait_ms: cfg.max_wait,
            compat_max_wait_ms: cfg.compat_max_wait,
            compat_max_attempts: cfg.compat_max_attempts,
            max_delay_ms: cfg.max_delay,
            levels_ms: cfg.levels.clone(),
            push_allowed_hosts: cfg.push_allowed_hosts.clone(),
        }
    }
}

/// Shared state of every handler: the broker handle, the limits and the shutdown signal.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    broker: Broker,
    limits: Limits,
    shutdown: watch::Sender<bool>,
    http_metrics: metrics::HttpMetrics,
    cluster: Option<Arc<crate::cluster::ClusterState>>,
    history: history::History,
}

impl AppState {
    /// Wraps a running broker for the router.
    pub fn new(broker: Broker, limits: Limits) -> AppState {
        AppState::with_cluster(broker, limits, None)
    }

    /// Wraps a cluster node's broker: requests it does not lead for are sent to the leader.
    pub fn clustered(broker: Broker, limits: Limits, cluster: Arc<crate::cluster::ClusterState>) -> AppState {
        AppState::with_cluster(broker, limits, Some(cluster))
    }

    fn with_cluster(
        broker: Broker,
        limits: Limits,
        cluster: Option<Arc<crate::cluster::ClusterState>>,
    ) -> AppState {
        let (shutdown, _) = watch::channel(false);
        let http_metrics = metrics::HttpMetrics::new();
        let history = history::History::new(now_ms());
        let inner = Arc::new(Inner { broker, limits, shutdown, http_metrics, cluster, history });
        history::start_sampler(Arc::downgrade(&inner));
        AppState { inner }
    }

    /// The cluster's state as this node sees it (`None` on a single node).
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::ClusterState>> {
        self.inner.cluster.as_ref()
    }

    /// The broker handle.
    pub fn broker(&self) -> &Broker {
        &self.inner.broker
    }

    /// The configured limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Requests served so far, by route, method and status.
    pub fn http_metrics(&self) -> &metrics::HttpMetrics {
        &self.inner.http_metrics
    }

    /// Makes waiting long-polls return at once (empty) so a graceful shutdown is not held up by them.
    pub fn begin_shutdown(&self) {
        self.inner.shutdown.send_replace(true);
    }

    /// Resolves once `begin_shutdown` has been called.
    pub async fn shutting_down(&self) {
        let mut rx = self.inner.shutdown.subscribe();
        // An error means the sender is gone, which cannot happen while `self` holds it.
        let _ = rx.wait_for(|down| *down).await;
    }
}

/// Every route of the API: (open to anyone, behind the bearer token). Each `routes!` registers a
/// handler under the path and method of its `#[utoipa::path]` and adds that operation to the
/// router's OpenAPI document, so a route cannot be served without being documented. Add routes
/// here with `routes!`, never `.route(...)`: `tests/openapi.rs` fails on an undocumented one.
fn routes() -> (OpenApiRouter<AppState>, OpenApiRouter<AppState>) {
    let open = OpenApiRouter::default().routes(routes!(healthz)).routes(routes!(openapi::serve));
    let protected = OpenApiRouter::default()
        .routes(routes!(native::produce, topics::browse))
        .routes(routes!(native::produce_batch))
        .routes(routes!(native::pop))
        .routes(routes!(native::ack))
        .routes(routes!(native::nack))
        .routes(routes!(native::touch))
        .routes(routes!(native::get_message, native::cancel, native::reschedule))
        .routes(routes!(native::history))
        .routes(routes!(native::stats))
        .routes(routes!(history::history))
        .routes(routes!(cluster::status))
        .routes(routes!(cluster::add_node))
        .routes(routes!(cluster::remove_node))
        .routes(routes!(admin::backup))
        .routes(routes!(topics::list))
        .routes(routes!(topics::pause))
        .routes(routes!(topics::resume))
        .routes(routes!(topics::redrive))
        .routes(routes!(topics::purge))
        .routes(routes!(push::put, push::get, push::delete))
        .routes(routes!(flow::put, flow::get, flow::delete))
        .routes(routes!(metrics::handler))
        // The original serves these paths for any method; so must a drop-in. The document
        // describes POST, which its clients use, and says so.
        .routes(routes!(compat::push).map(|_| any_but_head(compat::push)))
        .routes(routes!(compat::pop).map(|_| any_but_head(compat::pop)))
        .routes(routes!(compat::finish).map(|_| any_but_head(compat::finish)))
        .routes(routes!(compat::delete).map(|_| any_but_head(compat::delete)))
        .routes(routes!(compat::get).map(|_| any_but_head(compat::get)));
    (open, protected)
}

/// The OpenAPI document `GET /openapi.json` serves, built from the same registration as the router.
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    let (open, protected) = routes();
    openapi::document(open.into_openapi(), protected.into_openapi())
}

/// Builds the whole HTTP API over `state`.
pub fn router(state: AppState) -> Router {
    let limit = state.limits().max_body_bytes.saturating_add(ENVELOPE_BYTES);
    let (open, protected) = routes();
    let (open, open_doc) = open.split_for_parts();
    let (protected, protected_doc) =
        // The token is checked first (outermost), then a node that does not lead sends the
        // request on to the leader.
        protected
            .route_layer(middleware::from_fn_with_state(state.clone(), cluster::to_leader))
            .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
            .split_for_parts();
    let doc = openapi::Served::new(&openapi::document(open_doc, protected_doc));
    let router = open
        // The dashboard is a page, not an API operation: it is left out of the document. It is
        // static and holds no data, so it needs no token: its calls to /v1 carry it.
        .route("/ui", axum::routing::get(ui::index))
        .route("/ui/app.js", axum::routing::get(ui::script))
        .route("/ui/app.css", axum::routing::get(ui::style))
        .merge(protected)
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(doc));
    // A span and a line per request at debug level (`log_level = "tower_http=debug"`). Left out when
    // nothing would print them, the filter being fixed at start: even disabled, the layer timed
    // and classified every request and wrapped every answer body.
    let router = if tracing::enabled!(target: "tower_http::trace::on_response", tracing::Level::DEBUG) {
        router.layer(tower_http::trace::TraceLayer::new_for_http())
    } else {
        router
    };
    router
        // Outermost, so every answer is counted with its final status, 401s and 404s included.
        .layer(middleware::from_fn_with_state(state.clone(), metrics::track))
        .with_state(state)
}

/// The answer of `/healthz`.
#[derive(Debug, Serialize, ToSchema)]
struct HealthAnswer {
    /// Always `ok`: the server answers.
    #[schema(example = "ok")]
    status: &'static str,
}

/// `GET /healthz`
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    operation_id = "healthz",
    summary = "Liveness; never needs a token",
    responses((status = 200, description = "The server answers", body = HealthAnswer))
)]
async fn healthz() -> Json<HealthAnswer> {
    Json(HealthAnswer { status: "ok" })
}

async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

async fn method_not_allowed(uri: Uri) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not accept this method", uri.path()),
    )
}

/// Every method but `HEAD`, which must not change state: axum would run the handler for it (a
/// `HEAD` falls back to the `GET` handler), so it gets a 405 of its own.
fn any_but_head<H, T>(handler: H) -> MethodRouter<AppState>
where
    H: axum::handler::Handler<T, AppState>,
    T: 'static,
{
    const ALL_BUT_HEAD: MethodFilter = MethodFilter::GET
        .or(MethodFilter::POST)
        .or(MethodFilter::PUT)
        .or(MethodFilter::DELETE)
        .or(MethodFilter::PATCH)
        .or(MethodFilter::OPTIONS)
        .or(MethodFilter::TRACE)
        .or(MethodFilter::CONNECT);
    on(ALL_BUT_HEAD, handler).head(method_not_allowed)
}

/// The routes `read_token` may call, by method (`None`: any) and route template; every other
/// route behind the token changes something and answers it 403. A route is a read when it
/// changes no state: a pop reserves (and a compat `/pop` too), so it is a write. A route left out
/// of this list is refused to the read-only token, never opened to it by mistake; `HEAD` is
/// allowed wherever `GET` is.
pub const READ_ROUTES: &[(Option<&str>, &str)] = &[
    (Some("GET"), "/v1/topics"),
    (Some("GET"), "/v1/topics/{topic}/messages"),
    (Some("GET"), "/v1/topics/{topic}/push"),
    (Some("GET"), "/v1/topics/{topic}/flow"),
    (Some("GET"), "/v1/messages/{id}"),
    (Some("GET"), "/v1/messages/{id}/history"),
    (Some("GET"), "/v1/stats"),
    (Some("GET"), "/v1/stats/history"),
    (Some("GET"), "/v1/cluster"),
    (Some("GET"), "/metrics"),
    // The original serves every path for any method; `/get` only looks a job up.
    (None, "/get"),
];

/// Whether `method` on the route `template` only reads.
fn is_read_route(method: &axum::http::Method, template: &str) -> bool {
    let method = if method == axum::http::Method::HEAD { "GET" } else { method.as_str() };
    READ_ROUTES.iter().any(|(m, t)| *t == template && m.is_none_or(|m| m == method))
}

/// What a bearer token lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Everything (`auth_token`, or no token configured).
    Full,
    /// The routes of [`READ_ROUTES`] (`read_token`).
    Read,
    /// Nothing: missing or wrong.
    None,
}

/// The access an `Authorization` header gives under the configured tokens.
pub(crate) fn access(
    auth_token: Option<&str>,
    read_token: Option<&str>,
    headers: &axum::http::HeaderMap,
) -> Access {
    let Some(full) = auth_token else { return Access::Full };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer);
    let Some(given) = given else { return Access::None };
    // Both compared, so the time taken does not tell which token came close.
    let is_full = constant_time_eq(given.as_bytes(), full.as_bytes());
    let is_read = read_token.is_some_and(|r| constant_time_eq(given.as_bytes(), r.as_bytes()));
    match (is_full, is_read) {
        (true, _) => Access::Full,
        (false, true) => Access::Read,
        (false, false) => Access::None,
    }
}

async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let limits = state.limits();
    let denied = match access(limits.auth_token.as_deref(), limits.read_token.as_deref(), req.headers()) {
        Access::Full => return next.run(req).await,
        Access::Read => {
            // Set by the router before any route layer runs; a request here always has one.
            let template = req.extensions().get::<MatchedPath>().map_or("", |m| m.as_str());
            if is_read_route(req.method(), template) {
                return next.run(req).await;
            }
            ApiError::forbidden(format!(
                "the read-only token cannot call {} {}: it changes state; use auth_token",
                req.method(),
                req.uri().path()
            ))
        }
        Access::None => ApiError::unauthorized(),
    };
    if compat_paths::is_compat_path(req.uri().path()) {
        return compat::refused(denied);
    }
    denied.into_response()
}

/// The token of an `Authorization: Bearer <token>` value; the scheme in any case (RFC 7235).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without an early exit, so response timing does not reveal how much of a token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Unix time in milliseconds on the broker's step-safe clock, so a `deliver_at_ms` is checked
/// against the same "now" that will schedule it.
pub(crate) fn now_ms() -> u64 {
    SystemClock.now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_in_any_case() {
        for v in ["Bearer t0k", "bearer t0k", "BEARER t0k", "bEaReR   t0k ", "Bearer\tt0k"] {
            assert_eq!(bearer(v), Some("t0k"), "{v:?}");
        }
        for v in ["Basic dDBr", "Bearert0k", "t0k", "Bearer", ""] {
            assert_eq!(bearer(v), None, "{v:?}");
        }
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
