//! A cluster node's log before it opens: the log must end with an entry's mark, so records after
//! the last mark (appended by a leader that died before it proposed them, never acknowledged)
//! are cut, and so is everything after the entry a node was told to keep when its log diverged
//! from the leader's. Both cuts drop the derived files too, which the store then rebuilds from
//! what is left. What is found (the last entry, the recent entries with their records) starts
//! Raft's view of the log.

use std::path::Path;

use tracing::warn;

use super::ClusterConfig;
use crate::error::{Error, Result};
use crate::storage::commitlog::RecoveryMode;
use crate::storage::commitlog::{cut_files, CommitLog};
use crate::storage::durability::Durability;
use crate::storage::format::Record;
use crate::storage::replica::{ReplicaEntry, Sealed};

/// What a node's log holds of the replicated log.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The oldest entry found (index, term): Raft's log starts after it.
    pub base: Option<(u64, u64)>,
    /// The entries after it, with their records.
    pub entries: Vec<ReplicaEntry>,
    /// (index, term, end offset of its mark) of every entry found.
    pub marks: Vec<(u64, u64, u64)>,
    /// The last entry kept.
    pub last: Sealed,
}

/// The file naming the entry to keep after a divergence (written before the node restarts).
fn cut_marker(dir: &Path) -> std::path::PathBuf {
    dir.join("cluster").join("cut_after")
}

/// Asks the next start to cut the log after entry `keep`.
pub fn request_cut(dir: &Path, keep: u64) -> Result<()> {
    let path = cut_marker(dir);
    super::persist::write_durably(&path, keep.to_string().as_bytes())
        .map_err(|e| Error::io_at("write", &path, e))
}

/// The file naming a snapshot to install at the next start (written before the node restarts).
fn snapshot_marker(dir: &Path) -> std::path::PathBuf {
    dir.join("cluster").join("snapshot")
}

/// Asks the next start to install the snapshot at entry `index` of `term` from node `leader`;
/// `data` is the snapshot's description (the log's end at that entry, and its segment files).
pub fn request_snapshot(dir: &Path, leader: u64, index: u64, term: u64, data: &[u8]) -> Result<()> {
    let path = snapshot_marker(dir);
    let mut b = Vec::with_capacity(24 + data.len());
    for v in [leader, index, term] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(data);
    super::persist::write_durably(&path, &b).map_err(|e| Error::io_at("write", &path, e))
}

/// A snapshot to install: where to copy it from and what it holds.
struct SnapshotPlan {
    leader: u64,
    index: u64,
    term: u64,
    end: u64,
    files: Vec<(u64, u64)>,
}

fn read_snapshot_plan(b: &[u8]) -> Option<SnapshotPlan> {
    let word = |i: usize| b.get(i..i + 8).map(|w| u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
    let (leader, index, term, end) = (word(0)?, word(8)?, word(16)?, word(24)?);
    let n = u32::from_le_bytes(b.get(32..36)?.try_into().ok()?) as usize;
    let files = (0..n).map(|k| Some((word(36 + k * 16)?, word(44 + k * 16)?))).collect::<Option<Vec<_>>>()?;
    Some(SnapshotPlan { leader, index, term, end, files })
}

/// Replaces this node's log with the leader's segment files up to the snapshot's entry, copied
/// over the cluster link; the derived files go (the store rebuilds them). The copy is made
/// beside the log and swapped in whole, so a failure leaves the old log as it was.
fn install_snapshot(dir: &Path, cc: &ClusterConfig, plan: &SnapshotPlan) -> Result<()> {
    let addr =
        cc.peers.iter().find(|(id, _)| *id == plan.leader).map(|(_, a)| a.clone()).ok_or_else(|| {
            Error::Config(format!("the snapshot's leader {} is not among peers", plan.leader))
        })?;
    let fail = |what: &str, e: std::io::Error| {
        Error::Unavailable(format!("snapshot from node {}: {what}: {e}", plan.leader))
    };
    let staging = dir.join("commitlog.snapshot");
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| Error::io_at("remove", &staging, e))?;
    }
    crate::storage::io::create_private_dir(&staging)?;
    let mut fetcher =
        super::net::Fetcher::connect(&addr, &cc.secret, cc.node_id, plan.leader, &cc.advertise_url)
            .map_err(|e| fail("connect", e))?;
    let mut copied = 0u64;
    for (base, size) in &plan.files {
        let path = staging.join(crate::storage::commitlog::segment_name(*base));
        let mut f = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&path)
        }
        .map_err(|e| Error::io_at("create", &path, e))?;
        let want = (*size).min(plan.end.saturating_sub(*base));
        match fetcher.fetch(*base, want, &mut f).map_err(|e| fail("copy", e))? {
            Some(n) if n == want => copied += n,
            _ => {
                return Err(Error::Unavailable(format!(
                "snapshot from node {}: segment {base} is gone there (reclaimed); a newer one will be sent",
                plan.leader
            )))
            }
        }
        // Segment files keep their size: the next one's name is this one's base plus it.
        f.set_len(*size).map_err(|e| Error::io_at("extend", &path, e))?;
        f.sync_all().map_err(|e| Error::io_at("sync", &path, e))?;
    }
    sync_dir(&staging)?;
    let log_dir = dir.join("commitlog");
    for name in ["checkpoint", "clean_shutdown"] {
        remove(&dir.join(name))?;
    }
    for path in [log_dir.clone(), dir.join("cq"), dir.join("index")] {
        if path.exists() {
            std::fs::remove_dir_all(&path).map_err(|e| Error::io_at("remove", &path, e))?;
        }
    }
    std::fs::rename(&staging, &log_dir).map_err(|e| Error::io_at("rename", &staging, e))?;
    sync_dir(dir)?;
    // The snapshot's entry is committed: the node starts knowing so.
    let mut hs = super::persist::load_hard_state(dir).unwrap_or_default();
    hs.term = hs.term.max(plan.term);
    hs.commit = hs.commit.max(plan.index);
    super::persist::save_hard_state(dir, &hs)?;
    let _ = fetcher.done(plan.index);
    tracing::info!(index = plan.index, bytes = copied, segments = plan.files.len(), "snapshot installed");
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io_at("sync", dir, e))
}

/// Installs a snapshot asked for by the last run, if any. A failed copy is logged and dropped:
/// the node starts on its old log and the leader sends another snapshot.
fn install_requested(dir: &Path, cc: &ClusterConfig) -> Result<()> {
    let marker = snapshot_marker(dir);
    let bytes = match std::fs::read(&marker) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io_at("read", &marker, e)),
    };
    match read_snapshot_plan(&bytes) {
        Some(plan) => {
            if let Err(e) = install_snapshot(dir, cc, &plan) {
                warn!(error = %e, "snapshot not installed; starting on the log as it was");
                let staging = dir.join("commitlog.snapshot");
                let _ = std::fs::remove_dir_all(&staging);
            }
        }
        None => warn!(file = %marker.display(), "snapshot request damaged; ignored"),
    }
    remove(&marker)?;
    sync_dir(&dir.join("cluster"))
}

/// Cuts the log in `dir` as the module says and returns what it holds (after installing a
/// snapshot the last run received, if any).
pub fn prepare(dir: &Path, segment_bytes: u64, mode: RecoveryMode, cc: &ClusterConfig) -> Result<Recovered> {
    install_requested(dir, cc)?;
    let marker = cut_marker(dir);
    let keep = match std::fs::read_to_string(&marker) {
        Ok(s) => Some(s.trim().parse::<u64>().map_err(|_| Error::Corrupt {
            file: marker.display().to_string(),
            offset: 0,
            reason: "not an entry index".into(),
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io_at("read", &marker, e)),
    };
    let log_dir = dir.join("commitlog");
    if !log_dir.is_dir() {
        return Ok(Recovered::default());
    }
    // The end lies in the newest segment file or the one before it: the newest may be one made
    // ahead of need (empty), so scanning only it would take its start for the log's end.
    let bases = crate::storage::commitlog::list_numbered(&log_dir)?;
    let scan_from = bases.len().checked_sub(2).map_or(0, |i| bases[i]);
    let (log, _) = CommitLog::open(&log_dir, segment_bytes, scan_from, mode, &[], Durability::new(dir))?;
    let found = scan(&log, keep)?;
    let (start, end) = (log.start(), log.end());
    drop(log);
    if found.marks.is_empty() && end > start && keep.is_none() {
        return Err(Error::Config(format!(
            "the data directory {} holds a single node's log; a cluster node starts on an empty one \
             (move its messages over with a client)",
            dir.display()
        )));
    }
    if found.last.end < end {
        warn!(
            keep_index = found.last.index,
            from = found.last.end,
            bytes = end - found.last.end,
            "cutting records no committed entry holds; derived files are rebuilt"
        );
        cut_files(&log_dir, found.last.end)?;
        for name in ["checkpoint", "clean_shutdown"] {
            remove(&dir.join(name))?;
        }
        for name in ["cq", "index"] {
            let path = dir.join(name);
            if path.exists() {
                std::fs::remove_dir_all(&path).map_err(|e| Error::io_at("remove", &path, e))?;
            }
        }
    }
    if marker.exists() {
        // Durably gone: a marker back after a power cut would cut entries acknowledged since.
        remove(&marker)?;
        let cluster_dir = dir.join("cluster");
        std::fs::File::open(&cluster_dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io_at("sync", &cluster_dir, e))?;
    }
    Ok(found)
}

fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io_at("remove", path, e)),
    }
}

/// Reads the log's recent entries: from the newest segment back until a mark is found (and, with
/// `keep`, one at or below it), then forward to the end or to entry `keep`.
fn scan(log: &CommitLog, keep: Option<u64>) -> Result<Recovered> {
    let (start, end) = (log.start(), log.end());
    if end == start {
        return Ok(Recovered::default());
    }
    // From the newest segment back: far enough to hold a mark (and the one to keep), and then
    // on to fill the entries a leader keeps for followers that fell behind, as before the
    // restart (up to the window's bytes).
    let mut from = log.segment_base(end - 1).unwrap_or(start);
    loop {
        let found = scan_from(log, from, keep)?;
        let has_base = found.base.is_some_and(|(i, _)| keep.is_none_or(|k| i <= k));
        if has_base && end - from >= WINDOW_BYTES || from <= start {
            return Ok(found);
        }
        from = log.segment_base(from - 1).unwrap_or(start);
    }
}

/// Log bytes read back at a start to refill the entries kept for followers (as the node's
/// window holds at most this much of entries' records).
const WINDOW_BYTES: u64 = 64 << 20;

fn scan_from(log: &CommitLog, from: u64, keep: Option<u64>) -> Result<Recovered> {
    let mut out = Recovered::default();
    let mut records: Vec<u8> = Vec::new();
    let mut at = from;
    while let Some((offset, rec, next)) = log.next_fields(at)? {
        at = next;
        let Record::Raft(m) = rec else {
            if let Some(raw) = log.raw(offset, (next - offset) as usize) {
                records.extend_from_slice(raw);
            }
            continue;
        };
        if keep.is_some_and(|k| m.index > k) {
            break;
        }
        if out.base.is_none() {
            out.base = Some((m.index, m.term));
        } else {
            out.entries.push(ReplicaEntry {
                term: m.term,
                index: m.index,
                origin_start: Some(m.data_start),
                kind: m.kind,
                records: std::mem::take(&mut records),
                payload: m.payload.to_vec(),
            });
        }
        records.clear();
        out.marks.push((m.index, m.term, next));
        out.last = Sealed { index: m.index, term: m.term, end: next };
    }
    Ok(out)
}
