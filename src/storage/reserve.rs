//! The reserve file: disk space held back so that a full disk can recover.

use std::path::{Path, PathBuf};

use tracing::warn;

use super::io;
use crate::error::Error;

/// Name of the reserve file in the data directory.
pub const RESERVE_FILE: &str = "reserve";
/// Size of the reserve file: room for many checkpoints, a clean-shutdown marker and the growth of
/// a few consume-queue files when the disk is otherwise full.
pub const RESERVE_BYTES: u64 = 4 << 20;

/// A preallocated file of zeroes that holds disk space back for the writes that let a full disk
/// recover (checkpoints, a clean shutdown, queue entries of acks and deliveries): it is deleted
/// when one of them meets a full disk, and made again once there is room.
#[derive(Debug, Clone)]
pub struct Reserve {
    path: PathBuf,
}

impl Reserve {
    /// The reserve of the data directory `dir` (not created yet).
    pub fn new(dir: &Path) -> Reserve {
        Reserve { path: dir.join(RESERVE_FILE) }
    }

    /// True when the reserve file exists.
    pub fn is_held(&self) -> bool {
        self.path.exists()
    }

    /// Creates the reserve if it is missing; false when there is no room for it (then no partial
    /// file is left behind).
    pub fn ensure(&self) -> bool {
        if self.is_held() {
            return true;
        }
        let tmp = self.path.with_extension("new");
        let opts = std::fs::OpenOptions::new().write(true).create(true).truncate(true).clone();
        let made = io::open(&opts, &tmp)
            .and_then(|f| io::preallocate(&f, &tmp, RESERVE_BYTES))
            // Renamed into place only when whole, so a crash never leaves a short reserve.
            .and_then(|()| io::rename(&tmp, &self.path));
        if made.is_err() {
            let _ = io::remove_file(&tmp);
        }
        made.is_ok()
    }

    /// Deletes the reserve, giving its space to the next write; true if there was one.
    pub fn release(&self) -> bool {
        let released = io::remove_file(&self.path).is_ok();
        if released {
            warn!(file = %self.path.display(), bytes = RESERVE_BYTES, "disk full: released the reserve");
        }
        released
    }

    /// Runs `f`; when it fails for lack of disk space and the reserve is held, releases the
    /// reserve and runs `f` once more.
    pub fn retry_on_full_disk<T>(&self, mut f: impl FnMut() -> Result<T, Error>) -> Result<T, Error> {
        match f() {
            Err(Error::Io { op, file, source }) if is_disk_full(&source) => {
                if self.release() {
                    f()
                } else {
                    Err(Error::Io { op, file, source })
                }
            }
            r => r,
        }
    }
}

/// True for ENOSPC and EDQUOT.
pub fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}
