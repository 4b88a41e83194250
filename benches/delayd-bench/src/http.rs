//! A lean HTTP/1.1 client for the delayd side of the benchmark: kept-alive connections (one per
//! call in flight), one `write` per request, the answer read straight off the socket.
//!
//! Why not reqwest: the benchmark measures servers, and its clients share one CPU. redis-rs sends a
//! command as a few bytes on an open connection; reqwest spends several times that per call
//! (URL parsing, a header map, a body stream, a timer), so the delayd cases measured the
//! client as much as the server. This client does for HTTP what redis-rs does for RESP, and no
//! less: it checks the status line, reads `Content-Length` or chunked bodies, honours
//! `Connection: close`, and times out like the Redis connections do.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long one call may take; the Redis connections use the same response timeout.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest answer head accepted; delayd's are a few hundred bytes.
const MAX_HEAD: usize = 64 << 10;
/// Pause before a following client tries the nodes again when none of them took the call (an
/// election): short, so the time to the first answer of a new leader is measured to about this.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// An answer: status and body.
#[derive(Debug)]
pub struct Answer {
    /// HTTP status code.
    pub status: u16,
    /// The whole body.
    pub body: Vec<u8>,
    /// The `Location` header, when there is one.
    pub location: Option<String>,
    /// The port of the server that gave this answer.
    pub port: u16,
}

impl Answer {
    /// The body as text for an error message, cut to 300 characters.
    pub fn error(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        format!("HTTP {}: {}", self.status, text.chars().take(300).collect::<String>())
    }
}

/// A client of a server on loopback: kept-alive connections, one per call in flight. Clones share
/// the idle connections, so a consumer that acks its deliveries concurrently from clones reuses
/// as many connections as it has calls in flight (what reqwest's pool did), not one per call.
///
/// A client made with [`HttpConn::following`] talks to a delayd cluster: it sends to the node it
/// last found leading, follows a `307` to the leader, and while no node takes the call (the
/// leader is dead, an election runs: connection refused, `503 no_leader`) tries the nodes in turn
/// until one does or the call's time is up. It never resends a request that reached a server and
/// got no answer: that outcome is unknown, and the caller hears of it as an error.
#[derive(Clone)]
pub struct HttpConn {
    route: Arc<Route>,
    idle: Arc<Mutex<Vec<Conn>>>,
    timeout: Duration,
}

/// Where calls go: one server, or every node of a cluster and the one that leads as last seen.
struct Route {
    ports: Vec<u16>,
    current: AtomicU16,
}

/// One open connection and what was read off it but not yet used.
struct Conn {
    port: u16,
    stream: TcpStream,
    inbuf: Vec<u8>,
}

/// Why one attempt got no answer.
enum Failure {
    /// Nothing reached a server (no connection): safe to send elsewhere.
    NotSent(String),
    /// The request may have been acted on.
    Unknown(String),
}

impl HttpConn {
    /// A client for `127.0.0.1:port`; it connects on its first call.
    pub fn new(port: u16) -> HttpConn {
        HttpConn::following(&[port], port, CALL_TIMEOUT)
    }

    /// A client of the cluster whose nodes listen on `ports`, starting with `first`; each call
    /// (redirects and retries included) gives up after `timeout`.
    pub fn following(ports: &[u16], first: u16, timeout: Duration) -> HttpConn {
        let mut ports = ports.to_vec();
        if !ports.contains(&first) {
            ports.push(first);
        }
        HttpConn {
            route: Arc::new(Route { ports, current: AtomicU16::new(first) }),
            idle: Arc::default(),
            timeout,
        }
    }

    /// The port calls go to now.
    pub fn current_port(&self) -> u16 {
        self.route.current.load(Ordering::Relaxed)
    }

    fn follows(&self) -> bool {
        self.route.ports.len() > 1
    }

    /// Sends calls to `port` from now on, dropping kept connections to other nodes.
    fn switch_to(&self, port: u16) {
        self.route.current.store(port, Ordering::Relaxed);
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).retain(|c| c.port == port);
    }

    /// The node after `port` in the list.
    fn next_after(&self, port: u16) -> u16 {
        let ports = &self.route.ports;
        let i = ports.iter().position(|p| *p == port).unwrap_or(0);
        ports[(i + 1) % ports.len()]
    }

    /// Sends `method path` with an optional JSON body and reads the whole answer.
    pub async fn call(&mut self, method: &str, path: &str, json: Option<&[u8]>) -> Result<Answer, String> {
        let request = encode(method, path, json);
        let deadline = Instant::now() + self.timeout;
        let mut misses = 0usize;
        loop {
            let port = self.current_port();
            let outcome = self.attempt(port, &request, deadline).await;
            let next = match outcome {
                Ok(a) if self.follows() && a.status == 307 => {
                    match a.location.as_deref().and_then(port_of).filter(|p| self.route.ports.contains(p)) {
                        Some(p) if p != port => p,
                        _ => self.next_after(port),
                    }
                }
                Ok(a)
                    if self.follows() && a.status == 503 && a.body.windows(9).any(|w| w == b"no_leader") =>
                {
                    self.next_after(port)
                }
                Ok(a) => return Ok(a),
                Err(Failure::NotSent(e)) if !self.follows() => return Err(e),
                Err(Failure::NotSent(_)) => self.next_after(port),
                Err(Failure::Unknown(e)) => {
                    if self.follows() {
                        // The node may be dead: its kept connections are too.
                        self.switch_to(self.next_after(port));
                    }
                    return Err(e);
                }
            };
            self.switch_to(next);
            misses += 1;
            if misses.is_multiple_of(self.route.ports.len()) {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            if Instant::now() >= deadline {
                return Err(format!("{method} {path}: no node took the call within {:?}", self.timeout));
            }
        }
    }

    /// One try on one node.
    async fn attempt(&self, port: u16, request: &[u8], deadline: Instant) -> Result<Answer, Failure> {
        let left = deadline.saturating_duration_since(Instant::now());
        let kept = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            idle.iter().rposition(|c| c.port == port).map(|i| idle.swap_remove(i))
        };
        let mut conn = match kept {
            Some(c) => c,
            None => {
                let connect = TcpStream::connect(("127.0.0.1", port));
                let stream = match tokio::time::timeout(left, connect).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => return Err(Failure::NotSent(format!("connect: {e}"))),
                    Err(_) => return Err(Failure::NotSent(format!("connect: no answer within {left:?}"))),
                };
                stream.set_nodelay(true).map_err(|e| Failure::NotSent(format!("nodelay: {e}")))?;
                Conn { port, stream, inbuf: Vec::with_capacity(4096) }
            }
        };
        // On an error or a timeout the connection is dropped: its state is unknown.
        match tokio::time::timeout(left, conn.exchange(request)).await {
            Ok(Ok((answer, close))) => {
                if !close {
                    self.idle.lock().unwrap_or_else(PoisonError::into_inner).push(conn);
                }
                Ok(answer)
            }
            Ok(Err(e)) => Err(Failure::Unknown(e)),
            Err(_) => Err(Failure::Unknown(format!("no answer within {:?}", self.timeout))),
        }
    }

    /// Idle connections kept for the next calls (tests).
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// The port of a loopback URL such as `http://127.0.0.1:9277/v1/x`.
fn port_of(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    authority.rsplit_once(':')?.1.parse().ok()
}

/// A request's bytes: head and body, sent with one write.
fn encode(method: &str, path: &str, json: Option<&[u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + path.len() + json.map_or(0, <[u8]>::len));
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    match json {
        Some(body) => {
            out.extend_from_slice(b"Content-Type: application/json\r\nContent-Length: ");
            out.extend_from_slice(body.len().to_string().as_bytes());
            out.extend_from_slice(b"\r\n\r\n");
            out.extend_from_slice(body);
        }
        None => out.extend_from_slice(b"Content-Length: 0\r\n\r\n"),
    }
    out
}

impl Conn {
    /// Sends one request and reads its answer; true with it when the server closes afterwards.
    async fn exchange(&mut self, request: &[u8]) -> Result<(Answer, bool), String> {
        let (stream, inbuf) = (&mut self.stream, &mut self.inbuf);
        stream.write_all(request).await.map_err(|e| format!("send: {e}"))?;
        let (status, close, framing, location, head_len) = read_head(stream, inbuf).await?;
        inbuf.drain(..head_len);
        let body = match framing {
            Framing::Length(n) => {
                fill(stream, inbuf, n).await?;
                inbuf.drain(..n).collect()
            }
            Framing::Chunked => read_chunked(stream, inbuf).await?,
        };
        Ok((Answer { status, body, location, port: self.port }, close))
    }
}

enum Framing {
    Length(usize),
    Chunked,
}

/// What an answer's head says: status, whether the server closes the connection after it, how
/// its body is framed, its `Location`, and the head's length.
type Head = (u16, bool, Framing, Option<String>, usize);

/// Reads until a whole answer head is buffered and parses it.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Head, String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head =
                std::str::from_utf8(&buf[..end]).map_err(|_| "answer head is not UTF-8".to_string())?;
            let mut lines = head.split("\r\n");
            let status_line = lines.next().unwrap_or_default();
            let status = status_line
                .strip_prefix("HTTP/1.1 ")
                .and_then(|r| r.get(..3))
                .and_then(|c| c.parse::<u16>().ok())
                .ok_or_else(|| format!("bad status line {status_line:?}"))?;
            let (mut close, mut framing, mut location) = (false, None, None);
            for line in lines {
                let Some((name, value)) = line.split_once(':') else { continue };
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    framing =
                        Some(Framing::Length(value.parse().map_err(|_| format!("bad length {value:?}"))?));
                } else if name.eq_ignore_ascii_case("transfer-encoding")
                    && value.eq_ignore_ascii_case("chunked")
                {
                    framing = Some(Framing::Chunked);
                } else if name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close") {
                    close = true;
                } else if name.eq_ignore_ascii_case("location") {
                    location = Some(value.to_string());
                }
            }
            // Without either header an HTTP/1.1 answer runs to the close; delayd never sends one.
            let framing = framing.ok_or_else(|| format!("answer {status} has no length"))?;
            return Ok((status, close, framing, location, end + 4));
        }
        if buf.len() > MAX_HEAD {
            return Err("answer head too long".to_string());
        }
        read_more(s, buf).await?;
    }
}

/// Reads until `buf` holds at least `n` bytes.
async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> Result<(), String> {
    while buf.len() < n {
        read_more(s, buf).await?;
    }
    Ok(())
}

async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<(), String> {
    buf.reserve(4096);
    match s.read_buf(buf).await {
        Ok(0) => Err("the server closed the connection".to_string()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("receive: {e}")),
    }
}

/// Reads until `buf` holds a whole line; returns where its CRLF starts.
async fn line_end(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<usize, String> {
    loop {
        if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
            return Ok(i);
        }
        read_more(s, buf).await?;
    }
}

/// Reads a chunked body (no trailers are expected, but they are skipped).
async fn read_chunked(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let end = line_end(s, buf).await?;
        let line = std::str::from_utf8(&buf[..end]).map_err(|_| "bad chunk size".to_string())?;
        let hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(hex, 16).map_err(|_| format!("bad chunk size {hex:?}"))?;
        buf.drain(..end + 2);
        if size == 0 {
            // Trailers, up to the empty line.
            loop {
                let end = line_end(s, buf).await?;
                buf.drain(..end + 2);
                if end == 0 {
                    return Ok(body);
                }
            }
        }
        fill(s, buf, size + 2).await?;
        body.extend_from_slice(&buf[..size]);
        buf.drain(..size + 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A server that answers each request read with the next canned answer, then closes.
    async fn canned(answers: Vec<&'static [u8]>) -> (u16, tokio::task::JoinHandle<Vec<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut seen = Vec::new();
            for a in answers {
                let mut req = vec![0u8; 4096];
                let n = s.read(&mut req).await.expect("read");
                seen.push(req[..n].to_vec());
                s.write_all(a).await.expect("write");
            }
            seen
        });
        (port, task)
    }

    #[tokio::test]
    async fn reads_length_and_chunked_answers_on_one_connection() {
        let (port, server) = canned(vec![
            b"HTTP/1.1 201 Created\r\ncontent-length: 7\r\n\r\n{\"a\":1}",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno",
        ])
        .await;
        let mut c = HttpConn::new(port);
        let a = c.call("POST", "/v1/x", Some(b"{\"b\":2}")).await.expect("first");
        assert_eq!((a.status, a.body.as_slice()), (201, &b"{\"a\":1}"[..]));
        assert_eq!(c.idle_count(), 1, "kept for the next call");
        // A clone takes the same idle connection: the canned server accepts only one.
        let mut c = c.clone();
        let a = c.call("GET", "/v1/y", None).await.expect("second");
        assert_eq!((a.status, a.body.as_slice()), (200, &b"abcde"[..]));
        let a = c.call("GET", "/v1/z", None).await.expect("third");
        assert_eq!((a.status, a.body.as_slice()), (404, &b"no"[..]));
        assert_eq!(c.idle_count(), 0, "Connection: close drops the connection");
        let seen = server.await.expect("server");
        assert_eq!(
            seen[0],
            b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"b\":2}"
        );
        assert_eq!(seen[1], b"GET /v1/y HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n");
    }

    #[tokio::test]
    async fn a_following_client_skips_dead_and_leaderless_nodes_and_follows_redirects() {
        let dead =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let (a, server_a) = canned(vec![
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 30\r\n\r\n{\"error\":{\"code\":\"no_leader\"}}",
        ])
        .await;
        let (c, server_c) = canned(vec![b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"]).await;
        let location: &'static [u8] = Box::leak(
            format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{c}/v1/x\r\nContent-Length: 0\r\n\r\n")
                .into_bytes()
                .into_boxed_slice(),
        );
        let (b, server_b) = canned(vec![location]).await;
        // dead: refused; a: no leader; b: redirects to c; c answers.
        let mut client = HttpConn::following(&[dead, a, b, c], dead, Duration::from_secs(5));
        let answer = client.call("POST", "/v1/x", Some(b"{}")).await.expect("answered by c");
        assert_eq!((answer.status, answer.port, answer.body.as_slice()), (201, c, &b"ok"[..]));
        assert_eq!(client.current_port(), c, "the next call goes straight to the leader");
        for s in [server_a, server_b, server_c] {
            assert_eq!(s.await.expect("server").len(), 1, "each node saw the request once");
        }
        // A plain client hands a redirect to its caller.
        let (d, server_d) = canned(vec![location]).await;
        let answer = HttpConn::new(d).call("GET", "/v1/x", None).await.expect("answer");
        assert_eq!(answer.status, 307);
        assert_eq!(answer.location, Some(format!("http://127.0.0.1:{c}/v1/x")));
        server_d.await.expect("server");
        assert_eq!(port_of("http://127.0.0.1:9277/v1/x?y=1"), Some(9277));
        assert_eq!(port_of("http://127.0.0.1/v1/x"), None);
    }

    #[tokio::test]
    async fn a_cut_answer_is_an_error_and_drops_the_connection() {
        let (port, server) = canned(vec![b"HTTP/1.1 200 OK\r\nContent-Le"]).await;
        let mut c = HttpConn::new(port);
        let e = c.call("GET", "/", None).await.expect_err("cut answer");
        assert!(e.contains("closed"), "{e}");
        server.await.expect("server");
        assert_eq!(c.idle_count(), 0);
    }
}
