//! Test-only record of what each file held when it was last made durable, so a test can build the
//! disk image a power loss would leave: every byte synced since, and any subset of the rest.
//!
//! Syncs are recorded by inode (a rename keeps what was synced), only for files under a watched
//! directory. Directory operations (create, rename, delete) are taken as durable at once: delayd
//! fsyncs the directory after each one it relies on.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Durable images by (device, inode), per watched root.
type Images = HashMap<(u64, u64), Vec<u8>>;

static WATCHED: Mutex<Vec<(PathBuf, Images)>> = Mutex::new(Vec::new());

/// Starts recording syncs of files under `root` (canonical paths are compared).
pub fn watch(root: &Path) {
    let root = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    WATCHED.lock().unwrap_or_else(|p| p.into_inner()).push((root, HashMap::new()));
}

/// Stops recording under `root`.
pub fn unwatch(root: &Path) {
    let root = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    WATCHED.lock().unwrap_or_else(|p| p.into_inner()).retain(|(r, _)| *r != root);
}

/// What the file `path` (under a watched root) held when last synced; `None` if never synced.
pub fn image(path: &Path) -> Option<Vec<u8>> {
    let meta = std::fs::metadata(path).ok()?;
    let path = path.canonicalize().ok()?;
    let w = WATCHED.lock().unwrap_or_else(|p| p.into_inner());
    let (_, images) = w.iter().find(|(r, _)| path.starts_with(r))?;
    images.get(&(meta.dev(), meta.ino())).cloned()
}

/// Records that `file` was synced (found where its descriptor points now, else at `path`): the
/// whole file, or only `range` (offset, length) of it, as msync of a range does.
pub fn note(file: &File, path: Option<&Path>, range: Option<(u64, u64)>) {
    let mut w = WATCHED.lock().unwrap_or_else(|p| p.into_inner());
    if w.is_empty() {
        return;
    }
    // The descriptor names the file where it is now: a table renamed since it was opened (the id
    // index's next table becomes `ids` while the engine still holds the old name) is synced under
    // its new name. Resolving the name it was opened under missed such syncs, and a power cut
    // then brought back a stale image no real crash can leave.
    let by_fd = {
        use std::os::unix::io::AsRawFd;
        std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
    };
    if by_fd.as_ref().is_some_and(|p| p.to_string_lossy().ends_with(" (deleted)")) {
        return;
    }
    let Some(path) = by_fd.or_else(|| path.and_then(|p| p.canonicalize().ok())) else { return };
    let Some((_, images)) = w.iter_mut().find(|(r, _)| path.starts_with(r)) else { return };
    let Ok(meta) = file.metadata() else { return };
    if meta.is_dir() {
        return;
    }
    let mut now = vec![0u8; meta.len() as usize];
    if file.read_exact_at(&mut now, 0).is_err() {
        // A write-only descriptor (the checkpoint's temp file) cannot be read back: read the same
        // inode by path. Skipping the note instead would leave a stale image that a power cut
        // brings back beside newer files, a disk no real crash can leave.
        let Ok(by_path) = File::open(&path) else {
            // Deleted or renamed since its sync: nothing under this name to record.
            return;
        };
        if by_path.metadata().is_ok_and(|m| (m.dev(), m.ino()) != (meta.dev(), meta.ino())) {
            return;
        }
        if let Err(e) = by_path.read_exact_at(&mut now, 0) {
            panic!("cannot read back synced {}: {e}", path.display());
        }
    }
    let img = images.entry((meta.dev(), meta.ino())).or_default();
    match range {
        None => *img = now,
        Some((off, len)) => {
            // Bytes never synced read as zeroes: what a preallocated file holds on disk.
            img.resize(now.len(), 0);
            let (a, b) = ((off as usize).min(now.len()), ((off + len) as usize).min(now.len()));
            img[a..b].copy_from_slice(&now[a..b]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint is written through a write-only descriptor; before this was handled, its
    /// syncs went unrecorded and a simulated power cut brought back a stale checkpoint.
    #[test]
    fn a_sync_through_a_write_only_descriptor_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        watch(dir.path());
        let path = dir.path().join("checkpoint");
        crate::storage::checkpoint::write_atomic(
            &path,
            b"first",
            &crate::storage::durability::Durability::new(dir.path()),
        )
        .unwrap();
        assert_eq!(image(&path).as_deref(), Some(&b"first"[..]));
        crate::storage::checkpoint::write_atomic(
            &path,
            b"second",
            &crate::storage::durability::Durability::new(dir.path()),
        )
        .unwrap();
        assert_eq!(image(&path).as_deref(), Some(&b"second"[..]));
        unwatch(dir.path());
    }

    /// The id index's next table is renamed over `ids` while the engine still holds it under the
    /// old name; its syncs went unrecorded, and a simulated power cut lost slots a checkpoint had
    /// made durable (a crash no real disk can produce).
    #[test]
    fn a_sync_of_a_file_renamed_since_it_was_opened_is_recorded() {
        let dir = tempfile::tempdir().unwrap();
        watch(dir.path());
        let (old, new) = (dir.path().join("ids.next"), dir.path().join("ids"));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&old).unwrap();
        std::fs::rename(&old, &new).unwrap();
        file.write_all_at(b"slots", 0).unwrap();
        note(&file, Some(&old), None);
        assert_eq!(image(&new).as_deref(), Some(&b"slots"[..]));
        unwatch(dir.path());
    }
}
