//! Raft's view of the log: a bounded window of entries in memory (to send to followers that lag),
//! and the snapshots a leader offers a follower behind that window. The commit log itself is the
//! durable copy of every entry.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use raft::prelude::{ConfState, Entry, EntryType, Snapshot};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, Storage};
use tracing::info;

use crate::storage::format::EntryKind;
use crate::storage::replica::ReplicaEntry;

/// Entries kept in memory to send to a follower that fell behind, in bytes and in number.
pub(super) const WINDOW_BYTES: u64 = 64 << 20;
/// See [`WINDOW_BYTES`].
pub(super) const WINDOW_ENTRIES: usize = 100_000;
/// Shrinks the window (in entries) so tests reach a snapshot without writing 64 MiB.
pub const TEST_WINDOW_ENTRIES: &str = "DELAYD_TEST_RAFT_WINDOW_ENTRIES";

pub(super) fn window_entries() -> usize {
    std::env::var(TEST_WINDOW_ENTRIES).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(WINDOW_ENTRIES)
}

/// Raft's view of the log: the entries of a bounded window in memory (to send to followers);
/// the commit log is the durable copy. A follower behind the window gets a snapshot: the
/// newest committed entry's place in the log, and the list of segment files up to it, which it
/// then copies from this node's data directory (see `recover`).
pub struct LogStore(pub(super) MemStorage, pub(super) Arc<Snapshots>);

/// The newest committed entry with its mark in this log: where a snapshot can stand.
#[derive(Debug, Clone, Copy)]
pub(super) struct SnapPoint {
    pub(super) index: u64,
    pub(super) term: u64,
    /// Log offset one past its mark.
    pub(super) end: u64,
}

/// What a leader knows of the snapshots it can send and has sent.
pub(super) struct Snapshots {
    pub(super) dir: PathBuf,
    pub(super) point: Mutex<Option<SnapPoint>>,
    /// Followers a snapshot was sent to, and when: unanswered for long, it is given up.
    pub(super) sent: Mutex<std::collections::HashMap<u64, Instant>>,
}

/// Gives up on a snapshot a follower did not report fetched within this (it is sent again).
pub(super) const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

impl Snapshots {
    /// The snapshot standing at the current point: its metadata, and as data the log's end at
    /// that entry and every segment file (base, size) below it.
    pub(super) fn make(&self, conf: ConfState, to: u64) -> raft::Result<Snapshot> {
        let unavailable = || raft::Error::Store(raft::StorageError::SnapshotTemporarilyUnavailable);
        let point = (*lock(&self.point)).ok_or_else(unavailable)?;
        let log_dir = self.dir.join("commitlog");
        let bases = crate::storage::commitlog::list_numbered(&log_dir).map_err(|_| unavailable())?;
        let mut data = Vec::with_capacity(12 + bases.len() * 16);
        data.extend_from_slice(&point.end.to_le_bytes());
        let mut files = Vec::new();
        for base in bases.into_iter().filter(|b| *b < point.end) {
            let path = log_dir.join(crate::storage::commitlog::segment_name(base));
            let size = std::fs::metadata(&path).map_err(|_| unavailable())?.len();
            files.push((base, size));
        }
        data.extend_from_slice(&(files.len() as u32).to_le_bytes());
        for (base, size) in files {
            data.extend_from_slice(&base.to_le_bytes());
            data.extend_from_slice(&size.to_le_bytes());
        }
        let mut snap = Snapshot { data: data.into(), ..Default::default() };
        snap.mut_metadata().index = point.index;
        snap.mut_metadata().term = point.term;
        snap.mut_metadata().set_conf_state(conf);
        lock(&self.sent).insert(to, Instant::now());
        info!(
            node = to,
            index = point.index,
            "node is behind the entries kept in memory: sending it a snapshot"
        );
        Ok(snap)
    }
}

impl Storage for LogStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.0.initial_state()
    }
    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.0.entries(low, high, max_size, context)
    }
    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.0.term(idx)
    }
    fn first_index(&self) -> raft::Result<u64> {
        self.0.first_index()
    }
    fn last_index(&self) -> raft::Result<u64> {
        self.0.last_index()
    }
    fn snapshot(&self, _request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let conf = self.0.initial_state()?.conf_state;
        self.1.make(conf, to)
    }
}

pub(super) fn entry_of(e: &ReplicaEntry) -> Entry {
    let mut out = Entry { term: e.term, index: e.index, ..Default::default() };
    if let Some(start) = e.origin_start {
        out.context = start.to_le_bytes().to_vec().into();
    }
    if e.kind == EntryKind::ConfChange {
        out.set_entry_type(EntryType::EntryConfChangeV2);
        out.data = e.payload.clone().into();
    } else {
        out.data = e.records.clone().into();
    }
    out
}

pub(super) fn replica_entry(e: Entry) -> ReplicaEntry {
    let conf = e.get_entry_type() != EntryType::EntryNormal;
    let (term, index) = (e.term, e.index);
    let data = e.data.to_vec();
    let origin_start = <[u8; 8]>::try_from(&e.context[..]).ok().map(u64::from_le_bytes);
    ReplicaEntry {
        term,
        index,
        origin_start,
        kind: if conf { EntryKind::ConfChange } else { EntryKind::Normal },
        records: if conf { Vec::new() } else { data.clone() },
        payload: if conf { data } else { Vec::new() },
    }
}

/// Locks `m`, going on with the data a panicked holder left (each use keeps it consistent).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
