//! The engine thread and the step it runs: requests, due timers, maintenance, the commit, long-poll
//! wake-ups and checkpoints, on the engine thread or (one request) inline on the caller's thread.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::{error, info};

use super::command::{Command, Pending, WalkOp};
use super::step_timer::StepTimer;
use super::Shared;
use crate::config::FlushMode;
use crate::engine::Engine;
use crate::error::Result;
use crate::message::{ProduceRequest, Produced};
use crate::metrics::Metrics;
use crate::schedule::clock::Clock;
use crate::storage::durability::{Durability, Failure, FailureLog};
use crate::storage::store::Wake;
use crate::storage::writer::{CheckpointDone, Driver, Writer, WriterConfig};

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

/// How long timers and reclaim wait before trying again after a write failed for lack of a
/// resource (disk space, file handles).
const RETRY_AFTER_TROUBLE: Duration = Duration::from_secs(1);
/// How often a failure that goes on is logged again.
const REMIND_EVERY: Duration = Duration::from_secs(60);

/// The engine and what it needs between steps: requests taken and not yet applied, replies
/// waiting for a flush, the flusher and checkpoint threads.
pub(super) struct Core {
    pub(super) engine: Engine,
    clock: Arc<dyn Clock>,
    shared: std::sync::Weak<Shared>,
    durability: Durability,
    /// Requests taken off the channel and not yet applied (a step stops at its time budget).
    pub(super) batch: std::collections::VecDeque<Command>,
    /// A produce batch cut by the end of a step: applied first in the next one.
    producing: Option<Producing>,
    /// Replies owed for what the step applied, handed to the writer's commit.
    pending: Vec<Pending>,
    pub(super) metrics: Arc<Metrics>,
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
    pub(super) sleeping_until: Option<Instant>,
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
pub(super) fn run_engine(core: Arc<Mutex<Option<Core>>>, rx: flume::Receiver<Command>) {
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
    pub(super) fn start(
        engine: Engine,
        clock: Arc<dyn Clock>,
        flush: FlushMode,
        flush_every: Duration,
        shared: std::sync::Weak<Shared>,
        metrics: Arc<Metrics>,
        conditions: Vec<Box<dyn crate::storage::writer::Condition>>,
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
            conditions,
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
        self.commit(None);
        step.mark("commit");
        self.notify();
        step.mark("notify");
        if self.shutdown.is_some() {
            return true;
        }
        self.checkpoint();
        step.mark("checkpoint");
        step.record(&self.metrics, self.engine.take_index_resize_time());
        false
    }

    /// True when nothing is taken and unapplied, no reply waits, and (in sync mode) no flush is
    /// in flight: a request applied now is answered by this step alone.
    pub(super) fn idle(&self) -> bool {
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
    pub(super) fn step_inline(&mut self, may_block: bool) -> bool {
        let mut step = StepTimer::start(false);
        let log_end = self.engine.log_end();
        self.apply_requests(step.started + REQUESTS_UNTIL);
        step.mark("requests");
        self.commit(Some(may_block));
        step.mark("commit");
        self.notify();
        step.mark("notify");
        step.record(&self.metrics, self.engine.take_index_resize_time());
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

    /// The lone batch `step_inline` left for its thread to sync after letting go of the lock.
    pub(super) fn take_outside(&mut self) -> Option<crate::storage::writer::LoneSync<Pending>> {
        self.writer.take_outside()
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
                // A cluster node that does not lead fires no timers: the leader's records do that
                // here (the raft thread wakes the engine when entries arrive).
                None if !self.engine.may_act() => {}
                None => {
                    if let Some(due) = self.engine.next_due() {
                        let now_us = self.engine.fire_now_us().unwrap_or_else(|| self.clock.now_us());
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
        let mut first = true;
        loop {
            if !first && Instant::now() >= until {
                return;
            }
            first = false;
            if let Some(p) = self.producing.take() {
                self.produce_chunk(p);
                continue;
            }
            let Some(cmd) = self.batch.pop_front() else { return };
            if self.apply_command(cmd).is_break() {
                return;
            }
        }
    }

    /// Applies the next chunk of a produce batch: kept for the next round while requests are
    /// left, else its reply waits for the commit.
    fn produce_chunk(&mut self, mut p: Producing) {
        let engine = &mut self.engine;
        p.done.extend(p.reqs.by_ref().take(PRODUCE_CHUNK).map(|req| engine.produce(&p.topic, req)));
        if p.reqs.len() > 0 {
            self.producing = Some(p);
        } else {
            self.pending.push(Pending::Produce(p.reply, Ok(p.done)));
        }
    }

    /// Applies one request: a change's reply waits for the commit, a read is answered at once, and
    /// a shutdown ends the batch (`Break`).
    fn apply_command(&mut self, cmd: Command) -> ControlFlow<()> {
        let engine = &mut self.engine;
        // A cluster node appends only what the leader sends it: a change that reached it anyway
        // (it lost the lead after the request was routed here) is refused, never applied.
        let cmd = if engine.may_act() {
            cmd
        } else {
            match cmd.refuse_change("this node is not the cluster's leader; retry on the leader") {
                Some(read) => read,
                None => return ControlFlow::Continue(()),
            }
        };
        match cmd {
            Command::Produce { topic, reqs, reply } => {
                let done = Vec::with_capacity(reqs.len());
                self.producing = Some(Producing { topic, reqs: reqs.into_iter(), done, reply });
            }
            Command::Pop { topics, max, ttr_ms, reply } => {
                self.pending.push(Pending::Pop(reply, engine.pop_flow(&topics, max, ttr_ms)))
            }
            Command::Ack { receipt, reply } => self.pending.push(Pending::Unit(reply, engine.ack(&receipt))),
            Command::AckId { id, reply } => self.pending.push(Pending::Unit(reply, engine.ack_id(&id))),
            Command::Nack { receipt, delay_ms, error, reply } => {
                let nacked = engine.nack_with_error(&receipt, delay_ms, error.as_deref());
                self.pending.push(Pending::Nack(reply, nacked))
            }
            Command::Cancel { id, reply } => self.pending.push(Pending::Unit(reply, engine.cancel(&id))),
            Command::Touch { receipt, ttr_ms, reply } => {
                self.pending.push(Pending::Touch(reply, engine.touch(&receipt, ttr_ms)))
            }
            Command::Reschedule { id, req, reply } => {
                self.pending.push(Pending::Reschedule(reply, engine.reschedule(&id, &req)))
            }
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
            Command::SetFlow { topic, cfg, reply } => {
                self.pending.push(Pending::Unit(reply, engine.set_flow(&topic, cfg.as_ref())))
            }
            Command::GetFlow { topic, reply } => {
                let _ = reply.send(engine.flow_of(&topic));
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
            Command::BackupCut { started, reply } => {
                let _ = reply.send(engine.backup_cut(started));
            }
            Command::Shutdown { reply } => {
                // Requests behind it are dropped (their callers see the broker stopped).
                self.shutdown = Some(reply);
                self.batch.clear();
                return ControlFlow::Break(());
            }
            Command::Wake => {}
        }
        ControlFlow::Continue(())
    }

    /// Fires due timers until `until` (some, at least); after a failure, waits before trying
    /// again and logs it once.
    fn fire_timers(&mut self, until: Instant) {
        if self.durability.is_poisoned() || self.timers_retry_at.is_some() || !self.engine.may_act() {
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
        // A cluster node that does not lead still expires and deletes (reclaim appends nothing
        // there: see `Store::may_act`); the leader's Carries arrive replicated.
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
    /// commit call: on the engine thread (`inline` None) or on a request's own thread (`Some`,
    /// whether it may block on an fdatasync).
    fn commit(&mut self, inline: Option<bool>) {
        let stopping = self.shutdown.is_some();
        // Whether nothing waits behind this step is asked once the store sealed the log: a
        // follower's entries are appended there. The writer's cheap checks come first: the
        // channel's length takes its lock, which every request sender contends for, so it is
        // asked only when a lone batch is possible at all.
        let nothing_taken = self.batch.is_empty() && self.producing.is_none();
        let shared = &self.shared;
        self.engine.commit(&mut self.writer, &mut self.pending, |writer, replies, end| {
            let alone = || {
                nothing_taken
                    && writer.lone_batch_possible(replies, end)
                    && shared.upgrade().map_or(0, |s| s.tx.len()) == 0
            };
            match inline {
                _ if stopping => Driver::Stopping,
                None => Driver::Engine { alone: alone() },
                Some(may_block) => Driver::Inline { may_block, alone: alone() },
            }
        });
    }

    /// Wakes long-polls waiting on topics that got entries.
    fn notify(&mut self) {
        let touched = self.engine.take_touched();
        if touched.is_empty() {
            return;
        }
        if let Some(shared) = self.shared.upgrade() {
            let w = shared.waiters.lock().unwrap_or_else(|p| p.into_inner());
            for (t, wake) in touched {
                let Some(n) = w.get(&t) else { continue };
                match wake {
                    // One waiting pop per new entry. Waking every one sent them all to the engine
                    // for a message only one could get: at 1,000 msgs/s with 16 consumers the
                    // engine was asked four times as often, a sixth of the server's CPU. A woken
                    // pop that goes away passes its wake-up on (tokio's Notify), so none is lost.
                    Wake::Entries(k) if k < WAKE_ONE_BY_ONE => (0..k).for_each(|_| n.notify_one()),
                    Wake::Entries(_) | Wake::All => n.notify_waiters(),
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

/// Entries that arrive together in at least this number wake every pop waiting on their topic at
/// once: each can get some, and one notification per entry would cost more than the herd.
const WAKE_ONE_BY_ONE: u32 = 64;

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
