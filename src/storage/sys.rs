//! The two file system calls `storage::io` makes that std has no wrapper for. Beside the mapped
//! files (`mmap.rs`), the only `unsafe` in the crate; kept apart from `mmap` so that `io`, which
//! `mmap` calls for every file operation, does not call back into it.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::unix::io::AsRawFd;

/// `posix_fallocate(fd, 0, len)`.
pub(super) fn posix_fallocate(file: &File, len: i64) -> std::io::Result<()> {
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    match rc {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// `sync_file_range(fd, offset, len, WAIT_BEFORE | WRITE | WAIT_AFTER)`.
pub(super) fn sync_file_range(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(std::io::Error::other("range too large"));
    };
    let flags =
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: plain syscall on an fd we own.
    let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
