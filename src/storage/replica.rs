//! The store's side of replication: the log is framed into the cluster's replicated log by Raft
//! marks, and [`Replicator`] is what a cluster gives the store so that every commit keeps the two
//! in step.
//!
//! A leader's engine appends and dispatches records as on a single node; at its commit the store
//! proposes the records since the last mark as one entry and appends that entry's mark. Entries
//! the consensus log holds and this log lacks (a follower's replicated entries, a new leader's
//! empty entry) are appended, record by record and dispatched, before anything new is proposed.
//! Replies are released by the writer only once a majority has the entry (a durability
//! condition the cluster adds), so nothing answered 2xx depends on an entry that can be undone.

use crate::storage::format::EntryKind;

/// This log's last complete entry: the newest Raft mark, and the offset one past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sealed {
    /// The entry's index (0: none yet).
    pub index: u64,
    /// The entry's term.
    pub term: u64,
    /// Log offset one past its mark: where the next entry's records start.
    pub end: u64,
}

/// An entry of the consensus log, to be appended to this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaEntry {
    /// Its term.
    pub term: u64,
    /// Its index.
    pub index: u64,
    /// Where its records start in the leader's log, when the leader said: this log must place
    /// them at the same offset.
    pub origin_start: Option<u64>,
    /// Normal or membership change.
    pub kind: EntryKind,
    /// Its records, framed, back to back (empty for an empty or membership entry).
    pub records: Vec<u8>,
    /// The encoded membership change of a [`EntryKind::ConfChange`] entry.
    pub payload: Vec<u8>,
}

/// This log disagrees with the consensus log at or before its last entry: the node must cut its
/// log back to `keep` (the last entry both hold) and rebuild what derives from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Diverged {
    /// The newest entry index this log keeps.
    pub keep: u64,
    /// Why, for the log line.
    pub why: &'static str,
}

/// How far a leader's readers had passed its queues at a durable checkpoint. In each queue
/// listed, every entry pointing below its offset was handled (fired, popped or stale); in a topic
/// queue not listed (the leader forgot it, emptied), every entry pointing below `dispatched`. A
/// follower moves its own cursors there, so its queue files are deleted as the leader's are
/// (nothing else moves a follower's cursors: it fires and pops nothing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Passed {
    /// The entry the checkpoint's state is as of: a follower applies the positions only once it
    /// holds this very entry (index and term), committed.
    pub index: u64,
    /// That entry's term.
    pub term: u64,
    /// Log offset one past that entry's mark (the checkpoint's dispatch position).
    pub dispatched: u64,
    /// Level queues: (level in ms, log offset).
    pub levels: Vec<(u64, u64)>,
    /// Topic queues: (name, log offset).
    pub topics: Vec<(String, u64)>,
}

/// What a cluster gives the store (see the module documentation).
pub trait Replicator: Send {
    /// The entries after `sealed` that the consensus log holds, in order; `Err` when this log's
    /// entry at `sealed.index` is not the consensus log's.
    fn missing(&mut self, sealed: Sealed) -> Result<Vec<ReplicaEntry>, Diverged>;
    /// Proposes `records` (framed, back to back) as the next entry: its (term, index), or `None`
    /// when this node is not the leader (the records were appended for nothing).
    fn propose(&mut self, records: Vec<u8>, data_start: u64) -> Option<(u64, u64)>;
    /// Entry `sealed.index` is now in this log, its mark ending at `sealed.end`.
    fn sealed(&mut self, sealed: Sealed);
    /// True when this node may append records of its own (it leads, and holds every entry
    /// before its term's first): timers, expiries and reclaim run only then.
    fn leading(&self) -> bool;
    /// Log offset up to which this log's entries are committed: reclaim deletes nothing whose
    /// fate depends on a later entry (a new leader may drop entries past it).
    fn committed_end(&self) -> u64;
    /// This log disagrees with the consensus log: the cluster cuts it back to `d.keep` and
    /// rebuilds the node (nothing more is acknowledged here until then).
    fn diverged(&mut self, d: Diverged);
    /// Membership changes asked for since the last commit, proposed now (after the step's own
    /// records, so the log stays in index order): the entries to append.
    fn membership(&mut self) -> Vec<ReplicaEntry>;
    /// On a leader: its readers' positions at a checkpoint just made durable, for the followers.
    fn passed(&mut self, p: Passed);
    /// On a follower: the newest positions the leader sent, once this log (its last entry
    /// `sealed`) holds their entry and it is committed; `None` until then.
    fn take_passed(&mut self, sealed: Sealed) -> Option<Passed>;
    /// This node cannot follow the leader at all (its log would not match byte for byte): the
    /// cluster stops the node with `why`.
    fn refuse(&mut self, why: &str);
}
