//! Queue entries left behind by messages that moved on, so that stats count live entries only.
//!
//! A queue entry stays in its file until its reader passes it: the timer of a message cancelled
//! while delayed, of a reservation acked or nacked before its time-to-run, the topic entry of a
//! ready message cancelled or finished by id. Each is skipped when reached, but until then a
//! backlog of `len - cursor` would count it. The engine notes such an entry here when it makes
//! the change, by the log offset the entry points at, and forgets it when the reader passes it.
//!
//! In memory only, and bounded: after a restart, entries left behind before it count until they
//! are reached, as do those left beyond [`MAX_TRACKED`] at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Most entries remembered at once: 256 Ki offsets, a few MiB. A steady 8,000 acks a second
/// with a 30 s time-to-run stays below it.
pub const MAX_TRACKED: usize = 1 << 18;

/// Entries left behind per queue, by the log offset they point at.
#[derive(Debug, Default)]
pub struct LeftBehind {
    levels: BTreeMap<u64, BTreeSet<u64>>,
    topics: HashMap<String, BTreeSet<u64>>,
    tracked: usize,
}

impl LeftBehind {
    /// Entry `offset` of level `level_ms` no longer belongs to a live timer.
    pub fn level(&mut self, level_ms: u64, offset: u64) {
        if self.tracked < MAX_TRACKED && self.levels.entry(level_ms).or_default().insert(offset) {
            self.tracked += 1;
        }
    }

    /// Entry `offset` of topic queue `queue` no longer belongs to a ready message.
    pub fn topic(&mut self, queue: &str, offset: u64) {
        if self.tracked >= MAX_TRACKED {
            return;
        }
        let set = match self.topics.get_mut(queue) {
            Some(set) => set,
            None => self.topics.entry(queue.to_string()).or_default(),
        };
        if set.insert(offset) {
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

    /// The topic queue's reader passed entry `offset`.
    pub fn topic_passed(&mut self, queue: &str, offset: u64) {
        if let Some(set) = self.topics.get_mut(queue) {
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

    /// Entries left behind in a topic queue; `read_to_end` forgets them all.
    pub fn topic_count(&mut self, queue: &str, read_to_end: bool) -> u64 {
        let Some(set) = self.topics.get_mut(queue) else { return 0 };
        if read_to_end {
            self.tracked -= set.len();
            set.clear();
        }
        set.len() as u64
    }

    /// Forgets topic queues for which `keep` says no (the store forgot them).
    pub fn retain_topics(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let mut dropped = 0;
        self.topics.retain(|name, set| {
            let k = keep(name) && !set.is_empty();
            if !k {
                dropped += set.len();
            }
            k
        });
        self.tracked -= dropped;
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
        l.topic("t", 5);
        assert_eq!(l.tracked(), 4);
        assert_eq!(l.level_count(1000, Some(10)), 3);
        l.level_passed(1000, 10);
        assert_eq!(l.level_count(1000, Some(15)), 2);
        // The reader is at 25: the entry at 20 was passed without being reported.
        assert_eq!(l.level_count(1000, Some(25)), 1);
        assert_eq!(l.level_count(1000, None), 0);
        assert_eq!(l.level_count(5000, Some(0)), 0);
        assert_eq!(l.topic_count("t", false), 1);
        l.topic_passed("t", 5);
        assert_eq!(l.topic_count("t", false), 0);
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn forgotten_topics_and_read_queues_are_dropped() {
        let mut l = LeftBehind::default();
        l.topic("a", 1);
        l.topic("b", 2);
        l.topic("b", 3);
        l.retain_topics(|t| t == "b");
        assert_eq!(l.tracked(), 2);
        assert_eq!(l.topic_count("b", true), 0);
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
        l.topic("t", 1);
        assert_eq!(l.tracked(), MAX_TRACKED);
    }
}
