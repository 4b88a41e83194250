//! Timers: the level schedulers read ahead; a due timer hops on, makes its message ready or
//! expires its reservation.

use tracing::debug;

use crate::error::{Error, Result};
use crate::metrics::inc;
use crate::schedule::levels::plan_hop;
use crate::schedule::scheduler::LevelScheduler;
use crate::storage::consumequeue::Entry;
use crate::storage::format::{self, Cause, Home, Hop, Record, Route, State};
use crate::storage::store::{EntryCheck, QueueRef};
use crate::storage::types::{IdHash, LogOffset, QueueIndex, UnixMs};

use super::transition::{ready_state, Change};
use super::Engine;

/// Timers either make a delayed message ready or expire a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimerAction {
    MakeReady,
    Expire,
}

/// What firing a level entry did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fired {
    /// Handled: acted on, or found stale.
    Done,
    /// Nothing yet: the entry was an earlier hop of a message that is due already, to be held
    /// again under the message's own due time.
    Deferred(UnixMs),
}

/// What a queue entry's record says of the message's timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Timer {
    /// The message's Put or Carry record.
    pub(super) msg_offset: LogOffset,
    /// Its id hash, to find its index slot.
    pub(super) hash: IdHash,
    /// The delivery sequence the timer belongs to; a slot with another is past it.
    pub(super) seq: u32,
    /// When the timer is due (the hop's target, or the message's due time).
    pub(super) due_ms: UnixMs,
}

impl Timer {
    /// The timer of a record's fields (bare numbers, as records hold them).
    fn new(msg_offset: u64, hash: u64, seq: u32, due_ms: u64) -> Timer {
        Timer {
            msg_offset: LogOffset::new(msg_offset),
            hash: IdHash::new(hash),
            seq,
            due_ms: UnixMs::new(due_ms),
        }
    }
}

impl Engine {
    fn skew_for(&self, level_ms: u64) -> u64 {
        // Only the smallest level receives sub-level remainders, which may be out of order.
        if level_ms <= self.cfg.levels_ms[0] {
            level_ms
        } else {
            0
        }
    }

    pub(super) fn sync_schedulers(&mut self) {
        // Level queues are only ever added, and a scheduler only made for one: equal counts mean
        // every level has its scheduler. This runs at every engine step, inline ones included.
        if self.schedulers.len() == self.store.level_count() {
            return;
        }
        let levels: Vec<(u64, QueueIndex)> = self.store.levels().map(|(ms, q)| (ms, q.cursor)).collect();
        for (ms, cursor) in levels {
            if !self.schedulers.contains_key(&ms) {
                let skew = self.skew_for(ms);
                self.schedulers.insert(ms, LevelScheduler::new(ms, skew, cursor));
            }
        }
    }

    /// The timer a queue entry's record stands for; `None` when the record
    /// was reclaimed (its message was carried forward or expired, so the entry is stale).
    pub(super) fn timer_of(&self, at: LogOffset) -> Result<Option<Timer>> {
        if at < self.store.log_start() {
            return Ok(None);
        }
        let offset = at.get();
        // The entry was checked against this record on the same path: its fields are enough.
        Ok(Some(match self.store.record_fields_at(at)? {
            Record::Put(p) => Timer::new(offset, format::id_hash(p.id), 0, p.deliver_at_ms),
            Record::Carry(c) => Timer::new(offset, format::id_hash(c.put.id), c.seq, c.deliver_at_ms),
            Record::Transition(t) => Timer::new(t.msg_offset, t.id_hash, t.seq, t.deliver_at_ms),
            Record::Hop(h) => Timer::new(h.msg_offset, h.id_hash, h.seq, h.target_ms),
            Record::Pause(_) | Record::Push(_) | Record::Flow(_) | Record::Raft(_) | Record::EndOfSegment => {
                return Err(Error::Corrupt {
                    file: "commitlog".into(),
                    offset,
                    reason: "queue entry points at a record that makes none".into(),
                })
            }
        }))
    }

    /// Lets every scheduler read ahead, checking each entry against its record first; a damaged
    /// level queue is repaired from the log and its scheduler restarted from the last good entry.
    fn fill_schedulers(&mut self) {
        self.fill_schedulers_of(None);
    }

    /// [`fill_schedulers`](Self::fill_schedulers) for one level's scheduler only, or all.
    fn fill_schedulers_of(&mut self, only: Option<u64>) {
        self.sync_schedulers();
        // Repaired entries come from the log and check out; more damage than this per call is
        // left to the next call rather than looping here.
        for _ in 0..8 {
            let mut damaged = None;
            for (ms, s) in self.schedulers.iter_mut().filter(|(ms, _)| only.is_none_or(|o| o == **ms)) {
                let Some(q) = self.store.level(*ms) else { continue };
                let (store, queue) = (&self.store, QueueRef::Level(*ms));
                let mut why = String::new();
                let bad = s.fill_checked(&q.cq, |e| match store.check_entry(&queue, e) {
                    EntryCheck::Bad(w) => {
                        why = w;
                        true
                    }
                    _ => false,
                });
                if let Some(at) = bad {
                    damaged = Some((*ms, at, why));
                    break;
                }
            }
            let Some((ms, at, why)) = damaged else { return };
            if self.durability.is_poisoned() {
                // No writes: the scheduler waits before the damaged entry until a restart.
                return;
            }
            inc(&self.metrics.queue_repairs);
            let r = self.store.repair_queue(&QueueRef::Level(ms), at, &why);
            let keep = match self.poison_on_io(r) {
                Ok(keep) => keep,
                Err(e) => {
                    tracing::error!(error = %e, level_ms = ms, "repairing a level queue failed");
                    return;
                }
            };
            // The scheduler may hold entries read before the damage: start it again at the last
            // good entry (entries fired twice are skipped by their sequence number).
            let cursor = self.schedulers.get(&ms).map_or(keep, |s| s.cursor()).min(keep);
            self.store.set_level_cursor(ms, cursor);
            self.schedulers.remove(&ms);
            self.sync_schedulers();
        }
    }

    /// Earliest due time among all levels' held entries.
    pub fn next_due(&mut self) -> Option<u64> {
        self.fill_schedulers();
        let mut best: Option<u64> = None;
        for s in self.schedulers.values() {
            if let Some(d) = s.next_due() {
                best = Some(best.map_or(d, |b| b.min(d)));
            }
        }
        best
    }

    /// Fires due timers, earliest first across all levels; returns how many it fired. `limit`
    /// bounds the entries it handles, deferred ones included.
    ///
    /// Picking the global minimum each time keeps a catch-up after downtime in due order: an
    /// entry read late whose message is due already, although it was an earlier hop of its chain,
    /// is deferred to the message's own due time rather than made ready in the order of its hop.
    pub fn run_due(&mut self, limit: usize) -> Result<usize> {
        self.writable()?;
        let now = self.fire_now();
        let (mut fired, mut handled) = (0, 0);
        // Only the scheduler that handed out an entry needs to read on: looking at every level
        // for every fire cost a fifth of a catch-up's time. A fire that appended to a level (a
        // Hop, a reservation's timer) still sends every scheduler back to its queue; such entries
        // are planned from now, so none is due in this run, but nothing here relies on that.
        let mut last: Option<(u64, u64)> = None;
        while handled < limit {
            handled += 1;
            match last {
                Some((ms, appends)) if appends == self.store.level_appends() => self.fill_schedulers_of(Some(ms)),
                _ => self.fill_schedulers(),
            }
            let mut best: Option<(u64, u64)> = None;
            for (ms, s) in self.schedulers.iter() {
                if let Some(d) = s.next_due() {
                    if d <= now && best.is_none_or(|(bd, _)| d < bd) {
                        best = Some((d, *ms));
                    }
                }
            }
            let Some((_, ms)) = best else { break };
            let Some((idx, entry)) = self.schedulers.get_mut(&ms).and_then(|s| s.take_due(now)) else {
                break;
            };
            let appends = self.store.level_appends();
            let may_defer = self.schedulers.get(&ms).is_some_and(|s| s.may_defer());
            // Entries were checked against their records when the scheduler read them.
            match self.fire(entry, now, may_defer) {
                Ok(Fired::Done) => {}
                Ok(Fired::Deferred(due)) => {
                    if let Some(s) = self.schedulers.get_mut(&ms) {
                        s.defer(idx, entry, due);
                    }
                    last = Some((ms, appends));
                    continue;
                }
                // A damaged record of the message (logged and counted when read): it cannot be
                // acted on, and stopping here would hold the level's cursor back for good.
                Err(Error::Corrupt { file, offset, reason }) => {
                    tracing::error!(%file, offset, %reason, level_ms = ms, "timer skipped: its message is unreadable");
                }
                // Nothing was appended for it (a resource ran out, or the store is poisoned):
                // the timer fires on the next try instead of being forgotten until a restart.
                Err(e) => {
                    if let Some(s) = self.schedulers.get_mut(&ms) {
                        s.put_back(idx, entry);
                    }
                    return Err(e);
                }
            }
            if let Some(s) = self.schedulers.get_mut(&ms) {
                s.done(idx);
            }
            self.left_behind.level_passed(ms, entry.offset.get());
            last = Some((ms, appends));
            fired += 1;
        }
        self.sync_damage_metrics();
        Ok(fired)
    }

    fn fire(&mut self, entry: Entry, now: u64, may_defer: bool) -> Result<Fired> {
        let Some(Timer { msg_offset, hash, seq, due_ms }) = self.timer_of(entry.offset)? else {
            return Ok(Fired::Done);
        };
        // Read late, the entry of an earlier hop (due before its message) may come before entries
        // of messages due sooner that wait on their last hop: held back under the message's own
        // time, it is made ready in due order among them. Decided before the index is probed, so
        // a deferred entry costs that probe once; a stale one is dropped when it comes back.
        if may_defer && entry.tag < due_ms && due_ms.get() <= now {
            return Ok(Fired::Deferred(due_ms));
        }
        // A fire acts only on the timer's newest record. Entries fired after the last checkpoint
        // fire again after a crash, and the Hops they wrote then were replayed: an entry older
        // than such a Hop already hopped, and hopping again would start a second chain.
        if let Some(newest) = self.store.replayed_hop(msg_offset, seq) {
            if entry.offset < newest {
                return Ok(Fired::Done);
            }
        }
        let (slot, action) = match self.store.find_offset(hash, msg_offset) {
            Some((_, slot)) if slot.seq == seq && slot.state == State::Delayed => {
                (slot, TimerAction::MakeReady)
            }
            Some((_, slot)) if slot.seq == seq && slot.state == State::Reserved => {
                (slot, TimerAction::Expire)
            }
            _ => {
                self.store.forget_replayed_hop(msg_offset, seq);
                return Ok(Fired::Done);
            }
        };
        let target = due_ms.get();
        if target > now {
            let route = plan_hop(&self.cfg.levels_ms, now, target - now);
            debug!(msg_offset = msg_offset.get(), target, ?route, "hop");
            self.append(&Record::Hop(Hop {
                msg_offset: msg_offset.get(),
                id_hash: hash.get(),
                seq,
                target_ms: target,
                route,
            }))?;
            inc(&self.metrics.hops);
            return Ok(Fired::Done);
        }
        self.store.forget_replayed_hop(msg_offset, seq);
        match action {
            TimerAction::MakeReady => {
                self.metrics.lateness_ms.observe(now - target);
                self.transition(
                    &slot,
                    Change {
                        time_ms: now,
                        state: ready_state(slot.home),
                        cause: Cause::Due,
                        home: slot.home,
                        attempt: u32::from(slot.attempt),
                        deliver_at_ms: target,
                        route: Route::Topic,
                        due_ms: None,
                    },
                )?;
            }
            TimerAction::Expire => {
                inc(&self.metrics.ttr_expired);
                let put = self.store.message_fields_at(msg_offset)?;
                let max_attempts = self.store.delivery_settings(&slot, &put)?.max_attempts;
                if slot.home == Home::Main && u32::from(slot.attempt) >= max_attempts {
                    self.dead_letter(&slot, None)?;
                } else {
                    self.retry(&slot, Cause::Expire, now, now, 0, None)?;
                }
            }
        }
        Ok(Fired::Done)
    }

    /// Entries the level schedulers hold in memory (bounded by the read-ahead window).
    pub fn scheduler_window(&self) -> usize {
        self.schedulers.values().map(|s| s.held()).sum()
    }
}
