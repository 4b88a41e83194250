//! Level-queue entries left behind by timers that moved on, so that level backlogs count live
//! entries only. (Topic counts need none of this: the store counts messages by state.)
//!
//! A level entry stays in its file until its scheduler passes it: the timer of a message cancelled
//! while delayed, of a reservation acked or nacked before its time-to-run. Each is skipped when
//! reached, but until then a backlog of `len - cursor` would count it. The engine notes such an entry here when it makes
//! the change, by the log offset the entry points at, and forgets it when the reader passes it.
//!
//! In memory only, and bounded: after a restart, entries left behind before it count until they
//! are reached, as do those left beyond [`MAX_TRACKED`] at once.

use std::collections::{BTreeMap, BTreeSet};

/// Most entries remembered at once: 256 Ki offsets, a few MiB. A steady 8,000 acks a second
/// with a 30 s time-to-run stays below it.
pub const MAX_TRACKED: usize = 1 << 18;

/// Entries left behind per queue, by the log offset they point at.
#[derive(Debug, Default)]
pub struct LeftBehind {
    levels: BTreeMap<u64, BTreeSet<u64>>,
    tracked: usize,
}

impl LeftBehind {
    /// Entry `offset` of level `level_ms` no longer belongs to a live timer.
    pub fn level(&mut self, level_ms: u64, offset: u64) {
        if self.tracked < MAX_TRACKED && self.levels.entry(level_ms).or_default().insert(offset) {
            self.tracked += 1;
        }
    }

    /// The level's reader handled entry `offset`.
    pub fn level_passed(&mut self, level_ms: u64, offset: u64) {
        if let Some(set) = self.levels.get_mut(&level_ms) {
            if set.remove(&offset) {
                self.tracked -= 1;
            }
        }
    }

    /// Entries left behind on a level, given the offset of its first unhandled entry (`None`
    /// when it has none): the entries of a queue point at increasing offsets, so any below it
    /// were passed.
    pub fn level_count(&mut self, level_ms: u64, first_unhandled: Option<u64>) -> u64 {
        let Some(set) = self.levels.get_mut(&level_ms) else { return 0 };
        let kept = first_unhandled.map_or_else(BTreeSet::new, |at| set.split_off(&at));
        self.tracked -= set.len();
        *set = kept;
        set.len() as u64
    }

    /// Entries remembered now.
    #[cfg(test)]
    pub fn tracked(&self) -> usize {
        self.tracked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_count_until_passed_or_behind_the_reader() {
        let mut l = LeftBehind::default();
        l.level(1000, 10);
        l.level(1000, 20);
        l.level(1000, 20);
        l.level(1000, 30);
        assert_eq!(l.tracked(), 3);
        assert_eq!(l.level_count(1000, Some(10)), 3);
        l.level_passed(1000, 10);
        assert_eq!(l.level_count(1000, Some(15)), 2);
        // The reader is at 25: the entry at 20 was passed without being reported.
        assert_eq!(l.level_count(1000, Some(25)), 1);
        assert_eq!(l.level_count(1000, None), 0);
        assert_eq!(l.level_count(5000, Some(0)), 0);
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn at_most_max_tracked_are_remembered() {
        let mut l = LeftBehind::default();
        for o in 0..MAX_TRACKED as u64 + 10 {
            l.level(1, o);
        }
        assert_eq!(l.tracked(), MAX_TRACKED);
        l.level_passed(1, 0);
        l.level(2, 1);
        assert_eq!(l.tracked(), MAX_TRACKED);
    }
}
