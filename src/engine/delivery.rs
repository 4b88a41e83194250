//! Delivery: pop (reserve), ack, nack, cancel and dead-lettering, each one Transition record.

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::message::{Delivery, Nacked};
use crate::metrics::inc;
use crate::schedule::levels::plan_hop;
use crate::storage::consumequeue::Entry;
use crate::storage::format::{self, Cause, Home, Record, Route, State};
use crate::storage::index::{Slot, SlotRef};
use crate::storage::store::{dead_letter_topic, EntryCheck, QueueRef};
use crate::storage::types::{IdHash, LogOffset};

use super::timers::Timer;
use super::transition::{ready_state, Change};
use super::{validate_id, Engine};

/// Most queue entries a stats read looks at for a topic's oldest ready message.
const OLDEST_SCAN: u64 = 16;

impl Engine {
    /// Reserves up to `max` ready messages from `topics`, in order; never waits.
    pub fn pop(&mut self, topics: &[String], max: usize, ttr_ms: Option<u64>) -> Result<Vec<Delivery>> {
        Ok(self.pop_flow(topics, max, ttr_ms)?.0)
    }

    /// [`pop`](Self::pop), and when flow control held a topic back, in how many ms asking again
    /// may find room (a long poll waits for that rather than only for new messages).
    pub fn pop_flow(
        &mut self,
        topics: &[String],
        max: usize,
        ttr_ms: Option<u64>,
    ) -> Result<(Vec<Delivery>, Option<u64>)> {
        self.writable()?;
        if let Some(t) = ttr_ms {
            if t == 0 || t > self.cfg.max_delay_ms {
                return Err(Error::invalid("ttr_ms", format!("must be 1 to {} ms", self.cfg.max_delay_ms)));
            }
        }
        let mut out = Vec::new();
        let mut wake: Option<u64> = None;
        // A paused topic answers as if empty; its messages keep falling due meanwhile.
        for topic in topics {
            if self.store.is_paused(topic) || out.len() >= max {
                continue;
            }
            let allowance = self.flow_allowance(topic, max - out.len())?;
            let before = out.len();
            let failed = self.pop_topic(topic, before + allowance.take, ttr_ms, &mut out);
            self.flow_took(topic, out.len() - before, allowance.held);
            if let Some((_, at)) = allowance.held {
                let after = at.saturating_sub(self.now()).max(1);
                wake = Some(wake.map_or(after, |w| w.min(after)));
            }
            match failed {
                Err(e) if out.is_empty() => return Err(e),
                // The reservations made so far are appended: hand them out rather than leave
                // them reserved, invisible, until their time-to-run ends.
                Err(e) => {
                    tracing::warn!(error = %e, delivered = out.len(), "pop failed part-way; returning what it reserved");
                    return Ok((out, None));
                }
                Ok(()) => {}
            }
        }
        self.sync_damage_metrics();
        Ok((out, wake))
    }

    /// Reserves ready messages of `topic` into `out` until it holds `upto`.
    fn pop_topic(&mut self, topic: &str, upto: usize, ttr_ms: Option<u64>, out: &mut Vec<Delivery>) -> Result<()> {
        let mut repairs = 0;
        while out.len() < upto {
            match self.pop_one(topic, ttr_ms, &mut repairs)? {
                Some(Some(d)) => out.push(d),
                Some(None) => {}
                None => break,
            }
        }
        Ok(())
    }

    /// Looks at the entry at `topic`'s cursor: `None` when the queue is read to its end, else the
    /// delivery it made, if any. The cursor moves past the entry only once its reservation is
    /// appended (or it turned out stale or unreadable), so a failed append leaves it to be read
    /// again.
    fn pop_one(
        &mut self,
        topic: &str,
        ttr_ms: Option<u64>,
        repairs: &mut u32,
    ) -> Result<Option<Option<Delivery>>> {
        let Some((at, entry)) = self.store.peek_entry(topic)? else { return Ok(None) };
        let queue = QueueRef::Topic(topic);
        let delivery = match self.store.check_entry(&queue, &entry) {
            EntryCheck::Valid => self.try_reserve(topic, entry, ttr_ms)?,
            EntryCheck::Stale | EntryCheck::CorruptRecord => None,
            // Repaired entries come from the log and check out: one that still fails after
            // several repairs is skipped rather than repaired in a loop.
            EntryCheck::Bad(why) if *repairs >= 8 => {
                tracing::error!(%topic, entry = at.get(), %why, "consume-queue entry still damaged after repair; skipped");
                None
            }
            EntryCheck::Bad(why) => {
                *repairs += 1;
                inc(&self.metrics.queue_repairs);
                let r = self.store.repair_queue(&queue, at, &why);
                self.poison_on_io(r)?;
                return Ok(Some(None));
            }
        };
        self.store.advance_cursor(topic, at);
        Ok(Some(delivery))
    }

    /// Whether `entry` of `topic`'s queue stands for a message that is ready now (a live entry,
    /// not one its message moved on from).
    fn is_ready_entry(&self, topic: &str, entry: &Entry) -> bool {
        if self.store.check_entry(&QueueRef::Topic(topic), entry) != EntryCheck::Valid {
            return false;
        }
        let Ok(Some(Timer { msg_offset, hash, seq, .. })) = self.timer_of(entry.offset) else { return false };
        self.store
            .find_offset(hash, msg_offset)
            .is_some_and(|(_, s)| s.seq == seq && matches!(s.state, State::Ready | State::Dead))
    }

    /// When `topic`'s oldest ready message became due, unix ms. The first of at most
    /// [`OLDEST_SCAN`] entries from the reader's position that is live; past that many stale ones
    /// (acked or cancelled before a pop passed them), the first entry's time: older than the truth,
    /// never younger.
    pub(super) fn oldest_ready_ms(&mut self, topic: &str) -> Option<u64> {
        let queue = QueueRef::Topic(topic);
        let from = self.store.topic_cursor(topic);
        let (entries, _) = self.store.read_entries(&queue, from, OLDEST_SCAN).ok()?;
        let live = entries.iter().find(|(_, e)| self.is_ready_entry(topic, e));
        live.or(entries.first()).map(|(_, e)| e.tag.get())
    }

    fn try_reserve(&mut self, topic: &str, entry: Entry, ttr_ms: Option<u64>) -> Result<Option<Delivery>> {
        let Some(Timer { msg_offset, hash, seq, .. }) = self.timer_of(entry.offset)? else {
            return Ok(None);
        };
        let Some((_, slot)) = self.store.find_offset(hash, msg_offset) else {
            return Ok(None);
        };
        if slot.seq != seq || !matches!(slot.state, State::Ready | State::Dead) {
            return Ok(None);
        }
        let (id, body, msg_ttr) = match self.store.read_checked(msg_offset.get()) {
            Ok(Some(Record::Put(p))) => {
                (String::from_utf8_lossy(p.id).into_owned(), Bytes::copy_from_slice(p.body), p.ttr_ms)
            }
            Ok(Some(Record::Carry(c))) => (
                String::from_utf8_lossy(c.put.id).into_owned(),
                Bytes::copy_from_slice(c.put.body),
                c.put.ttr_ms,
            ),
            // Damaged (logged and counted by the read): nothing to deliver, nothing reserved.
            Ok(None) => return Ok(None),
            Ok(Some(_)) | Err(_) => {
                return Err(Error::NotFound(format!("no message at offset {msg_offset}")))
            }
        };
        let ttr = match ttr_ms {
            Some(t) => t,
            None => self.store.rescheduled_settings(&slot)?.map_or(msg_ttr, |s| s.ttr_ms),
        };
        let now = self.now();
        let attempt = u32::from(slot.attempt) + 1;
        if attempt == 1 {
            // What consumers wait beyond the fire (`lateness_ms`): a pop that came late, or the
            // engine busy; a redelivery's wait is the time-to-run's, not lateness.
            self.metrics.delivery_lateness_ms.observe(now.saturating_sub(entry.tag.get()));
        }
        let new_seq = self.transition(
            &slot,
            Change {
                time_ms: now,
                state: State::Reserved,
                cause: Cause::Reserve,
                home: slot.home,
                attempt,
                deliver_at_ms: now + ttr,
                route: plan_hop(&self.cfg.levels_ms, now, ttr),
                due_ms: Some(entry.tag.get()),
            },
        )?;
        inc(&self.metrics.popped);
        Ok(Some(Delivery {
            id,
            topic: topic.to_string(),
            body,
            receipt: self.receipts.encode(msg_offset.get(), new_seq),
            attempt,
            deliver_at_ms: entry.tag.get(),
            ttr_ms: ttr,
        }))
    }

    fn reserved_by_receipt(&self, receipt: &str) -> Result<Slot> {
        let (msg_offset, seq) = self.receipts.decode(receipt)?;
        let msg_offset = LogOffset::new(msg_offset);
        let gone = || Error::NotFound("unknown or expired receipt".to_string());
        if !self.store.in_log(msg_offset) {
            return Err(gone());
        }
        let hash = match self.store.message_fields_at(msg_offset) {
            Ok(p) => format::id_hash(p.id),
            Err(_) => return Err(gone()),
        };
        match self.store.find_offset(IdHash::new(hash), msg_offset) {
            Some((_, slot)) if slot.seq == seq && slot.state == State::Reserved => Ok(slot),
            // Touched since the pop: the receipt names the Reserve the Touches follow.
            Some((_, slot)) if slot.seq > seq && slot.state == State::Reserved => {
                match self.store.reservation_seq(&slot) {
                    Ok(Some(reserved)) if reserved == seq => Ok(slot),
                    _ => Err(gone()),
                }
            }
            _ => Err(gone()),
        }
    }

    /// Extends a reservation: it now ends `ttr_ms` from now, under the same receipt (one Touch
    /// record, which makes the old expiry timer stale); returns the new end.
    pub fn touch(&mut self, receipt: &str, ttr_ms: u64) -> Result<u64> {
        self.writable()?;
        let max = self.cfg.max_delay_ms;
        if ttr_ms == 0 || ttr_ms > max {
            return Err(Error::invalid("ttr_ms", format!("must be 1 to {max} ms")));
        }
        let slot = self.reserved_by_receipt(receipt)?;
        let now = self.now();
        let change = Change {
            time_ms: now,
            state: State::Reserved,
            cause: Cause::Touch,
            home: slot.home,
            attempt: u32::from(slot.attempt),
            deliver_at_ms: now + ttr_ms,
            route: plan_hop(&self.cfg.levels_ms, now, ttr_ms),
            // The delivery's due time, which an ack or cancel keeps.
            due_ms: Some(self.store.due_at(&slot)?),
        };
        self.transition(&slot, change)?;
        self.note_left_behind(&slot);
        inc(&self.metrics.touched);
        Ok(now + ttr_ms)
    }

    /// Acknowledges a delivery.
    pub fn ack(&mut self, receipt: &str) -> Result<()> {
        self.writable()?;
        let slot = self.reserved_by_receipt(receipt)?;
        self.finish(&slot)
    }

    fn finish(&mut self, slot: &Slot) -> Result<()> {
        self.end(slot, State::Done, Cause::Ack)?;
        inc(&self.metrics.acked);
        if let Some(queue) = self.queue_of(slot) {
            self.count_topic(&queue, |c| c.acked += 1);
        }
        Ok(())
    }

    /// The queue a message counts in now: its topic, or its dead-letter topic.
    fn queue_of(&self, slot: &Slot) -> Option<String> {
        let p = self.store.message_fields_at(slot.msg_offset).ok()?;
        let topic = String::from_utf8_lossy(p.topic);
        Some(match slot.home {
            Home::Main => topic.into_owned(),
            Home::DeadLetter => dead_letter_topic(&topic),
        })
    }

    /// Adds to `topic`'s counts for `/metrics`.
    pub(super) fn count_topic(&mut self, topic: &str, add: impl FnOnce(&mut crate::message::TopicCounts)) {
        if let Some(c) = self.topic_counts.get_mut(topic) {
            return add(c);
        }
        // Stats reads prune what went away; topics made and forgotten between two reads are
        // pruned here, so the map stays within the topics (and dead-letter topics) that exist.
        if self.topic_counts.len() >= 2 * self.cfg.max_topics.max(1) {
            let store = &self.store;
            self.topic_counts.retain(|t, _| store.topic_queue(t).is_some());
        }
        add(self.topic_counts.entry(topic.to_string()).or_default());
    }

    /// Makes the message final (Done or Cancelled), keeping the due time it had.
    fn end(&mut self, slot: &Slot, state: State, cause: Cause) -> Result<()> {
        let change = Change {
            time_ms: self.now(),
            state,
            cause,
            home: slot.home,
            attempt: u32::from(slot.attempt),
            deliver_at_ms: self.store.due_at(slot)?,
            route: Route::None,
            due_ms: None,
        };
        self.transition(slot, change)?;
        self.note_left_behind(slot);
        Ok(())
    }

    pub(super) fn by_id(&self, id: &str) -> Result<(SlotRef, Slot)> {
        if validate_id(id).is_err() {
            return Err(Error::NotFound(format!("no message with id {id:?}")));
        }
        self.store
            .find_id(id.as_bytes(), self.expired_at())
            .ok_or_else(|| Error::NotFound(format!("no message with id {id:?}")))
    }

    /// Marks a message done by id, whatever its state (compat `/finish`).
    pub fn ack_id(&mut self, id: &str) -> Result<()> {
        self.writable()?;
        let (_, slot) = self.by_id(id)?;
        if slot.state.is_final() {
            return Ok(());
        }
        self.finish(&slot)
    }

    /// Puts a delivery back: after `delay_ms`, or the next backoff step; dead-letters it when its
    /// attempts are used up.
    pub fn nack(&mut self, receipt: &str, delay_ms: Option<u64>) -> Result<Nacked> {
        self.nack_with_error(receipt, delay_ms, None)
    }

    /// A [`nack`](Self::nack) that records why the delivery failed in the same record: the
    /// message's last error from then on (cut to 2048 bytes at a character boundary; an empty one
    /// records nothing).
    pub fn nack_with_error(&mut self, receipt: &str, delay_ms: Option<u64>, error: Option<&str>) -> Result<Nacked> {
        self.writable()?;
        let error = error.map(format::bounded_error).filter(|e| !e.is_empty());
        let slot = self.reserved_by_receipt(receipt)?;
        if let Some(d) = delay_ms {
            if d > self.cfg.max_delay_ms {
                return Err(Error::invalid(
                    "delay_ms",
                    format!("exceeds max_delay of {} ms", self.cfg.max_delay_ms),
                ));
            }
        }
        let (max_attempts, step, topic) = {
            let p = self.store.message_fields_at(slot.msg_offset)?;
            let max_attempts = self.store.delivery_settings(&slot, &p)?.max_attempts;
            let backoff = if p.backoff_ms.is_empty() { &self.cfg.default_backoff_ms } else { &p.backoff_ms };
            let i = (slot.attempt as usize).saturating_sub(1).min(backoff.len().saturating_sub(1));
            (
                max_attempts,
                backoff.get(i).copied().unwrap_or(0),
                String::from_utf8_lossy(p.topic).into_owned(),
            )
        };
        inc(&self.metrics.nacked);
        let queue = match slot.home {
            Home::Main => topic.clone(),
            Home::DeadLetter => dead_letter_topic(&topic),
        };
        self.count_topic(&queue, |c| c.nacked += 1);
        if slot.home == Home::Main && u32::from(slot.attempt) >= max_attempts {
            self.dead_letter(&slot, error)?;
            self.note_left_behind(&slot);
            return Ok(Nacked::DeadLettered { topic: dead_letter_topic(&topic) });
        }
        let delay = delay_ms.unwrap_or(step);
        // As for a produce: the delay counts from the receive time rounded up, so the retry is
        // never before the consumer's nack plus the delay.
        let now_us = self.clock.now_us();
        let (now, from) = (now_us / 1000, now_us.div_ceil(1000));
        let deliver_at_ms = self.retry(&slot, Cause::Nack, now, from, delay, error)?;
        self.note_left_behind(&slot);
        Ok(Nacked::Retry { deliver_at_ms })
    }

    /// Makes a reserved message ready again, at once or `delay` ms after `from`, recording why its
    /// delivery failed if `error` says; returns its due time.
    pub(super) fn retry(
        &mut self,
        slot: &Slot,
        cause: Cause,
        now: u64,
        from: u64,
        delay: u64,
        error: Option<&str>,
    ) -> Result<u64> {
        let change = if delay == 0 {
            Change {
                time_ms: now,
                state: ready_state(slot.home),
                cause,
                home: slot.home,
                attempt: u32::from(slot.attempt),
                deliver_at_ms: now,
                route: Route::Topic,
                due_ms: None,
            }
        } else {
            Change {
                time_ms: now,
                state: State::Delayed,
                cause,
                home: slot.home,
                attempt: u32::from(slot.attempt),
                deliver_at_ms: from + delay,
                route: plan_hop(&self.cfg.levels_ms, from, delay),
                due_ms: None,
            }
        };
        let due = change.deliver_at_ms;
        self.transition_with(slot, change, None, error).map(|_| due)
    }

    /// Moves a message whose attempts are used up to its dead-letter topic, with the reason the
    /// last one failed when there is one.
    pub(super) fn dead_letter(&mut self, slot: &Slot, error: Option<&str>) -> Result<()> {
        let now = self.now();
        self.transition_with(
            slot,
            Change {
                time_ms: now,
                state: State::Dead,
                cause: Cause::DeadLetter,
                home: Home::DeadLetter,
                attempt: u32::from(slot.attempt),
                deliver_at_ms: now,
                route: Route::Topic,
                due_ms: None,
            },
            None,
            error,
        )?;
        inc(&self.metrics.dead_lettered);
        // Counted under the topic it left, as the `dead_lettered` gauge is.
        if let Ok(p) = self.store.message_fields_at(slot.msg_offset) {
            let topic = String::from_utf8_lossy(p.topic).into_owned();
            self.count_topic(&topic, |c| c.dead_lettered += 1);
        }
        Ok(())
    }

    /// Cancels a message that is not done: it will never be delivered (again).
    pub fn cancel(&mut self, id: &str) -> Result<()> {
        self.writable()?;
        let (_, slot) = self.by_id(id)?;
        match slot.state {
            State::Cancelled => Ok(()),
            State::Done => Err(Error::Conflict(format!("message {id:?} was already delivered and acked"))),
            _ => self.cancel_slot(&slot),
        }
    }

    pub(super) fn cancel_slot(&mut self, slot: &Slot) -> Result<()> {
        self.end(slot, State::Cancelled, Cause::Cancel)?;
        inc(&self.metrics.cancelled);
        Ok(())
    }

    /// Remembers the queue entry `old` (the slot before a change that did not come from reading
    /// that entry) leaves behind, so that stats do not count it. A timer already due may have
    /// fired and hopped to a level the slot does not record, so it is not noted: it counts until
    /// its reader reaches it (a hop: at most its level's length).
    pub(super) fn note_left_behind(&mut self, old: &Slot) {
        match old.state {
            State::Delayed | State::Reserved => {
                let route = match self.store.record_fields_at(old.last_offset) {
                    Ok(Record::Put(p)) => p.route,
                    Ok(Record::Carry(c)) => c.put.route,
                    Ok(Record::Transition(t)) => t.route,
                    _ => return,
                };
                if let Route::Level { level_ms, due_ms } = route {
                    if due_ms > self.now() {
                        self.left_behind.level(level_ms, old.last_offset.get());
                    }
                }
            }
            // Topic counts move with each record (the store counts states), nothing to note.
            State::Ready | State::Dead | State::Done | State::Cancelled => {}
        }
    }
}
