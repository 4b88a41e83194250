//! `delayd-cli`: a command-line client for delayd's native HTTP API (`/v1`).
//!
//! Every command is one HTTP request. With `--json` the API's JSON answer is printed as is on
//! stdout, for scripts; otherwise a small aligned table or a sentence. Exit codes: 0 success,
//! 1 the API answered with an error (its code and message go to stderr), 2 usage or input error,
//! 3 the server could not be reached or did not answer.
//!
//! In a cluster any node may be given: a follower's `307`/`308` redirect to the leader is followed
//! (the same method, body and token), and a `503 no_leader` during an election is waited out.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use delayd::config::units::{parse_duration, parse_duration_list, parse_u64};
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use url::Url;

/// Time allowed for any request beyond the long-poll wait it asks for.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Time allowed to open the TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Redirects followed for one request: a follower points at the leader, which answers itself, so
/// more than a few means nodes that disagree about who leads (or a loop).
const MAX_REDIRECTS: usize = 5;
/// How long a `503 no_leader` is retried, from the first one: an election takes a few seconds.
const NO_LEADER_PATIENCE: Duration = Duration::from_secs(10);
/// The longest single wait on `Retry-After`, so a new leader is found soon after it is elected.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(2);
/// The shortest, so a `Retry-After: 0` does not turn into a busy loop.
const MIN_RETRY_WAIT: Duration = Duration::from_millis(100);
/// The wait when a `503 no_leader` has no readable `Retry-After`.
const DEFAULT_RETRY_WAIT: Duration = Duration::from_secs(1);
/// What the CLI says when the cluster stayed without a leader for NO_LEADER_PATIENCE.
const NO_LEADER: &str = "no leader: the cluster is electing one or has lost its majority";

/// Command-line client for the delayd delay-message broker.
#[derive(Debug, Parser)]
#[command(name = "delayd-cli", version, after_help = EXIT_CODES)]
struct Cli {
    /// Base URL of the delayd server.
    #[arg(
        long,
        env = "DELAYD_URL",
        default_value = "http://127.0.0.1:9277",
        value_parser = parse_base_url,
        global = true,
        help_heading = "Global options"
    )]
    url: Url,

    /// Bearer token, when the server has auth_token set.
    // The value is a secret: keep it out of `--help`, which would otherwise show the variable's value.
    #[arg(
        long,
        env = "DELAYD_AUTH_TOKEN",
        hide_env_values = true,
        global = true,
        help_heading = "Global options"
    )]
    token: Option<String>,

    /// Print the API's JSON answer on stdout instead of a table.
    #[arg(long, global = true, help_heading = "Global options")]
    json: bool,

    /// Say on stderr where requests went: redirects to the leader, waits for an election.
    #[arg(short, long, global = true, help_heading = "Global options")]
    verbose: bool,

    #[command(subcommand)]
    command: Command,
}

const EXIT_CODES: &str = "Exit codes: 0 success; 1 the API answered with an error (code and message on \
stderr); 2 usage or input error; 3 the server could not be reached or did not answer.\n\
Durations: 500ms, 30s, 1h30m, 2d, or a plain number of milliseconds; --delay needs a unit (0 alone \
means now).";

#[derive(Debug, Subcommand)]
enum Command {
    /// Produce a message (BODY `-` reads it from stdin, byte for byte).
    Produce(Produce),
    /// Pop ready messages, reserving each for its time-to-run.
    Pop {
        /// Topic to pop from.
        topic: String,
        /// Most messages to return (the server's default is 1).
        #[arg(long)]
        max: Option<u64>,
        /// Wait this long for a message when none is ready (capped by the server's max_wait).
        #[arg(long, value_parser = parse_duration)]
        wait: Option<u64>,
        /// Reserve the popped messages for this long instead of their own time-to-run.
        #[arg(long, value_parser = parse_duration)]
        ttr: Option<u64>,
    },
    /// Acknowledge a delivery: the message is done.
    Ack {
        /// Receipt from the pop.
        receipt: String,
    },
    /// Extend a reservation for a long job; the receipt stays valid.
    Touch {
        /// Receipt from the pop.
        receipt: String,
        /// The reservation now ends this long from now (30s, 10m).
        #[arg(long, value_parser = parse_duration)]
        ttr: u64,
    },
    /// Give a delivery back for a retry (or dead-lettering once its attempts are used up).
    Nack {
        /// Receipt from the pop.
        receipt: String,
        /// Retry after this long, with a unit (30s, 500ms), instead of the next backoff step.
        #[arg(long, value_parser = parse_delay)]
        delay: Option<u64>,
        /// Why the work failed, kept as the message's last error (`get` shows it).
        #[arg(long)]
        error: Option<String>,
    },
    /// Show one message.
    Get {
        /// Message id.
        id: String,
    },
    /// Move a pending message to a new due time, keeping its id (--delay 0 delivers it now).
    Reschedule(Reschedule),
    /// Cancel a message that has not been acked.
    Cancel {
        /// Message id.
        id: String,
    },
    /// Show the broker's levels, topics and storage counters.
    Stats,
    /// List every topic with its counts and whether it is paused.
    Topics,
    /// List a topic's messages.
    Browse {
        /// Topic to list.
        topic: String,
        /// Only messages in this state.
        #[arg(long)]
        state: Option<String>,
        /// Most messages to list.
        #[arg(long)]
        limit: Option<u64>,
        /// Continue from the `next_cursor` of an earlier page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Move dead-lettered messages of TOPIC back to it.
    Redrive {
        /// Topic whose dead letters to move back (`orders.dlq` is taken as `orders`).
        topic: String,
        /// Only these message ids (repeatable); all of them when not given.
        #[arg(long = "id")]
        ids: Vec<String>,
    },
    /// Cancel every delayed, ready and reserved message of a topic (asks for --yes).
    Purge {
        /// Topic to purge.
        topic: String,
        /// Do it: without this flag nothing is purged.
        #[arg(long)]
        yes: bool,
    },
    /// Stop pops from a topic (messages keep coming due).
    Pause {
        /// Topic to pause.
        topic: String,
    },
    /// Let pops from a paused topic go on.
    Resume {
        /// Topic to resume.
        topic: String,
    },
    /// Inspect or change the cluster this node belongs to.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
}

/// Subcommands of `cluster`.
#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Show the leader, the term and every node with its role (`*` marks the node that answered).
    Status,
    /// Add a node (started with cluster_join = true): it joins as a learner and becomes a voter
    /// once it has caught up.
    Add {
        /// The new node's id.
        node_id: u64,
        /// Its cluster address, HOST:PORT of its cluster_listen.
        cluster_addr: String,
    },
    /// Remove a node; it stops. Removing the leader hands its lead over first.
    Remove {
        /// The node to remove.
        node_id: u64,
    },
}

/// Arguments of `produce`.
#[derive(Debug, Args)]
struct Produce {
    /// Topic to produce to.
    topic: String,
    /// Message body; `-` reads it from stdin.
    body: String,
    /// Message id (the broker makes one when not given).
    #[arg(long)]
    id: Option<String>,
    /// Deliver after this long, with a unit: 500ms, 5s, 1h30m (0 alone means now).
    #[arg(long, value_parser = parse_delay, group = "when")]
    delay: Option<u64>,
    /// Deliver at this time: unix milliseconds or an RFC 3339 time (2026-12-01T09:00:00Z,
    /// 2026-12-01T09:00:00.250+02:00).
    #[arg(long, value_parser = unix_ms, group = "when")]
    at: Option<u64>,
    /// Deliver after this configured delay level: a 1-based index or its duration (1m).
    #[arg(long, group = "when")]
    level: Option<String>,
    /// Time-to-run: how long a pop reserves the message before it comes back.
    #[arg(long, value_parser = parse_duration)]
    ttr: Option<u64>,
    /// Deliveries before the message is dead-lettered.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Retry delays after each nack, e.g. "1m 5m 30m".
    #[arg(long, value_parser = backoff_ms)]
    backoff: Option<Backoff>,
}

/// Arguments of `reschedule`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("when").required(true)))]
struct Reschedule {
    /// Message id.
    id: String,
    /// Deliver after this long from now, with a unit: 500ms, 5s, 1h30m (0 alone means now).
    #[arg(long, value_parser = parse_delay, group = "when")]
    delay: Option<u64>,
    /// Deliver at this time: unix milliseconds or an RFC 3339 time (2026-12-01T09:00:00Z,
    /// 2026-12-01T09:00:00.250+02:00).
    #[arg(long, value_parser = unix_ms, group = "when")]
    at: Option<u64>,
    /// A new time-to-run for its later deliveries.
    #[arg(long, value_parser = parse_duration)]
    ttr: Option<u64>,
    /// A new limit of deliveries before it is dead-lettered.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Also move a message a consumer holds reserved (its receipt stops working).
    #[arg(long)]
    force: bool,
}

/// `PATCH /v1/messages/{id}` with the fields `r` gives.
fn reschedule(api: &Api, r: Reschedule) -> Result<Answer, Failure> {
    let mut body = json!({});
    if let Some(d) = r.delay {
        body["delay_ms"] = json!(d);
    }
    if let Some(at) = r.at {
        body["deliver_at_ms"] = json!(at);
    }
    if let Some(t) = r.ttr {
        body["ttr_ms"] = json!(t);
    }
    if let Some(m) = r.max_attempts {
        body["max_attempts"] = json!(m);
    }
    if r.force {
        body["force"] = json!(true);
    }
    api.call(Method::PATCH, &["v1", "messages", &r.id], &[], Some(&body), Duration::ZERO)
}

fn show_rescheduled(a: &Answer) -> String {
    let v = &a.value;
    table(
        &["ID", "STATE", "DELIVER_AT"],
        &[vec![text(&v["id"]), text(&v["state"]), time(&v["deliver_at_ms"])]],
    )
}

/// `--backoff` as milliseconds; a newtype, as clap would take a bare `Vec` for a repeatable flag.
#[derive(Debug, Clone)]
struct Backoff(Vec<u64>);

fn backoff_ms(s: &str) -> Result<Backoff, String> {
    let steps = parse_duration_list(s)?;
    if steps.is_empty() {
        return Err("give at least one duration, e.g. \"1m 5m\"".into());
    }
    Ok(Backoff(steps))
}

/// A delay with a unit. A bare number is refused (except 0, which is now in any unit): ouqiang's
/// `delay` is seconds and delayd's is milliseconds, so `--delay 5` would silently mean either.
fn parse_delay(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
        return match parse_u64(t)? {
            0 => Ok(0),
            n => Err(format!("{t:?} has no unit: add one, e.g. {n}s for seconds or {n}ms for milliseconds")),
        };
    }
    parse_duration(s)
}

/// A plain number is unix ms; anything else must be an RFC 3339 time, with `Z`, a `±HH:MM` offset
/// or none (UTC).
fn unix_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
        return parse_u64(s);
    }
    // humantime reads UTC only: the offset is taken off here and applied after.
    let (local, offset_s) = split_offset(t).map_err(|e| format!("{s:?}: {e}"))?;
    let at = humantime::parse_rfc3339_weak(&local.to_ascii_uppercase())
        .map_err(|e| format!("{s:?} is neither unix milliseconds nor an RFC 3339 time ({e})"))?;
    let utc = if offset_s >= 0 {
        at.checked_sub(Duration::from_secs(offset_s.unsigned_abs()))
    } else {
        at.checked_add(Duration::from_secs(offset_s.unsigned_abs()))
    };
    let d =
        utc.and_then(|u| u.duration_since(UNIX_EPOCH).ok()).ok_or_else(|| format!("{s:?} is before 1970"))?;
    u64::try_from(d.as_millis()).map_err(|_| format!("{s:?} is too far ahead"))
}

/// Splits a trailing RFC 3339 `±HH:MM` offset off a date-time: (the rest, the offset in seconds
/// east of UTC); a time without one is returned whole with 0.
fn split_offset(t: &str) -> Result<(&str, i64), String> {
    // The offset follows `YYYY-MM-DDTHH:MM:SS` (19 bytes), so the date's own `-` never matches.
    let Some(cut) = t.len().checked_sub(6).filter(|c| *c >= 19 && t.is_char_boundary(*c)) else {
        return Ok((t, 0));
    };
    let (rest, off) = t.split_at(cut);
    let b = off.as_bytes();
    let sign = match b[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return Ok((t, 0)),
    };
    let digits =
        |x: &[u8]| x.iter().all(u8::is_ascii_digit).then(|| i64::from((x[0] - b'0') * 10 + (x[1] - b'0')));
    match (digits(&b[1..3]), b[3], digits(&b[4..6])) {
        (Some(h), b':', Some(m)) if h <= 23 && m <= 59 => Ok((rest, sign * (h * 3600 + m * 60))),
        _ => Err(format!("{off:?} is not a UTC offset of the form +HH:MM")),
    }
}

fn parse_base_url(s: &str) -> Result<Url, String> {
    let url = Url::parse(s).map_err(|e| format!("{s:?} is not a URL ({e})"))?;
    // The client here speaks plain HTTP only, as delayd itself does.
    if url.scheme() != "http" {
        return Err(format!("{s:?}: only http:// URLs are supported"));
    }
    if url.cannot_be_a_base() || url.host().is_none() {
        return Err(format!("{s:?} has no host"));
    }
    Ok(url)
}

/// Why a command failed; each kind has its own exit code.
#[derive(Debug)]
enum Failure {
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
    fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            Failure::Api { .. } | Failure::Other(_) => 1,
            Failure::Input(_) => 2,
            Failure::Unreachable { .. } => 3,
        })
    }

    fn message(&self) -> String {
        match self {
            Failure::Api { code, message, .. } if !code.is_empty() => format!("error: {code}: {message}"),
            Failure::Api { status, message, .. } => format!("error: HTTP {status}: {message}"),
            Failure::Other(m) | Failure::Input(m) => format!("error: {m}"),
            Failure::Unreachable { url, cause } => format!("error: cannot reach delayd at {url}: {cause}"),
        }
    }
}

/// One successful answer: the raw text, for `--json`, and its parsed form, for tables.
struct Answer {
    status: StatusCode,
    text: String,
    value: Value,
}

/// Talks to one server, or to the cluster behind it.
struct Api {
    base: Url,
    token: Option<String>,
    /// `-v`: redirects and no-leader waits are told on stderr.
    verbose: bool,
    http: Client<HttpConnector, Full<Bytes>>,
    /// One request at a time: a single-threaded runtime is all the client needs.
    rt: tokio::runtime::Runtime,
}

/// Why a request got no answer: our own deadline ran out, or the transport failed.
enum NoAnswer {
    /// REQUEST_TIMEOUT (plus the long poll) ran out.
    TimedOut,
    /// Connecting, sending or reading failed; the error's chain says why.
    Error(Box<dyn std::error::Error + Send + Sync>),
}

/// The cause shown when one of our own deadlines ran out.
const OWN_TIMEOUT: &str = "no answer in time (operation timed out)";

/// A request as built once, kept whole so that it can be sent again unchanged: to the leader a
/// follower redirects to, and after a no-leader wait.
struct Prepared {
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
struct Raw {
    /// The URL that gave it (after redirects).
    url: Url,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Api {
    fn new(base: Url, token: Option<String>, verbose: bool) -> Result<Api, Failure> {
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
    fn url(&self, segments: &[&str]) -> Result<Url, Failure> {
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
    fn note(&self, what: &str) {
        if self.verbose {
            eprintln!("delayd-cli: {what}");
        }
    }

    /// Sends the request, following redirects and waiting out an election, and reads the whole
    /// answer; a non-2xx answer becomes `Failure::Api` with the server's code and message.
    fn send(&self, req: &Prepared) -> Result<Answer, Failure> {
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
    fn follow(&self, req: &Prepared) -> Result<Raw, Failure> {
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
    fn exchange(&self, req: &Prepared, url: Url, redirected_by: Option<&Url>) -> Result<Raw, Failure> {
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
    fn unreachable(&self, e: NoAnswer, url: &Url, redirected_by: Option<&Url>) -> Failure {
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
    fn call(
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

    fn get(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Answer, Failure> {
        self.call(Method::GET, segments, query, None, Duration::ZERO)
    }

    fn post(&self, segments: &[&str], body: &Value) -> Result<Answer, Failure> {
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
fn root_cause(e: &(dyn std::error::Error + Send + Sync + 'static)) -> String {
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
fn judge(status: StatusCode, bytes: &[u8]) -> Result<Answer, Failure> {
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
fn error_code(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.get("code")?.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `Retry-After` in seconds; the HTTP-date form is not used by delayd and gets the default.
fn retry_after(headers: &HeaderMap) -> Duration {
    headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_RETRY_WAIT, Duration::from_secs)
}

/// `http://host:port`, how a node is named in messages (the path is the request's, not the node's).
fn origin(url: &Url) -> String {
    url.origin().ascii_serialization()
}

/// The first 200 characters of a body that is not the JSON we expected, for the error message.
fn snippet(text: &str) -> String {
    let t: String = text.trim().chars().take(200).collect();
    if t.is_empty() {
        "(empty body)".into()
    } else {
        t
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let result = Api::new(cli.url, cli.token, cli.verbose).and_then(|api| run(&api, cli.command));
    match result {
        Ok(output) => {
            let out = if json {
                // The API's document as sent; an empty body (pause, resume) prints as `{}`.
                let text = output.text.trim();
                format!("{}\n", if text.is_empty() { "{}" } else { text })
            } else {
                output.human
            };
            write_stdout(&out)
        }
        Err(f) => {
            eprintln!("{}", f.message());
            f.exit_code()
        }
    }
}

/// Writes without panicking when stdout is closed early (`delayd-cli stats | head -1`).
fn write_stdout(out: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What `main` prints: the raw answer for `--json`, the readable form otherwise.
struct Output {
    text: String,
    human: String,
}

fn run(api: &Api, command: Command) -> Result<Output, Failure> {
    let (answer, human): (Answer, fn(&Answer) -> String) = match command {
        Command::Produce(p) => (produce(api, p)?, show_produced),
        Command::Pop { topic, max, wait, ttr } => (pop(api, &topic, max, wait, ttr)?, show_popped),
        Command::Ack { receipt } => {
            (api.post(&["v1", "ack"], &json!({ "receipt": receipt }))?, |_| "acked\n".into())
        }
        Command::Touch { receipt, ttr } => {
            (api.post(&["v1", "touch"], &json!({ "receipt": receipt, "ttr_ms": ttr }))?, |a| {
                format!("reserved until {}\n", time(&a.value["expires_at_ms"]))
            })
        }
        Command::Nack { receipt, delay, error } => {
            let mut body = json!({ "receipt": receipt });
            if let Some(d) = delay {
                body["delay_ms"] = json!(d);
            }
            if let Some(e) = error {
                body["error"] = json!(e);
            }
            (api.post(&["v1", "nack"], &body)?, show_nacked)
        }
        Command::Get { id } => (api.get(&["v1", "messages", &id], &[])?, show_message),
        Command::Reschedule(r) => (reschedule(api, r)?, show_rescheduled),
        Command::Cancel { id } => {
            (api.call(Method::DELETE, &["v1", "messages", &id], &[], None, Duration::ZERO)?, |a| {
                format!("cancelled {}\n", text(&a.value["id"]))
            })
        }
        Command::Stats => (api.get(&["v1", "stats"], &[])?, show_stats),
        Command::Topics => (api.get(&["v1", "topics"], &[])?, show_topics),
        Command::Browse { topic, state, limit, cursor } => {
            let query: Vec<(&str, String)> =
                [("state", state), ("limit", limit.map(|n| n.to_string())), ("cursor", cursor)]
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k, v)))
                    .collect();
            (api.get(&["v1", "topics", &topic, "messages"], &query)?, show_browse)
        }
        Command::Redrive { topic, ids } => {
            (redrive(api, &topic, ids)?, |a| format!("moved {}\n", text(&a.value["moved"])))
        }
        Command::Purge { topic, yes } => {
            (purge(api, &topic, yes)?, |a| format!("cancelled {}\n", text(&a.value["cancelled"])))
        }
        // These take no fields; `{}` is sent so a handler that reads a JSON body accepts it too.
        Command::Pause { topic } => {
            (api.post(&["v1", "topics", &topic, "pause"], &json!({}))?, |_| "paused\n".into())
        }
        Command::Resume { topic } => {
            (api.post(&["v1", "topics", &topic, "resume"], &json!({}))?, |_| "resumed\n".into())
        }
        Command::Cluster { command: ClusterCommand::Status } => {
            (api.get(&["v1", "cluster"], &[])?, show_cluster)
        }
        Command::Cluster { command: ClusterCommand::Add { node_id, cluster_addr } } => {
            let body = json!({ "node_id": node_id, "cluster_addr": cluster_addr });
            (api.post(&["v1", "cluster", "nodes"], &body)?, |a| {
                format!("node {}: {}\n", text(&a.value["node_id"]), text(&a.value["status"]))
            })
        }
        Command::Cluster { command: ClusterCommand::Remove { node_id } } => {
            let id = node_id.to_string();
            (api.call(Method::DELETE, &["v1", "cluster", "nodes", &id], &[], None, Duration::ZERO)?, |a| {
                format!("node {}: {}\n", text(&a.value["node_id"]), text(&a.value["status"]))
            })
        }
    };
    Ok(Output { human: human(&answer), text: answer.text })
}

/// Tells the user something beside the answer, on stderr so `--json` output stays one document.
fn note(what: &str) {
    eprintln!("note: {what}");
}

/// The topic as `GET /v1/topics` lists it (counts and `paused`), or None when it has none.
fn topic_info(api: &Api, topic: &str) -> Result<Option<Value>, Failure> {
    let all = api.get(&["v1", "topics"], &[])?;
    Ok(items(&all.value, "topics").iter().find(|t| t["topic"] == topic).cloned())
}

fn pop(
    api: &Api,
    topic: &str,
    max: Option<u64>,
    wait: Option<u64>,
    ttr: Option<u64>,
) -> Result<Answer, Failure> {
    let query: Vec<(&str, String)> = [("max", max), ("wait_ms", wait), ("ttr_ms", ttr)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v.to_string())))
        .collect();
    // No body: the API takes none for a pop. The server holds the request up to `wait`.
    let long_poll = Duration::from_millis(wait.unwrap_or(0));
    let answer = api.call(Method::POST, &["v1", "topics", topic, "pop"], &query, None, long_poll)?;
    // A paused topic answers like an empty one; one more request tells the two apart. The hint is
    // best effort: the pop itself succeeded, so a failure here is not reported.
    if items(&answer.value, "messages").is_empty() {
        if let Ok(Some(info)) = topic_info(api, topic) {
            if info["paused"] == true {
                note(&format!(
                    "topic {topic} is paused: pops find nothing until `delayd-cli resume {topic}`"
                ));
            }
        }
    }
    Ok(answer)
}

/// `redrive X.dlq` is taken as `redrive X`: `topics` and the dashboard show the dead letters under
/// `X.dlq`, while the API names the topic they go back to.
fn redrive(api: &Api, topic: &str, ids: Vec<String>) -> Result<Answer, Failure> {
    let topic = match topic.strip_suffix(".dlq").filter(|t| !t.is_empty()) {
        Some(origin) => {
            note(&format!("{topic} holds the dead letters of {origin}: moving them back to {origin}"));
            origin
        }
        None => topic,
    };
    let body = if ids.is_empty() { json!({}) } else { json!({ "ids": ids }) };
    api.post(&["v1", "topics", topic, "redrive"], &body)
}

/// Purges only with `--yes`, and only a topic that exists: the API answers a purge of a mistyped
/// name with `cancelled 0`, which reads like success.
fn purge(api: &Api, topic: &str, yes: bool) -> Result<Answer, Failure> {
    if !yes {
        return Err(Failure::Input(format!(
            "purge cancels every delayed, ready and reserved message of {topic}; add --yes to do it"
        )));
    }
    if topic_info(api, topic)?.is_none() {
        return Err(Failure::Other(format!(
            "no topic {topic:?} (`delayd-cli topics` lists them); nothing purged"
        )));
    }
    // The API takes no fields; `{}` is sent so a handler that reads a JSON body accepts it too.
    api.post(&["v1", "topics", topic, "purge"], &json!({}))
}

fn produce(api: &Api, p: Produce) -> Result<Answer, Failure> {
    let body = if p.body == "-" { read_stdin()? } else { p.body };
    let mut req = json!({ "body": body });
    if let Some(id) = p.id {
        req["id"] = json!(id);
    }
    if let Some(d) = p.delay {
        req["delay_ms"] = json!(d);
    }
    if let Some(at) = p.at {
        req["deliver_at_ms"] = json!(at);
    }
    if let Some(level) = p.level {
        // The API takes the level as a 1-based index (a number) or a duration string.
        req["level"] = match parse_u64(&level) {
            Ok(n) => json!(n),
            Err(_) => json!(level),
        };
    }
    if let Some(t) = p.ttr {
        req["ttr_ms"] = json!(t);
    }
    if let Some(n) = p.max_attempts {
        req["max_attempts"] = json!(n);
    }
    if let Some(Backoff(steps)) = p.backoff {
        req["backoff"] = json!(steps);
    }
    api.post(&["v1", "topics", &p.topic, "messages"], &req)
}

/// The whole of stdin, unchanged: a trailing newline is part of the body.
fn read_stdin() -> Result<String, Failure> {
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .map_err(|e| Failure::Input(format!("cannot read stdin: {e}")))?;
    // The API carries bodies as JSON strings, so they must be UTF-8.
    String::from_utf8(bytes).map_err(|_| Failure::Input("the body on stdin is not UTF-8".into()))
}

// ---- readable output ----

/// A JSON scalar as a table cell: strings without quotes, absent or null as `-`.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => printable(s),
        other => other.to_string(),
    }
}

/// Unix ms as an RFC 3339 UTC time, so a person need not convert; anything else as is.
fn time(v: &Value) -> String {
    match v.as_u64() {
        Some(ms) => humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string(),
        None => text(v),
    }
}

/// Control characters escaped, so a body with newlines or tabs keeps the table on its rows.
fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.to_string() }).collect()
}

/// Columns padded to their widest cell, two spaces apart; the last column is not padded.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i < last {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(cell.chars().count()) + 2;
                line.push_str(&" ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn items<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[])
}

fn show_produced(a: &Answer) -> String {
    let v = &a.value;
    let mut out = table(&["ID", "DELIVER_AT"], &[vec![text(&v["id"]), time(&v["deliver_at_ms"])]]);
    // 200 instead of 201: the same request was made before; the answer is the original one.
    if a.status == StatusCode::OK {
        out.push_str("(already produced by an identical earlier request)\n");
    }
    out
}

fn show_popped(a: &Answer) -> String {
    let msgs = items(&a.value, "messages");
    if msgs.is_empty() {
        return "no messages\n".into();
    }
    let rows: Vec<Vec<String>> = msgs
        .iter()
        .map(|m| vec![text(&m["id"]), text(&m["attempt"]), text(&m["receipt"]), text(&m["body"])])
        .collect();
    table(&["ID", "ATTEMPT", "RECEIPT", "BODY"], &rows)
}

fn show_nacked(a: &Answer) -> String {
    let v = &a.value;
    match v["state"].as_str() {
        Some("dead") => format!("dead-lettered to {}\n", text(&v["topic"])),
        _ => format!("retry at {}\n", time(&v["deliver_at_ms"])),
    }
}

fn show_message(a: &Answer) -> String {
    let v = &a.value;
    let mut rows = vec![
        vec!["id".into(), text(&v["id"])],
        vec!["topic".into(), text(&v["topic"])],
        vec!["state".into(), text(&v["state"])],
        vec!["deliver_at".into(), time(&v["deliver_at_ms"])],
        vec!["attempt".into(), text(&v["attempt"])],
    ];
    if let Some(dlq) = v.get("dead_letter_topic") {
        rows.push(vec!["dead_letter_topic".into(), text(dlq)]);
    }
    if let Some(e) = v.get("last_error") {
        rows.push(vec!["last_error".into(), text(&e["message"])]);
        rows.push(vec![
            "last_error_at".into(),
            format!("{} (attempt {})", time(&e["time_ms"]), text(&e["attempt"])),
        ]);
    }
    rows.push(vec!["body".into(), text(&v["body"])]);
    // A key/value listing: a header row would only say "FIELD VALUE".
    let t = table(&["", ""], &rows);
    t.split_once('\n').map(|(_, rest)| rest.to_string()).unwrap_or(t)
}

fn show_stats(a: &Answer) -> String {
    let v = &a.value;
    let levels: Vec<Vec<String>> = items(v, "levels")
        .iter()
        .map(|l| {
            let level = l["level_ms"]
                .as_u64()
                .map(delayd::config::units::fmt_ms)
                .unwrap_or_else(|| text(&l["level_ms"]));
            vec![level, text(&l["backlog"]), time(&l["next_due_ms"])]
        })
        .collect();
    let topics: Vec<Vec<String>> = items(v, "topics")
        .iter()
        .map(|t| {
            let cells = ["topic", "ready", "reserved", "delayed", "dead_lettered"];
            cells.iter().map(|k| text(&t[*k])).collect()
        })
        .collect();
    let mut out = table(&["LEVEL", "BACKLOG", "NEXT_DUE"], &levels);
    out.push('\n');
    if topics.is_empty() {
        out.push_str("no topics\n");
    } else {
        out.push_str(&table(&["TOPIC", "READY", "RESERVED", "DELAYED", "DEAD_LETTERED"], &topics));
    }
    out.push('\n');
    let store = match v["store_writable"].as_bool() {
        Some(false) => format!("NOT writable: {}", text(&v["store_error"])),
        Some(true) => "writable".into(),
        None => "-".into(),
    };
    let counters = [
        vec!["disk_bytes".into(), text(&v["disk_bytes"])],
        vec!["log_bytes".into(), text(&v["log_bytes"])],
        vec!["live_bytes".into(), text(&v["live_bytes"])],
        vec!["open_queues".into(), text(&v["open_queues"])],
        vec!["store".into(), store],
    ];
    let t = table(&["", ""], &counters);
    out.push_str(t.split_once('\n').map(|(_, rest)| rest).unwrap_or(&t));
    out
}

fn show_topics(a: &Answer) -> String {
    let topics = items(&a.value, "topics");
    if topics.is_empty() {
        return "no topics\n".into();
    }
    let rows: Vec<Vec<String>> = topics
        .iter()
        .map(|t| {
            vec![
                text(&t["topic"]),
                text(&t["ready"]),
                text(&t["reserved"]),
                text(&t["delayed"]),
                text(&t["dead_lettered"]),
                text(&t["paused"]),
            ]
        })
        .collect();
    table(&["TOPIC", "READY", "RESERVED", "DELAYED", "DEAD_LETTERED", "PAUSED"], &rows)
}

fn show_browse(a: &Answer) -> String {
    let msgs = items(&a.value, "messages");
    let mut out = if msgs.is_empty() {
        "no messages\n".to_string()
    } else {
        let rows: Vec<Vec<String>> = msgs
            .iter()
            .map(|m| {
                vec![
                    text(&m["id"]),
                    text(&m["state"]),
                    time(&m["deliver_at_ms"]),
                    text(&m["attempt"]),
                    text(&m["body"]),
                ]
            })
            .collect();
        table(&["ID", "STATE", "DELIVER_AT", "ATTEMPT", "BODY"], &rows)
    };
    if let Some(c) = a.value.get("next_cursor").and_then(Value::as_str) {
        out.push_str(&format!("more: --cursor {c}\n"));
    }
    out
}

/// Per-node fields `/v1/cluster` may carry (the leader's view of replication), with their column.
const CLUSTER_EXTRAS: [(&str, &str); 3] =
    [("match_index", "MATCH_INDEX"), ("lag_entries", "LAG_ENTRIES"), ("last_contact_ms", "LAST_CONTACT_MS")];

fn show_cluster(a: &Answer) -> String {
    let v = &a.value;
    let me = &v["node_id"];
    let leader = &v["leader_id"];
    // raft numbers nodes from 1: a leader id of 0 is raft's "none".
    let mut out = if leader.is_null() || leader.as_u64() == Some(0) {
        "leader: none".to_string()
    } else {
        format!("leader: {} {}", text(leader), text(&v["leader_url"]))
    };
    out.push_str(&format!("  term: {}\n", text(&v["term"])));
    let nodes = items(v, "nodes");
    // An extra column only when some node has the field: a single node has no replication view.
    let extras: Vec<(&str, &str)> = CLUSTER_EXTRAS
        .into_iter()
        .filter(|(k, _)| nodes.iter().any(|n| n.get(*k).is_some_and(|x| !x.is_null())))
        .collect();
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let id = &n["node_id"];
            // Each node's role as the answering node knows it: its own, the leader's, or what the
            // node object says; otherwise unknown rather than a guess (a learner is no follower).
            let mut role = match n.get("role").filter(|r| !r.is_null()) {
                Some(r) => text(r),
                None if id == me => text(&v["role"]),
                None if id == leader => "leader".into(),
                None => "-".into(),
            };
            if id == me {
                role.push('*');
            }
            let mut row = vec![text(id), role, text(&n["api_url"]), text(&n["cluster_addr"])];
            row.extend(extras.iter().map(|(k, _)| text(&n[*k])));
            row
        })
        .collect();
    let mut headers = vec!["NODE", "ROLE", "API_URL", "CLUSTER_ADDR"];
    headers.extend(extras.iter().map(|(_, h)| *h));
    out.push_str(&table(&headers, &rows));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(v: Value) -> Answer {
        Answer { status: StatusCode::OK, text: v.to_string(), value: v }
    }

    #[test]
    fn tables_align_on_the_widest_cell() {
        let t = table(&["A", "BEE"], &[vec!["long".into(), "x".into()], vec!["é".into(), "".into()]]);
        assert_eq!(t, "A     BEE\nlong  x\né\n");
    }

    #[test]
    fn at_takes_unix_ms_or_rfc3339() {
        assert_eq!(unix_ms("1795407831175"), Ok(1_795_407_831_175));
        assert_eq!(unix_ms("2026-12-01T09:00:00Z"), Ok(1_796_115_600_000));
        assert_eq!(unix_ms("2026-12-01 09:00:00"), Ok(1_796_115_600_000));
        assert!(unix_ms("1969-12-31T23:59:59Z").is_err());
        assert!(unix_ms("tomorrow").is_err());
        assert!(unix_ms("").is_err());
    }

    #[test]
    fn at_takes_rfc3339_offsets_and_fractions() {
        let nine_utc = 1_796_115_600_000;
        assert_eq!(unix_ms("2026-12-01T11:00:00+02:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T04:30:00-04:30"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T09:00:00+00:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T09:00:00-00:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01t09:00:00z"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T11:00:00.250+02:00"), Ok(nine_utc + 250));
        assert_eq!(unix_ms("2026-12-01T09:00:00.5Z"), Ok(nine_utc + 500));
        assert_eq!(unix_ms("1970-01-01T01:00:00+01:00"), Ok(0));
        assert!(unix_ms("1970-01-01T00:59:59+01:00").is_err());
        for bad in ["2026-12-01T09:00:00+24:00", "2026-12-01T09:00:00+02:60", "2026-12-01T09:00:00+2:000"] {
            assert!(unix_ms(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_delay_needs_a_unit() {
        assert_eq!(parse_delay("5s"), Ok(5000));
        assert_eq!(parse_delay("500ms"), Ok(500));
        assert_eq!(parse_delay("1h30m"), Ok(5_400_000));
        assert_eq!(parse_delay("0"), Ok(0));
        for bare in ["5", "1_000", " 30 "] {
            let e = parse_delay(bare).unwrap_err();
            assert!(e.contains("no unit") && e.contains("s for seconds"), "{bare}: {e}");
        }
        assert!(parse_delay("soon").is_err());
    }

    // The table shapes of the API answers.
    #[test]
    fn topics_and_browse_tables() {
        let v = json!({"topics": [
            {"topic": "orders", "ready": 3, "reserved": 1, "delayed": 10, "dead_lettered": 2, "paused": false},
            {"topic": "mail", "ready": 0, "reserved": 0, "delayed": 0, "dead_lettered": 5, "paused": true},
        ]});
        assert_eq!(
            show_topics(&answer(v)),
            "TOPIC   READY  RESERVED  DELAYED  DEAD_LETTERED  PAUSED\n\
             orders  3      1         10       2              false\n\
             mail    0      0         0        5              true\n"
        );
        let v = json!({"messages": [
            {"id": "a", "state": "dead", "deliver_at_ms": 0, "attempt": 3, "body": "x\ny"},
        ], "next_cursor": "c1"});
        assert_eq!(
            show_browse(&answer(v)),
            "ID  STATE  DELIVER_AT                ATTEMPT  BODY\n\
             a   dead   1970-01-01T00:00:00.000Z  3        x\\ny\n\
             more: --cursor c1\n"
        );
        assert_eq!(show_browse(&answer(json!({"messages": [], "next_cursor": null}))), "no messages\n");
    }
}
