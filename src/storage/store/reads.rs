//! Reads of messages and counters: records by offset, a message's due times and queue, finding a
//! message by id, and damaged records met along the way.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use tracing::error;

use super::{dead_letter_topic, Store};
use crate::error::{Error, Result};
use crate::message::{last_error, LastError};
use crate::storage::format::{self, Cause, DeliverySettings, Home, Put, Record, State};
use crate::storage::commitlog::CommitLog;
use crate::storage::index::{Slot, SlotRef};
use crate::storage::types::{IdHash, LogOffset};

/// The due time a record sets: when a delayed message becomes ready, when a reservation expires,
/// when a ready message became ready (0 for records of no message).
fn deliver_at_of(rec: &Record<'_>) -> u64 {
    match rec {
        Record::Put(p) => p.deliver_at_ms,
        Record::Transition(t) => t.deliver_at_ms,
        Record::Carry(c) => c.deliver_at_ms,
        Record::Hop(h) => h.target_ms,
        Record::Pause(_) | Record::Push(_) | Record::Flow(_) | Record::Raft(_) | Record::EndOfSegment => 0,
    }
}

impl Store {
    /// The CRC-checked record at `offset`; `Ok(None)` when a record header is there but the record
    /// fails its check (damage in the log itself, logged and counted); `Err` when nothing there
    /// looks like a record (so whatever pointed there is wrong).
    pub(crate) fn read_checked(&self, offset: u64) -> std::result::Result<Option<Record<'_>>, String> {
        read_checked(&self.log, &self.corrupt_records, offset)
    }


    /// Damaged records met outside the recovery scan since open.
    pub fn corrupt_records(&self) -> u64 {
        self.corrupt_records.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the message whose Put (or Carry) record is at `msg_offset`.
    pub fn put_at(&self, msg_offset: LogOffset) -> Result<Put<'_>> {
        match self.log.read(msg_offset.get())?.0 {
            Record::Put(p) => Ok(p),
            Record::Carry(c) => Ok(c.put),
            _ => Err(Error::NotFound(format!("no message at offset {msg_offset}"))),
        }
    }

    /// The due time the slot's last state change set: when a delayed message becomes ready, when a
    /// reservation expires, or when a ready message became ready.
    pub fn deliver_at(&self, slot: &Slot) -> Result<u64> {
        Ok(deliver_at_of(&self.log.read_fields(slot.last_offset.get())?.0))
    }

    /// The due time a message had, for an ack or cancel to keep: when it was to become (or
    /// became) ready, or for a reserved message when the delivery it holds fell due.
    pub fn due_at(&self, slot: &Slot) -> Result<u64> {
        let rec = self.log.read_fields(slot.last_offset.get())?.0;
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

    /// The delivery settings the message's latest Reschedule set, if one did since its Put or
    /// Carry (which hold them otherwise): found by following its changes back, one read each.
    pub fn rescheduled_settings(&self, slot: &Slot) -> Result<Option<DeliverySettings>> {
        let (start, msg) = (self.log.start(), slot.msg_offset.get());
        let mut at = slot.last_offset.get();
        while at > msg && at >= start {
            match self.log.read_fields(at)?.0 {
                Record::Transition(t) => {
                    if t.settings.is_some() {
                        return Ok(t.settings);
                    }
                    // Links only go back; anything else is damage, and the Put's settings stand.
                    match t.prev_offset {
                        Some(prev) if prev < at => at = prev,
                        _ => break,
                    }
                }
                _ => break,
            }
        }
        Ok(None)
    }

    /// The message's last failure reason, if it has one: that of its latest Transition that
    /// holds one, or of the Carry that copied it (the records before go with their segment),
    /// found by following its changes back, one read each.
    pub fn last_error(&self, slot: &Slot) -> Result<Option<LastError>> {
        let mut at = slot.last_offset.get();
        while at >= self.log.start() {
            match self.log.read_fields(at)?.0 {
                Record::Transition(t) => {
                    if let Some(message) = t.error {
                        return Ok(Some(last_error(message, t.time_ms, t.attempt)));
                    }
                    match t.prev_offset {
                        Some(prev) if prev < at => at = prev,
                        _ => break,
                    }
                }
                Record::Carry(c) => {
                    return Ok(c.last_error.map(|l| last_error(l.message, l.time_ms, l.attempt)));
                }
                _ => break,
            }
        }
        Ok(None)
    }

    /// The `seq` of the Reserve that began the reservation the message in `slot` is in: its last
    /// record's, or after Touches (which keep the receipt) the one they follow; `None` when its
    /// records do not lead back to one.
    pub fn reservation_seq(&self, slot: &Slot) -> Result<Option<u32>> {
        let mut at = slot.last_offset.get();
        while at >= self.log.start() {
            match self.log.read_fields(at)?.0 {
                Record::Transition(t) if t.cause == Cause::Touch => match t.prev_offset {
                    Some(prev) if prev < at => at = prev,
                    _ => break,
                },
                Record::Transition(t) if t.cause == Cause::Reserve => return Ok(Some(t.seq)),
                _ => break,
            }
        }
        Ok(None)
    }

    /// The time-to-run and attempt limit that apply to the message in `slot`, whose Put (or the
    /// Put inside its Carry) is `put`.
    pub fn delivery_settings(&self, slot: &Slot, put: &Put<'_>) -> Result<DeliverySettings> {
        Ok(self
            .rescheduled_settings(slot)?
            .unwrap_or(DeliverySettings { ttr_ms: put.ttr_ms, max_attempts: put.max_attempts }))
    }

    /// The queue the message in `slot` belongs to now: its topic, or the topic's `.dlq`.
    pub fn queue_of(&self, slot: &Slot) -> Result<String> {
        let topic = self.topic_of(slot.msg_offset.get())?;
        Ok(match slot.home {
            Home::Main => topic,
            Home::DeadLetter => dead_letter_topic(&topic),
        })
    }

    /// Sum of the record sizes of every indexed message, read from the log (for tests: the
    /// store counts them from the slots, see `recount_live`, and this checks those).
    #[cfg(test)]
    pub(crate) fn count_live_bytes(&self) -> u64 {
        let mut sum = 0;
        self.index.for_each(|s| sum += self.log.record_len(s.msg_offset.get()));
        sum
    }

    pub(super) fn topic_of(&self, msg_offset: u64) -> Result<String> {
        Ok(String::from_utf8_lossy(self.message_fields_at(LogOffset::new(msg_offset))?.topic).into_owned())
    }

    /// The message whose Put (or Carry) is at `msg_offset`, read for its fields (id, topic,
    /// times): its body is neither read nor checked (see [`format::decode_fields`]). For offsets
    /// the index or a receipt gave; a consumer's read of the message uses [`put_at`](Self::put_at).
    pub fn message_fields_at(&self, msg_offset: LogOffset) -> Result<Put<'_>> {
        match self.log.read_fields(msg_offset.get())?.0 {
            Record::Put(p) => Ok(p),
            Record::Carry(c) => Ok(c.put),
            _ => Err(Error::NotFound(format!("no message at offset {msg_offset}"))),
        }
    }

    /// Finds a message by id: its slot, checked against the id in its Put record. A final message
    /// that became final at or before `expired_at_ms` is past `done_retention` and not found, even
    /// while the expiry walk has not reached it yet (a carried final message is reached late).
    pub fn find_id(&self, id: &[u8], expired_at_ms: u64) -> Option<(SlotRef, Slot)> {
        let hash = IdHash::new(format::id_hash(id));
        self.index.find_slot(hash, |s| {
            self.message_fields_at(s.msg_offset).is_ok_and(|p| p.id == id)
                && !self.is_expired(s, expired_at_ms)
        })
    }

    /// When a final message became final: the time of its final Transition, or of the Carry that
    /// moved it (which keeps that time); `None` for a message that is not final.
    pub fn final_at(&self, slot: &Slot) -> Result<Option<u64>> {
        if !slot.state.is_final() {
            return Ok(None);
        }
        Ok(match self.log.read_fields(slot.last_offset.get())?.0 {
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

    /// True when the record that last changed `slot` is durable, and in a cluster committed. Only
    /// then may the slot be removed: an open finds a slot ahead of the log (it points past the log
    /// end) but cannot find a missing one, so a removal that reached the disk before its record
    /// would lose the message for good.
    pub(crate) fn settled(&self, slot: &Slot) -> bool {
        slot.last_offset.get() < self.log.flushed().min(self.committed_end())
    }

    /// The index table and page holding message `id`'s slot (tests that cut power between pages).
    #[cfg(test)]
    pub(crate) fn index_page_of(&self, id: &str) -> Option<(bool, u64)> {
        self.find_id(id.as_bytes(), 0).map(|(at, _)| self.index.page_of(at))
    }

    /// Finds a message by its Put offset and id hash.
    pub fn find_offset(&self, hash: IdHash, msg_offset: LogOffset) -> Option<(SlotRef, Slot)> {
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
}

/// [`Store::read_checked`] over the log and the damage counter alone, for passes that threads
/// share.
pub(super) fn read_checked<'a>(
    log: &'a CommitLog,
    corrupt: &AtomicU64,
    offset: u64,
) -> std::result::Result<Option<Record<'a>>, String> {
    match log.read(offset) {
        Ok((rec, _)) => Ok(Some(rec)),
        Err(Error::Corrupt { reason, .. }) => {
            let h = log.raw(offset, format::HEADER_BYTES);
            if h.is_some_and(format::has_record_magic) {
                corrupt_record(log, corrupt, offset, &reason);
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
fn corrupt_record(log: &CommitLog, corrupt: &AtomicU64, offset: u64, reason: &str) {
    let file = log.segment_path(offset).map(|p| p.display().to_string()).unwrap_or_default();
    error!(%file, offset, %reason, "commit log: damaged record; its message cannot be read");
    corrupt.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
