//! Writes zeroes into the commit log just ahead of its write position, on a thread of its own.
//!
//! Segments are preallocated with `posix_fallocate`, which on ext4 leaves *unwritten* extents. The
//! first write into such a block makes the fdatasync that commits it also convert the extent, so a
//! sync produce waits for the extent blocks and the inode to be written, one after the other, on
//! top of its data. Measured here with 64 sync writers (`examples/sync_load`): 320-340 µs per
//! flush and 93-96k msgs/s on fallocated segments; 215-245 µs and 116-138k msgs/s on segments whose
//! blocks were written with zeroes beforehand.
//!
//! Zero-writing a whole 1 GiB segment up front would stall the roll for seconds and leave recovery
//! after a crash a gigabyte of zeroes to read (it skips only unwritten extents), so this thread
//! keeps a window of a few chunks ahead of the writer zeroed instead, the way RocketMQ warms the
//! next mapped file before it is needed.
//!
//! The zeroes go through the page cache 4 KiB at a time so that they sit in single-page folios (a
//! larger write would make the kernel cache them as large folios, and every later 100-byte append
//! would dirty, and commit, the whole folio), and they are written back and synced here, so
//! the conversion's metadata is paid on this thread rather than by the next commit.
//!
//! A commit's fdatasync writes back every dirty page of the segment, these zeroes included, and
//! waits for them. So zeroes are dirtied one writeback piece at a time and written back before the
//! next piece is dirtied: a commit meets at most one piece of them. Dirtying a whole chunk first
//! made one commit in every chunk write most of a megabyte of zeroes (seen in a block trace: a
//! 768 KiB write inside a produce's fdatasync, once per 1 MiB of log).
//!
//! Safety of the data: the appender and this thread never write the same bytes. The appender may
//! write below its *guard*; this thread zeroes only pieces at or past the guard; the appender
//! raises its guard with [`Warmer::advance`], which waits if a piece below the new guard is being
//! zeroed at that moment. Everything is under one mutex, taken once per chunk of appends.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tracing::{error, warn};

use super::durability::Durability;
use super::io::{self, sync_range};

/// Zeroes are written in pieces of one page, so the page cache holds them in single-page folios.
const PIECE: usize = 4096;
/// Chunks kept zeroed ahead of the writer's guard.
const AHEAD_CHUNKS: u64 = 8;
/// The largest chunk; smaller segments use a sixteenth of their size.
const MAX_CHUNK: u64 = 1 << 20;
/// Zeroes are dirtied and written back this much at a time (see the module's note).
const WRITEBACK_PIECE: u64 = 128 << 10;

/// A background thread that zero-fills the active segment ahead of the appender.
pub struct Warmer {
    shared: Arc<Shared>,
    chunk: u64,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when the appender moves or a new segment starts.
    work: Condvar,
    /// Signalled when a chunk is finished.
    idle: Condvar,
}

#[derive(Default)]
struct State {
    target: Option<Target>,
    /// File-relative: the appender may write below this; nothing at or past it has been written.
    guard: u64,
    /// File-relative: zeroes are written up to here (at or past `guard`).
    warmed: u64,
    /// File-relative start of the piece being zeroed, in segment `target.base`.
    busy: Option<(u64, u64)>,
    stop: bool,
    /// Bytes of zeroes written so far (for tests and logs).
    zeroed: u64,
    /// Bytes of zeroes in the page cache not yet written back, and the most there ever were (for
    /// tests: a commit's fdatasync would write them).
    unwritten: u64,
    most_unwritten: u64,
}

#[derive(Clone)]
struct Target {
    base: u64,
    len: u64,
    file: Arc<File>,
    path: PathBuf,
}

impl Warmer {
    /// Starts the thread for segments of `segment_bytes`; `None` where they are too small to bother.
    pub fn start(segment_bytes: u64, durability: Durability) -> Option<Warmer> {
        let chunk = (segment_bytes / 16).min(MAX_CHUNK) & !(PIECE as u64 - 1);
        if chunk == 0 {
            return None;
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            idle: Condvar::new(),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("delayd-warmer".into())
                .spawn(move || run(&shared, chunk, &durability))
        };
        match thread {
            Ok(t) => Some(Warmer { shared, chunk, thread: Some(t) }),
            Err(e) => {
                warn!(error = %e, "could not start the commit-log warmer; appends will convert extents");
                None
            }
        }
    }

    /// Points the warmer at the segment the appender now writes (`file`, a description of it of
    /// the warmer's own, open for writing), from file offset `from`; returns the appender's guard.
    pub fn segment(&self, base: u64, len: u64, file: File, path: &Path, from: u64) -> u64 {
        let mut st = self.lock();
        let guard = round_up(from, self.chunk).min(len);
        // A chunk still being zeroed in the previous segment is no concern: nobody writes there now.
        st.target = Some(Target { base, len, file: Arc::new(file), path: path.to_path_buf() });
        st.guard = guard;
        // The chunk right at the guard is next to be entered: zeroing it would only make the
        // appender wait, so the window starts one chunk further.
        st.warmed = guard + self.chunk;
        self.shared.work.notify_one();
        guard
    }

    /// Lets the appender write below `end` (file-relative, in segment `base`); returns the new guard.
    pub fn advance(&self, base: u64, end: u64) -> u64 {
        let mut st = self.lock();
        let guard = round_up(end, self.chunk);
        while matches!(st.busy, Some((b, at)) if b == base && at < guard) {
            st = self.shared.idle.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.guard = st.guard.max(guard);
        self.shared.work.notify_one();
        st.guard
    }

    /// Bytes of zeroes written so far.
    pub fn zeroed_bytes(&self) -> u64 {
        self.lock().zeroed
    }

    /// The most bytes of zeroes that were ever dirty in the page cache at once.
    #[cfg(test)]
    pub fn most_unwritten_bytes(&self) -> u64 {
        self.lock().most_unwritten
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Warmer {
    fn drop(&mut self) {
        self.lock().stop = true;
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn run(shared: &Shared, chunk: u64, durability: &Durability) {
    let zeroes = [0u8; PIECE];
    // The segment last written to, synced once the window is full.
    let mut unsynced: Option<(Arc<File>, PathBuf)> = None;
    loop {
        let (target, at, len) = {
            let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if st.stop {
                    return;
                }
                if let Some(t) = st.target.clone() {
                    let at = st.warmed.max(st.guard);
                    let limit = (st.guard + AHEAD_CHUNKS * chunk).min(t.len & !(PIECE as u64 - 1));
                    if at < limit {
                        st.busy = Some((t.base, at));
                        break (t, at, chunk.min(WRITEBACK_PIECE).min(limit - at));
                    }
                }
                if let Some((f, path)) = unsynced.take() {
                    // Caught up: sync the zeroes' extent conversion here, not in the next commit.
                    drop(st);
                    if let Err(e) = io::sync_data(&f, &path, durability) {
                        // The io layer has poisoned the store: a writeback error is reported once
                        // per open file description, and this one saw it. Zeroing stops too.
                        error!(error = %e, segment = %path.display(), "commit-log warmer fdatasync failed");
                        shared.state.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
                        return;
                    }
                    st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                st = shared.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let result = zero(&target.file, &target.path, at, len, &zeroes);
        {
            let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.busy = None;
            if result.is_ok() {
                st.zeroed += len;
                st.unwritten += len;
                st.most_unwritten = st.most_unwritten.max(st.unwritten);
                if st.target.as_ref().is_some_and(|t| t.base == target.base) {
                    st.warmed = st.warmed.max(at + len);
                }
            }
        }
        shared.idle.notify_all();
        // The zeroes are in the page cache, so the appender may already write over them; what
        // remains is to write them back before a commit finds them dirty and writes them itself
        // (see the module's note), and before the next piece is dirtied.
        let result = result.and_then(|()| sync_range(&target.file, &target.path, at, len, durability));
        if result.is_ok() {
            let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
            st.unwritten = st.unwritten.saturating_sub(len);
        }
        match result {
            Ok(()) => unsynced = Some((target.file.clone(), target.path.clone())),
            Err(e) => {
                // Only speed is at stake: appends work the same on unwritten extents. (A failed
                // sync_file_range has poisoned the store in the io layer; a failed write has not:
                // it only wrote zeroes where nothing was written yet.)
                warn!(error = %e, segment = %target.path.display(), "commit-log warmer stopped");
                shared.state.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
                return;
            }
        }
    }
}

/// Writes zeroes over `[at, at + len)` through the page cache, one page per write.
fn zero(f: &File, path: &Path, at: u64, len: u64, zeroes: &[u8]) -> std::io::Result<()> {
    let mut pos = at;
    while pos < at + len {
        let n = (at + len - pos).min(PIECE as u64) as usize;
        io::write_all_at(f, path, &zeroes[..n], pos)?;
        pos += n as u64;
    }
    Ok(())
}
