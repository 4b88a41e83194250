//! Maintenance: index resize steps, reclaim, and the checkpoints that reclaim waits for.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::schedule::levels::plan_hop;
use crate::storage::reclaim::ReclaimPolicy;

use super::Engine;

/// Index slots copied per chunk of a maintenance call during a resize, between two looks at the
/// deadline: a `pwrite` each, 2–3 µs on a VM while the tables fit the page cache. With 110
/// million messages they no longer do beside the log, and a copy can wait for its pages to be
/// read back and others reclaimed: a chunk of 128 then took 10 ms, which put its step at 11.5 ms
/// of CPU, and chunks of 32 still took 7.9 ms where about 2.5 ms were left for them.
const INDEX_STEP_CHUNK: usize = 8;
/// Time a maintenance call takes when its caller sets no deadline.
const MAINTAIN_BUDGET: std::time::Duration = std::time::Duration::from_millis(2);

impl Engine {
    /// [`maintain_until`](Self::maintain_until) with a budget of a few milliseconds.
    pub fn maintain(&mut self) -> Result<()> {
        self.maintain_until(std::time::Instant::now() + MAINTAIN_BUDGET)
    }

    /// One bounded round of maintenance, ending about `until`: a piece of an index resize, then
    /// reclaim (expire final messages past `done_retention`, move the oldest segment towards
    /// deletion; deletions wait for a durable checkpoint). Each part makes some progress even when
    /// `until` has passed, so maintenance keeps up under any load.
    pub fn maintain_until(&mut self, until: std::time::Instant) -> Result<()> {
        if self.durability.is_poisoned() {
            return Ok(());
        }
        // Without traffic, operations would never finish an index resize and the old table would
        // stay mapped; maintenance, which every engine step runs however busy, finishes it in
        // bounded steps. Reclaim gets the second half.
        let started = std::time::Instant::now();
        let index_until =
            if self.cfg.reclaim { started + until.saturating_duration_since(started) / 2 } else { until };
        loop {
            if !self.store.step_index(INDEX_STEP_CHUNK) || std::time::Instant::now() >= index_until {
                break;
            }
        }
        if !self.cfg.reclaim {
            return Ok(());
        }
        // A follower's readers never move (it fires and pops nothing): the leader's positions
        // move them, so its queue files are deleted as the leader's are.
        let moved = self.store.follow_passed();
        if !moved.is_empty() {
            for ms in moved {
                self.schedulers.remove(&ms);
            }
            self.sync_schedulers();
        }
        let now = self.now();
        let r = self.store.expire(self.expired_at(), until);
        self.poison_on_io(r)?;
        let policy = self.reclaim_policy();
        let levels = &self.cfg.levels_ms;
        let plan = |now: u64, target: u64| plan_hop(levels, now, target.saturating_sub(now));
        let r = self.store.reclaim_step(now, &policy, &plan, until);
        self.poison_on_io(r)
    }

    /// True when [`maintain`](Self::maintain) has work it could do at once.
    pub fn maintenance_due(&self) -> bool {
        !self.durability.is_poisoned()
            && (self.store.index_copying()
                || self.cfg.reclaim && self.store.reclaim_busy(self.now(), &self.reclaim_policy()))
    }

    fn reclaim_policy(&self) -> ReclaimPolicy {
        ReclaimPolicy { segment_bytes: self.cfg.segment_bytes, expired_at_ms: self.expired_at() }
    }

    /// A checkpoint became durable: reclaim may now delete what it no longer needs.
    pub fn checkpoint_durable(&mut self, cp: &crate::storage::checkpoint::Checkpoint) {
        if !self.cfg.reclaim {
            return;
        }
        let r = self.store.checkpoint_durable(cp);
        if let Err(e) = self.poison_on_io(r) {
            tracing::error!(error = %e, "reclaiming consume-queue files failed; refusing further writes");
        }
    }

    pub(super) fn level_cursors(&self) -> BTreeMap<u64, u64> {
        self.schedulers.iter().map(|(ms, s)| (*ms, s.cursor().get())).collect()
    }

    /// Persists queue lengths and cursors (after flushing everything they cover).
    pub fn checkpoint(&mut self) -> Result<()> {
        let cursors = self.level_cursors();
        self.store.checkpoint(&cursors)?;
        self.checkpoint_done();
        Ok(())
    }

    /// Notes for `/metrics` that a checkpoint is durable now.
    fn checkpoint_done(&self) {
        self.metrics.last_checkpoint_ms.store(self.now(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Captures a checkpoint for a background thread to make durable and write. Nothing counts
    /// as synced until [`checkpoint_synced`](Self::checkpoint_synced) says the job ran, so a job
    /// that fails or never runs leaves its files to the next one.
    pub fn checkpoint_job(&mut self) -> Result<crate::storage::checkpoint::CheckpointJob> {
        self.writable()?;
        let cursors = self.level_cursors();
        self.store.checkpoint_job(&cursors)
    }

    /// Makes the reserve file again if a full disk took it and there is room now.
    pub fn restore_reserve(&self) {
        self.store.restore_reserve();
    }

    /// A checkpoint job ran: the files it synced are durable up to what it captured.
    pub fn checkpoint_synced(&mut self, synced: &crate::storage::checkpoint::Captured) {
        self.store.checkpoint_synced(synced);
        self.checkpoint_done();
    }
}

impl Engine {
    /// The cut a backup copies (see `storage::backup`): the log's end now and a handle on every
    /// segment, so the copy holds every change applied before this call and none after. Refused
    /// on a cluster node, whose log is the replicated one (see docs/backup.md), and on a store
    /// whose sync failed: its log may hold records never acknowledged, and nothing is
    /// acknowledged after a failed sync, a backup included.
    pub fn backup_cut(&self, started: std::time::Instant) -> Result<crate::storage::backup::Cut> {
        self.writable()?;
        if self.store.replicated() {
            return Err(crate::error::Error::Conflict(
                "backup is for a single node, and this is a cluster node: every node holds the whole \
                 replicated log, so a lost node is replaced by adding a new one (docs/cluster.md)"
                    .into(),
            ));
        }
        Ok(crate::storage::backup::Cut {
            log_start: self.store.log_start().get(),
            log_end: self.store.log_end().get(),
            segments: self.store.backup_segments()?,
            receipt_key: self.cfg.receipt_secret.is_none().then(|| self.cfg.data_dir.join("receipt_key")),
            data_dir: self.cfg.data_dir.clone(),
            started,
        })
    }
}
