//! The HTTP/1.1 server: an accept loop and one hyper connection per socket, each under watch.
//!
//! What a connection may cost is bounded here, not in the handlers:
//! - at most `max_connections` sockets are served at once; past that, new ones wait in the
//!   kernel's listen backlog until a slot frees;
//! - a request head must arrive within `http_header_timeout` (counted from the accept, or from its
//!   first byte on a kept-alive connection), a kept-alive connection may sit idle for
//!   `http_idle_timeout`, and a request body must arrive within `http_body_timeout` of its head;
//! - an answer given before the request body was read (401, 413, 415, a 400 from an extractor)
//!   either reads the rest of a small body first, so the connection stays usable, or says
//!   `Connection: close` and keeps reading (and dropping) what the client still sends until the
//!   body's deadline, so the close does not reset the connection under the answer;
//! - a request whose declared body is larger than the request limit is answered 413 before any of
//!   the body is read (and before any `100 Continue`);
//! - request bodies in memory are bounded together by `max_body_memory`: a request whose body does
//!   not fit in what is left is answered 503 with `Retry-After` before its body is read;
//! - hyper's own answers to requests it cannot parse (400, 414, 431) carry the JSON error shape.

mod body;
mod io;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::{Extension, Router};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;
use utoipa::ToSchema;

pub use body::BodyTimedOut;
use body::{AnswerBody, BodyBudget, BodyPermit, Leftover, RequestBody};
use io::{ConnIo, Phase, PhaseCell};

use crate::config::Config;
use crate::http::ApiError;

/// How long a new connection waits before the "every slot is taken" warning may repeat.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Connection limits and timeouts, from the `http_*` and `max_connections` keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// A request head must arrive within this, from the accept or from its first byte.
    pub header_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request (or take to read an answer).
    pub idle_timeout: Duration,
    /// A request body must arrive within this, from the end of its head.
    pub body_timeout: Duration,
    /// Most connections served at once.
    pub max_connections: usize,
    /// Largest request body: `max_body_bytes` plus the JSON envelope the router allows.
    pub body_limit: u64,
    /// Most request-body bytes held at once by the requests being served.
    pub max_body_memory: u64,
    /// The bearer token of `auth_token`: a request without it is left to the router, which
    /// refuses it (401) before reading its body wherever a token is needed.
    pub auth_token: Option<String>,
}

impl ServeConfig {
    /// Takes the connection keys out of a full configuration.
    pub fn from_config(cfg: &Config) -> ServeConfig {
        ServeConfig {
            header_timeout: Duration::from_millis(cfg.http_header_timeout),
            idle_timeout: Duration::from_millis(cfg.http_idle_timeout),
            body_timeout: Duration::from_millis(cfg.http_body_timeout),
            max_connections: cfg.max_connections,
            body_limit: cfg.max_body_bytes.saturating_add(crate::http::ENVELOPE_BYTES as u64),
            max_body_memory: cfg.max_body_memory,
            auth_token: cfg.auth_token.clone(),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the request it is serving (idle ones close at once) and returns when all
/// have closed. The caller bounds that wait.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    cfg: ServeConfig,
    shutdown: impl Future<Output = ()>,
) {
    let cfg = Arc::new(cfg);
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    let bodies = Arc::new(Bodies {
        budget: BodyBudget::new(usize::try_from(cfg.max_body_memory).unwrap_or(usize::MAX)),
        refused: Throttled::default(),
        refused_total: AtomicU64::new(0),
    });
    let router = router.layer(Extension(ServerView { cfg: cfg.clone(), bodies: bodies.clone() }));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    let mut warned_full: Option<Instant> = None;
    loop {
        while connections.try_join_next().is_some() {}
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if warned_full.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
                    tracing::warn!(
                        max_connections = cfg.max_connections,
                        "every connection slot is taken; new connections wait in the listen backlog"
                    );
                    warned_full = Some(Instant::now());
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => match slot {
                        Ok(slot) => slot,
                        // The semaphore is never closed; stop serving rather than spin if it were.
                        Err(_) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let conn =
            connection(stream, peer, router.clone(), cfg.clone(), bodies.clone(), stop_rx.clone(), slot);
        connections.spawn(conn);
    }
    drop(listener);
    stop_tx.send_replace(true);
    while connections.join_next().await.is_some() {}
}

async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind;
    // The peer gave up between its connect and our accept: nothing to do.
    if matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    // Out of file handles (EMFILE, ENFILE) or memory: retrying at once would spin; some
    // connection will close meanwhile.
    tracing::error!("cannot accept a connection: {e}; retrying in 1s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Serves one connection until it closes, times out or the server stops.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    cfg: Arc<ServeConfig>,
    bodies: Arc<Bodies>,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let phase = Arc::new(PhaseCell::new(Phase::accepted()));
    let service = ConnService { router, phase: phase.clone(), cfg: cfg.clone(), bodies };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The head and idle deadlines are kept by `Phase` below: hyper's header timer would also
    // run while a kept-alive connection is idle, closing it after the (shorter) header timeout.
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(TokioIo::new(ConnIo::new(stream, phase.clone())), service);
    let mut conn = pin!(conn);
    let (header, idle) = (cfg.header_timeout, cfg.idle_timeout);
    // One timer for the connection's life, reset only when it fires: phase changes do not wake
    // this task (see `PhaseCell`).
    let check = tokio::time::sleep_until(phase.get().next_check(Instant::now(), header, idle));
    let mut check = pin!(check);
    let mut stopping = false;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                return;
            }
            () = check.as_mut() => {
                let (now, current) = (Instant::now(), phase.get());
                if current.deadline(header, idle).is_some_and(|at| at <= now) {
                    // Nothing is being served (no deadline runs then), so dropping the connection
                    // loses no answer.
                    tracing::debug!(%peer, phase = ?current, "closing a connection past its deadline");
                    return;
                }
                check.as_mut().reset(current.next_check(now, header, idle));
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The request bodies of every connection: their memory budget and the refusals past it.
struct Bodies {
    budget: BodyBudget,
    refused: Throttled,
    refused_total: AtomicU64,
}

/// What the HTTP server reports of itself in `/v1/stats` (as `http`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct HttpStats {
    /// Request-body bytes reserved by the requests being served now.
    pub body_memory_bytes: u64,
    /// The most they may reserve together (`max_body_memory`).
    pub max_body_memory: u64,
    /// Requests answered 503 since start because the bodies in flight filled `max_body_memory`.
    pub refused_bodies: u64,
}

/// A handle on the running server for `/v1/stats`; the server adds it to every request.
#[derive(Clone)]
pub struct ServerView {
    cfg: Arc<ServeConfig>,
    bodies: Arc<Bodies>,
}

impl ServerView {
    /// The server's figures now.
    pub fn stats(&self) -> HttpStats {
        HttpStats {
            body_memory_bytes: self.bodies.budget.in_use() as u64,
            max_body_memory: self.cfg.max_body_memory,
            refused_bodies: self.bodies.refused_total.load(Ordering::Relaxed),
        }
    }
}

/// Counts events and says when a warning about them is due: the first time, then at most once
/// per [`FULL_WARNING_EVERY`], with how many happened since the last warning.
#[derive(Default)]
struct Throttled(std::sync::Mutex<(Option<Instant>, u64)>);

impl Throttled {
    /// Counts one event; `Some(count)` when a warning is due now.
    fn hit(&self) -> Option<u64> {
        let mut g = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (warned, count) = &mut *g;
        *count += 1;
        if warned.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
            *warned = Some(Instant::now());
            return Some(std::mem::take(count));
        }
        None
    }
}

/// The hyper service of one connection: the router, with the request body under a deadline and
/// a `Connection: close` on answers given before the request body was read.
#[derive(Clone)]
struct ConnService {
    router: Router,
    phase: Arc<PhaseCell>,
    cfg: Arc<ServeConfig>,
    bodies: Arc<Bodies>,
}

impl ConnService {
    /// Whether the request carries the bearer token, or none is needed.
    fn authorized(&self, headers: &axum::http::HeaderMap) -> bool {
        let Some(token) = &self.cfg.auth_token else { return true };
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(super::bearer);
        given.is_some_and(|g| super::constant_time_eq(g.as_bytes(), token.as_bytes()))
    }

    /// Lets a request's body in, reserving its memory, or refuses the request before any of the
    /// body is read: 413 when it declares more than the request limit (the router would only
    /// refuse it after reading that much), 503 when the bodies in flight leave no room for it.
    fn admit_body(&self, size: http_body::SizeHint) -> Result<Option<BodyPermit>, ApiError> {
        let limit = self.cfg.body_limit;
        if size.lower() > limit {
            return Err(ApiError::too_large(format!(
                "the request declares a body of {} bytes; the limit is {limit} (max_body_bytes plus 64KiB of envelope)",
                size.lower()
            )));
        }
        // A chunked body says nothing of its size; it may grow to the limit.
        let need = size.upper().unwrap_or(limit).min(limit);
        if need == 0 {
            return Ok(None);
        }
        if let Some(permit) = self.bodies.budget.try_reserve(need) {
            return Ok(Some(permit));
        }
        self.bodies.refused_total.fetch_add(1, Ordering::Relaxed);
        if let Some(refused) = self.bodies.refused.hit() {
            tracing::warn!(
                max_body_memory = self.cfg.max_body_memory,
                refused,
                "request bodies in flight fill max_body_memory; refusing requests with 503 until some finish"
            );
        }
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the request bodies being received fill the server's budget (max_body_memory); retry shortly",
        ))
    }
}

/// An answer given without the router, in the shape the path's clients parse: the JSON error
/// envelope, or on a compat path the `{code, message, data}` body with the same status (as its 401).
fn refusal(path: &str, e: ApiError) -> Response<axum::body::Body> {
    if !super::compat::is_compat_path(path) {
        return e.into_response();
    }
    let body = serde_json::json!({"code": 1, "message": e.message, "data": null});
    let mut resp = (e.status, axum::Json(body)).into_response();
    if e.status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<AnswerBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<AnswerBody>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.phase.set(Phase::Serving { answered: None, body_done: false });
        let deadline = Instant::now() + self.cfg.body_timeout;
        let expects_continue = req
            .headers()
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        // A request without the token gets its 401 from the router before its body is read, and
        // must not take budget that authorized requests need; it is not a too-large one either,
        // so a client without the token learns nothing of the limits.
        let admitted =
            if self.authorized(req.headers()) { self.admit_body(req.body().size_hint()) } else { Ok(None) };
        let (parts, incoming) = req.into_parts();
        let (body, leftover) = RequestBody::new(incoming, deadline);
        let phase = self.phase.clone();
        let permit = match admitted {
            Ok(permit) => permit,
            Err(e) => {
                let resp = refusal(parts.uri.path(), e);
                // Unread: hyper sends no `100 Continue`, and `settle` decides about the rest.
                drop(body);
                return Box::pin(answer(resp, leftover, expects_continue, deadline, phase));
            }
        };
        let req = Request::from_parts(parts, axum::body::Body::new(body));
        let router = self.router.clone();
        Box::pin(async move {
            let resp = match router.oneshot(req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
            // The handler has let go of the body it buffered.
            drop(permit);
            answer(resp, leftover, expects_continue, deadline, phase).await
        })
    }
}

/// Finishes an answer: `Connection: close` unless the request body was read (or can be), and the
/// answer body under watch.
async fn answer(
    mut resp: Response<axum::body::Body>,
    leftover: Arc<Leftover>,
    expects_continue: bool,
    deadline: Instant,
    phase: Arc<PhaseCell>,
) -> Result<Response<AnswerBody>, Infallible> {
    if !leftover.settle(expects_continue, deadline).await {
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    phase.apply(Phase::on_answer);
    Ok(resp.map(|b| AnswerBody::new(b, phase)))
}
