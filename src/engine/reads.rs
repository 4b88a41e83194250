//! Reads that change nothing: a message by id, its history, and the counters.

use std::collections::HashSet;

use bytes::Bytes;

use crate::error::Result;
use crate::message::{last_error, HistoryEntry, LevelStats, MessageInfo, MessageState, Stats, TopicCounts, TopicStats};
use crate::storage::format::{Cause, Home, Record, Route, State};
use crate::storage::index::Slot;
use crate::storage::store::dead_letter_topic;
use crate::storage::types::LogOffset;

use super::Engine;

/// Most changes a history look-up returns (the newest).
pub const HISTORY_MAX: usize = 100;

/// The history's name for why a change happened.
fn cause_name(c: Cause) -> &'static str {
    match c {
        Cause::Due => "due",
        Cause::Reserve => "reserve",
        Cause::Ack => "ack",
        Cause::Nack => "nack",
        Cause::Expire => "expire",
        Cause::DeadLetter => "dead_letter",
        Cause::Cancel => "cancel",
        Cause::Redrive => "redrive",
        Cause::Reschedule => "reschedule",
        Cause::Touch => "touch",
    }
}

/// The API's name for a stored state.
pub(super) fn message_state(s: State) -> MessageState {
    match s {
        State::Delayed => MessageState::Delayed,
        State::Ready => MessageState::Ready,
        State::Reserved => MessageState::Reserved,
        State::Done => MessageState::Done,
        State::Cancelled => MessageState::Cancelled,
        State::Dead => MessageState::Dead,
    }
}

impl Engine {
    /// Looks a message up by id.
    pub fn get(&self, id: &str) -> Result<MessageInfo> {
        let (_, slot) = self.by_id(id)?;
        self.info_of(&slot)
    }

    /// The message's recorded changes, newest first, and whether they reach back to its produce:
    /// at most [`HISTORY_MAX`], following each change's link to the record before it (one read
    /// each). The walk stops at a Carry (reclaim moved the message and its older records go with
    /// their segment) and at a change written before links were recorded.
    pub fn history(&self, id: &str) -> Result<(Vec<HistoryEntry>, bool)> {
        let (_, slot) = self.by_id(id)?;
        let mut out = Vec::new();
        let mut at = slot.last_offset;
        while out.len() < HISTORY_MAX && at >= self.store.log_start() {
            let entry = |time_ms, event, state, attempt, deliver_at_ms| HistoryEntry {
                time_ms,
                event,
                state: message_state(state),
                attempt,
                deliver_at_ms,
                last_error: None,
            };
            match self.store.record_at(at)? {
                Record::Transition(t) => {
                    out.push(HistoryEntry {
                        last_error: t.error.map(|m| last_error(m, t.time_ms, t.attempt)),
                        ..entry(t.time_ms, cause_name(t.cause), t.state, t.attempt, t.deliver_at_ms)
                    });
                    match t.prev_offset {
                        Some(prev) => at = LogOffset::new(prev),
                        None => break,
                    }
                }
                Record::Put(p) => {
                    let state = if p.route == Route::Topic { State::Ready } else { State::Delayed };
                    out.push(entry(p.created_ms, "produced", state, 0, p.deliver_at_ms));
                    return Ok((out, true));
                }
                Record::Carry(c) => {
                    out.push(HistoryEntry {
                        last_error: c.last_error.map(|l| last_error(l.message, l.time_ms, l.attempt)),
                        ..entry(c.time_ms, "carried", c.state, c.attempt, c.deliver_at_ms)
                    });
                    break;
                }
                Record::Hop(_) | Record::Pause(_) | Record::Push(_) | Record::Flow(_) | Record::Raft(_) | Record::EndOfSegment => break,
            }
        }
        Ok((out, false))
    }

    /// What a look-up shows of the message in `slot`.
    pub(super) fn info_of(&self, slot: &Slot) -> Result<MessageInfo> {
        let deliver_at_ms = self.store.deliver_at(slot)?;
        let p = self.store.put_at(slot.msg_offset)?;
        let topic = String::from_utf8_lossy(p.topic).into_owned();
        Ok(MessageInfo {
            id: String::from_utf8_lossy(p.id).into_owned(),
            dead_letter_topic: (slot.home == Home::DeadLetter).then(|| dead_letter_topic(&topic)),
            topic,
            state: message_state(slot.state),
            deliver_at_ms,
            attempt: u32::from(slot.attempt),
            body: Bytes::copy_from_slice(p.body),
            ttr_ms: self.store.delivery_settings(slot, &p)?.ttr_ms,
            created_at_ms: p.created_ms,
            last_error: self.store.last_error(slot)?,
        })
    }

    /// [`oldest_ready_ms`](Self::oldest_ready_ms), reusing the last answer for a queue whose files
    /// are closed and whose reader has not moved since: its head is where it was (entries behind
    /// it only get older, and one that went stale makes the answer older, never younger). A
    /// closed queue is opened only when its reader moved, which a pop does with its files open.
    fn oldest_ready_cached(&mut self, topic: &str) -> Option<u64> {
        let cursor = self.store.topic_cursor(topic).get();
        let open = self.store.topic_queue(topic).is_some_and(|q| q.is_open());
        match self.oldest_ready.get(topic) {
            Some(&(at, tag)) if !open && at == cursor => tag,
            _ => {
                let tag = self.oldest_ready_ms(topic);
                self.oldest_ready.insert(topic.to_string(), (cursor, tag));
                tag
            }
        }
    }

    /// Counters per level and topic.
    pub fn stats(&mut self) -> Stats {
        self.next_due();
        let levels = self
            .store
            .levels()
            .map(|(ms, q)| {
                let s = self.schedulers.get(&ms);
                let cursor = s.map_or(q.cursor, |s| s.cursor());
                let entries = q.cq.len().saturating_sub(cursor.get());
                // Offset of the first unhandled entry; 0 (prune nothing) if it cannot be read.
                let first = (entries > 0).then(|| q.cq.get(cursor).map_or(0, |e| e.offset.get()));
                let behind = self.left_behind.level_count(ms, first);
                LevelStats {
                    level_ms: ms,
                    backlog: entries.saturating_sub(behind),
                    next_due_ms: s.and_then(|s| s.next_due()),
                }
            })
            .collect();
        let mut topics: Vec<TopicStats> = self
            .store
            .topic_queues()
            .map(|(name, q)| TopicStats {
                topic: name.to_string(),
                ready: q.ready,
                reserved: q.reserved,
                delayed: q.delayed,
                dead_lettered: q.dead,
                counts: TopicCounts::default(),
                oldest_ready_ms: None,
            })
            .collect();
        topics.sort_by(|a, b| a.topic.cmp(&b.topic));
        // Counts of topics that went away go with them: the series stay as many as the topics.
        let names: HashSet<&str> = topics.iter().map(|t| t.topic.as_str()).collect();
        self.topic_counts.retain(|t, _| names.contains(t.as_str()));
        self.oldest_ready.retain(|t, _| names.contains(t.as_str()));
        for t in &mut topics {
            t.counts = self.topic_counts.get(&t.topic).copied().unwrap_or_default();
            if t.ready > 0 {
                t.oldest_ready_ms = self.oldest_ready_cached(&t.topic);
            }
        }
        Stats {
            levels,
            topics,
            disk_bytes: self.store.disk_bytes(),
            open_queues: self.store.open_topic_queues(),
            log_bytes: self.store.log_disk_bytes(),
            log_written_bytes: self.store.log_end().get(),
            live_bytes: self.store.live_bytes(),
            index_entries: self.store.index_len(),
            index_slots: self.store.index_slots(),
            reclaim: self.store.reclaim_stats().into(),
            store_writable: self.durability.writable(),
            store_error: self
                .durability
                .poison_reason()
                .or_else(|| self.durability.trouble())
                .map(|f| f.to_string()),
        }
    }
}
