//! The checkpoint (dispatcher position, queue lengths, reader offsets, counters) and the clean-shutdown
//! marker. Both are replaced atomically: write temp, fsync, rename, fsync the directory.

use std::fs;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::io;
use super::mmap::{sync_dir, sync_path};
use crate::error::{Error, Result};

/// Magic of the checkpoint file ("DLCK").
pub const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"DLCK");
/// Magic of the clean-shutdown marker ("DLCS").
pub const CLEAN_MAGIC: u32 = u32::from_le_bytes(*b"DLCS");
/// Layout version of both files (3: per-topic state counts, paused topics, push subscriptions).
pub const CHECKPOINT_VERSION: u16 = 3;

/// Which family a queue belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueueKind {
    /// A delay level; the name is its duration in ms.
    Level = 0,
    /// A topic; the name is the topic.
    Topic = 1,
}

/// Saved state of one consume queue and its reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// Level or topic.
    pub kind: QueueKind,
    /// Level duration in ms (decimal) or topic name.
    pub name: String,
    /// Entries written (and durable) at checkpoint time.
    pub len: u64,
    /// Reader position: every entry below it was handled and its effect is durable.
    pub cursor: u64,
    /// Topics: messages reserved and not yet acked.
    pub reserved: u64,
    /// Topics: messages moved to the dead-letter topic.
    pub dead: u64,
    /// Topics: messages waiting on a delay level.
    pub delayed: u64,
    /// Topics: messages in the queue not yet popped.
    pub ready: u64,
}

/// Everything the engine restarts from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Commit-log offset up to which consume queues and the id index are durable.
    pub dispatched: u64,
    /// One entry per queue.
    pub queues: Vec<QueueState>,
    /// Paused topics, each with the log offset of its Pause record.
    pub paused: Vec<(String, u64)>,
    /// Topics with a push subscription, each with the log offset of its Push record.
    pub push: Vec<(String, u64)>,
    /// Which snapshot of this process it is (in memory only, 0 when loaded): reclaim must know a
    /// checkpoint was taken after its decision, which `dispatched` alone cannot tell when nothing
    /// was appended in between.
    pub serial: u64,
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

impl Checkpoint {
    /// Serialises with a trailing CRC32.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32 + self.queues.len() * 64);
        b.extend_from_slice(&CHECKPOINT_MAGIC.to_le_bytes());
        b.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        put_u64(&mut b, self.dispatched);
        b.extend_from_slice(&(self.queues.len() as u32).to_le_bytes());
        for q in &self.queues {
            b.push(q.kind as u8);
            b.extend_from_slice(&(q.name.len() as u16).to_le_bytes());
            b.extend_from_slice(q.name.as_bytes());
            put_u64(&mut b, q.len);
            put_u64(&mut b, q.cursor);
            put_u64(&mut b, q.reserved);
            put_u64(&mut b, q.dead);
            put_u64(&mut b, q.delayed);
            put_u64(&mut b, q.ready);
        }
        for list in [&self.paused, &self.push] {
            b.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for (topic, offset) in list {
                b.extend_from_slice(&(topic.len() as u16).to_le_bytes());
                b.extend_from_slice(topic.as_bytes());
                put_u64(&mut b, *offset);
            }
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and checks a checkpoint; `None` for anything malformed.
    pub fn decode(b: &[u8]) -> Option<Checkpoint> {
        Checkpoint::decode_checked(b).ok()
    }

    /// Parses and checks a checkpoint, saying why it is unusable.
    pub fn decode_checked(b: &[u8]) -> std::result::Result<Checkpoint, CheckpointDamage> {
        let damaged = |why: &str| CheckpointDamage::Damaged(why.to_string());
        if b.len() < 24 {
            return Err(damaged("shorter than 24 bytes"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
            return Err(damaged("CRC mismatch"));
        }
        if u32::from_le_bytes([body[0], body[1], body[2], body[3]]) != CHECKPOINT_MAGIC {
            return Err(damaged("bad magic"));
        }
        let version = u16::from_le_bytes([body[4], body[5]]);
        if version == 1 || version == 2 {
            // An older delayd's: everything in it can be derived again from the log.
            return Err(damaged(&format!("layout version {version}, without all of today's fields")));
        }
        if version != CHECKPOINT_VERSION {
            // Intact (the CRC matched) but from another delayd: it is not ours to overwrite.
            return Err(CheckpointDamage::OtherVersion(version));
        }
        Checkpoint::decode_body(body).ok_or_else(|| damaged("records do not parse or do not end at the CRC"))
    }

    fn decode_body(body: &[u8]) -> Option<Checkpoint> {
        let mut r = Reader { b: body, pos: 0 };
        if r.u32()? != CHECKPOINT_MAGIC || r.u16()? != CHECKPOINT_VERSION {
            return None;
        }
        r.u16()?;
        let dispatched = r.u64()?;
        let n = r.u32()?;
        let mut queues = Vec::new();
        for _ in 0..n {
            let kind = match r.take(1)?[0] {
                0 => QueueKind::Level,
                1 => QueueKind::Topic,
                _ => return None,
            };
            let len = r.u16()? as usize;
            let name = String::from_utf8(r.take(len)?.to_vec()).ok()?;
            queues.push(QueueState {
                kind,
                name,
                len: r.u64()?,
                cursor: r.u64()?,
                reserved: r.u64()?,
                dead: r.u64()?,
                delayed: r.u64()?,
                ready: r.u64()?,
            });
        }
        let mut lists = [Vec::new(), Vec::new()];
        for list in &mut lists {
            for _ in 0..r.u32()? {
                let len = r.u16()? as usize;
                let topic = String::from_utf8(r.take(len)?.to_vec()).ok()?;
                list.push((topic, r.u64()?));
            }
        }
        let [paused, push] = lists;
        (r.pos == body.len()).then_some(Checkpoint { dispatched, queues, paused, push, serial: 0 })
    }

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
            Err(e) => Err(Error::io(format!("read {}", path.display()), e)),
        }
    }

    /// Replaces `path` atomically.
    pub fn store(&self, path: &Path) -> Result<()> {
        write_atomic(path, &self.encode())
    }
}

/// Why a checkpoint file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointDamage {
    /// It fails its CRC, magic or layout check: damaged, so it is rebuilt from the log.
    Damaged(String),
    /// It is intact but has another layout version: written by a different delayd.
    OtherVersion(u16),
}

impl std::fmt::Display for CheckpointDamage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointDamage::Damaged(why) => write!(f, "damaged ({why})"),
            CheckpointDamage::OtherVersion(v) => {
                write!(f, "layout version {v}, this delayd writes {CHECKPOINT_VERSION}")
            }
        }
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
    pub reserve: super::durability::Reserve,
}

impl CheckpointJob {
    /// fdatasyncs every file, then replaces the checkpoint: it never names state not yet on disk.
    pub fn run(self) -> Result<()> {
        for f in &self.files {
            f.sync_data()?;
        }
        for p in &self.queue_files {
            match sync_path(p) {
                // Reclaim deletes queue files only behind a durable checkpoint's cursors (or a
                // forgotten topic's): a file gone since the capture holds nothing to sync.
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                r => r?,
            }
        }
        self.reserve.retry_on_full_disk(|| self.checkpoint.store(&self.path))
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// Writes `bytes` to `path` so that a crash leaves the old or the new content, never a mix.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let written = (|| {
        // 0600: the receipt key is written this way, and nothing here is for other users.
        let opts = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).clone();
        let f = io::open(&opts, &tmp).map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
        // A temp file left by a crash keeps the mode it was made with; `mode` covers new ones only.
        f.set_permissions(fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(format!("chmod {}", tmp.display()), e))?;
        io::write_all_at(&f, &tmp, bytes, 0).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
        io::sync_all(&f, &tmp).map_err(|e| Error::io(format!("fsync {}", tmp.display()), e))
    })();
    if let Err(e) = written {
        // A part-written temp file only holds disk space that a full disk needs back.
        let _ = io::remove_file(&tmp);
        return Err(e);
    }
    io::rename(&tmp, path).map_err(|e| Error::io(format!("rename {}", tmp.display()), e))?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => sync_dir(Path::new(".")),
    }
}

/// Writes the clean-shutdown marker holding the log end.
pub fn write_clean_marker(path: &Path, log_end: u64) -> Result<()> {
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(&CLEAN_MAGIC.to_le_bytes());
    b.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    put_u64(&mut b, log_end);
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    write_atomic(path, &b)
}

/// Reads and removes the clean-shutdown marker; returns the log end it holds, if valid.
pub fn take_clean_marker(path: &Path) -> Result<Option<u64>> {
    let b = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("read {}", path.display()), e)),
    };
    io::remove_file(path).map_err(|e| Error::io(format!("remove {}", path.display()), e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    if b.len() != 20 || crc32fast::hash(&b[..16]) != u32::from_le_bytes([b[16], b[17], b[18], b[19]]) {
        return Ok(None);
    }
    if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != CLEAN_MAGIC {
        return Ok(None);
    }
    Ok(Some(u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]))))
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
            serial: 0,
        };
        cp.store(&path).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), cp);
        let mut b = fs::read(&path).unwrap();
        b[10] ^= 1;
        fs::write(&path, &b).unwrap();
        assert!(Checkpoint::load(&path).is_err());
        for n in 0..b.len() {
            assert!(Checkpoint::decode(&b[..n]).is_none());
        }
    }

    /// A version 1 or 2 checkpoint (an older delayd's) is rebuilt from the log, not refused; a newer
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
        for v in [1, 2] {
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
        write_clean_marker(&path, 77).unwrap();
        assert_eq!(take_clean_marker(&path).unwrap(), Some(77));
        assert_eq!(take_clean_marker(&path).unwrap(), None);
    }
}
