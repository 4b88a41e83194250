//! Request and answer bodies as the connection sees them: a request body under a deadline that
//! hands itself back when a handler drops it unread, and an answer body that reports when hyper is
//! done with it.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use super::io::{Phase, PhaseCell};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The rest of a body that an early answer waits to read, so the connection can be kept: enough
/// for any JSON request the API takes without a message body in it, read from memory in a moment.
const KEEP_ALIVE_DRAIN_BYTES: u64 = 64 << 10;
/// How long an early answer waits for that rest before it closes the connection instead.
const KEEP_ALIVE_DRAIN_WAIT: Duration = Duration::from_secs(1);

/// The request body did not arrive within `http_body_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive within http_body_timeout")
    }
}

impl std::error::Error for BodyTimedOut {}

/// What the connection learns about a request body from the handler's side.
#[derive(Default)]
pub(crate) struct Leftover {
    /// The body was read to its end: the connection is ready for the next request.
    finished: AtomicBool,
    /// The body was read from, so hyper has sent any `100 Continue` and the client may be sending.
    started: AtomicBool,
    /// The body, handed back when it was dropped before its end.
    unread: Mutex<Option<Incoming>>,
}

impl Leftover {
    /// After the answer: true if the connection can take another request. Otherwise the answer
    /// must say `Connection: close`, and what the client still sends is read and dropped until
    /// `deadline` (in a task of its own), so the close does not reset the connection before the
    /// client has read the answer.
    pub(crate) async fn settle(&self, expects_continue: bool, deadline: Instant) -> bool {
        if self.finished.load(Ordering::Acquire) {
            return true;
        }
        // Not handed back: something still holds the body, so nobody knows where the client is.
        let Some(mut body) = self.unread.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            return false;
        };
        if body.is_end_stream() {
            return true;
        }
        if expects_continue && !self.started.load(Ordering::Acquire) {
            // No `100 Continue` went out, so the client holds the body back; dropping it lets
            // hyper close without reading a body that may never come.
            return false;
        }
        let small = body.size_hint().exact().is_some_and(|n| n <= KEEP_ALIVE_DRAIN_BYTES);
        if small {
            let until = deadline.min(Instant::now() + KEEP_ALIVE_DRAIN_WAIT);
            if let Ok(Ok(())) = tokio::time::timeout_at(until, drain(&mut body)).await {
                return true;
            }
        }
        tokio::spawn(async move {
            let _ = tokio::time::timeout_at(deadline, drain(&mut body)).await;
        });
        false
    }
}

/// Reads a body to its end, dropping what it reads.
async fn drain(body: &mut Incoming) -> Result<(), hyper::Error> {
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
        frame?;
    }
    Ok(())
}

/// A request body as handlers see it: it fails with [`BodyTimedOut`] past its deadline, and,
/// dropped before its end, goes back to its [`Leftover`].
pub(crate) struct RequestBody {
    inner: Option<Incoming>,
    deadline: Instant,
    /// Made the first time the body has to wait, so a body already in memory costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
    leftover: Arc<Leftover>,
}

impl RequestBody {
    /// Wraps hyper's body, due by `deadline`.
    pub(crate) fn new(inner: Incoming, deadline: Instant) -> (RequestBody, Arc<Leftover>) {
        let leftover = Arc::new(Leftover::default());
        (RequestBody { inner: Some(inner), deadline, timer: None, leftover: leftover.clone() }, leftover)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else { return Poll::Ready(None) };
        this.leftover.started.store(true, Ordering::Release);
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.leftover.finished.store(true, Ordering::Release);
                Poll::Ready(None)
            }
            Poll::Ready(Some(frame)) => Poll::Ready(Some(frame.map_err(BoxError::from))),
            Poll::Pending => {
                let deadline = this.deadline;
                let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimedOut)))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else { return };
        if inner.is_end_stream() {
            self.leftover.finished.store(true, Ordering::Release);
        } else if !self.leftover.finished.load(Ordering::Acquire) {
            *self.leftover.unread.lock().unwrap_or_else(PoisonError::into_inner) = Some(inner);
        }
    }
}

/// An answer body that tells the connection's [`Phase`] when hyper has let go of it.
pub(crate) struct AnswerBody {
    inner: axum::body::Body,
    phase: Arc<PhaseCell>,
}

impl AnswerBody {
    /// Wraps the router's answer body.
    pub(crate) fn new(inner: axum::body::Body, phase: Arc<PhaseCell>) -> AnswerBody {
        AnswerBody { inner, phase }
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for AnswerBody {
    fn drop(&mut self) {
        self.phase.apply(Phase::on_body_done);
    }
}

/// The memory that request bodies being served may hold at once, in bytes: each request with a
/// body reserves what it declares (a chunked one, the whole request limit, since nobody knows its
/// size yet) before the router sees it, and gives it back once answered. A body is buffered whole
/// before it is parsed, so without this a burst of large bodies holds `connections x limit`.
pub(crate) struct BodyBudget {
    bytes: Arc<Semaphore>,
    total: usize,
}

/// A reservation in a [`BodyBudget`], given back when dropped.
pub(crate) struct BodyPermit {
    _held: OwnedSemaphorePermit,
}

impl BodyBudget {
    /// A budget of `total` bytes.
    pub(crate) fn new(total: usize) -> BodyBudget {
        let total = total.min(Semaphore::MAX_PERMITS);
        BodyBudget { bytes: Arc::new(Semaphore::new(total)), total }
    }

    /// Bytes reserved now.
    pub(crate) fn in_use(&self) -> usize {
        self.total.saturating_sub(self.bytes.available_permits())
    }

    /// Reserves `n` bytes at once, or `None` when the budget cannot hold them now.
    pub(crate) fn try_reserve(&self, n: u64) -> Option<BodyPermit> {
        let n = u32::try_from(n).ok()?;
        self.bytes.clone().try_acquire_many_owned(n).ok().map(|held| BodyPermit { _held: held })
    }
}
