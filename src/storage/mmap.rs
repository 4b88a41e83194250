//! Preallocated files mapped read-write (with `sys.rs`, the only `unsafe` in the crate).
//!
//! Files are preallocated with `posix_fallocate` before mapping, and before they are grown and
//! mapped again, so writes into the map never hit a sparse hole (which on a full disk raises SIGBUS
//! instead of an error). A file is never truncated or shrunk while mapped.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use super::durability::Durability;
use super::io;
use crate::error::{Error, Result};

/// A preallocated file, mapped shared and writable; it only ever grows.
pub struct MappedFile {
    path: PathBuf,
    file: File,
    /// The mapping: the file's length, or more when opened with room to grow into.
    map: MmapMut,
    /// Bytes of the file, all of them mapped. Pages of the mapping past the file's end raise
    /// SIGBUS when touched, so nothing past `len` is ever handed out.
    len: usize,
    /// The store's durability owner, which every sync of this file reports to.
    durability: Durability,
}

impl MappedFile {
    /// Opens `path`, creating and preallocating it to `len` bytes when new or shorter.
    ///
    /// A file this call created is removed again when it cannot be preallocated, so a full disk
    /// leaves no partial file behind.
    pub fn open(path: &Path, len: u64, durability: &Durability) -> Result<MappedFile> {
        Self::map(path, open_preallocated(path, len)?, durability)
    }

    /// Drops this mapping's page-table entries a megabyte at a time (the file and its page cache
    /// are untouched), so the final unmap is quick. An unmap holds the process's mmap lock for
    /// writing while it tears down every entry, and page faults on every other thread wait for it:
    /// unmapping a 256 MiB table in one go stalled the engine for 60 ms.
    pub fn release_pages(&self) {
        const CHUNK: usize = 1 << 20;
        let mut at = 0;
        while at < self.map.len() {
            let len = CHUNK.min(self.map.len() - at);
            // SAFETY: the mapping is shared and file-backed, so dropping its pages loses nothing:
            // later reads fault the same bytes back in from the page cache or the file.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, len) };
            at += len;
        }
    }

    /// Tells the kernel that `[offset, offset + len)` (page-aligned inward) will not be used
    /// again soon (MADV_COLD): under memory pressure its pages are reclaimed before pages still
    /// in use that were merely touched less often, any dirty ones being written back first. The
    /// bytes are unaffected; a later access faults them back in. Ignored where unsupported.
    pub fn advise_cold(&self, offset: usize, len: usize) {
        let start = offset.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let end = offset.saturating_add(len).min(self.map.len()) / PAGE_BYTES * PAGE_BYTES;
        if end <= start {
            return;
        }
        // SAFETY: the range lies inside this mapping and MADV_COLD only changes which pages
        // the kernel reclaims first, never the mapping's contents.
        let _ = unsafe { libc::madvise(self.map.as_ptr().add(start) as *mut libc::c_void, end - start, libc::MADV_COLD) };
    }

    /// Pages of the mapping in the page cache (mincore), for tests of what a caller touched.
    #[cfg(test)]
    pub fn resident_pages(&self) -> usize {
        let mut vec = vec![0u8; self.map.len().div_ceil(PAGE_BYTES)];
        // SAFETY: the range is this live mapping; `vec` has a byte per page of it.
        let rc = unsafe { libc::mincore(self.map.as_ptr() as *mut libc::c_void, self.map.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|b| *b & 1 != 0).count()
    }

    /// Opens an existing file at its current length.
    pub fn open_existing(path: &Path, durability: &Durability) -> Result<MappedFile> {
        let file = open_rw(path, false)?;
        Self::map(path, file, durability)
    }

    /// Opens an existing file, mapped `room` bytes long when that is more than the file holds, so
    /// that [`grow`](Self::grow) up to `room` only extends the file. A remap takes the process's
    /// mmap lock for writing, which waits for every page fault under way in the process and
    /// holds off new ones: a queue file grown by remapping it (9 times from its first size to
    /// its full one) put the engine thread to sleep hundreds of times in one step.
    pub fn open_existing_with_room(path: &Path, room: u64, durability: &Durability) -> Result<MappedFile> {
        let file = open_rw(path, false)?;
        let len = file.metadata().map_err(|e| Error::io_at("stat", path, e))?.len();
        if room <= len {
            return Self::map(path, file, durability);
        }
        let (len, room) = match (usize::try_from(len), usize::try_from(room)) {
            (Ok(len), Ok(room)) => (len, room),
            _ => return Err(Error::io_at("mmap", path, std::io::Error::from(std::io::ErrorKind::InvalidInput))),
        };
        let map = map_len(path, &file, room)?;
        Ok(MappedFile { path: path.to_path_buf(), file, map, len, durability: durability.clone() })
    }

    fn map(path: &Path, file: File, durability: &Durability) -> Result<MappedFile> {
        let map = map_whole(path, &file)?;
        let len = map.len();
        Ok(MappedFile { path: path.to_path_buf(), file, map, len, durability: durability.clone() })
    }

    /// Preallocates the file to `len` bytes, mapping it again only past the room it was mapped
    /// with; never shrinks it.
    ///
    /// A crash after the preallocation leaves a longer file of zeros past the old end, which
    /// readers already take as unwritten.
    pub fn grow(&mut self, len: u64) -> Result<()> {
        if len <= self.len() {
            return Ok(());
        }
        io::preallocate(&self.file, &self.path, len)
            .map_err(|e| Error::io_at("preallocate", &self.path, e))?;
        match usize::try_from(len) {
            // Opened with room for it: the mapping already covers the new bytes.
            Ok(len) if len <= self.map.len() => self.len = len,
            _ => {
                // The old mapping stays valid until the new one replaces it (the file only grew).
                self.map = map_whole(&self.path, &self.file)?;
                self.len = self.map.len();
            }
        }
        Ok(())
    }

    /// Length of the file in bytes: what the mapping hands out.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// True for a zero-length file.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's bytes, through the mapping.
    pub fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// The file's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records that the file was renamed to `path` (the mapping itself is unaffected).
    pub fn set_path(&mut self, path: &Path) {
        self.path = path.to_path_buf();
    }

    /// Writes `data` at `offset`; the caller checks bounds against [`len`](Self::len).
    pub fn write_at(&mut self, offset: usize, data: &[u8]) {
        self.bytes_mut()[offset..offset + data.len()].copy_from_slice(data);
    }

    /// Writes `data` at `offset` with pwrite rather than a store into the mapping.
    ///
    /// Every sync cleans the pages it writes and write-protects their mappings, so the next store
    /// into each takes a fault (page_mkwrite, ~20 µs on a VM). Small writes scattered over a large
    /// file (the id index) would take one per write after every checkpoint; pwrite copies into the
    /// same page-cache page, which the mapping shows, with no fault. If pwrite fails the store is
    /// done instead: the page is the same either way, and a failing device shows at the next sync.
    pub fn write_through(&mut self, offset: usize, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        let mut done = 0;
        while done < data.len() {
            match self.file.write_at(&data[done..], (offset + done) as u64) {
                Ok(n) if n > 0 => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        if done < data.len() {
            self.bytes_mut()[offset + done..offset + data.len()].copy_from_slice(&data[done..]);
        }
    }

    /// Writes a small piece of a file written at scattered places: with pwrite while its page
    /// is cold since the last sync, with a store into the mapping once it is hot (see
    /// [`WriteHeat`]). The bytes land in the same page-cache page either way.
    pub fn write_scattered(&mut self, heat: &mut WriteHeat, offset: usize, data: &[u8]) {
        if heat.touch(offset) {
            self.write_at(offset, data);
        } else {
            self.write_through(offset, data);
        }
    }

    /// Makes `[offset, offset + len)` durable (msync, page-aligned by memmap2).
    pub fn flush_range(&self, offset: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if offset.saturating_add(len) > self.len {
            return Err(Error::io_at("msync", &self.path, std::io::Error::from(std::io::ErrorKind::InvalidInput)));
        }
        io::msync(&self.map, &self.path, offset, len, &self.durability)
            .map_err(|e| Error::io_at("msync", &self.path, e))?;
        #[cfg(test)]
        super::synced::note(&self.file, Some(&self.path), Some((offset as u64, len as u64)));
        Ok(())
    }

    /// Makes the file's written pages durable with fdatasync.
    ///
    /// On Linux, msync(MS_SYNC) is itself an fsync of the file range, and writes through a shared
    /// mapping dirty the page cache like write(2) does, so fdatasync covers them; it skips
    /// msync's walk of the mapping and measured cheaper here.
    pub fn sync_data(&self) -> Result<()> {
        io::sync_data(&self.file, &self.path, &self.durability)
            .map_err(|e| Error::io_at("fdatasync", &self.path, e))
    }

    /// Byte ranges at or after `from` that may hold data: the file's allocated, written extents
    /// (SEEK_DATA/SEEK_HOLE), so recovery scans skip preallocated space without reading it.
    /// Falls back to the whole rest of the file where the filesystem cannot tell.
    pub fn data_ranges(&self, from: usize) -> Vec<(usize, usize)> {
        let len = self.len;
        let fd = self.file.as_raw_fd();
        let mut out = Vec::new();
        let mut pos = from;
        while pos < len {
            // SAFETY: plain syscalls on an fd we own; offsets are within the file.
            let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                    out.push((pos, len));
                }
                break;
            }
            let data = (data as usize).min(len);
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
            let hole = if hole < 0 { len } else { (hole as usize).min(len) };
            if hole <= data {
                break;
            }
            out.push((data, hole));
            pos = hole;
        }
        out
    }

    /// Offset of the last non-zero byte at or after `from`, visiting only data ranges.
    pub fn last_nonzero(&self, from: usize) -> Option<usize> {
        let bytes = self.bytes();
        for (a, b) in self.data_ranges(from).into_iter().rev() {
            let region = &bytes[a..b];
            // Whole 64-byte blocks first (vectorised), then the bytes of the last non-zero block.
            let mut end = region.len();
            while end >= 64 && region[end - 64..end].iter().all(|x| *x == 0) {
                end -= 64;
            }
            if let Some(i) = region[..end].iter().rposition(|x| *x != 0) {
                return Some(a + i);
            }
        }
        None
    }

    /// A new open file description of this file (not a dup, which would share one), so another
    /// thread can sync it while the map is written and learn of every writeback error itself.
    /// Opened through `/proc/self/fd`, it names this very file even after a rename.
    pub fn handle(&self) -> Result<SyncFile> {
        let proc = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        let file = match std::fs::File::open(&proc) {
            Ok(f) => Ok(f),
            // No /proc: open the path (the file is not renamed while a handle is taken).
            Err(_) => io::open(OpenOptions::new().read(true), &self.path),
        };
        file.map(|file| SyncFile { file, path: self.path.clone(), durability: self.durability.clone() })
            .map_err(|e| Error::io_at("open", &self.path, e))
    }

    /// Makes the whole mapping durable.
    pub fn flush(&self) -> Result<()> {
        io::msync(&self.map, &self.path, 0, self.len, &self.durability)
            .map_err(|e| Error::io_at("msync", &self.path, e))?;
        #[cfg(test)]
        super::synced::note(&self.file, Some(&self.path), None);
        Ok(())
    }

    /// fsyncs file metadata too (after creation).
    pub fn sync_all(&self) -> Result<()> {
        io::sync_all(&self.file, &self.path, &self.durability)
            .map_err(|e| Error::io_at("fsync", &self.path, e))
    }

    /// The durability owner this file's syncs report to.
    pub fn durability(&self) -> &Durability {
        &self.durability
    }
}

/// Maps the first `len` bytes of `file`, shared and writable, even past its end (see
/// [`MappedFile::open_existing_with_room`]).
fn map_len(path: &Path, file: &File, len: usize) -> Result<MmapMut> {
    // SAFETY: as for `map_whole`; in addition, pages past the file's end are never touched:
    // `MappedFile` hands out only its first `len` bytes, which the file holds.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }
        .map_err(|e| Error::io_at("mmap", path, e))?;
    let _ = map.advise(memmap2::Advice::Random);
    Ok(map)
}

/// Maps all of `file`, shared and writable.
fn map_whole(path: &Path, file: &File) -> Result<MmapMut> {
    // SAFETY: delayd owns the data directory (guarded by the LOCK file) and never truncates a file
    // while it is mapped, so the mapping stays valid for its lifetime. Other processes modifying
    // the files underneath us is outside the supported model.
    let map = unsafe { MmapMut::map_mut(file) }.map_err(|e| Error::io_at("mmap", path, e))?;
    // MADV_RANDOM turns off fault-around readahead, so faults map single pages instead of
    // large folios. With large folios (ext4 on recent kernels) one 20-byte queue entry or
    // index slot dirtied a whole folio and every fdatasync wrote it back: measured here, a
    // 64-writer sync load wrote ~3.5 GB/s and ran at 60-70k msgs/s; with this, 28 MB/s and
    // 91k msgs/s. The cost: no readahead on cold sequential reads of a queue after a restart.
    // Advice is a hint: failure to apply it changes speed, not correctness.
    let _ = map.advise(memmap2::Advice::Random);
    Ok(map)
}

/// How a file written in small pieces at scattered places should take each write, page by page.
///
/// A sync cleans the pages it writes and write-protects their mappings, so the first store into
/// each afterwards faults (page_mkwrite, ~20 µs on a VM); later stores into it are plain memory
/// writes until the next sync. A pwrite never faults but is a system call every time (~3 µs
/// through ext4 here). So a page written a few times between syncs is best written with pwrite,
/// and one written often with stores: after [`HOT_WRITES`] pwrites to a page since the last
/// [`cool`](Self::cool), it takes stores. A page then costs at most its pwrites plus one fault
/// per sync, where stores alone could cost a fault per write (a table written at random) and
/// pwrite alone a system call per write (a table written densely: at 36,000 ids/s into a small
/// index, pwrite was an eighth of the server's CPU).
///
/// Counts are kept per page number modulo a fixed table, so the memory is the same whatever the
/// file's size; two pages that share a count only turn hot sooner. The choice never affects what
/// is written, only how: a page counted hot after the kernel's own writeback cleaned it costs one
/// fault. In a table much larger than the counts, nearly every write is a store; a count for
/// every page instead (nearly every write a pwrite, 0.05 faults a message against 0.66) made
/// batches into a 30-million index about a tenth slower (docs/benchmarks.md, 2026-12-08).
pub struct WriteHeat {
    counts: Box<[u8; HEAT_PAGES]>,
}

/// Pages tracked apart by [`WriteHeat`] (4 KiB of counts).
const HEAT_PAGES: usize = 4096;
/// pwrites to a page since the last sync after which it takes stores.
const HOT_WRITES: u8 = 4;
/// The page size the counts assume; a larger real page only merges counts.
const HEAT_PAGE_BYTES: usize = PAGE_BYTES;
/// The page size page-granular advice and residency counts assume (x86-64 and most arm64).
const PAGE_BYTES: usize = 4096;

impl Default for WriteHeat {
    fn default() -> Self {
        WriteHeat { counts: Box::new([0; HEAT_PAGES]) }
    }
}

impl WriteHeat {
    /// Counts a write at `offset`; true when its page should take a store.
    pub fn touch(&mut self, offset: usize) -> bool {
        let c = &mut self.counts[(offset / HEAT_PAGE_BYTES) % HEAT_PAGES];
        if *c >= HOT_WRITES {
            return true;
        }
        *c += 1;
        false
    }

    /// Forgets the counts: call when a sync of the file begins, since it write-protects again
    /// every page it cleans.
    pub fn cool(&mut self) {
        self.counts.fill(0);
    }
}

/// Opens `path`, creating and preallocating it to `len` bytes when new or shorter; a file this
/// call created is removed again when it cannot be preallocated.
fn open_preallocated(path: &Path, len: u64) -> Result<File> {
    let existed = path.exists();
    let file = open_rw(path, true)?;
    let cur = file.metadata().map_err(|e| Error::io_at("stat", path, e))?.len();
    if cur < len {
        if let Err(e) = io::preallocate(&file, path, len) {
            if !existed {
                drop(file);
                let _ = io::remove_file(path);
            }
            return Err(Error::io_at("preallocate", path, e));
        }
    }
    Ok(file)
}

/// Creates the file `path` preallocated to `len` bytes (as [`MappedFile::open`] does) and makes it
/// and its directory entry durable, without mapping it: for a helper thread making a file ahead
/// of need, whose map and unmap would only cost the process's other threads.
pub fn create_durably(path: &Path, len: u64, durability: &Durability) -> Result<()> {
    let file = open_preallocated(path, len)?;
    io::sync_all(&file, path, durability).map_err(|e| Error::io_at("fsync", path, e))?;
    // Closed before the directory is opened: a helper making a file ahead holds one handle at a
    // time, which is what `open_queues` budgets for.
    drop(file);
    match path.parent() {
        Some(dir) => sync_dir(dir, durability),
        None => Ok(()),
    }
}

/// A file being made durably on a helper thread ahead of need (by [`create_durably`] and whatever
/// must precede it), so that the thread that needs it only opens it. Dropping it waits for the
/// helper: none outlives its owner, nor creates a file in a directory its owner removes.
pub struct MadeAhead {
    at: u64,
    job: Option<std::thread::JoinHandle<Result<()>>>,
}

impl MadeAhead {
    /// Runs `job` on a thread named `name` for the file its owner calls `at`; `None` when no thread
    /// could start, and the owner makes the file itself when it needs it.
    pub fn start(
        name: &str,
        at: u64,
        job: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Option<MadeAhead> {
        match std::thread::Builder::new().name(name.into()).spawn(job) {
            Ok(job) => Some(MadeAhead { at, job: Some(job) }),
            Err(e) => {
                tracing::warn!(error = %e, thread = name, "cannot start a thread to make a file ahead");
                None
            }
        }
    }

    /// Waits for the helper; true if it made the file `at` durably. Otherwise the caller makes it
    /// and meets what the helper met (a failed sync has already poisoned the store).
    pub fn made(mut self, at: u64) -> bool {
        let done = self.job.take().map(std::thread::JoinHandle::join);
        self.at == at && matches!(done, Some(Ok(Ok(()))))
    }
}

impl Drop for MadeAhead {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            let _ = job.join();
        }
    }
}

/// Opens `path` for reading and writing, creating it (never truncating) when `create` is set.
fn open_rw(path: &Path, create: bool) -> Result<File> {
    // 0600 whatever the umask: log segments hold push subscriptions' secrets.
    io::open(OpenOptions::new().read(true).write(true).create(create).truncate(false).mode(0o600), path)
        .map_err(|e| Error::io_at("open", path, e))
}

/// fdatasyncs the file at `path` through a new handle. Pages written through a mapping that is
/// gone are still the file's dirty pages, so this makes them durable too.
pub fn sync_path(path: &Path, durability: &Durability) -> Result<()> {
    let f = io::open(OpenOptions::new().read(true), path).map_err(|e| Error::io_at("open", path, e))?;
    io::sync_data(&f, path, durability).map_err(|e| Error::io_at("fdatasync", path, e))
}

/// fsyncs a directory so a create, rename or delete in it survives power loss.
pub fn sync_dir(dir: &Path, durability: &Durability) -> Result<()> {
    let f = io::open(OpenOptions::new().read(true), dir).map_err(|e| Error::io_at("open dir", dir, e))?;
    io::sync_all(&f, dir, durability).map_err(|e| Error::io_at("fsync dir", dir, e))
}

/// A file handle of its own (its own open file description) with the path it names, for syncing
/// on another thread.
pub struct SyncFile {
    file: File,
    path: PathBuf,
    durability: Durability,
}

impl SyncFile {
    /// Opens `path` read-only: enough to fdatasync it.
    pub fn open(path: &Path, durability: &Durability) -> Result<SyncFile> {
        io::open(OpenOptions::new().read(true), path)
            .map(|file| SyncFile { file, path: path.to_path_buf(), durability: durability.clone() })
            .map_err(|e| Error::io_at("open", path, e))
    }

    /// fdatasync, under the store's durability owner.
    pub fn sync_data(&self) -> Result<()> {
        io::sync_data(&self.file, &self.path, &self.durability)
            .map_err(|e| Error::io_at("fdatasync", &self.path, e))
    }

    /// fsync (data and metadata: a size grown by preallocation), under the store's durability owner.
    pub fn sync_all(&self) -> Result<()> {
        io::sync_all(&self.file, &self.path, &self.durability)
            .map_err(|e| Error::io_at("fsync", &self.path, e))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file, to read from (a backup copies through it while the file may be deleted).
    pub fn into_file(self) -> File {
        self.file
    }
}

/// An exclusive advisory lock on a file, held for the life of the value.
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Takes `flock(LOCK_EX | LOCK_NB)` on `path`; fails at once if another process holds it.
    pub fn acquire(path: &Path) -> Result<DirLock> {
        let file = open_rw(path, true)?;
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Error::Unavailable(format!(
                    "data directory is in use by another delayd process (lock held on {})",
                    path.display()
                )));
            }
            return Err(Error::io_at("flock", path, err));
        }
        use std::io::Write;
        let _ = file.set_len(0);
        let mut f = &file;
        let _ = f.write_all(format!("{}\n", std::process::id()).as_bytes());
        Ok(DirLock { _file: file })
    }
}

/// CPU time of the calling thread, ns (0 if the clock cannot be read). Here because this module
/// holds the crate's system calls; the engine loop uses it to tell its own work from time other
/// processes take the CPU away.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// Page faults and context switches of the calling thread so far: (minor faults, major faults,
/// voluntary switches (it blocked), involuntary switches (it was preempted)); zeros if unknown.
pub fn thread_switches() -> [u64; 4] {
    // SAFETY: an all-zero rusage is valid, and the call only fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage for the call to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return [0; 4];
    }
    [ru.ru_minflt, ru.ru_majflt, ru.ru_nvcsw, ru.ru_nivcsw].map(|v| v.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_takes_pwrites_until_it_is_hot_and_again_after_a_sync() {
        let mut heat = WriteHeat::default();
        let page = 7 * HEAT_PAGE_BYTES;
        for _ in 0..HOT_WRITES {
            assert!(!heat.touch(page + 32), "cold: pwrite");
        }
        assert!(heat.touch(page + 4000), "hot after {HOT_WRITES} writes anywhere in the page: store");
        assert!(!heat.touch(page + HEAT_PAGE_BYTES), "the next page keeps its own count");
        // A page that shares the count is hot as well: the table has a fixed size.
        assert!(heat.touch(page + HEAT_PAGES * HEAT_PAGE_BYTES));
        heat.cool();
        assert!(!heat.touch(page), "a sync write-protects the page again: back to pwrite");
    }

    /// Pages marked cold keep their bytes, written back or not, and take writes again; a range
    /// past the end or inside one page is ignored.
    #[test]
    fn pages_marked_cold_keep_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = MappedFile::open(&path, 64 << 10, &Durability::new(dir.path())).unwrap();
        let data: Vec<u8> = (0..64 << 10).map(|i: u32| (i % 251) as u8).collect();
        f.write_at(0, &data);
        f.flush().unwrap();
        f.write_at(5000, b"written after the sync");
        let mut want = data.clone();
        want[5000..5022].copy_from_slice(b"written after the sync");
        f.advise_cold(100, 40 << 10);
        f.advise_cold(60 << 10, 1 << 20);
        f.advise_cold(8192 + 1, 100);
        assert_eq!(f.bytes(), &want[..]);
        f.write_at(4096, b"again");
        want[4096..4101].copy_from_slice(b"again");
        f.flush().unwrap();
        drop(f);
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }

    /// Opened with room, the file grows up to it in place (the same mapping) and shows only what
    /// the file holds; past the room it is mapped again.
    #[test]
    fn a_file_opened_with_room_grows_in_place_and_shows_only_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let d = Durability::new(dir.path());
        drop(MappedFile::open(&path, 4096, &d).unwrap());
        let mut f = MappedFile::open_existing_with_room(&path, 64 << 10, &d).unwrap();
        assert_eq!((f.len(), f.bytes().len()), (4096, 4096));
        f.write_at(10, b"head");
        let at = f.bytes().as_ptr();
        f.grow(16 << 10).unwrap();
        assert_eq!(f.bytes().as_ptr(), at, "grown within its room, the file was mapped again");
        assert_eq!((f.len(), f.bytes().len()), (16 << 10, 16 << 10));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 << 10);
        assert!(f.bytes()[4096..].iter().all(|b| *b == 0), "the grown part reads as zeroes");
        f.write_at((16 << 10) - 4, b"tail");
        f.flush().unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!((&on_disk[10..14], &on_disk[(16 << 10) - 4..]), (&b"head"[..], &b"tail"[..]));
        // Past the room: mapped again, at the new length, with what was written.
        f.grow(128 << 10).unwrap();
        assert_eq!((f.len(), f.bytes().len()), (128 << 10, 128 << 10));
        assert_eq!(&f.bytes()[10..14], b"head");
        f.write_at((128 << 10) - 4, b"last");
        assert_eq!(f.last_nonzero(0), Some((128 << 10) - 1));
        // Room less than the file: the file's own length.
        let g = MappedFile::open_existing_with_room(&path, 4096, &d).unwrap();
        assert_eq!(g.len(), 128 << 10);
    }

    #[test]
    fn scattered_writes_land_in_the_file_whichever_way_they_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut file =
            MappedFile::open(&path, 4 * HEAT_PAGE_BYTES as u64, &Durability::new(dir.path())).unwrap();
        let mut heat = WriteHeat::default();
        // Enough writes to one page that the later ones are stores, one to another page (a pwrite).
        for i in 0..2 * HOT_WRITES as usize {
            file.write_scattered(&mut heat, HEAT_PAGE_BYTES + i * 8, &(i as u64 + 1).to_le_bytes());
        }
        file.write_scattered(&mut heat, 3 * HEAT_PAGE_BYTES, b"last");
        let on_disk = std::fs::read(&path).unwrap();
        for (i, chunk) in on_disk[HEAT_PAGE_BYTES..][..2 * HOT_WRITES as usize * 8].chunks(8).enumerate() {
            assert_eq!(chunk, &(i as u64 + 1).to_le_bytes(), "write {i}");
        }
        assert_eq!(&on_disk[3 * HEAT_PAGE_BYTES..][..4], b"last");
        assert_eq!(&file.bytes()[3 * HEAT_PAGE_BYTES..][..4], b"last", "the mapping shows the pwrite");
    }
}
