//! Consume queues: fixed-size entries pointing into the commit log, in mapped files that each cover
//! a fixed range of entry indexes and are named by the first index of their range.
//!
//! A file starts small and doubles as entries arrive, up to its full range, so a queue holding a
//! few entries costs a few pages of disk, not the full file. Once a file has its full size, its
//! successor is created on a helper thread, so the three fsyncs that make a new file durable are
//! not paid by the engine thread that appends (5–7 ms on a busy disk).

use std::fs;
use std::path::{Path, PathBuf};

use super::commitlog::{list_numbered, segment_name};
use super::durability::Durability;
use super::mmap::{create_durably, sync_dir, sync_path, MadeAhead, MappedFile, SyncFile};
use super::types::{LogOffset, QueueIndex};
use crate::error::{Error, Result};

pub use super::format::entry::{Entry, ENTRY_BYTES};

/// Entries a new queue file is preallocated for: 20,480 bytes, five 4 KiB pages exactly.
pub const INITIAL_FILE_ENTRIES: u64 = 1024;

/// An append-only array of entries with O(1) access by index; files wholly behind the reader are
/// deleted from the front, so entry indexes keep counting from the first entry ever appended.
///
/// File `k` holds entries `[k·per_file, (k+1)·per_file)`. Every file but the last is full; the last
/// may be shorter (it grows by doubling), so an entry's file and position never depend on sizes.
///
/// A queue can be closed (its maps and handles dropped) and reopened: lengths, file counts and the
/// unsynced range stay in memory, so only reading or appending entries needs the files.
pub struct ConsumeQueue {
    dir: PathBuf,
    per_file: u64,
    /// Number (index / per_file) of the first file on disk; files before it were reclaimed.
    first_file: u64,
    /// Files on disk from `first_file` on (`files.len()` while open).
    file_count: u64,
    /// Size of the last file in bytes; every other file is full.
    last_bytes: u64,
    /// The mapped files while open, empty while closed.
    files: Vec<MappedFile>,
    mapped: bool,
    len: u64,
    /// Entries below this are durable or handed to a checkpoint to make durable.
    flushed_len: u64,
    /// The next file (by number), being made on a helper thread.
    next: Option<MadeAhead>,
    /// The store's durability owner, which every sync of the queue's files reports to.
    durability: Durability,
}

impl ConsumeQueue {
    /// Opens the queue in `dir` with `len` entries (from a checkpoint), or counts them when `None`.
    ///
    /// Entries at or past `len` are zeroed: they were written after the checkpoint and the
    /// dispatcher writes them again.
    pub fn open(
        dir: &Path,
        per_file: u64,
        len: Option<u64>,
        durability: &Durability,
    ) -> Result<ConsumeQueue> {
        fs::create_dir_all(dir).map_err(|e| Error::io_at("create", dir, e))?;
        let names = list_numbered(dir)?;
        let mut files = Vec::with_capacity(names.len());
        // Reclaim deletes whole files from the front, so the first may start past entry 0; with no
        // file left, the queue resumes at its checkpointed length.
        let first_file = match names.first() {
            Some(n) => n / per_file,
            None => len.unwrap_or(0) / per_file,
        };
        let full = per_file * ENTRY_BYTES as u64;
        for (i, first) in names.iter().enumerate() {
            let path = dir.join(segment_name(*first));
            let expect = (first_file + i as u64) * per_file;
            let f = MappedFile::open_existing_with_room(&path, full, durability)?;
            // A power loss while growing or creating the last file can leave it at any length it
            // was preallocated to (even 0); its missing or zero tail is unwritten entries.
            let size_ok = if i + 1 == names.len() {
                f.len() <= full && f.len() % ENTRY_BYTES as u64 == 0
            } else {
                f.len() == full
            };
            if *first != expect || !size_ok {
                return Err(Error::Corrupt {
                    file: path.display().to_string(),
                    offset: 0,
                    reason: format!(
                        "consume-queue file should start at entry {expect} and hold {per_file} entries, \
                         or a multiple of 20 bytes up to that if it is the last (was cq_entries_per_file \
                         changed?)"
                    ),
                });
            }
            files.push(f);
        }
        let mut q = ConsumeQueue {
            dir: dir.to_path_buf(),
            per_file,
            first_file,
            file_count: files.len() as u64,
            last_bytes: files.last().map_or(0, |f| f.len()),
            files,
            mapped: true,
            len: 0,
            flushed_len: 0,
            next: None,
            durability: durability.clone(),
        };
        let capacity =
            first_file * per_file + q.files.iter().map(|f| f.len() / ENTRY_BYTES as u64).sum::<u64>();
        let counted = q.count_written(capacity);
        let len = len.unwrap_or(counted).min(capacity).max(first_file * per_file);
        q.len = len;
        q.zero_from(len)?;
        q.flushed_len = len;
        Ok(q)
    }

    /// A new, empty queue in `dir`, closed; nothing is created on disk until the first append.
    pub fn new_closed(dir: &Path, per_file: u64, durability: &Durability) -> ConsumeQueue {
        ConsumeQueue {
            dir: dir.to_path_buf(),
            per_file,
            first_file: 0,
            file_count: 0,
            last_bytes: 0,
            files: Vec::new(),
            mapped: false,
            len: 0,
            flushed_len: 0,
            next: None,
            durability: durability.clone(),
        }
    }

    /// True while the files are mapped.
    pub fn is_open(&self) -> bool {
        self.mapped
    }

    /// Drops the maps and file handles. Unsynced entries stay in the page cache and are synced by
    /// path at the next [`flush`](Self::flush) or [`take_dirty`](Self::take_dirty).
    pub fn close(&mut self) {
        // A helper's handles count as the queue's: only open queues hold any.
        self.next = None;
        self.files.clear();
        self.mapped = false;
    }

    /// Maps the files again after [`close`](Self::close); a no-op while open.
    pub fn reopen(&mut self) -> Result<()> {
        if self.mapped {
            return Ok(());
        }
        let full = self.per_file * ENTRY_BYTES as u64;
        let mut files = Vec::with_capacity(self.file_count as usize);
        for k in 0..self.file_count {
            let f = MappedFile::open_existing_with_room(&self.file_path(self.first_file + k), full, &self.durability)?;
            let want = if k + 1 == self.file_count { self.last_bytes } else { full };
            if f.len() != want {
                return Err(Error::Corrupt {
                    file: f.path().display().to_string(),
                    offset: 0,
                    reason: format!("consume-queue file is {} bytes; it was {want} when closed", f.len()),
                });
            }
            files.push(f);
        }
        self.files = files;
        self.mapped = true;
        Ok(())
    }

    fn file_path(&self, k: u64) -> PathBuf {
        self.dir.join(segment_name(k * self.per_file))
    }

    fn count_written(&self, capacity: u64) -> u64 {
        // Entries are written in order, so the written ones form a prefix: binary search for its end.
        let (mut lo, mut hi) = (self.first_file * self.per_file, capacity);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.raw(mid).is_some_and(|e| e.size != 0) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn zero_from(&mut self, from: u64) -> Result<()> {
        let per_file = self.per_file;
        let first_file = self.first_file;
        for (i, f) in self.files.iter_mut().enumerate() {
            let first = (first_file + i as u64) * per_file;
            let start = (from.saturating_sub(first) as usize * ENTRY_BYTES).min(f.bytes().len());
            if let Some(last) = f.last_nonzero(start) {
                let stop = last + 1;
                f.bytes_mut()[start..stop].fill(0);
                f.flush_range(start, stop - start)?;
            }
        }
        Ok(())
    }

    fn raw(&self, i: u64) -> Option<Entry> {
        debug_assert!(self.mapped, "reading a closed consume queue");
        let f = self.files.get((i / self.per_file).checked_sub(self.first_file)? as usize)?;
        let pos = (i % self.per_file) as usize * ENTRY_BYTES;
        f.bytes().get(pos..pos + ENTRY_BYTES).and_then(|b| b.first_chunk()).map(Entry::from_bytes)
    }

    /// Number of entries.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when no entry was ever appended.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Index the next append gets (one past the last entry).
    pub fn end(&self) -> QueueIndex {
        QueueIndex::new(self.len)
    }

    /// Index of the first entry still on disk.
    pub fn first(&self) -> QueueIndex {
        QueueIndex::new(self.first_index())
    }

    fn first_index(&self) -> u64 {
        self.first_file * self.per_file
    }

    /// Entry `i`, if written and not reclaimed; the queue must be open.
    pub fn get(&self, i: QueueIndex) -> Option<Entry> {
        if i.get() >= self.len {
            return None;
        }
        self.raw(i.get())
    }

    /// The first index at or after `from` whose entry points at or past `offset` (entries point
    /// into the log in increasing order: dispatch appends them in log order); the queue's end
    /// when none does. An entry that cannot be read counts as not passed.
    pub fn first_at_or_past(&self, from: QueueIndex, offset: LogOffset) -> QueueIndex {
        let (mut lo, mut hi) = (from.get().max(self.first_index()), self.len);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.raw(mid) {
                Some(e) if e.offset < offset => lo = mid + 1,
                _ => hi = mid,
            }
        }
        QueueIndex::new(lo.max(from.get()))
    }

    /// Appends an entry and returns its index; reopens the files if closed.
    pub fn append(&mut self, e: Entry) -> Result<QueueIndex> {
        self.prepare_append()?;
        let i = self.len;
        let pos = (i % self.per_file) as usize * ENTRY_BYTES;
        let file = (i / self.per_file - self.first_file) as usize;
        let Some(f) = self.files.get_mut(file) else {
            return Err(Error::Corrupt {
                file: self.dir.display().to_string(),
                offset: i,
                reason: "consume-queue entry past its last file".into(),
            });
        };
        f.write_at(pos, &e.encode());
        self.len += 1;
        Ok(QueueIndex::new(i))
    }

    /// Opens, creates or grows files so that the next [`append`](Self::append) only writes into a
    /// mapping. The store calls it before appending a record, so that running out of disk space or
    /// file handles fails the request before anything changed.
    pub fn prepare_append(&mut self) -> Result<()> {
        self.reopen()?;
        let i = self.len;
        let file = (i / self.per_file - self.first_file) as usize;
        if file == self.files.len() {
            self.add_file(i / self.per_file)?;
        }
        let pos = (i % self.per_file) as usize * ENTRY_BYTES;
        let last = file + 1 == self.files.len();
        if let Some(f) = self.files.get_mut(file) {
            if pos + ENTRY_BYTES > f.len() as usize {
                let entries =
                    grown_entries(f.len() / ENTRY_BYTES as u64, i % self.per_file + 1, self.per_file);
                f.grow(entries * ENTRY_BYTES as u64)?;
                if last {
                    self.last_bytes = f.len();
                }
            }
        }
        self.start_next_file();
        Ok(())
    }

    /// Once the last file has its full size, starts making its successor on a helper thread, as
    /// [`add_file`](Self::add_file) would. A file made but never used is harmless: an empty last
    /// file is a valid queue state on disk.
    fn start_next_file(&mut self) {
        let full = self.per_file * ENTRY_BYTES as u64;
        let k = self.first_file + self.file_count;
        // Only while appends go into a full last file: an empty one (made ahead, or small per_file)
        // may never be reached.
        let appending_into_last = self.len >= (k.saturating_sub(1)) * self.per_file;
        if self.next.is_some()
            || !self.mapped
            || self.file_count == 0
            || self.last_bytes != full
            || !appending_into_last
        {
            return;
        }
        // Opened here, where the file surely exists; reclaim may delete it before the helper runs.
        let Ok(prev) = SyncFile::open(&self.file_path(k - 1), &self.durability) else { return };
        let (path, bytes) = (self.file_path(k), self.new_file_bytes());
        let durability = self.durability.clone();
        self.next = MadeAhead::start("delayd-cq-next", k, move || {
            prev.sync_all()?;
            // One handle at a time (see `create_durably`).
            drop(prev);
            create_durably(&path, bytes, &durability)
        });
    }

    /// Makes file number `k` the last: the one made ahead if its helper succeeded, else made here,
    /// small; the full previous file's size is made durable first, so a power loss never leaves a
    /// short file before a later one.
    fn add_file(&mut self, k: u64) -> Result<()> {
        let path = self.file_path(k);
        if !self.next.take().is_some_and(|next| next.made(k)) {
            match self.files.last() {
                Some(prev) => prev.sync_all()?,
                // The first file of a queue may also be the first thing in its directory.
                None => create_dir_durably(&self.dir, &self.durability)?,
            }
            create_durably(&path, self.new_file_bytes(), &self.durability)?;
        }
        // Mapped with room for its full size: growing it then never remaps it.
        let f = MappedFile::open_existing_with_room(&path, self.per_file * ENTRY_BYTES as u64, &self.durability)?;
        self.last_bytes = f.len();
        self.files.push(f);
        self.file_count += 1;
        Ok(())
    }

    /// Size a new file is made with.
    fn new_file_bytes(&self) -> u64 {
        INITIAL_FILE_ENTRIES.min(self.per_file) * ENTRY_BYTES as u64
    }

    /// Drops entries whose log offset is at or past `log_offset`; returns how many were dropped.
    pub fn truncate_to_offset(&mut self, log_offset: LogOffset) -> Result<u64> {
        self.reopen()?;
        // Entries are appended in log order, so offsets ascend: binary search.
        let (mut lo, mut hi) = (self.first_index(), self.len);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.raw(mid).is_some_and(|e| e.offset < log_offset) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let dropped = self.len - lo;
        if dropped > 0 {
            self.len = lo;
            self.flushed_len = self.flushed_len.min(lo);
            self.zero_from(lo)?;
        }
        Ok(dropped)
    }

    /// Replaces the entries from `from` on with `entries` (repairing a damaged queue from the log);
    /// the rewritten entries are synced at the next checkpoint like any append.
    pub fn rewrite_from(&mut self, from: QueueIndex, entries: &[Entry]) -> Result<()> {
        self.reopen()?;
        let from = from.get().clamp(self.first_index(), self.len);
        self.zero_from(from)?;
        self.len = from;
        self.flushed_len = self.flushed_len.min(from);
        for e in entries {
            self.append(*e)?;
        }
        Ok(())
    }

    /// File numbers holding the entries appended since the last flush or hand-off.
    fn dirty_files(&self) -> std::ops::Range<u64> {
        let (from, to) = (self.flushed_len, self.len);
        if from >= to {
            return 0..0;
        }
        (from / self.per_file).max(self.first_file)..(to - 1) / self.per_file + 1
    }

    /// Makes appended entries durable: msync while open, fdatasync by path while closed.
    pub fn flush(&mut self) -> Result<()> {
        let (from, to) = (self.flushed_len, self.len);
        for k in self.dirty_files() {
            if self.mapped {
                let first = k * self.per_file;
                let a = from.max(first) - first;
                let b = to.min(first + self.per_file) - first;
                self.files[(k - self.first_file) as usize]
                    .flush_range(a as usize * ENTRY_BYTES, (b - a) as usize * ENTRY_BYTES)?;
            } else {
                sync_path(&self.file_path(k), &self.durability)?;
            }
        }
        self.flushed_len = to;
        Ok(())
    }

    /// Paths of the files written since the last flush or [`mark_flushed`](Self::mark_flushed),
    /// for a background fdatasync.
    pub fn dirty_paths(&self, out: &mut Vec<PathBuf>) {
        for k in self.dirty_files() {
            out.push(self.file_path(k));
        }
    }

    /// [`dirty_paths`](Self::dirty_paths), with the caller owning their sync from then on.
    pub fn take_dirty(&mut self, out: &mut Vec<PathBuf>) {
        self.dirty_paths(out);
        self.flushed_len = self.len;
    }

    /// The first `len` entries are durable (a background sync of [`dirty_paths`](Self::dirty_paths)
    /// taken at that length succeeded).
    pub fn mark_flushed(&mut self, len: u64) {
        self.flushed_len = self.flushed_len.max(len.min(self.len));
    }

    /// Deletes the files whose entries all lie before `before` (a durably checkpointed reader
    /// cursor); returns how many. The file that takes the next append is never deleted. Works open
    /// or closed.
    pub fn drop_before(&mut self, before: QueueIndex) -> Result<usize> {
        let before = before.get().min(self.len);
        let mut dropped = 0;
        while self.file_count > 0 && (self.first_file + 1) * self.per_file <= before {
            if self.mapped {
                drop(self.files.remove(0));
            }
            let path = self.file_path(self.first_file);
            super::io::remove_file(&path).map_err(|e| Error::io_at("remove", &path, e))?;
            self.first_file += 1;
            self.file_count -= 1;
            dropped += 1;
        }
        if self.file_count == 0 {
            self.last_bytes = 0;
        }
        if dropped > 0 {
            // Deleted entries need no flush; the flush bookkeeping starts at the first kept one.
            self.flushed_len = self.flushed_len.max(self.first_index());
            sync_dir(&self.dir, &self.durability)?;
        }
        Ok(dropped)
    }

    /// Deletes every file and the directory, for a topic being forgotten; returns how many files
    /// there were. The removal need not be durable: recovery deletes the directory of a topic that
    /// its checkpoint shows emptied or does not list.
    pub fn remove(mut self) -> Result<usize> {
        self.close();
        match super::io::remove_dir_all(&self.dir) {
            Ok(()) => Ok(self.file_count as usize),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(Error::io_at("remove", &self.dir, e)),
        }
    }

    /// Bytes of disk the queue files occupy.
    pub fn disk_bytes(&self) -> u64 {
        match self.file_count {
            0 => 0,
            n => (n - 1) * self.per_file * ENTRY_BYTES as u64 + self.last_bytes,
        }
    }
}

/// Creates `dir` if missing and makes its entry durable in its parent.
fn create_dir_durably(dir: &Path, durability: &Durability) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(dir).map_err(|e| Error::io_at("create", dir, e))?;
    match dir.parent() {
        Some(parent) => sync_dir(parent, durability),
        None => Ok(()),
    }
}

/// The entry count a file of `cur` entries grows to so that it holds `need`: doubling from
/// [`INITIAL_FILE_ENTRIES`], capped at `full`.
fn grown_entries(cur: u64, need: u64, full: u64) -> u64 {
    let mut n = cur.max(INITIAL_FILE_ENTRIES.min(full)).max(1);
    while n < need {
        n = n.saturating_mul(2);
    }
    n.min(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::types::UnixMs;

    /// Opens a queue with an owner of its own.
    fn open(dir: &Path, per_file: u64, len: Option<u64>) -> Result<ConsumeQueue> {
        ConsumeQueue::open(dir, per_file, len, &Durability::new(dir))
    }
    use crate::storage::io::{Fault, Op};

    #[test]
    fn first_at_or_past_finds_the_first_entry_pointing_at_or_past_an_offset() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 4, None).unwrap();
        for k in 0..10u64 {
            q.append(Entry { offset: LogOffset::new(100 * k), size: 10, tag: UnixMs::new(0) }).unwrap();
        }
        let at = |from: u64, offset: u64| q.first_at_or_past(QueueIndex::new(from), LogOffset::new(offset)).get();
        assert_eq!(at(0, 0), 0);
        assert_eq!(at(0, 250), 3, "the first entry at or past 250 is 300's");
        assert_eq!(at(0, 300), 3);
        assert_eq!(at(5, 250), 5, "never before where it starts");
        assert_eq!(at(0, 5_000), 10, "past every entry: the queue's end");
        q.drop_before(QueueIndex::new(8)).unwrap();
        let first = q.first_at_or_past(QueueIndex::new(0), LogOffset::new(0)).get();
        assert_eq!(first, 8, "entries in deleted files count as passed");
    }

    #[test]
    fn the_next_file_is_made_durable_off_the_appending_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        // Every sync the appending thread itself tries fails; only the first file (and the
        // directory) may be synced there, before the fault is in place.
        let mut q = open(&path, 4, None).unwrap();
        q.append(entry(0)).unwrap();
        let _fault = Fault::new(Op::Sync, &path, libc::EIO).on_thread("cq-appender").inject();
        let q = std::thread::Builder::new()
            .name("cq-appender".into())
            .spawn(move || {
                for i in 1..13u64 {
                    assert_eq!(q.append(entry(i)).unwrap(), QueueIndex::new(i));
                }
                q
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(q.get(QueueIndex::new(9)), Some(entry(9)));
        assert_eq!(q.disk_bytes(), 4 * 4 * ENTRY_BYTES as u64);
        drop(q);
        // The file prepared for entries 12.. may stand empty after the last one: a valid queue.
        // Entry 12 filled nothing, but its file was created full (4 entries), so 16 is prepared.
        assert_eq!(list_numbered(&path).unwrap(), vec![0, 4, 8, 12, 16]);
        let q = open(&path, 4, None).unwrap();
        assert_eq!(q.len(), 13);
        assert_eq!(q.get(QueueIndex::new(12)), Some(entry(12)));
    }

    #[test]
    fn a_failed_preparation_poisons_the_store_and_the_append_that_needs_the_file_fails() {
        let dir = tempfile::tempdir().unwrap();
        let fault = Fault::new(Op::Sync, dir.path(), libc::EIO).on_thread("delayd-cq-next").inject();
        let owner = Durability::new(dir.path());
        let mut q = ConsumeQueue::open(dir.path(), 4, None, &owner).unwrap();
        for i in 0..4u64 {
            assert_eq!(q.append(entry(i)).unwrap(), QueueIndex::new(i));
        }
        // The helper making the next file met the failed sync: it reported it to the store's
        // owner, so the append that needs that file is refused, not written into a file whose
        // state is unknown.
        let e = q.append(entry(4)).unwrap_err();
        assert!(fault.failed() >= 1, "the helper's sync failed");
        assert!(owner.is_poisoned(), "{e}");
        assert!(e.to_string().contains("poisoned"), "{e}");
        drop(q);
        drop(fault);
        assert_eq!(open(dir.path(), 4, None).unwrap().len(), 4);
    }

    #[test]
    fn append_get_reopen_truncate() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut q = open(dir.path(), 4, None).unwrap();
            for i in 0..10u64 {
                assert_eq!(
                    q.append(Entry { offset: LogOffset::new(i * 100), size: 10, tag: UnixMs::new(i) })
                        .unwrap(),
                    QueueIndex::new(i)
                );
            }
            q.flush().unwrap();
            assert_eq!(
                q.get(QueueIndex::new(7)),
                Some(Entry { offset: LogOffset::new(700), size: 10, tag: UnixMs::new(7) })
            );
            assert_eq!(q.get(QueueIndex::new(10)), None);
        }
        let mut q = open(dir.path(), 4, None).unwrap();
        assert_eq!(q.len(), 10);
        assert_eq!(q.truncate_to_offset(LogOffset::new(450)).unwrap(), 5);
        assert_eq!(q.len(), 5);
        drop(q);
        let q = open(dir.path(), 4, None).unwrap();
        assert_eq!(q.len(), 5);
        // A checkpointed length below what is on disk zeroes the rest.
        drop(q);
        let q = open(dir.path(), 4, Some(2)).unwrap();
        assert_eq!(q.len(), 2);
        drop(q);
        assert_eq!(open(dir.path(), 4, None).unwrap().len(), 2);
    }

    #[test]
    fn files_behind_the_reader_are_deleted_and_indexes_keep_counting() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 4, None).unwrap();
        for i in 0..10u64 {
            q.append(Entry { offset: LogOffset::new(i * 100), size: 10, tag: UnixMs::new(i) }).unwrap();
        }
        // Entries 0..7 read: only the file of 0..4 is wholly behind.
        assert_eq!(q.drop_before(QueueIndex::new(7)).unwrap(), 1);
        assert_eq!(q.first().get(), 4);
        assert_eq!(q.get(QueueIndex::new(3)), None);
        assert_eq!(
            q.get(QueueIndex::new(4)),
            Some(Entry { offset: LogOffset::new(400), size: 10, tag: UnixMs::new(4) })
        );
        q.flush().unwrap();
        drop(q);
        // File 8 is full, so the one after it was prepared.
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![4, 8, 12]);
        let mut q = open(dir.path(), 4, Some(10)).unwrap();
        assert_eq!((q.first().get(), q.len()), (4, 10));
        assert_eq!(
            q.get(QueueIndex::new(9)),
            Some(Entry { offset: LogOffset::new(900), size: 10, tag: UnixMs::new(9) })
        );
        assert_eq!(q.truncate_to_offset(LogOffset::new(850)).unwrap(), 1);
        // Everything read: all files but the one taking the next append go.
        assert_eq!(q.drop_before(QueueIndex::new(9)).unwrap(), 1);
        assert_eq!(
            q.append(Entry { offset: LogOffset::new(1000), size: 10, tag: UnixMs::new(10) }).unwrap(),
            QueueIndex::new(9)
        );
        assert_eq!(q.drop_before(QueueIndex::new(12)).unwrap(), 0);
        for i in 10..12u64 {
            q.append(Entry { offset: LogOffset::new(i * 100), size: 10, tag: UnixMs::new(i) }).unwrap();
        }
        assert_eq!(q.drop_before(QueueIndex::new(12)).unwrap(), 1);
        // Dropping the queue waits for its helper, which may still be making file 12.
        drop(q);
        // Only the empty file prepared for the next append is left.
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![12]);
        // As if a crash came before its helper created it: with every file gone the checkpointed
        // length alone says where appends resume.
        std::fs::remove_file(dir.path().join(segment_name(12))).unwrap();
        let mut q = open(dir.path(), 4, Some(12)).unwrap();
        assert_eq!((q.first().get(), q.len(), q.get(QueueIndex::new(11))), (12, 12, None));
        assert_eq!(
            q.append(Entry { offset: LogOffset::new(1200), size: 10, tag: UnixMs::new(12) }).unwrap(),
            QueueIndex::new(12)
        );
        assert_eq!(
            q.get(QueueIndex::new(12)),
            Some(Entry { offset: LogOffset::new(1200), size: 10, tag: UnixMs::new(12) })
        );
    }

    #[test]
    fn a_changed_entry_count_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 4, None).unwrap();
        for i in 0..5 {
            q.append(Entry { offset: LogOffset::new(i + 1), size: 1, tag: UnixMs::new(1) }).unwrap();
        }
        drop(q);
        // Files 0 and 4: with 8 per file the second would have to be named 8, with 2 per file the
        // first is too long.
        assert!(matches!(open(dir.path(), 8, None), Err(Error::Corrupt { .. })));
        assert!(matches!(open(dir.path(), 2, None), Err(Error::Corrupt { .. })));
        assert_eq!(open(dir.path(), 4, None).unwrap().len(), 5);
    }

    fn entry(i: u64) -> Entry {
        Entry { offset: LogOffset::new(i * 10 + 1), size: 7, tag: UnixMs::new(i) }
    }

    fn file_sizes(dir: &Path) -> Vec<(u64, u64)> {
        list_numbered(dir)
            .unwrap()
            .into_iter()
            .map(|n| (n, fs::metadata(dir.join(segment_name(n))).unwrap().len()))
            .collect()
    }

    #[test]
    fn files_start_small_and_double_up_to_the_full_range() {
        let dir = tempfile::tempdir().unwrap();
        let per_file = 5000;
        let mut q = open(dir.path(), per_file, None).unwrap();
        let mut sizes = vec![];
        for i in 0..per_file + 1 {
            q.append(entry(i)).unwrap();
            // The files the queue has taken up: the next one, being made ahead on a helper thread,
            // can be seen half-made (0 bytes) until then.
            let used = (q.first_file + q.file_count) * per_file;
            let s: Vec<_> = file_sizes(dir.path()).into_iter().filter(|(n, _)| *n < used).collect();
            if sizes.last() != Some(&s) {
                sizes.push(s);
            }
        }
        let b = ENTRY_BYTES as u64;
        assert_eq!(
            sizes,
            vec![
                vec![(0, 1024 * b)],
                vec![(0, 2048 * b)],
                vec![(0, 4096 * b)],
                vec![(0, 5000 * b)],
                vec![(0, 5000 * b), (5000, 1024 * b)],
            ]
        );
        // Preallocated for real: the blocks are allocated, not a sparse hole.
        use std::os::unix::fs::MetadataExt;
        let meta = fs::metadata(dir.path().join(segment_name(5000))).unwrap();
        assert!(meta.blocks() * 512 >= 1024 * b, "{} blocks", meta.blocks());
        assert_eq!(q.disk_bytes(), 6024 * b);
        for i in 0..per_file + 1 {
            assert_eq!(q.get(QueueIndex::new(i)), Some(entry(i)), "{i}");
        }
        q.flush().unwrap();
        drop(q);
        let q = open(dir.path(), per_file, None).unwrap();
        assert_eq!(q.len(), per_file + 1);
        assert_eq!(q.get(QueueIndex::new(4999)), Some(entry(4999)));
        assert_eq!(q.get(QueueIndex::new(5000)), Some(entry(5000)));
    }

    #[test]
    fn a_partly_grown_file_reopens_and_keeps_growing() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 5000, None).unwrap();
        for i in 0..1500 {
            q.append(entry(i)).unwrap();
        }
        drop(q);
        assert_eq!(file_sizes(dir.path()), vec![(0, 2048 * 20)]);
        let mut q = open(dir.path(), 5000, None).unwrap();
        assert_eq!(q.len(), 1500);
        for i in 1500..3000 {
            q.append(entry(i)).unwrap();
        }
        assert_eq!(file_sizes(dir.path()), vec![(0, 4096 * 20)]);
        drop(q);
        // A checkpointed length inside the grown part zeroes what follows; the size stays.
        let q = open(dir.path(), 5000, Some(2100)).unwrap();
        assert_eq!(
            (q.len(), q.get(QueueIndex::new(2099)), q.get(QueueIndex::new(2100))),
            (2100, Some(entry(2099)), None)
        );
        drop(q);
        assert_eq!(open(dir.path(), 5000, None).unwrap().len(), 2100);
    }

    #[test]
    fn crash_shaped_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 2048, None).unwrap();
        for i in 0..2049 {
            q.append(entry(i)).unwrap();
        }
        drop(q);
        let last = dir.path().join(segment_name(2048));
        let first = dir.path().join(segment_name(0));
        let set_len =
            |p: &Path, len: u64| fs::OpenOptions::new().write(true).open(p).unwrap().set_len(len).unwrap();
        // Grown (preallocated) but never written past the old end: zeros are unwritten entries.
        set_len(&last, 2048 * 20);
        assert_eq!(open(dir.path(), 2048, None).unwrap().len(), 2049);
        // Created but not yet preallocated: a zero-length last file holds nothing and grows again.
        set_len(&last, 0);
        let mut q = open(dir.path(), 2048, None).unwrap();
        assert_eq!(q.len(), 2048);
        assert_eq!(q.append(entry(2048)).unwrap(), QueueIndex::new(2048));
        assert_eq!(q.get(QueueIndex::new(2048)), Some(entry(2048)));
        drop(q);
        assert_eq!(file_sizes(dir.path()), vec![(0, 2048 * 20), (2048, 1024 * 20)]);
        // A last file cut inside an entry, or longer than the full range: damage.
        set_len(&last, 1024 * 20 + 7);
        assert!(matches!(open(dir.path(), 2048, None), Err(Error::Corrupt { .. })));
        set_len(&last, 4096 * 20);
        assert!(matches!(open(dir.path(), 2048, None), Err(Error::Corrupt { .. })));
        set_len(&last, 1024 * 20);
        // A short file before the last one: damage too (the next file is only made once it is full).
        set_len(&first, 1024 * 20);
        assert!(matches!(open(dir.path(), 2048, None), Err(Error::Corrupt { .. })));
    }

    #[test]
    fn a_closed_queue_keeps_its_state_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = ConsumeQueue::new_closed(dir.path(), 4, &Durability::new(dir.path()));
        assert!(!dir.path().exists() || list_numbered(dir.path()).unwrap().is_empty());
        // Appending reopens; the first file creates the directory.
        for i in 0..6 {
            q.append(entry(i)).unwrap();
        }
        assert!(q.is_open());
        let bytes = q.disk_bytes();
        q.close();
        assert!(!q.is_open());
        assert_eq!((q.len(), q.first().get(), q.disk_bytes()), (6, 0, bytes));
        // Unsynced entries written before the close are synced by path.
        let mut dirty = vec![];
        q.take_dirty(&mut dirty);
        assert_eq!(dirty, vec![dir.path().join(segment_name(0)), dir.path().join(segment_name(4))]);
        q.append(entry(6)).unwrap();
        q.close();
        q.flush().unwrap();
        q.take_dirty(&mut dirty);
        assert_eq!(dirty.len(), 2, "flushed while closed: nothing left to hand over");
        // Files behind the reader go while closed, too.
        assert_eq!(q.drop_before(QueueIndex::new(5)).unwrap(), 1);
        // With file 4 full, file 8 was prepared: a closed queue keeps what a helper made.
        q.next = None;
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![4, 8]);
        q.reopen().unwrap();
        assert_eq!(
            (
                q.first().get(),
                q.get(QueueIndex::new(4)),
                q.get(QueueIndex::new(6)),
                q.get(QueueIndex::new(7))
            ),
            (4, Some(entry(4)), Some(entry(6)), None)
        );
        q.close();
        assert_eq!(q.drop_before(QueueIndex::new(8)).unwrap(), 0, "the file taking the next append stays");
        drop(q);
        let q = open(dir.path(), 4, Some(7)).unwrap();
        assert_eq!((q.first().get(), q.len(), q.get(QueueIndex::new(6))), (4, 7, Some(entry(6))));
    }

    #[test]
    fn reopening_a_file_changed_behind_a_closed_queue_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = open(dir.path(), 4096, None).unwrap();
        q.append(entry(0)).unwrap();
        q.close();
        fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(segment_name(0)))
            .unwrap()
            .set_len(40)
            .unwrap();
        assert!(matches!(q.reopen(), Err(Error::Corrupt { .. })));
    }

    #[test]
    fn growth_steps() {
        assert_eq!(grown_entries(0, 1, 300_000), 1024);
        assert_eq!(grown_entries(1024, 1025, 300_000), 2048);
        assert_eq!(grown_entries(1024, 5000, 300_000), 8192);
        assert_eq!(grown_entries(262_144, 262_145, 300_000), 300_000);
        assert_eq!(grown_entries(0, 1, 4), 4);
        assert_eq!(grown_entries(7, 8, 10), 10);
    }
}
