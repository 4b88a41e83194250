//! The store's side of a checkpoint: the snapshot it records, writing it (at once or through a
//! background job), and closing with the clean-shutdown marker.

use std::collections::BTreeMap;

use super::Store;
use crate::error::Result;
use crate::storage::checkpoint::{
    self, Captured, Checkpoint, CheckpointJob, CleanMarker, ClosedCounts, QueueKind, QueueState,
};
use crate::storage::types::QueueIndex;

impl Store {
    /// The state a checkpoint records; `level_cursors` are the schedulers' handled prefixes (they
    /// own that state between checkpoints).
    fn snapshot(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Checkpoint {
        let mut queues = Vec::with_capacity(self.levels.len() + self.topics.len());
        for (ms, q) in self.levels.iter_mut() {
            if let Some(c) = level_cursors.get(ms) {
                q.cursor = QueueIndex::new(*c);
            }
            queues.push(QueueState {
                kind: QueueKind::Level,
                name: ms.to_string(),
                len: q.cq.len(),
                cursor: q.cursor.get(),
                reserved: 0,
                dead: 0,
                delayed: 0,
                ready: 0,
            });
        }
        let mut names: Vec<&String> = self.topics.keys().collect();
        names.sort();
        for name in names {
            let q = &self.topics[name];
            queues.push(QueueState {
                kind: QueueKind::Topic,
                name: name.clone(),
                len: q.cq.len(),
                cursor: q.cursor.get(),
                reserved: q.reserved,
                dead: q.dead,
                delayed: q.delayed,
                ready: q.ready,
            });
        }
        self.snapshots += 1;
        self.captured_at = (self.replicated() && self.sealed.end == self.dispatched && self.sealed.index > 0)
            .then_some((self.snapshots, self.sealed));
        let paused = self.paused.iter().map(|(t, o)| (t.clone(), *o)).collect();
        let push = self.push.iter().map(|(t, o)| (t.clone(), *o)).collect();
        let flow = self.flow.iter().map(|(t, o)| (t.clone(), *o)).collect();
        Checkpoint { dispatched: self.dispatched, queues, paused, push, flow, serial: self.snapshots }
    }

    /// Flushes everything and records the dispatch position, queue lengths and cursors.
    pub fn checkpoint(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<()> {
        let cp = self.write_checkpoint(level_cursors)?;
        if self.cfg.reclaim {
            self.checkpoint_durable(&cp)?;
        }
        Ok(())
    }

    /// Makes every file durable, then replaces the checkpoint; returns what it wrote.
    pub(super) fn write_checkpoint(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<Checkpoint> {
        self.log.flush()?;
        let cp = self.snapshot(level_cursors);
        for q in self.levels.values_mut() {
            q.cq.flush()?;
        }
        for q in self.topics.values_mut() {
            q.cq.flush()?;
        }
        self.index.flush()?;
        self.cp_log_end = self.dispatched;
        let path = self.dir.join("checkpoint");
        self.reserve.retry_on_full_disk(|| cp.store(&path, &self.durability))?;
        Ok(cp)
    }

    /// Like [`checkpoint`](Self::checkpoint), but hands the fdatasyncs and the write to the caller
    /// (a background thread), so the engine never stalls on them.
    pub fn checkpoint_job(&mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<CheckpointJob> {
        // Everything fallible first: a failure here changes nothing.
        let mut files = self.log.handles(self.cp_log_end, self.dispatched)?;
        self.index.take_handles(&mut files)?;
        let checkpoint = self.snapshot(level_cursors);
        let mut queue_files = Vec::new();
        let mut captured = Captured { log_end: self.dispatched, queues: Vec::new() };
        for (ms, q) in &self.levels {
            q.cq.dirty_paths(&mut queue_files);
            captured.queues.push((QueueKind::Level, ms.to_string(), 0, q.cq.len()));
        }
        for (name, q) in &self.topics {
            q.cq.dirty_paths(&mut queue_files);
            captured.queues.push((QueueKind::Topic, name.clone(), q.created_at, q.cq.len()));
        }
        Ok(CheckpointJob {
            durability: self.durability.clone(),
            checkpoint,
            files,
            queue_files,
            path: self.dir.join("checkpoint"),
            captured,
            reserve: self.reserve.clone(),
        })
    }

    /// A checkpoint job ran: the log and queue files it synced count as durable up to what it
    /// captured (a queue forgotten and made again since is a namesake, and is left alone).
    pub fn checkpoint_synced(&mut self, c: &Captured) {
        self.cp_log_end = self.cp_log_end.max(c.log_end);
        for (kind, name, created_at, len) in &c.queues {
            match kind {
                QueueKind::Level => {
                    if let Some(q) = name.parse().ok().and_then(|ms: u64| self.levels.get_mut(&ms)) {
                        q.cq.mark_flushed(*len);
                    }
                }
                QueueKind::Topic => {
                    if let Some(q) = self.topics.get_mut(name).filter(|q| q.created_at == *created_at) {
                        q.cq.mark_flushed(*len);
                    }
                }
            }
        }
    }

    /// Final checkpoint plus the clean-shutdown marker.
    pub fn close(mut self, level_cursors: &BTreeMap<u64, u64>) -> Result<()> {
        // A checkpoint may let emptied topics go (a slice at a time); checkpointing until none goes
        // leaves a directory whose checkpoint lists exactly the queues on disk.
        loop {
            let forgotten = self.reclaim.stats.topics_forgotten;
            self.checkpoint(level_cursors)?;
            if self.reclaim.stats.topics_forgotten == forgotten {
                break;
            }
        }
        let (index_slots, index_filled, index_live) = self.index.counts().unwrap_or_default();
        let marker = CleanMarker {
            log_end: self.log.end(),
            counts: Some(ClosedCounts {
                index_slots,
                index_filled,
                index_live,
                live_bytes: self.live_bytes,
                segments: self.segs.to_list(),
            }),
        };
        self.reserve.retry_on_full_disk(|| {
            checkpoint::write_clean_marker(&self.dir.join("clean_shutdown"), &marker, &self.durability)
        })
    }
}
