//! The broker facade: an async handle to the engine that owns the store.
//!
//! The engine lives under one lock. A request that finds the lock free, the engine idle and no
//! request queued is applied on the thread that parsed it and answered from there (in `sync` mode
//! after an fdatasync on that thread): one request at a time crosses no thread. Otherwise it
//! travels over a bounded channel to the engine thread, which takes requests in batches, applies
//! each (one commit-log append per state change), has the flusher sync once for the whole batch in
//! `sync` mode (group commit), and only then replies. Between batches the engine thread sleeps
//! until the earliest due timer of any level, a checkpoint, an async flush or the next request;
//! a request applied inline that moves one of those earlier wakes it.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};
use tracing::{error, info};

pub use crate::config::{BrokerConfig, DelayPolicy, FlushMode, RecoveryMode};
use crate::engine::{Engine, WalkPos};
use crate::error::{Error, Result};
pub use crate::message::{
    Delivery, HistoryEntry, LevelStats, MessageInfo, MessageState, Nacked, PopRequest, ProduceRequest,
    Produced, PushConfig, Stats, TopicInfo, TopicStats, When,
};
use crate::metrics::{GaugeGuard, Metrics};
use crate::schedule::clock::{Clock, SystemClock};
use crate::storage::durability::{Durability, Failure, FailureLog};
use crate::storage::writer::{CheckpointDone, Driver, Release, Writer, WriterConfig};

/// Largest number of requests the engine takes off the channel at once.
const MAX_BATCH: usize = 1024;
/// Timers fired between two looks at the clock.
const FIRE_CHUNK: usize = 64;
/// Produce requests of one batch applied between two looks at the clock.
const PRODUCE_CHUNK: usize = 32;
/// An engine step spends up to this long on requests before it moves on (a single pop or ack
/// may run past it)...
const REQUESTS_UNTIL: Duration = Duration::from_millis(3);
/// ...fires due timers until this far into the step...
const TIMERS_UNTIL: Duration = Duration::from_millis(4);
/// ...and maintains (index resize, reclaim) until this far, then answers what it did. Requests
/// left over wait for the next step, which starts at once: no step holds the engine much past
/// 5 ms, whatever the load, so a long-poll or an ack is never stuck behind a burst of work, and
/// the 10 ms bound holds with room for one large request.
const STEP_UNTIL: Duration = Duration::from_millis(5);
/// A request applied inline wakes the sleeping engine thread only for a deadline this much
/// earlier than the one it sleeps until.
const WAKE_SLACK: Duration = Duration::from_micros(200);
/// Longest sleep between two reclaim rounds.
const RECLAIM_TICK: Duration = Duration::from_secs(1);

enum Command {
    Produce {
        topic: String,
        reqs: Vec<ProduceRequest>,
        reply: oneshot::Sender<Result<Vec<Result<Produced>>>>,
    },
    Pop {
        topics: Vec<String>,
        max: usize,
        ttr_ms: Option<u64>,
        reply: oneshot::Sender<Result<Vec<Delivery>>>,
    },
    Ack {
        receipt: String,
        reply: oneshot::Sender<Result<()>>,
    },
    AckId {
        id: String,
        reply: oneshot::Sender<Result<()>>,
    },
    Nack {
        receipt: String,
        delay_ms: Option<u64>,
        reply: oneshot::Sender<Result<Nacked>>,
    },
    Cancel {
        id: String,
        reply: oneshot::Sender<Result<()>>,
    },
    Replace {
        topic: String,
        req: ProduceRequest,
        reply: oneshot::Sender<Result<()>>,
    },
    Get {
        id: String,
        reply: oneshot::Sender<Result<MessageInfo>>,
    },
    Stats {
        reply: oneshot::Sender<Result<Stats>>,
    },
    Pause {
        topic: String,
        paused: bool,
        reply: oneshot::Sender<Result<()>>,
    },
    Topics {
        reply: oneshot::Sender<Result<Vec<TopicInfo>>>,
    },
    SetPush {
        topic: String,
        cfg: Option<PushConfig>,
        reply: oneshot::Sender<Result<()>>,
    },
    GetPush {
        topic: String,
        reply: oneshot::Sender<Result<Option<PushConfig>>>,
    },
    Pushes {
        reply: oneshot::Sender<Result<(u64, Vec<PushConfig>)>>,
    },
    History {
        id: String,
        reply: oneshot::Sender<Result<(Vec<HistoryEntry>, bool)>>,
    },
    Browse {
        topic: String,
        state: MessageState,
        at: WalkPos,
        limit: usize,
        reply: oneshot::Sender<Result<(Vec<MessageInfo>, Option<WalkPos>)>>,
    },
    /// One slice of a purge (`ids` is `None`) or a redrive.
    Walk {
        op: WalkOp,
        topic: String,
        at: WalkPos,
        until: Option<u64>,
        reply: oneshot::Sender<Result<WalkStep>>,
    },
    Shutdown {
        reply: oneshot::Sender<Result<()>>,
    },
    /// Nothing to apply: the engine thread looks at its timers again.
    Wake,
}

/// What a purge or redrive slice does.
#[derive(Debug, Clone)]
enum WalkOp {
    Purge,
    Redrive(Option<Vec<String>>),
}

/// One slice's result: messages changed, where to go on (`None`: done), and the log offset the
/// whole operation stops at (fixed by its first slice, so it never chases new messages).
type WalkStep = (u64, Option<WalkPos>, u64);

/// A reply held until the batch's flush decides whether it may be sent.
enum Pending {
    Produce(oneshot::Sender<Result<Vec<Result<Produced>>>>, Result<Vec<Result<Produced>>>),
    Pop(oneshot::Sender<Result<Vec<Delivery>>>, Result<Vec<Delivery>>),
    Unit(oneshot::Sender<Result<()>>, Result<()>),
    Nack(oneshot::Sender<Result<Nacked>>, Result<Nacked>),
    Walk(oneshot::Sender<Result<WalkStep>>, Result<WalkStep>),
}

impl Release for Pending {
    /// Sends the reply, or an `Unavailable` error instead when the flush covering it failed.
    fn release(self, flush_err: Option<&Error>) {
        match self {
            Pending::Produce(tx, r) => answer(tx, r, flush_err),
            Pending::Pop(tx, r) => answer(tx, r, flush_err),
            Pending::Unit(tx, r) => answer(tx, r, flush_err),
            Pending::Nack(tx, r) => answer(tx, r, flush_err),
            Pending::Walk(tx, r) => answer(tx, r, flush_err),
        }
    }
}

fn answer<T>(tx: oneshot::Sender<Result<T>>, r: Result<T>, flush_err: Option<&Error>) {
    let _ = tx.send(match flush_err {
        Some(Error::Unavailable(why)) => Err(Error::Unavailable(why.clone())),
        Some(e) => Err(Error::Unavailable(e.to_string())),
        None => r,
    });
}

struct Shared {
    tx: flume::Sender<Command>,
    /// The engine and its commit state. The engine thread runs its steps under this lock; a
    /// request that finds it free, the engine idle and nothing queued is applied right on the
    /// thread that parsed it (see [`Shared::try_inline`]). `None` once the engine stopped.
    core: Arc<Mutex<Option<Core>>>,
    waiters: Mutex<HashMap<String, Arc<Notify>>>,
    config: BrokerConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    /// Applies `cmd` here and now when the engine is free and idle and no request is queued
    /// before it; gives it back otherwise (it then goes to the engine thread).
    ///
    /// One request at a time is the common shape (an application produces while handling its
    /// own request), and on this path it costs no thread hop: a hand-off to the engine thread and
    /// its reply are two wake-ups, each tens of microseconds on a VM, about half of a produce's
    /// time. Under load the lock is taken or requests are queued, so they go to the engine
    /// thread, which takes them in batches and group-commits them as before.
    fn try_inline(&self, cmd: Command) -> Option<Command> {
        if matches!(cmd, Command::Shutdown { .. }) || !self.tx.is_empty() || !self.config.inline_requests {
            return Some(cmd);
        }
        let mut guard = match self.core.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Some(cmd),
        };
        let Some(core) = guard.as_mut().filter(|c| c.idle()) else { return Some(cmd) };
        core.batch.push_back(cmd);
        // An inline fdatasync stalls this thread: only where another worker goes on serving
        // connections meanwhile (they queue up for the engine thread and its group commit). With
        // a single worker it would serialise every request behind one fdatasync each.
        let may_block = tokio::runtime::Handle::try_current().is_ok_and(|h| h.metrics().num_workers() > 1);
        let wake = core.step_inline(may_block);
        core.metrics.requests_inline.fetch_add(1, Ordering::Relaxed);
        if wake {
            core.metrics.engine_wakeups.fetch_add(1, Ordering::Relaxed);
        }
        drop(guard);
        if wake {
            // The engine thread sleeps past something this request made due (a first timer, an
            // async flush); a full channel wakes it anyway.
            let _ = self.tx.try_send(Command::Wake);
        }
        None
    }

    fn notify_for(&self, topic: &str) -> Arc<Notify> {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        w.entry(topic.to_string()).or_default().clone()
    }

    /// Forgets the wake-up handles of `topics` that no pop holds any more, so the map follows the
    /// pops waiting now, not every topic name ever polled (a client polling made-up names would
    /// otherwise grow it without bound).
    fn release(&self, topics: &[String]) {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        for t in topics {
            // Under the lock nobody can clone it: one reference is the map's own.
            if w.get(t).is_some_and(|n| Arc::strong_count(n) == 1) {
                w.remove(t);
            }
        }
    }
}

/// Releases a pop's wake-up handles when the pop ends, however it ends (answered, timed out, or
/// dropped because the client went away). Declared before the handles, so it runs after they
/// are dropped.
struct Interest<'a> {
    shared: &'a Shared,
    topics: &'a [String],
}

impl Drop for Interest<'_> {
    fn drop(&mut self) {
        self.shared.release(self.topics);
    }
}

/// A cheap, cloneable handle to a running broker.
#[derive(Clone)]
pub struct Broker {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    push_metrics: Arc<crate::metrics::PushMetrics>,
    durability: Durability,
}

impl Broker {
    /// Opens (recovering if needed) the data dir and starts the engine thread.
    pub fn open(config: BrokerConfig) -> Result<Broker> {
        Self::open_with_clock(config, Arc::new(SystemClock))
    }

    /// Like [`open`](Self::open) with a chosen clock.
    pub fn open_with_clock(config: BrokerConfig, clock: Arc<dyn Clock>) -> Result<Broker> {
        let metrics = Arc::new(Metrics::default());
        let (engine, report) = Engine::open(config.clone(), clock.clone(), metrics.clone())?;
        let durability = engine.durability().clone();
        info!(clean = report.clean, rebuilt = report.rebuilt, "broker opened");
        let (tx, rx) = flume::bounded(4096);
        let flush = config.flush;
        let flush_every = Duration::from_millis(config.flush_interval_ms.max(1));
        let shared = Arc::new_cyclic(|weak: &std::sync::Weak<Shared>| {
            let core = Core::start(engine, clock, flush, flush_every, weak.clone(), metrics.clone());
            Shared {
                tx,
                core: Arc::new(Mutex::new(Some(core))),
                waiters: Mutex::new(HashMap::new()),
                config,
                thread: Mutex::new(None),
            }
        });
        let core = shared.core.clone();
        let handle = std::thread::Builder::new()
            .name("delayd-engine".into())
            .spawn(move || run_engine(core, rx))
            .map_err(|e| Error::io("spawn engine thread", e))?;
        *shared.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        Ok(Broker { shared, metrics, push_metrics: Arc::default(), durability })
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> Command) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        // Applied inline, the reply is already in `rx` (or, in sync mode under load, on its way
        // from the flusher).
        if let Some(cmd) = self.shared.try_inline(make(tx)) {
            self.metrics.requests_queued.fetch_add(1, Ordering::Relaxed);
            self.shared
                .tx
                .send_async(cmd)
                .await
                .map_err(|_| Error::Unavailable("the broker is shutting down".into()))?;
        }
        rx.await.map_err(|_| Error::Unavailable("the broker is shutting down".into()))?
    }

    /// Produces one message.
    pub async fn produce(&self, topic: &str, req: ProduceRequest) -> Result<Produced> {
        let mut out = self.produce_batch(topic, vec![req]).await?;
        out.pop().unwrap_or_else(|| Err(Error::Unavailable("empty batch result".into())))
    }

    /// Produces many messages with one durable flush; each gets its own result.
    pub async fn produce_batch(
        &self,
        topic: &str,
        reqs: Vec<ProduceRequest>,
    ) -> Result<Vec<Result<Produced>>> {
        let topic = topic.to_string();
        self.call(|reply| Command::Produce { topic, reqs, reply }).await
    }

    /// Reserves up to `max` ready messages, waiting up to `wait_ms` for the first one.
    pub async fn pop(&self, req: PopRequest) -> Result<Vec<Delivery>> {
        if req.topics.is_empty() {
            return Err(Error::invalid("topic", "at least one topic is required"));
        }
        for t in &req.topics {
            crate::engine::validate_topic(t)?;
        }
        let max_batch = self.shared.config.max_batch;
        if req.max == 0 || req.max > max_batch {
            return Err(Error::invalid("max", format!("must be 1 to {max_batch} (max_batch)")));
        }
        let wait = Duration::from_millis(req.wait_ms.min(self.shared.config.max_wait_ms));
        let deadline = Instant::now() + wait;
        let _interest = Interest { shared: &self.shared, topics: &req.topics };
        let notifies: Vec<Arc<Notify>> = req.topics.iter().map(|t| self.shared.notify_for(t)).collect();
        loop {
            // Register interest before asking, so a message that lands in between still wakes us.
            let mut waits: Vec<Pin<Box<tokio::sync::futures::Notified<'_>>>> =
                notifies.iter().map(|n| Box::pin(n.notified())).collect();
            for w in waits.iter_mut() {
                w.as_mut().enable();
            }
            let (topics, max, ttr_ms) = (req.topics.clone(), req.max, req.ttr_ms);
            let got = self.call(|reply| Command::Pop { topics, max, ttr_ms, reply }).await?;
            let now = Instant::now();
            if !got.is_empty() || now >= deadline {
                return Ok(got);
            }
            let any = std::future::poll_fn(|cx| {
                for w in waits.iter_mut() {
                    if w.as_mut().poll(cx).is_ready() {
                        return std::task::Poll::Ready(());
                    }
                }
                std::task::Poll::Pending
            });
            // Dropped with the wait, also when the client goes away and the request is cancelled.
            let _waiting = GaugeGuard::hold(&self.metrics.pops_waiting);
            if tokio::time::timeout(deadline - now, any).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }

    /// Acknowledges a delivery by receipt.
    pub async fn ack(&self, receipt: &str) -> Result<()> {
        let receipt = receipt.to_string();
        self.call(|reply| Command::Ack { receipt, reply }).await
    }

    /// Marks a message done by id, whatever its state (compat `/finish`).
    pub async fn ack_id(&self, id: &str) -> Result<()> {
        let id = id.to_string();
        self.call(|reply| Command::AckId { id, reply }).await
    }

    /// Returns a delivery for retry after `delay_ms` or the next backoff step.
    pub async fn nack(&self, receipt: &str, delay_ms: Option<u64>) -> Result<Nacked> {
        let receipt = receipt.to_string();
        self.call(|reply| Command::Nack { receipt, delay_ms, reply }).await
    }

    /// Cancels a message that has not been acked.
    pub async fn cancel(&self, id: &str) -> Result<()> {
        let id = id.to_string();
        self.call(|reply| Command::Cancel { id, reply }).await
    }

    /// Produces a message that its id names from now on, replacing a pending, reserved or dead one
    /// (cancelled, never delivered again) or a final one (the compat `/push`).
    pub async fn replace(&self, topic: &str, req: ProduceRequest) -> Result<()> {
        let topic = topic.to_string();
        self.call(|reply| Command::Replace { topic, req, reply }).await
    }

    /// Looks a message up by id.
    pub async fn get(&self, id: &str) -> Result<MessageInfo> {
        let id = id.to_string();
        self.call(|reply| Command::Get { id, reply }).await
    }

    /// Counters per level and topic.
    pub async fn stats(&self) -> Result<Stats> {
        self.call(|reply| Command::Stats { reply }).await
    }

    /// Pauses (`true`) or resumes a topic; durable like any change.
    pub async fn set_paused(&self, topic: &str, paused: bool) -> Result<()> {
        let topic = topic.to_string();
        self.call(|reply| Command::Pause { topic, paused, reply }).await
    }

    /// Sets, replaces or (`None`) removes `topic`'s push subscription; durable like any change.
    pub async fn set_push(&self, topic: &str, cfg: Option<PushConfig>) -> Result<()> {
        let topic = topic.to_string();
        self.call(|reply| Command::SetPush { topic, cfg, reply }).await
    }

    /// `topic`'s push subscription, if any.
    pub async fn push_of(&self, topic: &str) -> Result<Option<PushConfig>> {
        let topic = topic.to_string();
        self.call(|reply| Command::GetPush { topic, reply }).await
    }

    /// Every push subscription, with a number that changes whenever one is set or removed.
    pub async fn pushes(&self) -> Result<(u64, Vec<PushConfig>)> {
        self.call(|reply| Command::Pushes { reply }).await
    }

    /// The message's recorded changes, newest first, and whether they reach back to its produce.
    pub async fn history(&self, id: &str) -> Result<(Vec<HistoryEntry>, bool)> {
        let id = id.to_string();
        self.call(|reply| Command::History { id, reply }).await
    }

    /// Every topic with its counts and pause state.
    pub async fn topics(&self) -> Result<Vec<TopicInfo>> {
        self.call(|reply| Command::Topics { reply }).await
    }

    /// Up to `limit` messages of `topic` in `state` from `at`, and where the next page starts.
    pub async fn browse(
        &self,
        topic: &str,
        state: MessageState,
        at: WalkPos,
        limit: usize,
    ) -> Result<(Vec<MessageInfo>, Option<WalkPos>)> {
        let topic = topic.to_string();
        self.call(|reply| Command::Browse { topic, state, at, limit, reply }).await
    }

    /// Cancels every message of `topic` that is not final; returns how many. Runs in bounded
    /// slices between other requests, and stops at the messages that existed when it began.
    pub async fn purge(&self, topic: &str) -> Result<u64> {
        self.walk_all(WalkOp::Purge, topic).await
    }

    /// Moves dead letters of `topic` (all, or those of `ids`) back to it; returns how many.
    pub async fn redrive(&self, topic: &str, ids: Option<Vec<String>>) -> Result<u64> {
        self.walk_all(WalkOp::Redrive(ids), topic).await
    }

    async fn walk_all(&self, op: WalkOp, topic: &str) -> Result<u64> {
        let (mut total, mut at, mut until) = (0, Some(WalkPos::default()), None);
        while let Some(pos) = at {
            let (op, topic) = (op.clone(), topic.to_string());
            let (n, next, end) =
                self.call(|reply| Command::Walk { op, topic, at: pos, until, reply }).await?;
            total += n;
            (at, until) = (next, Some(end));
        }
        Ok(total)
    }

    /// Topics with a long poll's wake-up handle now (for tests: it follows the waiting pops).
    #[doc(hidden)]
    pub fn waiting_topics(&self) -> usize {
        self.shared.waiters.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Process-wide counters and histograms.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Push delivery counters and histograms, per topic.
    pub fn push_metrics(&self) -> &crate::metrics::PushMetrics {
        &self.push_metrics
    }

    /// True while the store takes writes: not poisoned by a failed sync, and its last write did
    /// not fail for lack of disk space or file handles.
    pub fn store_writable(&self) -> bool {
        self.durability.writable()
    }

    /// Why the store does not take writes (the failure: operation, file, OS error), if it does not.
    pub fn store_failure(&self) -> Option<String> {
        self.durability.poison_reason().or_else(|| self.durability.trouble()).map(|f| f.to_string())
    }

    /// The configuration the broker runs with.
    pub fn config(&self) -> &BrokerConfig {
        &self.shared.config
    }

    /// Flushes, persists offsets, writes the clean-shutdown marker and stops the engine.
    pub async fn shutdown(&self) -> Result<()> {
        let r = self.call(|reply| Command::Shutdown { reply }).await;
        let handle = self.shared.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        match r {
            // A second shutdown finds the engine gone: that is success.
            Err(Error::Unavailable(_)) => Ok(()),
            other => other,
        }
    }
}

/// How long timers and reclaim wait before trying again after a write failed for lack of a
/// resource (disk space, file handles).
const RETRY_AFTER_TROUBLE: Duration = Duration::from_secs(1);
/// How often a failure that goes on is logged again.
const REMIND_EVERY: Duration = Duration::from_secs(60);

/// The engine and what it needs between steps: requests taken and not yet applied, replies
/// waiting for a flush, the flusher and checkpoint threads.
struct Core {
    engine: Engine,
    clock: Arc<dyn Clock>,
    shared: std::sync::Weak<Shared>,
    durability: Durability,
    /// Requests taken off the channel and not yet applied (a step stops at its time budget).
    batch: std::collections::VecDeque<Command>,
    /// A produce batch cut by the end of a step: applied first in the next one.
    producing: Option<Producing>,
    /// Replies owed for what the step applied, handed to the writer's commit.
    pending: Vec<Pending>,
    metrics: Arc<Metrics>,
    shutdown: Option<oneshot::Sender<Result<()>>>,
    /// The storage write path: group commit, flusher and checkpoint threads.
    writer: Writer<Pending>,
    /// Timers (or reclaim) failed for lack of a resource: not before this instant again.
    timers_retry_at: Option<Instant>,
    reclaim_retry_at: Option<Instant>,
    timer_log: FailureLog,
    reclaim_log: FailureLog,
    checkpoint_log: FailureLog,
    /// Until when the engine thread sleeps, while it does: a request applied inline that makes
    /// something due earlier wakes it.
    sleeping_until: Option<Instant>,
}

/// Times one engine step: wall clock and the engine thread's own CPU time, and when each of its
/// parts ended, to say which one ran long.
struct StepTimer {
    started: Instant,
    /// The thread's CPU clock at the start; `None` for a step not timed on the CPU clock.
    cpu_ns: Option<u64>,
    /// Whether the CPU time goes into `delayd_engine_step_cpu_seconds` (engine-thread steps).
    count_cpu: bool,
    switches: [u64; 4],
    marks: [(&'static str, Instant); 6],
    marked: usize,
}

/// A step over this much wall or CPU time is logged with its parts, faults and context switches
/// (at debug level: the histograms count them, and on a loaded machine they are not news).
const SLOW_STEP: Duration = Duration::from_millis(10);

impl StepTimer {
    /// Starts timing a step; `on_cpu` also reads the thread's CPU clock, a system call at each
    /// end (not served by the vDSO like the wall clock). Steps on the engine thread read it, since
    /// a long one is either work or waiting and only that clock tells which; a request applied
    /// inline reads it only for the slow-step log, when that is on, since two system calls per
    /// request were 2-3% of the server's CPU under load, and such a step is one request's work.
    fn start(on_cpu: bool) -> StepTimer {
        let started = Instant::now();
        let slow_step_log = tracing::enabled!(tracing::Level::DEBUG);
        StepTimer {
            started,
            cpu_ns: (on_cpu || slow_step_log).then(crate::storage::mmap::thread_cpu_ns),
            count_cpu: on_cpu,
            // Only the slow-step log reads them: no system call per step otherwise.
            switches: if slow_step_log { crate::storage::mmap::thread_switches() } else { [0; 4] },
            marks: [("", started); 6],
            marked: 0,
        }
    }

    /// Notes that the part `name` ended now.
    fn mark(&mut self, name: &'static str) {
        if let Some(m) = self.marks.get_mut(self.marked) {
            *m = (name, Instant::now());
            self.marked += 1;
        }
    }

    fn record(&self, metrics: &Metrics) {
        let wall = self.started.elapsed();
        let cpu = self.cpu_ns.map_or(0, |at| crate::storage::mmap::thread_cpu_ns().saturating_sub(at));
        metrics.engine_step_us.observe(wall.as_micros() as u64);
        if self.count_cpu {
            metrics.engine_step_cpu_us.observe(cpu / 1000);
        }
        if (wall >= SLOW_STEP || Duration::from_nanos(cpu) >= SLOW_STEP)
            && tracing::enabled!(tracing::Level::DEBUG)
        {
            let now = crate::storage::mmap::thread_switches();
            let [minflt, majflt, blocked, preempted] =
                [0, 1, 2, 3].map(|k| now[k].saturating_sub(self.switches[k]));
            let mut parts = String::new();
            let mut from = self.started;
            for (name, at) in &self.marks[..self.marked] {
                parts.push_str(&format!("{name} {:.1?} ", at.duration_since(from)));
                from = *at;
            }
            tracing::debug!(
                ?wall,
                cpu = ?Duration::from_nanos(cpu),
                parts = parts.trim_end(),
                minflt,
                majflt,
                blocked,
                preempted,
                "slow engine step"
            );
        }
    }
}

/// A produce batch part-way through: the requests left and the results so far.
struct Producing {
    topic: String,
    reqs: std::vec::IntoIter<ProduceRequest>,
    done: Vec<Result<Produced>>,
    reply: oneshot::Sender<Result<Vec<Result<Produced>>>>,
}

/// The engine thread: sleeps (without the lock) until the next timer, checkpoint, async flush or
/// request, then runs a step under the lock; stops the core on shutdown or when every handle is
/// gone.
fn run_engine(core: Arc<Mutex<Option<Core>>>, rx: flume::Receiver<Command>) {
    let lock = || core.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let wait = {
            let mut guard = lock();
            let Some(c) = guard.as_mut() else { return };
            let wait = c.wait_time();
            if wait.is_zero()
                && rx.is_disconnected()
                && rx.is_empty()
                && c.batch.is_empty()
                && c.producing.is_none()
            {
                break;
            }
            c.sleeping_until = Some(Instant::now() + wait);
            wait
        };
        let mut first = None;
        if !wait.is_zero() {
            match rx.recv_timeout(wait) {
                Ok(cmd) => first = Some(cmd),
                Err(flume::RecvTimeoutError::Timeout) => {}
                Err(flume::RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut guard = lock();
        let Some(c) = guard.as_mut() else { return };
        c.sleeping_until = None;
        c.batch.extend(first);
        while c.batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(cmd) => c.batch.push_back(cmd),
                Err(_) => break,
            }
        }
        if c.step() {
            break;
        }
    }
    // Taken out under the lock: from here on, requests find no core and go to the channel,
    // which is closed once `rx` is dropped below.
    let core = lock().take();
    if let Some(c) = core {
        c.stop(&rx);
    }
}

impl Core {
    /// The core of a freshly opened engine, with its writer (flusher and checkpoint threads) started.
    fn start(
        engine: Engine,
        clock: Arc<dyn Clock>,
        flush: FlushMode,
        flush_every: Duration,
        shared: std::sync::Weak<Shared>,
        metrics: Arc<Metrics>,
    ) -> Core {
        let durability = engine.durability().clone();
        let on_flush = {
            let metrics = metrics.clone();
            Arc::new(move |took: Duration| metrics.flush_us.observe(took.as_micros() as u64))
        };
        let writer = Writer::start(
            WriterConfig { flush, flush_every, on_flush },
            durability.clone(),
            engine.log_end(),
            Vec::new(),
        );
        Core {
            engine,
            clock,
            shared,
            durability,
            batch: std::collections::VecDeque::with_capacity(MAX_BATCH),
            producing: None,
            pending: Vec::with_capacity(MAX_BATCH),
            metrics,
            shutdown: None,
            writer,
            timers_retry_at: None,
            reclaim_retry_at: None,
            timer_log: FailureLog::new(REMIND_EVERY),
            reclaim_log: FailureLog::new(REMIND_EVERY),
            checkpoint_log: FailureLog::new(REMIND_EVERY),
            sleeping_until: None,
        }
    }

    /// One step of the engine thread: requests, timers, maintenance, commit, wake-ups, checkpoint.
    /// True when a shutdown was asked for.
    fn step(&mut self) -> bool {
        let mut step = StepTimer::start(true);
        self.apply(&mut step);
        let driver =
            if self.shutdown.is_some() { Driver::Stopping } else { Driver::Engine { alone: self.alone() } };
        self.commit(driver);
        step.mark("commit");
        self.notify();
        step.mark("notify");
        if self.shutdown.is_some() {
            return true;
        }
        self.checkpoint();
        step.mark("checkpoint");
        step.record(&self.metrics);
        false
    }

    /// True when nothing is taken and unapplied, no reply waits, and (in sync mode) no flush is
    /// in flight: a request applied now is answered by this step alone.
    fn idle(&self) -> bool {
        // After a shutdown request nothing more is applied: the engine thread is about to stop.
        self.shutdown.is_none()
            && self.batch.is_empty()
            && self.producing.is_none()
            && self.pending.is_empty()
            && self.writer.settled()
    }

    /// Applies the request just put in `batch` on the caller's thread and answers it (a lone
    /// small sync batch is flushed here too). Timers, maintenance, checkpoints and async flushes
    /// stay with the engine thread; true when it sleeps past something that is now due earlier.
    fn step_inline(&mut self, may_block: bool) -> bool {
        let mut step = StepTimer::start(false);
        let log_end = self.engine.log_end();
        self.apply_requests(step.started + REQUESTS_UNTIL);
        step.mark("requests");
        self.commit(Driver::Inline { may_block, alone: self.alone() });
        step.mark("commit");
        self.notify();
        step.mark("notify");
        step.record(&self.metrics);
        // Only an append (a timer, a dirty log) or work left over can move the engine thread's
        // deadline: reads and empty pops skip the recomputation. Deadlines are recomputed from
        // `now`, so the same one comes out a little earlier each time: only one earlier by more
        // than the slack is worth a wake-up (a new one within it fires at most that late, never
        // early).
        let changed = self.engine.log_end() != log_end || self.producing.is_some();
        match self.sleeping_until {
            Some(until) if changed => Instant::now() + self.wait_time() + WAKE_SLACK < until,
            _ => false,
        }
    }

    /// How long the engine thread may sleep: until the next due timer (to the microsecond),
    /// checkpoint, async flush or maintenance, or not at all when requests are left over.
    ///
    /// A store that cannot write does not wake for timers or reclaim (they would fail at once, and
    /// a due time in the past would make the wait zero: a busy loop); one that failed for lack of
    /// a resource wakes for them again after [`RETRY_AFTER_TROUBLE`].
    fn wait_time(&mut self) -> Duration {
        if self.producing.is_some() || !self.batch.is_empty() {
            return Duration::ZERO;
        }
        let mut wait = self.writer.next_work(self.engine.dirty());
        if !self.durability.is_poisoned() {
            match retry_wait(&mut self.timers_retry_at) {
                Some(backoff) => wait = wait.min(backoff),
                None => {
                    if let Some(due) = self.engine.next_due() {
                        let now_us = self.clock.now_us();
                        wait = wait.min(Duration::from_micros((due * 1000).saturating_sub(now_us)));
                    }
                }
            }
            // Reclaim works in slices between requests; when it has nothing to do now it looks
            // again within a second (final messages reach their retention continuously).
            wait = wait.min(match retry_wait(&mut self.reclaim_retry_at) {
                Some(backoff) => backoff,
                None if self.engine.maintenance_due() => Duration::ZERO,
                None => RECLAIM_TICK,
            });
        }
        wait
    }

    /// Requests waiting in the channel, not yet taken.
    fn queued(&self) -> usize {
        self.shared.upgrade().map_or(0, |s| s.tx.len())
    }

    /// Applies requests, fires due timers and runs a slice of maintenance, each until its share
    /// of the step's time budget is spent (and each a little even when it is).
    fn apply(&mut self, step: &mut StepTimer) {
        self.apply_requests(step.started + REQUESTS_UNTIL);
        step.mark("requests");
        self.fire_timers(step.started + TIMERS_UNTIL);
        step.mark("timers");
        self.reclaim(step.started + STEP_UNTIL);
        step.mark("maintenance");
    }

    /// Applies queued requests in order until `until` (at least one).
    fn apply_requests(&mut self, until: Instant) {
        let engine = &mut self.engine;
        let mut first = true;
        loop {
            if !first && Instant::now() >= until {
                return;
            }
            first = false;
            if let Some(mut p) = self.producing.take() {
                p.done.extend(p.reqs.by_ref().take(PRODUCE_CHUNK).map(|req| engine.produce(&p.topic, req)));
                if p.reqs.len() > 0 {
                    self.producing = Some(p);
                } else {
                    self.pending.push(Pending::Produce(p.reply, Ok(p.done)));
                }
                continue;
            }
            let Some(cmd) = self.batch.pop_front() else { return };
            match cmd {
                Command::Produce { topic, reqs, reply } => {
                    let done = Vec::with_capacity(reqs.len());
                    self.producing = Some(Producing { topic, reqs: reqs.into_iter(), done, reply });
                }
                Command::Pop { topics, max, ttr_ms, reply } => {
                    self.pending.push(Pending::Pop(reply, engine.pop(&topics, max, ttr_ms)))
                }
                Command::Ack { receipt, reply } => {
                    self.pending.push(Pending::Unit(reply, engine.ack(&receipt)))
                }
                Command::AckId { id, reply } => self.pending.push(Pending::Unit(reply, engine.ack_id(&id))),
                Command::Nack { receipt, delay_ms, reply } => {
                    self.pending.push(Pending::Nack(reply, engine.nack(&receipt, delay_ms)))
                }
                Command::Cancel { id, reply } => self.pending.push(Pending::Unit(reply, engine.cancel(&id))),
                Command::Replace { topic, req, reply } => {
                    self.pending.push(Pending::Unit(reply, engine.replace(&topic, req).map(|_| ())))
                }
                Command::Get { id, reply } => {
                    let _ = reply.send(engine.get(&id));
                }
                Command::Stats { reply } => {
                    let _ = reply.send(Ok(engine.stats()));
                }
                Command::Pause { topic, paused, reply } => {
                    self.pending.push(Pending::Unit(reply, engine.set_paused(&topic, paused)))
                }
                Command::Topics { reply } => {
                    let _ = reply.send(Ok(engine.topics()));
                }
                Command::SetPush { topic, cfg, reply } => {
                    self.pending.push(Pending::Unit(reply, engine.set_push(&topic, cfg.as_ref())))
                }
                Command::GetPush { topic, reply } => {
                    let _ = reply.send(engine.push_of(&topic));
                }
                Command::Pushes { reply } => {
                    let _ = reply.send(engine.pushes());
                }
                Command::History { id, reply } => {
                    let _ = reply.send(engine.history(&id));
                }
                Command::Browse { topic, state, at, limit, reply } => {
                    let _ = reply.send(engine.browse(&topic, state, at, limit));
                }
                Command::Walk { op, topic, at, until, reply } => {
                    let until = until.unwrap_or_else(|| engine.log_end());
                    let r = match op {
                        WalkOp::Purge => engine.purge(&topic, at, until),
                        WalkOp::Redrive(ids) => engine.redrive(&topic, ids.as_deref(), at, until),
                    };
                    self.pending.push(Pending::Walk(reply, r.map(|(n, next)| (n, next, until))));
                }
                Command::Shutdown { reply } => {
                    // Requests behind it are dropped (their callers see the broker stopped).
                    self.shutdown = Some(reply);
                    self.batch.clear();
                    return;
                }
                Command::Wake => {}
            }
        }
    }

    /// Fires due timers until `until` (some, at least); after a failure, waits before trying
    /// again and logs it once.
    fn fire_timers(&mut self, until: Instant) {
        if self.durability.is_poisoned() || self.timers_retry_at.is_some() {
            return;
        }
        loop {
            match self.engine.run_due(FIRE_CHUNK) {
                Ok(n) => {
                    self.timer_log.clear();
                    if n < FIRE_CHUNK || Instant::now() >= until {
                        return;
                    }
                }
                // Poisoned: logged where it happened; timers stay idle until a restart.
                Err(_) if self.durability.is_poisoned() => return,
                Err(e) => {
                    self.timer_log.report("firing due timers", &Failure::from_error(&e));
                    self.timers_retry_at = Some(Instant::now() + RETRY_AFTER_TROUBLE);
                    return;
                }
            }
        }
    }

    /// Applies durable checkpoints and runs a slice of reclaim, until `until`.
    fn reclaim(&mut self, until: Instant) {
        for done in self.writer.checkpoints_done() {
            self.checkpoint_done(done);
        }
        if self.durability.is_poisoned() || self.reclaim_retry_at.is_some() {
            return;
        }
        match self.engine.maintain_until(until) {
            Ok(()) => self.reclaim_log.clear(),
            Err(_) if self.durability.is_poisoned() => {}
            Err(e) => {
                self.reclaim_log.report("reclaim", &Failure::from_error(&e));
                self.reclaim_retry_at = Some(Instant::now() + RETRY_AFTER_TROUBLE);
            }
        }
    }

    /// Makes the step's records durable and answers its requests, through the writer's one
    /// commit call (whichever thread drives the step).
    fn commit(&mut self, driver: Driver) {
        self.engine.commit(&mut self.writer, &mut self.pending, driver);
    }

    /// True when nothing waits behind the step just applied: no request taken or queued, none
    /// half applied.
    fn alone(&self) -> bool {
        self.batch.is_empty() && self.producing.is_none() && self.queued() == 0
    }

    /// Wakes long-polls waiting on topics that got entries.
    fn notify(&mut self) {
        let touched = self.engine.take_touched();
        if touched.is_empty() {
            return;
        }
        if let Some(shared) = self.shared.upgrade() {
            let w = shared.waiters.lock().unwrap_or_else(|p| p.into_inner());
            for t in touched {
                if let Some(n) = w.get(&t) {
                    n.notify_waiters();
                }
            }
        }
    }

    /// Every checkpoint period, captures a checkpoint and hands it to the writer's checkpoint
    /// thread.
    fn checkpoint(&mut self) {
        if !self.writer.checkpoint_due(self.engine.log_end()) {
            return;
        }
        for done in self.writer.checkpoints_done() {
            self.checkpoint_done(done);
        }
        let job = match self.engine.checkpoint_job() {
            Ok(job) => job,
            Err(e) => {
                self.checkpoint_log.report("capturing a checkpoint", &Failure::from_error(&e));
                return;
            }
        };
        if let Some(done) = self.writer.checkpoint(job, self.engine.log_end()) {
            self.checkpoint_done(done);
        }
    }

    /// A checkpoint job finished: on success its files count as synced and reclaim may delete
    /// what it replaces; on failure the next job syncs them again.
    fn checkpoint_done(&mut self, done: CheckpointDone) {
        match done.result {
            Ok(()) => {
                self.checkpoint_log.clear();
                self.engine.checkpoint_synced(&done.captured);
                self.engine.checkpoint_durable(&done.checkpoint);
                self.engine.restore_reserve();
            }
            // A failed sync poisoned the store and was logged where it happened.
            Err(_) if self.durability.is_poisoned() => {}
            // Out of space or handles: the writer captures everything since at the next round.
            Err(e) => {
                self.checkpoint_log.report("checkpoint", &Failure::from_error(&e));
            }
        }
    }

    /// Refuses whatever is still queued, lets the flusher answer what it holds, then leaves the
    /// data dir clean with a final, synchronous checkpoint (not when poisoned: recovery will
    /// scan the log instead of trusting files in an unknown state).
    fn stop(mut self, rx: &flume::Receiver<Command>) {
        rx.drain().for_each(drop);
        for done in self.writer.stop() {
            self.checkpoint_done(done);
        }
        let shutdown = self.shutdown.take();
        let r = match self.durability.check() {
            Err(e) => Err(e),
            Ok(()) => self.engine.close(),
        };
        match &r {
            Ok(()) => info!("engine stopped cleanly"),
            Err(e) => error!(error = %e, "clean shutdown failed"),
        }
        if let Some(reply) = shutdown {
            let _ = reply.send(r);
        }
    }
}

/// The time left until `retry_at`, clearing it once passed.
fn retry_wait(retry_at: &mut Option<Instant>) -> Option<Duration> {
    let at = (*retry_at)?;
    let now = Instant::now();
    if at > now {
        Some(at - now)
    } else {
        *retry_at = None;
        None
    }
}

#[cfg(test)]
#[path = "../broker_tests.rs"]
mod tests;
