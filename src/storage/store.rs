//! The store: one commit log plus everything derived from it (consume queues, id index, counters),
//! the dispatcher that derives them, checkpoints and crash recovery.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::checkpoint::{self, Captured, Checkpoint, CheckpointJob, QueueKind, QueueState};
use super::commitlog::{CommitLog, RecoveryMode, RecoveryReport};
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
        TopicQueue { cq, cursor, reserved, dead, lru: None, created_at }
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
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(format!("remove {}", path.display()), e))
            }
            _ => {}
        }
    }
    Ok(())
}

fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("remove {}", dir.display()), e))
        }
        _ => Ok(()),
    }
}

/// The dead-letter topic of `topic`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

impl Store {
    /// Opens (or creates) the data directory, recovering from whatever state it was left in.
    pub fn open(dir: &Path, cfg: StoreConfig) -> Result<(Store, OpenReport)> {
        fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let lock = DirLock::acquire(&dir.join("LOCK"))?;
        let durability = Durability::register(dir);
        let reserve = Reserve::new(dir);
        let clean_end = checkpoint::take_clean_marker(&dir.join("clean_shutdown"))?;
        let cp = Checkpoint::load(&dir.join("checkpoint"))?;
        let (log, log_report) = CommitLog::open(
            &dir.join("commitlog"),
            cfg.segment_bytes,
            cp.dispatched,
            clean_end,
            cfg.recovery,
        )?;
        let mut report = OpenReport { clean: clean_end.is_some(), log: log_report, ..Default::default() };

        let index_path = dir.join("index").join("ids");
        fs::create_dir_all(dir.join("index")).map_err(|e| Error::io("create index dir", e))?;
        let mut rebuild = !index_path.exists() && cp.dispatched > log.start();
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
            durability,
            reserve,
        };
        let dispatched = cp.dispatched.min(store.log.end()).max(store.log.start());
        if cp.dispatched > store.log.end() {
            warn!(checkpoint = cp.dispatched, log_end = store.log.end(), "log ends before the checkpoint");
        }
        if !rebuild {
            rebuild = !store.open_queues(&cp, dispatched, &mut report)?;
        }
        if !rebuild && !report.clean && store.index_is_ahead_of_log() {
            warn!("id index holds state from records past the recovered log end; rebuilding");
            rebuild = true;
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
        store.durability.log_synced(store.log.flushed());
        store.live_bytes = store.count_live_bytes();
        store.expiry = store.log.start();
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
                self.topics.insert(q.name.clone(), TopicQueue::new(cq, 0, q.reserved, q.dead, 0));
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
                    self.topics.insert(q.name.clone(), TopicQueue::new(cq, q.cursor, q.reserved, q.dead, 0));
                    self.topic_open(&q.name)?;
                }
            }
        }
        // Queues created after the checkpoint hold only re-dispatchable entries: levels start empty,
        // topics (perhaps forgotten before the crash) go and come back if the replay names them.
        for (kind, sub) in [(QueueKind::Level, "level"), (QueueKind::Topic, "topic")] {
            let root = self.dir.join("cq").join(sub);
            let Ok(rd) = fs::read_dir(&root) else { continue };
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

    /// Walks every slot: true if one holds state from past the log end.
    fn index_is_ahead_of_log(&self) -> bool {
        let end = self.log.end();
        let mut ahead = false;
        self.index.for_each(|s| ahead |= s.last_offset >= end || s.msg_offset >= end);
        ahead
    }

    /// Deletes every derived file and re-derives it from the start of the log; cursors survive.
    fn rebuild(&mut self, cp: &Checkpoint) -> Result<()> {
        self.levels.clear();
        self.topics.clear();
        self.lru.clear();
        let cq_root = self.dir.join("cq");
        if cq_root.exists() {
            fs::remove_dir_all(&cq_root)
                .map_err(|e| Error::io(format!("remove {}", cq_root.display()), e))?;
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

    /// The entry at `topic`'s cursor, moving the cursor past it; opens the queue's files only when
    /// there is an entry to read.
    pub fn next_entry(&mut self, topic: &str) -> Result<Option<Entry>> {
        match self.topics.get(topic) {
            Some(q) if q.cursor < q.cq.len() => {}
            _ => return Ok(None),
        }
        let q = self.topic_open(topic)?;
        let entry = q.cq.get(q.cursor);
        if entry.is_some() {
            q.cursor += 1;
        }
        Ok(entry)
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

    /// Gives back the entry a pop just took with [`next_entry`](Self::next_entry), when the pop
    /// could not append its reservation.
    pub fn unread(&mut self, topic: &str) {
        if let Some(q) = self.topics.get_mut(topic) {
            q.cursor = q.cursor.saturating_sub(1).max(q.cq.first());
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
                }
                self.route(route, &topic, Entry { offset, size, tag: deliver_at })?;
            }
            Record::Carry(c) => {
                let hash = format::id_hash(c.put.id);
                let topic = String::from_utf8_lossy(c.put.topic).into_owned();
                let (prev, route, deliver_at) = (c.prev_msg_offset, c.put.route, c.deliver_at_ms);
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
                        }
                    }
                    None if here => {}
                    // The replaced record is gone (a rebuild from a reclaimed log): the Carry alone
                    // holds the message.
                    None => {
                        self.index.insert(slot)?;
                        self.live_bytes += u64::from(size);
                    }
                }
                let queue = match c.home {
                    Home::Main => topic,
                    Home::DeadLetter => dead_letter_topic(&topic),
                };
                self.route(route, &queue, Entry { offset, size, tag: deliver_at })?;
            }
            // Records of a message whose Put or Carry is in a reclaimed segment are history: the
            // message was carried forward (a later Carry holds it) or expired.
            Record::Transition(t) if t.msg_offset < self.log.start() => {}
            Record::Hop(h) if h.msg_offset < self.log.start() => {}
            Record::Transition(t) => {
                let topic = self.topic_of(t.msg_offset)?;
                if let Some((at, mut slot)) = self.index.find(t.id_hash, |m| m == t.msg_offset) {
                    if slot.last_offset < offset {
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
                let prev_queue = if t.cause == Cause::DeadLetter { topic.clone() } else { queue.clone() };
                if t.prev_state == State::Reserved {
                    let q = self.topic_state(&prev_queue)?;
                    q.reserved = q.reserved.saturating_sub(1);
                }
                if t.state == State::Reserved {
                    self.topic_state(&queue)?.reserved += 1;
                }
                if t.cause == Cause::DeadLetter {
                    self.topic_state(&topic)?.dead += 1;
                }
                self.route(t.route, &queue, Entry { offset, size, tag: t.deliver_at_ms })?;
            }
            Record::Hop(h) => {
                self.route(h.route, "", Entry { offset, size, tag: 0 })?;
            }
            Record::EndOfSegment => {}
        }
        Ok(Some((offset, next)))
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
        Ok(match self.log.read(slot.last_offset)?.0 {
            Record::Put(p) => p.deliver_at_ms,
            Record::Transition(t) => t.deliver_at_ms,
            Record::Carry(c) => c.deliver_at_ms,
            Record::Hop(h) => h.target_ms,
            Record::EndOfSegment => 0,
        })
    }

    /// Sum of the record sizes of every indexed message (recount after recovery).
    fn count_live_bytes(&self) -> u64 {
        let mut sum = 0;
        self.index.for_each(|s| sum += self.log.record_len(s.msg_offset));
        sum
    }

    fn topic_of(&self, msg_offset: u64) -> Result<String> {
        Ok(String::from_utf8_lossy(self.put_at(msg_offset)?.topic).into_owned())
    }

    /// Finds a message by id: its slot, checked against the id in its Put record.
    pub fn find_id(&self, id: &[u8]) -> Option<(SlotRef, Slot)> {
        let hash = format::id_hash(id);
        self.index.find(hash, |m| self.put_at(m).map(|p| p.id == id).unwrap_or(false))
    }

    /// Finds a message by its Put offset and id hash.
    pub fn find_offset(&self, hash: u64, msg_offset: u64) -> Option<(SlotRef, Slot)> {
        self.index.find(hash, |m| m == msg_offset)
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
            });
        }
        self.snapshots += 1;
        Checkpoint { dispatched: self.dispatched, queues, serial: self.snapshots }
    }

    /// Flushes everything and records the dispatch position, queue lengths and cursors.
    pub fn checkpoint(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<()> {
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
        if self.cfg.reclaim {
            self.checkpoint_durable(&cp)?;
        }
        Ok(())
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
