//! Walks over a topic's queues in bounded slices: browse, purge and redrive.

use crate::error::{Error, Result};
use crate::message::{MessageInfo, MessageState};
use crate::metrics::inc;
use crate::storage::consumequeue::Entry;
use crate::storage::format::{Cause, Home, Route, State};
use crate::storage::index::Slot;
use crate::storage::store::{dead_letter_topic, QueueRef};
use crate::storage::types::QueueIndex;

use super::transition::Change;
use super::reads::message_state;
use super::timers::Timer;
use super::{validate_topic, Engine};

/// Most queue entries one walk step (browse, purge, redrive) looks at: a few milliseconds.
const WALK_BUDGET: u64 = 4096;

/// Where a walk over a topic's messages stands: which of its queues, and the entry in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalkPos {
    /// Index into the walk's queue list (the topic's queue, then the levels in ascending order).
    pub queue: usize,
    /// Entry index in that queue.
    pub entry: u64,
}

/// A queue a walk visits: the topic's own, or one level's.
enum WalkQueue {
    Topic,
    Level(u64),
}

impl Engine {
    /// The message a queue entry still stands for: its slot, if the entry is its live timer or
    /// queue entry (same seq) and it is not final, and it belongs to queue `topic`.
    fn live_entry(&self, entry: &Entry, topic: &str) -> Result<Option<Slot>> {
        let Some(Timer { msg_offset, hash, seq, .. }) = self.timer_of(entry.offset)? else {
            return Ok(None);
        };
        let Some((_, slot)) = self.store.find_offset(hash, msg_offset) else {
            return Ok(None);
        };
        if slot.seq != seq || slot.state.is_final() {
            return Ok(None);
        }
        Ok((self.store.queue_of(&slot)? == topic).then_some(slot))
    }

    /// The queues a walk over `topic`'s messages in `states` visits, in order: the topic's own
    /// queue for ready (and dead) ones, every level for delayed and reserved ones (their timers).
    fn walk_queues(&self, states: &[MessageState]) -> Vec<WalkQueue> {
        let mut out = Vec::new();
        if states.iter().any(|s| matches!(s, MessageState::Ready | MessageState::Dead)) {
            out.push(WalkQueue::Topic);
        }
        if states.iter().any(|s| matches!(s, MessageState::Delayed | MessageState::Reserved)) {
            out.extend(self.schedulers.keys().map(|ms| WalkQueue::Level(*ms)));
        }
        out
    }

    /// Visits live messages of queue `topic` in `states`, from `at`, looking at no more than
    /// [`WALK_BUDGET`] entries and stopping at entries written at or after log offset `until`;
    /// `visit` returns false to stop early (after that message). Returns where to go on from,
    /// `None` when the walk is done.
    fn walk(
        &mut self,
        topic: &str,
        states: &[MessageState],
        mut at: WalkPos,
        until: u64,
        mut visit: impl FnMut(&mut Engine, Slot) -> Result<bool>,
    ) -> Result<Option<WalkPos>> {
        let queues = self.walk_queues(states);
        let mut budget = WALK_BUDGET;
        while let Some(q) = queues.get(at.queue) {
            let (queue, floor) = match q {
                WalkQueue::Topic => (QueueRef::Topic(topic), self.store.topic_cursor(topic)),
                WalkQueue::Level(ms) => {
                    (QueueRef::Level(*ms), self.schedulers.get(ms).map_or(QueueIndex::new(0), |s| s.cursor()))
                }
            };
            let (entries, _) =
                self.store.read_entries(&queue, QueueIndex::new(at.entry).max(floor), budget)?;
            let mut finished = entries.len() < budget as usize;
            for (i, e) in entries {
                budget -= 1;
                at.entry = i.get() + 1;
                if e.offset.get() >= until {
                    finished = true;
                    break;
                }
                let Some(slot) = self.live_entry(&e, topic)? else { continue };
                if states.contains(&message_state(slot.state)) && !visit(self, slot)? {
                    return Ok(Some(at));
                }
            }
            if !finished {
                return Ok(Some(at));
            }
            at = WalkPos { queue: at.queue + 1, entry: 0 };
            if budget == 0 {
                return Ok((at.queue < queues.len()).then_some(at));
            }
        }
        Ok(None)
    }

    /// Up to `limit` live messages of queue `topic` in `state`, from `at` (see
    /// [`walk`](Self::walk)); with the position to go on from, `None` at the end.
    pub fn browse(
        &mut self,
        topic: &str,
        state: MessageState,
        at: WalkPos,
        limit: usize,
    ) -> Result<(Vec<MessageInfo>, Option<WalkPos>)> {
        validate_topic(topic)?;
        let states = [state];
        if at.queue >= self.walk_queues(&states).len().max(1) {
            return Err(Error::invalid("cursor", "does not belong to this listing"));
        }
        let mut out = Vec::new();
        let until = self.store.log_end().get();
        let next = self.walk(topic, &states, at, until, |e, slot| {
            out.push(e.info_of(&slot)?);
            Ok(out.len() < limit)
        })?;
        Ok((out, next))
    }

    /// Cancels live messages of `topic` (delayed, ready, reserved) written before log offset
    /// `until`, one bounded slice from `at`; returns how many and where to go on.
    pub fn purge(&mut self, topic: &str, at: WalkPos, until: u64) -> Result<(u64, Option<WalkPos>)> {
        self.writable()?;
        validate_topic(topic)?;
        let mut cancelled = 0;
        let states = [MessageState::Delayed, MessageState::Ready, MessageState::Dead, MessageState::Reserved];
        let next = self.walk(topic, &states, at, until, |e, slot| {
            e.cancel_slot(&slot)?;
            cancelled += 1;
            Ok(true)
        })?;
        Ok((cancelled, next))
    }

    /// Moves dead letters of `topic` (waiting in `{topic}.dlq`, not reserved) back to `topic`:
    /// ready now, attempts reset. With `ids`, those (others are left alone); else one bounded
    /// slice of the dead-letter queue from `at`, up to log offset `until`. Returns how many moved
    /// and where to go on.
    pub fn redrive(
        &mut self,
        topic: &str,
        ids: Option<&[String]>,
        at: WalkPos,
        until: u64,
    ) -> Result<(u64, Option<WalkPos>)> {
        self.writable()?;
        validate_topic(topic)?;
        let dlq = dead_letter_topic(topic);
        let mut moved = 0;
        if let Some(ids) = ids {
            for id in ids {
                let Ok((_, slot)) = self.by_id(id) else { continue };
                if slot.state == State::Dead && self.store.queue_of(&slot)? == dlq {
                    self.redrive_slot(&slot)?;
                    moved += 1;
                }
            }
            return Ok((moved, None));
        }
        let next = self.walk(&dlq, &[MessageState::Dead], at, until, |e, slot| {
            e.redrive_slot(&slot)?;
            moved += 1;
            Ok(true)
        })?;
        Ok((moved, next))
    }

    fn redrive_slot(&mut self, slot: &Slot) -> Result<()> {
        let now = self.now();
        self.transition(
            slot,
            Change {
                time_ms: now,
                state: State::Ready,
                cause: Cause::Redrive,
                home: Home::Main,
                attempt: 0,
                deliver_at_ms: now,
                route: Route::Topic,
                // Version 2, so an older delayd refuses the unknown cause rather than call it damage.
                due_ms: Some(now),
            },
        )?;
        inc(&self.metrics.redriven);
        Ok(())
    }
}
