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
//!
//! Its rooms, beside this file (the [`Broker`] handle, its async API, the state it shares with
//! the engine thread, the inline path and the long-poll wake-ups):
//! - `command.rs`: the requests the handle sends the engine and the replies held for a flush.
//! - `core.rs`: the engine thread and the step it runs (requests, timers, maintenance, commit,
//!   wake-ups, checkpoints), whichever thread drives it.
//! - `step_timer.rs`: how long a step took, on the wall and CPU clocks, and which part ran long.

mod command;
mod core;
mod step_timer;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};
use tracing::info;

use self::command::{Command, WalkOp};
use self::core::{run_engine, Core};
pub use crate::config::{BrokerConfig, DelayPolicy, FlushMode, RecoveryMode};
use crate::engine::{Engine, WalkPos};
use crate::error::{Error, Result};
pub use crate::message::{
    Delivery, FlowConfig, HistoryEntry, LevelStats, MessageInfo, MessageState, Nacked, PopRequest,
    ProduceRequest, Produced, PushConfig, RescheduleRequest, Rescheduled, Stats, TopicInfo, TopicStats, When,
};
use crate::metrics::{GaugeGuard, Metrics};
use crate::schedule::clock::{Clock, SystemClock};
use crate::storage::durability::Durability;

struct Shared {
    tx: flume::Sender<Command>,
    /// The engine and its commit state. The engine thread runs its steps under this lock; a
    /// request that finds it free, the engine idle and nothing queued is applied right on the
    /// thread that parsed it (see [`Shared::try_inline`]). `None` once the engine stopped.
    core: Arc<Mutex<Option<Core>>>,
    waiters: Mutex<HashMap<String, Arc<Notify>>>,
    config: BrokerConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The cluster this broker's node belongs to (unset on a single node).
    cluster: std::sync::OnceLock<Arc<crate::cluster::ClusterState>>,
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
        let lone = core.take_outside();
        drop(guard);
        if wake {
            // The engine thread sleeps past something this request made due (a first timer, an
            // async flush); a full channel wakes it anyway.
            let _ = self.tx.try_send(Command::Wake);
        }
        // Its fdatasync, with the engine free meanwhile: a timer falling due does not wait for it.
        if let Some(lone) = lone {
            lone.run();
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

/// What makes a broker a cluster node's: the store's side of replication, the log's last
/// replicated entry, and the writer's "durable on a majority" condition.
pub struct Replication {
    /// Keeps the store's log framed as the replicated log.
    pub replicator: Box<dyn crate::storage::replica::Replicator>,
    /// The log's last complete entry when it opened.
    pub sealed: crate::storage::replica::Sealed,
    /// Released replies wait for it after the local sync.
    pub condition: Box<dyn crate::storage::writer::Condition>,
    /// The clock timers fire by (a majority's).
    pub fire_clock: Arc<dyn Clock>,
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
        Self::open_replicated(config, clock, None)
    }

    /// Like [`open_with_clock`](Self::open_with_clock), as a cluster node when `replication` is
    /// given: its store keeps the log framed as the replicated log and its writer answers a
    /// change only once a majority has it.
    pub fn open_replicated(
        config: BrokerConfig,
        clock: Arc<dyn Clock>,
        replication: Option<Replication>,
    ) -> Result<Broker> {
        let metrics = Arc::new(Metrics::default());
        let (mut engine, report) = Engine::open(config.clone(), clock.clone(), metrics.clone())?;
        let conditions = match replication {
            Some(r) => {
                engine.set_replicator(r.replicator, r.sealed);
                engine.set_fire_clock(r.fire_clock);
                vec![r.condition]
            }
            None => Vec::new(),
        };
        let durability = engine.durability().clone();
        info!(clean = report.clean, rebuilt = report.rebuilt, "broker opened");
        let (tx, rx) = flume::bounded(4096);
        let flush = config.flush;
        let flush_every = Duration::from_millis(config.flush_interval_ms.max(1));
        let shared = Arc::new_cyclic(|weak: &std::sync::Weak<Shared>| {
            let core =
                Core::start(engine, clock, flush, flush_every, weak.clone(), metrics.clone(), conditions);
            Shared {
                tx,
                core: Arc::new(Mutex::new(Some(core))),
                waiters: Mutex::new(HashMap::new()),
                config,
                thread: Mutex::new(None),
                cluster: std::sync::OnceLock::new(),
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

    /// Ties this broker to its node's view of the cluster (once, when the node starts).
    pub fn set_cluster(&self, state: Arc<crate::cluster::ClusterState>) {
        let _ = self.shared.cluster.set(state);
    }

    /// Wakes every waiting pop so that it asks again (and, on a node that just stopped leading,
    /// ends with 503 instead of waiting out its time for messages that will not come here).
    pub fn wake_all_pops(&self) {
        let w = self.shared.waiters.lock().unwrap_or_else(|p| p.into_inner());
        w.values().for_each(|n| n.notify_waiters());
    }

    /// True when this broker may act on its own (push deliveries): always on a single node, only
    /// while its node leads in a cluster.
    pub fn leads(&self) -> bool {
        self.shared.cluster.get().is_none_or(|c| c.leading())
    }

    /// A function that makes the engine thread take a step (the raft thread calls it when
    /// entries arrive for the store).
    pub fn waker(&self) -> Box<dyn Fn() + Send + Sync> {
        let tx = self.shared.tx.clone();
        Box::new(move || {
            let _ = tx.try_send(Command::Wake);
        })
    }

    /// Like [`Broker::waker`], but the step is taken right on the calling thread when the
    /// engine is free and idle with nothing queued (see `Shared::try_inline`). The caller must
    /// hold no lock the engine's step may take.
    pub fn inline_waker(&self) -> Box<dyn Fn() + Send + Sync> {
        let shared = Arc::downgrade(&self.shared);
        Box::new(move || {
            let Some(shared) = shared.upgrade() else { return };
            if let Some(cmd) = shared.try_inline(Command::Wake) {
                let _ = shared.tx.try_send(cmd);
            }
        })
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
            let (got, held_for) = self.call(|reply| Command::Pop { topics, max, ttr_ms, reply }).await?;
            let now = Instant::now();
            if !got.is_empty() || now >= deadline {
                return Ok(got);
            }
            // Held back by flow control: look again when it may have room, not only on a new message.
            let until = held_for.map_or(deadline, |ms| deadline.min(now + Duration::from_millis(ms)));
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
            if tokio::time::timeout(until - now, any).await.is_err() && until >= deadline {
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
        self.nack_with_error(receipt, delay_ms, None).await
    }

    /// A [`nack`](Self::nack) that keeps `error` as the message's last error (see
    /// [`Engine::nack_with_error`](crate::engine::Engine::nack_with_error)).
    pub async fn nack_with_error(
        &self,
        receipt: &str,
        delay_ms: Option<u64>,
        error: Option<String>,
    ) -> Result<Nacked> {
        let receipt = receipt.to_string();
        self.call(|reply| Command::Nack { receipt, delay_ms, error, reply }).await
    }

    /// Extends a reservation to `ttr_ms` from now, keeping its receipt; returns its new end.
    pub async fn touch(&self, receipt: &str, ttr_ms: u64) -> Result<u64> {
        let receipt = receipt.to_string();
        self.call(|reply| Command::Touch { receipt, ttr_ms, reply }).await
    }

    /// Cancels a message that has not been acked.
    pub async fn cancel(&self, id: &str) -> Result<()> {
        let id = id.to_string();
        self.call(|reply| Command::Cancel { id, reply }).await
    }

    /// Moves a pending message to a new due time in one durable record, keeping its id.
    pub async fn reschedule(&self, id: &str, req: RescheduleRequest) -> Result<Rescheduled> {
        let id = id.to_string();
        self.call(|reply| Command::Reschedule { id, req, reply }).await
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

    /// Sets, replaces or (`None`) removes `topic`'s flow control; durable like any change.
    pub async fn set_flow(&self, topic: &str, cfg: Option<FlowConfig>) -> Result<()> {
        let topic = topic.to_string();
        self.call(|reply| Command::SetFlow { topic, cfg, reply }).await
    }

    /// `topic`'s flow control, if any.
    pub async fn flow_of(&self, topic: &str) -> Result<Option<FlowConfig>> {
        let topic = topic.to_string();
        self.call(|reply| Command::GetFlow { topic, reply }).await
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

    /// Copies the data directory's commit log up to now, and the receipt key, into `to` (absolute,
    /// absent or empty, outside the data directory) while the broker runs (see `storage::backup`).
    pub async fn backup(&self, to: std::path::PathBuf) -> Result<crate::storage::backup::BackupReport> {
        let started = std::time::Instant::now();
        let cut = self.call(|reply| Command::BackupCut { started, reply }).await?;
        let report = tokio::task::spawn_blocking(move || crate::storage::backup::write(cut, &to))
            .await
            .map_err(|e| Error::Unavailable(format!("the backup stopped: {e}")))??;
        info!(
            to = %report.to,
            files = report.files,
            bytes = report.bytes,
            log_end = report.log_end,
            took_ms = report.took_ms,
            "backup written"
        );
        Ok(report)
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

#[cfg(test)]
#[path = "../broker_tests.rs"]
mod tests;
