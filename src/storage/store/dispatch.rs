//! Appending records and dispatching them: each record applied to the queues, the id index and
//! the counters.

use std::borrow::Cow;

use tracing::warn;

use super::{dead_letter_topic, Store};
use crate::error::Result;
use crate::storage::consumequeue::Entry;
use crate::storage::durability::Failure;
use crate::storage::format::{
    self, Carry, Cause, Flow, Home, Hop, Pause, Push, Put, Record, Route, State, Transition,
};
use crate::storage::index::{Slot, SlotRef};
use crate::storage::types::{IdHash, LogOffset, UnixMs};

impl Store {
    /// Appends a record to the log and dispatches it at once, from the record itself (nothing is
    /// read back), so reads see their own writes.
    ///
    /// The files the record's dispatch writes to are opened, created or grown first, and the log
    /// makes room before it writes: so running out of disk space or file handles fails the call
    /// with nothing changed, and a retry may succeed. A failure after the record is in the log
    /// leaves queues and index half-updated, which poisons the store.
    pub fn append(&mut self, rec: &Record<'_>) -> Result<LogOffset> {
        self.append_framed(&rec.encode()?, rec)
    }

    /// [`append`](Self::append) of a record already encoded: `bytes` must be `rec`'s encoding
    /// (for a caller that built the bytes first, e.g. to copy a body it read once).
    pub(crate) fn append_framed(&mut self, bytes: &[u8], rec: &Record<'_>) -> Result<LogOffset> {
        self.prepare_dispatch(rec)?;
        let at = self.log.append(bytes)?;
        if let Err(e) = self.dispatch_appended(at, rec) {
            return Err(self.durability.poison(Failure::from_error(&e)));
        }
        Ok(LogOffset::new(at))
    }

    /// Dispatches `rec`, just appended at `at`, from the struct. Whatever lies between the
    /// dispatch position and the record (the end-of-segment marker of a roll) is dispatched from
    /// the log first, as a replay does.
    fn dispatch_appended(&mut self, at: u64, rec: &Record<'_>) -> Result<()> {
        while self.dispatched < at {
            // Looked at for its offset only: the record at `at` is not read here.
            match self.log.next_fields(self.dispatched)? {
                Some((offset, _, _)) if offset < at => {
                    let Some((_, next)) = self.dispatch_one(self.dispatched)? else { break };
                    self.dispatched = next;
                }
                _ => self.dispatched = at,
            }
        }
        let end = self.log.end();
        self.dispatch_record(at, (end - at) as u32, rec)?;
        self.dispatched = end;
        Ok(())
    }

    /// Applies one record, whichever way it came (appended now, or read back by a replay).
    fn dispatch_record(&mut self, offset: u64, size: u32, rec: &Record<'_>) -> Result<()> {
        match rec {
            Record::Put(p) => self.dispatch_put(offset, size, p),
            Record::Carry(c) => self.dispatch_carry(offset, size, c),
            Record::Transition(t) => self.dispatch_transition(offset, size, t),
            Record::Hop(h) => self.dispatch_hop(offset, size, h),
            Record::Pause(p) => self.dispatch_pause(offset, size, p),
            Record::Push(p) => self.dispatch_push(offset, size, p),
            Record::Flow(f) => self.dispatch_flow(offset, size, f),
            Record::Raft(_) | Record::EndOfSegment => Ok(()),
        }
    }

    /// Gets the queue file the record's dispatch appends to ready (see [`append`](Self::append)).
    /// State changes (not new messages) may use the reserve when the disk is full.
    fn prepare_dispatch(&mut self, rec: &Record<'_>) -> Result<()> {
        enum Target {
            Level(u64),
            Topic(String),
        }
        let home_queue = |home: Home, topic: String| match home {
            Home::Main => topic,
            Home::DeadLetter => dead_letter_topic(&topic),
        };
        let target = match (rec, rec.route()) {
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
        if rec.has_body() {
            prepare()
        } else {
            reserve.retry_on_full_disk(prepare)
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

    /// Applies the record at `at` (end-of-segment markers skipped); returns its offset and the
    /// offset after it, or `None` at the log end.
    fn dispatch_one(&mut self, at: u64) -> Result<Option<(u64, u64)>> {
        let Some((offset, rec, next)) = self.log.next(at)? else { return Ok(None) };
        let size = (next - offset) as u32;
        // Records borrow the log, which must end before queues and index are touched: a record
        // with bytes is handed on with owned copies of the ones dispatch reads (id and topic).
        match rec {
            Record::Put(p) => {
                let held = Held::of(p.id, p.topic);
                self.dispatch_put(offset, size, &held.put(p))?;
            }
            Record::Carry(c) => {
                let held = Held::of(c.put.id, c.put.topic);
                self.dispatch_carry(offset, size, &held.carry(c))?;
            }
            Record::Transition(t) => self.dispatch_transition(offset, size, &t.without_error())?,
            Record::Hop(h) => self.dispatch_hop(offset, size, &h)?,
            Record::Pause(p) => {
                let held = Held::of(&[], p.topic);
                self.dispatch_pause(offset, size, &held.pause(p))?;
            }
            Record::Push(p) => {
                let held = Held::of(&[], p.topic);
                self.dispatch_push(offset, size, &held.push(p))?;
            }
            Record::Flow(f) => {
                let held = Held::of(&[], f.topic);
                self.dispatch_flow(offset, size, &Flow { topic: held.topic(), ..f })?;
            }
            Record::Raft(_) | Record::EndOfSegment => {}
        }
        Ok(Some((offset, next)))
    }

    /// Applies a Put: indexes the new message (dropping an older one it replaces), counts it and
    /// appends its entry to its route's queue.
    fn dispatch_put(&mut self, offset: u64, size: u32, p: &Put<'_>) -> Result<()> {
        let (hash, at) = (IdHash::new(format::id_hash(p.id)), LogOffset::new(offset));
        let topic = String::from_utf8_lossy(p.topic);
        let (route, deliver_at) = (p.route, p.deliver_at_ms);
        // Live appends are dispatched exactly once and the engine already checked the id, so
        // only a replay after a crash can meet a Put that is indexed already.
        if !self.recovering || self.index.find(hash, |m| m == at).is_none() {
            let state = if route == Route::Topic { State::Ready } else { State::Delayed };
            self.index.insert(Slot {
                hash,
                msg_offset: at,
                last_offset: at,
                seq: 0,
                attempt: 0,
                state,
                home: Home::Main,
                len: size,
            })?;
            self.live_bytes += u64::from(size);
            self.segs.add(&self.log, offset, u64::from(size));
        }
        // After the insert: the removal of the replaced slot rests on the new one (see
        // `forget_others`).
        if p.replaces {
            self.forget_others(hash, p.id, offset)?;
        }
        // Counters move by the record alone (a replay starts from the checkpoint's counts).
        let state = if route == Route::Topic { State::Ready } else { State::Delayed };
        self.count(&topic, state, true)?;
        self.route(
            route,
            &topic,
            Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(deliver_at) },
        )
    }

    /// Applies a Carry (reclaim copied a message forward): its slot moves to the new record, and
    /// its entry goes to the queue the message is in.
    fn dispatch_carry(&mut self, offset: u64, size: u32, c: &Carry<'_>) -> Result<()> {
        let (hash, moved_to) = (IdHash::new(format::id_hash(c.put.id)), LogOffset::new(offset));
        let topic = String::from_utf8_lossy(c.put.topic);
        let (prev, route, deliver_at) = (c.prev_msg_offset, c.put.route, c.deliver_at_ms);
        if self.recovering && !self.replayed_hops.is_empty() {
            // The message's timer restarts from the Carry; records naming `prev` are stale.
            self.replayed_hops.remove(&(prev, c.seq));
        }
        let slot = Slot {
            hash,
            msg_offset: moved_to,
            last_offset: moved_to,
            seq: c.seq,
            attempt: c.attempt.min(u32::from(u16::MAX)) as u16,
            state: c.state,
            home: c.home,
            len: size,
        };
        let here = self.index.find(hash, |m| m == moved_to).is_some();
        match self.index.find(hash, |m| m.get() == prev) {
            // A replay re-inserted the message at its old record while the slot had moved
            // on to this Carry already: drop the resurrected copy, the moved slot is newer.
            Some((at, old)) if here => self.unindex(at, &old),
            Some((at, old)) => {
                if old.last_offset < moved_to {
                    self.index.update(at, slot);
                    let prev_len = u64::from(old.len);
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
            Home::DeadLetter => Cow::Owned(dead_letter_topic(&topic)),
        };
        // Moving a message changes no count, unless the record it replaces is gone from the
        // log: then this is a rebuild, which never met the message before. (A replay after
        // a crash never meets such a Carry: its segment goes only after a checkpoint that
        // covers the Carry is durable. The index cannot tell, as it may be ahead.)
        if prev < self.log.start() {
            self.count(&queue, c.state, true)?;
        }
        self.route(
            route,
            &queue,
            Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(deliver_at) },
        )
    }

    /// Applies a Transition (a message changed state): its slot, the counters of the queues it
    /// left and entered, and its entry on its new route.
    fn dispatch_transition(&mut self, offset: u64, size: u32, t: &Transition<'_>) -> Result<()> {
        // Records of a message whose Put or Carry is in a reclaimed segment are history: the
        // message was carried forward (a later Carry holds it) or expired.
        if t.msg_offset < self.log.start() {
            return Ok(());
        }
        if self.recovering && !self.replayed_hops.is_empty() {
            // The timer of the previous seq ended with this change.
            self.replayed_hops.remove(&(t.msg_offset, t.seq.wrapping_sub(1)));
        }
        let topic = self.topic_of(t.msg_offset)?;
        if let Some((at, mut slot)) = self.index.find(IdHash::new(t.id_hash), |m| m.get() == t.msg_offset) {
            if slot.last_offset.get() < offset {
                self.segs.state(&self.log, slot.msg_offset.get(), slot.state, t.state);
                slot.last_offset = LogOffset::new(offset);
                slot.seq = t.seq;
                slot.attempt = t.attempt.min(u16::MAX as u32) as u16;
                slot.state = t.state;
                slot.home = t.home;
                self.index.update(at, slot);
            }
        } else if !self.recovering {
            warn!(offset, msg_offset = t.msg_offset, "transition for a message missing from the index");
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
        self.route(
            t.route,
            &queue,
            Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(t.deliver_at_ms) },
        )
    }

    /// Applies a Hop (a timer moved to its next level): remembered during a replay, and queued on
    /// its next level.
    fn dispatch_hop(&mut self, offset: u64, size: u32, h: &Hop) -> Result<()> {
        // A Hop of a message in a reclaimed segment is history (see `dispatch_transition`).
        if h.msg_offset < self.log.start() {
            return Ok(());
        }
        if self.recovering {
            self.replayed_hops.insert((h.msg_offset, h.seq), (h.id_hash, offset));
        }
        self.route(h.route, "", Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(0) })
    }

    /// Applies a Pause (or resume): the topic's Pause record in effect, kept by reclaim.
    fn dispatch_pause(&mut self, offset: u64, size: u32, p: &Pause<'_>) -> Result<()> {
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
        Ok(())
    }

    /// Applies a Push (a topic's push subscription set or removed): the record in effect, kept by
    /// reclaim, and a change the pushers notice.
    fn dispatch_push(&mut self, offset: u64, size: u32, p: &Push<'_>) -> Result<()> {
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
        Ok(())
    }

    /// Applies a Flow (a topic's flow control set or removed): the record in effect, kept by
    /// reclaim.
    fn dispatch_flow(&mut self, offset: u64, size: u32, f: &Flow<'_>) -> Result<()> {
        let topic = String::from_utf8_lossy(f.topic).into_owned();
        let prev = if f.is_clear() {
            self.flow.remove(&topic)
        } else {
            self.segs.add(&self.log, offset, u64::from(size));
            self.flow.insert(topic, offset)
        };
        if let Some(prev) = prev {
            let len = self.log.record_len(prev);
            self.segs.sub(&self.log, prev, len);
        }
        Ok(())
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
    ///
    /// An open finds the new slot if its page reached the disk before the Put did (it points past
    /// the log end, and the index is rebuilt), but not a removal: were the old slot's page written
    /// back alone, a crash would lose the old message with nothing to tell. So where the two slots
    /// are on different pages (or tables), the new slot's page is synced first.
    fn forget_others(&mut self, hash: IdHash, id: &[u8], offset: u64) -> Result<()> {
        loop {
            let log = &self.log;
            let found = self.index.find_slot(hash, |s| {
                // Only older messages: on a replay over an index that is ahead, a later message
                // with this id (replaced after this one) keeps its slot.
                s.msg_offset.get() < offset
                    && match log.read_fields(s.msg_offset.get()) {
                        Ok((Record::Put(p), _)) => p.id == id,
                        Ok((Record::Carry(c), _)) => c.put.id == id,
                        _ => false,
                    }
            });
            let Some((at, old)) = found else { return Ok(()) };
            if !matches!(old.state, State::Done | State::Cancelled) {
                warn!(offset, old = old.msg_offset.get(), state = ?old.state, "a replacing put met a live message with its id");
            }
            // A replay applies records already on disk: nothing to order then.
            if !self.recovering {
                if let Some((new_at, _)) = self.index.find(hash, |m| m.get() == offset) {
                    if self.index.page_of(new_at) != self.index.page_of(at) {
                        self.index.sync_slot(new_at)?;
                    }
                }
            }
            self.unindex(at, &old);
        }
    }

    /// Removes slot `old` (at `at`) from the index and what it counted: its record's bytes and, if
    /// reserved, its reservation. Every change to the index moves the counts by exactly its own
    /// effect, so counts taken from the index before a replay stay exact through it.
    pub(crate) fn unindex(&mut self, at: SlotRef, old: &Slot) {
        self.index.remove(at);
        let (msg_offset, len) = (old.msg_offset.get(), u64::from(old.len));
        self.live_bytes = self.live_bytes.saturating_sub(len);
        self.segs.sub(&self.log, msg_offset, len);
        self.segs.state(&self.log, msg_offset, old.state, State::Done);
    }

    fn route(&mut self, route: Route, topic: &str, mut entry: Entry) -> Result<()> {
        match route {
            Route::None => {}
            Route::Topic => {
                self.topic_open(topic)?.cq.append(entry)?;
                self.touch_one(topic);
            }
            Route::Level { level_ms, due_ms } => {
                entry.tag = UnixMs::new(due_ms);
                self.level_queue(level_ms)?.cq.append(entry)?;
                self.level_appends += 1;
            }
        }
        Ok(())
    }
}

/// The bytes of a record that dispatch reads (a message's id, a topic), copied out of the log so
/// that its borrow ends before dispatch changes the store. The records rebuilt from it leave out
/// the bytes dispatch never reads (a message's body; a push's url, subject and secret): they are
/// for dispatch only.
struct Held {
    bytes: Vec<u8>,
    id_len: usize,
}

impl Held {
    fn of(id: &[u8], topic: &[u8]) -> Held {
        let mut bytes = Vec::with_capacity(id.len() + topic.len());
        bytes.extend_from_slice(id);
        bytes.extend_from_slice(topic);
        Held { bytes, id_len: id.len() }
    }

    fn id(&self) -> &[u8] {
        &self.bytes[..self.id_len]
    }

    fn topic(&self) -> &[u8] {
        &self.bytes[self.id_len..]
    }

    /// `p` reading its id and topic from the copy, without its body.
    fn put(&self, p: Put<'_>) -> Put<'_> {
        Put {
            created_ms: p.created_ms,
            deliver_at_ms: p.deliver_at_ms,
            ttr_ms: p.ttr_ms,
            max_attempts: p.max_attempts,
            request_kind: p.request_kind,
            request_value: p.request_value,
            route: p.route,
            id: self.id(),
            topic: self.topic(),
            backoff_ms: p.backoff_ms,
            body: &[],
            replaces: p.replaces,
        }
    }

    /// `c` reading its message's id and topic from the copy, without its body.
    fn carry(&self, c: Carry<'_>) -> Carry<'_> {
        Carry {
            prev_msg_offset: c.prev_msg_offset,
            seq: c.seq,
            attempt: c.attempt,
            state: c.state,
            home: c.home,
            time_ms: c.time_ms,
            deliver_at_ms: c.deliver_at_ms,
            put: self.put(c.put),
            last_error: None,
        }
    }

    /// `p` reading its topic from the copy.
    fn pause(&self, p: Pause<'_>) -> Pause<'_> {
        Pause { paused: p.paused, time_ms: p.time_ms, topic: self.topic() }
    }

    /// `p` reading its topic from the copy, without its url, subject and secret.
    fn push(&self, p: Push<'_>) -> Push<'_> {
        Push {
            target: p.target,
            time_ms: p.time_ms,
            timeout_ms: p.timeout_ms,
            max_in_flight: p.max_in_flight,
            topic: self.topic(),
            url: &[],
            subject: &[],
            secret: &[],
        }
    }
}
