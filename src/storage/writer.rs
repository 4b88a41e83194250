//! The write path's durable half: group commit, the flusher and checkpoint threads, and the one
//! call, [`Writer::commit`], that turns records appended to the log into answered requests.
//!
//! The engine appends records (each append is dispatched at once, so reads see their own writes)
//! and collects the replies those records owe. It then calls `commit` once per step, whichever
//! thread drives it (the engine thread or a request's own thread, inline): the writer decides how
//! the step's records become durable (an fdatasync on this thread, a job for the flusher, or the
//! periodic flush in `async` mode) and releases the replies when they are, or with the failure
//! that poisoned the store. Nothing is released ahead of durability, and after a failed sync
//! nothing is released as a success again.
//!
//! Durability is a list of [`Condition`]s a batch must meet, checked in order on the flusher
//! thread. Today the list is the local fdatasync ([`LocalSync`]); a replicated store adds "durable
//! on a majority" as a second condition (its `reach` waits until a majority reports the batch's
//! end offset synced), and every caller keeps making the same one call.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{debug, error};

use super::checkpoint::{Captured, Checkpoint, CheckpointJob};
use super::commitlog::CommitLog;
use super::durability::{Durability, Failure};
use super::mmap::SyncFile;
use crate::error::{Error, Result};

/// A batch of at most this many replies and bytes may be flushed on the thread that applied it.
const LONE_MAX_REPLIES: usize = 2;
/// See [`LONE_MAX_REPLIES`].
const LONE_MAX_BYTES: u64 = 64 << 10;
/// Records that owe no reply (timers firing, hops, upkeep) may wait this many bytes for a sync
/// that someone waits on; past it they are flushed in the background at once.
const DEFER_MAX_BYTES: u64 = 32 << 10;
/// Batches the engine may hand the flusher before it waits for the disk: when the disk falls
/// behind, the engine slows down instead of queueing without limit.
const FLUSH_QUEUE: usize = 64;
/// How often queue lengths and cursors are persisted. Each checkpoint fdatasyncs the id index,
/// whose random slot writes dirty most of its pages under load; every 5 s rather than every 1 s
/// cut the flush latency of a sustained 64-writer sync load by a fifth (554 -> 454 us) here, and
/// costs at most 5 s of records to re-dispatch after a crash.
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(5);

/// How appends become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlushMode {
    /// A write is acknowledged only after its bytes are on disk (group commit).
    Sync,
    /// A background flush every `flush_interval_ms`; a crash of the machine may lose that window.
    Async,
}

/// A reply owed for records appended: released once they are durable, or with the failure.
pub trait Release: Send + 'static {
    /// Answers the request; `failure` set means its records may not be durable.
    fn release(self, failure: Option<&Error>);
}

/// Something a batch of records must reach before its replies are released.
pub trait Condition: Send + 'static {
    /// Blocks until the log is durable under this condition up to `end`; `paths` are the segment
    /// files holding the batches being released. An error releases them with it. `owed` is false
    /// when the batches owe no reply: a condition need not wait for them then (a replicated one
    /// must not: its wait could depend on a later batch this one holds back).
    fn reach(&mut self, paths: &[&PathBuf], end: u64, owed: bool) -> Result<()>;

    /// Whether this condition can take a batch's replies and release them itself once met (see
    /// [`Condition::defer`]).
    fn defers(&self) -> bool {
        false
    }

    /// Takes the release of an owed batch ending at `end`, to run once this condition is met or
    /// with why it cannot be, on whichever thread learns it; no thread waits meanwhile. Gives it
    /// back when this condition cannot defer (`reach` is then called).
    fn defer(&mut self, _end: u64, release: Deferred) -> Option<Deferred> {
        Some(release)
    }
}

/// A batch's replies, released by whoever meets a deferred condition (see [`Condition::defer`]).
pub type Deferred = Box<dyn FnOnce(Option<&Error>) + Send>;

/// The replies as one release.
fn deferred<R: Release>(replies: Vec<R>) -> Deferred {
    Box::new(move |failure| replies.into_iter().for_each(|r| r.release(failure)))
}

/// Who is committing, and what may wait on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    /// The engine thread, which also runs the periodic `async` flush.
    Engine {
        /// Nothing is queued behind this step (no request waiting, none half applied).
        alone: bool,
    },
    /// A request's own thread, applying it inline.
    Inline {
        /// The thread may block on an fdatasync (a lone small batch is then synced right here).
        may_block: bool,
        /// Nothing is queued behind this step.
        alone: bool,
    },
    /// The engine is stopping: the `async` window is flushed now.
    Stopping,
}

/// What the writer is told when it starts.
pub struct WriterConfig {
    /// `sync` or `async`.
    pub flush: FlushMode,
    /// The `async` flush period.
    pub flush_every: Duration,
    /// Called with the length of each log sync (for the flush-latency histogram).
    pub on_flush: Arc<dyn Fn(Duration) + Send + Sync>,
}

/// A batch's replies, released once the log is durable up to `end`.
struct SyncJob<R> {
    /// Segment files holding the batch's records.
    paths: Vec<PathBuf>,
    /// Log offset one past the batch.
    end: u64,
    replies: Vec<R>,
}

/// A checkpoint job's outcome, sent back to the engine.
pub struct CheckpointDone {
    /// The checkpoint written (or not).
    pub checkpoint: Checkpoint,
    /// What its files' syncs covered.
    pub captured: Captured,
    /// Whether it was written.
    pub result: Result<()>,
}

/// The store's write path: see the module documentation.
pub struct Writer<R: Release> {
    flush: FlushMode,
    /// Conditions past the local sync exist: every batch that owes replies goes through the
    /// flusher.
    replicated: bool,
    /// Whether a batch's conditions include the local sync (all but a cluster's `async`).
    syncs: bool,
    /// The last condition releases replies itself (a cluster's majority): a lone batch that owes
    /// replies is then synced on the committing thread, with no thread left waiting on it.
    defers: bool,
    /// The batches' durability conditions, run by the flusher, or on the committing thread for a
    /// cluster batch that owes no reply while the flusher is idle.
    conditions: Arc<Mutex<Conditions>>,
    flush_every: Duration,
    durability: Durability,
    on_flush: Arc<dyn Fn(Duration) + Send + Sync>,
    /// `None` when the flusher thread could not start: every batch is then synced inline.
    sync_tx: Option<SyncSender<SyncJob<R>>>,
    flusher: Option<JoinHandle<()>>,
    /// Batches handed to the flusher (or synced outside the engine's lock) and not yet released.
    in_flight: Arc<AtomicUsize>,
    /// Set while a lone batch waits to be synced outside the engine's lock: the flusher holds
    /// every later batch back until it is, so batches become durable, and are answered, in log
    /// order.
    outside: Arc<Outside>,
    /// The lone batch just committed inline, for its thread to sync once it let go of the
    /// engine's lock ([`Writer::take_outside`]).
    lone: Option<LoneSync<R>>,
    /// Log offset up to which appends were handed to a flush.
    handed_off: u64,
    /// `sync` mode: since when records that owe no reply have waited, unsynced, for the next
    /// batch that does (which covers them) or for `flush_every` to pass.
    deferred: Option<Instant>,
    /// Log end after the last batch deferred that way.
    deferred_end: u64,
    last_flush: Instant,
    cp_tx: Option<SyncSender<CheckpointJob>>,
    /// Durable checkpoints come back to the engine: only then may reclaim delete what they replace.
    cp_done: Receiver<CheckpointDone>,
    cp_busy: Arc<AtomicBool>,
    checkpointer: Option<JoinHandle<()>>,
    last_checkpoint: Instant,
    /// Log end at the last checkpoint captured (`u64::MAX`: none, or the last one failed).
    checkpointed_end: u64,
}

impl<R: Release> Writer<R> {
    /// A writer for a log that ends at `log_end`, with its flusher and checkpoint threads started.
    /// `more` are durability conditions checked after the local sync (none on a single node).
    pub fn start(
        cfg: WriterConfig,
        durability: Durability,
        log_end: u64,
        more: Vec<Box<dyn Condition>>,
    ) -> Self {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let outside = Arc::new(Outside::default());
        let (sync_tx, sync_rx) = std::sync::mpsc::sync_channel::<SyncJob<R>>(FLUSH_QUEUE);
        // Every batch must meet every condition: a replicated store never answers from the
        // inline lone-batch sync (which meets only the local one). In a cluster `async` leaves
        // the local sync to the periodic flush, and waits only for a majority to have the batch
        // (each node flushing as its writer does: appended there, not yet synced).
        let replicated = !more.is_empty();
        let mut conditions: Vec<Box<dyn Condition>> = Vec::new();
        let syncs = !(replicated && cfg.flush == FlushMode::Async);
        if syncs {
            conditions.push(Box::new(LocalSync::new(durability.clone())));
        }
        conditions.extend(more);
        let defers = replicated && conditions.last().is_some_and(|c| c.defers());
        let conditions = Arc::new(Mutex::new(Conditions { list: conditions, durability: durability.clone() }));
        let flusher = Flusher {
            syncs,
            conditions: conditions.clone(),
            on_flush: cfg.on_flush.clone(),
            in_flight: in_flight.clone(),
            outside: outside.clone(),
        };
        let flusher =
            std::thread::Builder::new().name("delayd-flusher".into()).spawn(move || flusher.run(sync_rx));
        let (sync_tx, flusher) = match flusher {
            Ok(h) => (Some(sync_tx), Some(h)),
            Err(e) => {
                error!(error = %e, "could not start the flusher thread; flushing inline");
                (None, None)
            }
        };
        let (cp_tx, cp_rx) = std::sync::mpsc::sync_channel::<CheckpointJob>(1);
        let (done_tx, cp_done) = std::sync::mpsc::channel::<CheckpointDone>();
        // A captured job's files count as synced only once it reports success, and the next job is
        // captured only when it is done.
        let cp_busy = Arc::new(AtomicBool::new(false));
        let checkpointer = {
            let busy = cp_busy.clone();
            std::thread::Builder::new()
                .name("delayd-checkpoint".into())
                .spawn(move || run_checkpointer(cp_rx, done_tx, busy))
        };
        let (cp_tx, checkpointer) = match checkpointer {
            Ok(h) => (Some(cp_tx), Some(h)),
            Err(e) => {
                error!(error = %e, "could not start the checkpoint thread; checkpointing inline");
                (None, None)
            }
        };
        Writer {
            flush: cfg.flush,
            replicated,
            syncs,
            defers,
            conditions,
            flush_every: cfg.flush_every,
            durability,
            on_flush: cfg.on_flush,
            sync_tx,
            flusher,
            in_flight,
            outside,
            lone: None,
            handed_off: log_end,
            deferred: None,
            deferred_end: log_end,
            last_flush: Instant::now(),
            cp_tx,
            cp_done,
            cp_busy,
            checkpointer,
            last_checkpoint: Instant::now(),
            checkpointed_end: u64::MAX,
        }
    }

    /// The one commit call: everything appended to `log` so far becomes durable as the flush mode
    /// says, and `replies` (drained) are released when it is, or with the failure. In `sync` mode
    /// the syncs go to the flusher, so the engine never stops for an fdatasync (5-70 ms now and
    /// then on a busy disk, however little it writes); only a lone small batch, with nothing queued
    /// or in flight, is synced on this thread, where a thread wake-up would cost a lone writer a
    /// third of its throughput.
    pub fn commit(&mut self, log: &mut CommitLog, replies: &mut Vec<R>, driver: Driver) {
        let end = log.end();
        if self.flush == FlushMode::Async {
            let periodic = match driver {
                Driver::Engine { .. } => self.last_flush.elapsed() >= self.flush_every,
                Driver::Stopping => true,
                // The periodic flush is the engine thread's.
                Driver::Inline { .. } => false,
            };
            if periodic {
                if !self.durability.is_poisoned() {
                    let _ = self.sync_here(log);
                }
                self.last_flush = Instant::now();
            }
            // A cluster still answers only once a majority has the batch: the flusher waits
            // for that (and syncs nothing itself).
            if !self.replicated {
                replies.drain(..).for_each(|r| r.release(None));
                return;
            }
        }
        // Records that owe no reply (a timer fired, a hop, upkeep) need no sync of their own in
        // `sync` mode: lost to a crash, they are done again (a due timer fires again, never
        // early), and the next batch that owes a reply covers them, since a sync covers the
        // whole log before its end. Syncing them on their own put an fdatasync between a timer
        // falling due and the pops it wakes, and a second one in those pops' way. They wait at
        // most `flush_every` (or [`DEFER_MAX_BYTES`]), then go to the flusher.
        let stopping = driver == Driver::Stopping;
        let expired = self.deferred.is_some_and(|since| since.elapsed() >= self.flush_every);
        if self.flush == FlushMode::Sync
            && !self.replicated
            && !stopping
            && !expired
            && replies.is_empty()
            && end > self.handed_off
            && end - self.handed_off <= DEFER_MAX_BYTES
        {
            self.deferred.get_or_insert_with(Instant::now);
            self.deferred_end = end;
            return;
        }
        let covered = match self.deferred {
            Some(_) if !expired && !stopping => self.deferred_end,
            _ => self.handed_off,
        };
        if end <= covered {
            // Nothing appended: answer now, unless a sync on another thread failed meanwhile.
            let failure = self.durability.check().err();
            replies.drain(..).for_each(|r| r.release(failure.as_ref()));
            return;
        }
        self.deferred = None;
        let lone = match driver {
            // On a single node a batch that owes no reply is synced by the flusher: no thread
            // waits on it, so the engine thread need not stop for it.
            _ if replies.is_empty() && !self.replicated && !stopping => false,
            Driver::Engine { alone } | Driver::Inline { may_block: true, alone } => {
                alone && self.lone_small_batch(replies.len(), end)
            }
            Driver::Inline { may_block: false, .. } => false,
            Driver::Stopping => true,
        };
        if self.replicated {
            // A cluster batch that owes no reply (a follower's appends of the leader's entries)
            // meets its conditions here when nothing else is being flushed: the hand-off to the
            // flusher thread and back is most of a follower's part in a lone write's latency.
            // One that owes replies never does: the majority condition may wait for seconds.
            if lone && replies.is_empty() {
                let paths = log.paths(self.handed_off, end);
                let started = Instant::now();
                let paths: Vec<&PathBuf> = paths.iter().collect();
                let failure = lock(&self.conditions).reach(&paths, end, false).err();
                if self.syncs && failure.is_none() {
                    (self.on_flush)(started.elapsed());
                }
                self.handed_off = end;
                return;
            }
            // A lone batch that owes replies: synced here as well, its replies handed to the
            // majority condition, released by the thread that learns a majority has it. The
            // flusher would cost two thread hand-offs more (to it, and from the link's reader
            // back to it), the largest share of a lone replicated write's time.
            if lone && self.defers {
                let paths = log.paths(self.handed_off, end);
                let paths: Vec<&PathBuf> = paths.iter().collect();
                let started = Instant::now();
                lock(&self.conditions).settle(&paths, end, deferred(std::mem::take(replies)));
                if self.syncs {
                    (self.on_flush)(started.elapsed());
                }
                self.handed_off = end;
                return;
            }
        }
        let lone = lone && !self.replicated;
        match self.sync_tx.as_ref() {
            Some(tx) if !lone => {
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                let job =
                    SyncJob { paths: log.paths(self.handed_off, end), end, replies: std::mem::take(replies) };
                if let Err(std::sync::mpsc::SendError(job)) = tx.send(job) {
                    self.in_flight.fetch_sub(1, Ordering::AcqRel);
                    let e = self.durability.poison(Failure::new("hand off", "commit log", "flusher stopped"));
                    job.replies.into_iter().for_each(|r| r.release(Some(&e)));
                }
            }
            // No flusher thread (it could not be started): a cluster's batch still meets every
            // condition before its replies go, the majority wait included, here.
            None if self.replicated => {
                let paths = log.paths(self.handed_off, end);
                let paths: Vec<&PathBuf> = paths.iter().collect();
                let failure = lock(&self.conditions).reach(&paths, end, !replies.is_empty()).err();
                replies.drain(..).for_each(|r| r.release(failure.as_ref()));
            }
            // A lone request applied inline: its thread syncs it once it let go of the engine's
            // lock (`take_outside`), so a timer falling due or a request arriving meanwhile is not
            // held up by this batch's fdatasync (0.1 ms mostly, but 3 to 50 ms in a slow
            // window of the disk, when the engine thread waited for it).
            Some(_) if matches!(driver, Driver::Inline { may_block: true, .. }) && !replies.is_empty() => {
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                self.outside.hold();
                self.lone = Some(LoneSync {
                    conditions: self.conditions.clone(),
                    outside: self.outside.clone(),
                    in_flight: self.in_flight.clone(),
                    on_flush: self.on_flush.clone(),
                    job: SyncJob {
                        paths: log.paths(self.handed_off, end),
                        end,
                        replies: std::mem::take(replies),
                    },
                    finished: false,
                });
            }
            _ => {
                let failure = self.sync_here(log).err();
                // A sync on another thread may have failed: nothing is answered after that.
                let failure = failure.or_else(|| self.durability.check().err());
                replies.drain(..).for_each(|r| r.release(failure.as_ref()));
            }
        }
        self.handed_off = end;
    }

    /// The lone batch the last inline commit left to its thread: sync it with [`LoneSync::run`]
    /// after letting go of the engine's lock. Later batches wait for it at the flusher.
    pub fn take_outside(&mut self) -> Option<LoneSync<R>> {
        self.lone.take()
    }

    /// Whether a commit of `replies` answers for a log ending at `end` could be synced on the
    /// committing thread (`sync` mode, a small batch, nothing in flight): the cheap half of the
    /// lone-batch rule, so a driver asks whether anything is queued behind it (which takes the
    /// request channel's lock) only when the answer matters.
    pub fn lone_batch_possible(&self, replies: usize, end: u64) -> bool {
        (self.flush == FlushMode::Sync || self.replicated)
            && (!self.replicated || replies == 0 || self.defers)
            && end > self.handed_off
            && self.lone_small_batch(replies, end)
    }

    /// True when the batch is small and nothing is being flushed: syncing it on this thread
    /// delays nobody.
    fn lone_small_batch(&self, replies: usize, end: u64) -> bool {
        replies <= LONE_MAX_REPLIES
            && end - self.handed_off <= LONE_MAX_BYTES
            && self.in_flight.load(Ordering::Acquire) == 0
    }

    /// Syncs the log on this thread, through the log's own files.
    fn sync_here(&mut self, log: &mut CommitLog) -> Result<()> {
        let started = Instant::now();
        if sync_log(log, &self.durability)? {
            (self.on_flush)(started.elapsed());
        }
        Ok(())
    }

    /// True when no batch waits on the flusher (always in `async` mode): a request applied now is
    /// answered by its own step.
    pub fn settled(&self) -> bool {
        (self.flush == FlushMode::Async && !self.replicated) || self.in_flight.load(Ordering::Acquire) == 0
    }

    /// How long until the writer has work of its own: the next checkpoint, in `async` mode the
    /// next periodic flush of a dirty log, in `sync` mode the flush of records deferred since.
    pub fn next_work(&self, dirty: bool) -> Duration {
        let mut wait = CHECKPOINT_EVERY.saturating_sub(self.last_checkpoint.elapsed());
        if self.flush == FlushMode::Async && dirty {
            wait = wait.min(self.flush_every.saturating_sub(self.last_flush.elapsed()));
        }
        if let Some(since) = self.deferred {
            wait = wait.min(self.flush_every.saturating_sub(since.elapsed()));
        }
        wait
    }

    /// True when a checkpoint should be captured now: its period passed, the log moved since the
    /// last one, the store is healthy and no checkpoint is still being written. Restarts the
    /// period either way.
    pub fn checkpoint_due(&mut self, log_end: u64) -> bool {
        if self.last_checkpoint.elapsed() < CHECKPOINT_EVERY {
            return false;
        }
        self.last_checkpoint = Instant::now();
        // An idle broker has nothing new to record: skip the fsyncs. (A pop that only skipped
        // stale entries moves a cursor without an append; it is saved with the next change.)
        // A poisoned one must not record anything: its files' state is unknown.
        if log_end == self.checkpointed_end || self.durability.is_poisoned() {
            return false;
        }
        // If the last one is still running, this round is skipped rather than stalling the
        // schedulers.
        if self.cp_busy.load(Ordering::Acquire) {
            debug!("previous checkpoint still running; skipped");
            return false;
        }
        true
    }

    /// Hands a captured checkpoint to the checkpoint thread (which syncs the files it covers and
    /// writes it); runs it here when there is no such thread. What it covers ends at `log_end`.
    pub fn checkpoint(&mut self, job: CheckpointJob, log_end: u64) -> Option<CheckpointDone> {
        self.checkpointed_end = log_end;
        self.cp_busy.store(true, Ordering::Release);
        let job = match &self.cp_tx {
            None => job,
            Some(tx) => match tx.try_send(job) {
                Ok(()) => return None,
                Err(
                    std::sync::mpsc::TrySendError::Full(job)
                    | std::sync::mpsc::TrySendError::Disconnected(job),
                ) => job,
            },
        };
        self.cp_busy.store(false, Ordering::Release);
        let (checkpoint, captured) = (job.checkpoint.clone(), job.captured.clone());
        let result = job.run();
        Some(CheckpointDone { checkpoint, captured, result })
    }

    /// Checkpoints the checkpoint thread finished since the last call.
    pub fn checkpoints_done(&mut self) -> Vec<CheckpointDone> {
        let done: Vec<CheckpointDone> = self.cp_done.try_iter().collect();
        // A failed one is captured again, with everything since, at the next round.
        if done.iter().any(|d| d.result.is_err()) {
            self.checkpointed_end = u64::MAX;
        }
        done
    }

    /// Stops the flusher (after it released what it holds) and the checkpoint thread; returns the
    /// checkpoints that finished meanwhile.
    pub fn stop(&mut self) -> Vec<CheckpointDone> {
        self.sync_tx.take();
        if let Some(h) = self.flusher.take() {
            let _ = h.join();
        }
        self.cp_tx.take();
        if let Some(h) = self.checkpointer.take() {
            let _ = h.join();
        }
        self.checkpoints_done()
    }
}

/// Makes every record appended to `log` durable on this thread, through the log's own files;
/// false when there was nothing to sync. Refused once the store is poisoned; a failed sync
/// poisons it in the io layer, and any other failure (opening a file) poisons it here, since the
/// flush's outcome is unknown.
pub fn sync_log(log: &mut CommitLog, durability: &Durability) -> Result<bool> {
    durability.check()?;
    if durability.log_durable() >= log.end() {
        return Ok(false);
    }
    if let Err(e) = log.flush() {
        return Err(match durability.check() {
            Err(refusal) => refusal,
            Ok(()) => durability.poison(Failure::from_error(&e)),
        });
    }
    Ok(true)
}

/// The group-commit flusher: syncs the log for every batch handed to it, coalescing batches that
/// queued up meanwhile, then releases their replies. Running it beside the engine lets the engine
/// apply the next batch while the disk works on the previous one.
struct Flusher {
    /// Whether the batches are synced here (not in a cluster's `async` mode).
    syncs: bool,
    conditions: Arc<Mutex<Conditions>>,
    on_flush: Arc<dyn Fn(Duration) + Send + Sync>,
    in_flight: Arc<AtomicUsize>,
    outside: Arc<Outside>,
}

impl Flusher {
    fn run<R: Release>(self, rx: Receiver<SyncJob<R>>) {
        while let Ok(first) = rx.recv() {
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            let started = Instant::now();
            let replies: Vec<R> = jobs.iter_mut().flat_map(|j| std::mem::take(&mut j.replies)).collect();
            let mut paths: Vec<&PathBuf> = jobs.iter().flat_map(|j| &j.paths).collect();
            paths.sort();
            paths.dedup();
            let end = jobs.iter().map(|j| j.end).max().unwrap_or(0);
            let n = jobs.len();
            {
                // A lone batch committed before these and being synced outside the engine's lock
                // comes first: nothing is answered before what precedes it in the log is durable.
                self.outside.wait();
                let mut conditions = lock(&self.conditions);
                if replies.is_empty() {
                    let _ = conditions.reach(&paths, end, false);
                } else {
                    conditions.settle(&paths, end, deferred(replies));
                }
            }
            if self.syncs {
                (self.on_flush)(started.elapsed());
            }
            self.in_flight.fetch_sub(n, Ordering::AcqRel);
        }
    }
}

/// Whether a lone batch is waiting to be synced outside the engine's lock.
#[derive(Default)]
struct Outside {
    pending: Mutex<bool>,
    done: std::sync::Condvar,
}

impl Outside {
    fn hold(&self) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = true;
    }

    fn release(&self) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.done.notify_all();
    }

    /// Blocks while a lone batch is pending.
    fn wait(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while *pending {
            pending = self.done.wait(pending).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A lone batch committed inline, synced and answered by its own thread after it let go of the
/// engine's lock.
pub struct LoneSync<R: Release> {
    conditions: Arc<Mutex<Conditions>>,
    outside: Arc<Outside>,
    in_flight: Arc<AtomicUsize>,
    on_flush: Arc<dyn Fn(Duration) + Send + Sync>,
    job: SyncJob<R>,
    finished: bool,
}

impl<R: Release> LoneSync<R> {
    /// Syncs the batch (every condition, as the flusher would) and releases its replies.
    pub fn run(mut self) {
        let started = Instant::now();
        let replies = std::mem::take(&mut self.job.replies);
        let paths: Vec<&PathBuf> = self.job.paths.iter().collect();
        lock(&self.conditions).settle(&paths, self.job.end, deferred(replies));
        (self.on_flush)(started.elapsed());
        self.finish();
    }

    fn finish(&mut self) {
        if !std::mem::replace(&mut self.finished, true) {
            self.outside.release();
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl<R: Release> Drop for LoneSync<R> {
    fn drop(&mut self) {
        // A batch dropped unrun (its thread panicked) must not hold the flusher back forever;
        // its replies are dropped with it, so their requests fail.
        self.finish();
    }
}

/// A batch's durability conditions, in order.
struct Conditions {
    list: Vec<Box<dyn Condition>>,
    durability: Durability,
}

impl Conditions {
    /// Every condition, in order; then a last look at the store's health, since another thread's
    /// sync may have failed meanwhile and nothing is acknowledged after that.
    fn reach(&mut self, paths: &[&PathBuf], end: u64, owed: bool) -> Result<()> {
        for c in &mut self.list {
            c.reach(paths, end, owed)?;
        }
        self.durability.check()
    }

    /// Every condition of a batch that owes replies, in order, the last one deferred when it can
    /// be (see [`Condition::defer`]): `release` runs once all are met, or with the first failure.
    fn settle(&mut self, paths: &[&PathBuf], end: u64, release: Deferred) {
        let durability = self.durability.clone();
        let Some((last, first)) = self.list.split_last_mut() else {
            return release(durability.check().err().as_ref());
        };
        for c in first {
            if let Err(e) = c.reach(paths, end, true) {
                return release(Some(&e));
            }
        }
        // A sync on another thread may fail while the batch waits: nothing is acknowledged
        // after that, whoever releases it.
        let release: Deferred = Box::new(move |failure: Option<&Error>| {
            let late = if failure.is_none() { durability.check().err() } else { None };
            release(failure.or(late.as_ref()))
        });
        let Some(release) = last.defer(end, release) else { return };
        let failure = last.reach(paths, end, true).err();
        release(failure.as_ref())
    }
}

/// Locks the conditions (a panic elsewhere leaves them usable: each reach starts afresh).
fn lock(c: &Mutex<Conditions>) -> std::sync::MutexGuard<'_, Conditions> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// The local condition: fdatasyncs the segment files through open file descriptions of its own (a
/// writeback error is reported once per description, so sharing one with another thread could
/// hide it), and records the log offset made durable.
pub struct LocalSync {
    durability: Durability,
    own: Vec<SyncFile>,
}

impl LocalSync {
    /// A syncer reporting to `durability`.
    pub fn new(durability: Durability) -> LocalSync {
        LocalSync { durability, own: Vec::new() }
    }
}

impl Condition for LocalSync {
    /// Syncs every segment in `paths` (the only ones still written: descriptions of others are
    /// closed, as reclaim may delete them). An error means nothing up to `end` may be
    /// acknowledged: the store is poisoned (a failed sync), or a file could not be opened (out of
    /// handles: nothing is lost, the next sync covers it).
    fn reach(&mut self, paths: &[&PathBuf], end: u64, _owed: bool) -> Result<()> {
        self.durability.check()?;
        self.own.retain(|f| paths.iter().any(|p| p.as_path() == f.path()));
        for path in paths {
            let at = match self.own.iter().position(|f| f.path() == path.as_path()) {
                Some(i) => i,
                None => match SyncFile::open(path, &self.durability) {
                    Ok(f) => {
                        self.own.push(f);
                        self.own.len() - 1
                    }
                    Err(e) => {
                        self.durability.note_trouble(Failure::from_error(&e));
                        return Err(Error::Unavailable(e.to_string()));
                    }
                },
            };
            if let Err(e) = self.own[at].sync_data() {
                return Err(self.durability.check().err().unwrap_or(Error::Unavailable(e.to_string())));
            }
        }
        self.durability.check()?;
        self.durability.log_synced(end);
        Ok(())
    }
}

/// The checkpoint thread: syncs the files a checkpoint covers (its own descriptions), writes it,
/// and reports back; the engine counts the files synced only when the job succeeded.
fn run_checkpointer(
    rx: Receiver<CheckpointJob>,
    done: std::sync::mpsc::Sender<CheckpointDone>,
    busy: Arc<AtomicBool>,
) {
    while let Ok(job) = rx.recv() {
        let (checkpoint, captured) = (job.checkpoint.clone(), job.captured.clone());
        let result = job.run();
        let _ = done.send(CheckpointDone { checkpoint, captured, result });
        busy.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::commitlog::RecoveryMode;
    use crate::storage::format::{encode_hop, Hop, Route};
    use crate::storage::io::{Fault, Op};
    use std::sync::mpsc::{channel, Sender};
    use std::sync::Mutex;

    /// A condition that holds batches until a test lets them through: the stand-in for a second
    /// durability condition such as "durable on a majority".
    struct Gate {
        /// The highest end offset the gate lets through.
        open_to: Arc<(Mutex<u64>, std::sync::Condvar)>,
    }

    impl Condition for Gate {
        fn reach(&mut self, _paths: &[&PathBuf], end: u64, _owed: bool) -> Result<()> {
            let (lock, cv) = &*self.open_to;
            let mut open = lock.lock().unwrap_or_else(|p| p.into_inner());
            while *open < end {
                open = cv.wait(open).unwrap_or_else(|p| p.into_inner());
            }
            Ok(())
        }
    }

    /// A reply that reports how it was released.
    struct Reply(Sender<Option<String>>);

    impl Release for Reply {
        fn release(self, failure: Option<&Error>) {
            let _ = self.0.send(failure.map(|e| e.to_string()));
        }
    }

    fn log_in(dir: &std::path::Path) -> (CommitLog, Durability) {
        let durability = Durability::new(dir);
        let (log, _) =
            CommitLog::open(dir, 1 << 20, 0, RecoveryMode::Strict, &[], durability.clone()).unwrap();
        (log, durability)
    }

    fn append_one(log: &mut CommitLog, i: u64) {
        let hop = Hop {
            msg_offset: i,
            id_hash: i,
            seq: 1,
            target_ms: i,
            route: Route::Level { level_ms: 1000, due_ms: i },
        };
        log.append(&encode_hop(&hop)).unwrap();
    }

    fn writer(
        flush: FlushMode,
        durability: &Durability,
        log: &CommitLog,
        more: Vec<Box<dyn Condition>>,
    ) -> Writer<Reply> {
        let cfg = WriterConfig { flush, flush_every: Duration::from_millis(1), on_flush: Arc::new(|_| {}) };
        Writer::start(cfg, durability.clone(), log.end(), more)
    }

    /// A condition that records the ends it was asked to reach, and on which thread.
    struct Record(Arc<Mutex<Vec<(u64, bool, std::thread::ThreadId)>>>);

    impl Condition for Record {
        fn reach(&mut self, _paths: &[&PathBuf], end: u64, owed: bool) -> Result<()> {
            self.0.lock().unwrap().push((end, owed, std::thread::current().id()));
            Ok(())
        }
    }

    #[test]
    fn a_replicated_batch_owing_no_reply_meets_its_conditions_on_the_committing_thread() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut w = writer(FlushMode::Sync, &durability, &log, vec![Box::new(Record(seen.clone()))]);
        // A follower's appends of the leader's entries: no reply owed, nothing in flight.
        append_one(&mut log, 1);
        assert!(w.lone_batch_possible(0, log.end()));
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(durability.log_durable() >= log.end(), "synced before commit returned");
        let me = std::thread::current().id();
        assert_eq!(seen.lock().unwrap().as_slice(), &[(log.end(), false, me)]);
        // A batch owing replies never is: the majority condition may wait for long.
        assert!(!w.lone_batch_possible(1, log.end() + 1));
        let (tx, rx) = channel();
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Engine { alone: true });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert!(seen[1].1 && seen[1].2 != me, "the batch owing a reply went to the flusher");
        drop(seen);
        w.stop();
    }

    #[test]
    fn without_a_flusher_thread_a_replicated_batch_still_meets_every_condition_before_its_replies() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut w = writer(FlushMode::Sync, &durability, &log, vec![Box::new(Record(seen.clone()))]);
        // As if the flusher thread could not be started.
        w.sync_tx = None;
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Engine { alone: false });
        assert_eq!(rx.try_recv().unwrap(), None, "answered once the conditions were met");
        assert!(durability.log_durable() >= log.end(), "the local sync ran");
        let me = std::thread::current().id();
        assert_eq!(seen.lock().unwrap().as_slice(), &[(log.end(), true, me)], "the majority condition ran, owed");
        w.stop();
    }

    #[test]
    fn replicated_async_replies_wait_for_the_majority_but_not_for_a_local_sync() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let gate = Arc::new((Mutex::new(0u64), std::sync::Condvar::new()));
        // A period long enough that the periodic flush does not run during the test.
        let cfg = WriterConfig {
            flush: FlushMode::Async,
            flush_every: Duration::from_secs(3600),
            on_flush: Arc::new(|_| {}),
        };
        let more: Vec<Box<dyn Condition>> = vec![Box::new(Gate { open_to: gate.clone() })];
        let mut w: Writer<Reply> = Writer::start(cfg, durability.clone(), log.end(), more);
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        let mut replies = vec![Reply(tx.clone())];
        w.commit(&mut log, &mut replies, Driver::Engine { alone: true });
        assert!(replies.is_empty(), "the reply went to the flusher");
        assert!(!w.settled(), "a reply waits on the majority");
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "released before the gate opened");
        let (lock, cv) = &*gate;
        *lock.lock().unwrap() = log.end();
        cv.notify_all();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
        assert!(durability.log_durable() < log.end(), "nothing synced the log: the periodic flush will");
        w.stop();
    }

    #[test]
    fn replies_wait_for_every_condition_not_only_the_local_sync() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let gate = Arc::new((Mutex::new(0u64), std::sync::Condvar::new()));
        let mut w =
            writer(FlushMode::Sync, &durability, &log, vec![Box::new(Gate { open_to: gate.clone() })]);
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        let mut replies = vec![Reply(tx.clone()), Reply(tx.clone())];
        w.commit(&mut log, &mut replies, Driver::Engine { alone: false });
        assert!(replies.is_empty(), "the replies went to the flusher");
        assert!(!w.settled());
        // The local sync is done long before this, but the gate holds the batch.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "released before the gate opened");
        let (lock, cv) = &*gate;
        *lock.lock().unwrap() = log.end();
        cv.notify_all();
        for _ in 0..2 {
            assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
        }
        assert!(durability.log_durable() >= log.end(), "the local condition ran first");
        w.stop();
        assert!(w.settled());
    }

    #[test]
    fn a_lone_small_batch_is_synced_and_answered_on_the_committing_thread() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = writer(FlushMode::Sync, &durability, &log, Vec::new());
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Inline { may_block: true, alone: true });
        // Left to the committing thread, to sync once it let go of the engine's lock.
        assert!(rx.try_recv().is_err(), "not answered before it is synced");
        assert!(durability.log_durable() < log.end());
        assert!(!w.settled(), "a request applied now would not be answered by its own step");
        let lone = w.take_outside().expect("the lone batch is left to this thread");
        lone.run();
        assert_eq!(rx.try_recv().unwrap(), None, "answered once synced, on this thread");
        assert_eq!(durability.log_durable(), log.end());
        assert!(w.settled());
        // A thread that may not block hands even a lone batch to the flusher.
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Inline { may_block: false, alone: true });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
        w.stop();
        assert_eq!(durability.log_durable(), log.end());
    }

    /// A majority-like condition that keeps the releases it is given, for the test to run.
    struct Parks(Arc<Mutex<Vec<(u64, Deferred, std::thread::ThreadId)>>>);
    impl Condition for Parks {
        fn reach(&mut self, _paths: &[&PathBuf], _end: u64, _owed: bool) -> Result<()> {
            Ok(())
        }
        fn defers(&self) -> bool {
            true
        }
        fn defer(&mut self, end: u64, release: Deferred) -> Option<Deferred> {
            self.0.lock().unwrap().push((end, release, std::thread::current().id()));
            None
        }
    }

    #[test]
    fn a_lone_replicated_batch_is_synced_here_and_its_replies_wait_for_the_deferred_condition() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let parked = Arc::new(Mutex::new(Vec::new()));
        let mut w = writer(FlushMode::Sync, &durability, &log, vec![Box::new(Parks(parked.clone()))]);
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        assert!(w.lone_batch_possible(1, log.end()), "a lone replicated batch owing a reply may be synced here");
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: true });
        assert_eq!(durability.log_durable(), log.end(), "synced on the committing thread");
        assert!(w.settled(), "no thread waits on the batch");
        let (end, release, on) = parked.lock().unwrap().pop().expect("the replies were handed to the condition");
        assert_eq!((end, on), (log.end(), std::thread::current().id()));
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "answered before the condition was met");
        release(None);
        assert_eq!(rx.recv_timeout(Duration::from_secs(1)).unwrap(), None);

        // A failure the condition reports goes to the replies; so does one of the store that
        // happens while a batch waits, though the condition then reports success.
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: true });
        let (_, release, _) = parked.lock().unwrap().pop().unwrap();
        release(Some(&Error::Unavailable("no majority".into())));
        assert_eq!(rx.recv_timeout(Duration::from_secs(1)).unwrap().as_deref(), Some("store unavailable: no majority"));
        append_one(&mut log, 3);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: true });
        let (_, release, _) = parked.lock().unwrap().pop().unwrap();
        durability.poison(Failure::new("sync", "commit log", "injected"));
        release(None);
        assert!(rx.recv_timeout(Duration::from_secs(1)).unwrap().is_some(), "a poisoned store acknowledges nothing");
        w.stop();
    }

    /// Batches the flusher handles (not lone) hand their replies to the deferred condition too,
    /// from the flusher's thread.
    #[test]
    fn the_flusher_defers_replicated_replies_instead_of_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let parked = Arc::new(Mutex::new(Vec::new()));
        let mut w = writer(FlushMode::Sync, &durability, &log, vec![Box::new(Parks(parked.clone()))]);
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: false });
        let deadline = Instant::now() + Duration::from_secs(10);
        while parked.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (end, release, on) = parked.lock().unwrap().pop().expect("the flusher handed the replies over");
        assert_eq!(end, log.end());
        assert_ne!(on, std::thread::current().id(), "handed over by the flusher");
        assert_eq!(durability.log_durable(), log.end(), "the local sync came first");
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        release(None);
        assert_eq!(rx.recv_timeout(Duration::from_secs(1)).unwrap(), None);
        w.stop();
    }

    #[test]
    fn after_a_failed_sync_no_reply_is_released_as_a_success() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = writer(FlushMode::Sync, &durability, &log, Vec::new());
        let (tx, rx) = channel();
        let fault = Fault::new(Op::Sync, dir.path(), libc::EIO).times(1).inject();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: false });
        // The batch's sync, or the log's warmer writing back ahead of it, met the fault: either
        // way the store is poisoned and the reply carries the failure.
        let failed = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(failed.as_deref().is_some_and(|e| e.contains("Input/output error")), "{failed:?}");
        assert!(durability.is_poisoned());
        drop(fault);
        // The disk works again, but the store is poisoned: a later batch, and a step that
        // appended nothing, are both refused.
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Engine { alone: true });
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_some());
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Engine { alone: true });
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().is_some());
        w.stop();
    }

    #[test]
    fn async_mode_answers_at_once_and_the_engine_thread_flushes_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = writer(FlushMode::Async, &durability, &log, Vec::new());
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Inline { may_block: true, alone: true });
        assert_eq!(rx.try_recv().unwrap(), None);
        assert!(durability.log_durable() < log.end(), "an inline step leaves the flush to the engine thread");
        std::thread::sleep(Duration::from_millis(5));
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert_eq!(durability.log_durable(), log.end(), "the periodic flush ran");
        w.stop();
    }

    fn sync_writer(durability: &Durability, log: &CommitLog, flush_every: Duration) -> Writer<Reply> {
        let cfg = WriterConfig { flush: FlushMode::Sync, flush_every, on_flush: Arc::new(|_| {}) };
        Writer::start(cfg, durability.clone(), log.end(), Vec::new())
    }

    /// Waits up to 10 s for the log to be durable to `end`.
    fn durable_soon(durability: &Durability, end: u64) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while durability.log_durable() < end && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        durability.log_durable() >= end
    }

    #[test]
    fn records_that_owe_no_reply_wait_for_the_next_batch_that_does() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = sync_writer(&durability, &log, Duration::from_secs(600));
        // A timer fired: no reply owed, so no sync of its own, on this thread or the flusher.
        append_one(&mut log, 1);
        let fired = log.end();
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(w.settled(), "nothing was handed to the flusher");
        std::thread::sleep(Duration::from_millis(20));
        assert!(durability.log_durable() < fired, "the fired timer was not synced on its own");
        assert!(w.next_work(false) > Duration::from_secs(1), "nothing to flush before the period");
        // A request that appends nothing (a read, an empty pop) is answered at once meanwhile.
        let (tx, rx) = channel();
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Inline { may_block: true, alone: true });
        assert_eq!(rx.try_recv().unwrap(), None);
        assert!(durability.log_durable() < fired);
        // The next batch that owes a reply is synced with the deferred records before its answer.
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Inline { may_block: true, alone: true });
        w.take_outside().expect("a lone batch, left to this thread").run();
        assert_eq!(rx.try_recv().unwrap(), None);
        assert!(durability.log_durable() >= log.end(), "synced before the answer, the timer's record with it");
        w.stop();
    }

    #[test]
    fn records_that_owe_no_reply_are_flushed_in_the_background_within_the_period() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let every = Duration::from_millis(50);
        let mut w = sync_writer(&durability, &log, every);
        append_one(&mut log, 1);
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(durability.log_durable() < log.end());
        assert!(w.next_work(false) <= every, "the engine thread wakes for them within the period");
        std::thread::sleep(every);
        // The engine thread's next step hands them to the flusher.
        let me = std::thread::current().id();
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(durable_soon(&durability, log.end()), "flushed once the period passed");
        assert!(w.next_work(false) > every, "nothing deferred any more");
        assert_eq!(std::thread::current().id(), me);
        w.stop();
    }

    #[test]
    fn many_records_that_owe_no_reply_go_to_the_flusher_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = sync_writer(&durability, &log, Duration::from_secs(600));
        // A catch-up fires far more than a deferral may hold: they are flushed as they go, not
        // left for one request to pay for.
        let start = log.end();
        while log.end() - start <= DEFER_MAX_BYTES {
            let i = log.end();
            append_one(&mut log, i);
        }
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(durable_soon(&durability, log.end()));
        w.stop();
    }

    #[test]
    fn a_stopping_engine_syncs_what_was_deferred() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = sync_writer(&durability, &log, Duration::from_secs(600));
        append_one(&mut log, 1);
        w.commit(&mut log, &mut Vec::new(), Driver::Engine { alone: true });
        assert!(durability.log_durable() < log.end());
        w.commit(&mut log, &mut Vec::new(), Driver::Stopping);
        assert_eq!(durability.log_durable(), log.end(), "synced before the engine stops");
        w.stop();
    }

    #[test]
    fn the_flusher_answers_nothing_behind_a_lone_batch_until_that_batch_is_synced() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = writer(FlushMode::Sync, &durability, &log, Vec::new());
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        let first = log.end();
        w.commit(&mut log, &mut vec![Reply(tx.clone())], Driver::Inline { may_block: true, alone: true });
        let lone = w.take_outside().expect("left to this thread");
        // The engine lock is free again: the engine thread commits a later batch meanwhile.
        let (tx2, rx2) = channel();
        append_one(&mut log, 2);
        assert!(!w.lone_batch_possible(1, log.end()), "not lone while the first is unsynced");
        w.commit(&mut log, &mut vec![Reply(tx2)], Driver::Engine { alone: true });
        assert!(rx2.recv_timeout(Duration::from_millis(200)).is_err(), "held back behind the lone batch");
        assert!(durability.log_durable() < first);
        lone.run();
        assert_eq!(rx.try_recv().unwrap(), None);
        assert_eq!(rx2.recv_timeout(Duration::from_secs(10)).unwrap(), None, "then released, in log order");
        assert_eq!(durability.log_durable(), log.end());
        w.stop();
    }

    #[test]
    fn a_lone_batch_dropped_unsynced_fails_its_request_and_holds_nothing_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, durability) = log_in(dir.path());
        let mut w = writer(FlushMode::Sync, &durability, &log, Vec::new());
        let (tx, rx) = channel();
        append_one(&mut log, 1);
        w.commit(&mut log, &mut vec![Reply(tx)], Driver::Inline { may_block: true, alone: true });
        // As if its thread panicked before syncing it.
        drop(w.take_outside());
        assert!(matches!(rx.try_recv(), Err(std::sync::mpsc::TryRecvError::Disconnected)), "never answered");
        assert!(w.settled());
        let (tx2, rx2) = channel();
        append_one(&mut log, 2);
        w.commit(&mut log, &mut vec![Reply(tx2)], Driver::Engine { alone: false });
        assert_eq!(rx2.recv_timeout(Duration::from_secs(10)).unwrap(), None, "the flusher was not held back");
        assert_eq!(durability.log_durable(), log.end(), "its sync covered the dropped batch too");
        w.stop();
    }
}
