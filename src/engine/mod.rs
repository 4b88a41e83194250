//! The engine: the single-threaded state machine that owns the store and the level schedulers.
//!
//! Every operation is one append to the commit log (dispatched at once into queues and index), so
//! the engine's state can always be rebuilt from the log. It never waits: the broker thread around
//! it decides when to flush and when to sleep.
//!
//! Each room is an `impl Engine` of its own, beside this file (the struct, `open` and the helpers
//! every room shares: the clock, the write check, `append` and how an I/O error poisons):
//! - `produce.rs`: produce and replace (checks, route planning, the Put).
//! - `delivery.rs`: pop, ack, nack, cancel and dead-lettering (one Transition each).
//! - `receipts.rs`: the signed receipt that names one delivery.
//! - `timers.rs`: the level schedulers and what a due timer does (hop, ready, expire).
//! - `walks.rs`: browse, purge and redrive, in bounded slices over a topic's queues.
//! - `topics.rs`: pause, push subscriptions, `max_topics` and the topic listing.
//! - `reschedule.rs`: a pending message moved to a new due time (one Transition).
//! - `reads.rs`: look-ups by id, history and stats.
//! - `maintenance.rs`: index resize steps, reclaim and checkpoints.

mod delivery;
mod flow;
mod maintenance;
mod produce;
mod reads;
mod receipts;
mod reschedule;
mod timers;
mod transition;
mod topics;
mod walks;

pub use reads::HISTORY_MAX;
pub(crate) use receipts::Receipts;
pub use walks::WalkPos;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::config::BrokerConfig;
use crate::error::{Error, Result};
use crate::limits::{MAX_ID_BYTES, MAX_TOPIC_LEN};
use crate::live::LeftBehind;
use crate::metrics::Metrics;
use crate::schedule::clock::Clock;
use crate::schedule::levels::validate_levels;
use crate::schedule::scheduler::LevelScheduler;
use crate::storage::durability::{Durability, Failure};
use crate::storage::format::{self, Record};
use crate::storage::io;
use crate::storage::store::{OpenReport, Store, StoreConfig};
use crate::storage::types::LogOffset;
use crate::storage::writer::{Driver, Release, Writer};

/// Checks a topic name: `[A-Za-z0-9._-]{1,128}`.
pub fn validate_topic(topic: &str) -> Result<()> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_LEN} characters")));
    }
    // '%' appears only in the storage names of topics outside this set (see `http::topic_name`), which escape
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
    /// In a cluster, the clock timers fire by: a majority's, never ahead of `clock` (see
    /// `cluster::ClusterClock`). Due times are stamped by `clock`, so a correction that varies
    /// never moves a firing earlier than the delay asked for.
    fire_clock: Option<Arc<dyn Clock>>,
    /// Per-topic counts for `/metrics`; pruned to the topics that have a queue at each stats
    /// read, so topics that go away take their series with them.
    topic_counts: HashMap<String, crate::message::TopicCounts>,
    /// Each topic's oldest ready time as last found, with the reader position it was found at:
    /// a stats read reuses it for a queue whose files are closed and whose reader has not moved,
    /// rather than open every topic's files on every scrape. Pruned with `topic_counts`.
    oldest_ready: HashMap<String, (u64, Option<u64>)>,
    /// Flow control's token buckets (in memory).
    flow: flow::FlowState,
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
                check_on_start: cfg.check_on_start,
            },
        )?;
        let id_seed = format::id_hash(&clock.now_us().to_le_bytes()) ^ u64::from(std::process::id());
        let durability = store.durability().clone();
        let key = match &cfg.receipt_secret {
            Some(secret) => crate::storage::secret::derive_key(secret),
            None => {
                crate::storage::secret::load_or_create(&cfg.data_dir.join("receipt_key"), holds_log, &durability)?
            }
        };
        let receipts = Receipts::new(&key);
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
            fire_clock: None,
            topic_counts: HashMap::new(),
            oldest_ready: HashMap::new(),
            flow: flow::FlowState::default(),
        };
        // The checkpoint an earlier run left is the last durable one until this run writes one.
        let left = std::fs::metadata(engine.cfg.data_dir.join("checkpoint")).and_then(|m| m.modified());
        if let Ok(ms) = left.map(|t| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)) {
            engine.metrics.last_checkpoint_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
        }
        // Levels removed from the config keep their queue until drained: their entries carry
        // absolute due times, so they fire correctly whatever the current level list is.
        for (ms, q) in engine.store.levels() {
            if !engine.cfg.levels_ms.contains(&ms) && q.cq.len() > q.cursor.get() {
                tracing::warn!(
                    level_ms = ms,
                    pending = q.cq.len() - q.cursor.get(),
                    "draining a level no longer configured"
                );
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

    /// Now by the clock timers fire by (the engine's own clock on a single node).
    fn fire_now(&self) -> u64 {
        self.fire_clock.as_ref().map_or_else(|| self.now(), |c| c.now_ms().min(self.now()))
    }

    /// Now in µs by the clock timers fire by, when it is not the engine's own.
    pub fn fire_now_us(&self) -> Option<u64> {
        self.fire_clock.as_ref().map(|c| c.now_us().min(self.clock.now_us()))
    }

    /// Makes timers fire by `clock` (a cluster's majority clock).
    pub fn set_fire_clock(&mut self, clock: Arc<dyn Clock>) {
        self.fire_clock = Some(clock);
    }

    /// Final messages that became final at or before this time are past `done_retention`.
    fn expired_at(&self) -> u64 {
        self.expired_at_from(self.now())
    }

    /// [`expired_at`](Self::expired_at) by a clock reading the caller took already.
    fn expired_at_from(&self, now: u64) -> u64 {
        now.saturating_sub(self.cfg.done_retention_ms)
    }

    fn writable(&self) -> Result<()> {
        self.durability.check()
    }

    /// The store's durability owner (health, durable log offset).
    pub fn durability(&self) -> &Durability {
        &self.durability
    }

    /// Appends `rec`; the store dispatches it from the struct (see `Store::append`).
    fn append(&mut self, rec: &Record<'_>) -> Result<LogOffset> {
        self.append_framed(&rec.encode()?, rec)
    }

    /// [`append`](Self::append) of a record encoded already (`bytes` is `rec`'s encoding).
    fn append_framed(&mut self, bytes: &[u8], rec: &Record<'_>) -> Result<LogOffset> {
        self.writable()?;
        let r = self.store.append_framed(bytes, rec);
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

    /// Makes every append durable on this thread, outside any writer (tools, benches and tests);
    /// a failed sync has poisoned the store (see `durability.rs`).
    pub fn flush(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        if self.store.sync_log()? {
            self.metrics.flush_us.observe(started.elapsed().as_micros() as u64);
        }
        Ok(())
    }

    /// The one commit call of the write path: the records this step appended become durable
    /// through `writer`, which releases `replies` when they are (see `storage::writer`).
    pub fn commit<R: Release>(
        &mut self,
        writer: &mut Writer<R>,
        replies: &mut Vec<R>,
        driver: impl FnOnce(&Writer<R>, usize, u64) -> Driver,
    ) {
        self.store.commit(writer, replies, driver);
    }

    /// True when this node may append records of its own (timers, expiries, reclaim): always on
    /// a single node, only while it leads in a cluster.
    pub fn may_act(&self) -> bool {
        self.store.may_act()
    }

    /// Makes this engine's store a cluster node's (see `storage::replica`).
    pub fn set_replicator(
        &mut self,
        replica: Box<dyn crate::storage::replica::Replicator>,
        sealed: crate::storage::replica::Sealed,
    ) {
        self.store.set_replicator(replica, sealed);
    }

    /// True when appends are waiting for a flush.
    pub fn dirty(&self) -> bool {
        self.store.unflushed()
    }

    /// Time spent on the id index's resize since the last call (an engine step's share of it).
    pub fn take_index_resize_time(&mut self) -> std::time::Duration {
        self.store.take_index_resize_time()
    }

    /// Offset one past the last appended record.
    pub fn log_end(&self) -> u64 {
        self.store.log_end().get()
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

    /// Topics that received entries since the last call, with how many waiting pops each can
    /// serve (for long-poll wake-ups).
    pub fn take_touched(&mut self) -> Vec<(String, crate::storage::store::Wake)> {
        self.store.take_touched()
    }

    /// Publishes the store's count of damaged records as a metric.
    fn sync_damage_metrics(&self) {
        self.metrics
            .corrupt_records
            .store(self.store.corrupt_records(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// White-box and benchmark accessors: in the crate's own tests, and public for the benches and
/// integration tests with the `internals` feature; never in a default build.
#[cfg(any(test, feature = "internals"))]
impl Engine {
    /// The store, for white-box tests.
    pub fn store_for_tests(&self) -> &Store {
        &self.store
    }

    /// Slots of the id index table inserts go to (benchmarks).
    pub fn index_slots_for_bench(&self) -> u64 {
        self.store.index_slots()
    }

    /// Whether the id index is being resized (benchmarks).
    pub fn index_resizing_for_bench(&self) -> bool {
        self.store.index_migrating()
    }

    /// Commit-log end offset (benchmarks).
    pub fn log_end_for_bench(&self) -> u64 {
        self.store.log_end().get()
    }

    /// Entries written to all queues so far (benchmarks).
    pub fn queue_entries_for_bench(&self) -> u64 {
        self.store.queue_entries()
    }

    /// Hops performed so far (benchmarks).
    pub fn hops_for_bench(&self) -> usize {
        self.metrics.hops.load(std::sync::atomic::Ordering::Relaxed) as usize
    }
}
