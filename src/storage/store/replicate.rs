//! The store's half of replication (see `storage::replica`): every commit first appends the
//! consensus log's entries this log lacks, then proposes this step's own records as one entry and
//! appends its mark.

use std::collections::HashMap;

use super::Store;
use crate::error::{Error, Result};
use crate::storage::checkpoint::{Checkpoint, QueueKind, QueueState};
use crate::storage::consumequeue::ConsumeQueue;
use crate::storage::format::{self, EntryKind, RaftMark, Record};
use crate::storage::replica::{Diverged, Passed, ReplicaEntry, Replicator, Sealed};
use crate::storage::types::{LogOffset, QueueIndex};

impl Store {
    /// Makes this store a cluster node's: `sealed` is its log's last entry (found before it
    /// opened).
    pub fn set_replicator(&mut self, replica: Box<dyn Replicator>, sealed: Sealed) {
        self.replica = Some(replica);
        self.sealed = sealed;
    }

    /// True when this node may append records of its own: always on a single node; in a
    /// cluster, only while it leads.
    pub fn may_act(&self) -> bool {
        self.replica.as_ref().is_none_or(|r| r.leading())
    }

    /// Log offset up to which this log's entries are committed (durable on a majority, never
    /// undone); the whole log on a single node.
    pub fn committed_end(&self) -> u64 {
        self.replica.as_ref().map_or(u64::MAX, |r| r.committed_end())
    }

    /// True in a cluster.
    pub fn replicated(&self) -> bool {
        self.replica.is_some()
    }

    /// On a leader, once checkpoint `cp` is durable: tells the followers how far its readers had
    /// passed each queue then (see [`Passed`]). Nothing when the checkpoint was not captured at a
    /// whole entry.
    pub(crate) fn publish_passed(&mut self, cp: &Checkpoint) {
        let Some((serial, sealed)) = self.captured_at else { return };
        if serial != cp.serial || !self.may_act() {
            return;
        }
        let mut p = Passed { index: sealed.index, term: sealed.term, dispatched: cp.dispatched, ..Passed::default() };
        let at = |cq: &ConsumeQueue, q: &QueueState| {
            if q.cursor >= q.len {
                Some(cp.dispatched)
            } else {
                cq.get(QueueIndex::new(q.cursor)).map(|e| e.offset.get())
            }
        };
        for q in &cp.queues {
            match q.kind {
                QueueKind::Level => {
                    let ms = q.name.parse::<u64>().ok();
                    if let Some((ms, l)) = ms.and_then(|ms| self.levels.get(&ms).map(|l| (ms, l))) {
                        p.levels.extend(at(&l.cq, q).map(|o| (ms, o)));
                    }
                }
                // A closed queue's entries are not mapped: unless it was read to its end, it is
                // sent as passing nothing (offset 0), for a later checkpoint. A topic made again
                // since the capture is not the queue it describes; left out, it counts as read
                // below `dispatched`, true of the one forgotten (its new entries are past that).
                QueueKind::Topic => {
                    if let Some(t) = self.topics.get(&q.name).filter(|t| t.created_at < cp.dispatched) {
                        if q.cursor >= q.len || t.cq.is_open() {
                            p.topics.extend(at(&t.cq, q).map(|o| (q.name.clone(), o)));
                        } else {
                            p.topics.push((q.name.clone(), 0));
                        }
                    }
                }
            }
        }
        if let Some(rep) = self.replica.as_mut() {
            rep.passed(p);
        }
    }

    /// On a follower: moves its queues' cursors to the leader's newest positions, once it holds
    /// what they are as of; returns the levels whose cursor moved (their schedulers start again
    /// there).
    pub fn follow_passed(&mut self) -> Vec<u64> {
        if self.may_act() {
            return Vec::new();
        }
        let sealed = self.sealed;
        let Some(p) = self.replica.as_mut().and_then(|r| r.take_passed(sealed)) else {
            return Vec::new();
        };
        let mut moved = Vec::new();
        for (ms, offset) in &p.levels {
            if let Some(q) = self.levels.get_mut(ms) {
                let to = q.cq.first_at_or_past(q.cursor, LogOffset::new(*offset));
                if to > q.cursor {
                    q.cursor = to;
                    moved.push(*ms);
                }
            }
        }
        let listed: HashMap<&str, u64> = p.topics.iter().map(|(n, o)| (n.as_str(), *o)).collect();
        let names: Vec<String> = self.topics.keys().cloned().collect();
        for name in names {
            let offset = listed.get(name.as_str()).copied().unwrap_or(p.dispatched);
            match self.topics.get(&name) {
                Some(q) if q.cursor < q.cq.end() && offset > 0 => {}
                _ => continue,
            }
            // A queue that cannot be opened now (no file handle left) is moved at a later
            // checkpoint's positions.
            match self.topic_open(&name) {
                Ok(q) => q.cursor = q.cq.first_at_or_past(q.cursor, LogOffset::new(offset)),
                Err(e) => tracing::debug!(topic = %name, error = %e, "topic queue not moved to the leader's position"),
            }
        }
        moved
    }

    /// Keeps the log framed as the replicated log before a commit (see the module
    /// documentation). An error answers the step's requests with it.
    pub(super) fn seal(&mut self) -> Result<()> {
        let Some(mut rep) = self.replica.take() else { return Ok(()) };
        let r = self.seal_with(rep.as_mut());
        self.replica = Some(rep);
        r
    }

    fn seal_with(&mut self, rep: &mut dyn Replicator) -> Result<()> {
        let unsealed = self.log.end() > self.sealed.end;
        let missing = match rep.missing(self.sealed) {
            Ok(m) => m,
            Err(d) => return Err(diverged(rep, d)),
        };
        if unsealed && !missing.is_empty() {
            let why = "records were applied here while the leader's entries arrived";
            return Err(diverged(rep, Diverged { keep: self.sealed.index, why }));
        }
        for e in &missing {
            self.append_entry(rep, e)?;
        }
        if unsealed {
            let data_start = self.sealed.end;
            let records = self.records_between(data_start, self.log.end())?;
            let Some((term, index)) = rep.propose(records, data_start) else {
                let why = "leadership was lost before this step's records were proposed";
                return Err(diverged(rep, Diverged { keep: self.sealed.index, why }));
            };
            self.append_mark(rep, RaftMark { term, index, kind: EntryKind::Normal, data_start, payload: &[] })?;
        }
        for e in rep.membership() {
            let data_start = self.log.end();
            self.append_mark(rep, RaftMark { term: e.term, index: e.index, kind: e.kind, data_start, payload: &e.payload })?;
        }
        Ok(())
    }

    /// Appends a replicated entry: each record, dispatched as if this node had written it, then
    /// its mark.
    fn append_entry(&mut self, rep: &mut dyn Replicator, e: &ReplicaEntry) -> Result<()> {
        let data_start = self.log.end();
        if let Some(origin) = e.origin_start.filter(|o| *o != data_start) {
            let why = format!(
                "entry {} starts at log offset {origin} on the leader but would start at {data_start} here: \
                 every node must have the same segment_bytes (records refer to each other by offset)",
                e.index
            );
            rep.refuse(&why);
            return Err(Error::Config(why));
        }
        let mut at = 0;
        while at < e.records.len() {
            let bytes = &e.records[at..];
            let (rec, len) = format::decode(bytes).map_err(|err| Error::Corrupt {
                file: "replicated entry".into(),
                offset: e.index,
                reason: format!("record {at} of the entry does not decode: {err:?}"),
            })?;
            self.append_framed(&bytes[..len], &rec)?;
            at += len;
        }
        let mark = RaftMark { term: e.term, index: e.index, kind: e.kind, data_start, payload: &e.payload };
        self.append_mark(rep, mark)
    }

    fn append_mark(&mut self, rep: &mut dyn Replicator, mark: RaftMark<'_>) -> Result<()> {
        let (term, index) = (mark.term, mark.index);
        self.append(&Record::Raft(mark))?;
        self.sealed = Sealed { index, term, end: self.log.end() };
        rep.sealed(self.sealed);
        Ok(())
    }

    /// The records appended in `[from, to)`, framed, back to back (end-of-segment markers left
    /// out: a node places records in segments itself).
    fn records_between(&self, from: u64, to: u64) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut at = from;
        while at < to {
            let Some((offset, _, next)) = self.log.next_fields(at)? else { break };
            if let Some(raw) = self.log.raw(offset, (next - offset) as usize) {
                out.extend_from_slice(raw);
            }
            at = next;
        }
        Ok(out)
    }
}

/// Reports a divergence to the cluster (which cuts the log back and rejoins) and the error the
/// step's requests get.
fn diverged(rep: &mut dyn Replicator, d: Diverged) -> Error {
    rep.diverged(d);
    Error::Unavailable(format!("this node's log diverged from the leader's ({}); it is rejoining: retry", d.why))
}
