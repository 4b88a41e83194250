//! The id index: open-addressing hash tables in mapped files, so pending messages cost disk and
//! page cache, not anonymous memory.
//!
//! A slot keeps the message's current state and where its records are; ids themselves stay in the
//! commit log and are compared by reading the Put record when hashes match.
//!
//! The table resizes without stopping the world. When it passes 3/4 full (or drops below 1/8 live),
//! a background thread creates `ids.next`, sized for the live count; then every insert or remove
//! copies a bounded run of old slots into it, and lookups consult the new table first, then the
//! old one. The old table is never rearranged: a copied slot stays where it was, so whatever subset
//! of pages a crash leaves on disk, every message is still in at least one file at a state no older
//! than the last checkpoint. Slots are never moved inside a table either (removal marks a slot
//! removed instead of shifting its neighbours), for the same reason; removed slots are dropped by
//! the next migration, which the fill (live plus removed) triggers. When the copy is done, a
//! background thread fdatasyncs the new file and renames it over `ids`.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use super::durability::Durability;
use super::format::slot::{
    decode_index_header, encode_index_header, index_file_bytes, slot_hash, slot_is_live, slot_is_occupied,
    slot_msg_offset, slot_position, slot_removed_flags, INDEX_PAGE_BYTES, SLOTS_PER_PAGE, SLOT_FLAGS_AT,
};
use super::format::DecodeError;
use super::mmap::{sync_dir, MappedFile, WriteHeat};
use super::types::{IdHash, LogOffset};
use crate::error::{Error, Result};

// The layout is storage::format's; these names stay here for the index's users.
pub use super::format::slot::{
    Slot, INDEX_HEADER_BYTES as HEADER_BYTES, INDEX_MAGIC, INDEX_VERSION, SLOT_BYTES,
};

/// Smallest table, in slots.
pub const MIN_SLOTS: u64 = 64;
/// Fewest old slots copied per insert or remove while a migration runs (the rate actually used is
/// also at least 4 × old/new slots, which finishes the copy before inserts could fill the new
/// table). Inserts whose old home is ahead of the copy go to the old table (see
/// `IdIndex::place_ahead`), about `old / (2 × this)` of them in a doubling: at 8, a table that
/// started the copy 3/4 full ends it below 13/16, short of the 7/8 past which inserts go to the
/// new table at random. Kept small because an engine step applies up to 1,024 operations: at 512
/// a step took 260 ms at 10M ids; the engine's maintenance, between requests and under load too,
/// copies the rest in time-bounded chunks.
pub const MIGRATE_SLOTS_PER_OP: usize = 8;
/// How much of the old table's copied part is marked cold at a time during a resize.
const COLD_CHUNK_BYTES: usize = 16 << 20;
/// Mutations to wait before retrying a failed creation of the next table.
const RETRY_AFTER_OPS: u64 = 4096;

/// Position of a slot: valid from a [`IdIndex::find`] until the next mutating call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    in_old: bool,
    pos: u64,
}

/// One mapped table file.
struct Table {
    file: MappedFile,
    /// How each slot write is made (pwrite or a store), by how often its page was written.
    heat: WriteHeat,
    slots: u64,
    /// Occupied slots, removed ones included: what probes walk over.
    filled: u64,
    /// For a table created by this process: one bit per page, set once a slot of the page is
    /// written. A page never written holds only empty slots, so a probe stops there without
    /// touching it: while a resize copies into a fresh table, a look-up of an absent id (every
    /// produce makes one) would otherwise fault in a fresh page of the new table at random,
    /// and fill the page cache with its zeroes well ahead of the copy.
    written: Option<Box<[u64]>>,
}

impl Table {
    /// Maps and validates an existing table file.
    fn open(path: &Path, durability: &Durability) -> Result<Table> {
        let file = MappedFile::open_existing(path, durability)?;
        let b = file.bytes();
        let bad = |reason: &str| Error::Corrupt {
            file: path.display().to_string(),
            offset: 0,
            reason: reason.to_string(),
        };
        if b.len() < HEADER_BYTES {
            return Err(bad("index file shorter than its header"));
        }
        let slots = match decode_index_header(&b[..HEADER_BYTES]) {
            Ok(slots) => slots,
            Err(DecodeError::Invalid(why)) => return Err(bad(why)),
            Err(_) => return Err(bad("index file shorter than its header")),
        };
        if !slots.is_power_of_two() || slots < MIN_SLOTS || file.len() != table_bytes(slots) {
            return Err(bad("index slot count does not match the file size"));
        }
        // `filled` is set by `count`, once any interrupted migration is merged.
        Ok(Table { file, heat: WriteHeat::default(), slots, filled: 0, written: None })
    }

    fn fresh(file: MappedFile, slots: u64) -> Table {
        let words = slots.div_ceil(SLOTS_PER_PAGE as u64).div_ceil(64) as usize;
        Table { file, heat: WriteHeat::default(), slots, filled: 0, written: Some(vec![0; words].into_boxed_slice()) }
    }

    /// False only for a slot on a page no slot was ever written to (see `written`).
    fn may_be_occupied(&self, i: u64) -> bool {
        let Some(w) = &self.written else { return true };
        let (word, bit) = page_bit(i);
        w.get(word).is_none_or(|x| x & bit != 0)
    }

    fn raw(&self, i: u64) -> &[u8; SLOT_BYTES] {
        let pos = slot_position(i);
        // Slot positions are below `slots`, which `open` matched to the file size.
        self.file.bytes()[pos..pos + SLOT_BYTES].first_chunk().unwrap_or(&[0; SLOT_BYTES])
    }

    fn write(&mut self, i: u64, b: &[u8; SLOT_BYTES]) {
        if let Some(w) = &mut self.written {
            let (word, bit) = page_bit(i);
            if let Some(x) = w.get_mut(word) {
                *x |= bit;
            }
        }
        self.file.write_scattered(&mut self.heat, slot_position(i), b);
    }

    fn mark_removed(&mut self, i: u64) {
        let flags = slot_removed_flags(self.raw(i));
        self.file.write_scattered(
            &mut self.heat,
            slot_position(i) + SLOT_FLAGS_AT,
            &[flags],
        );
    }

    /// Counts occupied slots into `filled` and returns the live ones, in one pass.
    fn count(&mut self) -> u64 {
        let (mut filled, mut live) = (0, 0);
        for i in 0..self.slots {
            let b = self.raw(i);
            filled += u64::from(slot_is_occupied(b));
            live += u64::from(slot_is_live(b));
        }
        self.filled = filled;
        live
    }

    /// Positions on `hash`'s probe path, up to (not including) the first never-occupied slot.
    fn probe(&self, hash: u64) -> impl Iterator<Item = u64> + '_ {
        let mask = self.slots - 1;
        (0..self.slots)
            .map(move |k| hash.wrapping_add(k) & mask)
            .take_while(move |&i| self.may_be_occupied(i) && slot_is_occupied(self.raw(i)))
    }

    /// First live slot on `hash`'s probe path that satisfies `is_it`.
    fn find(&self, hash: IdHash, is_it: &mut impl FnMut(&Slot) -> bool) -> Option<(u64, Slot)> {
        self.find_from(hash, hash.get(), is_it)
    }

    /// Like [`find`](Self::find), walking `hash`'s probe path from position `start` on (a
    /// position on that path, or the path's home).
    fn find_from(&self, hash: IdHash, start: u64, is_it: &mut impl FnMut(&Slot) -> bool) -> Option<(u64, Slot)> {
        self.probe(start).find_map(|i| {
            let b = self.raw(i);
            if !slot_is_live(b) || slot_hash(b) != hash {
                return None;
            }
            let slot = Slot::from_bytes(b);
            is_it(&slot).then_some((i, slot))
        })
    }

    /// One of `parts` shares of the structure check of this table (see
    /// [`IdIndex::check_part`]), handing every live slot to `f`; the occupied and live slots.
    fn check_share(&self, k: u64, parts: u64, mut f: impl FnMut(&Slot)) -> std::result::Result<(u64, u64), String> {
        let t = self;
        let (mask, parts) = (t.slots - 1, parts.max(1));
        let at = |j: u64| (u128::from(t.slots) * u128::from(j) / u128::from(parts)) as u64;
        let (from, to) = (at(k.min(parts)), at((k + 1).min(parts)));
        // The run of occupied slots this share starts in may begin in an earlier share (or wrap
        // around the end): count it back to its empty slot, as `check` starts after one.
        let mut run = 0u64;
        while run < t.slots && slot_is_occupied(t.raw(from.wrapping_sub(run + 1) & mask)) {
            run += 1;
        }
        if run == t.slots {
            return Err("index table has no empty slot".into());
        }
        let (mut filled, mut live) = (0, 0);
        for p in from..to {
            let b = t.raw(p);
            if !slot_is_occupied(b) {
                if b.iter().any(|x| *x != 0) {
                    return Err(format!("index slot {p} is marked empty but holds data"));
                }
                run = 0;
                continue;
            }
            run += 1;
            filled += 1;
            let Ok(slot) = Slot::decode(b) else {
                return Err(format!("index slot {p} has unknown flags or state"));
            };
            if (p.wrapping_sub(slot.hash.get() & mask) & mask) >= run {
                return Err(format!("index slot {p} is not on the probe path of its hash"));
            }
            if slot_is_live(b) {
                live += 1;
                f(&slot);
            }
        }
        Ok((filled, live))
    }

    /// Whether a slot, live or removed, holds the message `(hash, msg_offset)`.
    fn knows(&self, hash: IdHash, msg_offset: LogOffset) -> bool {
        self.probe(hash.get()).any(|i| {
            let b = self.raw(i);
            slot_hash(b) == hash && slot_msg_offset(b) == msg_offset
        })
    }

    /// Writes `b` into the first empty slot of its probe path; None if the table is full.
    /// Removed slots are not reused: a migration's merge relies on them to remember removals.
    fn place(&mut self, b: &[u8; SLOT_BYTES]) -> Option<u64> {
        let start = slot_hash(b).get();
        // The first position past the occupied run, if the run does not cover the whole table.
        let run = self.probe(start).count() as u64;
        if run == self.slots {
            return None;
        }
        let i = start.wrapping_add(run) & (self.slots - 1);
        self.write(i, b);
        self.filled += 1;
        Some(i)
    }
}

/// The word and bit of slot `i`'s page in a [`Table`]'s `written` bits.
fn page_bit(i: u64) -> (usize, u64) {
    let page = i / SLOTS_PER_PAGE as u64;
    ((page / 64) as usize, 1 << (page % 64))
}

/// A resize in progress: the table being emptied into the current one.
struct Migration {
    table: Table,
    /// Old slots below this position were copied (or skipped as removed).
    cursor: u64,
    /// Where the run of occupied old slots that ends at the cursor starts: the position after the
    /// last never-occupied slot the copy passed. Nothing below the cursor changes any more, so a
    /// probe whose home is below this position ends before the cursor, and one whose home lies
    /// in `run_start..cursor` walks only occupied, copied slots until the cursor.
    run_start: u64,
    /// Bytes of the old table below which its pages were marked cold.
    cold_to: usize,
    /// Old slots copied per insert or remove.
    per_op: usize,
}

/// Work handed to a background thread, so no call on the engine thread waits for a large file.
enum Job {
    /// Creating and preallocating `ids.next` with `slots` slots.
    Prepare { slots: u64, thread: JoinHandle<Result<MappedFile>> },
    /// Making `ids.next` durable, renaming it over `ids`, unmapping the old table.
    Finish(JoinHandle<Result<()>>),
}

/// How [`IdIndex::open_counted`] learns the table's occupied and live slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// A pass over the table now.
    Now,
    /// `(slots, filled, live)` a clean close recorded; counted now if they do not fit the table.
    Known(u64, u64, u64),
    /// From the [`IdIndex::check_part`] pass the caller makes next, given to
    /// [`IdIndex::set_counts`] (the first change counts them if it never comes).
    ByCheck,
}

/// The mapped hash table, resized incrementally.
pub struct IdIndex {
    path: PathBuf,
    next_path: PathBuf,
    tmp_path: PathBuf,
    initial_slots: u64,
    /// The table inserts go to (during a migration, the new one).
    cur: Table,
    from: Option<Migration>,
    live: u64,
    /// Opened with [`Counting::ByCheck`] and not yet counted: `live` and `filled` mean nothing,
    /// and the first change counts them.
    uncounted: bool,
    job: Option<Job>,
    step_slots: usize,
    /// Mutations left before a failed next-table creation is tried again.
    retry_in: u64,
    /// Set when a background fsync or rename failed: the files' state is unknown, writes stop.
    poisoned: Option<String>,
    /// The store's durability owner, which every sync of the tables reports to.
    durability: Durability,
    /// Time spent on resize work (copying slots, waiting for a background job) since the last
    /// [`take_resize_time`](Self::take_resize_time), so an engine step can say how much of it
    /// was the resize's.
    resize_ns: u64,
}

impl IdIndex {
    /// Opens the index at `path` (`index/ids`), creating it with `initial_slots` (rounded up to a
    /// power of two, at least [`MIN_SLOTS`]). A migration left by a crash is finished here.
    pub fn open(path: &Path, initial_slots: u64, durability: &Durability) -> Result<IdIndex> {
        Self::open_counted(path, initial_slots, durability, Counting::Now)
    }

    /// Like [`open`](Self::open), taking the table's occupied and live slot counts as `counting`
    /// says: from a clean close's counts when they describe the table found (same size, no resize
    /// to finish), or from a [`check_part`](Self::check_part) pass the caller makes next.
    pub fn open_counted(
        path: &Path,
        initial_slots: u64,
        durability: &Durability,
        counting: Counting,
    ) -> Result<IdIndex> {
        let initial_slots = initial_slots.max(MIN_SLOTS).next_power_of_two();
        let next_path = path.with_extension("next");
        let tmp_path = path.with_extension("new");
        let mut uncounted = false;
        let (cur, live) = if path.exists() {
            let mut cur = Table::open(path, durability)?;
            let mut counting = match counting {
                Counting::Known(slots, filled, live) if slots != cur.slots || filled > slots || live > filled => {
                    Counting::Now
                }
                c => c,
            };
            if next_path.exists() {
                let next = Table::open(&next_path, durability)?;
                // A power loss can keep a slot written since the last sync while losing an
                // earlier page of its run: the merge would not find it on its probe path and copy
                // its message a second time. Such a table is damaged; the store rebuilds it.
                if let Err(reason) = next.check_share(0, 1, |_| {}) {
                    return Err(Error::Corrupt { file: next_path.display().to_string(), offset: 0, reason });
                }
                cur = finish_interrupted(path, cur, next)?;
                if matches!(counting, Counting::Known(..)) {
                    counting = Counting::Now;
                }
            }
            remove_if_exists(&tmp_path)?;
            let live = match counting {
                Counting::Known(_, filled, live) => {
                    cur.filled = filled;
                    live
                }
                Counting::Now => cur.count(),
                Counting::ByCheck => {
                    uncounted = true;
                    0
                }
            };
            (cur, live)
        } else {
            // The protocol never leaves `ids.next` without `ids` (it becomes `ids` by rename); a
            // lone one is stale, next to an `ids` deleted to force a rebuild.
            remove_if_exists(&next_path)?;
            (Table::fresh(create_table(&tmp_path, path, initial_slots, durability)?, initial_slots), 0)
        };
        Ok(IdIndex {
            path: path.to_path_buf(),
            next_path,
            tmp_path,
            initial_slots,
            cur,
            from: None,
            live,
            uncounted,
            job: None,
            step_slots: MIGRATE_SLOTS_PER_OP,
            retry_in: 0,
            poisoned: None,
            resize_ns: 0,
            durability: durability.clone(),
        })
    }

    /// Number of messages in the index.
    pub fn len(&self) -> u64 {
        self.live
    }

    /// True when the index holds no message.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Slots, occupied slots and live slots of the one table, for a clean close to record; none
    /// while slots are being copied between two tables (a next table still being created is not
    /// part of the index yet: the open deletes it).
    pub fn counts(&self) -> Option<(u64, u64, u64)> {
        (self.from.is_none() && !self.uncounted).then_some((self.cur.slots, self.cur.filled, self.live))
    }

    /// Number of slots in the table inserts go to.
    pub fn capacity(&self) -> u64 {
        self.cur.slots
    }

    /// True while a resize is under way (a table being created, copied or retired).
    pub fn is_migrating(&self) -> bool {
        self.from.is_some() || self.job.is_some()
    }

    /// True while old slots wait to be copied (work [`step`](Self::step) can do at once).
    pub fn is_copying(&self) -> bool {
        self.from.is_some()
    }

    /// Finds the slot with `hash` whose Put record offset satisfies `is_it` (callers compare ids).
    pub fn find(&self, hash: IdHash, mut is_it: impl FnMut(LogOffset) -> bool) -> Option<(SlotRef, Slot)> {
        self.find_slot(hash, |s| is_it(s.msg_offset))
    }

    /// Like [`find`](Self::find), with the whole slot to judge.
    pub fn find_slot(&self, hash: IdHash, mut is_it: impl FnMut(&Slot) -> bool) -> Option<(SlotRef, Slot)> {
        if let Some((pos, s)) = self.cur.find(hash, &mut is_it) {
            return Some((SlotRef { in_old: false, pos }, s));
        }
        let m = self.from.as_ref()?;
        // Below the cursor every slot was copied: a look-up reads none of those pages again, so
        // the old table's copied part leaves the page cache as the copy moves on, instead of
        // both whole tables staying hot until the end (see `Migration::run_start`).
        let home = hash.get() & (m.table.slots - 1);
        let start = match home {
            h if h >= m.cursor => h,
            h if h < m.run_start => return None,
            _ => m.cursor,
        };
        let (pos, s) = m.table.find_from(hash, start, &mut is_it)?;
        // A probe that wrapped past the end meets copied slots again; missing from the new
        // table, such a one was removed there.
        (pos >= m.cursor).then_some((SlotRef { in_old: true, pos }, s))
    }

    /// Overwrites the slot found by [`find`](Self::find); `hash` and `msg_offset` must not change.
    pub fn update(&mut self, at: SlotRef, slot: Slot) {
        let b = slot.encode();
        match (&mut self.from, at.in_old) {
            (Some(m), true) => m.table.write(at.pos, &b),
            _ => self.cur.write(at.pos, &b),
        }
    }

    /// Which table and page slot `at` is written in: the kernel writes a page back whole, so
    /// changes to slots with the same answer reach the disk together, and others in any order.
    pub fn page_of(&self, at: SlotRef) -> (bool, u64) {
        let in_old = at.in_old && self.from.is_some();
        (in_old, at.pos / SLOTS_PER_PAGE as u64)
    }

    /// Makes the page holding slot `at` durable, for a change elsewhere in the index that must not
    /// reach the disk before it.
    pub fn sync_slot(&self, at: SlotRef) -> Result<()> {
        let table = match (&self.from, at.in_old) {
            (Some(m), true) => &m.table,
            _ => &self.cur,
        };
        let page = slot_position(at.pos) / INDEX_PAGE_BYTES * INDEX_PAGE_BYTES;
        table.file.flush_range(page, INDEX_PAGE_BYTES)
    }

    /// Inserts a new slot (the caller checked the id is absent), then does a bounded step of any
    /// resize in progress.
    pub fn insert(&mut self, slot: Slot) -> Result<()> {
        self.count_if_needed();
        self.check_poisoned()?;
        self.poll_job(false);
        self.make_room()?;
        let b = slot.encode();
        if !self.place_ahead(&b) && self.cur.place(&b).is_none() {
            return Err(Error::Unavailable("id index is full".into()));
        }
        self.live += 1;
        self.after_op();
        Ok(())
    }

    /// During a copy, puts a new slot whose old-table home the copy has not reached into the old
    /// table, where the copy will carry it over. The new table then fills in position order, two
    /// fronts moving through it, instead of at random: a table this large no longer has to be
    /// faulted in whole ahead of the copy, which at 100 million messages pushed the hot pages out
    /// of a full page cache. False (the caller places it in the new table) when no copy is under
    /// way, when the home is below the copy position, when the probe would wrap to the start of
    /// the old table (below the copy position again), or when the old table is 7/8 occupied.
    fn place_ahead(&mut self, b: &[u8; SLOT_BYTES]) -> bool {
        let Some(m) = &mut self.from else { return false };
        let t = &mut m.table;
        if (t.filled + 1) * 8 > t.slots * 7 {
            return false;
        }
        let home = slot_hash(b).get() & (t.slots - 1);
        if home < m.cursor {
            return false;
        }
        let at = home + t.probe(home).count() as u64;
        if at >= t.slots {
            return false;
        }
        t.write(at, b);
        t.filled += 1;
        true
    }

    /// Removes the slot found by [`find`](Self::find), then does a bounded step of any resize.
    pub fn remove(&mut self, at: SlotRef) {
        self.count_if_needed();
        match (&mut self.from, at.in_old) {
            (Some(m), true) => m.table.mark_removed(at.pos),
            _ => self.cur.mark_removed(at.pos),
        }
        self.live = self.live.saturating_sub(1);
        self.poll_job(false);
        self.after_op();
    }

    /// Copies up to `budget` old slots of a resize in progress (for an idle engine); true while
    /// resize work remains.
    pub fn step(&mut self, budget: usize) -> bool {
        let started = std::time::Instant::now();
        let was = self.is_migrating();
        self.poll_job(false);
        self.migrate(budget);
        self.maybe_start_resize();
        if was || self.is_migrating() {
            self.resize_ns += started.elapsed().as_nanos() as u64;
        }
        self.is_migrating()
    }

    /// Calls `f` for every slot (recovery checks).
    pub fn for_each(&self, f: impl FnMut(Slot)) {
        self.for_each_part(0, 1, f);
    }

    /// Calls `f` for every slot of part `k` of `parts` (a contiguous share of each table), so
    /// threads can split a pass over the index between them; the parts together are every slot.
    pub fn for_each_part(&self, k: u64, parts: u64, mut f: impl FnMut(Slot)) {
        let parts = parts.max(1);
        let share = |from: u64, to: u64| {
            let n = u128::from(to - from);
            let at = |j: u64| from + (n * u128::from(j) / u128::from(parts)) as u64;
            at(k.min(parts))..at((k + 1).min(parts))
        };
        for i in share(0, self.cur.slots) {
            let b = self.cur.raw(i);
            if slot_is_live(b) {
                f(Slot::from_bytes(b));
            }
        }
        if let Some(m) = &self.from {
            for i in share(m.cursor, m.table.slots) {
                let b = m.table.raw(i);
                if slot_is_live(b) {
                    f(Slot::from_bytes(b));
                }
            }
        }
    }

    /// Slots in the tables (both while a resize runs): what a pass over the index walks.
    pub fn table_slots(&self) -> u64 {
        self.cur.slots + self.from.as_ref().map_or(0, |m| m.table.slots - m.cursor)
    }

    /// One of `parts` shares of a check of the table that also hands every live slot to `f` and
    /// counts the occupied and live slots: the whole pass a start after a crash makes over the
    /// index, split so that threads share it. Only for an index just opened (no resize under
    /// way). `Err` says why the table cannot be trusted: an empty slot holding data, an occupied
    /// slot that does not decode (unknown flag bits or state, see [`Slot::decode`]), or one that
    /// linear probing could not have put where it is (a slot on its probe path is empty, so
    /// look-ups would stop before it). Damage that clears or scrambles slots breaks one of these
    /// for the slots around it.
    pub fn check_part(&self, k: u64, parts: u64, f: impl FnMut(&Slot)) -> std::result::Result<(u64, u64), String> {
        if self.from.is_some() {
            return Err("index check while a resize is under way".into());
        }
        self.cur.check_share(k, parts, f)
    }

    /// Sets the occupied and live slot counts of an index opened with [`Counting::ByCheck`],
    /// from its check's pass.
    pub fn set_counts(&mut self, filled: u64, live: u64) {
        self.cur.filled = filled;
        self.live = live;
        self.uncounted = false;
    }

    /// Counts the slots of an index opened with [`Counting::ByCheck`] whose check did not run.
    pub fn count_if_needed(&mut self) {
        if self.uncounted {
            self.live = self.cur.count();
            self.uncounted = false;
        }
    }

    /// Pushes a handle on every index file in use, for a background fdatasync at a checkpoint.
    pub fn take_handles(&mut self, out: &mut Vec<super::mmap::SyncFile>) -> Result<()> {
        out.push(self.cur.file.handle()?);
        if let Some(m) = &self.from {
            out.push(m.table.file.handle()?);
        }
        // The sync about to run write-protects the pages it cleans.
        self.cool();
        Ok(())
    }

    /// Makes the tables durable.
    pub fn flush(&mut self) -> Result<()> {
        self.cur.file.flush()?;
        if let Some(m) = &self.from {
            m.table.file.flush()?;
        }
        self.cool();
        Ok(())
    }

    /// Forgets which pages were written often: a sync of the tables is starting or done.
    fn cool(&mut self) {
        self.cur.heat.cool();
        if let Some(m) = &mut self.from {
            m.table.heat.cool();
        }
    }

    /// Bytes of disk the index files in use occupy.
    pub fn disk_bytes(&self) -> u64 {
        self.cur.file.len() + self.from.as_ref().map_or(0, |m| m.table.file.len())
    }

    fn check_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(Error::Unavailable(format!("id index: {why}"))),
            None => Ok(()),
        }
    }

    /// The bounded work every insert and remove does.
    fn after_op(&mut self) {
        let Some(budget) = self.from.as_ref().map(|m| m.per_op) else {
            self.maybe_start_resize();
            return;
        };
        let started = std::time::Instant::now();
        self.migrate(budget);
        self.maybe_start_resize();
        self.resize_ns += started.elapsed().as_nanos() as u64;
    }

    /// Time spent on resize work since the last call: copying old slots, and waiting for a
    /// background job the table could not do without.
    pub fn take_resize_time(&mut self) -> std::time::Duration {
        std::time::Duration::from_nanos(std::mem::take(&mut self.resize_ns))
    }

    /// Ensures the current table takes one more slot while staying below 7/8 full. Reached only
    /// when a background job falls far behind; then it waits for it rather than fill the table.
    fn make_room(&mut self) -> Result<()> {
        if (self.cur.filled + 1) * 8 <= self.cur.slots * 7 {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let r = self.make_room_waiting();
        self.resize_ns += started.elapsed().as_nanos() as u64;
        r
    }

    fn make_room_waiting(&mut self) -> Result<()> {
        for _ in 0..4 {
            if (self.cur.filled + 1) * 8 <= self.cur.slots * 7 {
                return Ok(());
            }
            if self.job.is_some() {
                tracing::warn!(slots = self.cur.slots, "id index nearly full; waiting for its resize");
                self.poll_job(true);
                self.check_poisoned()?;
            } else if self.from.is_some() {
                self.migrate(usize::MAX);
            } else {
                self.retry_in = 0;
                self.maybe_start_resize();
                if self.job.is_none() {
                    break;
                }
            }
        }
        if (self.cur.filled + 1) * 8 <= self.cur.slots * 7 {
            return Ok(());
        }
        Err(Error::Unavailable(format!(
            "id index is full ({} of {} slots) and could not be resized",
            self.cur.filled, self.cur.slots
        )))
    }

    /// Starts creating the next table when the current one is over 3/4 filled (live plus removed)
    /// or under 1/8 live and larger than the initial size.
    fn maybe_start_resize(&mut self) {
        if self.from.is_some() || self.job.is_some() || self.poisoned.is_some() {
            return;
        }
        if self.retry_in > 0 {
            self.retry_in -= 1;
            return;
        }
        let s = self.cur.slots;
        let full = self.cur.filled * 4 > s * 3;
        let sparse = s > self.initial_slots && self.live * 8 < s;
        if !full && !sparse {
            return;
        }
        // Room for twice the live count: after the copy the table is at most half full, so the
        // next resize is at least a quarter of the table away.
        let slots = self.live.saturating_mul(2).saturating_add(2).next_power_of_two().max(self.initial_slots);
        let (tmp, next) = (self.tmp_path.clone(), self.next_path.clone());
        let durability = self.durability.clone();
        let spawned = std::thread::Builder::new()
            .name("index-prepare".into())
            .spawn(move || create_table(&tmp, &next, slots, &durability));
        match spawned {
            Ok(thread) => self.job = Some(Job::Prepare { slots, thread }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the id index resize thread; retrying later");
                self.retry_in = RETRY_AFTER_OPS;
            }
        }
    }

    /// Collects a finished background job (or waits for it when `wait`).
    fn poll_job(&mut self, wait: bool) {
        let done = match &self.job {
            None => return,
            Some(Job::Prepare { thread, .. }) => thread.is_finished(),
            Some(Job::Finish(thread)) => thread.is_finished(),
        };
        if !done && !wait {
            return;
        }
        match self.job.take() {
            None => {}
            Some(Job::Prepare { slots, thread }) => match thread.join() {
                Ok(Ok(file)) => {
                    tracing::info!(
                        from = self.cur.slots,
                        to = slots,
                        live = self.live,
                        "id index resize started"
                    );
                    let old = std::mem::replace(&mut self.cur, Table::fresh(file, slots));
                    // Fast enough that the copy ends before inserts could fill the new table: at
                    // most `old / per_op` inserts arrive meanwhile, a quarter of the new table.
                    let per_op = self.step_slots.max(4 * old.slots.div_ceil(slots) as usize);
                    self.from = Some(Migration { table: old, cursor: 0, run_start: 0, cold_to: 0, per_op });
                }
                Ok(Err(e)) => {
                    // Nothing was changed yet: the current table keeps serving, and the creation is
                    // retried later (a full disk may have room again by then).
                    tracing::warn!(error = %e, slots, "cannot create the next id index table; retrying later");
                    self.retry_in = RETRY_AFTER_OPS;
                }
                Err(_) => self.poisoned = Some("the resize thread panicked".into()),
            },
            Some(Job::Finish(thread)) => match thread.join() {
                Ok(Ok(())) => {
                    self.cur.file.set_path(&self.path);
                    tracing::info!(slots = self.cur.slots, live = self.live, "id index resize finished");
                }
                // A failed fsync is never retried: what reached the disk is unknown.
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "retiring the old id index table failed");
                    self.poisoned = Some(format!("retiring the old table failed: {e}"));
                }
                Err(_) => self.poisoned = Some("the resize thread panicked".into()),
            },
        }
    }

    /// Copies up to `budget` old slots into the current table; at the end hands the old table to
    /// a background thread that retires it.
    fn migrate(&mut self, budget: usize) {
        let Some(m) = &mut self.from else { return };
        let end = m.cursor.saturating_add(budget as u64).min(m.table.slots);
        for i in m.cursor..end {
            let b = m.table.raw(i);
            if !slot_is_occupied(b) {
                m.run_start = i + 1;
                continue;
            }
            if !slot_is_live(b) {
                continue;
            }
            let copy = *b;
            if self.cur.place(&copy).is_none() {
                // Cannot happen: the new table has room for twice the live count. Stop rather than
                // lose the slot; the old table keeps it findable.
                m.cursor = i;
                self.poisoned = Some("the new id index table filled during a resize".into());
                return;
            }
        }
        m.cursor = end;
        // The copied pages are never read again (see `run_start`), but a page cache short of
        // room would keep them, recently busy, over the new table's pages it just faulted in.
        let copied = slot_position(end) / INDEX_PAGE_BYTES * INDEX_PAGE_BYTES;
        if copied >= m.cold_to + COLD_CHUNK_BYTES {
            m.table.file.advise_cold(m.cold_to, copied - m.cold_to);
            m.cold_to = copied;
        }
        if end == m.table.slots {
            self.retire_old();
        }
    }

    fn retire_old(&mut self) {
        let Some(m) = self.from.take() else { return };
        let handle = match self.cur.file.handle() {
            Ok(h) => h,
            Err(e) => {
                // Keep the old table consulted (every slot below the cursor is in both), retry later.
                tracing::warn!(error = %e, "cannot retire the old id index table yet");
                self.from = Some(m);
                return;
            }
        };
        let (next, path) = (self.next_path.clone(), self.path.clone());
        let durability = self.durability.clone();
        // The retire thread's sync write-protects the new table's pages.
        self.cur.heat.cool();
        let old = m.table;
        let spawned = std::thread::Builder::new().name("index-retire".into()).spawn(move || {
            // The new file must be durable before the rename drops the old one, or a power loss
            // could leave `ids` without slots copied since the last checkpoint.
            handle.sync_data()?;
            super::io::rename(&next, &path).map_err(|e| Error::io_at("rename", &next, e))?;
            if let Some(dir) = path.parent() {
                sync_dir(dir, &durability)?;
            }
            // Unmapping a large table takes milliseconds and blocks the engine's page faults
            // meanwhile: release it in small pieces first, here, not on the engine.
            old.file.release_pages();
            drop(old);
            Ok(())
        });
        match spawned {
            Ok(thread) => self.job = Some(Job::Finish(thread)),
            Err(e) => {
                self.poisoned = Some(format!("cannot start the id index retire thread: {e}"));
            }
        }
    }

    /// Waits for any background job (tests).
    #[cfg(test)]
    fn settle(&mut self) {
        self.poll_job(true);
    }
}

impl Drop for IdIndex {
    fn drop(&mut self) {
        match self.job.take() {
            // An unused next table would cost the next open a full merge; a crash just pays it.
            Some(Job::Prepare { thread, .. }) => {
                if let Ok(Ok(file)) = thread.join() {
                    drop(file);
                    let _ = super::io::remove_file(&self.next_path);
                }
            }
            Some(Job::Finish(thread)) => {
                let _ = thread.join();
            }
            None => {}
        }
    }
}

/// Completes a migration found at open: every live old slot that the new table does not know
/// (neither live nor removed there) is copied over, then the new table replaces `ids` durably.
fn finish_interrupted(path: &Path, old: Table, mut next: Table) -> Result<Table> {
    let mut copied = 0u64;
    for i in 0..old.slots {
        let b = old.raw(i);
        if !slot_is_live(b) || next.knows(slot_hash(b), slot_msg_offset(b)) {
            continue;
        }
        let copy = *b;
        if next.place(&copy).is_none() {
            return Err(Error::Corrupt {
                file: next.file.path().display().to_string(),
                offset: 0,
                reason: "the next index table is too small for the old one's slots".into(),
            });
        }
        copied += 1;
    }
    next.file.flush()?;
    drop(old);
    let next_path = next.file.path().to_path_buf();
    super::io::rename(&next_path, path).map_err(|e| Error::io_at("rename", &next_path, e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir, next.file.durability())?;
    }
    next.file.set_path(path);
    tracing::info!(copied, slots = next.slots, "finished an interrupted id index resize");
    Ok(next)
}

fn table_bytes(slots: u64) -> u64 {
    index_file_bytes(slots)
}

/// Creates a preallocated, empty table at `tmp` and renames it to `dest` durably.
fn create_table(tmp: &Path, dest: &Path, slots: u64, durability: &Durability) -> Result<MappedFile> {
    remove_if_exists(tmp)?;
    let mut file = MappedFile::open(tmp, table_bytes(slots), durability)?;
    file.write_at(0, &encode_index_header(slots));
    file.flush()?;
    file.sync_all()?;
    super::io::rename(tmp, dest).map_err(|e| Error::io_at("rename", tmp, e))?;
    if let Some(dir) = dest.parent() {
        sync_dir(dir, durability)?;
    }
    file.set_path(dest);
    Ok(file)
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match super::io::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io_at("remove", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::format::{Home, State};
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::fs;

    type Key = (IdHash, LogOffset);

    fn slot(hash: u64, off: u64) -> Slot {
        Slot {
            hash: IdHash::new(hash),
            msg_offset: LogOffset::new(off),
            last_offset: LogOffset::new(off),
            seq: 0,
            attempt: 0,
            state: State::Delayed,
            home: Home::Main,
            len: 100,
        }
    }

    /// An index whose migrations copy as few slots per operation as the pacing allows, so tests
    /// meet them half done.
    fn open_slow(path: &Path) -> IdIndex {
        let mut idx = IdIndex::open(path, 64, &Durability::new(Path::new("/"))).unwrap();
        idx.step_slots = 1;
        idx
    }

    /// The index answers exactly as the model: every key found with its slot, nothing else listed.
    fn check(idx: &IdIndex, model: &BTreeMap<Key, Slot>) {
        assert_eq!(idx.len(), model.len() as u64, "len");
        for (&(h, o), s) in model {
            let (_, got) = idx.find(h, |m| m == o).unwrap_or_else(|| panic!("{h}/{o} missing"));
            assert_eq!(&got, s);
        }
        let mut seen = BTreeMap::new();
        idx.for_each(|s| assert!(seen.insert((s.hash, s.msg_offset), s).is_none(), "listed twice: {s:?}"));
        assert_eq!(&seen, model, "for_each");
        // Split between threads, the parts together list every slot once, mid-resize too.
        for parts in [2, 3, 7] {
            let mut seen = BTreeMap::new();
            for k in 0..parts {
                idx.for_each_part(k, parts, |s| {
                    assert!(seen.insert((s.hash, s.msg_offset), s).is_none(), "listed twice in {parts} parts: {s:?}")
                });
            }
            assert_eq!(&seen, model, "for_each_part, {parts} parts");
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        Remove(usize),
        Update(usize),
        FindAbsent(u64),
        Step(usize),
        Reopen,
        CopyAndOpen,
    }

    fn ops(insert: u32, remove: u32) -> impl Strategy<Value = Op> {
        // Hashes from a small range collide a lot; arbitrary ones exercise the whole table.
        let hash = prop_oneof![0..8u64, any::<u64>()];
        prop_oneof![
            insert => hash.clone().prop_map(Op::Insert),
            remove => any::<usize>().prop_map(Op::Remove),
            3 => any::<usize>().prop_map(Op::Update),
            1 => hash.prop_map(Op::FindAbsent),
            1 => (0..64usize).prop_map(Op::Step),
            1 => Just(Op::Reopen),
            1 => Just(Op::CopyAndOpen),
        ]
    }

    fn pick(model: &BTreeMap<Key, Slot>, i: usize) -> Option<Key> {
        (!model.is_empty())
            .then(|| *model.keys().nth(i % model.len()).unwrap_or(&(IdHash::new(0), LogOffset::new(0))))
    }

    fn copy_dir(from: &Path, to: &Path) {
        fs::create_dir_all(to).unwrap();
        for name in files(from) {
            fs::copy(from.join(&name), to.join(&name)).unwrap();
        }
    }

    fn run_model(script: Vec<Op>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("index");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ids");
        let mut idx = open_slow(&path);
        let mut model: BTreeMap<Key, Slot> = BTreeMap::new();
        let mut offset = 1u64;
        let mut max_cap = 0;
        for op in script {
            match op {
                Op::Insert(h) => {
                    let s = slot(h, offset);
                    let h = s.hash;
                    offset += 1;
                    assert!(idx.find(h, |m| m == s.msg_offset).is_none());
                    idx.insert(s).unwrap();
                    model.insert((s.hash, s.msg_offset), s);
                }
                Op::Remove(i) => {
                    if let Some((h, o)) = pick(&model, i) {
                        let (at, _) = idx.find(h, |m| m == o).unwrap();
                        idx.remove(at);
                        model.remove(&(h, o));
                        assert!(idx.find(h, |m| m == o).is_none(), "found after remove");
                    }
                }
                Op::Update(i) => {
                    if let Some((h, o)) = pick(&model, i) {
                        let (at, mut s) = idx.find(h, |m| m == o).unwrap();
                        s.seq += 1;
                        s.last_offset = LogOffset::new(offset);
                        offset += 1;
                        s.state = if s.seq % 2 == 0 { State::Ready } else { State::Reserved };
                        s.attempt = s.attempt.saturating_add(1);
                        s.home = if s.seq % 3 == 0 { Home::DeadLetter } else { Home::Main };
                        idx.update(at, s);
                        model.insert((h, o), s);
                    }
                }
                Op::FindAbsent(h) => assert!(idx.find(IdHash::new(h), |m| m.get() == offset).is_none()),
                Op::Step(budget) => {
                    idx.step(budget);
                }
                Op::Reopen => {
                    drop(idx);
                    idx = open_slow(&path);
                    assert!(!dir.join("ids.next").exists(), "open finishes a migration");
                    check(&idx, &model);
                }
                Op::CopyAndOpen => {
                    // A SIGKILL image: whatever the mappings hold, with no drop and no flush.
                    idx.settle();
                    let copy = tmp.path().join(format!("copy-{offset}"));
                    copy_dir(&dir, &copy);
                    let other = open_slow(&copy.join("ids"));
                    check(&other, &model);
                }
            }
            max_cap = max_cap.max(idx.capacity());
            assert_eq!(idx.len(), model.len() as u64);
        }
        check(&idx, &model);
        assert!(max_cap > 64, "the script grew the table");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: crate::test_support::model_cases(24), ..ProptestConfig::default() })]

        #[test]
        fn behaves_like_a_map_through_growth_shrinking_and_reopens(
            grow in prop::collection::vec(ops(12, 1), 150..400),
            shrink in prop::collection::vec(ops(1, 12), 150..400),
        ) {
            run_model(grow.into_iter().chain(shrink).collect());
        }
    }

    /// Every share count of the open's check pass sees the slots and counts of one pass, and
    /// finds damage wherever the shares split the table (runs wrap around its end here).
    #[test]
    fn the_check_pass_in_any_number_of_shares_sees_every_slot_and_finds_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        let mut idx = IdIndex::open(&path, 256, &Durability::new(Path::new("/"))).unwrap();
        // Hashes near the end of the table, so runs wrap; every tenth removed.
        for i in 0..150u64 {
            idx.insert(slot((255 - i % 40) | (i << 20), 100 + i)).unwrap();
        }
        for i in (0..150u64).step_by(10) {
            let (at, _) = idx.find(IdHash::new((255 - i % 40) | (i << 20)), |m| m.get() == 100 + i).unwrap();
            idx.remove(at);
        }
        idx.flush().unwrap();
        while idx.is_migrating() {
            idx.step(1 << 20);
        }
        let mut want = Vec::new();
        idx.for_each(|s| want.push(s));
        want.sort_by_key(|s| s.msg_offset);
        let filled = idx.cur.filled;
        for parts in 1..=7 {
            let mut got = Vec::new();
            let (mut f, mut l) = (0, 0);
            for k in 0..parts {
                let (pf, pl) = idx.check_part(k, parts, |s| got.push(*s)).unwrap();
                (f, l) = (f + pf, l + pl);
            }
            got.sort_by_key(|s| s.msg_offset);
            assert_eq!((got.len() as u64, f, l), (want.len() as u64, filled, idx.len()), "{parts} shares");
            assert_eq!(got, want, "{parts} shares");
        }
        drop(idx);
        let damaged = |at: usize, byte: u8| {
            let mut b = fs::read(&path).unwrap();
            let mut occupied = (250..256).map(slot_position).filter(|p| b[p + SLOT_FLAGS_AT] & 1 == 1);
            let p = occupied.next().unwrap();
            b[p + at] = byte;
            let copy = dir.path().join("copy");
            fs::write(&copy, &b).unwrap();
            IdIndex::open(&copy, 256, &Durability::new(Path::new("/"))).unwrap()
        };
        // Unknown flag bits; an emptied slot with data left (its run then breaks, too).
        for (at, byte) in [(SLOT_FLAGS_AT, 0x81), (SLOT_FLAGS_AT, 0)] {
            let idx = damaged(at, byte);
            for parts in 1..=7 {
                let found = (0..parts).find_map(|k| idx.check_part(k, parts, |_| {}).err());
                assert!(found.is_some(), "byte {at} set to {byte:#x}, {parts} shares: not found");
            }
        }
    }

    #[test]
    fn grows_and_shrinks_back_leaving_one_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ids");
        let mut idx = IdIndex::open(&path, 64, &Durability::new(Path::new("/"))).unwrap();
        let mut model = BTreeMap::new();
        for i in 0..3000u64 {
            // Force collisions: many ids share a hash and are told apart by offset.
            idx.insert(slot(i % 37, i)).unwrap();
            model.insert((IdHash::new(i % 37), LogOffset::new(i)), slot(i % 37, i));
        }
        while idx.step(usize::MAX) {
            idx.settle();
        }
        assert!(idx.capacity() >= 4096, "grew to {}", idx.capacity());
        check(&idx, &model);
        assert_eq!(files(tmp.path()), vec!["ids"]);
        for i in 0..3000u64 {
            let (at, _) = idx.find(IdHash::new(i % 37), |o| o.get() == i).unwrap();
            idx.remove(at);
            model.remove(&(IdHash::new(i % 37), LogOffset::new(i)));
        }
        while idx.step(usize::MAX) {
            idx.settle();
        }
        assert_eq!(idx.capacity(), 64, "shrank back to the initial size");
        assert_eq!(idx.len(), 0);
        check(&idx, &model);
        assert_eq!(files(tmp.path()), vec!["ids"]);
        assert_eq!(fs::metadata(&path).unwrap().len(), table_bytes(64));
    }

    /// Resize work is timed and handed out once; operations while no resize runs add nothing.
    #[test]
    fn resize_work_is_timed_and_taken_once() {
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let mut idx = open_slow(&tmp.path().join("ids"));
        let (mut model, mut offset) = (BTreeMap::new(), 0u64);
        // 3/4 of the 64 slots start a resize; 40 do not.
        for _ in 0..40 {
            let s = slot(offset % 50, offset);
            offset += 1;
            idx.insert(s).unwrap();
            model.insert((s.hash, s.msg_offset), s);
        }
        assert!(!idx.is_migrating());
        assert_eq!(idx.take_resize_time(), Duration::ZERO, "no resize, no time");
        until_migrating(&mut idx, &mut model, &mut offset, 64);
        idx.take_resize_time();
        idx.insert(slot(offset % 50, offset)).unwrap();
        offset += 1;
        assert!(idx.take_resize_time() > Duration::ZERO, "an insert that copied slots was not timed");
        assert_eq!(idx.take_resize_time(), Duration::ZERO, "taken twice");
        while idx.step(usize::MAX) {
            idx.settle();
        }
        assert!(idx.take_resize_time() > Duration::ZERO, "the idle copy was not timed");
        idx.insert(slot(offset % 50, offset)).unwrap();
        assert!(!idx.step(16));
        assert_eq!(idx.take_resize_time(), Duration::ZERO, "timed with no resize under way");
    }

    /// Drives `idx` until a migration is under way from a table of at least `min_old` slots.
    fn until_migrating(idx: &mut IdIndex, model: &mut BTreeMap<Key, Slot>, offset: &mut u64, min_old: u64) {
        loop {
            idx.settle();
            if idx.from.as_ref().is_some_and(|m| m.table.slots >= min_old && m.cursor < m.table.slots / 2) {
                return;
            }
            let s = slot(*offset % 50, *offset);
            *offset += 1;
            idx.insert(s).unwrap();
            model.insert((s.hash, s.msg_offset), s);
        }
    }

    #[test]
    fn a_reopen_mid_migration_finishes_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ids");
        let mut idx = open_slow(&path);
        let (mut model, mut offset) = (BTreeMap::new(), 1);
        until_migrating(&mut idx, &mut model, &mut offset, 256);
        for k in model.keys().filter(|k| k.0 == IdHash::new(3)).copied().collect::<Vec<_>>() {
            let (at, _) = idx.find(k.0, |m| m == k.1).unwrap();
            idx.remove(at);
            model.remove(&k);
        }
        assert!(idx.from.is_some());
        let big = idx.capacity();
        drop(idx);
        assert_eq!(files(tmp.path()), vec!["ids", "ids.next"]);
        let idx = open_slow(&path);
        assert_eq!(files(tmp.path()), vec!["ids"]);
        assert_eq!(idx.capacity(), big);
        check(&idx, &model);
    }

    /// During a copy a new slot whose old home the copy has not reached goes into the old table
    /// (the copy carries it over), one behind the copy into the new table, and so does every one
    /// once the old table is 7/8 occupied; all stay findable through the copy and after it.
    #[test]
    fn inserts_ahead_of_the_copy_go_to_the_old_table() {
        let tmp = tempfile::tempdir().unwrap();
        let mut idx = open_slow(&tmp.path().join("ids"));
        let (mut model, mut offset) = (BTreeMap::new(), 1);
        until_migrating(&mut idx, &mut model, &mut offset, 256);
        let (n, cursor) = idx.from.as_ref().map(|m| (m.table.slots, m.cursor)).unwrap();
        assert!(cursor < n / 2);
        let in_old = |idx: &IdIndex, s: &Slot| idx.find(s.hash, |m| m == s.msg_offset).unwrap().0.in_old;
        let mut put = |idx: &mut IdIndex, home: u64, offset: &mut u64| {
            // A multiple of the old size on top: the home in the new table differs.
            let s = slot(home + n * 7, *offset);
            *offset += 1;
            idx.insert(s).unwrap();
            model.insert((s.hash, s.msg_offset), s);
            s
        };
        let ahead = put(&mut idx, (cursor + n) / 2, &mut offset);
        assert!(in_old(&idx, &ahead), "a slot ahead of the copy goes to the old table");
        let behind = put(&mut idx, cursor.saturating_sub(1), &mut offset);
        assert!(!in_old(&idx, &behind), "a slot behind the copy goes to the new table");
        let filled = idx.from.as_ref().unwrap().table.filled;
        idx.from.as_mut().unwrap().table.filled = n * 7 / 8;
        let ahead_full = put(&mut idx, (cursor + n) / 2 + 1, &mut offset);
        assert!(!in_old(&idx, &ahead_full), "a 7/8 occupied old table takes no more");
        idx.from.as_mut().unwrap().table.filled = filled;
        // The old table's last slot taken, a probe from it would wrap to the start, below the copy.
        let last = put(&mut idx, n - 1, &mut offset);
        let wraps = put(&mut idx, n - 1, &mut offset);
        assert!(in_old(&idx, &last) && !in_old(&idx, &wraps), "a probe past the end goes to the new table");
        check(&idx, &model);
        while idx.step(usize::MAX) {
            idx.settle();
        }
        assert!(idx.from.is_none());
        check(&idx, &model);
        for s in [ahead, behind, ahead_full, last, wraps] {
            assert!(!in_old(&idx, &s));
        }
    }

    /// Look-ups of absent ids in a fresh table read none of its never-written pages: during a
    /// resize they would otherwise fault the new table into the page cache at random.
    #[test]
    fn absent_ids_do_not_fault_in_pages_no_slot_was_written_to() {
        let tmp = tempfile::tempdir().unwrap();
        let mut idx = IdIndex::open(&tmp.path().join("ids"), 1 << 20, &Durability::new(Path::new("/"))).unwrap();
        let pages = idx.cur.file.len() as usize / 4096;
        for k in 0..10u64 {
            idx.insert(slot(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), k + 1)).unwrap();
        }
        let mut x = 1u64;
        for _ in 0..20_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            assert!(idx.find(IdHash::new(x), |_| true).is_none());
        }
        let resident = idx.cur.file.resident_pages();
        assert!(resident < pages / 10, "{resident} of {pages} pages faulted in by look-ups of absent ids");
    }

    fn page_mix(a: &[u8], b: &[u8], bits: &[bool]) -> Vec<u8> {
        assert_eq!(a.len(), b.len());
        let mut out = a.to_vec();
        for (p, chunk) in out.chunks_mut(4096).enumerate() {
            if bits[p % bits.len()] {
                let at = p * 4096;
                chunk.copy_from_slice(&b[at..at + chunk.len()]);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: crate::test_support::model_cases(24), ..ProptestConfig::default() })]

        /// Power loss mid-migration: each page of each file is either as flushed at the checkpoint
        /// (A) or as written later (B). Unless the start's check finds the table damaged (then it
        /// is rebuilt from the log), every message live at A and not removed since must come back
        /// exactly once, at a state no older than A's; nothing else may appear.
        #[test]
        fn a_power_loss_image_mid_migration_loses_nothing(
            after in prop::collection::vec(ops(4, 3), 10..40),
            bits in prop::collection::vec(any::<bool>(), 1..97),
        ) {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("live");
            fs::create_dir_all(&dir).unwrap();
            let mut idx = open_slow(&dir.join("ids"));
            let mut model = BTreeMap::new();
            let mut offset = 1;
            until_migrating(&mut idx, &mut model, &mut offset, 512);
            idx.flush().unwrap();
            let names = files(&dir);
            prop_assert_eq!(&names, &vec!["ids".to_string(), "ids.next".to_string()]);
            let at_a: Vec<Vec<u8>> = names.iter().map(|n| fs::read(dir.join(n)).unwrap()).collect();
            let model_a = model.clone();
            let mut versions: BTreeMap<Key, Vec<Slot>> = model.iter().map(|(k, s)| (*k, vec![*s])).collect();
            let mut removed = std::collections::BTreeSet::new();
            for op in after {
                match op {
                    Op::Insert(h) => {
                        let s = slot(h, offset);
                        offset += 1;
                        idx.insert(s).unwrap();
                        model.insert((s.hash, s.msg_offset), s);
                        versions.entry((s.hash, s.msg_offset)).or_default().push(s);
                    }
                    Op::Remove(i) => if let Some((h, o)) = pick(&model, i) {
                        let (at, _) = idx.find(h, |m| m == o).unwrap();
                        idx.remove(at);
                        model.remove(&(h, o));
                        removed.insert((h, o));
                    },
                    Op::Update(i) => if let Some((h, o)) = pick(&model, i) {
                        let (at, mut s) = idx.find(h, |m| m == o).unwrap();
                        s.seq += 1;
                        s.last_offset = LogOffset::new(offset);
                        offset += 1;
                        s.state = State::Ready;
                        idx.update(at, s);
                        model.insert((h, o), s);
                        versions.entry((h, o)).or_default().push(s);
                    },
                    _ => {}
                }
            }
            prop_assert!(idx.from.is_some(), "still migrating at B");
            prop_assert_eq!(files(&dir), names.clone());
            let crash = tmp.path().join("crash");
            fs::create_dir_all(&crash).unwrap();
            for (n, a) in names.iter().zip(&at_a) {
                let b = fs::read(dir.join(n)).unwrap();
                fs::write(crash.join(n), page_mix(a, &b, &bits)).unwrap();
            }
            // A page lost from the middle of a run of slots filled since A leaves the slots after
            // it off their probe path: the open refuses such a table (the store rebuilds the index
            // from the log) rather than merge it, which would copy their messages a second time.
            let back = match IdIndex::open(&crash.join("ids"), 64, &Durability::new(Path::new("/"))) {
                Err(Error::Corrupt { reason, .. }) if reason.contains("probe path") => return Ok(()),
                other => other.unwrap(),
            };
            prop_assert_eq!(files(&crash), vec!["ids".to_string()]);
            let checked = back.check_part(0, 1, |_| {});
            prop_assert!(checked.is_ok(), "the merged table fails its check: {:?}", checked);
            let mut seen = BTreeMap::new();
            back.for_each(|s| assert!(seen.insert((s.hash, s.msg_offset), s).is_none(), "twice: {s:?}"));
            prop_assert_eq!(back.len(), seen.len() as u64);
            for (k, s) in &seen {
                let known = versions.get(k).is_some_and(|v| v.contains(s));
                prop_assert!(known, "{:?} is no version the message ever had", s);
            }
            for (k, a) in &model_a {
                if removed.contains(k) {
                    continue;
                }
                let got = seen.get(k);
                prop_assert!(got.is_some_and(|g| g.last_offset >= a.last_offset), "{:?} lost or older than A: {:?}", k, got);
                let (_, found) = back.find(k.0, |m| m == k.1).unwrap();
                prop_assert_eq!(Some(&found), got);
            }
        }
    }

    #[test]
    fn a_prepared_but_unused_next_table_is_merged_at_open() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("live");
        fs::create_dir_all(&dir).unwrap();
        let mut idx = open_slow(&dir.join("ids"));
        let mut model = BTreeMap::new();
        let mut i = 0u64;
        while !matches!(idx.job, Some(Job::Prepare { .. })) {
            idx.insert(slot(i % 9, i)).unwrap();
            model.insert((IdHash::new(i % 9), LogOffset::new(i)), slot(i % 9, i));
            i += 1;
        }
        while !matches!(&idx.job, Some(Job::Prepare { thread, .. }) if thread.is_finished()) {
            std::thread::yield_now();
        }
        // The crash image: `ids` with every slot, a fresh empty `ids.next` nobody used yet.
        let copy = tmp.path().join("copy");
        copy_dir(&dir, &copy);
        assert_eq!(files(&copy), vec!["ids", "ids.next"]);
        let back = open_slow(&copy.join("ids"));
        check(&back, &model);
        assert_eq!(back.capacity(), 128, "the merge kept the larger table");
        drop(idx);
        assert_eq!(files(&dir), vec!["ids"], "drop removes an unused next table");
    }

    #[test]
    fn a_damaged_header_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        drop(IdIndex::open(&path, 64, &Durability::new(Path::new("/"))).unwrap());
        let mut b = fs::read(&path).unwrap();
        b[0] = b'X';
        fs::write(&path, &b).unwrap();
        assert!(matches!(
            IdIndex::open(&path, 64, &Durability::new(Path::new("/"))),
            Err(Error::Corrupt { .. })
        ));
        // A version-1 file is refused too (the store rebuilds the index from the log).
        b[0] = b'D';
        b[4] = 1;
        fs::write(&path, &b).unwrap();
        assert!(matches!(
            IdIndex::open(&path, 64, &Durability::new(Path::new("/"))),
            Err(Error::Corrupt { .. })
        ));
    }

    #[test]
    fn a_damaged_next_table_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        drop(IdIndex::open(&path, 64, &Durability::new(Path::new("/"))).unwrap());
        fs::write(dir.path().join("ids.next"), b"DLYX").unwrap();
        assert!(matches!(
            IdIndex::open(&path, 64, &Durability::new(Path::new("/"))),
            Err(Error::Corrupt { .. })
        ));
        // Without `ids` (deleted to force a rebuild) a stale next table is discarded.
        fs::remove_file(&path).unwrap();
        let idx = IdIndex::open(&path, 64, &Durability::new(Path::new("/"))).unwrap();
        assert!(idx.is_empty());
        assert_eq!(files(dir.path()), vec!["ids"]);
    }
}
