//! Opening the data directory: loading the checkpoint, checking the derived files against the
//! log, rebuilding what cannot be trusted and replaying the records past the checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;
use std::sync::atomic::AtomicU64;

use tracing::{error, info, warn};

use super::{
    level_dir, remove_dir_if_present, remove_index_files, topic_dir, LevelQueue, OpenReport, StartCheck,
    Store, StoreConfig, TopicQueue,
};
use crate::storage::reclaim::state::SegCounts;
use crate::error::{Error, Result};
use crate::storage::checkpoint::{self, Checkpoint, CheckpointDamage, QueueKind, QueueState};
use crate::storage::commitlog::{CommitLog, DurableClaim};
use crate::storage::consumequeue::ConsumeQueue;
use crate::storage::durability::Durability;
use crate::storage::format::{self, Home, Record, Route, State};
use crate::storage::index::{Counting, IdIndex, Slot};
use crate::storage::mmap::DirLock;
use crate::storage::reserve::Reserve;
use crate::storage::types::{IdHash, LogOffset, QueueIndex};

impl Store {
    /// Opens (or creates) the data directory, recovering from whatever state it was left in.
    pub fn open(dir: &Path, cfg: StoreConfig) -> Result<(Store, OpenReport)> {
        crate::storage::io::create_private_dir(dir)?;
        let lock = DirLock::acquire(&dir.join("LOCK"))?;
        let durability = Durability::new(dir);
        let reserve = Reserve::new(dir);
        let clean = checkpoint::take_clean_marker(&dir.join("clean_shutdown"), &durability)?;
        let clean_end = clean.as_ref().map(|m| m.log_end);
        let cp_path = dir.join("checkpoint");
        let (cp, cp_damaged) = load_checkpoint(&cp_path)?;
        let claims = durable_claims(dir, &cp_path, &cp, clean_end);
        let ms_since = |t: std::time::Instant| t.elapsed().as_millis() as u64;
        let started = std::time::Instant::now();
        let (log, log_report) = CommitLog::open(
            &dir.join("commitlog"),
            cfg.segment_bytes,
            cp.dispatched,
            cfg.recovery,
            &claims,
            durability.clone(),
        )?;
        // A clean close's counts describe its files at its log end: usable when the checkpoint
        // was written there and the log still ends there, so nothing is replayed over them.
        let closed = clean.and_then(|m| {
            let whole = !cp_damaged && m.log_end == cp.dispatched && m.log_end == log.end();
            m.counts.filter(|_| whole)
        });
        let trusted = closed.as_ref().filter(|_| cfg.check_on_start == StartCheck::AfterCrash);
        let full_check = cfg.check_on_start == StartCheck::Always;
        let mut report = OpenReport {
            clean: clean_end.is_some(),
            log: log_report,
            checkpoint_rebuilt: cp_damaged,
            ..Default::default()
        };

        report.took.log_ms = ms_since(started);
        let started = std::time::Instant::now();
        let index_path = dir.join("index").join("ids");
        fs::create_dir_all(dir.join("index")).map_err(|e| Error::io("create index dir", e))?;
        let rebuild = cp_damaged || (!index_path.exists() && cp.dispatched > log.start());
        // Counted by the check's pass when one runs (every start but one taking a clean close's counts).
        let counting = match trusted {
            Some(c) => Counting::Known(c.index_slots, c.index_filled, c.index_live),
            None => Counting::ByCheck,
        };
        let (index, index_unusable) = open_index(&index_path, cfg.index_initial_slots, &durability, counting)?;
        let mut store = Store::fresh(dir, cfg, lock, log, index, durability, reserve);
        let dispatched = cp.dispatched.min(store.log.end()).max(store.log.start());
        store.report_truncation(&mut report);
        report.checked = trusted.is_none();
        report.checked_records = full_check;
        let checked = store.open_derived(&cp, dispatched, rebuild || index_unusable, &mut report)?;
        // A check that did not run (a rebuild) left the index's slot counts to be made.
        store.index.count_if_needed();
        // The counts of the index as it is now; the replay moves them with every change it makes.
        match (report.rebuilt, trusted, checked) {
            (true, ..) | (false, None, None) => store.take_live_counts(SegCounts::default(), 0),
            (false, Some(closed), _) => {
                store.live_bytes = closed.live_bytes;
                store.segs = SegCounts::from_list(&closed.segments);
            }
            (false, None, Some((segs, live))) => store.take_live_counts(segs, live),
        }
        report.took.check_ms = ms_since(started);
        let started = std::time::Instant::now();
        let before = store.dispatched;
        store.replay(&mut report)?;
        store.finish_open(report.rebuilt)?;
        report.took.replay_ms = ms_since(started);
        let took = report.took;
        info!(
            clean = report.clean,
            checked = report.checked,
            checked_records = report.checked_records,
            rebuilt = report.rebuilt,
            log_end = store.log.end(),
            from = before,
            redispatched = report.redispatched,
            entries_dropped = report.entries_dropped,
            log_ms = took.log_ms,
            check_ms = took.check_ms,
            replay_ms = took.replay_ms,
            "store opened"
        );
        Ok((store, report))
    }

    /// A store over `log` and `index` with nothing derived yet: no queues, nothing dispatched.
    fn fresh(
        dir: &Path,
        cfg: StoreConfig,
        lock: DirLock,
        log: CommitLog,
        index: IdIndex,
        durability: Durability,
        reserve: Reserve,
    ) -> Store {
        Store {
            dir: dir.to_path_buf(),
            cfg,
            _lock: lock,
            log,
            levels: BTreeMap::new(),
            topics: HashMap::new(),
            paused: BTreeMap::new(),
            push: BTreeMap::new(),
            push_changes: 0,
            flow: BTreeMap::new(),
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
            replica: None,
            sealed: Default::default(),
            captured_at: None,
            seal_reported: None,
            level_appends: 0,
        }
    }

    /// In `truncate` mode, when the log lost records that were durable, says what they meant,
    /// from the index as it was (it is rebuilt after).
    fn report_truncation(&self, report: &mut OpenReport) {
        let Some(claimed) = report.log.claimed_end else { return };
        let end = self.log.end();
        let (mut lost, mut reverted) = (0u64, 0u64);
        self.index.for_each(|s| {
            if s.msg_offset.get() >= end {
                lost += 1;
            } else if s.last_offset.get() >= end {
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

    /// Opens the queues and index the checkpoint describes, up to `dispatched`, when they check
    /// out against the log; otherwise (or when `rebuild` already says so) rebuilds them from the
    /// whole log. Returns the live counts the index check made on the way (before any replay),
    /// if it ran and passed.
    fn open_derived(
        &mut self,
        cp: &Checkpoint,
        dispatched: u64,
        mut rebuild: bool,
        report: &mut OpenReport,
    ) -> Result<Option<(SegCounts, u64)>> {
        // Pauses before the checkpoint's position; later ones are replayed below.
        self.paused = cp.paused.iter().filter(|(_, at)| *at < self.log.end()).cloned().collect();
        self.push = cp.push.iter().filter(|(_, at)| *at < self.log.end()).cloned().collect();
        self.flow = cp.flow.iter().filter(|(_, at)| *at < self.log.end()).cloned().collect();
        if !rebuild {
            rebuild = !self.open_queues(cp, dispatched, report)?;
        }
        let mut counted = None;
        if !rebuild && report.checked {
            match self.index_damage(report.checked_records) {
                (Some(why), _) => {
                    warn!(%why, "id index disagrees with the commit log; rebuilding it and the queues from the log");
                    report.index_damaged = true;
                    rebuild = true;
                }
                (None, counts) => counted = Some(counts),
            }
        }
        if rebuild {
            self.rebuild(cp)?;
            report.rebuilt = true;
            counted = None;
        } else {
            self.dispatched = dispatched;
        }
        Ok(counted)
    }

    /// Re-dispatches the records past what the derived files hold.
    fn replay(&mut self, report: &mut OpenReport) -> Result<()> {
        self.recovering = true;
        report.redispatched = self.dispatch()?;
        self.recovering = false;
        // Only timers still running need their newest Hop remembered.
        let index = &self.index;
        self.replayed_hops.retain(|&(msg_offset, seq), &mut (hash, _)| {
            index.find(IdHash::new(hash), |m| m.get() == msg_offset).is_some_and(|(_, slot)| {
                slot.seq == seq && matches!(slot.state, State::Delayed | State::Reserved)
            })
        });
        Ok(())
    }

    /// Brings cursors within their queues and, after a rebuild, checkpoints the new derived files.
    fn finish_open(&mut self, rebuilt: bool) -> Result<()> {
        for q in self.levels.values_mut() {
            q.cursor = q.cursor.min(q.cq.end());
        }
        for q in self.topics.values_mut() {
            q.cursor = q.cursor.min(q.cq.end()).max(q.cq.first());
        }
        for q in self.levels.values_mut() {
            q.cursor = q.cursor.max(q.cq.first());
        }
        self.touched.clear();
        if !self.reserve.ensure() {
            warn!(
                bytes = crate::storage::reserve::RESERVE_BYTES,
                "no room for the reserve file; starting without it"
            );
        }
        self.expiry = self.log.start();
        if rebuilt {
            // The checkpoint on disk describes the derived files the rebuild replaced: until one
            // describes the new ones, a power loss would pair it with a fresh, partly unsynced
            // index and queues, and the messages only they held would be gone.
            self.write_checkpoint(&BTreeMap::new())?;
        }
        Ok(())
    }

    /// Opens queues at their checkpointed lengths; false when one is missing and a rebuild is needed.
    fn open_queues(&mut self, cp: &Checkpoint, dispatched: u64, report: &mut OpenReport) -> Result<bool> {
        for q in &cp.queues {
            if !self.open_listed_queue(q, dispatched, report)? {
                return Ok(false);
            }
        }
        self.open_unlisted_queues()
    }

    /// Opens one queue the checkpoint lists, checked against the log and cut back to
    /// `dispatched`; false when it cannot be trusted and a rebuild is needed.
    fn open_listed_queue(
        &mut self,
        q: &QueueState,
        dispatched: u64,
        report: &mut OpenReport,
    ) -> Result<bool> {
        let per_file = self.cfg.cq_entries_per_file;
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
            let cq = ConsumeQueue::new_closed(&path, per_file, &self.durability);
            let mut t = TopicQueue::new(cq, QueueIndex::new(0), q.reserved, q.dead, 0);
            (t.delayed, t.ready) = (q.delayed, q.ready);
            self.topics.insert(q.name.clone(), t);
            return Ok(true);
        }
        if q.len > 0 && !path.exists() {
            warn!(queue = %q.name, "consume queue missing; rebuilding all queues from the commit log");
            return Ok(false);
        }
        let mut cq = match ConsumeQueue::open(&path, per_file, Some(q.len), &self.durability) {
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
        let damage = if report.checked {
            self.queue_damage(&cq, QueueIndex::new(q.cursor), dispatched, report.checked_records)
        } else {
            None
        };
        if let Some((why, unwritten)) = damage {
            warn!(queue = %q.name, %why, "consume queue disagrees with the commit log; rebuilding all queues from the log");
            report.queue_damaged = true;
            if unwritten {
                report.behind_checkpoint.push(q.name.clone());
            }
            return Ok(false);
        }
        let dropped = cq.truncate_to_offset(LogOffset::new(dispatched))?;
        if dropped > 0 {
            warn!(queue = %q.name, dropped, "dropped consume-queue entries past the recovered log end");
            report.entries_dropped += dropped;
        }
        match level {
            Some(ms) => {
                self.levels.insert(ms, LevelQueue { cq, cursor: QueueIndex::new(q.cursor) });
            }
            None => {
                let mut t = TopicQueue::new(cq, QueueIndex::new(q.cursor), q.reserved, q.dead, 0);
                (t.delayed, t.ready) = (q.delayed, q.ready);
                self.topics.insert(q.name.clone(), t);
                self.topic_open(&q.name)?;
            }
        }
        Ok(true)
    }

    /// Queues created after the checkpoint hold only re-dispatchable entries: levels start empty,
    /// topics (perhaps forgotten before the crash) go and come back if the replay names them.
    /// False when such a level queue cannot be opened and a rebuild is needed.
    fn open_unlisted_queues(&mut self) -> Result<bool> {
        let per_file = self.cfg.cq_entries_per_file;
        for (kind, sub) in [(QueueKind::Level, "level"), (QueueKind::Topic, "topic")] {
            let root = self.dir.join("cq").join(sub);
            let Ok(rd) = crate::storage::io::read_dir(&root) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                match kind {
                    QueueKind::Level => {
                        if let Ok(ms) = name.parse::<u64>() {
                            if let std::collections::btree_map::Entry::Vacant(v) = self.levels.entry(ms) {
                                let Ok(cq) =
                                    ConsumeQueue::open(&e.path(), per_file, Some(0), &self.durability)
                                else {
                                    return Ok(false);
                                };
                                v.insert(LevelQueue { cq, cursor: QueueIndex::new(0) });
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
    /// must be written (`size != 0`) and ascend strictly in log offset; with `records`, the unread
    /// ones (from `cursor`) below `dispatched` must point at a record header of their `size`.
    /// Entries past `dispatched` are the torn suffix that recovery drops, which ascending order
    /// keeps a suffix. Costs one read of each queue file, and with `records` one record header per
    /// unread entry (damage to the files alone makes them disagree: a crash leaves entries below
    /// the checkpointed length as synced). The flag says the cause is an entry below the
    /// checkpointed length that was never written: the checkpoint vouched for a write nobody synced.
    fn queue_damage(
        &self,
        cq: &ConsumeQueue,
        cursor: QueueIndex,
        dispatched: u64,
        records: bool,
    ) -> Option<(String, bool)> {
        let mut prev: Option<u64> = None;
        for i in (cq.first().get()..cq.len()).map(QueueIndex::new) {
            let Some(e) = cq.get(i) else { return Some((format!("entry {i} is missing"), false)) };
            if e.size == 0 {
                return Some((
                    format!("entry {i} is unwritten (zero) below the queue length {}", cq.len()),
                    true,
                ));
            }
            let offset = e.offset.get();
            if prev.is_some_and(|p| offset <= p) {
                let why = format!("entry {i} (log offset {offset}) does not follow the previous one");
                return Some((why, false));
            }
            prev = Some(offset);
            if records && i >= cursor && offset >= self.log.start() && offset < dispatched {
                if let Some(why) = self.header_mismatch(offset, e.size) {
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
    /// live slot points outside the log (state from records a crash lost, which replay cannot
    /// undo), or, with `records`, disagrees with the records it points to (its Put or Carry must
    /// carry an id with the slot's hash; its last record must have set exactly the slot's seq,
    /// state, home and attempt: only damage to the files breaks that, as a crash leaves each slot
    /// at a record's state). Costs a read of the table, and with `records` one or two records per
    /// live slot. The same pass counts the live bytes and per-segment counts from the slots,
    /// returned with it.
    fn index_damage(&mut self, records: bool) -> (Option<String>, (SegCounts, u64)) {
        let (log, corrupt) = (&self.log, &self.corrupt_records);
        let (damage, segs, live, (filled, slots_live)) = self.check_and_count_index(|s| match records {
            true => Self::slot_damage(log, corrupt, s),
            false => Self::slot_outside_log(log, s),
        });
        if damage.is_none() {
            self.index.set_counts(filled, slots_live);
        }
        (damage, (segs, live))
    }

    /// Why slot `s` points outside the log, if it does (its records are gone, or not yet there).
    fn slot_outside_log(log: &CommitLog, s: &Slot) -> Option<String> {
        let (start, end) = (log.start(), log.end());
        let (msg_offset, last_offset) = (s.msg_offset.get(), s.last_offset.get());
        let what = || format!("slot of the message at {msg_offset} (last record {last_offset})");
        if msg_offset >= end || last_offset >= end {
            return Some(format!("{} holds state from past the log end {end}", what()));
        }
        if msg_offset < start || last_offset < msg_offset {
            return Some(format!("{} points outside the log [{start}, {end})", what()));
        }
        None
    }

    /// Why slot `s` disagrees with the log, if it does: over the log and the damage counter
    /// alone, so threads can share the pass.
    fn slot_damage(log: &CommitLog, corrupt: &AtomicU64, s: &Slot) -> Option<String> {
        let read_checked = |offset| super::reads::read_checked(log, corrupt, offset);
        let (msg_offset, last_offset, hash) = (s.msg_offset.get(), s.last_offset.get(), s.hash.get());
        // Built only for a damaged slot: this check runs over every live slot at each open.
        let what = || format!("slot of the message at {msg_offset} (last record {last_offset})");
        if let Some(why) = Self::slot_outside_log(log, s) {
            return Some(why);
        }
        let attempt = |a: u32| a.min(u32::from(u16::MAX)) as u16;
        let expect = match read_checked(msg_offset) {
            Ok(Some(Record::Put(p))) if format::id_hash(p.id) == hash => {
                let state = if p.route == Route::Topic { State::Ready } else { State::Delayed };
                (0, state, Home::Main, 0)
            }
            Ok(Some(Record::Carry(c))) if format::id_hash(c.put.id) == hash => {
                (c.seq, c.state, c.home, attempt(c.attempt))
            }
            Ok(Some(_)) => return Some(format!("{}: no message with its id hash there", what())),
            // The log itself is damaged there: not the index's fault, and already reported.
            Ok(None) => return None,
            Err(why) => return Some(format!("{}: {why}", what())),
        };
        let record_len = log.record_len(msg_offset);
        if record_len != u64::from(s.len) {
            return Some(format!("{}: slot says its record is {} bytes, the log says {record_len}", what(), s.len));
        }
        let expect = if last_offset == msg_offset {
            expect
        } else {
            match read_checked(last_offset) {
                Ok(Some(Record::Transition(t))) if t.msg_offset == msg_offset && t.id_hash == hash => {
                    (t.seq, t.state, t.home, attempt(t.attempt))
                }
                Ok(Some(_)) => return Some(format!("{}: its last record is not a change of it", what())),
                Ok(None) => return None,
                Err(why) => return Some(format!("{}: {why}", what())),
            }
        };
        if expect != (s.seq, s.state, s.home, s.attempt) {
            return Some(format!(
                "{}: slot says seq {} {:?} {:?} attempt {}, its record says {expect:?}",
                what(),
                s.seq, s.state, s.home, s.attempt
            ));
        }
        None
    }

    /// Deletes every derived file and re-derives it from the start of the log; cursors survive.
    fn rebuild(&mut self, cp: &Checkpoint) -> Result<()> {
        self.levels.clear();
        self.topics.clear();
        // Pauses come back from their records (reclaim keeps the one in effect in the log).
        self.paused.clear();
        self.push.clear();
        self.flow.clear();
        self.lru.clear();
        let cq_root = self.dir.join("cq");
        if cq_root.exists() {
            crate::storage::io::remove_dir_all(&cq_root).map_err(|e| Error::io_at("remove", &cq_root, e))?;
        }
        let index_path = self.dir.join("index").join("ids");
        remove_index_files(&index_path)?;
        self.index = IdIndex::open(&index_path, self.cfg.index_initial_slots, &self.durability)?;
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
                        let cq = ConsumeQueue::open(
                            &level_dir(&self.dir, ms),
                            per_file,
                            Some(0),
                            &self.durability,
                        )?;
                        self.levels.insert(ms, LevelQueue { cq, cursor: QueueIndex::new(0) });
                    }
                }
                QueueKind::Topic => {
                    let cq =
                        ConsumeQueue::new_closed(&topic_dir(&self.dir, &q.name), per_file, &self.durability);
                    self.topics.insert(q.name.clone(), TopicQueue::new(cq, QueueIndex::new(0), 0, 0, 0));
                }
            }
        }
        Ok(())
    }
}

/// The checkpoint at `path`, and whether it was unusable (then an empty one stands in, and
/// everything derived is rebuilt from the log). One written by another layout version fails.
fn load_checkpoint(path: &Path) -> Result<(Checkpoint, bool)> {
    match Checkpoint::load_or_damage(path)? {
        Ok(cp) => Ok((cp, false)),
        Err(why @ CheckpointDamage::OtherVersion(_)) => Err(Error::Corrupt {
            file: path.display().to_string(),
            offset: 0,
            reason: format!("checkpoint written by another delayd: {why}; upgrade instead"),
        }),
        // Everything in it is derived from the log except the reader cursors, and a rebuild
        // restarts readers at entry 0, where entries of handled messages are skipped.
        Err(why) => {
            error!(
                file = %path.display(),
                %why,
                "checkpoint unusable; rebuilding queues, index and counters from the whole commit log"
            );
            Ok((Checkpoint::default(), true))
        }
    }
}

/// What other files vouch was durable: a log ending before it lost acknowledged records.
fn durable_claims(dir: &Path, cp_path: &Path, cp: &Checkpoint, clean_end: Option<u64>) -> Vec<DurableClaim> {
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
    claims
}

/// The id index at `path`, and whether it was unusable (then a fresh one stands in, to be
/// rebuilt from the log).
fn open_index(
    path: &Path,
    initial_slots: u64,
    durability: &Durability,
    counting: Counting,
) -> Result<(IdIndex, bool)> {
    match IdIndex::open_counted(path, initial_slots, durability, counting) {
        Ok(index) => Ok((index, false)),
        // The index is derived: a damaged or older-layout one is rebuilt from the log.
        Err(Error::Corrupt { file, reason, .. }) => {
            warn!(%file, %reason, "id index unusable; rebuilding it from the commit log");
            remove_index_files(path)?;
            Ok((IdIndex::open(path, initial_slots, durability)?, true))
        }
        Err(e) => Err(e),
    }
}
