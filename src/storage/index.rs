//! The id index: an open-addressing hash table in a mapped file, so pending messages cost disk and
//! page cache, not anonymous memory.
//!
//! A slot keeps the message's current state and where its records are; ids themselves stay in the
//! commit log and are compared by reading the Put record when hashes match.

use std::fs;
use std::path::{Path, PathBuf};

use super::format::{Home, State};
use super::mmap::{sync_dir, MappedFile};
use crate::error::{Error, Result};

/// Magic at the start of the index file ("DLYI").
pub const INDEX_MAGIC: u32 = u32::from_le_bytes(*b"DLYI");
/// Layout version of the index file.
pub const INDEX_VERSION: u16 = 1;
/// Bytes before the first slot.
pub const HEADER_BYTES: usize = 64;
/// Bytes per slot.
pub const SLOT_BYTES: usize = 32;
const FLAG_USED: u8 = 1;
const FLAG_DEAD_LETTER: u8 = 2;

/// One message's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// `format::id_hash` of the id.
    pub hash: u64,
    /// Commit-log offset of the Put record.
    pub msg_offset: u64,
    /// Commit-log offset of the last record applied to this slot (Put or Transition).
    pub last_offset: u64,
    /// Sequence number: 0 at Put, +1 per transition.
    pub seq: u32,
    /// Deliveries so far (saturates at u16::MAX).
    pub attempt: u16,
    /// Current state.
    pub state: State,
    /// Which topic queue the message belongs to.
    pub home: Home,
}

impl Slot {
    fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut b = [0u8; SLOT_BYTES];
        b[0..8].copy_from_slice(&self.hash.to_le_bytes());
        b[8..16].copy_from_slice(&self.msg_offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.last_offset.to_le_bytes());
        b[24..28].copy_from_slice(&self.seq.to_le_bytes());
        b[28..30].copy_from_slice(&self.attempt.to_le_bytes());
        b[30] = self.state as u8;
        b[31] = FLAG_USED | if self.home == Home::DeadLetter { FLAG_DEAD_LETTER } else { 0 };
        b
    }

    fn decode(b: &[u8]) -> Option<Slot> {
        if b[31] & FLAG_USED == 0 {
            return None;
        }
        let u64at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Some(Slot {
            hash: u64at(0),
            msg_offset: u64at(8),
            last_offset: u64at(16),
            seq: u32::from_le_bytes([b[24], b[25], b[26], b[27]]),
            attempt: u16::from_le_bytes([b[28], b[29]]),
            // An unknown state byte can only come from a damaged file; treat it as done so the
            // message is never delivered early or twice, and rebuilds fix it.
            state: State::from_u8(b[30]).unwrap_or(State::Done),
            home: if b[31] & FLAG_DEAD_LETTER != 0 { Home::DeadLetter } else { Home::Main },
        })
    }
}

/// Position of a slot in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef(u64);

/// The mapped hash table.
pub struct IdIndex {
    path: PathBuf,
    file: MappedFile,
    slots: u64,
    used: u64,
}

impl IdIndex {
    /// Opens the index at `path`, creating it with `initial_slots` (rounded up to a power of two).
    pub fn open(path: &Path, initial_slots: u64) -> Result<IdIndex> {
        if path.exists() {
            let file = MappedFile::open_existing(path)?;
            let b = file.bytes();
            let bad = |reason: &str| Error::Corrupt {
                file: path.display().to_string(),
                offset: 0,
                reason: reason.to_string(),
            };
            if b.len() < HEADER_BYTES {
                return Err(bad("index file shorter than its header"));
            }
            if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != INDEX_MAGIC {
                return Err(bad("bad index magic"));
            }
            if u16::from_le_bytes([b[4], b[5]]) != INDEX_VERSION {
                return Err(bad("unsupported index version"));
            }
            let slots = read_u64(b, 8);
            let used = read_u64(b, 16);
            if !slots.is_power_of_two() || file.len() != HEADER_BYTES as u64 + slots * SLOT_BYTES as u64 {
                return Err(bad("index slot count does not match the file size"));
            }
            return Ok(IdIndex { path: path.to_path_buf(), file, slots, used });
        }
        Self::create(path, initial_slots.max(64).next_power_of_two())
    }

    fn create(path: &Path, slots: u64) -> Result<IdIndex> {
        let tmp = path.with_extension("new");
        let _ = fs::remove_file(&tmp);
        let mut file = MappedFile::open(&tmp, HEADER_BYTES as u64 + slots * SLOT_BYTES as u64)?;
        let mut h = [0u8; 24];
        h[0..4].copy_from_slice(&INDEX_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&INDEX_VERSION.to_le_bytes());
        h[8..16].copy_from_slice(&slots.to_le_bytes());
        file.write_at(0, &h);
        file.flush()?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path).map_err(|e| Error::io(format!("rename {}", tmp.display()), e))?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        let file = MappedFile::open_existing(path)?;
        Ok(IdIndex { path: path.to_path_buf(), file, slots, used: 0 })
    }

    /// Number of messages in the index.
    pub fn len(&self) -> u64 {
        self.used
    }

    /// True when no message was ever indexed.
    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    /// Sets the used-slot count after a recount.
    pub fn set_len(&mut self, used: u64) {
        self.used = used;
        self.file.write_at(16, &used.to_le_bytes());
    }

    /// Number of slots in the table.
    pub fn capacity(&self) -> u64 {
        self.slots
    }

    fn slot_at(&self, i: u64) -> Option<Slot> {
        let pos = HEADER_BYTES + i as usize * SLOT_BYTES;
        Slot::decode(&self.file.bytes()[pos..pos + SLOT_BYTES])
    }

    /// Finds the slot with `hash` whose Put record offset satisfies `is_it` (callers compare ids).
    pub fn find(&self, hash: u64, mut is_it: impl FnMut(u64) -> bool) -> Option<(SlotRef, Slot)> {
        let mask = self.slots - 1;
        let mut i = hash & mask;
        for _ in 0..self.slots {
            let s = self.slot_at(i)?;
            if s.hash == hash && is_it(s.msg_offset) {
                return Some((SlotRef(i), s));
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Overwrites the slot found by [`find`](Self::find).
    pub fn update(&mut self, at: SlotRef, slot: Slot) {
        let pos = HEADER_BYTES + at.0 as usize * SLOT_BYTES;
        self.file.write_at(pos, &slot.encode());
    }

    /// Inserts a new slot (the caller checked the id is absent), growing the table past 3/4 full.
    pub fn insert(&mut self, slot: Slot) -> Result<()> {
        if (self.used + 1) * 4 > self.slots * 3 {
            self.grow()?;
        }
        self.place(slot);
        self.used += 1;
        let used = self.used;
        self.file.write_at(16, &used.to_le_bytes());
        Ok(())
    }

    /// Removes the slot found by [`find`](Self::find), shifting later members of its probe run back
    /// so lookups need no tombstones.
    pub fn remove(&mut self, at: SlotRef) {
        let mask = self.slots - 1;
        let mut hole = at.0;
        let mut i = (hole + 1) & mask;
        while let Some(s) = self.slot_at(i) {
            let home = s.hash & mask;
            // `s` may fill the hole only if its home is not cyclically within (hole, i].
            let stays = if hole <= i { hole < home && home <= i } else { hole < home || home <= i };
            if !stays {
                self.update(SlotRef(hole), s);
                hole = i;
            }
            i = (i + 1) & mask;
        }
        let pos = HEADER_BYTES + hole as usize * SLOT_BYTES;
        self.file.write_at(pos, &[0u8; SLOT_BYTES]);
        self.used = self.used.saturating_sub(1);
        let used = self.used;
        self.file.write_at(16, &used.to_le_bytes());
    }

    fn place(&mut self, slot: Slot) {
        let mask = self.slots - 1;
        let mut i = slot.hash & mask;
        while self.slot_at(i).is_some() {
            i = (i + 1) & mask;
        }
        self.update(SlotRef(i), slot);
    }

    fn grow(&mut self) -> Result<()> {
        let slots = self.slots * 2;
        let tmp = self.path.with_extension("grow");
        let _ = fs::remove_file(&tmp);
        {
            let mut bigger = IdIndex::create(&tmp, slots)?;
            for i in 0..self.slots {
                if let Some(s) = self.slot_at(i) {
                    bigger.place(s);
                    bigger.used += 1;
                }
            }
            let used = bigger.used;
            bigger.file.write_at(16, &used.to_le_bytes());
            bigger.file.flush()?;
        }
        fs::rename(&tmp, &self.path).map_err(|e| Error::io(format!("rename {}", tmp.display()), e))?;
        if let Some(dir) = self.path.parent() {
            sync_dir(dir)?;
        }
        self.file = MappedFile::open_existing(&self.path)?;
        self.slots = slots;
        tracing::info!(slots, "id index grown");
        Ok(())
    }

    /// Calls `f` for every used slot (recovery checks).
    pub fn for_each(&self, mut f: impl FnMut(Slot)) {
        for i in 0..self.slots {
            if let Some(s) = self.slot_at(i) {
                f(s);
            }
        }
    }

    /// A second handle on the index file, for a background fdatasync.
    pub fn handle(&self) -> Result<std::fs::File> {
        self.file.handle()
    }

    /// Makes the table durable.
    pub fn flush(&self) -> Result<()> {
        self.file.flush()
    }

    /// Bytes of disk the index occupies.
    pub fn disk_bytes(&self) -> u64 {
        self.file.len()
    }
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(hash: u64, off: u64) -> Slot {
        Slot {
            hash,
            msg_offset: off,
            last_offset: off,
            seq: 0,
            attempt: 0,
            state: State::Delayed,
            home: Home::Main,
        }
    }

    #[test]
    fn insert_find_update_grow_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        {
            let mut idx = IdIndex::open(&path, 64).unwrap();
            for i in 0..1000u64 {
                // Force collisions: many ids share a hash and are told apart by offset.
                idx.insert(slot(i % 37, i)).unwrap();
            }
            assert!(idx.capacity() >= 1024);
            let (at, mut s) = idx.find(5, |o| o == 42).unwrap();
            s.state = State::Ready;
            s.seq = 3;
            idx.update(at, s);
            idx.flush().unwrap();
        }
        let idx = IdIndex::open(&path, 64).unwrap();
        assert_eq!(idx.len(), 1000);
        let (_, s) = idx.find(5, |o| o == 42).unwrap();
        assert_eq!((s.state, s.seq), (State::Ready, 3));
        assert!(idx.find(5, |o| o == 43).is_none());
        for i in 0..1000u64 {
            assert_eq!(idx.find(i % 37, |o| o == i).unwrap().1.msg_offset, i);
        }
    }

    #[test]
    fn removal_keeps_every_other_slot_findable() {
        let dir = tempfile::tempdir().unwrap();
        let mut ix = IdIndex::open(&dir.path().join("ids"), 64).unwrap();
        // Few distinct hashes modulo 64 make long, wrapping probe runs.
        let keys: Vec<(u64, u64)> = (0..40u64).map(|i| ((i % 5) * 64 + 62 + (i % 3), i)).collect();
        for (h, o) in &keys {
            ix.insert(slot(*h, *o)).unwrap();
        }
        for (n, (h, o)) in keys.iter().enumerate().filter(|(n, _)| n % 2 == 0) {
            let (at, _) = ix.find(*h, |m| m == *o).unwrap();
            ix.remove(at);
            assert!(ix.find(*h, |m| m == *o).is_none(), "removed key {n} still found");
        }
        for (n, (h, o)) in keys.iter().enumerate() {
            assert_eq!(ix.find(*h, |m| m == *o).is_some(), n % 2 == 1, "key {n}");
        }
        assert_eq!(ix.len(), 20);
    }

    #[test]
    fn a_damaged_header_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        drop(IdIndex::open(&path, 64).unwrap());
        let mut b = fs::read(&path).unwrap();
        b[0] = b'X';
        fs::write(&path, b).unwrap();
        assert!(matches!(IdIndex::open(&path, 64), Err(Error::Corrupt { .. })));
    }
}
