//! The per-level scheduler: reads its consume queue in order from a persisted cursor and yields
//! entries as they fall due.
//!
//! Within a level, full hops are due exactly `level` after they were written, so due times ascend
//! and the scheduler only ever looks at the head. The smallest level also carries sub-level
//! remainders (due sooner than a full hop), which can be out of order by less than the level's
//! length: for that level the scheduler reads ahead just far enough (`skew_ms`) that no unread
//! entry can be due before the earliest one it holds. Memory is bounded by the entries written in
//! one `skew_ms` window, never by the backlog.
//!
//! An entry read late may stand for a message that is due already although the entry was an
//! earlier hop of its chain (a catch-up after downtime): the engine then [defers](LevelScheduler::defer)
//! it under the message's own due time, so that messages become ready in due order rather than
//! in the order of the hops they were waiting on. Deferred entries are capped, so memory still
//! does not follow the backlog.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::storage::consumequeue::{ConsumeQueue, Entry};
use crate::storage::types::{LogOffset, QueueIndex, UnixMs};

/// Deferred entries one scheduler holds at most; past that, a catch-up makes messages ready in
/// the order of their hops (never early, only out of due order among themselves).
const MAX_DEFERRED: usize = 16_384;
/// Read-ahead window (entries from the cursor on) past which nothing is deferred: a deferred
/// entry holds the cursor back, and the window keeps a byte for every entry read since.
const MAX_DEFER_WINDOW: usize = 1 << 20;

/// An entry held by the scheduler, ordered by due time and then by its index in the queue (the
/// field order is the order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    /// When it falls due: the entry's tag.
    due_ms: UnixMs,
    /// Its index in the level queue.
    idx: QueueIndex,
    /// The record it stands for.
    offset: LogOffset,
    size: u32,
    /// Held under its message's due time rather than its tag (see [`LevelScheduler::defer`]).
    deferred: bool,
}

impl Held {
    fn new(idx: QueueIndex, e: &Entry) -> Held {
        Held { due_ms: e.tag, idx, offset: e.offset, size: e.size, deferred: false }
    }
}

/// Reader state of one level queue.
#[derive(Debug)]
pub struct LevelScheduler {
    /// Level duration in ms.
    pub level_ms: u64,
    skew_ms: u64,
    read_pos: QueueIndex,
    /// Entries read but not all handled, from the cursor on; `true` once handled.
    window: VecDeque<bool>,
    window_start: QueueIndex,
    heap: BinaryHeap<Reverse<Held>>,
    last_read_due: u64,
    /// Entries in `heap` that were deferred.
    deferred: usize,
}

impl LevelScheduler {
    /// A scheduler starting at `cursor`, tolerating due times out of order by up to `skew_ms`.
    pub fn new(level_ms: u64, skew_ms: u64, cursor: QueueIndex) -> Self {
        LevelScheduler {
            level_ms,
            skew_ms,
            read_pos: cursor,
            window: VecDeque::new(),
            window_start: cursor,
            heap: BinaryHeap::new(),
            last_read_due: 0,
            deferred: 0,
        }
    }

    /// First entry not yet handled: everything below it may be skipped after a restart.
    pub fn cursor(&self) -> QueueIndex {
        self.window_start
    }

    /// Reads ahead until no unread entry can be due before the earliest held one.
    pub fn fill(&mut self, cq: &ConsumeQueue) {
        self.fill_checked(cq, |_| false);
    }

    /// Like [`fill`](Self::fill), but stops before the first entry `is_bad` rejects and returns its
    /// index: a damaged entry must be repaired before it is held (a garbage due time would hold it,
    /// and the cursor behind it, for good).
    pub fn fill_checked(
        &mut self,
        cq: &ConsumeQueue,
        mut is_bad: impl FnMut(&Entry) -> bool,
    ) -> Option<QueueIndex> {
        while self.read_pos < cq.end() {
            if let Some(Reverse(min)) = self.heap.peek() {
                if min.due_ms.get() <= self.last_read_due.saturating_sub(self.skew_ms) {
                    break;
                }
            }
            let Some(e) = cq.get(self.read_pos) else { break };
            if is_bad(&e) {
                return Some(self.read_pos);
            }
            self.heap.push(Reverse(Held::new(self.read_pos, &e)));
            self.window.push_back(false);
            self.last_read_due = e.tag.get();
            self.read_pos = self.read_pos.plus(1);
        }
        None
    }

    /// Due time of the earliest held entry.
    pub fn next_due(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse(h)| h.due_ms.get())
    }

    /// Takes the earliest entry if it is due at `now_ms`; call [`done`](Self::done) once handled.
    pub fn take_due(&mut self, now_ms: u64) -> Option<(QueueIndex, Entry)> {
        match self.heap.peek() {
            Some(Reverse(h)) if h.due_ms.get() <= now_ms => {
                let Reverse(Held { due_ms, idx, offset, size, deferred }) = self.heap.pop()?;
                self.deferred -= usize::from(deferred);
                Some((idx, Entry { offset, size, tag: due_ms }))
            }
            _ => None,
        }
    }

    /// Gives back an entry [`take_due`](Self::take_due) yielded whose handling failed (nothing
    /// was written for it), so it is yielded again on the next try.
    pub fn put_back(&mut self, idx: QueueIndex, e: Entry) {
        self.heap.push(Reverse(Held::new(idx, &e)));
    }

    /// Whether an entry may be [deferred](Self::defer) now (within the caps on memory).
    pub fn may_defer(&self) -> bool {
        self.deferred < MAX_DEFERRED && self.window.len() < MAX_DEFER_WINDOW
    }

    /// Holds entry `idx`, which [`take_due`](Self::take_due) yielded, again under the later due
    /// time `due_ms`: still unhandled, it is yielded once that is the earliest held. The read-ahead
    /// stays sound: it stops only once no unread entry can be due before the earliest held one,
    /// whatever that one's time.
    pub fn defer(&mut self, idx: QueueIndex, e: Entry, due_ms: UnixMs) {
        self.heap.push(Reverse(Held { due_ms, idx, offset: e.offset, size: e.size, deferred: true }));
        self.deferred += 1;
    }

    /// Marks entry `idx` handled and advances the cursor over the handled prefix.
    pub fn done(&mut self, idx: QueueIndex) {
        let held = idx.get().checked_sub(self.window_start.get());
        if let Some(slot) = held.and_then(|i| self.window.get_mut(i as usize)) {
            *slot = true;
        }
        while self.window.front() == Some(&true) {
            self.window.pop_front();
            self.window_start = self.window_start.plus(1);
        }
    }

    /// Entries held in memory (the read-ahead window).
    pub fn held(&self) -> usize {
        self.window.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A level queue in `dir` holding entries due at `dues`, the i-th pointing at offset 10 i.
    fn queue_of(dir: &std::path::Path, dues: &[u64]) -> ConsumeQueue {
        let durability = crate::storage::durability::Durability::new(dir);
        let mut cq = ConsumeQueue::open(dir, 16, None, &durability).unwrap();
        for (i, due) in dues.iter().enumerate() {
            cq.append(Entry { offset: LogOffset::new(i as u64 * 10), size: 1, tag: UnixMs::new(*due) })
                .unwrap();
        }
        cq
    }

    #[test]
    fn yields_in_due_order_within_the_skew_and_tracks_the_cursor() {
        let dir = tempfile::tempdir().unwrap();
        // Written at t=0,100,200,300: full hops of 1000 and remainders shorter than that.
        let cq = queue_of(dir.path(), &[1000, 400, 1200, 350]);
        let mut s = LevelScheduler::new(1000, 1000, QueueIndex::new(0));
        s.fill(&cq);
        assert_eq!(s.next_due(), Some(350));
        let mut order = vec![];
        let mut now = 0;
        while s.held() > 0 {
            s.fill(&cq);
            while let Some((idx, e)) = s.take_due(now) {
                assert!(e.tag.get() <= now);
                order.push(e.tag.get());
                s.done(idx);
            }
            now += 50;
        }
        assert_eq!(order, vec![350, 400, 1000, 1200]);
        assert_eq!(s.cursor().get(), 4);
    }

    #[test]
    fn a_deferred_entry_comes_back_at_its_new_time_and_holds_the_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let cq = queue_of(dir.path(), &[1000, 1300, 1900]);
        let mut s = LevelScheduler::new(1000, 1000, QueueIndex::new(0));
        s.fill(&cq);
        let (idx, e) = s.take_due(3000).unwrap();
        assert_eq!(e.tag.get(), 1000);
        assert!(s.may_defer());
        s.defer(idx, e, UnixMs::new(1450));
        let mut order = vec![];
        while let Some((idx, e)) = s.take_due(3000) {
            order.push((e.offset.get(), e.tag.get()));
            if e.offset.get() == 10 {
                assert_eq!(s.cursor().get(), 0, "entry 0 is not handled yet");
            }
            s.done(idx);
        }
        assert_eq!(order, vec![(10, 1300), (0, 1450), (20, 1900)]);
        assert_eq!(s.cursor().get(), 3);
    }

    #[test]
    fn deferring_stops_at_its_cap() {
        let mut s = LevelScheduler::new(1000, 0, QueueIndex::new(0));
        for i in 0..MAX_DEFERRED as u64 {
            assert!(s.may_defer());
            let e = Entry { offset: LogOffset::new(i), size: 1, tag: UnixMs::new(i) };
            s.defer(QueueIndex::new(i), e, UnixMs::new(i + 1));
        }
        assert!(!s.may_defer());
        let (idx, _) = s.take_due(u64::MAX).unwrap();
        assert!(s.may_defer(), "one fewer is held once one is taken");
        s.done(idx);
    }

    #[test]
    fn an_ordered_level_holds_one_entry() {
        let dir = tempfile::tempdir().unwrap();
        let mut cq = ConsumeQueue::open(
            dir.path(),
            1024,
            None,
            &crate::storage::durability::Durability::new(dir.path()),
        )
        .unwrap();
        for i in 0..1000u64 {
            cq.append(Entry { offset: LogOffset::new(i), size: 1, tag: UnixMs::new(5000 + i) }).unwrap();
        }
        let mut s = LevelScheduler::new(5000, 0, QueueIndex::new(10));
        s.fill(&cq);
        assert_eq!(s.held(), 1);
        assert_eq!(s.next_due(), Some(5010));
        assert!(s.take_due(5009).is_none());
        let (idx, _) = s.take_due(5010).unwrap();
        s.done(idx);
        assert_eq!(s.cursor().get(), 11);
    }
}
