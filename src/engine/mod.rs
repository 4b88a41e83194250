//! The engine: the single-threaded state machine that owns the store and the level schedulers.
//!
//! Every operation is one append to the commit log (dispatched at once into queues and index), so
//! the engine's state can always be rebuilt from the log. It never waits: the broker thread around
//! it decides when to flush and when to sleep.
//!
//! Each room is an `impl Engine` of its own:
//! - [`receipts`]: the signed delivery receipts.
//! - [`timers`]: level schedulers and due timers.
//! - [`walks`]: browse, purge, redrive.
//! - [`topics`]: pause, push subscriptions, topic listing.
//! - [`reads`]: look-ups, history, stats.
//! - [`maintenance`]: index resize, reclaim, checkpoints.

mod maintenance;
mod reads;
mod receipts;
mod timers;
mod topics;
mod walks;

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::config::{BrokerConfig, DelayPolicy};
use crate::error::{Error, Result};
use crate::limits::{MAX_ATTEMPTS_LIMIT, MAX_BACKOFF_STEPS, MAX_ID_BYTES, MAX_TOPIC_LEN, UNLIMITED_ATTEMPTS};
use crate::live::LeftBehind;
use crate::message::{Delivery, Nacked, ProduceRequest, Produced, When};
use crate::metrics::{inc, Metrics};
use crate::schedule::clock::Clock;
use crate::schedule::levels::{nearest_level, plan_hop, validate_levels};
use crate::schedule::scheduler::LevelScheduler;
use crate::storage::consumequeue::Entry;
use crate::storage::durability::{Durability, Failure};
use crate::storage::format::{self, Cause, Home, Put, Record, Route, State, Transition};
use crate::storage::index::{Slot, SlotRef};
use crate::storage::io;
use crate::storage::store::{dead_letter_topic, EntryCheck, OpenReport, QueueRef, Store, StoreConfig};
pub use reads::HISTORY_MAX;
pub(crate) use receipts::Receipts;
use timers::Timer;
pub use walks::WalkPos;

/// Checks a topic name: `[A-Za-z0-9._-]{1,128}`.
pub fn validate_topic(topic: &str) -> Result<()> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_LEN} characters")));
    }
    // '%' appears only in the storage names of compat topics (see `http::compat`), which escape
    // every other byte as %XX; native topics never contain it.
    if !topic.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'%')) {
        return Err(Error::invalid("topic", "may only contain A-Z, a-z, 0-9, '.', '_' and '-'"));
    }
    Ok(())
}

/// Checks a client-chosen id: 1 to 128 bytes of UTF-8 without control characters. (The native
/// API also refuses whitespace; compat ids, as the original's, may contain spaces.)
pub fn validate_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(Error::invalid("id", format!("must be 1 to {MAX_ID_BYTES} bytes")));
    }
    if id.chars().any(|c| c.is_control()) {
        return Err(Error::invalid("id", "must not contain control characters"));
    }
    Ok(())
}

/// The broker's state machine.
pub struct Engine {
    cfg: BrokerConfig,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    store: Store,
    schedulers: BTreeMap<u64, LevelScheduler>,
    id_counter: u64,
    id_seed: u64,
    /// The store's health, shared with the threads that sync its files.
    durability: Durability,
    receipts: Receipts,
    /// Queue entries of messages that moved on without their reader passing them.
    left_behind: LeftBehind,
}

pub(super) fn ready_state(home: Home) -> State {
    match home {
        Home::Main => State::Ready,
        Home::DeadLetter => State::Dead,
    }
}

pub(super) struct Change {
    /// The clock reading the change was decided on; it also planned `deliver_at_ms` and `route`.
    pub(super) time_ms: u64,
    pub(super) state: State,
    pub(super) cause: Cause,
    pub(super) home: Home,
    pub(super) attempt: u32,
    pub(super) deliver_at_ms: u64,
    pub(super) route: Route,
    /// A Reserve's delivery due time, kept by a later ack or cancel.
    pub(super) due_ms: Option<u64>,
}

impl Engine {
    /// Opens the store under `cfg.data_dir` and sets up one scheduler per level queue.
    pub fn open(
        cfg: BrokerConfig,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<(Engine, OpenReport)> {
        validate_levels(&cfg.levels_ms)?;
        // Asked before the store makes a fresh log: a key made beside an old log is worth a warning.
        let holds_log = cfg.data_dir.join("commitlog").is_dir();
        let (store, report) = Store::open(
            &cfg.data_dir,
            StoreConfig {
                segment_bytes: cfg.segment_bytes,
                cq_entries_per_file: cfg.cq_entries_per_file,
                index_initial_slots: cfg.index_initial_slots,
                recovery: cfg.recovery,
                open_queues: cfg.open_queues,
                reclaim: cfg.reclaim,
            },
        )?;
        let id_seed = format::id_hash(&clock.now_us().to_le_bytes()) ^ u64::from(std::process::id());
        let durability = store.durability().clone();
        let receipts = Receipts::new(&crate::storage::secret::load_or_create(
            &cfg.data_dir.join("receipt_key"),
            holds_log,
        )?);
        let mut engine = Engine {
            cfg,
            clock,
            metrics,
            store,
            schedulers: BTreeMap::new(),
            id_counter: 0,
            id_seed,
            durability,
            receipts,
            left_behind: LeftBehind::default(),
        };
        // Levels removed from the config keep their queue until drained: their entries carry
        // absolute due times, so they fire correctly whatever the current level list is.
        let on_disk: Vec<u64> = engine.store.levels.keys().copied().collect();
        for ms in on_disk {
            if !engine.cfg.levels_ms.contains(&ms) {
                let q = &engine.store.levels[&ms];
                if q.cq.len() > q.cursor {
                    tracing::warn!(
                        level_ms = ms,
                        pending = q.cq.len() - q.cursor,
                        "draining a level no longer configured"
                    );
                }
            }
        }
        for ms in engine.cfg.levels_ms.clone() {
            engine.store.level_queue(ms)?;
        }
        engine.sync_schedulers();
        Ok((engine, report))
    }

    /// The configuration in force.
    pub fn config(&self) -> &BrokerConfig {
        &self.cfg
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Final messages that became final at or before this time are past `done_retention`.
    fn expired_at(&self) -> u64 {
        self.now().saturating_sub(self.cfg.done_retention_ms)
    }

    fn writable(&self) -> Result<()> {
        self.durability.check()
    }

    /// The store's durability owner (health, durable log offset).
    pub fn durability(&self) -> &Durability {
        &self.durability
    }

    fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.writable()?;
        let r = self.store.append(record);
        if r.is_ok() {
            self.durability.clear_trouble();
        }
        self.poison_on_io(r)
    }

    /// Sorts a failed write, mapping or deletion into what it means for later writes. A resource
    /// that ran out (disk space, file handles) fails this call only: the store changed nothing
    /// before it (see `Store::append`), and the next write may succeed. Any other I/O error leaves
    /// the files in an unknown state, so nothing more may be acknowledged.
    fn poison_on_io<T>(&mut self, r: Result<T>) -> Result<T> {
        let e = match r {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        self.writable()?;
        match e {
            Error::Io { ref source, .. } if io::is_resource_exhausted(source) => {
                let f = Failure::from_error(&e);
                if self.durability.note_trouble(f.clone()) {
                    tracing::warn!(op = %f.op, file = %f.file, error = %f.error, "write refused for lack of a resource; retry later");
                }
                Err(Error::Unavailable(e.to_string()))
            }
            Error::Io { .. } | Error::Corrupt { .. } => Err(self.durability.poison(Failure::from_error(&e))),
            e => Err(e),
        }
    }

    /// Makes every append durable; a failed sync has poisoned the store (see `durability.rs`).
    pub fn flush(&mut self) -> Result<()> {
        self.writable()?;
        if self.store.log.flushed() >= self.store.log.end() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        if let Err(e) = self.store.flush_log() {
            // A sync failure poisoned the store in the io layer; anything else (opening a file)
            // poisons here, since the flush's outcome is unknown.
            return Err(match self.durability.check() {
                Err(refusal) => refusal,
                Ok(()) => self.durability.poison(Failure::from_error(&e)),
            });
        }
        self.metrics.flush_us.observe(started.elapsed().as_micros() as u64);
        Ok(())
    }

    /// True when appends are waiting for a flush.
    pub fn dirty(&self) -> bool {
        self.store.log.flushed() < self.store.log.end()
    }

    /// Offset one past the last appended record.
    pub fn log_end(&self) -> u64 {
        self.store.log.end()
    }

    /// Paths of the segment files holding `[from, to)` of the log, for a background flusher.
    pub fn log_paths(&self, from: u64, to: u64) -> Vec<std::path::PathBuf> {
        self.store.log.paths(from, to)
    }

    /// Refuses every later write: something failed whose outcome is unknown.
    pub fn poison(&mut self, failure: Failure) {
        self.durability.poison(failure);
    }

    /// Checkpoints and leaves the clean-shutdown marker.
    pub fn close(self) -> Result<()> {
        let cursors = self.level_cursors();
        self.store.close(&cursors)
    }

    /// Topics that received entries since the last call (for long-poll wake-ups).
    pub fn take_touched(&mut self) -> Vec<String> {
        self.store.take_touched()
    }

    fn new_id(&mut self) -> String {
        loop {
            self.id_counter += 1;
            let a = format::id_hash(&[self.id_seed.to_le_bytes(), self.id_counter.to_le_bytes()].concat());
            let id = format!("{:012x}{:016x}", self.clock.now_ms() & 0xFFFF_FFFF_FFFF, a);
            if self.store.find_id(id.as_bytes(), self.expired_at()).is_none() {
                return id;
            }
        }
    }

    /// Produces one message; a message with the same id answers as an idempotent retry (the same
    /// request) or a conflict.
    pub fn produce(&mut self, topic: &str, req: ProduceRequest) -> Result<Produced> {
        self.produce_as(topic, req, false)
    }

    /// Produces one message that its id names from now on, as the compat `/push` does: a pending,
    /// reserved or dead message with the same id is cancelled first (it is never delivered again)
    /// and a final one is forgotten. Everything that can refuse the request is checked before the
    /// old message changes. A failure between the two appends leaves the old message cancelled and
    /// the push unanswered, which its client retries.
    pub fn replace(&mut self, topic: &str, req: ProduceRequest) -> Result<Produced> {
        self.produce_as(topic, req, true)
    }

    fn produce_as(&mut self, topic: &str, req: ProduceRequest, replace: bool) -> Result<Produced> {
        // Even an idempotent repeat is refused by a poisoned store: the first produce's record
        // may be among the writes whose sync failed, and a 200 would acknowledge it.
        self.writable()?;
        validate_topic(topic)?;
        if req.body.len() > self.cfg.max_body_bytes {
            return Err(Error::TooLarge(format!(
                "body is {} bytes; the limit is {} (max_body_bytes)",
                req.body.len(),
                self.cfg.max_body_bytes
            )));
        }
        let ttr_ms = req.ttr_ms.unwrap_or(self.cfg.default_ttr_ms);
        if ttr_ms == 0 || ttr_ms > self.cfg.max_delay_ms {
            return Err(Error::invalid("ttr_ms", format!("must be 1 to {} ms", self.cfg.max_delay_ms)));
        }
        let max_attempts = req.max_attempts.unwrap_or(self.cfg.default_max_attempts);
        if max_attempts == 0 || (max_attempts > MAX_ATTEMPTS_LIMIT && max_attempts != UNLIMITED_ATTEMPTS) {
            return Err(Error::invalid("max_attempts", format!("must be 1 to {MAX_ATTEMPTS_LIMIT}")));
        }
        let backoff_ms = req.backoff_ms.clone().unwrap_or_default();
        if backoff_ms.len() > MAX_BACKOFF_STEPS || backoff_ms.iter().any(|b| *b > self.cfg.max_delay_ms) {
            let why = format!("at most {MAX_BACKOFF_STEPS} steps, each no longer than max_delay");
            return Err(Error::invalid("backoff", why));
        }
        let now_us = self.clock.now_us();
        let now = now_us / 1000;
        let (request_kind, request_value) = match req.when {
            When::Now => (0, 0),
            When::DelayMs(d) => (1, d),
            When::AtMs(t) => (2, t),
            When::LevelIndex(i) => (3, u64::from(i)),
        };
        // With `replace`, the message this one replaces, and whether it must be cancelled first.
        let mut replaces = None;
        if let Some(id) = &req.id {
            validate_id(id)?;
            if let Some((_, slot)) = self.store.find_id(id.as_bytes(), self.expired_at()) {
                if replace {
                    replaces = Some(!matches!(slot.state, State::Done | State::Cancelled));
                } else {
                    let p = self.store.put_at(slot.msg_offset)?;
                    let same = p.topic == topic.as_bytes()
                        && p.body == &req.body[..]
                        && p.request_kind == request_kind
                        && p.request_value == request_value;
                    if same {
                        return Ok(Produced {
                            id: id.clone(),
                            deliver_at_ms: p.deliver_at_ms,
                            created: false,
                        });
                    }
                    return Err(Error::Conflict(format!(
                        "id {id:?} already exists with a different topic, body or delay"
                    )));
                }
            }
        }
        self.may_name_topic(topic)?;
        // A delay counts from the receive time rounded up, so the due time is never before the
        // client's send time plus the delay; a message ready at once is visible from `now` on.
        let (deliver_at_ms, route) = self.plan_produce(&req.when, now, now_us.div_ceil(1000))?;
        let id = match req.id {
            Some(id) => id,
            None => self.new_id(),
        };
        let rec = format::encode_put(&Put {
            created_ms: now,
            deliver_at_ms,
            ttr_ms,
            max_attempts,
            request_kind,
            request_value,
            route,
            id: id.as_bytes(),
            topic: topic.as_bytes(),
            backoff_ms,
            body: &req.body,
            replaces: replaces.is_some(),
        })?;
        if replaces == Some(true) {
            self.cancel(&id)?;
        }
        self.append(&rec)?;
        inc(&self.metrics.produced);
        Ok(Produced { id, deliver_at_ms, created: true })
    }

    fn plan_produce(&self, when: &When, now: u64, delay_from: u64) -> Result<(u64, Route)> {
        let levels = &self.cfg.levels_ms;
        let max = self.cfg.max_delay_ms;
        let (base, delay) = match *when {
            When::Now => return Ok((now, Route::Topic)),
            When::LevelIndex(i) => {
                let Some(l) = (i as usize).checked_sub(1).and_then(|i| levels.get(i)) else {
                    return Err(Error::invalid("level", format!("must be 1 to {}", levels.len())));
                };
                return Ok((delay_from + l, Route::Level { level_ms: *l, due_ms: delay_from + l }));
            }
            When::DelayMs(d) => {
                if d > max {
                    return Err(Error::invalid("delay_ms", format!("{d} exceeds max_delay of {max} ms")));
                }
                (delay_from, d)
            }
            When::AtMs(t) => {
                if t <= now {
                    // Due already: the answer says when it really became ready.
                    return Ok((now, Route::Topic));
                }
                if t - now > max {
                    return Err(Error::invalid(
                        "deliver_at_ms",
                        format!("is more than max_delay ({max} ms) ahead"),
                    ));
                }
                (now, t - now)
            }
        };
        if delay == 0 {
            return Ok((now, Route::Topic));
        }
        match self.cfg.delay_policy {
            DelayPolicy::Chain => Ok((base + delay, plan_hop(levels, base, delay))),
            DelayPolicy::Round => {
                let l = nearest_level(levels, delay);
                Ok((base + l, Route::Level { level_ms: l, due_ms: base + l }))
            }
        }
    }

    pub(super) fn transition(&mut self, slot: &Slot, change: Change) -> Result<u32> {
        let seq = slot.seq + 1;
        let rec = format::encode_transition(&Transition {
            msg_offset: slot.msg_offset,
            id_hash: slot.hash,
            seq,
            prev_state: slot.state,
            state: change.state,
            cause: change.cause,
            home: change.home,
            attempt: change.attempt,
            time_ms: change.time_ms,
            deliver_at_ms: change.deliver_at_ms,
            route: change.route,
            due_ms: change.due_ms,
            prev_offset: Some(slot.last_offset),
        });
        self.append(&rec)?;
        Ok(seq)
    }

    /// Reserves up to `max` ready messages from `topics`, in order; never waits.
    pub fn pop(&mut self, topics: &[String], max: usize, ttr_ms: Option<u64>) -> Result<Vec<Delivery>> {
        self.writable()?;
        if let Some(t) = ttr_ms {
            if t == 0 || t > self.cfg.max_delay_ms {
                return Err(Error::invalid("ttr_ms", format!("must be 1 to {} ms", self.cfg.max_delay_ms)));
            }
        }
        let mut out = Vec::new();
        // A paused topic answers as if empty; its messages keep falling due meanwhile.
        for topic in topics {
            if self.store.paused.contains_key(topic) {
                continue;
            }
            let mut repairs = 0;
            while out.len() < max {
                match self.pop_one(topic, ttr_ms, &mut repairs) {
                    Ok(Some(Some(d))) => out.push(d),
                    Ok(Some(None)) => {}
                    Ok(None) => break,
                    Err(e) if out.is_empty() => return Err(e),
                    // The reservations made so far are appended: hand them out rather than leave
                    // them reserved, invisible, until their time-to-run ends.
                    Err(e) => {
                        tracing::warn!(error = %e, delivered = out.len(), "pop failed part-way; returning what it reserved");
                        return Ok(out);
                    }
                }
            }
        }
        self.sync_damage_metrics();
        Ok(out)
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
                tracing::error!(%topic, entry = at, %why, "consume-queue entry still damaged after repair; skipped");
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

    /// Publishes the store's count of damaged records as a metric.
    fn sync_damage_metrics(&self) {
        self.metrics
            .corrupt_records
            .store(self.store.corrupt_records(), std::sync::atomic::Ordering::Relaxed);
    }

    fn try_reserve(&mut self, topic: &str, entry: Entry, ttr_ms: Option<u64>) -> Result<Option<Delivery>> {
        let Some(Timer { msg_offset, hash, seq, .. }) = self.timer_of(entry.offset)? else { return Ok(None) };
        let Some((_, slot)) = self.store.find_offset(hash, msg_offset) else { return Ok(None) };
        if slot.seq != seq || !matches!(slot.state, State::Ready | State::Dead) {
            return Ok(None);
        }
        let (id, body, msg_ttr) = match self.store.read_checked(msg_offset) {
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
        let ttr = ttr_ms.unwrap_or(msg_ttr);
        let now = self.now();
        let attempt = u32::from(slot.attempt) + 1;
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
                due_ms: Some(entry.tag),
            },
        )?;
        inc(&self.metrics.popped);
        Ok(Some(Delivery {
            id,
            topic: topic.to_string(),
            body,
            receipt: self.receipts.encode(msg_offset, new_seq),
            attempt,
            deliver_at_ms: entry.tag,
            ttr_ms: ttr,
        }))
    }

    fn reserved_by_receipt(&self, receipt: &str) -> Result<Slot> {
        let (msg_offset, seq) = self.receipts.decode(receipt)?;
        let gone = || Error::NotFound("unknown or expired receipt".to_string());
        if msg_offset >= self.store.log.end() || msg_offset < self.store.log.start() {
            return Err(gone());
        }
        let hash = match self.store.put_at(msg_offset) {
            Ok(p) => format::id_hash(p.id),
            Err(_) => return Err(gone()),
        };
        match self.store.find_offset(hash, msg_offset) {
            Some((_, slot)) if slot.seq == seq && slot.state == State::Reserved => Ok(slot),
            _ => Err(gone()),
        }
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
        Ok(())
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
        self.writable()?;
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
            let p = self.store.put_at(slot.msg_offset)?;
            let backoff = if p.backoff_ms.is_empty() { &self.cfg.default_backoff_ms } else { &p.backoff_ms };
            let i = (slot.attempt as usize).saturating_sub(1).min(backoff.len().saturating_sub(1));
            (
                p.max_attempts,
                backoff.get(i).copied().unwrap_or(0),
                String::from_utf8_lossy(p.topic).into_owned(),
            )
        };
        inc(&self.metrics.nacked);
        if slot.home == Home::Main && u32::from(slot.attempt) >= max_attempts {
            self.dead_letter(&slot)?;
            self.note_left_behind(&slot);
            return Ok(Nacked::DeadLettered { topic: dead_letter_topic(&topic) });
        }
        let delay = delay_ms.unwrap_or(step);
        // As for a produce: the delay counts from the receive time rounded up, so the retry is
        // never before the consumer's nack plus the delay.
        let now_us = self.clock.now_us();
        let (now, from) = (now_us / 1000, now_us.div_ceil(1000));
        let deliver_at_ms = self.retry(&slot, Cause::Nack, now, from, delay)?;
        self.note_left_behind(&slot);
        Ok(Nacked::Retry { deliver_at_ms })
    }

    /// Makes a reserved message ready again, at once or `delay` ms after `from`; returns its due
    /// time.
    pub(super) fn retry(
        &mut self,
        slot: &Slot,
        cause: Cause,
        now: u64,
        from: u64,
        delay: u64,
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
        self.transition(slot, change).map(|_| due)
    }

    pub(super) fn dead_letter(&mut self, slot: &Slot) -> Result<()> {
        let now = self.now();
        self.transition(
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
        )?;
        inc(&self.metrics.dead_lettered);
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
    fn note_left_behind(&mut self, old: &Slot) {
        match old.state {
            State::Delayed | State::Reserved => {
                let route = match self.store.log.read(old.last_offset) {
                    Ok((Record::Put(p), _)) => p.route,
                    Ok((Record::Carry(c), _)) => c.put.route,
                    Ok((Record::Transition(t), _)) => t.route,
                    _ => return,
                };
                if let Route::Level { level_ms, due_ms } = route {
                    if due_ms > self.now() {
                        self.left_behind.level(level_ms, old.last_offset);
                    }
                }
            }
            // Topic counts move with each record (the store counts states), nothing to note.
            State::Ready | State::Dead | State::Done | State::Cancelled => {}
        }
    }
}

#[cfg(test)]
impl Engine {
    /// The store, for white-box tests.
    pub fn store_for_tests(&self) -> &Store {
        &self.store
    }
}

#[doc(hidden)]
impl Engine {
    /// Slots of the id index table inserts go to (benchmarks).
    pub fn index_slots_for_bench(&self) -> u64 {
        self.store.index.capacity()
    }

    /// Whether the id index is being resized (benchmarks).
    pub fn index_resizing_for_bench(&self) -> bool {
        self.store.index.is_migrating()
    }

    /// Commit-log end offset (benchmarks).
    pub fn log_end_for_bench(&self) -> u64 {
        self.store.log.end()
    }

    /// Entries written to all queues so far (benchmarks).
    pub fn queue_entries_for_bench(&self) -> u64 {
        self.store.levels.values().map(|q| q.cq.len()).sum::<u64>()
            + self.store.topics.values().map(|q| q.cq.len()).sum::<u64>()
    }

    /// Hops performed so far (benchmarks).
    pub fn hops_for_bench(&self) -> usize {
        self.metrics.hops.load(std::sync::atomic::Ordering::Relaxed) as usize
    }
}
