//! What reclaim keeps between its steps (the phase, the head, its counts) and the per-segment live
//! counts dispatch keeps up to date: state only, so that the store can hold it without importing
//! the reclaim work that runs on it.

use std::collections::BTreeMap;

use super::super::commitlog::CommitLog;
use super::super::format::State;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Phase {
    /// Nothing examined yet.
    #[default]
    Start,
    /// Counting what the segment starting at `seg` still holds, from `pos`. Segments from the head
    /// up to `seg` were found empty: waiting for a checkpoint per segment would free at most one
    /// segment per checkpoint interval, slower than a busy log fills them.
    Scan { seg: u64, pos: u64, live: u64, pinned: u64 },
    /// Copying the head's live messages to the end of the log, from `pos`.
    Carry { pos: u64 },
    /// Nothing live is left before `upto`: delete those segments, one per step, once the
    /// checkpoint with serial `need` (the first taken after the decision) is durable. It covers the
    /// Carries written for them and the expiry of their final messages from the index.
    /// In a cluster, also once the log is committed up to `decided` (its end when the decision
    /// was made): an entry after it that a new leader drops could make a message live again.
    Free { need: u64, upto: u64, decided: u64 },
    /// A scan found the head pinned (a timer about to fire, a reservation made meanwhile) or not
    /// worth carrying although its counts said it was (the log changed while it ran): scan again
    /// at `until_ms` or once the head's `changes` count moved, whichever comes first, and only if
    /// its counts still say so.
    Rest { until_ms: u64, changes: u64 },
}

/// Progress and totals of reclaim.
#[derive(Debug, Default)]
pub struct Reclaim {
    pub(super) head: u64,
    pub(super) phase: Phase,
    /// The last expiry pass stopped on its budget, not on a record too young to expire.
    pub(super) expiry_behind: bool,
    /// The record too young to expire that stopped the last pass, and its time: nothing can
    /// expire before the cutoff reaches that time, so the walk waits for it without reading.
    pub(super) expiry_young: Option<(u64, u64)>,
    /// Where the last pass stopped because the log was durable (and committed) only that far:
    /// once it is durable further, the walk has work again.
    pub(super) expiry_unsynced: Option<u64>,
    /// Totals since start, for metrics and the write-amplification figure.
    pub stats: ReclaimStats,
}

/// Counters of what reclaim did since the broker started. The HTTP answer is
/// [`crate::message::ReclaimCounts`]: storage does not shape what clients see.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReclaimStats {
    /// Messages copied forward.
    pub carried: u64,
    /// Bytes of Carry records written.
    pub carried_bytes: u64,
    /// Commit-log segments deleted.
    pub segments_deleted: u64,
    /// Bytes of segment files deleted.
    pub segment_bytes_deleted: u64,
    /// Consume-queue files deleted.
    pub queue_files_deleted: u64,
    /// Final messages removed from the id index after `done_retention`.
    pub expired: u64,
    /// Emptied topics forgotten: files and directory deleted, no longer counted in `max_topics`.
    pub topics_forgotten: u64,
    /// Records read by scans of the oldest segments (a scan runs only when the segments' counts
    /// say it could free or carry something, and again only once something there changed).
    pub scanned_records: u64,
}

/// What one segment holds that reclaim must keep: the Put and Carry records of its indexed
/// messages and the Pause and Push records in effect, and how many of its messages are reserved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SegLive {
    /// Bytes of those records.
    pub bytes: u64,
    /// Its messages now Reserved (a reservation pins its segment).
    pub reserved: u64,
    /// Bumped by every change to its messages, so a scan that found nothing to do is repeated
    /// only once something in the segment changed.
    pub changes: u64,
}

/// [`SegLive`] of every segment, by base offset. Dispatch keeps it (every change of the index
/// goes through it), so deciding whether the head segment is worth scanning costs nothing.
#[derive(Debug, Default)]
pub struct SegCounts(pub(super) BTreeMap<u64, SegLive>);

impl SegCounts {
    fn at(&mut self, log: &CommitLog, offset: u64) -> Option<&mut SegLive> {
        let base = log.segment_base(offset)?;
        let c = self.0.entry(base).or_default();
        c.changes += 1;
        Some(c)
    }

    /// The record at `offset` (`len` bytes) is now needed.
    pub(crate) fn add(&mut self, log: &CommitLog, offset: u64, len: u64) {
        if let Some(c) = self.at(log, offset) {
            c.bytes += len;
        }
    }

    /// The record at `offset` (`len` bytes) is no longer needed.
    pub(crate) fn sub(&mut self, log: &CommitLog, offset: u64, len: u64) {
        if let Some(c) = self.at(log, offset) {
            c.bytes = c.bytes.saturating_sub(len);
        }
    }

    /// The message whose record is at `msg_offset` went from `from` to `to`.
    pub(crate) fn state(&mut self, log: &CommitLog, msg_offset: u64, from: State, to: State) {
        if let Some(c) = self.at(log, msg_offset) {
            match (from == State::Reserved, to == State::Reserved) {
                (false, true) => c.reserved += 1,
                (true, false) => c.reserved = c.reserved.saturating_sub(1),
                _ => {}
            }
        }
    }

    /// Base, bytes and reserved count of every segment holding anything, ascending: what a
    /// clean close records.
    pub(crate) fn to_list(&self) -> Vec<(u64, u64, u64)> {
        self.0.iter().filter(|(_, c)| c.bytes > 0 || c.reserved > 0).map(|(b, c)| (*b, c.bytes, c.reserved)).collect()
    }

    /// Counts a clean close recorded (see [`to_list`](Self::to_list)).
    pub(crate) fn from_list(list: &[(u64, u64, u64)]) -> SegCounts {
        SegCounts(list.iter().map(|&(base, bytes, reserved)| (base, SegLive { bytes, reserved, changes: 0 })).collect())
    }

    /// The counts of the segment starting at `base`.
    pub(crate) fn get(&self, base: u64) -> SegLive {
        self.0.get(&base).copied().unwrap_or_default()
    }
}


/// Per-segment counts of one pass over many messages: a vector by segment position, as a map
/// entry per message costs more than the rest of the pass.
pub(crate) struct SegTally {
    bounds: Vec<(u64, u64)>,
    /// Bytes and reserved messages, by position in `bounds`.
    counts: Vec<(u64, u64)>,
}

impl SegTally {
    /// An empty tally over the segments of `log`.
    pub(crate) fn new(log: &CommitLog) -> SegTally {
        let bounds = log.segment_bounds();
        SegTally { counts: vec![(0, 0); bounds.len()], bounds }
    }

    /// A message in the index: its record at `msg_offset` (`len` bytes), in `state`. Offsets
    /// outside the log count nowhere, as in [`SegCounts`].
    pub(crate) fn message(&mut self, msg_offset: u64, len: u64, state: State) {
        let Some(i) = self.bounds.partition_point(|&(base, _)| base <= msg_offset).checked_sub(1) else {
            return;
        };
        if let (Some(&(_, end)), Some(c)) = (self.bounds.get(i), self.counts.get_mut(i)) {
            if msg_offset < end {
                c.0 += len;
                c.1 += u64::from(state == State::Reserved);
            }
        }
    }

    /// Adds the counts of `other`, a tally over the same segments.
    pub(crate) fn merge(&mut self, other: &SegTally) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            mine.0 += theirs.0;
            mine.1 += theirs.1;
        }
    }

    /// The counts as [`SegCounts`].
    pub(crate) fn into_counts(self) -> SegCounts {
        let live = self.bounds.iter().zip(self.counts).filter(|(_, c)| c.0 > 0 || c.1 > 0);
        SegCounts(live.map(|(&(base, _), (bytes, reserved))| (base, SegLive { bytes, reserved, changes: 0 })).collect())
    }
}

/// How eager reclaim is.
#[derive(Debug, Clone, Copy)]
pub struct ReclaimPolicy {
    /// Bytes per new segment (the unit of the log-size bound).
    pub segment_bytes: u64,
    /// Final messages that became final at or before this time are past `done_retention`.
    pub expired_at_ms: u64,
}

impl ReclaimPolicy {
    /// Carry when at most half the head is live (each byte copied frees at least one), or when
    /// the log holds more than twice the live bytes plus two segments (the bound reclaim keeps).
    pub(super) fn should_carry(&self, head_len: u64, head_live: u64, log_bytes: u64, live_bytes: u64) -> bool {
        head_live * 2 <= head_len
            || log_bytes > live_bytes.saturating_mul(2).saturating_add(2 * self.segment_bytes)
    }
}

