//! The socket under hyper: it tells the connection's watcher where the connection is in its
//! request cycle, and turns hyper's own error answers into the JSON error shape.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::error::ApiError;

/// Where a connection is in its request cycle; each phase but serving has a deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for the first byte of a request: on a new connection (`kept_alive` false, the
    /// header timeout applies) or after an answer (`kept_alive` true, the idle timeout applies).
    Waiting { since: Instant, kept_alive: bool },
    /// Part of a request head has arrived.
    Head { since: Instant },
    /// A request is with the router. Once it answered (`answered`), the client has the idle
    /// timeout to take the answer; the phase ends when hyper has let go of the answer's body
    /// (`body_done`) and flushed the socket.
    Serving { answered: Option<Instant>, body_done: bool },
}

impl Phase {
    /// The phase of a connection just accepted.
    pub(crate) fn accepted() -> Phase {
        Phase::Waiting { since: Instant::now(), kept_alive: false }
    }

    /// When the connection is to be closed if the phase has not changed by then. `brief`, when
    /// the server is short of connection slots, shortens the wait for a request to begin.
    pub(crate) fn deadline(
        &self,
        header: Duration,
        idle: Duration,
        brief: Option<Duration>,
    ) -> Option<Instant> {
        let waiting = |timeout: Duration| brief.map_or(timeout, |b| b.min(timeout));
        match *self {
            Phase::Waiting { since, kept_alive: false } => Some(since + waiting(header)),
            Phase::Head { since } => Some(since + header),
            Phase::Waiting { since, kept_alive: true } => Some(since + waiting(idle)),
            Phase::Serving { answered, .. } => answered.map(|at| at + idle),
        }
    }

    /// Since when the connection has waited for a request to begin, if it is waiting.
    pub(crate) fn idle_since(&self) -> Option<Instant> {
        match *self {
            Phase::Waiting { since, .. } => Some(since),
            _ => None,
        }
    }

    /// When the connection's watcher should look at the phase next: its deadline, but no later
    /// than `now` plus the shorter timeout. A phase that begins later has a deadline at least that
    /// far from its start, so looking this often misses no deadline, while a phase change itself
    /// never has to wake the watcher (see [`PhaseCell`]).
    pub(crate) fn next_check(
        &self,
        now: Instant,
        header: Duration,
        idle: Duration,
        brief: Option<Duration>,
    ) -> Instant {
        // Configuration keeps both timeouts at 1 ms or more; the floor only keeps a zero from
        // ever turning the watcher into a busy loop.
        let shortest = brief.map_or(header.min(idle), |b| b.min(header).min(idle));
        let soonest = now + shortest.max(Duration::from_millis(1));
        self.deadline(header, idle, brief).map_or(soonest, |d| d.min(soonest))
    }

    fn is_serving(&self) -> bool {
        matches!(self, Phase::Serving { .. })
    }

    /// Bytes arrived: the first ones start a request head.
    fn on_bytes(&mut self) -> bool {
        match self {
            Phase::Waiting { .. } => {
                *self = Phase::Head { since: Instant::now() };
                true
            }
            _ => false,
        }
    }

    /// The router answered.
    pub(crate) fn on_answer(&mut self) {
        if let Phase::Serving { answered, .. } = self {
            *answered = Some(Instant::now());
        }
    }

    /// hyper dropped the answer's body: all of it is in hyper's write buffer, or was never to be
    /// sent (an answer to `HEAD`).
    pub(crate) fn on_body_done(&mut self) -> bool {
        match self {
            Phase::Serving { body_done, .. } if !*body_done => {
                *body_done = true;
                true
            }
            _ => false,
        }
    }

    /// The socket was flushed; after a whole answer, the connection waits for the next request.
    fn on_flushed(&mut self) -> bool {
        match self {
            Phase::Serving { answered: Some(_), body_done: true } => {
                *self = Phase::Waiting { since: Instant::now(), kept_alive: true };
                true
            }
            _ => false,
        }
    }
}

/// A connection's [`Phase`], shared by its socket, its service and its watcher.
///
/// A change costs one uncontended lock and wakes nobody: a request moves through five phases, and
/// waking the watcher at each (a task poll and a new timer every time) cost more than the rest of
/// the connection's bookkeeping. The watcher reads the phase when its timer fires instead, and
/// [`Phase::next_check`] keeps that timer early enough to close on time.
pub(crate) struct PhaseCell(Mutex<Phase>);

impl PhaseCell {
    /// A cell holding `phase`.
    pub(crate) fn new(phase: Phase) -> PhaseCell {
        PhaseCell(Mutex::new(phase))
    }

    /// The phase now.
    pub(crate) fn get(&self) -> Phase {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the phase.
    pub(crate) fn set(&self, phase: Phase) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = phase;
    }

    /// Applies one of `Phase`'s transitions.
    pub(crate) fn apply<R>(&self, transition: impl FnOnce(&mut Phase) -> R) -> R {
        transition(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A TCP stream that reports read and flush progress to the connection's [`Phase`] and replaces
/// the bodiless error answers hyper writes for requests it cannot parse.
pub(crate) struct ConnIo {
    stream: TcpStream,
    phase: Arc<PhaseCell>,
    /// The JSON answer written instead of hyper's own, and how much of it is out.
    replacement: Option<(Vec<u8>, usize)>,
}

impl ConnIo {
    /// Wraps an accepted stream.
    pub(crate) fn new(stream: TcpStream, phase: Arc<PhaseCell>) -> ConnIo {
        ConnIo { stream, phase, replacement: None }
    }

    /// Writes the rest of the replacement answer, if there is one.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some((bytes, written)) = &mut self.replacement {
            while *written < bytes.len() {
                let n = ready!(Pin::new(&mut self.stream).poll_write(cx, &bytes[*written..]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                *written += n;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.phase.apply(Phase::on_bytes);
        }
        polled
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // hyper writes outside of serving a request only to refuse one it could not parse, and
        // closes the connection after that answer: what it writes then is replaced whole.
        if this.replacement.is_none() && !this.phase.get().is_serving() {
            if let Some(answer) = parser_error_answer(buf) {
                this.replacement = Some((answer, 0));
            }
        }
        if this.replacement.is_some() {
            ready!(this.poll_replacement(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.replacement.is_some() || !self.phase.get().is_serving() {
            // One slice at a time, so the check above sees where an answer starts.
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &**b);
            return self.poll_write(cx, first);
        }
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        ready!(Pin::new(&mut this.stream).poll_flush(cx))?;
        this.phase.apply(Phase::on_flushed);
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}

/// Whether bytes wait unread on the socket `fd`: a connection that looks idle from its phase may
/// have a request in the kernel's buffer that hyper has not read yet (a new connection whose task
/// has not run, or a request that just arrived); closing it then would reset it under the client.
pub(crate) fn has_unread_bytes(fd: std::os::fd::RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: recv writes at most 1 byte into `byte`, which lives across the call; MSG_PEEK leaves
    // the byte in the socket and MSG_DONTWAIT keeps the call from blocking. `fd` is the caller's
    // open socket for the duration of the call.
    #[allow(unsafe_code)]
    let n = unsafe { libc::recv(fd, (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    n > 0
}

/// The JSON answer for hyper's own error answer starting `buf` (`HTTP/1.x 4xx ...`), if it is one.
fn parser_error_answer(buf: &[u8]) -> Option<Vec<u8>> {
    let version = buf.get(..8).filter(|v| v.starts_with(b"HTTP/1."))?;
    let code = std::str::from_utf8(buf.get(9..12)?).ok()?.parse::<u16>().ok()?;
    let status = StatusCode::from_u16(code).ok().filter(|s| s.is_client_error() || s.is_server_error())?;
    let (code, message) = match status {
        StatusCode::URI_TOO_LONG => ("uri_too_long", "the request target is longer than this server reads"),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => {
            ("headers_too_large", "the request head is larger than this server reads, or has too many fields")
        }
        _ => (
            "bad_request",
            "the request is not valid HTTP/1.1 (its request line, a header, or a repeated or \
             malformed Content-Length or Transfer-Encoding)",
        ),
    };
    let body = ApiError::new(status, code, message).body().to_string();
    let mut out = Vec::with_capacity(160 + body.len());
    out.extend_from_slice(version);
    out.extend_from_slice(
        format!(
            " {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            status.as_str(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_error_answers_become_json() {
        let out =
            parser_error_answer(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n")
                .expect("an error answer");
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{head}");
        assert!(head.contains("content-type: application/json") && head.contains("connection: close"));
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "headers_too_large");
        let out = parser_error_answer(b"HTTP/1.0 400 Bad Request\r\n\r\n").unwrap();
        assert!(out.starts_with(b"HTTP/1.0 400 Bad Request\r\n"));
        assert!(parser_error_answer(b"HTTP/1.1 200 OK\r\n\r\n").is_none());
        assert!(parser_error_answer(b"HTTP/1.1 100 Continue\r\n\r\n").is_none());
        assert!(parser_error_answer(b"{\"messages\":[]}").is_none());
        assert!(parser_error_answer(b"HTTP/1.1 4").is_none());
    }

    #[test]
    fn deadlines_follow_the_phase() {
        let (h, i) = (Duration::from_secs(10), Duration::from_secs(60));
        let mut p = Phase::accepted();
        let Phase::Waiting { since, .. } = p else { panic!("{p:?}") };
        assert_eq!(p.deadline(h, i, None), Some(since + h), "a new connection gets the header timeout");
        assert!(p.on_bytes());
        assert!(!p.on_bytes(), "only the first bytes start a head");
        let Phase::Head { since } = p else { panic!("{p:?}") };
        assert_eq!(p.deadline(h, i, None), Some(since + h));
        p = Phase::Serving { answered: None, body_done: false };
        assert_eq!(p.deadline(h, i, None), None, "no deadline while the router works");
        assert!(!p.on_flushed(), "a flush before the answer changes nothing");
        p.on_answer();
        assert!(!p.on_bytes(), "request body bytes do not start a head");
        let Phase::Serving { answered: Some(at), .. } = p else { panic!("{p:?}") };
        assert_eq!(p.deadline(h, i, None), Some(at + i));
        assert!(!p.on_flushed(), "hyper still holds the answer body");
        assert!(p.on_body_done());
        assert!(p.on_flushed());
        let Phase::Waiting { since, kept_alive: true } = p else { panic!("{p:?}") };
        assert_eq!(p.deadline(h, i, None), Some(since + i), "a kept-alive connection gets the idle timeout");
    }

    #[test]
    fn the_watcher_looks_before_any_deadline_a_later_phase_can_have() {
        let (h, i) = (Duration::from_secs(10), Duration::from_secs(60));
        let now = Instant::now();
        // Kept alive: its own deadline is 60 s away, but a head may start at once and is due in 10.
        let idle = Phase::Waiting { since: now, kept_alive: true };
        assert_eq!(idle.next_check(now, h, i, None), now + h);
        // A head that started 4 s ago is due in 6, sooner than any later phase could be.
        let head = Phase::Head { since: now - Duration::from_secs(4) };
        assert_eq!(head.next_check(now, h, i, None), now + Duration::from_secs(6));
        // Serving has no deadline of its own; the answer's starts the idle timeout later.
        let serving = Phase::Serving { answered: None, body_done: false };
        assert_eq!(serving.next_check(now, h, i, None), now + h);
        // With the idle timeout the shorter one, that is the bound.
        assert_eq!(serving.next_check(now, i, h, None), now + h);
        // Never a zero wait, which would spin the watcher while a request is served.
        assert_eq!(
            serving.next_check(now, Duration::ZERO, Duration::ZERO, None),
            now + Duration::from_millis(1)
        );
        // Whatever phase follows a check, its deadline is no sooner than the next check.
        for p in [idle, head, serving] {
            let check = p.next_check(now, h, i, None);
            for later in [
                Phase::Waiting { since: now, kept_alive: false },
                Phase::Waiting { since: now, kept_alive: true },
                Phase::Head { since: now },
                Phase::Serving { answered: Some(now), body_done: true },
            ] {
                assert!(later.deadline(h, i, None).is_some_and(|d| d >= check), "{p:?} then {later:?}");
            }
        }
    }
}
