//! The store: one commit log plus everything derived from it (consume queues, id index, counters),
//! the dispatcher that derives them, checkpoints and crash recovery.
//!
//! This file holds the store's state and its small accessors; each room adds an `impl Store`:
//! `open` (opening and recovery), `dispatch` (appending and applying records), `queues` (the
//! queue cache, reading and repairing entries), `reads` (messages, due times, counters) and
//! `checkpoint` (snapshots, checkpoints and closing).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tracing::info;

use super::commitlog::{CommitLog, RecoveryMode, RecoveryReport};
use super::consumequeue::ConsumeQueue;
use super::durability::Durability;
use super::format::{Record, State};
use super::index::IdIndex;
use super::mmap::DirLock;
use super::reserve::Reserve;
use super::types::{LogOffset, QueueIndex};
use super::writer::{self, Driver, Release, Writer};
use crate::error::{Error, Result};

mod checkpoint;
mod dispatch;
mod open;
mod queues;
mod reads;
mod replicate;

/// How many waiting pops a topic's news can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// This many entries were appended: at most this many pops can get one.
    Entries(u32),
    /// What the topic may hand out changed as a whole: every waiting pop looks again.
    All,
}

/// Sizes and policies of the files.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Commit-log segment size in bytes.
    pub segment_bytes: u64,
    /// Entries per consume-queue file.
    pub cq_entries_per_file: u64,
    /// Initial slots of the id index.
    pub index_initial_slots: u64,
    /// What to do with a bad record followed by valid ones.
    pub recovery: RecoveryMode,
    /// Most topic queues whose files are open (mapped, with a handle) at once.
    pub open_queues: usize,
    /// Whether a durable checkpoint deletes what it makes unnecessary (read queue files, emptied
    /// topics); off, everything is kept.
    pub reclaim: bool,
    /// When the open checks the derived files against the log.
    pub check_on_start: StartCheck,
}

/// What opening the store checks of the queues and the id index against the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartCheck {
    /// What a crash can leave wrong, after a crash only: the files' structure and that nothing in
    /// them points past the log, then a recount. After a clean close the derived files are exactly
    /// what that run synced, and the counts come from the clean-shutdown marker.
    #[default]
    AfterCrash,
    /// Also what only damage to the files can leave wrong, at every start: every pending
    /// message's slot and queue entry against the record it points at (one or two reads per
    /// message, so the start grows with the backlog).
    Always,
}

/// A topic queue with its reader cursor and counters.
pub struct TopicQueue {
    /// The entries; their files are open only while the queue is in the open-queue cache.
    pub cq: ConsumeQueue,
    /// Next entry a pop looks at.
    pub cursor: QueueIndex,
    /// Messages currently reserved from this queue.
    pub reserved: u64,
    /// Messages of this queue waiting on a delay level.
    pub delayed: u64,
    /// Messages in this queue not yet popped: Ready, or Dead in a dead-letter queue.
    pub ready: u64,
    /// Messages of this topic moved to its dead-letter topic since this queue was created.
    pub dead: u64,
    /// Key in the store's least-recently-used order while the files are open.
    lru: Option<u64>,
    /// Log offset of the record whose dispatch created this queue (0 when it came from the
    /// checkpoint at open). A checkpoint with a `dispatched` at or below it predates the queue:
    /// it describes a forgotten namesake, whose cursor and emptiness say nothing about this one.
    pub(super) created_at: u64,
}

impl TopicQueue {
    fn new(cq: ConsumeQueue, cursor: QueueIndex, reserved: u64, dead: u64, created_at: u64) -> TopicQueue {
        TopicQueue { cq, cursor, reserved, delayed: 0, ready: 0, dead, lru: None, created_at }
    }

    /// Whether its files are open now (it is in the open-queue cache).
    pub fn is_open(&self) -> bool {
        self.lru.is_some()
    }

    /// The counter a message in `state` counts in; none for a final one.
    fn counter(&mut self, state: State) -> Option<&mut u64> {
        match state {
            State::Delayed => Some(&mut self.delayed),
            State::Ready | State::Dead => Some(&mut self.ready),
            State::Reserved => Some(&mut self.reserved),
            State::Done | State::Cancelled => None,
        }
    }
}

/// A level queue with its scheduler's persisted cursor.
pub struct LevelQueue {
    /// The entries.
    pub cq: ConsumeQueue,
    /// First entry not yet handled (persisted at checkpoints).
    pub cursor: QueueIndex,
}

/// What opening found, for logs and tests.
#[derive(Debug, Clone, Default)]
pub struct OpenReport {
    /// Whether the last shutdown left the clean marker.
    pub clean: bool,
    /// What the commit-log scan found.
    pub log: RecoveryReport,
    /// Consume queues and index were rebuilt from the whole log.
    pub rebuilt: bool,
    /// Queue entries dropped because they pointed past the recovered log end.
    pub entries_dropped: u64,
    /// Records re-dispatched after the checkpoint.
    pub redispatched: u64,
    /// The checkpoint was damaged, so everything derived was rebuilt from the log.
    pub checkpoint_rebuilt: bool,
    /// A consume queue failed a check against the log, so the queues were rebuilt.
    pub queue_damaged: bool,
    /// The id index failed a check against the log, so it was rebuilt.
    pub index_damaged: bool,
    /// `truncate` mode, log shorter than what was durable: indexed messages whose Put is gone.
    pub messages_lost: u64,
    /// Same: indexed messages whose latest change is gone (they go back to an earlier state).
    pub messages_reverted: u64,
    /// Queues found shorter than the checkpoint said was durable: a checkpoint vouched for
    /// writes nobody synced (rebuilt from the log, but a broken sync protocol, never a power cut).
    pub behind_checkpoint: Vec<String>,
    /// Whether the queues and the id index were checked against the log and the counts
    /// recounted (false: a clean close's files and counts were taken as they were).
    pub checked: bool,
    /// Whether that check read the records every pending message's slot and queue entry point
    /// at (`check_on_start = "always"`), not only the files' structure and bounds.
    pub checked_records: bool,
    /// How long each part of the open took, in ms: where a slow start on a large backlog goes.
    pub took: OpenTimes,
}

/// Runs `pass(k, parts)` for every part `k` of a pass over `slots` index slots, on as many
/// threads as the machine has cores (at most 8): recovery's passes read the log at random, one
/// record per pending message, and wait on memory more than they compute, so they scale with
/// threads. A small index, or a thread the system refuses, runs its part here.
pub(crate) fn in_parts<T: Send>(slots: u64, pass: impl Fn(u64, u64) -> T + Sync) -> Vec<T> {
    // The unit tests' stores are small: there every pass is split, so they check the parts.
    #[cfg(not(test))]
    const SLOTS_PER_THREAD: u64 = 1 << 18;
    #[cfg(test)]
    const SLOTS_PER_THREAD: u64 = 8;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8) as u64;
    let parts = cores.min(slots / SLOTS_PER_THREAD).max(1);
    if parts == 1 {
        return vec![pass(0, 1)];
    }
    let pass = &pass;
    std::thread::scope(|scope| {
        let spawned: Vec<_> = (1..parts)
            .map(|k| {
                let thread = std::thread::Builder::new().name("delayd-recover".into());
                (k, thread.spawn_scoped(scope, move || pass(k, parts)).ok())
            })
            .collect();
        let mut out = vec![pass(0, parts)];
        for (k, handle) in spawned {
            // A part whose thread could not start, or stopped on a panic, is run here.
            match handle.map(|h| h.join()) {
                Some(Ok(t)) => out.push(t),
                _ => out.push(pass(k, parts)),
            }
        }
        out
    })
}

/// Wall time of each part of [`Store::open`], in ms.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OpenTimes {
    /// Scanning the commit log's tail and opening its segments.
    pub log_ms: u64,
    /// Opening and checking the queues and the id index against the log (or rebuilding them),
    /// and counting the live bytes from the index in the same pass.
    pub check_ms: u64,
    /// Re-dispatching the records past the checkpoint (and, after a rebuild, the checkpoint of
    /// the new files).
    pub replay_ms: u64,
}

/// The store.
pub struct Store {
    dir: PathBuf,
    cfg: StoreConfig,
    _lock: DirLock,
    /// The commit log.
    pub(super) log: CommitLog,
    /// Level queues by duration in ms.
    pub(super) levels: BTreeMap<u64, LevelQueue>,
    /// Topic queues by name.
    pub(super) topics: HashMap<String, TopicQueue>,
    /// Paused topics, with the offset of the Pause record in effect (reclaim copies it forward).
    pub(super) paused: BTreeMap<String, u64>,
    /// Topics with a push subscription, with the offset of the Push record in effect (reclaim
    /// copies it forward; the subscription is read from it).
    pub(super) push: BTreeMap<String, u64>,
    /// Push records applied so far, so that the pushers can tell when to look again.
    push_changes: u64,
    /// Topics with flow control, with the offset of the Flow record in effect (reclaim copies it
    /// forward; the limits are read from it).
    pub(super) flow: BTreeMap<String, u64>,
    /// Topics whose queue files are open, by last use (oldest first); at most `cfg.open_queues`.
    lru: BTreeMap<u64, String>,
    /// Key of the most recent use.
    lru_tick: u64,
    /// The id index.
    pub(super) index: IdIndex,
    pub(super) dispatched: u64,
    /// True while open() re-dispatches records that may already be in the index.
    recovering: bool,
    /// Log offset the last checkpoint covered: later segments need syncing before the next one.
    cp_log_end: u64,
    /// Topics that received entries since the last [`take_touched`](Self::take_touched), with how
    /// many waiting pops the news can serve.
    touched: Vec<(String, Wake)>,
    /// Bytes of the Put or Carry records of every indexed message (what reclaim must keep).
    pub(super) live_bytes: u64,
    /// Log offset up to which final messages were checked for expiry.
    pub(super) expiry: u64,
    /// Checkpoint snapshots taken by this process.
    pub(super) snapshots: u64,
    /// `serial` of the newest checkpoint known to be durable.
    pub(super) durable_serial: u64,
    /// Where reclaiming the oldest segment stands.
    pub(super) reclaim: super::reclaim::state::Reclaim,
    /// What each segment holds that reclaim must keep, kept by dispatch (recounted at open).
    pub(super) segs: super::reclaim::state::SegCounts,
    /// The id hash and offset of the newest Hop of each timer, by (msg_offset, seq), among the records re-dispatched at
    /// open. A level entry fired after the checkpoint fires again after a crash; the Hop it wrote
    /// then is in the replayed records, so a timer record older than that Hop is superseded and
    /// must not hop again (see `Engine::fire`). Only the replay fills it: in a running broker each
    /// entry fires once. Emptied as those timers fire or end.
    replayed_hops: HashMap<(u64, u32), (u64, u64)>,
    /// Damaged records met outside the recovery scan (reads take `&self`, hence atomic).
    corrupt_records: std::sync::atomic::AtomicU64,
    /// The store's health and durable offsets, shared with every thread that syncs its files.
    durability: Durability,
    /// Disk space held back for the writes that let a full disk recover.
    reserve: Reserve,
    /// In a cluster, what keeps this log framed as the replicated log (see `storage::replica`).
    replica: Option<Box<dyn super::replica::Replicator>>,
    /// This log's last complete replicated entry.
    sealed: super::replica::Sealed,
    /// The checkpoint serial last captured, with the entry the log ended with then (when it
    /// ended with a whole entry): what a leader's followers check its queue positions against.
    captured_at: Option<(u64, super::replica::Sealed)>,
    /// When a failure to append the replicated log was last logged (`None`: appending works).
    seal_reported: Option<std::time::Instant>,
    /// Entries appended to level queues since the store opened: a scheduler need only look at
    /// its queue again when this moved (or when it handed out an entry).
    level_appends: u64,
}

fn level_dir(root: &Path, level_ms: u64) -> PathBuf {
    root.join("cq").join("level").join(format!("{level_ms:012}"))
}

fn topic_dir(root: &Path, topic: &str) -> PathBuf {
    // The prefix keeps names such as "." and ".." (valid topics) from meaning anything to the filesystem.
    root.join("cq").join("topic").join(format!("t-{topic}"))
}

/// Deletes the index and its resize files, so the next open creates a fresh one.
fn remove_index_files(ids: &Path) -> Result<()> {
    for path in [ids.to_path_buf(), ids.with_extension("next"), ids.with_extension("new")] {
        match super::io::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io_at("remove", &path, e))
            }
            _ => {}
        }
    }
    Ok(())
}

fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match super::io::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io_at("remove", dir, e)),
        _ => Ok(()),
    }
}

/// A queue named by what it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueRef<'a> {
    /// The queue of a topic (dead-letter topics included).
    Topic(&'a str),
    /// The queue of a delay level, by its duration in ms.
    Level(u64),
}

impl std::fmt::Display for QueueRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueueRef::Topic(t) => write!(f, "topic {t}"),
            QueueRef::Level(ms) => write!(f, "level {ms} ms"),
        }
    }
}

/// The queue a record routes to (owned).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Topic(String),
    Level(u64),
}

impl Target {
    fn is(&self, q: &QueueRef<'_>) -> bool {
        match (self, q) {
            (Target::Topic(a), QueueRef::Topic(b)) => a == b,
            (Target::Level(a), QueueRef::Level(b)) => a == b,
            _ => false,
        }
    }
}

/// What [`Store::check_entry`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryCheck {
    /// The entry matches its record.
    Valid,
    /// Its record was reclaimed; the entry is history.
    Stale,
    /// A record header is there but the record fails its CRC (logged and counted): the log itself
    /// is damaged, and the message cannot be read.
    CorruptRecord,
    /// The entry does not match the log: the queue file is damaged.
    Bad(String),
}

/// The dead-letter topic of `topic`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

impl Store {
    /// The store's durability owner.
    pub fn durability(&self) -> &Durability {
        &self.durability
    }

    /// Makes the reserve file again if it was released and there is room now.
    pub fn restore_reserve(&self) {
        if !self.reserve.is_held() && self.reserve.ensure() {
            info!("disk space is back: the reserve file is made again");
        }
    }

    /// Wakes every pop waiting on the topic: what it may hand out changed as a whole (it was
    /// resumed, or its flow limits changed).
    pub fn touch(&mut self, topic: &str) {
        match self.touched.iter_mut().find(|(t, _)| t == topic) {
            Some((_, wake)) => *wake = Wake::All,
            None => self.touched.push((topic.to_string(), Wake::All)),
        }
    }

    /// Counts one entry appended to `topic`'s queue, for the pops it can wake.
    pub(super) fn touch_one(&mut self, topic: &str) {
        match self.touched.iter_mut().find(|(t, _)| t == topic) {
            Some((_, Wake::Entries(n))) => *n = n.saturating_add(1),
            Some((_, Wake::All)) => {}
            None => self.touched.push((topic.to_string(), Wake::Entries(1))),
        }
    }

    /// Topics that got new entries since the last call, and how many waiting pops each can serve.
    pub fn take_touched(&mut self) -> Vec<(String, Wake)> {
        std::mem::take(&mut self.touched)
    }

    /// Makes the log durable.
    pub fn flush_log(&mut self) -> Result<()> {
        self.log.flush()
    }

    /// Bytes of disk the data files occupy.
    pub fn disk_bytes(&self) -> u64 {
        self.log.disk_bytes()
            + self.index.disk_bytes()
            + self.levels.values().map(|q| q.cq.disk_bytes()).sum::<u64>()
            + self.topics.values().map(|q| q.cq.disk_bytes()).sum::<u64>()
    }

    /// Offset up to which records are dispatched.
    pub fn dispatched(&self) -> u64 {
        self.dispatched
    }
}

/// What the engine reads of the store's state: each method answers one question, so that the
/// maps, log and index behind them stay the store's to change.
impl Store {
    /// Offset of the oldest record still in the log (older ones were reclaimed).
    pub fn log_start(&self) -> LogOffset {
        LogOffset::new(self.log.start())
    }

    /// Offset one past the last appended record.
    pub fn log_end(&self) -> LogOffset {
        LogOffset::new(self.log.end())
    }

    /// The log's segments up to its end, as a backup copies them (see `storage::backup`).
    pub fn backup_segments(&self) -> Result<Vec<super::backup::CutSegment>> {
        self.log.backup_segments()
    }

    /// Whether `offset` lies in the log's live range, between its start and its end.
    pub fn in_log(&self, offset: LogOffset) -> bool {
        offset.get() >= self.log.start() && offset.get() < self.log.end()
    }

    /// True when appends are waiting for a flush.
    pub fn unflushed(&self) -> bool {
        self.log.flushed() < self.log.end()
    }

    /// Bytes of disk the commit log occupies.
    pub fn log_disk_bytes(&self) -> u64 {
        self.log.disk_bytes()
    }

    /// The CRC-checked record at `offset`.
    pub fn record_at(&self, offset: LogOffset) -> Result<Record<'_>> {
        Ok(self.log.read(offset.get())?.0)
    }

    /// The record at `offset` read for its fields: a body is neither read nor checked (see
    /// [`format::decode_fields`](super::format::decode_fields)).
    pub fn record_fields_at(&self, offset: LogOffset) -> Result<Record<'_>> {
        Ok(self.log.read_fields(offset.get())?.0)
    }

    /// Makes every append durable on this thread; true when there was something to sync (see
    /// [`writer::sync_log`]).
    pub fn sync_log(&mut self) -> Result<bool> {
        writer::sync_log(&mut self.log, &self.durability)
    }

    /// Hands the log to `writer`'s commit of this step's appends (see [`Writer::commit`]), as
    /// `driver` says once the log is sealed: given the writer, the replies and the log's end, it
    /// tells who commits and whether anything waits behind (a follower's entries are appended by
    /// the seal, so asking before it would find nothing to commit and never sync here).
    pub fn commit<R: Release>(
        &mut self,
        writer: &mut Writer<R>,
        replies: &mut Vec<R>,
        driver: impl FnOnce(&Writer<R>, usize, u64) -> Driver,
    ) {
        if let Err(e) = self.seal() {
            // Retried at the next commit (the raft thread wakes the engine while entries wait);
            // said once a minute, not once a step.
            if self.seal_reported.is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(60)) {
                tracing::warn!(error = %e, "cannot append the replicated log here; retrying");
                self.seal_reported = Some(std::time::Instant::now());
            }
            replies.drain(..).for_each(|r| r.release(Some(&e)));
        } else if self.seal_reported.take().is_some() {
            tracing::info!("appending the replicated log here again");
        }
        let driver = driver(writer, replies.len(), self.log.end());
        writer.commit(&mut self.log, replies, driver);
    }

    /// The delay levels with a queue, by duration in ms.
    pub fn levels(&self) -> impl Iterator<Item = (u64, &LevelQueue)> {
        self.levels.iter().map(|(ms, q)| (*ms, q))
    }

    /// How many delay levels have a queue.
    pub fn level_count(&self) -> usize {
        self.levels.len()
    }

    /// The queue of the `level_ms` delay level, if it has one.
    pub fn level(&self, level_ms: u64) -> Option<&LevelQueue> {
        self.levels.get(&level_ms)
    }

    /// Entries appended to level queues since the store opened.
    pub fn level_appends(&self) -> u64 {
        self.level_appends
    }

    /// Moves a level's persisted cursor (back to the last good entry after a repair).
    pub fn set_level_cursor(&mut self, level_ms: u64, cursor: QueueIndex) {
        if let Some(q) = self.levels.get_mut(&level_ms) {
            q.cursor = cursor;
        }
    }

    /// Entries written to all queues so far.
    pub fn queue_entries(&self) -> u64 {
        self.levels.values().map(|q| q.cq.len()).sum::<u64>()
            + self.topics.values().map(|q| q.cq.len()).sum::<u64>()
    }

    /// The topics with a queue, with their queue and counters.
    pub fn topic_queues(&self) -> impl Iterator<Item = (&str, &TopicQueue)> {
        self.topics.iter().map(|(name, q)| (name.as_str(), q))
    }

    /// `topic`'s queue, if it has one.
    pub fn topic_queue(&self, topic: &str) -> Option<&TopicQueue> {
        self.topics.get(topic)
    }

    /// Whether `topic` is paused.
    pub fn is_paused(&self, topic: &str) -> bool {
        self.paused.contains_key(topic)
    }

    /// The paused topics, by name.
    pub fn paused_topics(&self) -> impl Iterator<Item = &str> {
        self.paused.keys().map(String::as_str)
    }

    /// Offset of the Push record in effect for `topic`, if it has a subscription.
    pub fn push_at(&self, topic: &str) -> Option<LogOffset> {
        self.push.get(topic).copied().map(LogOffset::new)
    }

    /// The topics with a push subscription, by name.
    pub fn push_topics(&self) -> impl Iterator<Item = &str> {
        self.push.keys().map(String::as_str)
    }

    /// Push records applied so far, so that the pushers can tell when to look again.
    pub fn push_changes(&self) -> u64 {
        self.push_changes
    }

    /// Offset of the Flow record in effect for `topic`, if it has flow control.
    pub fn flow_at(&self, topic: &str) -> Option<LogOffset> {
        self.flow.get(topic).copied().map(LogOffset::new)
    }

    /// The topics with flow control, by name.
    pub fn flow_topics(&self) -> impl Iterator<Item = &str> {
        self.flow.keys().map(String::as_str)
    }

    /// Whether `topic` exists: it has a queue, a pause, a push subscription or flow control.
    pub fn knows_topic(&self, topic: &str) -> bool {
        self.topics.contains_key(topic)
            || self.paused.contains_key(topic)
            || self.push.contains_key(topic)
            || self.flow.contains_key(topic)
    }

    /// How many topics exist (see [`knows_topic`](Self::knows_topic)).
    pub fn topic_count(&self) -> usize {
        // Names with only a pause or a subscription are few; counted when a new topic is asked for.
        let paused_only = self.paused.keys().filter(|t| !self.topics.contains_key(*t)).count();
        let push_only = self
            .push
            .keys()
            .filter(|t| !self.topics.contains_key(*t) && !self.paused.contains_key(*t))
            .count();
        let flow_only = self
            .flow
            .keys()
            .filter(|t| !self.topics.contains_key(*t) && !self.paused.contains_key(*t) && !self.push.contains_key(*t))
            .count();
        self.topics.len() + paused_only + push_only + flow_only
    }

    /// Messages in the id index.
    pub fn index_len(&self) -> u64 {
        self.index.len()
    }

    /// Slots of the id index table inserts go to.
    pub fn index_slots(&self) -> u64 {
        self.index.capacity()
    }

    /// Whether the id index is being resized.
    pub fn index_migrating(&self) -> bool {
        self.index.is_migrating()
    }

    /// Whether an index resize has old slots left to copy.
    pub fn index_copying(&self) -> bool {
        self.index.is_copying()
    }

    /// Time spent on the id index's resize since the last call.
    pub fn take_index_resize_time(&mut self) -> std::time::Duration {
        self.index.take_resize_time()
    }

    /// Copies up to `budget` old slots of an index resize in progress; true while copying remains.
    pub fn step_index(&mut self, budget: usize) -> bool {
        self.index.step(budget);
        self.index.is_copying()
    }

    /// Offset of the newest Hop replayed at open for the timer of (`msg_offset`, `seq`), if any
    /// (see the `replayed_hops` field).
    pub fn replayed_hop(&self, msg_offset: LogOffset, seq: u32) -> Option<LogOffset> {
        self.replayed_hops.get(&(msg_offset.get(), seq)).map(|&(_, newest)| LogOffset::new(newest))
    }

    /// Forgets the replayed Hop of a timer that fired or ended.
    pub fn forget_replayed_hop(&mut self, msg_offset: LogOffset, seq: u32) {
        self.replayed_hops.remove(&(msg_offset.get(), seq));
    }
}

/// Read-only views for white-box tests.
#[cfg(test)]
impl Store {
    /// The commit log.
    pub(crate) fn log(&self) -> &CommitLog {
        &self.log
    }

    /// The id index.
    pub(crate) fn index(&self) -> &IdIndex {
        &self.index
    }

    /// Offset of the Pause record in effect for `topic`, if it is paused.
    pub(crate) fn paused_at(&self, topic: &str) -> Option<LogOffset> {
        self.paused.get(topic).copied().map(LogOffset::new)
    }

    /// Timers replayed at open whose Hop has not fired or ended yet.
    pub(crate) fn replayed_hops_left(&self) -> usize {
        self.replayed_hops.len()
    }
}
