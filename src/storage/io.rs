//! The file operations the store's durability depends on, with a fault-injection hook.
//!
//! Every open, preallocation, positioned write, sync (fsync, fdatasync, msync, sync_file_range),
//! rename and directory listing of the store goes through this module, so a test can make the
//! Nth matching call fail with a chosen errno, write only part of its bytes, or wait at a gate.
//!
//! Faults are registered process-wide but match only paths under a directory the test names (its
//! own temp dir), so tests running in parallel in one process never see each other's faults. The
//! hook (`Fault`, `FaultGuard`) is built only for the crate's own tests and with the `internals`
//! feature: a default build has none and every call goes straight through; with it and no fault
//! registered, each call costs one relaxed atomic load. Either way nothing here changes what a
//! real call does. (A `FileSystem` trait object threaded through every constructor, as
//! raft-engine does, would touch every file that opens a file; matching by directory gives the
//! same reach with no signature changes.)

use std::fs::{File, OpenOptions, ReadDir};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
#[cfg(any(test, feature = "internals"))]
use std::path::PathBuf;
#[cfg(any(test, feature = "internals"))]
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(any(test, feature = "internals"))]
use std::sync::{Arc, Condvar, Mutex};

use super::durability::{Durability, Failure};

/// The kinds of call a fault can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Opening or creating a file, opening a directory, listing a directory.
    Open,
    /// `posix_fallocate`.
    Preallocate,
    /// A positioned or sequential write through a file handle (not through a mapping).
    Write,
    /// fsync, fdatasync, msync or sync_file_range.
    Sync,
    /// A rename.
    Rename,
    /// Removing a file or a directory tree.
    Remove,
}

/// What one registered fault does.
#[cfg(any(test, feature = "internals"))]
#[derive(Debug, Clone)]
pub struct Fault {
    /// The call kind it matches.
    pub op: Op,
    /// Only paths under this directory match.
    pub under: PathBuf,
    /// When set, only paths whose text contains this match.
    pub path_contains: Option<String>,
    /// When set, only calls made on the thread of this name match.
    pub thread: Option<String>,
    /// Matching calls to let through before the first failure.
    pub skip: u64,
    /// How many matching calls fail after the skipped ones; `u64::MAX` for all of them.
    pub times: u64,
    /// The OS error a failing call returns.
    pub errno: i32,
    /// For writes and preallocations: do half of the work before failing (a short write).
    pub short: bool,
}

#[cfg(any(test, feature = "internals"))]
impl Fault {
    /// A fault failing every `op` under `under` with `errno`, from the first call on.
    pub fn new(op: Op, under: &Path, errno: i32) -> Fault {
        Fault {
            op,
            under: under.to_path_buf(),
            path_contains: None,
            thread: None,
            skip: 0,
            times: u64::MAX,
            errno,
            short: false,
        }
    }

    /// Only paths containing `s`.
    pub fn path_contains(mut self, s: &str) -> Fault {
        self.path_contains = Some(s.to_string());
        self
    }

    /// Only calls made on the thread named `name`.
    pub fn on_thread(mut self, name: &str) -> Fault {
        self.thread = Some(name.to_string());
        self
    }

    /// Lets `n` matching calls through first, so the (n+1)th fails.
    pub fn skip(mut self, n: u64) -> Fault {
        self.skip = n;
        self
    }

    /// Fails `n` calls, then lets the rest through.
    pub fn times(mut self, n: u64) -> Fault {
        self.times = n;
        self
    }

    /// Writes or preallocates half before failing.
    pub fn short(mut self) -> Fault {
        self.short = true;
        self
    }

    /// Registers the fault; it is active until the guard is dropped.
    pub fn inject(self) -> FaultGuard {
        let rule = Arc::new(Rule {
            fault: self,
            seen: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            gate: Gate::default(),
        });
        let mut rules = RULES.lock().unwrap_or_else(|p| p.into_inner());
        rules.push(rule.clone());
        ACTIVE.store(rules.len(), Ordering::Release);
        FaultGuard { rule }
    }

    /// Registers the fault with its failing calls held at a gate until [`FaultGuard::release`].
    pub fn inject_gated(self) -> FaultGuard {
        let g = self.inject();
        g.rule.gate.closed.store(true, Ordering::Release);
        g
    }
}

#[cfg(any(test, feature = "internals"))]
#[derive(Default)]
struct Gate {
    closed: AtomicBool,
    lock: Mutex<()>,
    open: Condvar,
}

#[cfg(any(test, feature = "internals"))]
struct Rule {
    fault: Fault,
    /// Matching calls seen.
    seen: AtomicU64,
    /// Calls failed.
    failed: AtomicU64,
    gate: Gate,
}

/// Keeps a fault registered; dropping it removes the fault (and opens its gate).
#[cfg(any(test, feature = "internals"))]
pub struct FaultGuard {
    rule: Arc<Rule>,
}

#[cfg(any(test, feature = "internals"))]
impl FaultGuard {
    /// Calls that failed because of this fault so far.
    pub fn failed(&self) -> u64 {
        self.rule.failed.load(Ordering::Acquire)
    }

    /// Matching calls seen so far (failed or let through).
    pub fn seen(&self) -> u64 {
        self.rule.seen.load(Ordering::Acquire)
    }

    /// Lets calls waiting at the gate go on (and fail).
    pub fn release(&self) {
        let _l = self.rule.gate.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.rule.gate.closed.store(false, Ordering::Release);
        self.rule.gate.open.notify_all();
    }
}

#[cfg(any(test, feature = "internals"))]
impl Drop for FaultGuard {
    fn drop(&mut self) {
        self.release();
        let mut rules = RULES.lock().unwrap_or_else(|p| p.into_inner());
        rules.retain(|r| !Arc::ptr_eq(r, &self.rule));
        ACTIVE.store(rules.len(), Ordering::Release);
    }
}

#[cfg(any(test, feature = "internals"))]
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
#[cfg(any(test, feature = "internals"))]
static RULES: Mutex<Vec<Arc<Rule>>> = Mutex::new(Vec::new());

/// What an injected fault asks of the call.
#[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
enum Injected {
    Fail(io::Error),
    Short(io::Error),
}

#[cfg(any(test, feature = "internals"))]
fn injected(op: Op, path: &Path) -> Option<Injected> {
    if ACTIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let rule = {
        let rules = RULES.lock().unwrap_or_else(|p| p.into_inner());
        let thread = std::thread::current();
        rules
            .iter()
            .find(|r| {
                let f = &r.fault;
                f.op == op
                    && path.starts_with(&f.under)
                    && f.path_contains.as_ref().is_none_or(|s| path.to_string_lossy().contains(s.as_str()))
                    && f.thread.as_ref().is_none_or(|t| thread.name() == Some(t.as_str()))
            })
            .cloned()?
    };
    let n = rule.seen.fetch_add(1, Ordering::AcqRel);
    let f = &rule.fault;
    if n < f.skip || n - f.skip >= f.times {
        return None;
    }
    rule.failed.fetch_add(1, Ordering::AcqRel);
    let mut l = rule.gate.lock.lock().unwrap_or_else(|p| p.into_inner());
    while rule.gate.closed.load(Ordering::Acquire) {
        l = rule.gate.open.wait(l).unwrap_or_else(|p| p.into_inner());
    }
    let e = io::Error::from_raw_os_error(f.errno);
    Some(if f.short { Injected::Short(e) } else { Injected::Fail(e) })
}

/// Without the hooks built in, no call is failed.
#[cfg(not(any(test, feature = "internals")))]
#[inline(always)]
fn injected(_op: Op, _path: &Path) -> Option<Injected> {
    None
}

fn fail_if_injected(op: Op, path: &Path) -> io::Result<()> {
    match injected(op, path) {
        Some(Injected::Fail(e) | Injected::Short(e)) => Err(e),
        None => Ok(()),
    }
}

/// Opens `path` with `opts`.
pub fn open(opts: &OpenOptions, path: &Path) -> io::Result<File> {
    fail_if_injected(Op::Open, path)?;
    opts.open(path)
}

/// Narrows an existing file that holds secrets (`what`) to 0600 when other users may read or
/// write it (made by an older delayd under the umask, or copied in), saying so. A file it cannot
/// narrow is left as it is, with a warning: the broker still runs.
pub fn keep_private(path: &Path, what: &str) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(path) else { return };
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 == 0 {
        return;
    }
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        Ok(()) => tracing::warn!(
            file = %path.display(),
            was = format!("{mode:04o}"),
            "{what} was open to other users; narrowed to 0600"
        ),
        Err(e) => tracing::warn!(
            file = %path.display(),
            mode = format!("{mode:04o}"),
            "{what} is open to other users and cannot be narrowed to 0600: {e}"
        ),
    }
}

/// Creates the data directory (and missing parents) readable by its owner alone, whatever the
/// umask: the log holds push subscriptions' secrets and the directory the receipt key. A directory
/// that already exists keeps its mode (the operator chose it), with a warning when others can
/// read it.
pub fn create_private_dir(dir: &Path) -> crate::error::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let existed = dir.is_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| crate::error::Error::io_at("create", dir, e))?;
    if existed {
        if let Ok(meta) = std::fs::metadata(dir) {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    dir = %dir.display(),
                    mode = format!("{mode:04o}"),
                    "the data directory is open to other users; it holds push secrets and the receipt key: chmod 700 it"
                );
            }
        }
    }
    Ok(())
}

/// Lists a directory.
pub fn read_dir(path: &Path) -> io::Result<ReadDir> {
    fail_if_injected(Op::Open, path)?;
    std::fs::read_dir(path)
}

/// Allocates `[0, len)` of `file` for real (`posix_fallocate`), so writes through a mapping never
/// meet a hole; where the filesystem cannot, the file is extended sparse instead.
pub fn preallocate(file: &File, path: &Path, len: u64) -> io::Result<()> {
    let len = i64::try_from(len).map_err(|_| io::Error::other("file too large"))?;
    match injected(Op::Preallocate, path) {
        Some(Injected::Fail(e)) => return Err(e),
        Some(Injected::Short(e)) => {
            let _ = fallocate(file, len / 2);
            return Err(e);
        }
        None => {}
    }
    match fallocate(file, len) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate (tmpfs on old kernels, some overlays): fall back to
        // set_len, accepting a sparse file there.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
            file.set_len(len as u64)
        }
        Err(e) => Err(e),
    }
}

fn fallocate(file: &File, len: i64) -> io::Result<()> {
    super::sys::posix_fallocate(file, len)
}

/// Writes all of `data` at `offset`.
pub fn write_all_at(file: &File, path: &Path, data: &[u8], offset: u64) -> io::Result<()> {
    match injected(Op::Write, path) {
        Some(Injected::Fail(e)) => Err(e),
        Some(Injected::Short(e)) => {
            file.write_all_at(&data[..data.len() / 2], offset)?;
            Err(e)
        }
        None => file.write_all_at(data, offset),
    }
}

/// Runs a sync of `path` under its store's durability owner: refused without being tried once the
/// store is poisoned, and poisoning it when it fails.
fn guarded(
    op: &str,
    path: &Path,
    owner: &Durability,
    call: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    if let Some(f) = owner.poison_reason() {
        return Err(io::Error::other(format!("not tried: the store was poisoned by {f}")));
    }
    let r = fail_if_injected(Op::Sync, path).and_then(|()| call());
    if let Err(e) = &r {
        owner.poison(Failure::new(op, path.display().to_string(), e));
    }
    r
}

/// fdatasync.
pub fn sync_data(file: &File, path: &Path, owner: &Durability) -> io::Result<()> {
    guarded("fdatasync", path, owner, || file.sync_data())?;
    #[cfg(test)]
    super::synced::note(file, Some(path), None);
    Ok(())
}

/// fsync (data and metadata).
pub fn sync_all(file: &File, path: &Path, owner: &Durability) -> io::Result<()> {
    guarded("fsync", path, owner, || file.sync_all())?;
    #[cfg(test)]
    super::synced::note(file, Some(path), None);
    Ok(())
}

/// msync(MS_SYNC) of part of a mapping.
pub fn msync(
    map: &memmap2::MmapMut,
    path: &Path,
    offset: usize,
    len: usize,
    owner: &Durability,
) -> io::Result<()> {
    guarded("msync", path, owner, || map.flush_range(offset, len))
}

/// Writes back `[offset, offset + len)` of `file` and waits for it (sync_file_range): data only,
/// no metadata and no cache flush, so it makes nothing durable by itself, but it does report (and
/// consume) a writeback error, so it counts as a sync.
pub fn sync_range(file: &File, path: &Path, offset: u64, len: u64, owner: &Durability) -> io::Result<()> {
    guarded("sync_file_range", path, owner, || super::sys::sync_file_range(file, offset, len))
}

/// Renames `from` to `to`.
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    fail_if_injected(Op::Rename, from)?;
    std::fs::rename(from, to)
}

/// Removes the file `path`.
pub fn remove_file(path: &Path) -> io::Result<()> {
    fail_if_injected(Op::Remove, path)?;
    std::fs::remove_file(path)
}

/// Removes the directory `path` and everything under it.
pub fn remove_dir_all(path: &Path) -> io::Result<()> {
    fail_if_injected(Op::Remove, path)?;
    std::fs::remove_dir_all(path)
}

/// True for errors that say a resource ran out (disk space, quota, file handles, memory for a
/// mapping) rather than that the disk failed: the call may succeed once the cause is gone.
pub fn is_resource_exhausted(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC | libc::EDQUOT | libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fails_only_the_chosen_calls_under_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let g = Fault::new(Op::Sync, dir.path(), libc::EIO).skip(1).times(2).inject();
        let p = dir.path().join("f");
        let f = File::create(&p).unwrap();
        let q = other.path().join("f");
        let fq = File::create(&q).unwrap();
        // A fresh owner each call: this test is about which calls the fault hits, not poison.
        let d = || Durability::new(dir.path());
        assert!(sync_data(&fq, &q, &d()).is_ok(), "another directory is untouched");
        assert!(sync_data(&f, &p, &d()).is_ok(), "the first call is skipped");
        assert_eq!(sync_data(&f, &p, &d()).unwrap_err().raw_os_error(), Some(libc::EIO));
        assert_eq!(sync_all(&f, &p, &d()).unwrap_err().raw_os_error(), Some(libc::EIO));
        assert!(sync_data(&f, &p, &d()).is_ok(), "only two calls fail");
        assert_eq!(g.failed(), 2);
        drop(g);
        assert!(sync_data(&f, &p, &d()).is_ok());
    }

    #[test]
    fn a_short_write_writes_half_and_fails() {
        let dir = tempfile::tempdir().unwrap();
        let _g = Fault::new(Op::Write, dir.path(), libc::ENOSPC).short().times(1).inject();
        let p = dir.path().join("f");
        let f = File::create(&p).unwrap();
        let e = write_all_at(&f, &p, &[7u8; 100], 0).unwrap_err();
        assert!(is_resource_exhausted(&e));
        assert_eq!(std::fs::read(&p).unwrap(), vec![7u8; 50]);
    }
}
