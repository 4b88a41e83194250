//! The store: one commit log plus everything derived from it (consume queues, id index, counters),
//! the dispatcher that derives them, checkpoints and crash recovery.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use tracing::{error, info, warn};

use super::checkpoint::{self, Captured, Checkpoint, CheckpointDamage, CheckpointJob, QueueKind, QueueState};
use super::commitlog::{CommitLog, DurableClaim, RecoveryMode, RecoveryReport};
use super::consumequeue::{ConsumeQueue, Entry};
use super::durability::{Durability, Failure, Reserve};
use super::format::{self, Cause, Home, Put, Record, Route, State};
use super::index::{IdIndex, Slot, SlotRef};
use super::mmap::DirLock;
use crate::error::{Error, Result};

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
}

/// A topic queue with its reader cursor and counters.
pub struct TopicQueue {
    /// The entries; their files are open only while the queue is in the open-queue cache.
    pub cq: ConsumeQueue,
    /// Next entry a pop looks at.
    pub cursor: u64,
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
    fn new(cq: ConsumeQueue, cursor: u64, reserved: u64, dead: u64, created_at: u64) -> TopicQueue {
        TopicQueue { cq, cursor, reserved, delayed: 0, ready: 0, dead, lru: None, created_at }
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
    pub cursor: u64,
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
}

/// The store.
pub struct Store {
    dir: PathBuf,
    cfg: StoreConfig,
    _lock: DirLock,
    /// The commit log.
    pub log: CommitLog,
    /// Level queues by duration in ms.
    pub levels: BTreeMap<u64, LevelQueue>,
    /// Topic queues by name.
    pub topics: HashMap<String, TopicQueue>,
    /// Paused topics, with the offset of the Pause record in effect (reclaim copies it forward).
    pub paused: BTreeMap<String, u64>,
    /// Topics with a push subscription, with the offset of the Push record in effect (reclaim
    /// copies it forward; the subscription is read from it).
    pub push: BTreeMap<String, u64>,
    /// Push records applied so far, so that the pushers can tell when to look again.
    pub push_changes: u64,
    /// Topics whose queue files are open, by last use (oldest first); at most `cfg.open_queues`.
    lru: BTreeMap<u64, String>,
    /// Key of the most recent use.
    lru_tick: u64,
    /// The id index.
    pub index: IdIndex,
    pub(super) dispatched: u64,
    /// True while open() re-dispatches records that may already be in the index.
    recovering: bool,
    /// Log offset the last checkpoint covered: later segments need syncing before the next one.
    cp_log_end: u64,
    /// Topics that received entries since the last [`take_touched`](Self::take_touched).
    touched: Vec<String>,
    /// Bytes of the Put or Carry records of every indexed message (what reclaim must keep).
    pub(super) live_bytes: u64,
    /// Log offset up to which final messages were checked for expiry.
    pub(super) expiry: u64,
    /// Checkpoint snapshots taken by this process.
    pub(super) snapshots: u64,
    /// `serial` of the newest checkpoint known to be durable.
    pub(super) durable_serial: u64,
    /// Where reclaiming the oldest segment stands.
    pub(super) reclaim: super::reclaim::Reclaim,
    /// What each segment holds that reclaim must keep, kept by dispatch (recounted at open).
    pub(super) segs: super::reclaim::SegCounts,
    /// The id hash and offset of the newest Hop of each timer, by (msg_offset, seq), among the records re-dispatched at
    /// open. A level entry fired after the checkpoint fires again after a crash; the Hop it wrote
    /// then is in the replayed records, so a timer record older than that Hop is superseded and
    /// must not hop again (see `Engine::fire`). Only the replay fills it: in a running broker each
    /// entry fires once. Emptied as those timers fire or end.
    pub(crate) replayed_hops: HashMap<(u64, u32), (u64, u64)>,
    /// Damaged records met outside the recovery scan (reads take `&self`, hence atomic).
    corrupt_records: std::sync::atomic::AtomicU64,
    /// The store's health and durable offsets, shared with every thread that syncs its files.
    durability: Durability,
    /// Disk space held back for the writes that let a full disk recover.
    reserve: Reserve,
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

/// Where a record's dispatch puts an entry.
enum Routed {
    /// This entry in this queue.
    To(Target, Entry),
    /// No queue (route None, end of segment).
    Nowhere,
    /// A change of a message whose record was reclaimed: dispatch skips it, entries are history.
    Reclaimed,
    /// The message's record is damaged (logged and counted).
    Damaged,
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
    /// Opens (or creates) the data directory, recovering from whatever state it was left in.
    pub fn open(dir: &Path, cfg: StoreConfig) -> Result<(Store, OpenReport)> {
        super::io::create_private_dir(dir)?;
        let lock = DirLock::acquire(&dir.join("LOCK"))?;
        let durability = Durability::register(dir);
        let reserve = Reserve::new(dir);
        let clean_end = checkpoint::take_clean_marker(&dir.join("clean_shutdown"))?;
        let cp_path = dir.join("checkpoint");
        let (cp, cp_damaged) = match Checkpoint::load_or_damage(&cp_path)? {
            Ok(cp) => (cp, false),
            Err(why @ CheckpointDamage::OtherVersion(_)) => {
                return Err(Error::Corrupt {
                    file: cp_path.display().to_string(),
                    offset: 0,
                    reason: format!("checkpoint written by another delayd: {why}; upgrade instead"),
                })
            }
            // Everything in it is derived from the log except the reader cursors, and a rebuild
            // restarts readers at entry 0, where entries of handled messages are skipped.
            Err(why) => {
                error!(
                    file = %cp_path.display(),
                    %why,
                    "checkpoint unusable; rebuilding queues, index and counters from the whole commit log"
                );
                (Checkpoint::default(), true)
            }
        };
        // What other files vouch was durable: a log ending before it lost acknowledged records.
        let mut claims = Vec::new();
        if cp.dispatched > 0 {
            claims.push(DurableClaim {
                offset: cp.dispatched,
                source: format!("the checkpoint ({}, field dispatched)", cp_path.display()),
            });
        }
        if let Some(end) = clean_end {
            claims.push(DurableClaim {
                offset: end,
                source: format!(
                    "the clean-shutdown marker ({}, field log_end)",
                    dir.join("clean_shutdown").display()
                ),
            });
        }
        let (log, log_report) = CommitLog::open(
            &dir.join("commitlog"),
            cfg.segment_bytes,
            cp.dispatched,
            cfg.recovery,
            &claims,
            durability.clone(),
        )?;
        let mut report = OpenReport {
            clean: clean_end.is_some(),
            log: log_report,
            checkpoint_rebuilt: cp_damaged,
            ..Default::default()
        };

        let index_path = dir.join("index").join("ids");
        fs::create_dir_all(dir.join("index")).map_err(|e| Error::io("create index dir", e))?;
        let mut rebuild = cp_damaged || (!index_path.exists() && cp.dispatched > log.start());
        let index = match IdIndex::open(&index_path, cfg.index_initial_slots) {
            Ok(index) => index,
            // The index is derived: a damaged or older-layout one is rebuilt from the log.
            Err(Error::Corrupt { file, reason, .. }) => {
                warn!(%file, %reason, "id index unusable; rebuilding it from the commit log");
                rebuild = true;
                remove_index_files(&index_path)?;
                IdIndex::open(&index_path, cfg.index_initial_slots)?
            }
            Err(e) => return Err(e),
        };
        let mut store = Store {
            dir: dir.to_path_buf(),
            cfg,
            _lock: lock,
            log,
            levels: BTreeMap::new(),
            topics: HashMap::new(),
            paused: BTreeMap::new(),
            push: BTreeMap::new(),
            push_changes: 0,
            lru: BTreeMap::new(),
            lru_tick: 0,
            index,
            dispatched: 0,
            cp_log_end: 0,
            recovering: false,
            touched: Vec::new(),
            live_bytes: 0,
            expiry: 0,
            snapshots: 0,
            durable_serial: 0,
            reclaim: Default::default(),
            segs: Default::default(),
            replayed_hops: HashMap::new(),
            corrupt_records: Default::default(),
            durability,
            reserve,
        };
        let dispatched = cp.dispatched.min(store.log.end()).max(store.log.start());
        if let Some(claimed) = report.log.claimed_end {
            // Only `truncate` mode gets here: say what the lost records meant, from the index as it
            // was (it is rebuilt below).
            let end = store.log.end();
            let (mut lost, mut reverted) = (0u64, 0u64);
            store.index.for_each(|s| {
                if s.msg_offset >= end {
                    lost += 1;
                } else if s.last_offset >= end {
                    reverted += 1;
                }
            });
            error!(
                log_end = end,
                claimed_end = claimed,
                bytes_lost = report.log.durable_bytes_lost,
                messages_lost = lost,
                messages_reverted = reverted,
                "recovery = truncate: records that were durable are gone; messages produced there are \
                 lost and messages changed there (acked, cancelled, reserved, moved) go back to their \
                 last state before the log end"
            );
            report.messages_lost = lost;
            report.messages_reverted = reverted;
        }
        // Pauses before the checkpoint's position; later ones are replayed below.
        store.paused = cp.paused.iter().filter(|(_, at)| *at < store.log.end()).cloned().collect();
        store.push = cp.push.iter().filter(|(_, at)| *at < store.log.end()).cloned().collect();
        if !rebuild {
            rebuild = !store.open_queues(&cp, dispatched, &mut report)?;
        }
        if !rebuild {
            if let Some(why) = store.index_damage() {
                warn!(%why, "id index disagrees with the commit log; rebuilding it and the queues from the log");
                report.index_damaged = true;
                rebuild = true;
            }
        }
        if rebuild {
            store.rebuild(&cp)?;
            report.rebuilt = true;
        } else {
            store.dispatched = dispatched;
        }
        let before = store.dispatched;
        store.recovering = true;
        report.redispatched = store.dispatch()?;
        store.recovering = false;
        // Only timers still running need their newest Hop remembered.
        let index = &store.index;
        store.replayed_hops.retain(|&(msg_offset, seq), &mut (hash, _)| {
            index.find(hash, |m| m == msg_offset).is_some_and(|(_, slot)| {
                slot.seq == seq && matches!(slot.state, State::Delayed | State::Reserved)
            })
        });
        for q in store.levels.values_mut() {
            q.cursor = q.cursor.min(q.cq.len());
        }
        for q in store.topics.values_mut() {
            q.cursor = q.cursor.min(q.cq.len()).max(q.cq.first());
        }
        for q in store.levels.values_mut() {
            q.cursor = q.cursor.max(q.cq.first());
        }
        store.touched.clear();
        if !store.reserve.ensure() {
            warn!(
                bytes = super::durability::RESERVE_BYTES,
                "no room for the reserve file; starting without it"
            );
        }
        store.live_bytes = store.count_live_bytes();
        store.recount_segments();
        store.expiry = store.log.start();
        if report.rebuilt {
            // The checkpoint on disk describes the derived files the rebuild replaced: until one
            // describes the new ones, a power loss would pair it with a fresh, partly unsynced
            // index and queues, and the messages only they held would be gone.
            store.write_checkpoint(&BTreeMap::new())?;
        }
        info!(
            clean = report.clean,
            rebuilt = report.rebuilt,
            log_end = store.log.end(),
            from = before,
            redispatched = report.redispatched,
            entries_dropped = report.entries_dropped,
            "store opened"
        );
        Ok((store, report))
    }

    /// Opens queues at their checkpointed lengths; false when one is missing and a rebuild is needed.
    fn open_queues(&mut self, cp: &Checkpoint, dispatched: u64, report: &mut OpenReport) -> Result<bool> {
        let per_file = self.cfg.cq_entries_per_file;
        for q in &cp.queues {
            let (path, level) = match q.kind {
                QueueKind::Level => {
                    let ms: u64 = q.name.parse().map_err(|_| Error::Corrupt {
                        file: "checkpoint".into(),
                        offset: 0,
                        reason: format!("level name {:?} is not a number", q.name),
                    })?;
                    (level_dir(&self.dir, ms), Some(ms))
                }
                QueueKind::Topic => (topic_dir(&self.dir, &q.name), None),
            };
            if level.is_none() && q.cursor >= q.len {
                // Every entry the checkpoint knew of was read, and entries past it are dispatched
                // again: nothing on disk is needed. The topic may have been forgotten after this
                // checkpoint (files partly or wholly gone) and even recreated from entry 0, so it
                // restarts empty at entry 0 whatever its directory holds.
                remove_dir_if_present(&path)?;
                let cq = ConsumeQueue::new_closed(&path, per_file);
                let mut t = TopicQueue::new(cq, 0, q.reserved, q.dead, 0);
                (t.delayed, t.ready) = (q.delayed, q.ready);
                self.topics.insert(q.name.clone(), t);
                continue;
            }
            if q.len > 0 && !path.exists() {
                warn!(queue = %q.name, "consume queue missing; rebuilding all queues from the commit log");
                return Ok(false);
            }
            let mut cq = match ConsumeQueue::open(&path, per_file, Some(q.len)) {
                Ok(cq) => cq,
                Err(Error::Corrupt { file, reason, .. }) => {
                    warn!(%file, %reason, "damaged consume queue; rebuilding all queues from the commit log");
                    return Ok(false);
                }
                Err(e) => return Err(e),
            };
            if cq.len() < q.len {
                warn!(queue = %q.name, "consume queue shorter than its checkpoint; rebuilding");
                report.behind_checkpoint.push(q.name.clone());
                return Ok(false);
            }
            if let Some((why, unwritten)) = self.queue_damage(&cq, q.cursor, dispatched) {
                warn!(queue = %q.name, %why, "consume queue disagrees with the commit log; rebuilding all queues from the log");
                report.queue_damaged = true;
                if unwritten {
                    report.behind_checkpoint.push(q.name.clone());
                }
                return Ok(false);
            }
            let dropped = cq.truncate_to_offset(dispatched)?;
            if dropped > 0 {
                warn!(queue = %q.name, dropped, "dropped consume-queue entries past the recovered log end");
                report.entries_dropped += dropped;
            }
            match level {
                Some(ms) => {
                    self.levels.insert(ms, LevelQueue { cq, cursor: q.cursor });
                }
                None => {
                    let mut t = TopicQueue::new(cq, q.cursor, q.reserved, q.dead, 0);
                    (t.delayed, t.ready) = (q.delayed, q.ready);
                    self.topics.insert(q.name.clone(), t);
                    self.topic_open(&q.name)?;
                }
            }
        }
        // Queues created after the checkpoint hold only re-dispatchable entries: levels start empty,
        // topics (perhaps forgotten before the crash) go and come back if the replay names them.
        for (kind, sub) in [(QueueKind::Level, "level"), (QueueKind::Topic, "topic")] {
            let root = self.dir.join("cq").join(sub);
            let Ok(rd) = super::io::read_dir(&root) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                match kind {
                    QueueKind::Level => {
                        if let Ok(ms) = name.parse::<u64>() {
                            if let std::collections::btree_map::Entry::Vacant(v) = self.levels.entry(ms) {
                                let Ok(cq) = ConsumeQueue::open(&e.path(), per_file, Some(0)) else {
                                    return Ok(false);
                                };
                                v.insert(LevelQueue { cq, cursor: 0 });
                            }
                        }
                    }
                    QueueKind::Topic => {
                        if name.strip_prefix("t-").is_some_and(|topic| !self.topics.contains_key(topic)) {
                            remove_dir_if_present(&e.path())?;
                        }
                    }
                }
            }
        }
        Ok(true)
    }

    /// Why a queue opened from the checkpoint cannot be trusted, if it cannot. Every entry on disk
    /// must be written (`size != 0`) and ascend strictly in log offset; the unread ones (from
    /// `cursor`) below `dispatched` must point at a record header of their `size`. Entries past
    /// `dispatched` are the torn suffix that recovery drops, which ascending order keeps a suffix.
    /// Costs one read of each queue file and one record header per unread entry. The flag says
    /// the cause is an entry below the checkpointed length that was never written: the checkpoint
    /// vouched for a write nobody synced.
    fn queue_damage(&self, cq: &ConsumeQueue, cursor: u64, dispatched: u64) -> Option<(String, bool)> {
        let mut prev: Option<u64> = None;
        for i in cq.first()..cq.len() {
            let Some(e) = cq.get(i) else { return Some((format!("entry {i} is missing"), false)) };
            if e.size == 0 {
                return Some((
                    format!("entry {i} is unwritten (zero) below the queue length {}", cq.len()),
                    true,
                ));
            }
            if prev.is_some_and(|p| e.offset <= p) {
                let why = format!("entry {i} (log offset {}) does not follow the previous one", e.offset);
                return Some((why, false));
            }
            prev = Some(e.offset);
            if i >= cursor && e.offset >= self.log.start() && e.offset < dispatched {
                if let Some(why) = self.header_mismatch(e.offset, e.size) {
                    return Some((format!("entry {i}: {why}"), false));
                }
            }
        }
        None
    }

    /// Why `offset` does not hold a record header of length `size` (not checking its CRC), if not.
    fn header_mismatch(&self, offset: u64, size: u32) -> Option<String> {
        let Some(h) = self.log.raw(offset, format::HEADER_BYTES) else {
            return Some(format!("log offset {offset} is not in the log"));
        };
        match format::RecordHeader::decode(h) {
            Ok(h) if h.len == size => None,
            _ => Some(format!("log offset {offset} holds no record of {size} bytes")),
        }
    }

    /// Why the index cannot be trusted, if it cannot: its table fails its structural checks, or a
    /// live slot is ahead of the log or disagrees with the records it points to (its Put or Carry
    /// must carry an id with the slot's hash; its last record must have set exactly the slot's
    /// seq, state, home and attempt). Costs a read of the table and of one or two records per
    /// live slot (recounting live bytes reads the first anyway).
    fn index_damage(&self) -> Option<String> {
        if let Some(why) = self.index.check() {
            return Some(why);
        }
        let mut damage = None;
        self.index.for_each(|s| {
            if damage.is_none() {
                damage = self.slot_damage(&s);
            }
        });
        damage
    }

    fn slot_damage(&self, s: &Slot) -> Option<String> {
        let (start, end) = (self.log.start(), self.log.end());
        let what = format!("slot of the message at {} (last record {})", s.msg_offset, s.last_offset);
        if s.msg_offset >= end || s.last_offset >= end {
            return Some(format!("{what} holds state from past the log end {end}"));
        }
        if s.msg_offset < start || s.last_offset < s.msg_offset {
            return Some(format!("{what} points outside the log [{start}, {end})"));
        }
        let attempt = |a: u32| a.min(u32::from(u16::MAX)) as u16;
        let expect = match self.read_checked(s.msg_offset) {
            Ok(Some(Record::Put(p))) if format::id_hash(p.id) == s.hash => {
                let state = if p.route == Route::Topic { State::Ready } else { State::Delayed };
                (0, state, Home::Main, 0)
            }
            Ok(Some(Record::Carry(c))) if format::id_hash(c.put.id) == s.hash => {
                (c.seq, c.state, c.home, attempt(c.attempt))
            }
            Ok(Some(_)) => return Some(format!("{what}: no message with its id hash there")),
            // The log itself is damaged there: not the index's fault, and already reported.
            Ok(None) => return None,
            Err(why) => return Some(format!("{what}: {why}")),
        };
        let expect = if s.last_offset == s.msg_offset {
            expect
        } else {
            match self.read_checked(s.last_offset) {
                Ok(Some(Record::Transition(t))) if t.msg_offset == s.msg_offset && t.id_hash == s.hash => {
                    (t.seq, t.state, t.home, attempt(t.attempt))
                }
                Ok(Some(_)) => return Some(format!("{what}: its last record is not a change of it")),
                Ok(None) => return None,
                Err(why) => return Some(format!("{what}: {why}")),
            }
        };
        if expect != (s.seq, s.state, s.home, s.attempt) {
            return Some(format!(
                "{what}: slot says seq {} {:?} {:?} attempt {}, its record says {expect:?}",
                s.seq, s.state, s.home, s.attempt
            ));
        }
        None
    }

    /// The CRC-checked record at `offset`; `Ok(None)` when a record header is there but the record
    /// fails its check (damage in the log itself, logged and counted); `Err` when nothing there
    /// looks like a record (so whatever pointed there is wrong).
    pub(crate) fn read_checked(&self, offset: u64) -> std::result::Result<Option<Record<'_>>, String> {
        match self.log.read(offset) {
            Ok((rec, _)) => Ok(Some(rec)),
            Err(Error::Corrupt { reason, .. }) => {
                let h = self.log.raw(offset, format::HEADER_BYTES);
                if h.is_some_and(format::has_record_magic) {
                    self.corrupt_record(offset, &reason);
                    Ok(None)
                } else {
                    Err(format!("no record at log offset {offset} ({reason})"))
                }
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Logs and counts a record that fails its CRC or layout check outside the recovery scan: its
    /// message cannot be read, which must not pass unnoticed.
    pub(crate) fn corrupt_record(&self, offset: u64, reason: &str) {
        let file = self.log.segment_path(offset).map(|p| p.display().to_string()).unwrap_or_default();
        error!(%file, offset, %reason, "commit log: damaged record; its message cannot be read");
        self.corrupt_records.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Damaged records met outside the recovery scan since open.
    pub fn corrupt_records(&self) -> u64 {
        self.corrupt_records.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Deletes every derived file and re-derives it from the start of the log; cursors survive.
    fn rebuild(&mut self, cp: &Checkpoint) -> Result<()> {
        self.levels.clear();
        self.topics.clear();
        // Pauses come back from their records (reclaim keeps the one in effect in the log).
        self.paused.clear();
        self.push.clear();
        self.lru.clear();
        let cq_root = self.dir.join("cq");
        if cq_root.exists() {
            super::io::remove_dir_all(&cq_root).map_err(|e| Error::io_at("remove", &cq_root, e))?;
        }
        let index_path = self.dir.join("index").join("ids");
        remove_index_files(&index_path)?;
        self.index = IdIndex::open(&index_path, self.cfg.index_initial_slots)?;
        self.dispatched = self.log.start();
        let per_file = self.cfg.cq_entries_per_file;
        // The log may have lost its oldest segments since the queues were made, so rebuilt queues
        // need not match the old ones entry for entry: readers start again at entry 0. That is
        // safe because every entry is checked against the index slot (seq and state) when read,
        // so entries of messages already handled are skipped, never delivered twice or early.
        for q in &cp.queues {
            match q.kind {
                QueueKind::Level => {
                    if let Ok(ms) = q.name.parse::<u64>() {
                        let cq = ConsumeQueue::open(&level_dir(&self.dir, ms), per_file, Some(0))?;
                        self.levels.insert(ms, LevelQueue { cq, cursor: 0 });
                    }
                }
                QueueKind::Topic => {
                    let cq = ConsumeQueue::new_closed(&topic_dir(&self.dir, &q.name), per_file);
                    self.topics.insert(q.name.clone(), TopicQueue::new(cq, 0, 0, 0, 0));
                }
            }
        }
        Ok(())
    }

    /// The level queue for `level_ms`, created on first use.
    pub fn level_queue(&mut self, level_ms: u64) -> Result<&mut LevelQueue> {
        if !self.levels.contains_key(&level_ms) {
            let cq =
                ConsumeQueue::open(&level_dir(&self.dir, level_ms), self.cfg.cq_entries_per_file, Some(0))?;
            self.levels.insert(level_ms, LevelQueue { cq, cursor: 0 });
        }
        self.levels.get_mut(&level_ms).ok_or_else(|| Error::Unavailable("level queue vanished".into()))
    }

    /// The topic's queue state, created on first use without touching the disk (a topic whose
    /// only use is a counter never gets a directory).
    fn topic_state(&mut self, topic: &str) -> Result<&mut TopicQueue> {
        if !self.topics.contains_key(topic) {
            let cq = ConsumeQueue::new_closed(&topic_dir(&self.dir, topic), self.cfg.cq_entries_per_file);
            // Dispatch creates queues, and it is applying the record at `dispatched` right now.
            self.topics.insert(topic.to_string(), TopicQueue::new(cq, 0, 0, 0, self.dispatched));
        }
        self.topics.get_mut(topic).ok_or_else(|| Error::Unavailable("topic queue vanished".into()))
    }

    /// The topic's queue with its files open, marked most recently used. Past `open_queues` the
    /// least recently used queue is closed: it keeps its lengths, cursor and counters in memory,
    /// and its unsynced entries are synced by path at the next checkpoint.
    fn topic_open(&mut self, topic: &str) -> Result<&mut TopicQueue> {
        self.topic_state(topic)?;
        let Some(q) = self.topics.get_mut(topic) else {
            return Err(Error::Unavailable("topic queue vanished".into()));
        };
        let had = q.lru;
        if had != Some(self.lru_tick) {
            q.cq.reopen()?;
            self.lru_tick += 1;
            q.lru = Some(self.lru_tick);
            if let Some(old) = had {
                self.lru.remove(&old);
            }
            self.lru.insert(self.lru_tick, topic.to_string());
            while self.lru.len() > self.cfg.open_queues.max(1) {
                let Some((_, name)) = self.lru.pop_first() else { break };
                if let Some(q) = self.topics.get_mut(&name) {
                    q.cq.close();
                    q.lru = None;
                }
            }
        }
        self.topic_state(topic)
    }

    /// The entry at `topic`'s cursor and its index, without moving the cursor (the caller moves it
    /// with [`advance_cursor`](Self::advance_cursor) once the entry's outcome is appended); opens
    /// the queue's files only when there is an entry to read.
    pub fn peek_entry(&mut self, topic: &str) -> Result<Option<(u64, Entry)>> {
        match self.topics.get(topic) {
            Some(q) if q.cursor < q.cq.len() => {}
            _ => return Ok(None),
        }
        let q = self.topic_open(topic)?;
        let at = q.cursor;
        Ok(q.cq.get(at).map(|e| (at, e)))
    }

    /// Entries `[from, from + max)` of a queue (clipped to what its files hold), with their
    /// indexes; `len` is where the queue ends now.
    pub fn read_entries(
        &mut self,
        queue: &QueueRef<'_>,
        from: u64,
        max: u64,
    ) -> Result<(Vec<(u64, Entry)>, u64)> {
        let cq = match queue {
            QueueRef::Topic(t) => {
                if !self.topics.contains_key(*t) {
                    return Ok((Vec::new(), 0));
                }
                &self.topic_open(t)?.cq
            }
            QueueRef::Level(ms) => match self.levels.get(ms) {
                Some(q) => &q.cq,
                None => return Ok((Vec::new(), 0)),
            },
        };
        let from = from.max(cq.first());
        let to = from.saturating_add(max).min(cq.len());
        Ok(((from..to).filter_map(|i| cq.get(i).map(|e| (i, e))).collect(), cq.len()))
    }

    /// Where a topic's reader stands (0 for a topic without a queue).
    pub fn topic_cursor(&self, topic: &str) -> u64 {
        self.topics.get(topic).map_or(0, |q| q.cursor)
    }

    /// Moves `topic`'s cursor past entry `at` (read with [`peek_entry`](Self::peek_entry)).
    pub fn advance_cursor(&mut self, topic: &str, at: u64) {
        if let Some(q) = self.topics.get_mut(topic) {
            if q.cursor == at {
                q.cursor += 1;
            }
        }
    }

    /// Checks a queue entry against the CRC-checked record it points to: the record must exist,
    /// have the entry's size, and route to this queue (for a level, at the entry's due time; for a
    /// topic, the message's topic and home). Queue files carry no checksum of their own; this
    /// check costs no disk and catches any damaged entry before it is acted on.
    pub fn check_entry(&self, queue: &QueueRef<'_>, entry: &Entry) -> EntryCheck {
        let bad = |why: String| EntryCheck::Bad(why);
        if entry.offset < self.log.start() {
            // Its record was reclaimed: the message was carried forward or expired.
            return EntryCheck::Stale;
        }
        if entry.size == 0 || entry.offset >= self.dispatched {
            return bad(format!("entry points at log offset {} past the dispatched log", entry.offset));
        }
        let rec = match self.read_checked(entry.offset) {
            Ok(Some(rec)) => rec,
            Ok(None) => return EntryCheck::CorruptRecord,
            Err(why) => return bad(why),
        };
        if self.log.record_len(entry.offset) != u64::from(entry.size) {
            return bad(format!("entry size {} differs from the record at {}", entry.size, entry.offset));
        }
        match self.routed(entry.offset, entry.size, &rec) {
            Ok(Routed::To(target, e)) if target.is(queue) && e.tag == entry.tag => EntryCheck::Valid,
            Ok(Routed::Reclaimed) => EntryCheck::Stale,
            Ok(Routed::Damaged) => EntryCheck::CorruptRecord,
            Ok(Routed::To(..)) | Ok(Routed::Nowhere) => {
                bad(format!("the record at {} does not route to this queue with this tag", entry.offset))
            }
            Err(why) => bad(why),
        }
    }

    /// The queue and entry a record's dispatch appends (None for routes that append nothing, and
    /// for changes of a message whose record was reclaimed: dispatch skips those too).
    fn routed(&self, offset: u64, size: u32, rec: &Record<'_>) -> std::result::Result<Routed, String> {
        let main_or_dlq = |topic: &[u8], home: Home| {
            let topic = String::from_utf8_lossy(topic).into_owned();
            match home {
                Home::Main => topic,
                Home::DeadLetter => dead_letter_topic(&topic),
            }
        };
        let (route, topic, tag) = match rec {
            Record::Put(p) => (p.route, Some(main_or_dlq(p.topic, Home::Main)), p.deliver_at_ms),
            Record::Carry(c) => (c.put.route, Some(main_or_dlq(c.put.topic, c.home)), c.deliver_at_ms),
            Record::Transition(t) if t.msg_offset < self.log.start() => return Ok(Routed::Reclaimed),
            Record::Transition(t) => {
                let topic = match self.read_checked(t.msg_offset)? {
                    Some(Record::Put(p)) => main_or_dlq(p.topic, t.home),
                    Some(Record::Carry(c)) => main_or_dlq(c.put.topic, t.home),
                    Some(_) => {
                        return Err(format!("no message at {} for the change at {offset}", t.msg_offset))
                    }
                    None => return Ok(Routed::Damaged),
                };
                (t.route, Some(topic), t.deliver_at_ms)
            }
            Record::Hop(h) if h.msg_offset < self.log.start() => return Ok(Routed::Reclaimed),
            Record::Hop(h) => (h.route, None, 0),
            Record::Pause(_) | Record::Push(_) | Record::EndOfSegment => return Ok(Routed::Nowhere),
        };
        Ok(match (route, topic) {
            (Route::Topic, Some(t)) => Routed::To(Target::Topic(t), Entry { offset, size, tag }),
            (Route::Level { level_ms, due_ms }, _) => {
                Routed::To(Target::Level(level_ms), Entry { offset, size, tag: due_ms })
            }
            _ => Routed::Nowhere,
        })
    }

    /// Repairs a queue whose entry `bad` failed [`check_entry`](Self::check_entry): from the last
    /// entry before it that checks out, every entry is derived again from the log (the records
    /// after that entry's record that route to the queue). Returns the index readers must restart
    /// from; entries of messages already handled are skipped when read, so re-reading is safe.
    pub fn repair_queue(&mut self, queue: &QueueRef<'_>, bad: u64, why: &str) -> Result<u64> {
        let (first, created_at) = match queue {
            QueueRef::Topic(t) => {
                let q = self.topic_open(t)?;
                (q.cq.first(), q.created_at)
            }
            QueueRef::Level(ms) => (self.level_queue(*ms)?.cq.first(), 0),
        };
        let cq = match queue {
            QueueRef::Topic(t) => &self.topics[*t].cq,
            QueueRef::Level(ms) => &self.levels[ms].cq,
        };
        let old_len = cq.len();
        // The last good entry before the damage bounds the scan: the log is never read twice over.
        let mut keep = first;
        let mut from = self.log.start().max(created_at);
        for i in (first..bad.min(cq.len())).rev() {
            if let Some(e) = cq.get(i) {
                if e.offset >= self.log.start() && self.check_entry(queue, &e) == EntryCheck::Valid {
                    keep = i + 1;
                    from = e.offset + u64::from(e.size);
                    break;
                }
            }
        }
        let mut entries = Vec::new();
        let mut at = from;
        while at < self.dispatched {
            let Some((offset, rec, next)) = self.log.next(at)? else { break };
            if let Ok(Routed::To(target, e)) = self.routed(offset, (next - offset) as u32, &rec) {
                if target.is(queue) {
                    entries.push(e);
                }
            }
            at = next;
        }
        let cq = match queue {
            QueueRef::Topic(t) => &mut self.topic_open(t)?.cq,
            QueueRef::Level(ms) => &mut self.level_queue(*ms)?.cq,
        };
        cq.rewrite_from(keep, &entries)?;
        let new_len = cq.len();
        match queue {
            QueueRef::Topic(t) => {
                if let Some(q) = self.topics.get_mut(*t) {
                    q.cursor = q.cursor.min(keep);
                }
            }
            QueueRef::Level(ms) => {
                if let Some(q) = self.levels.get_mut(ms) {
                    q.cursor = q.cursor.min(keep);
                }
            }
        }
        error!(
            queue = %queue,
            entry = bad,
            %why,
            kept = keep,
            rewritten = entries.len(),
            old_len,
            new_len,
            from_log_offset = from,
            "consume queue damaged; repaired it from the commit log (readers restart at the last good entry)"
        );
        Ok(keep)
    }

    /// Drops a topic from the map and deletes its files and directory; returns how many files.
    pub(super) fn forget_topic(&mut self, topic: &str) -> Result<usize> {
        let Some(q) = self.topics.remove(topic) else { return Ok(0) };
        if let Some(key) = q.lru {
            self.lru.remove(&key);
        }
        q.cq.remove()
    }

    /// Topic queues whose files are open now (at most `open_queues`).
    pub fn open_topic_queues(&self) -> usize {
        self.lru.len()
    }

    /// Appends a record to the log and dispatches it at once, so reads see their own writes.
    ///
    /// The files the record's dispatch writes to are opened, created or grown first, and the log
    /// makes room before it writes: so running out of disk space or file handles fails the call
    /// with nothing changed, and a retry may succeed. A failure after the record is in the log
    /// leaves queues and index half-updated, which poisons the store.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.prepare_dispatch(record)?;
        let at = self.log.append(record)?;
        if let Err(e) = self.dispatch() {
            return Err(self.durability.poison(Failure::from_error(&e)));
        }
        Ok(at)
    }

    /// Gets the queue file the record's dispatch appends to ready (see [`append`](Self::append)).
    /// State changes (not new messages) may use the reserve when the disk is full.
    fn prepare_dispatch(&mut self, record: &[u8]) -> Result<()> {
        enum Target {
            Level(u64),
            Topic(String),
        }
        // Records handed to append are the engine's own; a bad one fails in dispatch instead.
        let Ok((rec, _)) = format::decode(record) else { return Ok(()) };
        let grows = matches!(rec, Record::Put(_) | Record::Carry(_));
        let home_queue = |home: Home, topic: String| match home {
            Home::Main => topic,
            Home::DeadLetter => dead_letter_topic(&topic),
        };
        let target = match (&rec, rec.route()) {
            (_, Route::Level { level_ms, .. }) => Target::Level(level_ms),
            (Record::Put(p), Route::Topic) => Target::Topic(String::from_utf8_lossy(p.topic).into_owned()),
            (Record::Carry(c), Route::Topic) => {
                Target::Topic(home_queue(c.home, String::from_utf8_lossy(c.put.topic).into_owned()))
            }
            (Record::Transition(t), Route::Topic) if t.msg_offset >= self.log.start() => {
                Target::Topic(home_queue(t.home, self.topic_of(t.msg_offset)?))
            }
            _ => return Ok(()),
        };
        let reserve = self.reserve.clone();
        let mut prepare = || match &target {
            Target::Level(ms) => self.level_queue(*ms)?.cq.prepare_append(),
            Target::Topic(q) => self.topic_open(q)?.cq.prepare_append(),
        };
        if grows {
            prepare()
        } else {
            reserve.retry_on_full_disk(prepare)
        }
    }

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

    /// Applies every record between the dispatch position and the log end; returns how many.
    pub fn dispatch(&mut self) -> Result<u64> {
        let mut n = 0;
        while let Some((offset, next)) = self.dispatch_one(self.dispatched)? {
            debug_assert!(next > offset);
            self.dispatched = next;
            n += 1;
        }
        Ok(n)
    }

    fn dispatch_one(&mut self, at: u64) -> Result<Option<(u64, u64)>> {
        let Some((offset, rec, next)) = self.log.next(at)? else { return Ok(None) };
        let size = (next - offset) as u32;
        // Owned copies end the borrow of the log before queues and index are touched.
        match rec {
            Record::Put(p) => {
                let hash = format::id_hash(p.id);
                let topic = String::from_utf8_lossy(p.topic).into_owned();
                let (route, deliver_at) = (p.route, p.deliver_at_ms);
                if p.replaces {
                    let id = p.id.to_vec();
                    self.forget_others(hash, &id, offset);
                }
                // Live appends are dispatched exactly once and the engine already checked the id, so
                // only a replay after a crash can meet a Put that is indexed already.
                if !self.recovering || self.index.find(hash, |m| m == offset).is_none() {
                    let state = if route == Route::Topic { State::Ready } else { State::Delayed };
                    self.index.insert(Slot {
                        hash,
                        msg_offset: offset,
                        last_offset: offset,
                        seq: 0,
                        attempt: 0,
                        state,
                        home: Home::Main,
                    })?;
                    self.live_bytes += u64::from(size);
                    self.segs.add(&self.log, offset, u64::from(size));
                }
                // Counters move by the record alone (a replay starts from the checkpoint's counts).
                let state = if route == Route::Topic { State::Ready } else { State::Delayed };
                self.count(&topic, state, true)?;
                self.route(route, &topic, Entry { offset, size, tag: deliver_at })?;
            }
            Record::Carry(c) => {
                let hash = format::id_hash(c.put.id);
                let topic = String::from_utf8_lossy(c.put.topic).into_owned();
                let (prev, route, deliver_at) = (c.prev_msg_offset, c.put.route, c.deliver_at_ms);
                if self.recovering && !self.replayed_hops.is_empty() {
                    // The message's timer restarts from the Carry; records naming `prev` are stale.
                    self.replayed_hops.remove(&(prev, c.seq));
                }
                let slot = Slot {
                    hash,
                    msg_offset: offset,
                    last_offset: offset,
                    seq: c.seq,
                    attempt: c.attempt.min(u32::from(u16::MAX)) as u16,
                    state: c.state,
                    home: c.home,
                };
                let here = self.index.find(hash, |m| m == offset).is_some();
                match self.index.find(hash, |m| m == prev) {
                    // A replay re-inserted the message at its old record while the slot had moved
                    // on to this Carry already: drop the resurrected copy, the moved slot is newer.
                    Some((at, _)) if here => self.index.remove(at),
                    Some((at, old)) => {
                        if old.last_offset < offset {
                            self.index.update(at, slot);
                            let prev_len = self.log.record_len(prev);
                            self.live_bytes = (self.live_bytes + u64::from(size)).saturating_sub(prev_len);
                            self.segs.sub(&self.log, prev, prev_len);
                            self.segs.add(&self.log, offset, u64::from(size));
                        }
                    }
                    None if here => {}
                    // The replaced record is gone (a rebuild from a reclaimed log): the Carry alone
                    // holds the message.
                    None => {
                        self.index.insert(slot)?;
                        self.live_bytes += u64::from(size);
                        self.segs.add(&self.log, offset, u64::from(size));
                    }
                }
                let queue = match c.home {
                    Home::Main => topic,
                    Home::DeadLetter => dead_letter_topic(&topic),
                };
                // Moving a message changes no count, unless the record it replaces is gone from the
                // log: then this is a rebuild, which never met the message before. (A replay after
                // a crash never meets such a Carry: its segment goes only after a checkpoint that
                // covers the Carry is durable. The index cannot tell, as it may be ahead.)
                if prev < self.log.start() {
                    self.count(&queue, c.state, true)?;
                }
                self.route(route, &queue, Entry { offset, size, tag: deliver_at })?;
            }
            // Records of a message whose Put or Carry is in a reclaimed segment are history: the
            // message was carried forward (a later Carry holds it) or expired.
            Record::Transition(t) if t.msg_offset < self.log.start() => {}
            Record::Hop(h) if h.msg_offset < self.log.start() => {}
            Record::Transition(t) => {
                if self.recovering && !self.replayed_hops.is_empty() {
                    // The timer of the previous seq ended with this change.
                    self.replayed_hops.remove(&(t.msg_offset, t.seq.wrapping_sub(1)));
                }
                let topic = self.topic_of(t.msg_offset)?;
                if let Some((at, mut slot)) = self.index.find(t.id_hash, |m| m == t.msg_offset) {
                    if slot.last_offset < offset {
                        self.segs.state(&self.log, slot.msg_offset, slot.state, t.state);
                        slot.last_offset = offset;
                        slot.seq = t.seq;
                        slot.attempt = t.attempt.min(u16::MAX as u32) as u16;
                        slot.state = t.state;
                        slot.home = t.home;
                        self.index.update(at, slot);
                    }
                } else if !self.recovering {
                    warn!(
                        offset,
                        msg_offset = t.msg_offset,
                        "transition for a message missing from the index"
                    );
                }
                let queue = match t.home {
                    Home::Main => topic.clone(),
                    Home::DeadLetter => dead_letter_topic(&topic),
                };
                // Counters move by the record alone, so replay after a crash counts each change once.
                let prev_queue = match t.cause {
                    Cause::DeadLetter => topic.clone(),
                    Cause::Redrive => dead_letter_topic(&topic),
                    _ => queue.clone(),
                };
                self.count(&prev_queue, t.prev_state, false)?;
                self.count(&queue, t.state, true)?;
                if t.cause == Cause::DeadLetter {
                    self.topic_state(&topic)?.dead += 1;
                }
                self.route(t.route, &queue, Entry { offset, size, tag: t.deliver_at_ms })?;
            }
            Record::Hop(h) => {
                if self.recovering {
                    self.replayed_hops.insert((h.msg_offset, h.seq), (h.id_hash, offset));
                }
                self.route(h.route, "", Entry { offset, size, tag: 0 })?;
            }
            Record::Pause(p) => {
                let topic = String::from_utf8_lossy(p.topic).into_owned();
                let prev = if p.paused {
                    self.segs.add(&self.log, offset, u64::from(size));
                    self.paused.insert(topic, offset)
                } else {
                    self.paused.remove(&topic)
                };
                if let Some(prev) = prev {
                    let len = self.log.record_len(prev);
                    self.segs.sub(&self.log, prev, len);
                }
            }
            Record::Push(p) => {
                let topic = String::from_utf8_lossy(p.topic).into_owned();
                let prev = if p.target == format::PushTarget::None {
                    self.push.remove(&topic)
                } else {
                    self.segs.add(&self.log, offset, u64::from(size));
                    self.push.insert(topic, offset)
                };
                if let Some(prev) = prev {
                    let len = self.log.record_len(prev);
                    self.segs.sub(&self.log, prev, len);
                }
                self.push_changes += 1;
            }
            Record::EndOfSegment => {}
        }
        Ok(Some((offset, next)))
    }

    /// One message of `queue` entered (`up`) or left `state`'s counter; final states count nowhere.
    fn count(&mut self, queue: &str, state: State, up: bool) -> Result<()> {
        if state.is_final() {
            return Ok(());
        }
        if let Some(c) = self.topic_state(queue)?.counter(state) {
            *c = if up { *c + 1 } else { c.saturating_sub(1) };
        }
        Ok(())
    }

    /// Removes every slot of an older message with id `id` than the one at `offset`: a replacing
    /// Put took its id. The engine cancelled such a message first, so it is final and counts in
    /// no queue; its entries left in queues find no slot and are skipped. Idempotent, so a replay
    /// over an index that already lost the slot changes nothing.
    fn forget_others(&mut self, hash: u64, id: &[u8], offset: u64) {
        loop {
            let log = &self.log;
            let found = self.index.find_slot(hash, |s| {
                // Only older messages: on a replay over an index that is ahead, a later message
                // with this id (replaced after this one) keeps its slot.
                s.msg_offset < offset
                    && match log.read(s.msg_offset) {
                        Ok((Record::Put(p), _)) => p.id == id,
                        Ok((Record::Carry(c), _)) => c.put.id == id,
                        _ => false,
                    }
            });
            let Some((at, old)) = found else { return };
            if !matches!(old.state, State::Done | State::Cancelled) {
                warn!(offset, old = old.msg_offset, state = ?old.state, "a replacing put met a live message with its id");
            }
            self.index.remove(at);
            let len = self.log.record_len(old.msg_offset);
            self.live_bytes = self.live_bytes.saturating_sub(len);
            self.segs.sub(&self.log, old.msg_offset, len);
        }
    }

    fn route(&mut self, route: Route, topic: &str, mut entry: Entry) -> Result<()> {
        match route {
            Route::None => {}
            Route::Topic => {
                self.topic_open(topic)?.cq.append(entry)?;
                if !self.touched.iter().any(|t| t == topic) {
                    self.touched.push(topic.to_string());
                }
            }
            Route::Level { level_ms, due_ms } => {
                entry.tag = due_ms;
                self.level_queue(level_ms)?.cq.append(entry)?;
            }
        }
        Ok(())
    }

    /// Reads the message whose Put (or Carry) record is at `msg_offset`.
    pub fn put_at(&self, msg_offset: u64) -> Result<Put<'_>> {
        match self.log.read(msg_offset)?.0 {
            Record::Put(p) => Ok(p),
            Record::Carry(c) => Ok(c.put),
            _ => Err(Error::NotFound(format!("no message at offset {msg_offset}"))),
        }
    }

    /// The due time the slot's last state change set: when a delayed message becomes ready, when a
    /// reservation expires, or when a ready message became ready.
    pub fn deliver_at(&self, slot: &Slot) -> Result<u64> {
        Ok(deliver_at_of(&self.log.read(slot.last_offset)?.0))
    }

    /// The due time a message had, for an ack or cancel to keep: when it was to become (or
    /// became) ready, or for a reserved message when the delivery it holds fell due.
    pub fn due_at(&self, slot: &Slot) -> Result<u64> {
        let rec = self.log.read(slot.last_offset)?.0;
        Ok(match &rec {
            Record::Transition(t) => match (t.due_ms, t.state) {
                (Some(due), _) => due,
                // A version 1 Reserve (an older delayd) did not record its due time; the time of
                // the pop is the closest at hand and never before it.
                (None, State::Reserved) => t.time_ms,
                (None, _) => t.deliver_at_ms,
            },
            other => deliver_at_of(other),
        })
    }

    /// The queue the message in `slot` belongs to now: its topic, or the topic's `.dlq`.
    pub fn queue_of(&self, slot: &Slot) -> Result<String> {
        let topic = self.topic_of(slot.msg_offset)?;
        Ok(match slot.home {
            Home::Main => topic,
            Home::DeadLetter => dead_letter_topic(&topic),
        })
    }

    /// Sum of the record sizes of every indexed message (recount after recovery).
    pub(crate) fn count_live_bytes(&self) -> u64 {
        let mut sum = 0;
        self.index.for_each(|s| sum += self.log.record_len(s.msg_offset));
        sum
    }

    fn topic_of(&self, msg_offset: u64) -> Result<String> {
        Ok(String::from_utf8_lossy(self.put_at(msg_offset)?.topic).into_owned())
    }

    /// Finds a message by id: its slot, checked against the id in its Put record. A final message
    /// that became final at or before `expired_at_ms` is past `done_retention` and not found, even
    /// while the expiry walk has not reached it yet (a carried final message is reached late).
    pub fn find_id(&self, id: &[u8], expired_at_ms: u64) -> Option<(SlotRef, Slot)> {
        let hash = format::id_hash(id);
        self.index.find_slot(hash, |s| {
            self.put_at(s.msg_offset).is_ok_and(|p| p.id == id) && !self.is_expired(s, expired_at_ms)
        })
    }

    /// When a final message became final: the time of its final Transition, or of the Carry that
    /// moved it (which keeps that time); `None` for a message that is not final.
    pub fn final_at(&self, slot: &Slot) -> Result<Option<u64>> {
        if !slot.state.is_final() {
            return Ok(None);
        }
        Ok(match self.log.read(slot.last_offset)?.0 {
            Record::Transition(t) => Some(t.time_ms),
            Record::Carry(c) => Some(c.time_ms),
            _ => None,
        })
    }

    /// A final message whose final change is at or before `cutoff_ms`. A record that cannot be read
    /// counts as not expired: the message stays visible rather than vanish on a damaged file.
    pub(crate) fn is_expired(&self, slot: &Slot, cutoff_ms: u64) -> bool {
        matches!(self.final_at(slot), Ok(Some(t)) if t <= cutoff_ms)
    }

    /// Finds a message by its Put offset and id hash.
    pub fn find_offset(&self, hash: u64, msg_offset: u64) -> Option<(SlotRef, Slot)> {
        self.index.find(hash, |m| m == msg_offset)
    }

    /// Per topic queue: (ready, reserved, delayed) as counted, leaving out all-zero queues.
    pub fn state_counts(&self) -> BTreeMap<String, (u64, u64, u64)> {
        self.topics
            .iter()
            .map(|(n, q)| (n.clone(), (q.ready, q.reserved, q.delayed)))
            .filter(|(_, c)| *c != (0, 0, 0))
            .collect()
    }

    /// [`state_counts`](Self::state_counts) worked out from scratch, one index slot and Put at a
    /// time: what the counters must equal. For tests; it reads every live message.
    pub fn recount_states(&self) -> Result<BTreeMap<String, (u64, u64, u64)>> {
        let mut slots = Vec::new();
        self.index.for_each(|s| slots.push(s));
        let mut out: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for s in slots {
            let c = out.entry(self.queue_of(&s)?).or_default();
            match s.state {
                State::Ready | State::Dead => c.0 += 1,
                State::Reserved => c.1 += 1,
                State::Delayed => c.2 += 1,
                State::Done | State::Cancelled => {}
            }
        }
        out.retain(|_, c| *c != (0, 0, 0));
        Ok(out)
    }

    /// Wakes the topic's waiting pops as if it got an entry (it was resumed).
    pub fn touch(&mut self, topic: &str) {
        self.touched.push(topic.to_string());
    }

    /// Topics that got new entries since the last call.
    pub fn take_touched(&mut self) -> Vec<String> {
        std::mem::take(&mut self.touched)
    }

    /// Makes the log durable.
    pub fn flush_log(&mut self) -> Result<()> {
        self.log.flush()
    }

    /// The state a checkpoint records; `level_cursors` are the schedulers' handled prefixes (they
    /// own that state between checkpoints).
    fn snapshot(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Checkpoint {
        let mut queues = Vec::with_capacity(self.levels.len() + self.topics.len());
        for (ms, q) in self.levels.iter_mut() {
            if let Some(c) = level_cursors.get(ms) {
                q.cursor = *c;
            }
            queues.push(QueueState {
                kind: QueueKind::Level,
                name: ms.to_string(),
                len: q.cq.len(),
                cursor: q.cursor,
                reserved: 0,
                dead: 0,
                delayed: 0,
                ready: 0,
            });
        }
        let mut names: Vec<&String> = self.topics.keys().collect();
        names.sort();
        for name in names {
            let q = &self.topics[name];
            queues.push(QueueState {
                kind: QueueKind::Topic,
                name: name.clone(),
                len: q.cq.len(),
                cursor: q.cursor,
                reserved: q.reserved,
                dead: q.dead,
                delayed: q.delayed,
                ready: q.ready,
            });
        }
        self.snapshots += 1;
        let paused = self.paused.iter().map(|(t, o)| (t.clone(), *o)).collect();
        let push = self.push.iter().map(|(t, o)| (t.clone(), *o)).collect();
        Checkpoint { dispatched: self.dispatched, queues, paused, push, serial: self.snapshots }
    }

    /// Flushes everything and records the dispatch position, queue lengths and cursors.
    pub fn checkpoint(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<()> {
        let cp = self.write_checkpoint(level_cursors)?;
        if self.cfg.reclaim {
            self.checkpoint_durable(&cp)?;
        }
        Ok(())
    }

    /// Makes every file durable, then replaces the checkpoint; returns what it wrote.
    fn write_checkpoint(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<Checkpoint> {
        self.log.flush()?;
        let cp = self.snapshot(level_cursors);
        for q in self.levels.values_mut() {
            q.cq.flush()?;
        }
        for q in self.topics.values_mut() {
            q.cq.flush()?;
        }
        self.index.flush()?;
        self.cp_log_end = self.dispatched;
        let path = self.dir.join("checkpoint");
        self.reserve.retry_on_full_disk(|| cp.store(&path))?;
        Ok(cp)
    }

    /// Like [`checkpoint`](Self::checkpoint), but hands the fdatasyncs and the write to the caller
    /// (a background thread), so the engine never stalls on them.
    pub fn checkpoint_job(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<CheckpointJob> {
        // Everything fallible first: a failure here changes nothing.
        let mut files = self.log.handles(self.cp_log_end, self.dispatched)?;
        self.index.take_handles(&mut files)?;
        let checkpoint = self.snapshot(level_cursors);
        let mut queue_files = Vec::new();
        let mut captured = Captured { log_end: self.dispatched, queues: Vec::new() };
        for (ms, q) in &self.levels {
            q.cq.dirty_paths(&mut queue_files);
            captured.queues.push((QueueKind::Level, ms.to_string(), 0, q.cq.len()));
        }
        for (name, q) in &self.topics {
            q.cq.dirty_paths(&mut queue_files);
            captured.queues.push((QueueKind::Topic, name.clone(), q.created_at, q.cq.len()));
        }
        Ok(CheckpointJob {
            checkpoint,
            files,
            queue_files,
            path: self.dir.join("checkpoint"),
            captured,
            reserve: self.reserve.clone(),
        })
    }

    /// A checkpoint job ran: the log and queue files it synced count as durable up to what it
    /// captured (a queue forgotten and made again since is a namesake, and is left alone).
    pub fn checkpoint_synced(&mut self, c: &Captured) {
        self.cp_log_end = self.cp_log_end.max(c.log_end);
        for (kind, name, created_at, len) in &c.queues {
            match kind {
                QueueKind::Level => {
                    if let Some(q) = name.parse().ok().and_then(|ms: u64| self.levels.get_mut(&ms)) {
                        q.cq.mark_flushed(*len);
                    }
                }
                QueueKind::Topic => {
                    if let Some(q) = self.topics.get_mut(name).filter(|q| q.created_at == *created_at) {
                        q.cq.mark_flushed(*len);
                    }
                }
            }
        }
    }

    /// Final checkpoint plus the clean-shutdown marker.
    pub fn close(mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<()> {
        // A checkpoint may let emptied topics go (a slice at a time); checkpointing until none goes
        // leaves a directory whose checkpoint lists exactly the queues on disk.
        loop {
            let forgotten = self.reclaim.stats.topics_forgotten;
            self.checkpoint(level_cursors)?;
            if self.reclaim.stats.topics_forgotten == forgotten {
                break;
            }
        }
        let end = self.log.end();
        self.reserve
            .retry_on_full_disk(|| checkpoint::write_clean_marker(&self.dir.join("clean_shutdown"), end))
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

/// The due time a record sets: when a delayed message becomes ready, when a reservation expires,
/// when a ready message became ready (0 for records of no message).
fn deliver_at_of(rec: &Record<'_>) -> u64 {
    match rec {
        Record::Put(p) => p.deliver_at_ms,
        Record::Transition(t) => t.deliver_at_ms,
        Record::Carry(c) => c.deliver_at_ms,
        Record::Hop(h) => h.target_ms,
        Record::Pause(_) | Record::Push(_) | Record::EndOfSegment => 0,
    }
}
