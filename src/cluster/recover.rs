//! A cluster node's log before it opens: the log must end with an entry's mark, so records after
//! the last mark (appended by a leader that died before it proposed them, never acknowledged)
//! are cut, and so is everything after the entry a node was told to keep when its log diverged
//! from the leader's. Both cuts drop the derived files too, which the store then rebuilds from
//! what is left. What is found (the last entry, the recent entries with their records) starts
//! Raft's view of the log.

use std::path::Path;

use tracing::warn;

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
    std::fs::create_dir_all(dir.join("cluster")).map_err(|e| Error::io_at("create", &path, e))?;
    std::fs::write(&path, keep.to_string()).map_err(|e| Error::io_at("write", &path, e))?;
    std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|e| Error::io_at("sync", &path, e))
}

/// Cuts the log in `dir` as the module says and returns what it holds.
pub fn prepare(dir: &Path, segment_bytes: u64, mode: RecoveryMode) -> Result<Recovered> {
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
    let (log, _) = CommitLog::open(&log_dir, segment_bytes, u64::MAX, mode, &[], Durability::new(dir))?;
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
    remove(&marker)?;
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
    let mut from = log.segment_base(end - 1).unwrap_or(start);
    loop {
        let found = scan_from(log, from, keep)?;
        let enough = found.base.is_some_and(|(i, _)| keep.is_none_or(|k| i <= k));
        if enough || from <= start {
            return Ok(found);
        }
        from = log.segment_base(from - 1).unwrap_or(start);
    }
}

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
