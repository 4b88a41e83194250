//! What the raft thread, the engine's commit and the writer's flusher share: raft-rs's state
//! machine behind one lock, how far the log is durable and committed, and the events other
//! threads hand the driver.
//!
//! The driver is stepped by whichever thread has news for it (a link's reader with a message,
//! the engine with a proposal, the flusher with a durable end), under the driver's lock, rather
//! than by handing the news to the raft thread: on this path a write used to cross about four
//! thread hand-offs more, each a wake-up and a context switch that cost more than the step. The
//! raft thread only ticks the clock.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use raft::prelude::Message;
use raft::{RaftLog, RawNode};

use super::clock::ClockView;
pub(super) use super::log_store::lock;
use super::log_store::LogStore;
use super::Role;
use super::{ClusterState, Stamps};
use crate::error::Error;
use crate::storage::replica::Passed;
use crate::storage::writer::Deferred;

/// What the driver thread is told.
pub enum Event {
    /// A message from another node.
    Msg(Message),
    /// Node `from` copied every segment of the snapshot it was sent.
    SnapshotFetched {
        /// The node.
        from: u64,
    },
    /// Node `by` says it removed this node from the cluster.
    Removed {
        /// The node that says so (believed only if it leads).
        by: u64,
    },
    /// A clock probe of node `from` came back.
    Clock {
        /// The node probed.
        from: u64,
        /// Its four stamps and the round trip.
        sample: super::clock::Sample,
        /// This node's monotonic µs when it came back.
        at_mono_us: u64,
    },
    /// Node `from` says how far its readers had passed its queues (believed only if it leads).
    Passed {
        /// The node that says so.
        from: u64,
        /// Its positions.
        p: Passed,
    },
}

/// How far the local log is durable and how far a majority has it, in log offsets.
#[derive(Default)]
pub(super) struct Progress {
    pub(super) local_durable: u64,
    pub(super) committed_end: u64,
}

/// What the driver, the engine's commit and the writer's flusher share.
pub struct Shared {
    pub(super) raw: Mutex<RawNode<LogStore>>,
    pub(super) state: Arc<ClusterState>,
    pub(super) progress: Mutex<Progress>,
    pub(super) changed: Condvar,
    /// (index, term, end offset of its mark) of entries in the local log not yet both durable
    /// and committed.
    pub(super) marks: Mutex<VecDeque<(u64, u64, u64)>>,
    pub(super) events: flume::Sender<Event>,
    /// Offsets of the other nodes' clocks.
    pub(super) clocks: Mutex<ClockView>,
    pub(super) stamps: Arc<Stamps>,
    /// How far the engine's clock is held back (see `ClusterClock`).
    pub(super) behind_us: Arc<AtomicU64>,
    pub(super) max_skew_ms: u64,
    pub(super) voters: std::sync::atomic::AtomicUsize,
    /// On a leader: queue positions to send the followers (see [`Passed`]).
    pub(super) passed_out: Mutex<Option<Passed>>,
    /// On a follower: the leader's newest queue positions, not yet applied.
    pub(super) passed_in: Mutex<Option<Passed>>,
    /// The driver, stepped by whichever thread holds its lock (set once it is built).
    pub(super) driver: std::sync::OnceLock<Mutex<super::driver::Driver>>,
    /// (term, index) of the newest entry the engine proposed: a leader's `Ready` holding only
    /// that entry needs no wake-up of the engine, which appends its mark itself.
    pub(super) proposed: Mutex<(u64, u64)>,
    /// Makes the engine thread take a step.
    pub(super) wake_engine: Box<dyn Fn() + Send + Sync>,
    /// Makes the engine take a step on the calling thread when it is free and idle, else on its
    /// own; only for a caller that holds no lock (the engine's step takes several).
    pub(super) wake_engine_here: Box<dyn Fn() + Send + Sync>,
    /// On a leader: replies of writes waiting for a majority to have them, in log order.
    pub(super) waiting: Mutex<VecDeque<Waiting>>,
}

/// Replies of a write that wait for a majority (see `MajorityDurable::defer`).
pub(super) struct Waiting {
    /// Log offset one past the write.
    pub(super) end: u64,
    /// The term this node led in when the write was made.
    pub(super) term: u64,
    pub(super) since: Instant,
    pub(super) release: Deferred,
}

/// Longest a reply waits for a majority before it is answered 503.
pub(super) const MAJORITY_WAIT: Duration = Duration::from_secs(10);

impl Shared {
    /// Steps the driver on this thread: the events queued for it, then its `Ready`. An engine
    /// step it asks for goes to the engine's thread: the callers (the engine's commit, the
    /// flusher) hold locks that step takes.
    pub(super) fn wake(&self) {
        if self.step_driver() {
            (self.wake_engine)();
        }
    }

    /// Hands the driver an event and steps it on this thread (a link's reader, holding no lock).
    /// Events are taken from the queue only under the driver's lock, so those of one sender are
    /// stepped in the order sent.
    pub(super) fn deliver(&self, ev: Event) {
        // Dropped only when the queue is full, which stepping right away prevents; Raft
        // resends what is lost.
        let _ = self.events.try_send(ev);
        // The engine's step is asked for once the driver's lock is free, and taken right here
        // when the engine is free: a follower appends what just arrived without a hand-off.
        if self.step_driver() {
            (self.wake_engine_here)();
        }
    }

    /// Queues an event for the driver's next step without stepping it (more follow at once).
    pub(super) fn queue(&self, ev: Event) {
        // As in `deliver`: a full queue drops it, and Raft resends what is lost.
        let _ = self.events.try_send(ev);
    }

    /// One step of the driver; true when it asks for an engine step.
    fn step_driver(&self) -> bool {
        let Some(d) = self.driver.get() else { return false };
        super::driver::stepped(|| lock(d).step(false))
    }

    /// Releases the replies of writes a majority now has; fails those made in a term this node no
    /// longer leads (another leader may have replaced them) and those that waited longer than
    /// [`MAJORITY_WAIT`]. Called after every step of the driver and at every tick.
    pub(super) fn release_waiting(&self) {
        let (leads, term) = (self.state.role() == Role::Leader, self.state.term());
        let committed = lock(&self.progress).committed_end;
        let mut done = Vec::new();
        {
            let mut waiting = lock(&self.waiting);
            while let Some(w) = waiting.front() {
                let outcome = if !leads || w.term != term {
                    Err("leadership changed before a majority had this write; it may or may not be applied: retry on the leader")
                } else if w.end <= committed {
                    Ok(())
                } else if w.since.elapsed() > MAJORITY_WAIT {
                    Err("no majority acknowledged this write in time; it may or may not be applied")
                } else {
                    break;
                };
                if let Some(w) = waiting.pop_front() {
                    done.push((w, outcome));
                }
            }
        }
        // Released outside the lock: a release answers a request, which may take a while.
        for (w, outcome) in done {
            match outcome {
                Ok(()) => {
                    self.state.quorum_wait_us.observe(w.since.elapsed().as_micros() as u64);
                    (w.release)(None);
                }
                Err(why) => (w.release)(Some(&Error::Unavailable(why.into()))),
            }
        }
    }

    /// The highest entry whose mark ends at or before `offset`.
    pub(super) fn index_at(&self, offset: u64) -> u64 {
        lock(&self.marks).iter().take_while(|(_, _, end)| *end <= offset).last().map_or(0, |(i, _, _)| *i)
    }

    /// The end offset of the highest local entry at or below `index`.
    pub(super) fn end_of(&self, index: u64) -> Option<u64> {
        lock(&self.marks).iter().take_while(|(i, _, _)| *i <= index).last().map(|(_, _, end)| *end)
    }

    /// The newest local entry at or below `index` that Raft's log holds too, same index and
    /// term (all before it then agree as well): its mark (index, term, end offset). A
    /// deposed leader's own entries, which Raft replaced by the new leader's, never count: they
    /// are neither committed here nor a point to cut back to.
    pub(super) fn newest_agreed(&self, index: u64, log: &RaftLog<LogStore>) -> Option<(u64, u64, u64)> {
        lock(&self.marks)
            .iter()
            .rev()
            .filter(|(i, _, _)| *i <= index)
            .find(|(i, t, _)| agrees(log, *i, *t))
            .copied()
    }

    /// Whether the local log holds entry (`index`, `term`) durably (its mark ends at or before
    /// `offset`). The term matters: after a leader change Raft may replace entries this log still
    /// holds (a deposed leader's own), and those must not count as the new ones being durable.
    pub(super) fn holds(&self, index: u64, term: u64, offset: u64) -> bool {
        lock(&self.marks).iter().any(|(i, t, end)| *i == index && *t == term && *end <= offset)
    }
}

/// Whether Raft's log holds entry (`index`, `term`). One compacted out of Raft's window cannot be
/// checked, and counts as held: it was committed, and a node whose log disagreed below the
/// window is sent a snapshot.
pub(super) fn agrees(log: &RaftLog<LogStore>, index: u64, term: u64) -> bool {
    index + 1 < log.first_index() || log.term(index).is_ok_and(|t| t == term)
}

/// Hands the lead to the node that holds most of the log (a leader refused for its clock, or
/// being removed).
pub(super) fn hand_over_lead(raw: &mut RawNode<LogStore>) {
    let me = raw.raft.id;
    let best =
        raw.raft.prs().iter().filter(|(id, _)| **id != me).max_by_key(|(_, p)| p.matched).map(|(id, _)| *id);
    if let Some(to) = best {
        raw.transfer_leader(to);
    }
}

/// Unix time in milliseconds by this node's clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
