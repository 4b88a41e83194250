//! The consume queues: the level queues, the cache of open topic queues, reading entries,
//! checking them against the log and repairing a damaged queue.

use tracing::error;

use super::{
    dead_letter_topic, level_dir, topic_dir, EntryCheck, LevelQueue, QueueRef, Store, Target, TopicQueue,
};
use crate::error::{Error, Result};
use crate::storage::consumequeue::{ConsumeQueue, Entry};
use crate::storage::format::{Home, Record, Route};
use crate::storage::types::{LogOffset, QueueIndex, UnixMs};

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

impl Store {
    /// The level queue for `level_ms`, created on first use.
    pub fn level_queue(&mut self, level_ms: u64) -> Result<&mut LevelQueue> {
        if !self.levels.contains_key(&level_ms) {
            let cq = ConsumeQueue::open(
                &level_dir(&self.dir, level_ms),
                self.cfg.cq_entries_per_file,
                Some(0),
                &self.durability,
            )?;
            self.levels.insert(level_ms, LevelQueue { cq, cursor: QueueIndex::new(0) });
        }
        self.levels.get_mut(&level_ms).ok_or_else(|| Error::Unavailable("level queue vanished".into()))
    }

    /// The topic's queue state, created on first use without touching the disk (a topic whose
    /// only use is a counter never gets a directory).
    pub(super) fn topic_state(&mut self, topic: &str) -> Result<&mut TopicQueue> {
        if !self.topics.contains_key(topic) {
            let cq = ConsumeQueue::new_closed(
                &topic_dir(&self.dir, topic),
                self.cfg.cq_entries_per_file,
                &self.durability,
            );
            // Dispatch creates queues, and it is applying the record at `dispatched` right now.
            self.topics
                .insert(topic.to_string(), TopicQueue::new(cq, QueueIndex::new(0), 0, 0, self.dispatched));
        }
        self.topics.get_mut(topic).ok_or_else(|| Error::Unavailable("topic queue vanished".into()))
    }

    /// The topic's queue with its files open, marked most recently used. Past `open_queues` the
    /// least recently used queue is closed: it keeps its lengths, cursor and counters in memory,
    /// and its unsynced entries are synced by path at the next checkpoint.
    pub(super) fn topic_open(&mut self, topic: &str) -> Result<&mut TopicQueue> {
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
    pub fn peek_entry(&mut self, topic: &str) -> Result<Option<(QueueIndex, Entry)>> {
        match self.topics.get(topic) {
            Some(q) if q.cursor < q.cq.end() => {}
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
        from: QueueIndex,
        max: u64,
    ) -> Result<(Vec<(QueueIndex, Entry)>, QueueIndex)> {
        let none = QueueIndex::new(0);
        let cq = match queue {
            QueueRef::Topic(t) => {
                if !self.topics.contains_key(*t) {
                    return Ok((Vec::new(), none));
                }
                &self.topic_open(t)?.cq
            }
            QueueRef::Level(ms) => match self.levels.get(ms) {
                Some(q) => &q.cq,
                None => return Ok((Vec::new(), none)),
            },
        };
        let from = from.max(cq.first()).get();
        let to = from.saturating_add(max).min(cq.len());
        let entries = (from..to).map(QueueIndex::new).filter_map(|i| cq.get(i).map(|e| (i, e))).collect();
        Ok((entries, cq.end()))
    }

    /// Where a topic's reader stands (0 for a topic without a queue).
    pub fn topic_cursor(&self, topic: &str) -> QueueIndex {
        self.topics.get(topic).map_or(QueueIndex::new(0), |q| q.cursor)
    }

    /// Moves `topic`'s cursor past entry `at` (read with [`peek_entry`](Self::peek_entry)).
    pub fn advance_cursor(&mut self, topic: &str, at: QueueIndex) {
        if let Some(q) = self.topics.get_mut(topic) {
            if q.cursor == at {
                q.cursor = at.plus(1);
            }
        }
    }

    /// Checks a queue entry against the CRC-checked record it points to: the record must exist,
    /// have the entry's size, and route to this queue (for a level, at the entry's due time; for a
    /// topic, the message's topic and home). Queue files carry no checksum of their own; this
    /// check costs no disk and catches any damaged entry before it is acted on.
    ///
    /// The check reads records for their fields (see [`decode_fields`](crate::storage::format::decode_fields)): a message's body
    /// is checked once, where it is read for the consumer. Anything but a valid entry is looked at
    /// again with every CRC checked, so damage is told from a wrong entry as before.
    pub fn check_entry(&self, queue: &QueueRef<'_>, entry: &Entry) -> EntryCheck {
        match self.check_entry_with(queue, entry, Read::Fields) {
            EntryCheck::Valid => EntryCheck::Valid,
            _ => self.check_entry_with(queue, entry, Read::Checked),
        }
    }

    fn check_entry_with(&self, queue: &QueueRef<'_>, entry: &Entry, how: Read) -> EntryCheck {
        let bad = |why: String| EntryCheck::Bad(why);
        let offset = entry.offset.get();
        if offset < self.log.start() {
            // Its record was reclaimed: the message was carried forward or expired.
            return EntryCheck::Stale;
        }
        if entry.size == 0 || offset >= self.dispatched {
            return bad(format!("entry points at log offset {offset} past the dispatched log"));
        }
        let rec = match self.read_as(offset, how) {
            Ok(Some(rec)) => rec,
            Ok(None) => return EntryCheck::CorruptRecord,
            Err(why) => return bad(why),
        };
        if self.log.record_len(offset) != u64::from(entry.size) {
            return bad(format!("entry size {} differs from the record at {offset}", entry.size));
        }
        match self.routed(offset, entry.size, &rec, how) {
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
    fn routed(
        &self,
        offset: u64,
        size: u32,
        rec: &Record<'_>,
        how: Read,
    ) -> std::result::Result<Routed, String> {
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
                let topic = match self.read_as(t.msg_offset, how)? {
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
            Record::Pause(_) | Record::Push(_) | Record::Flow(_) | Record::Raft(_) | Record::EndOfSegment => return Ok(Routed::Nowhere),
        };
        Ok(match (route, topic) {
            (Route::Topic, Some(t)) => Routed::To(
                Target::Topic(t),
                Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(tag) },
            ),
            (Route::Level { level_ms, due_ms }, _) => Routed::To(
                Target::Level(level_ms),
                Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(due_ms) },
            ),
            _ => Routed::Nowhere,
        })
    }

    /// Repairs a queue whose entry `bad` failed [`check_entry`](Self::check_entry): from the last
    /// entry before it that checks out, every entry is derived again from the log (the records
    /// after that entry's record that route to the queue). Returns the index readers must restart
    /// from; entries of messages already handled are skipped when read, so re-reading is safe.
    pub fn repair_queue(&mut self, queue: &QueueRef<'_>, bad: QueueIndex, why: &str) -> Result<QueueIndex> {
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
        for i in (first.get()..bad.min(cq.end()).get()).rev().map(QueueIndex::new) {
            if let Some(e) = cq.get(i) {
                if e.offset.get() >= self.log.start() && self.check_entry(queue, &e) == EntryCheck::Valid {
                    keep = i.plus(1);
                    from = e.offset.get() + u64::from(e.size);
                    break;
                }
            }
        }
        let mut entries = Vec::new();
        let mut at = from;
        while at < self.dispatched {
            let Some((offset, rec, next)) = self.log.next(at)? else { break };
            if let Ok(Routed::To(target, e)) =
                self.routed(offset, (next - offset) as u32, &rec, Read::Checked)
            {
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
            entry = bad.get(),
            %why,
            kept = keep.get(),
            rewritten = entries.len(),
            old_len,
            new_len,
            from_log_offset = from,
            "consume queue damaged; repaired it from the commit log (readers restart at the last good entry)"
        );
        Ok(keep)
    }

    /// Drops a topic from the map and deletes its files and directory; returns how many files.
    pub(in crate::storage) fn forget_topic(&mut self, topic: &str) -> Result<usize> {
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
}

/// How [`Store::check_entry`] reads records.
#[derive(Clone, Copy)]
enum Read {
    /// For their fields: a message's body is not checked.
    Fields,
    /// Every CRC checked, damage logged and counted.
    Checked,
}

impl Store {
    /// The record at `offset` read as `how` says; see [`read_checked`](Self::read_checked) for
    /// what `Ok(None)` and `Err` mean. A fields read reports nothing: a failure is looked at again,
    /// checked.
    fn read_as(&self, offset: u64, how: Read) -> std::result::Result<Option<Record<'_>>, String> {
        match how {
            Read::Checked => self.read_checked(offset),
            Read::Fields => match self.log.read_fields(offset) {
                Ok((rec, _)) => Ok(Some(rec)),
                Err(e) => Err(e.to_string()),
            },
        }
    }
}
