//! The commit log: preallocated, mapped segment files named by the global offset of their first byte.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::durability::Durability;
use super::format::{self, DecodeError, Kind, Record, HEADER_BYTES};
use super::mmap::{create_durably, sync_dir, MadeAhead, MappedFile};
use super::warmer::Warmer;
use crate::error::{Error, Result};

/// A way of decoding a record (checked, or for its fields only).
type Decoder<'a> = fn(&'a [u8]) -> Result<(Record<'a>, usize), DecodeError>;
/// What recovery does when it finds a bad record with valid records after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecoveryMode {
    /// Refuse to open and report the offset: the bad bytes are in the middle of acknowledged data.
    #[default]
    Strict,
    /// Truncate at the first bad record, dropping what follows, and log exactly what was dropped.
    Truncate,
}

/// What [`CommitLog::open`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Offset one past the last valid record.
    pub end: u64,
    /// Offset of the first invalid record, if the scan stopped on one rather than on zeroes.
    pub bad_offset: Option<u64>,
    /// Why that record was invalid.
    pub reason: Option<String>,
    /// Non-zero bytes cleared after the end (a torn tail, or corruption in Truncate mode).
    pub bytes_dropped: u64,
    /// Valid-looking records found after the bad one (non-zero means mid-log corruption).
    pub records_after_bad: u64,
    /// The furthest offset a checkpoint or clean-shutdown marker said was durable, when the log
    /// ends before it (only in `truncate` mode; `strict` refuses to open).
    pub claimed_end: Option<u64>,
    /// Bytes between the recovered end and [`claimed_end`](Self::claimed_end): records that were
    /// durable (and possibly acknowledged) and are gone.
    pub durable_bytes_lost: u64,
}

/// An offset up to which some file says the commit log was durable, and which file says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableClaim {
    /// The log offset the file vouches for (every byte below it was fdatasynced).
    pub offset: u64,
    /// Which file and field, for the error message (e.g. "checkpoint (dispatched)").
    pub source: String,
}

struct Segment {
    base: u64,
    file: MappedFile,
}

impl Segment {
    fn end(&self) -> u64 {
        self.base + self.file.len()
    }
}

/// An append-only log of CRC-checked records over mapped segment files.
pub struct CommitLog {
    dir: PathBuf,
    segment_bytes: u64,
    segments: Vec<Segment>,
    write_pos: u64,
    /// Owns the offset below which the log is durable, whichever thread synced it.
    durability: Durability,
    /// Zero-fills the active segment ahead of `write_pos` (see `warmer.rs`).
    warmer: Option<Warmer>,
    /// File-relative offset in the active segment below which appends need not ask the warmer.
    warm_guard: u64,
    /// Until when making the next segment is not tried again for a new message, and what refused
    /// it last time: on a full disk every produce would otherwise preallocate (and give back) a
    /// whole segment.
    roll_refused: Option<(Instant, (String, Option<std::path::PathBuf>), i32)>,
    /// The next segment (by base), being made on a helper thread.
    next: Option<MadeAhead>,
}

/// How long a next segment refused for want of space or file handles is not tried again.
const ROLL_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Largest tail reserve of a segment: room for ~60,000 state changes.
pub const TAIL_RESERVE_MAX_BYTES: u64 = 4 << 20;

/// Name of the segment file starting at `base`: 20 digits, so names sort like offsets.
pub fn segment_name(base: u64) -> String {
    format!("{base:020}")
}

impl CommitLog {
    /// Opens the log in `dir`, scanning for the end from the start of the segment holding
    /// `scan_from` (a known record boundary).
    ///
    /// `claims` are offsets other files say were durable (the checkpoint, the clean-shutdown
    /// marker). A log that ends before one of them lost records that may have been acknowledged:
    /// `strict` refuses to open (before changing any byte), `truncate` opens and reports the loss.
    pub fn open(
        dir: &Path,
        segment_bytes: u64,
        scan_from: u64,
        mode: RecoveryMode,
        claims: &[DurableClaim],
        durability: Durability,
    ) -> Result<(CommitLog, RecoveryReport)> {
        fs::create_dir_all(dir).map_err(|e| Error::io_at("create", dir, e))?;
        let bases = list_numbered(dir)?;
        let last_on_disk = newest_on_disk(dir, &bases)?;
        let claim = claims.iter().max_by_key(|c| c.offset);
        if let (Some(claim), Some(newest)) = (claim, &last_on_disk) {
            if mode == RecoveryMode::Strict {
                refuse_cut_newest(newest, claim)?;
            }
        }
        let segments = open_segments(dir, &bases, segment_bytes, &durability)?;
        let mut log = CommitLog {
            dir: dir.to_path_buf(),
            segment_bytes,
            segments,
            write_pos: 0,
            durability,
            warmer: None,
            warm_guard: 0,
            roll_refused: None,
            next: None,
        };
        let start = log.scan_start(scan_from);
        // A clean marker's end is a claim like the checkpoint's, not a licence to skip the scan:
        // it says what the log held at shutdown, not that it still does (a segment cut or zeroed
        // since reads as a clean end right there). The scan costs at most one segment.
        let report = log.recover(start, mode, claim)?;
        log.write_pos = report.end;
        // What recovery kept is on disk (it read it back from there).
        log.durability.log_synced(report.end);
        log.drop_segments_after(report.end)?;
        log.warmer = Warmer::start(segment_bytes, log.durability.clone());
        log.warm_active();
        Ok((log, report))
    }

    /// Where the recovery scan starts: the start of the segment holding `scan_from`.
    fn scan_start(&self, scan_from: u64) -> u64 {
        // Scan from the start of the segment holding the checkpoint rather than the checkpoint
        // itself: it costs at most one segment and also re-checks what the checkpoint covers there,
        // so a log that lost bytes the checkpoint thought durable is cut, not trusted.
        let first = self.segments[0].base;
        match self.locate(scan_from.max(first)) {
            Some((i, _)) => self.segments[i].base,
            None => self.segments.last().map_or(first, |s| s.base),
        }
    }

    /// Finds the log's end from `start`, weighs it against `claim` and clears what lies after it.
    fn recover(
        &mut self,
        start: u64,
        mode: RecoveryMode,
        claim: Option<&DurableClaim>,
    ) -> Result<RecoveryReport> {
        let (end, bad, reason) = self.scan_end(start);
        if reason.as_deref() == Some("unsupported record version") {
            return Err(Error::Corrupt {
                file: self.dir.display().to_string(),
                offset: end,
                reason:
                    "record written by a newer delayd (unknown record version); upgrade instead of truncating"
                        .into(),
            });
        }
        let after = self.count_valid_records_after(end);
        let mut report = RecoveryReport {
            end,
            bad_offset: bad,
            reason,
            records_after_bad: after,
            bytes_dropped: 0,
            claimed_end: None,
            durable_bytes_lost: 0,
        };
        if let Some(claim) = claim.filter(|c| c.offset > end) {
            self.lost_before_claim(claim, mode, &mut report)?;
        }
        if after > 0 && mode == RecoveryMode::Strict {
            return Err(self.records_after_end(&report));
        }
        self.cut_tail(&mut report)?;
        Ok(report)
    }

    /// Reads records from `start` to the first that is not one: the log's end, and where and why
    /// the scan stopped on a bad record (`None` on zeroes).
    fn scan_end(&self, start: u64) -> (u64, Option<u64>, Option<String>) {
        let mut offset = start;
        let (bad, reason) = loop {
            match self.decode_at(offset) {
                Ok(Some((Record::EndOfSegment, _))) => match self.next_segment_base(offset) {
                    Some(next) => offset = next,
                    None => break (None, None),
                },
                Ok(Some((_, len))) => offset += len as u64,
                Ok(None) => break (None, None),
                Err(DecodeError::Empty) => break (None, None),
                Err(DecodeError::Truncated) => break (Some(offset), Some("record cut short".to_string())),
                Err(DecodeError::Invalid(why)) => break (Some(offset), Some(why.to_string())),
            }
        };
        (offset, bad, reason)
    }

    /// The log ends before what `claim` says was durable: `strict` refuses to open, `truncate`
    /// logs the loss and records it in `report`.
    fn lost_before_claim(
        &self,
        claim: &DurableClaim,
        mode: RecoveryMode,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        let end = report.end;
        let file = match self.locate(end) {
            Some((i, _)) => self.segments[i].file.path().display().to_string(),
            None => self.dir.display().to_string(),
        };
        let why = report.reason.as_deref().unwrap_or("no record (zeroes)");
        if mode == RecoveryMode::Strict {
            return Err(Error::Corrupt {
                file,
                offset: end,
                reason: format!(
                    "the commit log ends at offset {end} ({why} there), but {} says it was durable \
                     up to offset {}: {} bytes of records that may have been acknowledged are \
                     missing. Refusing to start; restore the file, or set recovery = \"truncate\" \
                     to accept the loss",
                    claim.source,
                    claim.offset,
                    claim.offset - end
                ),
            });
        }
        tracing::error!(
            %file,
            log_end = end,
            claimed_end = claim.offset,
            claimed_by = %claim.source,
            bytes_lost = claim.offset - end,
            reason = why,
            "commit log: ends before what was durable; recovery = truncate accepts the loss of \
             every record in [log_end, claimed_end)"
        );
        report.claimed_end = Some(claim.offset);
        report.durable_bytes_lost = claim.offset - end;
        Ok(())
    }

    /// The `strict` refusal of a bad record with valid records after it: mid-log corruption, not
    /// a torn tail.
    fn records_after_end(&self, report: &RecoveryReport) -> Error {
        let (end, after) = (report.end, report.records_after_bad);
        let (i, _) = self.locate(end).unwrap_or((0, 0));
        Error::Corrupt {
            file: self.segments[i].file.path().display().to_string(),
            offset: end,
            reason: format!(
                "{}; {after} valid records follow it, so this is not a torn tail. Refusing to drop \
                 acknowledged data: inspect the file, or set recovery = \"truncate\" to drop them",
                report.reason.as_deref().unwrap_or("unreadable record")
            ),
        }
    }

    /// Clears every byte after the end and logs what was dropped.
    fn cut_tail(&mut self, report: &mut RecoveryReport) -> Result<()> {
        let (end, after) = (report.end, report.records_after_bad);
        report.bytes_dropped = self.clear_from(end)?;
        if report.bytes_dropped > 0 || after > 0 {
            warn!(
                offset = end,
                bytes_dropped = report.bytes_dropped,
                records_dropped = after,
                reason = report.reason.as_deref().unwrap_or("non-zero bytes after the last record"),
                "commit log: truncated tail after the last valid record"
            );
        } else {
            info!(end, "commit log: recovered, tail is clean");
        }
        Ok(())
    }

    /// Counts frames with a valid CRC anywhere after `from` (byte-by-byte search, only on recovery).
    fn count_valid_records_after(&self, from: u64) -> u64 {
        let mut found = 0;
        for seg in &self.segments {
            if seg.end() <= from {
                continue;
            }
            let bytes = seg.file.bytes();
            let start = if seg.base >= from { 0 } else { (from - seg.base) as usize + 1 };
            for (region_start, region_end) in seg.file.data_ranges(start) {
                let mut pos = region_start.max(start);
                // A frame may run past the end of a data range only into zeroes, which fail its
                // CRC anyway, so ranges are scanned independently.
                let bytes = &bytes[..region_end.max(pos).min(bytes.len())];
                found += count_frames(bytes, &mut pos);
            }
        }
        found
    }

    /// Zeroes every non-zero byte at or after `from`; returns how many bytes were cleared.
    fn clear_from(&mut self, from: u64) -> Result<u64> {
        let mut cleared = 0;
        for seg in &mut self.segments {
            if seg.end() <= from {
                continue;
            }
            let start = from.saturating_sub(seg.base) as usize;
            let Some(last) = seg.file.last_nonzero(start) else { continue };
            let stop = last + 1;
            seg.file.bytes_mut()[start..stop].fill(0);
            seg.file.flush_range(start, stop - start)?;
            cleared += (stop - start) as u64;
        }
        Ok(cleared)
    }

    fn drop_segments_after(&mut self, end: u64) -> Result<()> {
        // A segment that starts after the end holds nothing valid (cleared above): remove it so the
        // invariant "only the last segment has free space" holds.
        while self.segments.len() > 1 && self.segments.last().is_some_and(|s| s.base > end) {
            if let Some(seg) = self.segments.pop() {
                let path = seg.file.path().to_path_buf();
                drop(seg);
                super::io::remove_file(&path).map_err(|e| Error::io_at("remove", &path, e))?;
                sync_dir(&self.dir, &self.durability)?;
            }
        }
        Ok(())
    }

    fn locate(&self, offset: u64) -> Option<(usize, usize)> {
        let i = self.segments.partition_point(|s| s.base <= offset).checked_sub(1)?;
        let seg = &self.segments[i];
        (offset < seg.end()).then(|| (i, (offset - seg.base) as usize))
    }

    /// Base and end of every segment, ascending.
    pub fn segment_bounds(&self) -> Vec<(u64, u64)> {
        self.segments.iter().map(|s| (s.base, s.end())).collect()
    }

    /// Base of the segment holding `offset`, if it is still in the log.
    pub fn segment_base(&self, offset: u64) -> Option<u64> {
        self.locate(offset).map(|(i, _)| self.segments[i].base)
    }

    fn next_segment_base(&self, offset: u64) -> Option<u64> {
        let (i, _) = self.locate(offset)?;
        self.segments.get(i + 1).map(|s| s.base)
    }

    fn decode_at(&self, offset: u64) -> Result<Option<(Record<'_>, usize)>, DecodeError> {
        self.decode_at_with(offset, format::decode)
    }

    fn decode_at_with<'a>(
        &'a self,
        offset: u64,
        decode: Decoder<'a>,
    ) -> Result<Option<(Record<'a>, usize)>, DecodeError> {
        match self.locate(offset) {
            Some((i, pos)) => decode(&self.segments[i].file.bytes()[pos..]).map(Some),
            None => Ok(None),
        }
    }

    /// Path of the segment file holding `offset`.
    pub fn segment_path(&self, offset: u64) -> Option<&Path> {
        self.locate(offset).map(|(i, _)| self.segments[i].file.path())
    }

    /// Offset where the next record will be appended (one past the last record).
    pub fn end(&self) -> u64 {
        self.write_pos
    }

    /// Offset of the first byte still held by the log.
    pub fn start(&self) -> u64 {
        self.segments.first().map_or(0, |s| s.base)
    }

    /// Offset up to which appends are durable (synced here or by the flusher).
    pub fn flushed(&self) -> u64 {
        self.durability.log_durable()
    }

    /// Appends one encoded record and returns its offset. Rolls to a new segment when it does not fit.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        let need = record.len() as u64 + HEADER_BYTES as u64;
        if need > self.segment_bytes {
            return Err(Error::TooLarge(format!(
                "record of {} bytes does not fit a {}-byte segment",
                record.len(),
                self.segment_bytes
            )));
        }
        // A message (Put, Carry) leaves the segment's tail reserve free: when the next segment
        // cannot be made (a full disk), acks, cancels, deliveries and timers still have room.
        let grows =
            matches!(record.get(7).copied(), Some(k) if k == Kind::Put as u8 || k == Kind::Carry as u8);
        let keep = if grows { self.tail_reserve() } else { 0 };
        let last = self.segments.len() - 1;
        let seg_end = self.segments[last].end();
        if self.write_pos + need + keep > seg_end {
            self.roll(grows)?;
        } else if self.next.is_none() && seg_end - self.write_pos < self.segment_bytes / 8 {
            self.start_next_segment(seg_end);
        }
        let at = self.write_pos;
        self.write_last(record);
        Ok(at)
    }

    /// Bytes at the end of each segment that only state changes (Transition, Hop) may use.
    pub fn tail_reserve(&self) -> u64 {
        (self.segment_bytes / 16).min(TAIL_RESERVE_MAX_BYTES)
    }

    /// Writes `bytes` at the write position in the last segment, which the caller made sure holds them.
    fn write_last(&mut self, bytes: &[u8]) {
        let last = self.segments.len() - 1;
        let seg = &mut self.segments[last];
        let rel = self.write_pos - seg.base;
        let end = rel + bytes.len() as u64;
        if end > self.warm_guard {
            if let Some(w) = &self.warmer {
                self.warm_guard = w.advance(seg.base, end);
            }
        }
        seg.file.write_at(rel as usize, bytes);
        self.write_pos += bytes.len() as u64;
    }

    /// Points the warmer at the last segment, from the write position.
    fn warm_active(&mut self) {
        let (Some(w), Some(seg)) = (&self.warmer, self.segments.last()) else { return };
        // The warmer's own open file description (a dup would share this one's error state).
        let opened = super::io::open(std::fs::OpenOptions::new().write(true), seg.file.path());
        match opened {
            Ok(file) => {
                let from = self.write_pos.saturating_sub(seg.base);
                self.warm_guard = w.segment(seg.base, seg.file.len(), file, seg.file.path(), from);
            }
            Err(e) => {
                // Only speed is at stake: appends work the same on unwritten extents.
                warn!(error = %e, "commit-log warmer stopped");
                self.warmer = None;
            }
        }
    }

    /// The most bytes of the warmer's zeroes ever dirty in the page cache at once.
    #[cfg(test)]
    fn warmer_most_unwritten(&self) -> u64 {
        self.warmer.as_ref().map_or(0, |w| w.most_unwritten_bytes())
    }

    /// Bytes of zeroes the warmer has written ahead of appends (0 without a warmer).
    pub fn warmed_bytes(&self) -> u64 {
        self.warmer.as_ref().map_or(0, |w| w.zeroed_bytes())
    }

    /// Starts the next segment. `grows`: the record that needs it is a new message, which waits out
    /// a recent refusal; a state change (which may be what frees space) always tries.
    fn roll(&mut self, grows: bool) -> Result<()> {
        let last = self.segments.len() - 1;
        let eos = format::encode_end_of_segment();
        let next = self.segments[last].end();
        if let Some((until, (op, file), code)) = &self.roll_refused {
            if grows && Instant::now() < *until {
                let source = std::io::Error::from_raw_os_error(*code);
                return Err(Error::Io { op: op.clone(), file: file.clone(), source });
            }
            self.roll_refused = None;
        }
        let path = self.dir.join(segment_name(next));
        let made = self.next.take().is_some_and(|ahead| ahead.made(next));
        let file =
            match if made { Ok(()) } else { create_durably(&path, self.segment_bytes, &self.durability) }
                .and_then(|()| MappedFile::open_existing(&path, &self.durability))
            {
                Ok(file) => file,
                Err(e) => {
                    if let Error::Io { op, file, source } = &e {
                        if let (true, Some(code)) =
                            (super::io::is_resource_exhausted(source), source.raw_os_error())
                        {
                            let what = (op.clone(), file.clone());
                            self.roll_refused = Some((Instant::now() + ROLL_RETRY_AFTER, what, code));
                        }
                    }
                    return Err(e);
                }
            };
        // The old segment's tail, marker included, must be durable before anything in the new one.
        self.write_last(&eos);
        self.flush()?;
        self.segments.push(Segment { base: next, file });
        self.write_pos = next;
        // Past the marker the old segment holds only preallocated zeroes.
        self.durability.log_synced(next);
        self.warm_active();
        Ok(())
    }

    /// Starts making the segment at `base` on a helper thread, with the roll's own steps
    /// (preallocate, fsync the file, fsync the directory), so the engine thread that rolls only
    /// opens it: those syncs took 5–10 ms of a roll on a busy disk. Not while a roll is refused
    /// for want of space: that retry is paced by [`roll`](Self::roll) alone.
    fn start_next_segment(&mut self, base: u64) {
        if self.roll_refused.is_some() {
            return;
        }
        let (path, bytes) = (self.dir.join(segment_name(base)), self.segment_bytes);
        let durability = self.durability.clone();
        self.next =
            MadeAhead::start("delayd-log-next", base, move || create_durably(&path, bytes, &durability));
    }

    /// Makes every appended byte durable; one msync per touched segment.
    pub fn flush(&mut self) -> Result<()> {
        let durable = self.flushed();
        if durable >= self.write_pos {
            return Ok(());
        }
        for seg in &self.segments {
            let from = durable.max(seg.base);
            let to = self.write_pos.min(seg.end());
            if from < to {
                seg.file.sync_data()?;
            }
        }
        self.durability.log_synced(self.write_pos);
        Ok(())
    }

    /// Paths of the segment files holding `[from, to)`, for a thread that syncs through its own
    /// open file descriptions.
    pub fn paths(&self, from: u64, to: u64) -> Vec<PathBuf> {
        let held = self.segments.iter().filter(|s| s.base < to && s.end() > from);
        held.map(|s| s.file.path().to_path_buf()).collect()
    }

    /// Handles on the segment files holding `[from, to)`, for an fdatasync on another thread.
    pub fn handles(&self, from: u64, to: u64) -> Result<Vec<super::mmap::SyncFile>> {
        let mut out = Vec::new();
        for seg in &self.segments {
            if seg.base < to && seg.end() > from {
                out.push(seg.file.handle()?);
            }
        }
        Ok(out)
    }

    /// Reads and checks the record at `offset`, which must be below [`end`](Self::end).
    pub fn read(&self, offset: u64) -> Result<(Record<'_>, usize)> {
        self.read_with(offset, format::decode)
    }

    fn read_with<'a>(&'a self, offset: u64, decode: Decoder<'a>) -> Result<(Record<'a>, usize)> {
        if offset >= self.write_pos {
            return Err(Error::NotFound(format!("offset {offset} is past the end of the log")));
        }
        match self.decode_at_with(offset, decode) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(Error::NotFound(format!("offset {offset} is not in the log"))),
            Err(e) => {
                Err(Error::Corrupt { file: self.dir.display().to_string(), offset, reason: format!("{e:?}") })
            }
        }
    }

    /// Reads the record at `offset` for its fields, never reading a message's body (see
    /// [`format::decode_fields`]): for offsets the index or a queue gave.
    pub fn read_fields(&self, offset: u64) -> Result<(Record<'_>, usize)> {
        self.read_with(offset, format::decode_fields)
    }

    /// Reads the record at `offset` and returns it with the offset of the record after it.
    ///
    /// Returns `None` at the end of the log; skips end-of-segment markers.
    pub fn next(&self, offset: u64) -> Result<Option<(u64, Record<'_>, u64)>> {
        self.next_with(offset, format::decode)
    }

    /// [`next`](Self::next) reading records for their fields only (see [`format::decode_fields`]).
    pub fn next_fields(&self, offset: u64) -> Result<Option<(u64, Record<'_>, u64)>> {
        self.next_with(offset, format::decode_fields)
    }

    fn next_with<'a>(
        &'a self,
        mut offset: u64,
        decode: Decoder<'a>,
    ) -> Result<Option<(u64, Record<'a>, u64)>> {
        loop {
            if offset >= self.write_pos {
                return Ok(None);
            }
            let (rec, len) = self.read_with(offset, decode)?;
            if rec == Record::EndOfSegment {
                match self.next_segment_base(offset) {
                    Some(n) => {
                        offset = n;
                        continue;
                    }
                    None => return Ok(None),
                }
            }
            return Ok(Some((offset, rec, offset + len as u64)));
        }
    }

    /// Every segment with the bytes below the write position (all of a sealed one), each with a
    /// handle that stays readable if reclaim deletes the file: what a backup copies (see
    /// `storage::backup`).
    pub fn backup_segments(&self) -> Result<Vec<super::backup::CutSegment>> {
        let mut out = Vec::with_capacity(self.segments.len());
        for seg in &self.segments {
            let size = seg.file.len();
            let copy = self.write_pos.saturating_sub(seg.base).min(size);
            let file = seg.file.handle()?.into_file();
            out.push(super::backup::CutSegment { base: seg.base, size, copy, file });
        }
        Ok(out)
    }

    /// Raw bytes of the record at `offset` (zero-copy view into the mapping).
    pub fn raw(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let (i, pos) = self.locate(offset)?;
        self.segments[i].file.bytes().get(pos..pos + len)
    }

    /// The oldest segment as `[base, end)`, if it is sealed (a newer segment follows it).
    pub fn sealed_head(&self) -> Option<(u64, u64)> {
        (self.segments.len() > 1).then(|| (self.segments[0].base, self.segments[0].end()))
    }

    /// The segment starting at `base` as (base, end), if there is one and it is sealed.
    pub fn sealed_at(&self, base: u64) -> Option<(u64, u64)> {
        let i = self.segments.binary_search_by_key(&base, |s| s.base).ok()?;
        (i + 1 < self.segments.len()).then(|| (self.segments[i].base, self.segments[i].end()))
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Deletes the oldest segment, which must be sealed and end at or before `upto`; returns the
    /// bytes freed.
    ///
    /// The caller guarantees nothing live is left in it and a durable checkpoint covers its end,
    /// so recovery never needs its records again.
    pub fn drop_head(&mut self, upto: u64) -> Result<u64> {
        if self.segments.len() < 2 || self.segments[0].end() > upto {
            return Ok(0);
        }
        let seg = self.segments.remove(0);
        let (path, bytes) = (seg.file.path().to_path_buf(), seg.file.len());
        drop(seg);
        super::io::remove_file(&path).map_err(|e| Error::io_at("remove", &path, e))?;
        sync_dir(&self.dir, &self.durability)?;
        Ok(bytes)
    }

    /// Length of the record at `offset` from its header alone (no CRC check); 0 if none is there.
    pub fn record_len(&self, offset: u64) -> u64 {
        match self.raw(offset, HEADER_BYTES) {
            Some(h) => h.first_chunk().map_or(0, |h| u64::from(format::RecordHeader::from_bytes(h).len)),
            None => 0,
        }
    }

    /// Bytes of disk the segment files in use occupy (not a next segment still being prepared).
    pub fn disk_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.file.len()).sum()
    }
}

/// Counts valid frames in `bytes` from `pos` on, trying every offset where one could start.
fn count_frames(bytes: &[u8], pos: &mut usize) -> u64 {
    let mut found = 0;
    while *pos + HEADER_BYTES <= bytes.len() {
        match next_nonzero(bytes, *pos) {
            Some(p) => *pos = p.saturating_sub(4).max(*pos),
            None => break,
        }
        if *pos + HEADER_BYTES > bytes.len() {
            break;
        }
        if format::has_record_magic(&bytes[*pos..]) {
            if let Ok((len, _)) = format::check_frame(&bytes[*pos..]) {
                found += 1;
                *pos += len;
                continue;
            }
        }
        *pos += 1;
    }
    found
}

fn next_nonzero(bytes: &[u8], from: usize) -> Option<usize> {
    let rest = &bytes[from..];
    let mut i = 0;
    // Word-at-a-time over the zero-filled preallocated space keeps recovery scans fast.
    while i + 8 <= rest.len() {
        // Only compared with zero, so the byte order does not matter; little-endian as everywhere.
        let w = u64::from_le_bytes([
            rest[i],
            rest[i + 1],
            rest[i + 2],
            rest[i + 3],
            rest[i + 4],
            rest[i + 5],
            rest[i + 6],
            rest[i + 7],
        ]);
        if w != 0 {
            break;
        }
        i += 8;
    }
    rest[i..].iter().position(|b| *b != 0).map(|p| from + i + p)
}

/// The newest segment's base, size and path before it is extended: a file cut short looks, once
/// extended, like unwritten space, so this is the only trace of the cut.
fn newest_on_disk(dir: &Path, bases: &[u64]) -> Result<Option<(u64, u64, PathBuf)>> {
    match bases.last() {
        Some(base) => {
            let path = dir.join(segment_name(*base));
            let len = fs::metadata(&path).map_err(|e| Error::io_at("stat", &path, e))?.len();
            Ok(Some((*base, len, path)))
        }
        None => Ok(None),
    }
}

/// In `strict` mode, refuses a log whose newest segment on disk ends before what `claim` says
/// was durable (before any byte is changed).
fn refuse_cut_newest((base, len, path): &(u64, u64, PathBuf), claim: &DurableClaim) -> Result<()> {
    if claim.offset > base + len {
        return Err(Error::Corrupt {
            file: path.display().to_string(),
            offset: base + len,
            reason: format!(
                "the commit log ends at offset {} (this file, the newest segment, is {len} bytes), \
                 but {} says it was durable up to offset {}: {} bytes of records that may have \
                 been acknowledged are missing. Refusing to start; restore the file, or set \
                 recovery = \"truncate\" to accept the loss",
                base + len,
                claim.source,
                claim.offset,
                claim.offset - (base + len)
            ),
        });
    }
    Ok(())
}

/// Maps the segments `bases` names (the newest extended to `segment_bytes`), checks that each
/// follows the previous one, and makes the first segment of an empty log.
fn open_segments(
    dir: &Path,
    bases: &[u64],
    segment_bytes: u64,
    durability: &Durability,
) -> Result<Vec<Segment>> {
    let mut segments = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        let path = dir.join(segment_name(*base));
        // Segments hold push subscriptions' secrets; new ones are made 0600.
        super::io::keep_private(&path, "a commit log segment");
        // The newest segment may be short if power failed between its creation and its
        // preallocation: extend it (the tail is zeroes, i.e. unwritten).
        let file = if i + 1 == bases.len() {
            MappedFile::open(&path, segment_bytes, durability)?
        } else {
            MappedFile::open_existing(&path, durability)?
        };
        segments.push(Segment { base: *base, file });
    }
    for pair in segments.windows(2) {
        if pair[0].end() != pair[1].base {
            return Err(Error::Corrupt {
                file: pair[1].file.path().display().to_string(),
                offset: pair[1].base,
                reason: format!("segment does not follow the previous one, which ends at {}", pair[0].end()),
            });
        }
    }
    if segments.is_empty() {
        let file = MappedFile::open(&dir.join(segment_name(0)), segment_bytes, durability)?;
        file.sync_all()?;
        sync_dir(dir, durability)?;
        segments.push(Segment { base: 0, file });
    }
    Ok(segments)
}

/// Cuts the log in `dir` (closed: no `CommitLog` open on it) back to `offset`, a record
/// boundary: zeroes the segment holding it from there and deletes the segments after it, durably.
/// A cluster node does this to records no replicated entry holds (see `cluster::recover`).
pub fn cut_files(dir: &Path, offset: u64) -> Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let bases = list_numbered(dir)?;
    let Some(&base) = bases.iter().rev().find(|b| **b <= offset) else { return Ok(()) };
    for later in bases.iter().filter(|b| **b > base) {
        let path = dir.join(segment_name(*later));
        std::fs::remove_file(&path).map_err(|e| Error::io_at("remove", &path, e))?;
    }
    let path = dir.join(segment_name(base));
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).map_err(|e| Error::io_at("open", &path, e))?;
    let len = f.metadata().map_err(|e| Error::io_at("stat", &path, e))?.len();
    let from = offset - base;
    if from < len {
        f.seek(SeekFrom::Start(from)).map_err(|e| Error::io_at("seek", &path, e))?;
        let zeroes = vec![0u8; 1 << 20];
        let mut left = len - from;
        while left > 0 {
            let n = left.min(zeroes.len() as u64) as usize;
            f.write_all(&zeroes[..n]).map_err(|e| Error::io_at("write", &path, e))?;
            left -= n as u64;
        }
    }
    f.sync_all().map_err(|e| Error::io_at("sync", &path, e))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io_at("sync", dir, e))
}

/// Lists files in `dir` whose names are 20-digit numbers, ascending.
pub fn list_numbered(dir: &Path) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    let rd = match super::io::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io_at("read dir", dir, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| Error::io_at("read dir", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.len() == 20 && name.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(n) = name.parse::<u64>() {
                out.push(n);
            }
        }
    }
    out.sort_unstable();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::format::{encode_hop, Hop, Route};
    use proptest::prelude::*;

    fn rec(i: u64, pad: usize) -> Vec<u8> {
        if pad == 0 {
            return encode_hop(&Hop {
                msg_offset: i,
                id_hash: i * 7,
                seq: i as u32,
                target_ms: i,
                route: Route::Level { level_ms: 1000, due_ms: i },
            });
        }
        let body = vec![0xA5u8; pad * 40];
        format::encode_put(&format::Put {
            created_ms: i,
            deliver_at_ms: i,
            ttr_ms: 1,
            max_attempts: 1,
            request_kind: 0,
            request_value: 0,
            route: Route::Topic,
            id: b"id",
            topic: b"t",
            backoff_ms: vec![],
            body: &body,
            replaces: false,
        })
        .unwrap()
    }

    fn open(dir: &Path, seg: u64, mode: RecoveryMode) -> Result<(CommitLog, RecoveryReport)> {
        CommitLog::open(dir, seg, 0, mode, &[], Durability::new(dir))
    }

    fn offsets(log: &CommitLog) -> Vec<u64> {
        let mut out = vec![];
        let mut at = log.start();
        while let Some((off, _, next)) = log.next(at).unwrap() {
            out.push(off);
            at = next;
        }
        out
    }

    fn wait_for_warmer(log: &CommitLog, bytes: u64) -> bool {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while log.warmed_bytes() < bytes {
            if std::time::Instant::now() > until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        true
    }

    #[test]
    fn appends_racing_the_warmer_come_back_intact() {
        // 64 KiB segments give 4 KiB chunks, so appends cross into a new chunk every few records
        // and meet the warmer zeroing the chunks just ahead of them many times over.
        let dir = tempfile::tempdir().unwrap();
        let seg = 64 << 10;
        let mut written = vec![];
        {
            let (mut log, _) = open(dir.path(), seg, RecoveryMode::Strict).unwrap();
            for i in 0..6_000u64 {
                let r = rec(i, (i % 7) as usize);
                written.push((log.append(&r).unwrap(), r));
                if i % 500 == 0 {
                    // Let the warmer run ahead now and then, as it does when appends pause.
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            assert!(log.warmed_bytes() > 0, "the warmer never wrote anything");
            for (off, r) in &written {
                assert_eq!(log.raw(*off, r.len()).unwrap(), &r[..], "record at {off} damaged");
            }
            log.flush().unwrap();
        }
        let (log, report) = open(dir.path(), seg, RecoveryMode::Strict).unwrap();
        assert_eq!(report.bytes_dropped, 0);
        assert_eq!(offsets(&log), written.iter().map(|(o, _)| *o).collect::<Vec<_>>());
        for (off, r) in &written {
            assert_eq!(log.raw(*off, r.len()).unwrap(), &r[..], "record at {off} damaged after reopen");
        }
    }

    #[test]
    fn the_warmer_turns_preallocated_space_ahead_of_appends_into_written_zeroes() {
        let dir = tempfile::tempdir().unwrap();
        let seg = 16 << 20;
        // Asked of a file of its own: the segment's first pages are already in the page cache
        // after the open, and ext4 reports cached pages of an unwritten extent as data.
        let probe_dir = tempfile::tempdir().unwrap();
        let probe_path = probe_dir.path().join("probe");
        let probe = MappedFile::open(&probe_path, 1 << 20, &Durability::new(probe_dir.path())).unwrap();
        if !probe.data_ranges(0).is_empty() {
            eprintln!("skipped: this filesystem reports preallocated space as data");
            return;
        }
        let (mut log, _) = open(dir.path(), seg, RecoveryMode::Strict).unwrap();
        log.append(&rec(1, 3)).unwrap();
        // Chunks are 1 MiB here; the window reaches eight past the appender's guard.
        assert!(wait_for_warmer(&log, 8 << 20), "warmer wrote only {} bytes", log.warmed_bytes());
        let ranges = log.segments[0].file.data_ranges(log.end() as usize);
        let covered: usize = ranges.iter().map(|(a, b)| b - a).sum();
        assert!(covered >= 8 << 20, "only {covered} bytes ahead are written extents: {ranges:?}");
        let bytes = log.segments[0].file.bytes();
        assert!(bytes[log.end() as usize..].iter().all(|b| *b == 0), "zeroing ahead wrote non-zero bytes");
        // Recovery after a crash treats the written zeroes like unwritten space: the end is found.
        drop(log);
        let (log, report) = open(dir.path(), seg, RecoveryMode::Strict).unwrap();
        assert_eq!(report.bytes_dropped, 0);
        assert_eq!(offsets(&log), vec![0]);
    }

    #[test]
    fn the_warmer_leaves_at_most_one_piece_of_zeroes_for_a_commit_to_write() {
        // A commit's fdatasync writes back every dirty page of the segment, the warmer's zeroes
        // included: they are dirtied one 128 KiB piece at a time, each written back before the
        // next, never a whole 1 MiB chunk at once.
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = open(dir.path(), 16 << 20, RecoveryMode::Strict).unwrap();
        log.append(&rec(1, 3)).unwrap();
        assert!(wait_for_warmer(&log, 8 << 20), "warmer wrote only {} bytes", log.warmed_bytes());
        let most = log.warmer_most_unwritten();
        assert!(most > 0 && most <= 128 << 10, "{most} bytes of zeroes were dirty at once");
    }

    #[test]
    fn the_next_segment_is_made_durable_off_the_appending_thread_and_dropped_unused_at_reopen() {
        use crate::storage::io::{Fault, Op};
        let dir = tempfile::tempdir().unwrap();
        let seg = 64 << 10;
        let path = dir.path().to_path_buf();
        // The appending thread may not fsync the second segment: a helper must have.
        let second = path.join(segment_name(seg));
        let _fault = Fault::new(Op::Sync, &second, libc::EIO).on_thread("log-appender").inject();
        let (log, offs) = std::thread::Builder::new()
            .name("log-appender".into())
            .spawn(move || {
                let (mut log, _) = open(&path, seg, RecoveryMode::Strict).unwrap();
                let mut offs = vec![];
                let mut i = 0;
                // Into the second segment, and past 7/8 of it, so that the third is prepared too.
                while log.end() < seg + seg - seg / 16 {
                    offs.push(log.append(&rec(i, 0)).unwrap());
                    i += 1;
                }
                (log, offs)
            })
            .unwrap()
            .join()
            .unwrap();
        let mut log = log;
        log.flush().unwrap();
        assert_eq!(log.segments.len(), 2);
        drop(log);
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![0, seg, 2 * seg], "the third was made ahead");
        let (log, report) = open(dir.path(), seg, RecoveryMode::Strict).unwrap();
        assert_eq!(report.bytes_dropped, 0);
        assert_eq!(offsets(&log), offs);
        assert_eq!(list_numbered(dir.path()).unwrap(), vec![0, seg], "an unused segment is not kept");
    }

    #[test]
    fn appends_roll_across_segments_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut offs = vec![];
        {
            let (mut log, _) = open(dir.path(), 1024, RecoveryMode::Strict).unwrap();
            for i in 0..100 {
                offs.push(log.append(&rec(i, 0)).unwrap());
            }
            log.flush().unwrap();
        }
        assert!(list_numbered(dir.path()).unwrap().len() > 3);
        let (log, report) = open(dir.path(), 1024, RecoveryMode::Strict).unwrap();
        assert_eq!(report.bytes_dropped, 0);
        assert_eq!(offsets(&log), offs);
        for (i, off) in offs.iter().enumerate() {
            match log.read(*off).unwrap().0 {
                Record::Hop(h) => assert_eq!(h.msg_offset, i as u64),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn corruption_in_the_middle_is_refused_in_strict_mode_and_dropped_in_truncate_mode() {
        let dir = tempfile::tempdir().unwrap();
        let mut offs = vec![];
        {
            let (mut log, _) = open(dir.path(), 1 << 16, RecoveryMode::Strict).unwrap();
            for i in 0..50 {
                offs.push(log.append(&rec(i, 0)).unwrap());
            }
            log.flush().unwrap();
        }
        let seg = dir.path().join(segment_name(0));
        let mut bytes = fs::read(&seg).unwrap();
        bytes[offs[20] as usize + 14] ^= 0xFF;
        fs::write(&seg, &bytes).unwrap();
        match open(dir.path(), 1 << 16, RecoveryMode::Strict) {
            Err(Error::Corrupt { offset, reason, .. }) => {
                assert_eq!(offset, offs[20]);
                assert!(reason.contains("29 valid records follow"), "{reason}");
            }
            other => panic!("expected corrupt error, got {:?}", other.map(|r| r.1)),
        }
        let (log, report) = open(dir.path(), 1 << 16, RecoveryMode::Truncate).unwrap();
        assert_eq!(report.end, offs[20]);
        assert_eq!(report.records_after_bad, 29);
        assert_eq!(offsets(&log), offs[..20].to_vec());
    }

    #[test]
    fn a_record_from_a_newer_version_is_refused_even_in_truncate_mode() {
        let dir = tempfile::tempdir().unwrap();
        let offs: Vec<u64> = {
            let (mut log, _) = open(dir.path(), 1 << 16, RecoveryMode::Strict).unwrap();
            let o = (0..5).map(|i| log.append(&rec(i, 0)).unwrap()).collect();
            log.flush().unwrap();
            o
        };
        let seg = dir.path().join(segment_name(0));
        let mut bytes = fs::read(&seg).unwrap();
        let at = offs[3] as usize;
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        bytes[at + 6] = format::RECORD_VERSION_FLOW + 1;
        let mut h = crc32fast::Hasher::new();
        h.update(&bytes[at..at + 8]);
        h.update(&bytes[at + HEADER_BYTES..at + len]);
        let crc = h.finalize();
        bytes[at + 8..at + 12].copy_from_slice(&crc.to_le_bytes());
        fs::write(&seg, &bytes).unwrap();
        match open(dir.path(), 1 << 16, RecoveryMode::Truncate) {
            Err(Error::Corrupt { offset, reason, .. }) => {
                assert_eq!(offset, offs[3]);
                assert!(reason.contains("newer delayd"), "{reason}");
            }
            other => panic!("expected a refusal, got {:?}", other.map(|r| r.1)),
        }
    }

    #[test]
    fn a_short_newest_segment_is_extended_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let mut offs = vec![];
        {
            let (mut log, _) = open(dir.path(), 1024, RecoveryMode::Strict).unwrap();
            // Until the log rolls: the next segment's file may exist earlier, made ahead.
            while log.segments.len() < 2 {
                offs.push(log.append(&rec(offs.len() as u64, 0)).unwrap());
            }
            log.flush().unwrap();
        }
        // Power failed after the new segment was created but before it was preallocated/written.
        let last = *list_numbered(dir.path()).unwrap().last().unwrap();
        let f = fs::OpenOptions::new().write(true).open(dir.path().join(segment_name(last))).unwrap();
        f.set_len(0).unwrap();
        drop(f);
        let (mut log, _) = open(dir.path(), 1024, RecoveryMode::Strict).unwrap();
        assert_eq!(offsets(&log), offs[..offs.len() - 1].to_vec());
        let at = log.append(&rec(999, 0)).unwrap();
        assert!(matches!(log.read(at).unwrap().0, Record::Hop(h) if h.msg_offset == 999));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn recovery_yields_the_longest_valid_prefix(
            pads in proptest::collection::vec(0usize..3, 1..60),
            cut in any::<prop::sample::Index>(),
            garbage in any::<u8>(),
            corrupt in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let seg_size = 2048u64;
            let mut offs = vec![];
            let mut ends = vec![];
            {
                let (mut log, _) = open(dir.path(), seg_size, RecoveryMode::Strict).unwrap();
                for (i, p) in pads.iter().enumerate() {
                    let r = rec(i as u64, *p);
                    let at = log.append(&r).unwrap();
                    offs.push(at);
                    ends.push(at + r.len() as u64);
                }
                log.flush().unwrap();
            }
            // Damage one byte somewhere in the written range: either flip it (corruption) or cut the
            // log there (zero everything after it, as a power loss would).
            let end = *ends.last().unwrap();
            let bases = list_numbered(dir.path()).unwrap();
            let at = cut.index(end as usize) as u64;
            let seg_base = *bases.iter().rev().find(|b| **b <= at).unwrap();
            let path = dir.path().join(segment_name(seg_base));
            let mut bytes = fs::read(&path).unwrap();
            let original = bytes.clone();
            let pos = (at - seg_base) as usize;
            if corrupt {
                bytes[pos] ^= garbage | 1;
            } else {
                bytes[pos..].fill(0);
            }
            fs::write(&path, &bytes).unwrap();
            if !corrupt {
                for b in bases.iter().filter(|b| **b > seg_base) {
                    fs::remove_file(dir.path().join(segment_name(*b))).unwrap();
                }
            }
            // Model: the recovered log is the longest prefix of records whose bytes (and, across a
            // segment boundary, the previous segment's end marker) survived the damage.
            let damaged = |from: u64, to: u64| -> bool {
                let base = *bases.iter().rev().find(|b| **b <= from).unwrap();
                if !corrupt && base > seg_base {
                    return true;
                }
                if base != seg_base {
                    return false;
                }
                let (a, b) = ((from - base) as usize, (to - base) as usize);
                let orig = &original[a..b];
                let now = &bytes[a..b];
                orig != now
            };
            let mut expect = vec![];
            for (i, (o, e)) in offs.iter().zip(&ends).enumerate() {
                if i > 0 && *o != ends[i - 1] {
                    // The previous segment closes with a 12-byte marker at ends[i-1].
                    if damaged(ends[i - 1], ends[i - 1] + 12) {
                        break;
                    }
                }
                if damaged(*o, *e) {
                    break;
                }
                expect.push(*o);
            }
            let (log, report) = open(dir.path(), seg_size, RecoveryMode::Truncate).unwrap();
            prop_assert_eq!(offsets(&log), expect);
            prop_assert!(report.end <= end);
        }
    }
}
