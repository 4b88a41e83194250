//! The one owner of durability: how far the commit log is known durable, and the store's health.
//!
//! A store makes one owner when it opens and hands a clone to every file it opens: each sync of
//! one of its files (fsync, fdatasync, msync, sync_file_range; see [`super::io`]) goes through
//! it, whatever thread makes the call: the engine, the flusher, the checkpointer, the warmer or a
//! reclaim deletion. Nothing finds it by path: a file is told its owner when it is opened. The first failed sync **poisons** the store: the kernel may already have dropped the
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
use std::sync::{Arc, Mutex};
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
    /// The data directory.
    dir: PathBuf,
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

impl Durability {
    /// The owner of the store in `dir`; the store passes it to every file it opens.
    pub fn new(dir: &Path) -> Durability {
        let inner = Arc::new(Inner {
            dir: dir.to_path_buf(),
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
            trouble: Mutex::new(None),
            log_durable: AtomicU64::new(0),
        });
        Durability { inner }
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
