//! The one owner of durability: how far the commit log is known durable, and the store's health.
//!
//! A store registers its data directory here when it opens. Every sync of a file under that
//! directory (fsync, fdatasync, msync, sync_file_range; see [`super::io`]) consults it, whatever
//! thread makes the call: the engine, the flusher, the checkpointer, the warmer or a reclaim
//! deletion. The first failed sync **poisons** the store: the kernel may already have dropped the
//! dirty pages it could not write (and reports a writeback error only once per open file
//! description), so a later sync that succeeds proves nothing about them. From then on every sync
//! is refused without being tried, nothing more is acknowledged, state-changing calls answer
//! 503 with the first failure (operation, file, OS error), and reads keep working.
//!
//! Running out of a resource (disk space, file handles) is not poison: the call that met it fails
//! with 503, the store is marked *in trouble* (not writable, for metrics and logs) and becomes
//! writable again with the next write that succeeds.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tracing::{error, warn};

use crate::error::Error;

/// One failed operation: what was done, to which file, and what the OS said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The operation, e.g. `fdatasync` or `preallocate`.
    pub op: String,
    /// The file or directory.
    pub file: String,
    /// The OS error (or why the call was refused).
    pub error: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.op, self.file, self.error)
    }
}

impl Failure {
    /// A failure from its parts.
    pub fn new(op: impl Into<String>, file: impl Into<String>, error: impl std::fmt::Display) -> Failure {
        Failure { op: op.into(), file: file.into(), error: error.to_string() }
    }

    /// Describes a broker error.
    pub fn from_error(e: &Error) -> Failure {
        match e {
            Error::Io { op, file, source } => {
                Failure::new(op, file.as_ref().map(|f| f.display().to_string()).unwrap_or_default(), source)
            }
            Error::Corrupt { file, offset, reason } => {
                Failure::new("read", format!("{file} at offset {offset}"), reason)
            }
            other => Failure::new("write", "", other),
        }
    }
}

struct Inner {
    /// The data directory as given (file paths are built from it) and canonical.
    dir: PathBuf,
    canon: PathBuf,
    poisoned: AtomicBool,
    poison: Mutex<Option<Failure>>,
    trouble: Mutex<Option<Failure>>,
    log_durable: AtomicU64,
}

/// A cheap, cloneable handle on one store's durability state.
#[derive(Clone)]
pub struct Durability {
    inner: Arc<Inner>,
}

static STORES: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

impl Durability {
    /// Registers the store in `dir`: syncs of files under it report to the returned owner.
    pub fn register(dir: &Path) -> Durability {
        let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let inner = Arc::new(Inner {
            dir: dir.to_path_buf(),
            canon,
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
            trouble: Mutex::new(None),
            log_durable: AtomicU64::new(0),
        });
        let mut stores = STORES.lock().unwrap_or_else(|p| p.into_inner());
        stores.retain(|w| w.strong_count() > 0);
        stores.push(Arc::downgrade(&inner));
        Durability { inner }
    }

    /// The owner of the store holding `path`, if one is open (the newest, if a store was reopened).
    pub fn for_path(path: &Path) -> Option<Durability> {
        let stores = STORES.lock().unwrap_or_else(|p| p.into_inner());
        if stores.is_empty() {
            return None;
        }
        // Store paths are built from the registered directory, so the literal path usually
        // matches; canonicalize only when it does not (a relative data dir).
        let find = |p: &Path| {
            stores
                .iter()
                .rev()
                .filter_map(Weak::upgrade)
                .find(|i| p.starts_with(&i.dir) || p.starts_with(&i.canon))
                .map(|inner| Durability { inner })
        };
        if let Some(d) = find(path) {
            return Some(d);
        }
        let canon = path.canonicalize().ok().or_else(|| path.parent().and_then(|p| p.canonicalize().ok()))?;
        find(&canon)
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// True once a sync failed: nothing more may be acknowledged until a restart.
    pub fn is_poisoned(&self) -> bool {
        self.inner.poisoned.load(Ordering::Acquire)
    }

    /// The failure that poisoned the store.
    pub fn poison_reason(&self) -> Option<Failure> {
        self.inner.poison.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Poisons the store (the first failure is kept and logged once); returns the error callers get.
    pub fn poison(&self, f: Failure) -> Error {
        let mut p = self.inner.poison.lock().unwrap_or_else(|p| p.into_inner());
        if p.is_none() {
            error!(
                op = %f.op, file = %f.file, error = %f.error,
                "store poisoned: a sync failed, so nothing more is acknowledged until a restart"
            );
            *p = Some(f);
            self.inner.poisoned.store(true, Ordering::Release);
        }
        Error::Unavailable(refusal(p.as_ref()))
    }

    /// `Ok` while the store may take writes; the poison, as a 503, once it may not.
    pub fn check(&self) -> Result<(), Error> {
        if !self.is_poisoned() {
            return Ok(());
        }
        let p = self.inner.poison.lock().unwrap_or_else(|p| p.into_inner());
        Err(Error::Unavailable(refusal(p.as_ref())))
    }

    /// Records a failure that a retry may get past (a resource ran out); true if it differs from
    /// the last one recorded (so the caller logs it).
    pub fn note_trouble(&self, f: Failure) -> bool {
        let mut t = self.inner.trouble.lock().unwrap_or_else(|p| p.into_inner());
        let new = t.as_ref() != Some(&f);
        *t = Some(f);
        new
    }

    /// A write went through: the store is writable again (unless poisoned).
    pub fn clear_trouble(&self) {
        let mut t = self.inner.trouble.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = t.take() {
            warn!(op = %f.op, file = %f.file, "store writable again after: {}", f.error);
        }
    }

    /// The resource failure the store is in, if any.
    pub fn trouble(&self) -> Option<Failure> {
        self.inner.trouble.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// True when neither poisoned nor failing for lack of a resource.
    pub fn writable(&self) -> bool {
        !self.is_poisoned() && self.inner.trouble.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Commit-log offset up to which every byte is known durable.
    pub fn log_durable(&self) -> u64 {
        self.inner.log_durable.load(Ordering::Acquire)
    }

    /// The commit log is durable up to `offset` (a sync covering it succeeded).
    pub fn log_synced(&self, offset: u64) {
        self.inner.log_durable.fetch_max(offset, Ordering::AcqRel);
    }
}

fn refusal(p: Option<&Failure>) -> String {
    match p {
        Some(f) => format!("a sync failed earlier ({f}); writes are refused until a restart"),
        None => "writes are refused".into(),
    }
}

/// Syncs commit-log segments for the flusher thread, through file descriptions of its own (a
/// writeback error is reported once per description, so sharing one with another thread could
/// hide it), and records the log offset made durable.
pub struct LogSyncer {
    durability: Durability,
    own: Vec<super::mmap::SyncFile>,
}

impl LogSyncer {
    /// A syncer reporting to `durability`.
    pub fn new(durability: Durability) -> LogSyncer {
        LogSyncer { durability, own: Vec::new() }
    }

    /// fdatasyncs every segment in `paths` (the only ones still written: descriptions of others
    /// are closed, as reclaim may delete them), then records `end` as durable. An error means
    /// nothing up to `end` may be acknowledged: the store is poisoned (a failed sync), or a
    /// file could not be opened (out of handles: nothing is lost, the next sync covers it).
    pub fn sync(&mut self, paths: &[&PathBuf], end: u64) -> Result<(), Error> {
        self.durability.check()?;
        self.own.retain(|f| paths.iter().any(|p| p.as_path() == f.path()));
        for path in paths {
            let at = match self.own.iter().position(|f| f.path() == path.as_path()) {
                Some(i) => i,
                None => match super::mmap::SyncFile::open(path) {
                    Ok(f) => {
                        self.own.push(f);
                        self.own.len() - 1
                    }
                    Err(e) => {
                        self.durability.note_trouble(Failure::from_error(&e));
                        return Err(Error::Unavailable(e.to_string()));
                    }
                },
            };
            if let Err(e) = self.own[at].sync_data() {
                return Err(self.durability.check().err().unwrap_or(Error::Unavailable(e.to_string())));
            }
        }
        // Another thread's sync may have failed meanwhile: nothing is acknowledged after that.
        self.durability.check()?;
        self.durability.log_synced(end);
        Ok(())
    }
}

/// Logs each distinct failure once, then a reminder at most every `every` while it goes on.
pub struct FailureLog {
    last: Option<Failure>,
    repeats: u64,
    reminded: Instant,
    every: Duration,
}

impl FailureLog {
    /// A log that reminds at most every `every`.
    pub fn new(every: Duration) -> FailureLog {
        FailureLog { last: None, repeats: 0, reminded: Instant::now(), every }
    }

    /// Reports `f` from `what` (e.g. "scheduler"): an error line when new, a reminder when due.
    pub fn report(&mut self, what: &str, f: &Failure) {
        if self.last.as_ref() != Some(f) {
            error!(op = %f.op, file = %f.file, error = %f.error, "{what} failed; retrying later");
            self.last = Some(f.clone());
            self.repeats = 0;
            self.reminded = Instant::now();
            return;
        }
        self.repeats += 1;
        if self.reminded.elapsed() >= self.every {
            warn!(op = %f.op, file = %f.file, error = %f.error, repeats = self.repeats, "{what} still failing");
            self.repeats = 0;
            self.reminded = Instant::now();
        }
    }

    /// The failure is over.
    pub fn clear(&mut self) {
        self.last = None;
    }
}

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
        let made = super::io::open(&opts, &tmp)
            .and_then(|f| super::io::preallocate(&f, &tmp, RESERVE_BYTES))
            // Renamed into place only when whole, so a crash never leaves a short reserve.
            .and_then(|()| super::io::rename(&tmp, &self.path));
        if made.is_err() {
            let _ = super::io::remove_file(&tmp);
        }
        made.is_ok()
    }

    /// Deletes the reserve, giving its space to the next write; true if there was one.
    pub fn release(&self) -> bool {
        let released = super::io::remove_file(&self.path).is_ok();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_takes_the_operation_and_the_file_from_the_error_fields() {
        // A two-word operation used to be split at its first space ("read" on "dir /d").
        let e = Error::io_at("read dir", "/data/cq/topic", std::io::Error::from_raw_os_error(24));
        let f = Failure::from_error(&e);
        assert_eq!((f.op.as_str(), f.file.as_str()), ("read dir", "/data/cq/topic"));
        assert!(f.error.contains("os error 24"), "{}", f.error);
        assert_eq!(
            e.to_string(),
            format!("read dir /data/cq/topic: {}", std::io::Error::from_raw_os_error(24))
        );
        let f = Failure::from_error(&Error::io("spawn engine thread", std::io::Error::other("no threads")));
        assert_eq!((f.op.as_str(), f.file.as_str()), ("spawn engine thread", ""));
    }
}
