//! The HTTP/1.1 server: an accept loop and one hyper connection per socket, each under watch.
//!
//! What a connection may cost is bounded here, not in the handlers:
//! - at most `max_connections` sockets are open at once (lowered at start to fit the file-handle
//!   limit), and one client address holds at most its share of them; at the cap an idle
//!   connection, or else the long poll that has waited longest, makes room for a new one, and near
//!   it idle ones close after a brief idle time (see `admit`), so neither idle keep-alives nor
//!   long polls (a parked task each) keep new clients out; when every connection is busy with
//!   another request, new ones wait in the kernel's listen backlog;
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

mod admit;
mod body;
mod io;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

use admit::{Admission, LongPoll, Ticket, BRIEF_IDLE_AUTHENTICATED, BRIEF_IDLE_UNAUTHENTICATED};
pub use body::BodyTimedOut;
use body::{AnswerBody, BodyBudget, BodyPermit, Leftover, RequestBody};
use io::{ConnIo, Phase, PhaseCell};

use crate::config::Config;
use crate::http::ApiError;

/// How long a new connection waits before the "every slot is taken" warning may repeat.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);
/// How often the accept loop, every slot taken, looks again for idle connections to close.
const LOOK_FOR_IDLE_EVERY: Duration = Duration::from_millis(100);
/// Refused connections answered at once; past that they are closed without an answer.
const REFUSING_AT_ONCE: usize = 64;
/// How soon a connection past its deadline with a request unread looks again.
const UNREAD_RECHECK: Duration = Duration::from_millis(10);
/// How long a refused connection is kept to deliver its answer.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Connection limits and timeouts, from the `http_*` and `max_connections` keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// A request head must arrive within this, from the accept or from its first byte.
    pub header_timeout: Duration,
    /// How long a kept-alive connection may wait for its next request (or take to read an answer).
    pub idle_timeout: Duration,
    /// A request body must arrive within this, from the end of its head.
    pub body_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most connections one client address may hold; `None`: half of `max_connections`.
    pub max_connections_per_ip: Option<usize>,
    /// Largest request body: `max_body_bytes` plus the JSON envelope the router allows.
    pub body_limit: u64,
    /// Most request-body bytes held at once by the requests being served.
    pub max_body_memory: u64,
    /// The bearer token of `auth_token`: a request without it is left to the router, which
    /// refuses it (401) before reading its body wherever a token is needed.
    pub auth_token: Option<String>,
    /// The bearer token of `read_token`, which also lets a request's body in: the router
    /// refuses it (403) on a write before reading the body.
    pub read_token: Option<String>,
}

impl ServeConfig {
    /// Takes the connection keys out of a full configuration.
    pub fn from_config(cfg: &Config) -> ServeConfig {
        ServeConfig {
            header_timeout: Duration::from_millis(cfg.http_header_timeout),
            idle_timeout: Duration::from_millis(cfg.http_idle_timeout),
            body_timeout: Duration::from_millis(cfg.http_body_timeout),
            max_connections: cfg.max_connections,
            max_connections_per_ip: cfg.max_connections_per_ip,
            body_limit: cfg.max_body_bytes.saturating_add(crate::limits::ENVELOPE_BYTES as u64),
            max_body_memory: cfg.max_body_memory,
            auth_token: cfg.auth_token.clone(),
            read_token: cfg.read_token.clone(),
        }
    }
}

impl ServeConfig {
    /// The share of the connections one client address may hold.
    pub fn per_ip(&self) -> usize {
        // Not bounded by the cap: a share at or above it lets one address wait for slots as
        // anyone else, rather than be refused.
        self.max_connections_per_ip.unwrap_or(self.max_connections / 2).max(1)
    }

    /// Lowers `max_connections` to what `nofile`, the soft limit on open files, leaves once the
    /// store's files (`open_queues` queue files and its logs and index) and push deliveries have
    /// theirs; returns the lowered cap when it had to be lowered. Past the handle limit a
    /// connection would fail its accept, or worse, the store would fail to open a file.
    pub fn fit_to_file_handles(&mut self, nofile: u64, open_queues: usize) -> Option<usize> {
        let reserved = (open_queues + STORE_FILES + PUSH_HANDLES) as u64;
        // With fewer handles than the reserve, half of them still serve connections.
        let room = nofile.saturating_sub(reserved).max(nofile / 2).max(1);
        let room = usize::try_from(room).unwrap_or(usize::MAX);
        (room < self.max_connections).then(|| {
            self.max_connections = room;
            room
        })
    }
}

/// File handles kept for the store beside its queue files: log segments, index, checkpoint, lock.
const STORE_FILES: usize = 64;
/// File handles kept for push deliveries (one connection each while in flight).
const PUSH_HANDLES: usize = 1024;

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the request it is serving (idle ones close at once) and returns when all
/// have closed. The caller bounds that wait.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    cfg: ServeConfig,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    let shared = Arc::new(Shared {
        bodies: Bodies {
            budget: BodyBudget::new(usize::try_from(cfg.max_body_memory).unwrap_or(usize::MAX)),
            refused: Throttled::default(),
            refused_total: AtomicU64::new(0),
        },
        admission: Arc::new(Admission::new(cfg.max_connections, cfg.per_ip())),
        refused_ip: Throttled::default(),
        refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE)),
        cfg,
    });
    let router = router.layer(Extension(ServerView(shared.clone())));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    let mut warned_full: Option<Instant> = None;
    'serving: loop {
        while connections.try_join_next().is_some() {}
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
        let phase = Arc::new(PhaseCell::new(Phase::accepted()));
        let Some(ticket) = shared.admission.admit(peer.ip(), phase.clone()) else {
            shared.refuse(stream, peer);
            continue;
        };
        let slot = loop {
            if let Ok(slot) = slots.clone().try_acquire_owned() {
                break slot;
            }
            // Every slot is taken and a client is waiting: an idle connection makes room at once
            // (its client loses nothing but a reconnect), the one idle longest, preferring those
            // without an authenticated request; with none idle, the long poll that has waited
            // longest ends, empty, as if its wait had run out. Without either, the client waits
            // for a slot, and those behind it in the listen backlog.
            let room = shared.admission.close_idle(1) > 0 || shared.admission.cut_long_poll();
            if !room && warned_full.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
                tracing::warn!(
                    max_connections = shared.cfg.max_connections,
                    "every connection is busy with a request other than a long poll; new connections \
                     wait in the listen backlog"
                );
                warned_full = Some(Instant::now());
            }
            tokio::select! {
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => break slot,
                    // The semaphore is never closed; stop serving rather than spin if it were.
                    Err(_) => break 'serving,
                },
                // The connection asked to close may have begun a request meanwhile; look again.
                () = tokio::time::sleep(LOOK_FOR_IDLE_EVERY) => {}
                () = &mut shutdown => break 'serving,
            }
        };
        let conn =
            connection(stream, peer, router.clone(), shared.clone(), phase, ticket, stop_rx.clone(), slot);
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

/// Serves one connection until it closes, times out, gives way to new ones or the server stops.
#[allow(clippy::too_many_arguments)]
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    shared: Arc<Shared>,
    phase: Arc<PhaseCell>,
    ticket: Ticket,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    ticket.start();
    let authenticated = ticket.authenticated.clone();
    if shared.cfg.auth_token.is_none() {
        authenticated.store(true, Ordering::Relaxed);
    }
    let poll = ticket.poll.clone();
    let service = ConnService { router, phase: phase.clone(), shared: shared.clone(), authenticated, poll };
    // Kept to look for unread bytes; the socket stays open as long as `conn` below.
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The head and idle deadlines are kept by `Phase` below: hyper's header timer would also
    // run while a kept-alive connection is idle, closing it after the (shorter) header timeout.
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(TokioIo::new(ConnIo::new(stream, phase.clone())), service);
    let mut conn = pin!(conn);
    let (header, idle) = (shared.cfg.header_timeout, shared.cfg.idle_timeout);
    let mut pressure = shared.admission.pressure();
    let brief = |pressure: &watch::Receiver<bool>| {
        let authenticated = ticket.authenticated.load(Ordering::Relaxed);
        (*pressure.borrow()).then_some(if authenticated {
            BRIEF_IDLE_AUTHENTICATED
        } else {
            BRIEF_IDLE_UNAUTHENTICATED
        })
    };
    // One timer for the connection's life, reset only when it fires or pressure changes: phase
    // changes do not wake this task (see `PhaseCell`).
    let check =
        tokio::time::sleep_until(phase.get().next_check(Instant::now(), header, idle, brief(&pressure)));
    let mut check = pin!(check);
    let (mut stopping, mut pressure_open) = (false, true);
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                return;
            }
            () = check.as_mut() => match recheck(peer, &phase, fd, (header, idle), || brief(&pressure)) {
                Some(at) => check.as_mut().reset(at),
                None => return,
            },
            () = ticket.close.notified() => {
                // Asked to make room: only if still idle, since a request may have begun since.
                if phase.get().idle_since().is_some() && !io::has_unread_bytes(fd) {
                    shared.admission.closed_one_idle();
                    tracing::debug!(%peer, "closing an idle connection to make room for a new one");
                    return;
                }
            }
            changed = pressure.changed(), if pressure_open => {
                pressure_open = changed.is_ok();
                check.as_mut().reset(phase.get().next_check(Instant::now(), header, idle, brief(&pressure)));
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// What the connection's timer says when it fires: `None` to close it (past its deadline), else
/// when to look again. `brief` is the shortened wait for a request while slots are short.
fn recheck(
    peer: SocketAddr,
    phase: &PhaseCell,
    fd: std::os::fd::RawFd,
    (header, idle): (Duration, Duration),
    brief: impl Fn() -> Option<Duration>,
) -> Option<Instant> {
    let (now, current) = (Instant::now(), phase.get());
    if current.deadline(header, idle, brief()).is_some_and(|at| at <= now) {
        if current.idle_since().is_some() && io::has_unread_bytes(fd) {
            // A request arrived that hyper has not read yet: not idleness. Its first
            // bytes will start a head; look again once they have.
            return Some(now + UNREAD_RECHECK);
        }
        // Nothing is being served (no deadline runs then), so dropping the connection
        // loses no answer.
        tracing::debug!(%peer, phase = ?current, "closing a connection past its deadline");
        return None;
    }
    Some(current.next_check(now, header, idle, brief()))
}

/// What every connection shares: the limits, the request-body budget and the admission.
struct Shared {
    cfg: ServeConfig,
    bodies: Bodies,
    admission: Arc<Admission>,
    /// Refusals of connections whose address held its share, for a warning now and then.
    refused_ip: Throttled,
    /// Refused connections being answered now.
    refusing: Arc<Semaphore>,
}

impl Shared {
    /// Refuses a connection whose address holds its share: a 503 if it can be written at once,
    /// then the close; a warning now and then says so.
    fn refuse(&self, stream: TcpStream, peer: SocketAddr) {
        if let Some(refused) = self.refused_ip.hit() {
            tracing::warn!(
                client = %peer.ip(),
                max_connections_per_ip = self.admission.per_ip(),
                refused,
                "a client address holds its share of connections; refusing its new ones"
            );
        }
        // Past a few refusals at once, the flood gets closed sockets rather than answers.
        let Ok(permit) = self.refusing.clone().try_acquire_owned() else { return };
        tokio::spawn(async move {
            let _permit = permit;
            refuse_connection(stream).await;
        });
    }
}

/// Writes a 503 on a refused connection and closes it, reading what the client sends for a moment
/// so the close does not reset the connection before the client has read the answer.
async fn refuse_connection(mut stream: TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        "this client address holds its share of the server's connections (max_connections_per_ip); \
         reuse or close one",
    );
    let body = e.body().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let refused = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(REFUSAL_LINGER, refused).await;
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
    /// Client connections open now.
    pub connections: u64,
    /// The cap on them in force: `max_connections`, lowered at start to fit the file-handle limit.
    pub max_connections: u64,
    /// Most connections one client address may hold.
    pub max_connections_per_ip: u64,
    /// Connections refused since start because their address held its share.
    pub refused_connections: u64,
    /// Idle connections closed since start to make room for new ones.
    pub closed_idle_connections: u64,
    /// Long polls answered early (empty) since start to make room for new connections.
    pub cut_long_polls: u64,
    /// Request-body bytes reserved by the requests being served now.
    pub body_memory_bytes: u64,
    /// The most they may reserve together (`max_body_memory`).
    pub max_body_memory: u64,
    /// Requests answered 503 since start because the bodies in flight filled `max_body_memory`.
    pub refused_bodies: u64,
}

/// A handle on the running server for `/v1/stats`; the server adds it to every request.
#[derive(Clone)]
pub struct ServerView(Arc<Shared>);

impl ServerView {
    /// The server's figures now.
    pub fn stats(&self) -> HttpStats {
        let s = &self.0;
        HttpStats {
            connections: s.admission.open() as u64,
            max_connections: s.cfg.max_connections as u64,
            max_connections_per_ip: s.admission.per_ip() as u64,
            refused_connections: s.admission.refused(),
            closed_idle_connections: s.admission.closed_idle(),
            cut_long_polls: s.admission.cut_polls(),
            body_memory_bytes: s.bodies.budget.in_use() as u64,
            max_body_memory: s.cfg.max_body_memory,
            refused_bodies: s.bodies.refused_total.load(Ordering::Relaxed),
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
    shared: Arc<Shared>,
    /// The connection's: set by its first request with the bearer token.
    authenticated: Arc<AtomicBool>,
    /// The connection's long poll, which the accept loop may cut short.
    poll: Arc<LongPoll>,
}

impl ConnService {
    /// Whether the request carries a bearer token (full or read-only), or none is needed.
    fn authorized(&self, headers: &axum::http::HeaderMap) -> bool {
        let cfg = &self.shared.cfg;
        super::access(cfg.auth_token.as_deref(), cfg.read_token.as_deref(), headers) != super::Access::None
    }

    /// Lets a request's body in, reserving its memory, or refuses the request before any of the
    /// body is read: 413 when it declares more than the request limit (the router would only
    /// refuse it after reading that much), 503 when the bodies in flight leave no room for it.
    fn admit_body(&self, size: http_body::SizeHint) -> Result<Option<BodyPermit>, ApiError> {
        let limit = self.shared.cfg.body_limit;
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
        if let Some(permit) = self.shared.bodies.budget.try_reserve(need) {
            return Ok(Some(permit));
        }
        self.shared.bodies.refused_total.fetch_add(1, Ordering::Relaxed);
        if let Some(refused) = self.shared.bodies.refused.hit() {
            tracing::warn!(
                max_body_memory = self.shared.cfg.max_body_memory,
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
    if !super::compat_paths::is_compat_path(path) {
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
        let deadline = Instant::now() + self.shared.cfg.body_timeout;
        let expects_continue = req
            .headers()
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        // A request without the token gets its 401 from the router before its body is read, and
        // must not take budget that authorized requests need; it is not a too-large one either,
        // so a client without the token learns nothing of the limits.
        let authorized = self.authorized(req.headers());
        if authorized && self.shared.cfg.auth_token.is_some() {
            self.authenticated.store(true, Ordering::Relaxed);
        }
        let admitted = if authorized { self.admit_body(req.body().size_hint()) } else { Ok(None) };
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
        let poll = is_long_poll(&parts)
            .then(|| (self.poll.clone(), super::compat_paths::is_compat_path(parts.uri.path())));
        let req = Request::from_parts(parts, axum::body::Body::new(body));
        let router = self.router.clone();
        Box::pin(async move {
            let served = async {
                match router.oneshot(req).await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                }
            };
            let resp = match poll {
                None => served.await,
                Some((poll, compat)) => match poll.run(served).await {
                    Some(resp) => resp,
                    // Cut short to make room: dropped as a graceful stop drops a waiting pop,
                    // answered as if the wait had run out, and the connection goes.
                    None => {
                        let mut resp = poll_cut_answer(compat);
                        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                        resp
                    }
                },
            };
            // The handler has let go of the body it buffered.
            drop(permit);
            answer(resp, leftover, expects_continue, deadline, phase).await
        })
    }
}

/// Whether a request is a pop that may wait: the native `POST /v1/topics/{topic}/pop`, or the
/// compat `/pop` (any method, as its router takes).
fn is_long_poll(parts: &axum::http::request::Parts) -> bool {
    let path = parts.uri.path();
    path == "/pop"
        || (parts.method == axum::http::Method::POST
            && path.starts_with("/v1/topics/")
            && path.ends_with("/pop"))
}

/// The answer of a long poll cut short: what its wait running out gives.
fn poll_cut_answer(compat: bool) -> Response<axum::body::Body> {
    let body = if compat {
        serde_json::json!({"code": 0, "message": "ok", "data": null})
    } else {
        serde_json::json!({"messages": []})
    };
    axum::Json(body).into_response()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_the_file_limit_and_each_address_gets_a_share() {
        let mut c = ServeConfig::from_config(&Config::default());
        assert_eq!((c.max_connections, c.per_ip()), (10_000, 5000));
        // Room to spare: unchanged.
        assert_eq!(c.fit_to_file_handles(1 << 20, 1024), None);
        assert_eq!(c.fit_to_file_handles(u64::MAX, 1024), None);
        // 8192 handles, 1024 queue files, 64 more for the store and 1024 for push: 6080 left.
        assert_eq!(c.fit_to_file_handles(8192, 1024), Some(6080));
        assert_eq!((c.max_connections, c.per_ip()), (6080, 3040), "the share follows the cap");
        // Fewer handles than the reserve: half of them still serve connections.
        assert_eq!(c.fit_to_file_handles(1024, 1024), Some(512));
        let mut c = ServeConfig { max_connections_per_ip: Some(20_000), ..c };
        assert_eq!(c.per_ip(), 20_000, "a share above the cap only lets the address wait like others");
        c.max_connections_per_ip = Some(0);
        assert_eq!(c.per_ip(), 1);
    }

    #[test]
    fn warnings_are_counted_and_throttled() {
        let t = Throttled::default();
        assert_eq!(t.hit(), Some(1));
        assert_eq!(t.hit(), None);
        assert_eq!(t.hit(), None);
        *t.0.lock().unwrap() = (Some(Instant::now() - FULL_WARNING_EVERY), 2);
        assert_eq!(t.hit(), Some(3), "the next warning counts what it held back");
    }
}
