//! The store's side of a cluster node: the [`Replicator`] a cluster gives the store (entries
//! to append, proposals, the leader's queue positions), and the writer's majority condition.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::prelude::EntryType;
use raft::{GetEntriesContext, StateRole};
use tracing::{info, warn};

use super::log_store::replica_entry;
use super::shared::{hand_over_lead, lock, Shared, Waiting, MAJORITY_WAIT};
use super::Role;
use crate::error::{Error, Result};
use crate::storage::replica::{Diverged, Passed, ReplicaEntry, Replicator, Sealed};
use crate::storage::writer::{Condition, Deferred};

/// The store's side: see [`Replicator`].
pub struct StoreSide {
    pub(super) shared: Arc<Shared>,
    pub(super) dir: PathBuf,
    pub(super) restart: Arc<dyn Fn() + Send + Sync>,
}

impl Replicator for StoreSide {
    fn missing(&mut self, sealed: Sealed) -> std::result::Result<Vec<ReplicaEntry>, Diverged> {
        let raw = lock(&self.shared.raw);
        let log = &raw.raft.raft_log;
        let (last, committed) = (log.last_index(), log.committed);
        // Cut back to the newest entry both logs hold (same index and term: all before it then
        // agree too). Not to the commit index: Raft's may already count the leader's entries at
        // indexes where this log still holds a deposed leader's own, and not one entry a
        // restart either.
        let agreed = |below: u64| self.shared.newest_agreed(below, log).map(|(i, _, _)| i);
        if sealed.index > last {
            return Err(Diverged {
                keep: agreed(last).unwrap_or(committed.min(last)),
                why: "the leader's log is shorter than this node's",
            });
        }
        if sealed.index > 0 {
            if let Ok(t) = log.term(sealed.index) {
                if t != sealed.term {
                    return Err(Diverged {
                        keep: agreed(sealed.index - 1).unwrap_or(committed.min(sealed.index - 1)),
                        why: "this node's last entry is not the leader's",
                    });
                }
            }
        }
        if sealed.index == last {
            return Ok(Vec::new());
        }
        let entries = log
            .entries(sealed.index + 1, None, GetEntriesContext::empty(false))
            .map_err(|_| Diverged { keep: committed.min(sealed.index), why: "entries no longer held" })?;
        Ok(entries.into_iter().map(replica_entry).collect())
    }

    fn propose(&mut self, records: Vec<u8>, data_start: u64) -> Option<(u64, u64)> {
        let mut raw = lock(&self.shared.raw);
        if raw.raft.state != StateRole::Leader || !self.shared.state.leading() {
            return None;
        }
        // The context carries where the records start in the leader's log: a follower checks it
        // places them at the same offsets (records refer to each other by offset).
        raw.propose(data_start.to_le_bytes().to_vec(), records).ok()?;
        let at = (raw.raft.term, raw.raft.raft_log.last_index());
        *lock(&self.shared.proposed) = at;
        drop(raw);
        self.shared.wake();
        Some(at)
    }

    fn sealed(&mut self, sealed: Sealed) {
        lock(&self.shared.marks).push_back((sealed.index, sealed.term, sealed.end));
        self.shared.state.set_sealed(sealed.index);
        let state = &self.shared.state;
        if state.role() == Role::Leader && sealed.term == state.term() && !state.leading() && state.may_lead()
        {
            info!(
                term = sealed.term,
                index = sealed.index,
                "leader caught up with its log; accepting writes"
            );
            state.set_leading(true);
        }
    }

    fn leading(&self) -> bool {
        self.shared.state.leading()
    }

    fn passed(&mut self, p: Passed) {
        *lock(&self.shared.passed_out) = Some(p);
        self.shared.wake();
    }

    fn take_passed(&mut self, sealed: Sealed) -> Option<Passed> {
        // Taken out before Raft's lock: the driver holds that one while it fills this slot.
        let p = lock(&self.shared.passed_in).take()?;
        let (committed, term) = {
            let raw = lock(&self.shared.raw);
            let log = &raw.raft.raft_log;
            (log.committed, log.term(p.index).ok())
        };
        if p.index > sealed.index || p.index > committed {
            // Not yet here: kept, unless newer positions arrived meanwhile.
            lock(&self.shared.passed_in).get_or_insert(p);
            return None;
        }
        // The same entry here (index and term) means the same log up to it: the positions are
        // of records this node holds, committed. Otherwise (another leader's entry replaced it,
        // or it left the window) they are dropped.
        (term == Some(p.term)).then_some(p)
    }

    fn committed_end(&self) -> u64 {
        lock(&self.shared.progress).committed_end
    }

    fn membership(&mut self) -> Vec<ReplicaEntry> {
        let requests: Vec<super::members::Request> = std::mem::take(&mut *lock(&self.shared.state.requests));
        if requests.is_empty() {
            return Vec::new();
        }
        let mut raw = lock(&self.shared.raw);
        let mut out = Vec::new();
        for mut req in requests {
            let mut reply = req.reply.take();
            let mut refuse = |why: String| {
                if let Some(r) = reply.take() {
                    let _ = r.send(Err(why));
                }
            };
            if raw.raft.state != StateRole::Leader || !self.shared.state.leading() {
                refuse("this node is not the leader".into());
                continue;
            }
            if req.change == (super::members::Change::Remove { id: raw.raft.id }) {
                // The leader leaves last: it hands the lead over and the next leader removes it.
                hand_over_lead(&mut raw);
                refuse(
                    "this node leads: the lead is being handed over first; retry on the new leader".into(),
                );
                continue;
            }
            if raw.propose_conf_change(Vec::new(), req.change.encode()).is_err() {
                refuse("raft refused the change".into());
                continue;
            }
            let index = raw.raft.raft_log.last_index();
            let Some(e) = raw
                .raft
                .raft_log
                .entries(index, None, GetEntriesContext::empty(false))
                .ok()
                .and_then(|v| v.into_iter().next())
            else {
                refuse("the change was not appended".into());
                continue;
            };
            if e.get_entry_type() == EntryType::EntryConfChangeV2 {
                if let Some(r) = reply.take() {
                    lock(&self.shared.state.change_waiters).insert(index, r);
                }
            } else {
                // raft-rs turns a change proposed while another is pending into an empty entry.
                refuse("another membership change is still in progress; retry when it is done".into());
            }
            out.push(replica_entry(e));
        }
        drop(raw);
        self.shared.wake();
        out
    }

    fn refuse(&mut self, why: &str) {
        tracing::error!("{why}; stopping this node");
        std::process::exit(2);
    }

    fn diverged(&mut self, d: Diverged) {
        warn!(
            keep_index = d.keep,
            why = d.why,
            "this node's log diverged from the leader's; restarting to cut it back"
        );
        self.shared.state.set_leading(false);
        match super::recover::request_cut(&self.dir, d.keep) {
            Ok(()) => (self.restart)(),
            Err(e) => {
                tracing::error!(error = %e, "cannot record where to cut the log; stopping");
                std::process::exit(1);
            }
        }
    }
}

/// The writer's second durability condition in a cluster: the batch's entries are durable on a
/// majority of nodes.
pub struct MajorityDurable(pub Arc<Shared>);

impl Condition for MajorityDurable {
    fn defers(&self) -> bool {
        true
    }

    /// Parks the replies until a majority has the write: the link reader that steps the last
    /// acknowledgement it needs releases them (`Shared::release_waiting`).
    fn defer(&mut self, end: u64, release: Deferred) -> Option<Deferred> {
        let shared = &self.0;
        {
            let mut p = lock(&shared.progress);
            p.local_durable = p.local_durable.max(end);
        }
        if shared.state.role() == Role::Leader {
            let w = Waiting { end, term: shared.state.term(), since: Instant::now(), release };
            lock(&shared.waiting).push_back(w);
        } else {
            release(Some(&Error::Unavailable(
                "this node no longer leads; the write may or may not be applied: retry on the leader".into(),
            )));
        }
        // Steps the driver: this node's own durable entries count toward the majority, which
        // may already be complete.
        shared.wake();
        None
    }

    fn reach(&mut self, _paths: &[&PathBuf], end: u64, owed: bool) -> Result<()> {
        let shared = &self.0;
        {
            let mut p = lock(&shared.progress);
            p.local_durable = p.local_durable.max(end);
        }
        shared.wake();
        // A follower's appends of the leader's entries answer no client, and a leader does not
        // wait for a batch that owes no reply (the entries of a former leader it appended as it
        // took over): they commit only with a later entry of its own term, which this wait
        // would hold back behind them.
        if !owed {
            return Ok(());
        }
        // Only a leader releases replies, once a majority has the batch: a batch that waited in
        // the flusher behind the one that saw this node step down holds records of its own,
        // never committed, and must not be answered 2xx.
        if shared.state.role() != Role::Leader {
            return Err(Error::Unavailable(
                "this node no longer leads; the write may or may not be applied: retry on the leader".into(),
            ));
        }
        let term = shared.state.term();
        let started = Instant::now();
        let mut p = lock(&shared.progress);
        while p.committed_end < end {
            if shared.state.role() != Role::Leader || shared.state.term() != term {
                return Err(Error::Unavailable(
                    "leadership changed before a majority had this write; it may or may not be applied: retry on the leader"
                        .into(),
                ));
            }
            if started.elapsed() > MAJORITY_WAIT {
                return Err(Error::Unavailable(
                    "no majority acknowledged this write in time; it may or may not be applied".into(),
                ));
            }
            p = shared
                .changed
                .wait_timeout(p, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        shared.state.quorum_wait_us.observe(started.elapsed().as_micros() as u64);
        Ok(())
    }
}
