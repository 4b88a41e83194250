//! A consistent copy of a running single node's data directory (`POST /v1/admin/backup`).
//!
//! The commit log is the only source of truth (everything else in the data directory derives
//! from it, see storage-format.md), so a backup is the log up to a **cut** plus the receipt key.
//! The cut is taken on the engine thread, between two requests: the log's write position then,
//! with a handle on every segment file. Appends only ever write past the write position, and a
//! sealed segment is never written again (reclaim deletes whole files), so the bytes below the cut
//! stay as they were while another thread copies them; a segment reclaim deletes meanwhile stays
//! readable through its handle. The copy holds every change applied before the cut (everything
//! acknowledged before the backup was asked for) and nothing after it.
//!
//! The checkpoint, the consume queues and the id index are left out: the engine writes them
//! through mappings at any time, so a copy of them would not match the cut, and recovery derives
//! them from the log anyway. The broker started on the copy replays the whole log once.
//!
//! Segments are copied, never hard-linked: a broker started on the copy writes into its last
//! segment and recovery may zero a segment's tail in place, which a link would share with the
//! original.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use super::commitlog::segment_name;
use crate::error::{Error, Result};

/// One segment of the cut: the file as it was open at the cut, and how much of it to copy.
pub struct CutSegment {
    /// Global offset of its first byte (its name).
    pub base: u64,
    /// The file's size; the copy has the same size, zero past `copy`.
    pub size: u64,
    /// Bytes from position 0 that hold records (or an EndOfSegment) at the cut.
    pub copy: u64,
    /// Read handle, valid even if reclaim deletes the file meanwhile.
    pub file: File,
}

/// What a backup copies, fixed on the engine thread.
pub struct Cut {
    /// Offset of the first byte still in the log.
    pub log_start: u64,
    /// The write position at the cut: the copy's log ends here.
    pub log_end: u64,
    /// Every segment from `log_start` to `log_end`, in order.
    pub segments: Vec<CutSegment>,
    /// The receipt key file, when this node keeps one (a cluster node derives its key).
    pub receipt_key: Option<PathBuf>,
    /// The data directory, which a backup must not be written into.
    pub data_dir: PathBuf,
    /// When the backup was asked for.
    pub started: Instant,
}

/// What a backup copied, as `POST /v1/admin/backup` answers it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct BackupReport {
    /// The directory the copy is in.
    pub to: String,
    /// Files written (segments and the receipt key).
    pub files: u64,
    /// Bytes copied (the zero tail of the last segment is not written, only sized).
    pub bytes: u64,
    /// Log offset the copy starts at (older segments were reclaimed).
    pub log_start: u64,
    /// Log offset the copy ends at: every change applied before it is in the copy.
    pub log_end: u64,
    /// Time the whole backup took, cut and copy, in milliseconds.
    pub took_ms: u64,
}

/// Copies `cut` into `to`, which must be an absolute path, absent or an empty directory, outside
/// the data directory. On failure, whatever this call created is removed again.
pub fn write(cut: Cut, to: &Path) -> Result<BackupReport> {
    check_target(&cut.data_dir, to)?;
    let created = !to.exists();
    let log_dir = to.join("commitlog");
    claim(to, &log_dir)?;
    match copy_all(&cut, to, &log_dir) {
        Ok((files, bytes)) => Ok(BackupReport {
            to: to.display().to_string(),
            files,
            bytes,
            log_start: cut.log_start,
            log_end: cut.log_end,
            took_ms: cut.started.elapsed().as_millis() as u64,
        }),
        Err(e) => {
            // A part-copied log would start as a shorter one: never leave it behind.
            let _ = std::fs::remove_dir_all(&log_dir);
            let _ = std::fs::remove_file(to.join("receipt_key"));
            if created {
                let _ = std::fs::remove_dir(to);
            }
            Err(e)
        }
    }
}

/// Refuses a target that is relative, not empty, or inside the data directory.
fn check_target(data_dir: &Path, to: &Path) -> Result<()> {
    if !to.is_absolute() {
        return Err(Error::invalid("to", "must be an absolute path on the server's machine"));
    }
    if to.components().any(|c| matches!(c, Component::CurDir | Component::ParentDir)) {
        return Err(Error::invalid("to", "must not contain . or .. components"));
    }
    let data = data_dir.canonicalize().map_err(|e| Error::io_at("resolve", data_dir, e))?;
    if resolve(to)?.starts_with(&data) {
        return Err(Error::invalid(
            "to",
            format!("{} is inside the data directory {}", to.display(), data.display()),
        ));
    }
    match std::fs::read_dir(to).map(|mut entries| entries.next().is_none()) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Conflict(format!(
            "{} is not empty: a backup goes into an absent or empty directory",
            to.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) if to.exists() && !to.is_dir() => {
            Err(Error::Conflict(format!("{} exists and is not a directory", to.display())))
        }
        Err(e) => Err(Error::io_at("list", to, e)),
    }
}

/// `path` with its deepest existing ancestor's symlinks resolved (the rest does not exist yet).
fn resolve(path: &Path) -> Result<PathBuf> {
    let mut existing = path;
    let mut rest = Vec::new();
    while !existing.exists() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => break,
        }
    }
    let mut out = existing.canonicalize().map_err(|e| Error::io_at("resolve", existing, e))?;
    out.extend(rest.iter().rev());
    Ok(out)
}

/// Creates `to` (0700, with missing parents) and `to/commitlog`, which must not exist yet: two
/// backups into the same directory at once cannot both claim it.
fn claim(to: &Path, log_dir: &Path) -> Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(to)
        .map_err(|e| Error::io_at("create", to, e))?;
    match std::fs::DirBuilder::new().mode(0o700).create(log_dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::Conflict(format!(
            "{} is not empty: a backup goes into an absent or empty directory",
            to.display()
        ))),
        Err(e) => Err(Error::io_at("create", log_dir, e)),
    }
}

/// Copies every segment and the receipt key, then makes them and their directories durable;
/// returns the files written and the bytes copied.
fn copy_all(cut: &Cut, to: &Path, log_dir: &Path) -> Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    for seg in &cut.segments {
        bytes += copy_segment(seg, &log_dir.join(segment_name(seg.base)))?;
        files += 1;
    }
    if let Some(key) = &cut.receipt_key {
        match std::fs::read(key) {
            Ok(b) => {
                write_new(&to.join("receipt_key"), &b)?;
                files += 1;
                bytes += b.len() as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io_at("read", key, e)),
        }
    }
    sync_dir(log_dir)?;
    sync_dir(to)?;
    if let Some(parent) = to.parent() {
        sync_dir(parent)?;
    }
    Ok((files, bytes))
}

/// Copies the first `seg.copy` bytes into a new file of `seg.size` bytes (the rest reads as
/// zeros: the end of the log, as recovery expects it) and fsyncs it; returns the bytes copied.
fn copy_segment(seg: &CutSegment, path: &Path) -> Result<u64> {
    let out = create_private(path)?;
    let mut from = (&seg.file).take(seg.copy);
    let copied = std::io::copy(&mut from, &mut &out).map_err(|e| Error::io_at("copy", path, e))?;
    if copied != seg.copy {
        return Err(Error::io_at(
            "copy",
            path,
            std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "segment shorter than the cut"),
        ));
    }
    out.set_len(seg.size).map_err(|e| Error::io_at("resize", path, e))?;
    out.sync_all().map_err(|e| Error::io_at("fsync", path, e))?;
    Ok(copied)
}

/// Writes a new file holding `bytes`, 0600, and fsyncs it.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = create_private(path)?;
    f.write_all(bytes).map_err(|e| Error::io_at("write", path, e))?;
    f.sync_all().map_err(|e| Error::io_at("fsync", path, e))
}

/// Creates `path`, which must not exist, readable and writable by its owner alone.
fn create_private(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io_at("create", path, e))
}

/// fsyncs a directory, so the names made in it survive a power loss.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io_at("fsync", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut_of(data: &Path, content: &[u8], size: u64) -> Cut {
        let seg_path = data.join("seg");
        std::fs::write(&seg_path, content).unwrap();
        let file = File::open(&seg_path).unwrap();
        // Deleted before the copy, as reclaim may: the handle still reads it.
        std::fs::remove_file(&seg_path).unwrap();
        let seg = CutSegment { base: 4096, size, copy: 5, file };
        Cut {
            log_start: 4096,
            log_end: 4101,
            segments: vec![seg],
            receipt_key: None,
            data_dir: data.to_path_buf(),
            started: Instant::now(),
        }
    }

    #[test]
    fn copies_the_prefix_of_a_deleted_segment_at_its_size_zero_past_the_cut() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let to = tmp.path().join("b/c");
        let report = write(cut_of(&data, b"abcdeXYZ", 64), &to).unwrap();
        assert_eq!((report.files, report.bytes, report.log_end), (1, 5, 4101));
        let copy = std::fs::read(to.join("commitlog").join(segment_name(4096))).unwrap();
        let mut want = b"abcde".to_vec();
        want.resize(64, 0);
        assert_eq!(copy, want, "bytes written after the cut are not copied");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&to).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }

    #[test]
    fn refuses_relative_non_empty_and_inside_the_data_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let full = tmp.path().join("full");
        std::fs::create_dir(&full).unwrap();
        std::fs::write(full.join("x"), b"x").unwrap();
        let file = tmp.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let cases = [
            (PathBuf::from("rel/dir"), "invalid to"),
            (tmp.path().join("a/../b"), "invalid to"),
            (data.join("inner"), "inside the data directory"),
            (full.clone(), "is not empty"),
            (file.clone(), "not a directory"),
        ];
        for (to, want) in cases {
            let err = write(cut_of(&data, b"abcde", 8), &to).expect_err("refused");
            assert!(err.to_string().contains(want), "{}: {err}", to.display());
        }
        assert_eq!(std::fs::read_dir(&full).unwrap().count(), 1, "a refused target is left as it was");
    }
}
