//! The HTTP side of delayd-cli: one request per command, following a cluster's redirects to the
//! leader and waiting out an election, and what an answer or its absence means for the exit code.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use url::Url;

/// Time allowed for any request beyond the long-poll wait it asks for.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Time allowed to open the TCP connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Redirects followed for one request: a follower points at the leader, which answers itself, so
/// more than a few means nodes that disagree about who leads (or a loop).
pub(crate) const MAX_REDIRECTS: usize = 5;
/// How long a `503 no_leader` is retried, from the first one: an election takes a few seconds.
pub(crate) const NO_LEADER_PATIENCE: Duration = Duration::from_secs(10);
/// The longest single wait on `Retry-After`, so a new leader is found soon after it is elected.
pub(crate) const MAX_RETRY_WAIT: Duration = Duration::from_secs(2);
/// The shortest, so a `Retry-After: 0` does not turn into a busy loop.
pub(crate) const MIN_RETRY_WAIT: Duration = Duration::from_millis(100);
/// The wait when a `503 no_leader` has no readable `Retry-After`.
pub(crate) const DEFAULT_RETRY_WAIT: Duration = Duration::from_secs(1);
/// What the CLI says when the cluster stayed without a leader for NO_LEADER_PATIENCE.
pub(crate) const NO_LEADER: &str = "no leader: the cluster is electing one or has lost its majority";

/// Why a command failed; each kind has its own exit code.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The API answered with an error status.
    Api { status: StatusCode, code: String, message: String },
    /// Anything else: a 2xx answer this client cannot read, an HTTP client that cannot start.
    Other(String),
    /// Bad input that clap could not check (e.g. a body on stdin that is not UTF-8).
    Input(String),
    /// No answer: connection refused, timeout, reset.
    Unreachable { url: String, cause: String },
}

impl Failure {
    pub(crate) fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            Failure::Api { .. } | Failure::Other(_) => 1,
            Failure::Input(_) => 2,
            Failure::Unreachable { .. } => 3,
        })
    }

    pub(crate) fn message(&self) -> String {
        match self {
            Failure::Api { code, message, .. } if !code.is_empty() => format!("error: {code}: {message}"),
            Failure::Api { status, message, .. } => format!("error: HTTP {status}: {message}"),
            Failure::Other(m) | Failure::Input(m) => format!("error: {m}"),
            Failure::Unreachable { url, cause } => format!("error: cannot reach delayd at {url}: {cause}"),
        }
    }
}

/// One successful answer: the raw text, for `--json`, and its parsed form, for tables.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) text: String,
    pub(crate) value: Value,
}

/// Talks to one server, or to the cluster behind it.
pub(crate) struct Api {
    base: Url,
    token: Option<String>,
    /// `-v`: redirects and no-leader waits are told on stderr.
    verbose: bool,
    http: Client<HttpConnector, Full<Bytes>>,
    /// One request at a time: a single-threaded runtime is all the client needs.
    rt: tokio::runtime::Runtime,
}

/// Why a request got no answer: our own deadline ran out, or the transport failed.
pub(crate) enum NoAnswer {
    /// REQUEST_TIMEOUT (plus the long poll) ran out.
    TimedOut,
    /// Connecting, sending or reading failed; the error's chain says why.
    Error(Box<dyn std::error::Error + Send + Sync>),
}

/// The cause shown when one of our own deadlines ran out.
pub(crate) const OWN_TIMEOUT: &str = "no answer in time (operation timed out)";

/// A request as built once, kept whole so that it can be sent again unchanged: to the leader a
/// follower redirects to, and after a no-leader wait.
pub(crate) struct Prepared {
    method: Method,
    url: Url,
    /// Authorization included: the token is cluster-wide, so the leader needs it as much as the
    /// node that redirected.
    headers: HeaderMap,
    payload: Bytes,
    /// For each exchange: REQUEST_TIMEOUT plus any long poll.
    timeout: Duration,
}

/// One raw answer, before it is judged.
pub(crate) struct Raw {
    /// The URL that gave it (after redirects).
    url: Url,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Api {
    pub(crate) fn new(base: Url, token: Option<String>, verbose: bool) -> Result<Api, Failure> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Failure::Other(format!("cannot set up the HTTP client: {e}")))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        // A request is one small write: Nagle's delay would only add latency.
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Api { base, token, verbose, http, rt })
    }

    /// The base URL plus `segments`, each percent-encoded (ids may hold `/`, `?`, `#`, Unicode).
    pub(crate) fn url(&self, segments: &[&str]) -> Result<Url, Failure> {
        // URL rules resolve `.` and `..` even percent-encoded, so `get ..` would silently ask for
        // another path; the API allows no such id or topic anyway.
        if let Some(bad) = segments.iter().find(|s| matches!(**s, "" | "." | "..")) {
            return Err(Failure::Input(format!("{bad:?} is not a valid topic or id")));
        }
        let mut url = self.base.clone();
        // `parse_base_url` refused URLs that cannot be a base, so the segments are always there.
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        Ok(url)
    }

    /// Tells `-v` users what happened to their request.
    pub(crate) fn note(&self, what: &str) {
        if self.verbose {
            eprintln!("delayd-cli: {what}");
        }
    }

    /// Sends the request, following redirects and waiting out an election, and reads the whole
    /// answer; a non-2xx answer becomes `Failure::Api` with the server's code and message.
    pub(crate) fn send(&self, req: &Prepared) -> Result<Answer, Failure> {
        let mut no_leader_since: Option<Instant> = None;
        loop {
            let raw = self.follow(req)?;
            if raw.status != StatusCode::SERVICE_UNAVAILABLE || error_code(&raw.body) != "no_leader" {
                return judge(raw.status, &raw.body);
            }
            // A 503 no_leader means the request was not taken, so sending it again is safe. It
            // goes to the node the user named, which learns of the new leader and redirects.
            let since = *no_leader_since.get_or_insert_with(Instant::now);
            let left = NO_LEADER_PATIENCE.saturating_sub(since.elapsed());
            if left.is_zero() {
                return Err(Failure::Other(format!("{NO_LEADER} (still none after {NO_LEADER_PATIENCE:?})")));
            }
            let wait = retry_after(&raw.headers).clamp(MIN_RETRY_WAIT, MAX_RETRY_WAIT).min(left);
            self.note(&format!("{} has no leader; asking again in {wait:?}", origin(&raw.url)));
            std::thread::sleep(wait);
        }
    }

    /// Sends the request to its URL and then to each `307`/`308` `Location`, at most
    /// MAX_REDIRECTS times, and returns the first answer that is not a redirect.
    pub(crate) fn follow(&self, req: &Prepared) -> Result<Raw, Failure> {
        let mut url = req.url.clone();
        let mut redirected_by: Option<Url> = None;
        let mut hops = 0;
        loop {
            let raw = self.exchange(req, url, redirected_by.as_ref())?;
            let redirect =
                matches!(raw.status, StatusCode::TEMPORARY_REDIRECT | StatusCode::PERMANENT_REDIRECT);
            let Some(location) = raw.headers.get(LOCATION).filter(|_| redirect) else {
                return Ok(raw);
            };
            let next =
                location.to_str().ok().and_then(|l| raw.url.join(l).ok()).ok_or_else(|| {
                    Failure::Other(format!("{} redirected to an unreadable Location", raw.url))
                })?;
            if next.scheme() != "http" {
                return Err(Failure::Other(format!(
                    "{} redirected to {next}, which this client cannot follow (only http:// is supported)",
                    origin(&raw.url)
                )));
            }
            if hops == MAX_REDIRECTS {
                return Err(Failure::Other(format!(
                    "more than {MAX_REDIRECTS} redirects (the last from {} to {next}); do the nodes agree \
                     on a leader?",
                    origin(&raw.url)
                )));
            }
            hops += 1;
            self.note(&format!("{} from {}: following to {next}", raw.status.as_u16(), origin(&raw.url)));
            url = next;
            redirected_by = Some(raw.url);
        }
    }

    /// One exchange with one URL within the request's timeout.
    pub(crate) fn exchange(
        &self,
        req: &Prepared,
        url: Url,
        redirected_by: Option<&Url>,
    ) -> Result<Raw, Failure> {
        let no_answer = |e: NoAnswer| self.unreachable(e, &url, redirected_by);
        // Like a token that cannot be a header, a URL that hyper cannot send fails as unsendable.
        let uri: Uri = url.as_str().parse().map_err(|e: hyper::http::uri::InvalidUri| no_answer(e.into()))?;
        let mut request = Request::builder()
            .method(req.method.clone())
            .uri(uri)
            .body(Full::new(req.payload.clone()))
            .map_err(|e| Failure::Other(format!("cannot build the request: {e}")))?;
        *request.headers_mut() = req.headers.clone();
        let exchange = async {
            let resp = self.http.request(request).await.map_err(|e| NoAnswer::Error(e.into()))?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map_err(|e| NoAnswer::Error(e.into()))?;
            Ok((parts.status, parts.headers, body.to_bytes()))
        };
        let (status, headers, body) = self
            .rt
            .block_on(async {
                tokio::time::timeout(req.timeout, exchange).await.unwrap_or(Err(NoAnswer::TimedOut))
            })
            .map_err(no_answer)?;
        Ok(Raw { url, status, headers, body })
    }

    /// `url` failed to answer. The URL the user gave is named as given; a leader reached by
    /// redirect is named with the node that sent the CLI there.
    pub(crate) fn unreachable(&self, e: NoAnswer, url: &Url, redirected_by: Option<&Url>) -> Failure {
        let cause = match e {
            NoAnswer::TimedOut => OWN_TIMEOUT.to_string(),
            NoAnswer::Error(e) => root_cause(&*e),
        };
        let url = match redirected_by {
            None => self.base.as_str().trim_end_matches('/').to_string(),
            Some(by) => format!("{} (redirected there by {})", origin(url), origin(by)),
        };
        Failure::Unreachable { url, cause }
    }

    /// One request: `segments` under the base URL, `query` pairs, an optional JSON body, and
    /// `long_poll` on top of the usual timeout for a server that holds the request that long.
    pub(crate) fn call(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
        body: Option<&Value>,
        long_poll: Duration,
    ) -> Result<Answer, Failure> {
        let mut url = self.url(segments)?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("*/*"));
        if let Some(t) = &self.token {
            // A token that cannot be a header value fails here, as an unsendable request.
            let mut value = HeaderValue::try_from(format!("Bearer {t}"))
                .map_err(|e| self.unreachable(NoAnswer::Error(Box::new(e)), &url, None))?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let payload = match body {
            Some(b) => {
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                let bytes = serde_json::to_vec(b)
                    .map_err(|e| Failure::Other(format!("cannot encode the request: {e}")))?;
                Bytes::from(bytes)
            }
            None => Bytes::new(),
        };
        let timeout = REQUEST_TIMEOUT.saturating_add(long_poll);
        self.send(&Prepared { method, url, headers, payload, timeout })
    }

    pub(crate) fn get(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Answer, Failure> {
        self.call(Method::GET, segments, query, None, Duration::ZERO)
    }

    pub(crate) fn post(&self, segments: &[&str], body: &Value) -> Result<Answer, Failure> {
        self.call(Method::POST, segments, &[], Some(body), Duration::ZERO)
    }
}

impl From<hyper::http::uri::InvalidUri> for NoAnswer {
    fn from(e: hyper::http::uri::InvalidUri) -> NoAnswer {
        NoAnswer::Error(Box::new(e))
    }
}

/// Why a transport error happened. The client's own sentence is generic ("client error
/// (Connect)"); the root cause says why.
pub(crate) fn root_cause(e: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
    let mut root: &(dyn std::error::Error + 'static) = e;
    let (mut timed_out, mut own_deadline) = (false, false);
    loop {
        let io = root.downcast_ref::<std::io::Error>();
        timed_out |= io.is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut);
        // CONNECT_TIMEOUT running out is a tokio deadline inside an io::Error.
        own_deadline |=
            io.and_then(|io| io.get_ref()).is_some_and(|inner| inner.is::<tokio::time::error::Elapsed>());
        match root.source() {
            Some(s) => root = s,
            None => break,
        }
    }
    match (own_deadline, timed_out) {
        (true, _) => OWN_TIMEOUT.to_string(),
        (false, true) => format!("no answer in time ({root})"),
        (false, false) => root.to_string(),
    }
}

/// A final answer: 2xx becomes an `Answer`, anything else `Failure::Api`.
pub(crate) fn judge(status: StatusCode, bytes: &[u8]) -> Result<Answer, Failure> {
    // delayd answers in UTF-8 JSON; anything else is shown as best it can be.
    let text = String::from_utf8_lossy(bytes).into_owned();
    let parsed = serde_json::from_str::<Value>(&text);
    if !status.is_success() {
        let err = parsed.as_ref().ok().and_then(|v| v.get("error"));
        let field = |k: &str| err.and_then(|e| e.get(k)).and_then(Value::as_str).map(str::to_string);
        return Err(Failure::Api {
            status,
            code: field("code").unwrap_or_default(),
            message: field("message").unwrap_or_else(|| snippet(&text)),
        });
    }
    // pause and resume may answer 200 with no body; treat that as an empty object.
    let value = if text.trim().is_empty() {
        json!({})
    } else {
        parsed
            .map_err(|e| Failure::Other(format!("unexpected answer, not JSON ({e}): {}", snippet(&text))))?
    };
    Ok(Answer { status, text, value })
}

/// The API's `error.code` in an error body, or "" when there is none.
pub(crate) fn error_code(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.get("code")?.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `Retry-After` in seconds; the HTTP-date form is not used by delayd and gets the default.
pub(crate) fn retry_after(headers: &HeaderMap) -> Duration {
    headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_RETRY_WAIT, Duration::from_secs)
}

/// `http://host:port`, how a node is named in messages (the path is the request's, not the node's).
pub(crate) fn origin(url: &Url) -> String {
    url.origin().ascii_serialization()
}

/// The first 200 characters of a body that is not the JSON we expected, for the error message.
pub(crate) fn snippet(text: &str) -> String {
    let t: String = text.trim().chars().take(200).collect();
    if t.is_empty() {
        "(empty body)".into()
    } else {
        t
    }
}
