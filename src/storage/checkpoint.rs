//! The checkpoint (dispatcher position, queue lengths, reader offsets, counters) and the clean-shutdown
//! marker. Both are replaced atomically: write temp, fsync, rename, fsync the directory. Their bytes
//! are encoded and decoded in [`super::format::checkpoint`].

use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::durability::Durability;
use super::io;
use super::mmap::{sync_dir, sync_path};
use crate::error::{Error, Result};

// The layout is storage::format's; these names stay here for the checkpoint's users.
pub use super::format::checkpoint::{
    Checkpoint, CheckpointDamage, CleanMarker, ClosedCounts, QueueKind, QueueState, CHECKPOINT_MAGIC,
    CHECKPOINT_VERSION, CLEAN_MAGIC,
};

impl Checkpoint {
    /// Loads `path`; a missing file is the empty checkpoint, a damaged one is an error.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        match Checkpoint::load_or_damage(path)? {
            Ok(cp) => Ok(cp),
            Err(why) => Err(Error::Corrupt {
                file: path.display().to_string(),
                offset: 0,
                reason: format!("checkpoint unusable: {why}"),
            }),
        }
    }

    /// Loads `path`; a missing file is the empty checkpoint. A damaged file comes back as its
    /// damage (the caller rebuilds, since everything in it can be derived from the log); only a
    /// failure to read the file is an error.
    pub fn load_or_damage(path: &Path) -> Result<std::result::Result<Checkpoint, CheckpointDamage>> {
        match fs::read(path) {
            Ok(b) => Ok(Checkpoint::decode_checked(&b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ok(Checkpoint::default())),
            Err(e) => Err(Error::io_at("read", path, e)),
        }
    }

    /// Replaces `path` atomically.
    pub fn store(&self, path: &Path, durability: &Durability) -> Result<()> {
        write_atomic(path, &self.encode(), durability)
    }
}

/// What a checkpoint job covers, handed back to the store once the job has run: only then do the
/// files count as synced, so a job that fails leaves its files to the next one.
#[derive(Debug, Clone, Default)]
pub struct Captured {
    /// Commit-log offset the job's segment syncs cover.
    pub log_end: u64,
    /// Per queue: kind, name, the log offset that created it (to tell a namesake apart) and the
    /// length whose entries the job syncs.
    pub queues: Vec<(QueueKind, String, u64, u64)>,
}

/// A checkpoint to write once its files are durable: built on the engine thread, run on another.
pub struct CheckpointJob {
    /// The state to record.
    pub checkpoint: Checkpoint,
    /// Open files whose writes the checkpoint covers (log segments, the index).
    pub files: Vec<super::mmap::SyncFile>,
    /// Consume-queue files whose writes the checkpoint covers, opened one at a time when synced,
    /// so a job holds no handle per queue. Nothing deletes them before the job has run: files are
    /// deleted only behind a durable checkpoint's cursors, and these hold entries past them, and a
    /// topic is forgotten only if it has not changed since that checkpoint.
    pub queue_files: Vec<std::path::PathBuf>,
    /// Where the checkpoint goes.
    pub path: std::path::PathBuf,
    /// What the job covers, for [`Store::checkpoint_synced`](super::store::Store::checkpoint_synced).
    pub captured: Captured,
    /// Space to give up when the disk is full, so the checkpoint can still be written.
    pub reserve: super::reserve::Reserve,
    /// The store's durability owner, which the job's syncs report to.
    pub durability: Durability,
}

impl CheckpointJob {
    /// fdatasyncs every file, then replaces the checkpoint: it never names state not yet on disk.
    pub fn run(self) -> Result<()> {
        for f in &self.files {
            f.sync_data()?;
        }
        for p in &self.queue_files {
            match sync_path(p, &self.durability) {
                // Reclaim deletes queue files only behind a durable checkpoint's cursors (or a
                // forgotten topic's): a file gone since the capture holds nothing to sync.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                r => r?,
            }
        }
        self.reserve.retry_on_full_disk(|| self.checkpoint.store(&self.path, &self.durability))
    }
}

/// Writes `bytes` to `path` so that a crash leaves the old or the new content, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8], durability: &Durability) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let written = (|| {
        // 0600: the receipt key is written this way, and nothing here is for other users.
        let opts = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).clone();
        let f = io::open(&opts, &tmp).map_err(|e| Error::io_at("create", &tmp, e))?;
        // A temp file left by a crash keeps the mode it was made with; `mode` covers new ones only.
        f.set_permissions(fs::Permissions::from_mode(0o600)).map_err(|e| Error::io_at("chmod", &tmp, e))?;
        io::write_all_at(&f, &tmp, bytes, 0).map_err(|e| Error::io_at("write", &tmp, e))?;
        io::sync_all(&f, &tmp, durability).map_err(|e| Error::io_at("fsync", &tmp, e))
    })();
    if let Err(e) = written {
        // A part-written temp file only holds disk space that a full disk needs back.
        let _ = io::remove_file(&tmp);
        return Err(e);
    }
    io::rename(&tmp, path).map_err(|e| Error::io_at("rename", &tmp, e))?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir, durability),
        _ => sync_dir(Path::new("."), durability),
    }
}

/// Writes the clean-shutdown marker.
pub fn write_clean_marker(path: &Path, marker: &CleanMarker, durability: &Durability) -> Result<()> {
    write_atomic(path, &marker.encode(), durability)
}

/// Reads and removes the clean-shutdown marker; returns it if valid.
pub fn take_clean_marker(path: &Path, durability: &Durability) -> Result<Option<CleanMarker>> {
    let b = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io_at("read", path, e)),
    };
    io::remove_file(path).map_err(|e| Error::io_at("remove", path, e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir, durability)?;
    }
    Ok(CleanMarker::decode(&b).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint");
        assert_eq!(Checkpoint::load(&path).unwrap(), Checkpoint::default());
        let cp = Checkpoint {
            dispatched: 12345,
            queues: vec![
                QueueState {
                    kind: QueueKind::Level,
                    name: "1000".into(),
                    len: 5,
                    cursor: 3,
                    reserved: 0,
                    dead: 0,
                    delayed: 0,
                    ready: 0,
                },
                QueueState {
                    kind: QueueKind::Topic,
                    name: "orders".into(),
                    len: 9,
                    cursor: 1,
                    reserved: 2,
                    dead: 1,
                    delayed: 4,
                    ready: 7,
                },
            ],
            paused: vec![("orders".into(), 99), ("订单 a".into(), 7)],
            push: vec![("hooks".into(), 1234)],
            flow: vec![("slow".into(), 77)],
            serial: 0,
        };
        cp.store(&path, &Durability::new(dir.path())).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), cp);
        let mut b = fs::read(&path).unwrap();
        b[10] ^= 1;
        fs::write(&path, &b).unwrap();
        assert!(Checkpoint::load(&path).is_err());
        for n in 0..b.len() {
            assert!(Checkpoint::decode(&b[..n]).is_none());
        }
    }

    /// A version 1, 2 or 3 checkpoint (an older delayd's) is rebuilt from the log, not refused; a newer
    /// one is refused.
    #[test]
    fn older_checkpoints_read_as_rebuildable_and_newer_ones_as_another_version() {
        let with_version = |v: u16| {
            let mut b = Checkpoint::default().encode();
            b[4..6].copy_from_slice(&v.to_le_bytes());
            let n = b.len() - 4;
            let crc = crc32fast::hash(&b[..n]);
            b[n..].copy_from_slice(&crc.to_le_bytes());
            Checkpoint::decode_checked(&b)
        };
        for v in [1, 2, 3] {
            assert!(matches!(with_version(v), Err(CheckpointDamage::Damaged(_))), "version {v}");
        }
        assert!(with_version(CHECKPOINT_VERSION).is_ok());
        let newer = CHECKPOINT_VERSION + 1;
        assert_eq!(with_version(newer).err(), Some(CheckpointDamage::OtherVersion(newer)));
    }

    #[test]
    fn clean_marker_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clean_shutdown");
        let d = Durability::new(dir.path());
        let m = CleanMarker { log_end: 77, counts: Some(ClosedCounts { live_bytes: 5, ..Default::default() }) };
        write_clean_marker(&path, &m, &d).unwrap();
        assert_eq!(take_clean_marker(&path, &d).unwrap(), Some(m));
        assert_eq!(take_clean_marker(&path, &d).unwrap(), None);
    }
}
