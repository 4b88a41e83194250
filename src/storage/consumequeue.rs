//! Consume queues: fixed-size entries pointing into the commit log, in mapped files of a fixed entry
//! count named by the index of their first entry.

use std::fs;
use std::path::{Path, PathBuf};

use super::commitlog::{list_numbered, segment_name};
use super::mmap::{sync_dir, MappedFile};
use crate::error::{Error, Result};

/// Bytes per entry: log offset u64, record size u32, tag u64.
pub const ENTRY_BYTES: usize = 20;

/// One consume-queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Commit-log offset of the record.
    pub offset: u64,
    /// Size of that record in bytes; never zero for a written entry.
    pub size: u32,
    /// Level queues: the due time in unix ms. Topic queues: the time the message became due.
    pub tag: u64,
}

impl Entry {
    fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b[12..20].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Entry {
        let mut o = [0u8; 8];
        o.copy_from_slice(&b[0..8]);
        let mut s = [0u8; 4];
        s.copy_from_slice(&b[8..12]);
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[12..20]);
        Entry { offset: u64::from_le_bytes(o), size: u32::from_le_bytes(s), tag: u64::from_le_bytes(t) }
    }
}

/// An append-only array of entries with O(1) access by index; files wholly behind the reader are
/// deleted from the front, so entry indexes keep counting from the first entry ever appended.
pub struct ConsumeQueue {
    dir: PathBuf,
    per_file: u64,
    /// Number (index / per_file) of `files[0]`; files before it were reclaimed.
    first_file: u64,
    files: Vec<MappedFile>,
    len: u64,
    flushed_len: u64,
}

impl ConsumeQueue {
    /// Opens the queue in `dir` with `len` entries (from a checkpoint), or counts them when `None`.
    ///
    /// Entries at or past `len` are zeroed: they were written after the checkpoint and the
    /// dispatcher writes them again.
    pub fn open(dir: &Path, per_file: u64, len: Option<u64>) -> Result<ConsumeQueue> {
        fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let names = list_numbered(dir)?;
        let mut files = Vec::with_capacity(names.len());
        // Reclaim deletes whole files from the front, so the first may start past entry 0; with no
        // file left, the queue resumes at its checkpointed length.
        let first_file = match names.first() {
            Some(n) => n / per_file,
            None => len.unwrap_or(0) / per_file,
        };
        for (i, first) in names.iter().enumerate() {
            let path = dir.join(segment_name(*first));
            let expect = (first_file + i as u64) * per_file;
            let f = MappedFile::open_existing(&path)?;
            if *first != expect || f.len() != per_file * ENTRY_BYTES as u64 {
                return Err(Error::Corrupt {
                    file: path.display().to_string(),
                    offset: 0,
                    reason: format!(
                        "consume-queue file should start at entry {expect} and hold {per_file} entries \
                         (was cq_entries_per_file changed?)"
                    ),
                });
            }
            files.push(f);
        }
        let mut q =
            ConsumeQueue { dir: dir.to_path_buf(), per_file, first_file, files, len: 0, flushed_len: 0 };
        let capacity = (first_file + q.files.len() as u64) * per_file;
        let counted = q.count_written(capacity);
        let len = len.unwrap_or(counted).min(capacity).max(first_file * per_file);
        q.len = len;
        q.zero_from(len)?;
        q.flushed_len = len;
        Ok(q)
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
            let start = from.saturating_sub(first).min(per_file) as usize * ENTRY_BYTES;
            if let Some(last) = f.last_nonzero(start) {
                let stop = last + 1;
                f.bytes_mut()[start..stop].fill(0);
                f.flush_range(start, stop - start)?;
            }
        }
        Ok(())
    }

    fn raw(&self, i: u64) -> Option<Entry> {
        let f = self.files.get((i / self.per_file).checked_sub(self.first_file)? as usize)?;
        let pos = (i % self.per_file) as usize * ENTRY_BYTES;
        Some(Entry::decode(&f.bytes()[pos..pos + ENTRY_BYTES]))
    }

    /// Number of entries.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when no entry was ever appended.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Index of the first entry still on disk.
    pub fn first(&self) -> u64 {
        self.first_file * self.per_file
    }

    /// Entry `i`, if written and not reclaimed.
    pub fn get(&self, i: u64) -> Option<Entry> {
        if i >= self.len {
            return None;
        }
        self.raw(i)
    }

    /// Appends an entry and returns its index.
    pub fn append(&mut self, e: Entry) -> Result<u64> {
        let i = self.len;
        let file = (i / self.per_file - self.first_file) as usize;
        if file == self.files.len() {
            let path = self.dir.join(segment_name(i));
            let f = MappedFile::open(&path, self.per_file * ENTRY_BYTES as u64)?;
            f.sync_all()?;
            sync_dir(&self.dir)?;
            self.files.push(f);
        }
        let pos = (i % self.per_file) as usize * ENTRY_BYTES;
        self.files[file].write_at(pos, &e.encode());
        self.len += 1;
        Ok(i)
    }

    /// Drops entries whose log offset is at or past `log_offset`; returns how many were dropped.
    pub fn truncate_to_offset(&mut self, log_offset: u64) -> Result<u64> {
        // Entries are appended in log order, so offsets ascend: binary search.
        let (mut lo, mut hi) = (self.first(), self.len);
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

    /// Makes appended entries durable.
    pub fn flush(&mut self) -> Result<()> {
        let (from, to) = (self.flushed_len, self.len);
        if from >= to {
            return Ok(());
        }
        for i in (from / self.per_file)..=((to - 1) / self.per_file) {
            let first = i * self.per_file;
            let a = from.max(first) - first;
            let b = to.min(first + self.per_file) - first;
            self.files[(i - self.first_file) as usize]
                .flush_range(a as usize * ENTRY_BYTES, (b - a) as usize * ENTRY_BYTES)?;
        }
        self.flushed_len = to;
        Ok(())
    }

    /// Handles on the files written since the last flush or call, for a background fdatasync;
    /// the caller owns making them durable from then on.
    pub fn take_dirty_handles(&mut self, out: &mut Vec<std::fs::File>) -> Result<()> {
        let (from, to) = (self.flushed_len, self.len);
        if from < to {
            for i in (from / self.per_file)..=((to - 1) / self.per_file) {
                out.push(self.files[(i - self.first_file) as usize].handle()?);
            }
        }
        self.flushed_len = to;
        Ok(())
    }

    /// Deletes the files whose entries all lie before `before` (a durably checkpointed reader
    /// cursor); returns how many. The file that takes the next append is never deleted.
    pub fn drop_before(&mut self, before: u64) -> Result<usize> {
        let before = before.min(self.len);
        let mut dropped = 0;
        while !self.files.is_empty() && (self.first_file + 1) * self.per_file <= before {
            let f = self.files.remove(0);
            let path = f.path().to_path_buf();
            drop(f);
            fs::remove_file(&path).map_err(|e| Error::io(format!("remove {}", path.display()), e))?;
            self.first_file += 1;
            dropped += 1;
        }
        if dropped > 0 {
            // Deleted entries need no flush; the flush bookkeeping starts at the first kept one.
            self.flushed_len = self.flushed_len.max(self.first());
            sync_dir(&self.dir)?;
        }
        Ok(dropped)
    }

    /// Bytes of disk the queue files occupy.
    pub fn disk_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_get_reopen_truncate() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut q = ConsumeQueue::open(dir.path(), 4, None).unwrap();
            for i in 0..10u64 {
                assert_eq!(q.append(Entry { offset: i * 100, size: 10, tag: i }).unwrap(), i);
            }
            q.flush().unwrap();
            assert_eq!(q.get(7), Some(Entry { offset: 700, size: 10, tag: 7 }));
            assert_eq!(q.get(10), None);
        }
        let mut q = ConsumeQueue::open(dir.path(), 4, None).unwrap();
        assert_eq!(q.len(), 10);
        assert_eq!(q.truncate_to_offset(450).unwrap(), 5);
        assert_eq!(q.len(), 5);
        drop(q);
        let q = ConsumeQueue::open(dir.path(), 4, None).unwrap();
        assert_eq!(q.len(), 5);
        // A checkpointed length below what is on disk zeroes the rest.
        drop(q);
        let q = ConsumeQueue::open(dir.path(), 4, Some(2)).unwrap();
        assert_eq!(q.len(), 2);
        drop(q);
        assert_eq!(ConsumeQueue::open(dir.path(), 4, None).unwrap().len(), 2);
    }

    #[test]
    fn files_behind_the_reader_are_deleted_and_indexes_keep_counting() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = ConsumeQueue::open(dir.path(), 4, None).unwrap();
        for i in 0..10u64 {
            q.append(Entry { offset: i * 100, size: 10, tag: i }).unwrap();
        }
        // Entries 0..7 read: only the file of 0..4 is wholly behind.
        assert_eq!(q.drop_before(7).unwrap(), 1);
        assert_eq!(q.first(), 4);
        assert_eq!(q.get(3), None);
        assert_eq!(q.get(4), Some(Entry { offset: 400, size: 10, tag: 4 }));
        q.flush().unwrap();
        drop(q);
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![4, 8]);
        let mut q = ConsumeQueue::open(dir.path(), 4, Some(10)).unwrap();
        assert_eq!((q.first(), q.len()), (4, 10));
        assert_eq!(q.get(9), Some(Entry { offset: 900, size: 10, tag: 9 }));
        assert_eq!(q.truncate_to_offset(850).unwrap(), 1);
        // Everything read: all files but the one taking the next append go.
        assert_eq!(q.drop_before(9).unwrap(), 1);
        assert_eq!(q.append(Entry { offset: 1000, size: 10, tag: 10 }).unwrap(), 9);
        assert_eq!(q.drop_before(12).unwrap(), 0);
        for i in 10..12u64 {
            q.append(Entry { offset: i * 100, size: 10, tag: i }).unwrap();
        }
        assert_eq!(q.drop_before(12).unwrap(), 1);
        assert!(list_numbered(dir.path()).unwrap().is_empty());
        drop(q);
        // With every file gone the checkpointed length alone says where appends resume.
        let mut q = ConsumeQueue::open(dir.path(), 4, Some(12)).unwrap();
        assert_eq!((q.first(), q.len(), q.get(11)), (12, 12, None));
        assert_eq!(q.append(Entry { offset: 1200, size: 10, tag: 12 }).unwrap(), 12);
        assert_eq!(q.get(12), Some(Entry { offset: 1200, size: 10, tag: 12 }));
    }

    #[test]
    fn a_changed_entry_count_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let mut q = ConsumeQueue::open(dir.path(), 4, None).unwrap();
        q.append(Entry { offset: 1, size: 1, tag: 1 }).unwrap();
        drop(q);
        assert!(matches!(ConsumeQueue::open(dir.path(), 8, None), Err(Error::Corrupt { .. })));
    }
}
