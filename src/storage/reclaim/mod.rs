//! Reclaim: expiring final messages from the id index, carrying live messages out of the oldest
//! commit-log segment, and deleting segments and consume-queue files nothing needs any more.
//!
//! Every step is bounded (a slice of records and a deadline per call) so the engine thread never
//! stalls on it,
//! and every deletion waits for a durable checkpoint that covers what replaces the deleted bytes:
//! recovery never needs a file that is gone. See storage-format.md, "Reclaim".

use std::time::Instant;

use tracing::{debug, info};

use super::checkpoint::{Checkpoint, QueueKind};
use super::format::{self, Carry, Put, Record, Route, State};
use super::index::{Slot, SlotRef};
use super::store::Store;
use super::types::{IdHash, QueueIndex};
use crate::error::Result;

pub(super) mod state;

pub use state::{ReclaimPolicy, ReclaimStats};
use state::{Phase, SegCounts, SegTally};

/// Records examined per scan or expiry step, at most (the caller's deadline usually ends it first).
const SCAN_SLICE: usize = 4096;
/// Records examined or carried per step before the deadline is looked at: every call makes some
/// progress, however little time the engine can spare.
const MIN_SLICE: usize = 32;
/// Bytes of records examined or copied per step, whichever limit comes first.
const BYTES_SLICE: u64 = 4 << 20;
/// Messages carried per step.
const CARRY_SLICE: usize = 512;
/// How long a head segment that cannot be reclaimed yet rests before it is scanned again.
const RESCAN_MS: u64 = 1_000;
/// Most segments found empty in a row that one durable checkpoint frees together.
const FREE_RUN: u64 = 64;
/// Emptied topics forgotten per durable checkpoint (each deletes a file and a directory); the rest
/// are forgotten at the next one, whose checkpoint shows them emptied again.
const FORGET_SLICE: usize = 256;

/// Where reclaiming the oldest segment stands.
/// What a message at the head still needs.
enum Holds {
    /// Not indexed any more (expired, or carried already).
    Nothing,
    /// Final and past `done_retention`, but the expiry walk has not reached its final record yet
    /// (a carried final message is reached late): remove it now.
    Expired(SlotRef, Slot),
    /// Live and movable; its slot.
    Carryable(Slot),
    /// Live but must stay where it is for now.
    Pinned,
}

impl Store {
    /// Bytes of every indexed message's Put or Carry record.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// What reclaim did so far.
    pub fn reclaim_stats(&self) -> ReclaimStats {
        self.reclaim.stats
    }

    /// True when a reclaim step has work it could do right now. Costs no scan: a head segment
    /// that its counts say cannot be freed or carried is not work.
    pub fn reclaim_busy(&self, now_ms: u64, policy: &ReclaimPolicy) -> bool {
        if self.reclaim.expiry_behind {
            return true;
        }
        if self.reclaim.expiry_unsynced.is_some_and(|at| self.log.flushed().min(self.committed_end()) > at) {
            return true;
        }
        let Some((base, end)) = self.log.sealed_head() else { return false };
        match self.reclaim.phase {
            _ if self.reclaim.head != base => self.head_worth_scanning(policy, base, end),
            Phase::Scan { .. } | Phase::Carry { .. } => true,
            Phase::Free { need, decided, .. } => self.durable_serial >= need && self.committed_end() >= decided,
            Phase::Start => self.head_worth_scanning(policy, base, end),
            Phase::Rest { until_ms, changes } => {
                (now_ms >= until_ms || self.segs.get(base).changes != changes)
                    && self.head_worth_scanning(policy, base, end)
            }
        }
    }

    /// Whether the counts of the head segment `[base, end)` say a scan could free or carry it:
    /// nothing in it is needed, or nothing is reserved and carrying would pay. Reclaim scans
    /// only then, so a head full of messages pending for days costs nothing while it stays so.
    fn head_worth_scanning(&self, policy: &ReclaimPolicy, base: u64, end: u64) -> bool {
        let c = self.segs.get(base);
        c.bytes == 0
            || c.reserved == 0
                && policy.should_carry(end - base, c.bytes, self.log.disk_bytes(), self.live_bytes)
    }

    /// Sets the counts from `segs` and `live`, a pass over the index's live slots, adding the
    /// records of the topic settings in effect (at open; dispatch keeps the counts from then on,
    /// a replay included).
    pub(crate) fn take_live_counts(&mut self, mut segs: SegCounts, live: u64) {
        self.live_bytes = live;
        for &at in self.paused.values().chain(self.push.values()).chain(self.flow.values()) {
            segs.add(&self.log, at, self.log.record_len(at));
        }
        self.segs = segs;
    }

    /// One pass over the index just opened, split between threads: the table's structure (see
    /// [`IdIndex::check_part`](crate::storage::index::IdIndex::check_part)), the first damage
    /// `check` finds in a live slot, and the live bytes and per-segment counts of the live slots
    /// (without the topic settings' records), from the slots alone; and the occupied and live
    /// slots, for [`IdIndex::set_counts`](crate::storage::index::IdIndex::set_counts).
    pub(crate) fn check_and_count_index(
        &self,
        check: impl Fn(&Slot) -> Option<String> + Sync,
    ) -> (Option<String>, SegCounts, u64, (u64, u64)) {
        let (log, index) = (&self.log, &self.index);
        let parts = crate::storage::store::in_parts(index.table_slots(), |k, parts| {
            let mut segs = SegTally::new(log);
            let (mut live_bytes, mut damage) = (0, None);
            let table = index.check_part(k, parts, |s| {
                if damage.is_none() {
                    damage = check(s);
                }
                let len = u64::from(s.len);
                live_bytes += len;
                segs.message(s.msg_offset.get(), len, s.state);
            });
            (table, damage, segs, live_bytes)
        });
        let (mut first, mut segs, mut live_bytes) = (None, SegTally::new(log), 0);
        let (mut filled, mut live) = (0, 0);
        for (table, damage, part, bytes) in parts {
            match table {
                Ok((f, l)) => (filled, live) = (filled + f, live + l),
                Err(why) => first = first.or(Some(why)),
            }
            first = first.or(damage);
            segs.merge(&part);
            live_bytes += bytes;
        }
        (first, segs.into_counts(), live_bytes, (filled, live))
    }

    /// The kept counts of the segments: base, live bytes, reserved (for tests).
    #[cfg(test)]
    pub(crate) fn segment_counts(&self) -> Vec<(u64, u64, u64)> {
        self.segs.to_list()
    }

    /// Segments of the commit log (for tests).
    #[cfg(test)]
    pub(crate) fn log_segments(&self) -> usize {
        self.log.segment_count()
    }

    /// How the kept counts of the segments differ from a recount, if they do (for tests).
    #[cfg(test)]
    pub(crate) fn segment_counts_differ(&self) -> Option<String> {
        let mut fresh = SegCounts::default();
        let log = &self.log;
        self.index.for_each(|s| {
            fresh.add(log, s.msg_offset.get(), log.record_len(s.msg_offset.get()));
            fresh.state(log, s.msg_offset.get(), State::Delayed, s.state);
        });
        for &at in self.paused.values().chain(self.push.values()).chain(self.flow.values()) {
            fresh.add(log, at, log.record_len(at));
        }
        let counts = |c: &SegCounts| -> Vec<(u64, u64, u64)> {
            c.0.iter()
                .filter(|(_, l)| l.bytes > 0 || l.reserved > 0)
                .map(|(b, l)| (*b, l.bytes, l.reserved))
                .collect()
        };
        let (kept, want) = (counts(&self.segs), counts(&fresh));
        (kept != want).then(|| format!("kept {kept:?}, recounted {want:?}"))
    }

    /// Called once a checkpoint is durable: nothing before its dispatch position is replayed any
    /// more, and queue files wholly behind its cursors are never read again.
    ///
    /// A topic the checkpoint shows emptied (every entry read, nothing reserved) and untouched since
    /// is forgotten: its files, its last one included, and its directory are deleted and it leaves
    /// the topic map, so it costs nothing and no longer counts against `max_topics`. Nothing refers
    /// to a topic queue's entry indexes but its cursor (receipts name the message's record), so a
    /// later message for it simply starts a fresh queue at entry 0. Recovery from this checkpoint
    /// restarts such a topic empty whatever is left on disk (see `Store::open`).
    pub fn checkpoint_durable(&mut self, cp: &Checkpoint) -> Result<()> {
        self.durable_serial = self.durable_serial.max(cp.serial);
        // Before any topic is forgotten below: its last positions (read to its end) go too.
        self.publish_passed(cp);
        let mut forget = Vec::new();
        for q in &cp.queues {
            let cq = match q.kind {
                QueueKind::Level => {
                    q.name.parse::<u64>().ok().and_then(|ms| self.levels.get_mut(&ms)).map(|l| &mut l.cq)
                }
                // A topic forgotten and created again since the checkpoint was captured is not the
                // queue it describes.
                QueueKind::Topic => {
                    self.topics.get_mut(&q.name).filter(|t| t.created_at < cp.dispatched).map(|t| &mut t.cq)
                }
            };
            if let Some(cq) = cq {
                self.reclaim.stats.queue_files_deleted += cq.drop_before(QueueIndex::new(q.cursor))? as u64;
            }
            let empty = |reserved: u64, delayed: u64, ready: u64| reserved == 0 && delayed == 0 && ready == 0;
            if q.kind == QueueKind::Topic
                && q.cursor >= q.len
                && empty(q.reserved, q.delayed, q.ready)
                && forget.len() < FORGET_SLICE
            {
                let unchanged = self.topics.get(&q.name).is_some_and(|t| {
                    t.created_at < cp.dispatched
                        && t.cq.len() == q.len
                        && t.cursor.get() == q.len
                        && empty(t.reserved, t.delayed, t.ready)
                });
                if unchanged {
                    forget.push(q.name.as_str());
                }
            }
        }
        for name in &forget {
            self.reclaim.stats.queue_files_deleted += self.forget_topic(name)? as u64;
            self.reclaim.stats.topics_forgotten += 1;
        }
        if !forget.is_empty() {
            debug!(topics = forget.len(), "emptied topics forgotten");
        }
        Ok(())
    }

    /// Removes from the index final messages whose final transition is older than `cutoff_ms`,
    /// until caught up or `until`; returns how many records it looked at (0 when caught up).
    pub fn expire(&mut self, cutoff_ms: u64, until: Instant) -> Result<usize> {
        self.expiry = self.expiry.max(self.log.start());
        if let Some((at, time_ms)) = self.reclaim.expiry_young {
            if at == self.expiry && cutoff_ms < time_ms {
                return Ok(0);
            }
        }
        self.reclaim.expiry_young = None;
        let (mut seen, mut bytes) = (0, 0u64);
        self.reclaim.expiry_behind = false;
        // Only durable (and committed) final records may remove a slot (see `settled`): the walk
        // stops there and comes back for the rest once the log is synced.
        let upto = self.dispatched.min(self.log.flushed()).min(self.committed_end());
        self.reclaim.expiry_unsynced = None;
        loop {
            if seen >= SCAN_SLICE || bytes >= BYTES_SLICE || seen >= MIN_SLICE && Instant::now() >= until {
                self.reclaim.expiry_behind = true;
                break;
            }
            // Times, ids and states are all the walk reads: no body is read or checked.
            let Some((offset, rec, next)) = self.log.next_fields(self.expiry)? else { break };
            if next > upto {
                if upto < self.dispatched {
                    self.reclaim.expiry_unsynced = Some(upto);
                }
                break;
            }
            let final_of = match rec {
                // A carried final message keeps the time it became final, older than the records
                // around it: judged before the time-order rule below.
                Record::Carry(c) if c.state.is_final() && c.time_ms <= cutoff_ms => {
                    Some((format::id_hash(c.put.id), offset))
                }
                // Records are otherwise appended in time order, so the first too-young one ends
                // the pass.
                Record::Transition(t) if t.time_ms > cutoff_ms => {
                    self.reclaim.expiry_young = Some((offset, t.time_ms));
                    break;
                }
                Record::Put(p) if p.created_ms > cutoff_ms => {
                    self.reclaim.expiry_young = Some((offset, p.created_ms));
                    break;
                }
                Record::Carry(c) if c.time_ms > cutoff_ms => {
                    self.reclaim.expiry_young = Some((offset, c.time_ms));
                    break;
                }
                Record::Transition(t) if t.state.is_final() => Some((t.id_hash, t.msg_offset)),
                _ => None,
            };
            if let Some((hash, msg_offset)) = final_of {
                if let Some((at, slot)) = self.index.find(IdHash::new(hash), |m| m.get() == msg_offset) {
                    // Only the final transition itself expires the message; the slot could not
                    // have changed after it, but a damaged index is not trusted to say so.
                    if slot.last_offset.get() == offset && slot.state.is_final() {
                        self.forget_expired(at, &slot);
                    }
                }
            }
            seen += 1;
            bytes += next - offset;
            self.expiry = next;
        }
        Ok(seen)
    }

    /// Removes an expired final message's slot from the index.
    fn forget_expired(&mut self, at: SlotRef, slot: &Slot) {
        self.unindex(at, slot);
        self.reclaim.stats.expired += 1;
    }

    fn holds(&self, msg_offset: u64, hash: u64, now_ms: u64, expired_at_ms: u64) -> Result<Holds> {
        let Some((at, slot)) = self.index.find(IdHash::new(hash), |m| m.get() == msg_offset) else {
            return Ok(Holds::Nothing);
        };
        Ok(match slot.state {
            State::Ready | State::Dead => Holds::Carryable(slot),
            // A timer about to fire would only be planned again; let it fire first.
            State::Delayed if self.deliver_at(&slot)? > now_ms => Holds::Carryable(slot),
            // Final messages stay readable until they expire; carried, they keep the time they
            // became final, so carrying never lengthens their retention. Without carrying them a
            // segment mixing long and short delays stays pinned for the longest delay plus the
            // retention, whatever else it holds.
            // Removed only once its final record is durable (see `settled`); until then carried.
            State::Done | State::Cancelled if self.is_expired(&slot, expired_at_ms) && self.settled(&slot) => {
                Holds::Expired(at, slot)
            }
            State::Done | State::Cancelled => Holds::Carryable(slot),
            // A reservation's receipt names the Put offset: it keeps its segment until acked or
            // expired (at most a TTR).
            State::Delayed | State::Reserved => Holds::Pinned,
        })
    }

    /// One bounded step of reclaiming the oldest segment, ending by `until`. `plan` gives the
    /// level entry for a delayed message due at `target` (arguments: now, target).
    pub fn reclaim_step(
        &mut self,
        now_ms: u64,
        policy: &ReclaimPolicy,
        plan: &dyn Fn(u64, u64) -> Route,
        until: Instant,
    ) -> Result<()> {
        let Some((base, end)) = self.log.sealed_head() else { return Ok(()) };
        if self.reclaim.head != base {
            self.reclaim.head = base;
            self.reclaim.phase = Phase::Start;
        }
        let head = Phase::Scan { seg: base, pos: base, live: 0, pinned: 0 };
        self.reclaim.phase = match self.reclaim.phase {
            Phase::Start | Phase::Rest { .. } if !self.head_worth_scanning(policy, base, end) => {
                return Ok(())
            }
            Phase::Start => head,
            Phase::Rest { until_ms, changes }
                if now_ms < until_ms && self.segs.get(base).changes == changes =>
            {
                return Ok(())
            }
            Phase::Rest { .. } => head,
            Phase::Scan { seg, pos, live, pinned } => {
                self.scan(now_ms, policy, until, base, seg, pos, live, pinned)?
            }
            // A cluster node that does not lead appends nothing: the leader carries the head's
            // live messages, and their Carries, replicated here, change the head's counts.
            Phase::Carry { .. } if !self.may_act() => {
                Phase::Rest { until_ms: now_ms + 1_000, changes: self.segs.get(base).changes }
            }
            Phase::Carry { pos } => self.carry(now_ms, policy, plan, until, base, end, pos)?,
            Phase::Free { need, decided, .. } if self.durable_serial < need || self.committed_end() < decided => {
                return Ok(())
            }
            Phase::Free { need, upto, decided } => {
                let freed = self.log.drop_head(upto)?;
                if freed > 0 {
                    self.reclaim.stats.segments_deleted += 1;
                    self.reclaim.stats.segment_bytes_deleted += freed;
                    info!(base, end, freed, "commit-log segment reclaimed");
                }
                self.segs.0.retain(|&b, _| b >= self.log.start());
                match self.log.sealed_head() {
                    Some((next, next_end)) if freed > 0 && next_end <= upto => {
                        self.reclaim.head = next;
                        Phase::Free { need, upto, decided }
                    }
                    _ => Phase::Start,
                }
            }
        };
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn scan(
        &mut self,
        now_ms: u64,
        policy: &ReclaimPolicy,
        until: Instant,
        base: u64,
        seg: u64,
        mut pos: u64,
        mut live: u64,
        mut pinned: u64,
    ) -> Result<Phase> {
        let Some((_, end)) = self.log.sealed_at(seg) else { return Ok(Phase::Start) };
        let mut seen = 0;
        let start = pos;
        while seen < SCAN_SLICE && pos - start < BYTES_SLICE && (seen < MIN_SLICE || Instant::now() < until) {
            // Only ids and lengths are needed here: the carry that follows checks what it copies.
            let Some((offset, rec, next)) = self.log.next_fields(pos)? else { break };
            if offset >= end {
                pos = end;
                break;
            }
            let msg = match &rec {
                Record::Put(p) => Some(format::id_hash(p.id)),
                Record::Carry(c) => Some(format::id_hash(c.put.id)),
                Record::Pause(p) if self.pause_in_effect(p, offset) => {
                    live += next - offset;
                    None
                }
                Record::Push(p) if self.push_in_effect(p, offset) => {
                    live += next - offset;
                    None
                }
                Record::Flow(f) if self.flow_in_effect(f, offset) => {
                    live += next - offset;
                    None
                }
                _ => None,
            };
            if let Some(hash) = msg {
                match self.holds(offset, hash, now_ms, policy.expired_at_ms)? {
                    Holds::Nothing => {}
                    Holds::Expired(at, slot) => self.forget_expired(at, &slot),
                    Holds::Carryable(_) => live += next - offset,
                    Holds::Pinned => pinned += 1,
                }
            }
            pos = next;
            seen += 1;
        }
        self.reclaim.stats.scanned_records += seen as u64;
        if pos < end && self.log.next_fields(pos)?.is_some_and(|(o, _, _)| o < end) {
            return Ok(Phase::Scan { seg, pos, live, pinned });
        }
        if live == 0 && pinned == 0 {
            debug!(seg, "segment holds nothing live");
            let run_full = end - base >= FREE_RUN.saturating_mul(policy.segment_bytes);
            // The next segment is scanned only if its counts say nothing in it is needed.
            if !run_full && self.log.sealed_at(end).is_some() && self.segs.get(end).bytes == 0 {
                return Ok(Phase::Scan { seg: end, pos: end, live: 0, pinned: 0 });
            }
            return Ok(Phase::Free { need: self.snapshots + 1, upto: end, decided: self.log.end() });
        }
        if seg > base {
            // The segments before this one are empty; this one is the head's business next round.
            return Ok(Phase::Free { need: self.snapshots + 1, upto: seg, decided: self.log.end() });
        }
        let head_len = end - base;
        Ok(if pinned == 0 && policy.should_carry(head_len, live, self.log.disk_bytes(), self.live_bytes) {
            debug!(base, live, "carrying the head segment's live messages forward");
            Phase::Carry { pos: base }
        } else {
            // Pinned (a timer about to fire, a reservation made during the scan), or the log
            // changed while the scan ran: look again a second later, or once the head changes,
            // and then only if its counts still say a scan could free or carry it.
            Phase::Rest { until_ms: now_ms + RESCAN_MS, changes: self.segs.get(base).changes }
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn carry(
        &mut self,
        now_ms: u64,
        policy: &ReclaimPolicy,
        plan: &dyn Fn(u64, u64) -> Route,
        until: Instant,
        base: u64,
        end: u64,
        mut pos: u64,
    ) -> Result<Phase> {
        let (mut moved, mut bytes) = (0, 0u64);
        let mut seen = 0;
        while moved < CARRY_SLICE && bytes < BYTES_SLICE && (seen < MIN_SLICE || Instant::now() < until) {
            seen += 1;
            // Read for its fields: only a live message's record is read again, checked, to be copied
            // (its body's one check on this path).
            let Some((offset, rec, next)) = self.log.next_fields(pos)? else { break };
            if offset >= end {
                pos = end;
                break;
            }
            pos = next;
            let step = self.carry_step(offset, &rec, now_ms, policy, plan)?;
            match step {
                CarryStep::Skip => {}
                CarryStep::Expire(at, slot) => self.forget_expired(at, &slot),
                CarryStep::Append { record, message } => {
                    bytes += record.len() as u64;
                    // Built here, so only its fields are decoded again (no CRC) for the dispatch.
                    let (rec, _) = format::decode_with(&record, format::Verify::Fields).map_err(|e| {
                        crate::error::Error::Corrupt {
                            file: "carry".into(),
                            offset,
                            reason: format!("the record built to carry it does not decode: {e:?}"),
                        }
                    })?;
                    self.append_framed(&record, &rec)?;
                    if message {
                        self.reclaim.stats.carried += 1;
                        self.reclaim.stats.carried_bytes += record.len() as u64;
                    }
                    moved += 1;
                }
            }
        }
        if pos < end && self.log.next_fields(pos)?.is_some_and(|(o, _, _)| o < end) {
            return Ok(Phase::Carry { pos });
        }
        // Scan again: a message may have been reserved while the carry was under way.
        Ok(Phase::Scan { seg: base, pos: base, live: 0, pinned: 0 })
    }

    /// Whether the Pause record at `offset` is the one keeping its topic paused.
    fn pause_in_effect(&self, p: &format::Pause<'_>, offset: u64) -> bool {
        self.paused.get(String::from_utf8_lossy(p.topic).as_ref()) == Some(&offset)
    }

    /// Whether the Push record at `offset` is the subscription in effect for its topic.
    fn push_in_effect(&self, p: &format::Push<'_>, offset: u64) -> bool {
        self.push.get(String::from_utf8_lossy(p.topic).as_ref()) == Some(&offset)
    }

    /// Whether the Flow record at `offset` is the flow control in effect for its topic.
    fn flow_in_effect(&self, f: &format::Flow<'_>, offset: u64) -> bool {
        self.flow.get(String::from_utf8_lossy(f.topic).as_ref()) == Some(&offset)
    }

    /// What carrying the record at `offset` does: topic settings in effect (a pause, a push
    /// subscription, flow control) move forward like live messages (ending one needs no copy, since no record in
    /// the log means not set); a live message is copied forward; an expired one is forgotten.
    fn carry_step(
        &self,
        offset: u64,
        rec: &Record<'_>,
        now_ms: u64,
        policy: &ReclaimPolicy,
        plan: &dyn Fn(u64, u64) -> Route,
    ) -> Result<CarryStep> {
        let put = match rec {
            Record::Pause(p) if self.pause_in_effect(p, offset) => {
                return Ok(CarryStep::Append { record: format::encode_pause(p)?, message: false })
            }
            Record::Push(p) if self.push_in_effect(p, offset) => {
                return Ok(CarryStep::Append { record: format::encode_push(p)?, message: false })
            }
            Record::Flow(f) if self.flow_in_effect(f, offset) => {
                return Ok(CarryStep::Append { record: format::encode_flow(f)?, message: false })
            }
            Record::Put(p) => p,
            Record::Carry(c) => &c.put,
            _ => return Ok(CarryStep::Skip),
        };
        Ok(match self.holds(offset, format::id_hash(put.id), now_ms, policy.expired_at_ms)? {
            Holds::Carryable(slot) => {
                let put = match self.log.read(offset)?.0 {
                    Record::Put(p) => p,
                    Record::Carry(c) => c.put,
                    _ => return Ok(CarryStep::Skip),
                };
                CarryStep::Append { record: self.carry_record(&slot, &put, now_ms, plan)?, message: true }
            }
            Holds::Expired(at, slot) => CarryStep::Expire(at, slot),
            Holds::Nothing | Holds::Pinned => CarryStep::Skip,
        })
    }

    /// The Carry of the message in `slot`, whose Put (or the Put of its last Carry), read and
    /// checked by the caller, is `put`.
    fn carry_record(
        &self,
        slot: &Slot,
        put: &Put<'_>,
        now_ms: u64,
        plan: &dyn Fn(u64, u64) -> Route,
    ) -> Result<Vec<u8>> {
        let deliver_at_ms = self.deliver_at(slot)?;
        // A Reschedule's settings go into the copy: the records before it go with their segment.
        let settings = self.delivery_settings(slot, put)?;
        // So is its last failure reason, which an older Transition may hold.
        let last_error = self.last_error(slot)?;
        let route = match slot.state {
            State::Delayed => plan(now_ms, deliver_at_ms),
            State::Done | State::Cancelled => Route::None,
            State::Ready | State::Dead | State::Reserved => Route::Topic,
        };
        format::encode_carry(&Carry {
            prev_msg_offset: slot.msg_offset.get(),
            seq: slot.seq,
            attempt: u32::from(slot.attempt),
            state: slot.state,
            home: slot.home,
            time_ms: self.final_at(slot)?.unwrap_or(now_ms),
            deliver_at_ms,
            put: Put { route, ttr_ms: settings.ttr_ms, max_attempts: settings.max_attempts, ..put.clone() },
            last_error: last_error.as_ref().map(|l| format::LastError {
                time_ms: l.time_ms,
                attempt: l.attempt,
                message: l.message.as_bytes(),
            }),
        })
    }
}

/// One record's part in a carry.
enum CarryStep {
    /// Nothing to move.
    Skip,
    /// A final message past its retention: forget it.
    Expire(SlotRef, Slot),
    /// Append this record (a live message's Carry when `message`, else a topic setting).
    Append { record: Vec<u8>, message: bool },
}
