//! The driver of raft-rs's state machine: it steps the messages other nodes send, handles each
//! `Ready` (messages out, term and vote saved, entries handed to the engine), tells raft-rs what
//! became durable, and publishes role, indexes and progress. The raft thread ticks its clock;
//! the other threads step it where their news happens (see `shared`).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use raft::prelude::{Entry, EntryType, Message};
use raft::{RawNode, StateRole, Storage};
use tracing::{info, warn};

use super::log_store::{LogStore, SnapPoint, Snapshots, SNAPSHOT_TIMEOUT, WINDOW_BYTES};
use super::net::Net;
use super::persist::save_hard_state;
use super::shared::{agrees, hand_over_lead, lock, now_ms, Event, Shared};
use super::Role;

/// One tick of the consensus clock.
pub const TICK: Duration = Duration::from_millis(100);
/// Election priority of a node whose clock lets it lead (one whose clock does not has 0).
pub(super) const MAY_LEAD_PRIORITY: i64 = 1;
/// A learner this close to the leader's last entry is promoted to voter.
const CAUGHT_UP_ENTRIES: u64 = 16;
/// How often the other nodes' clocks are probed.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// What the driver thread owns.
pub(super) struct Driver {
    pub(super) shared: Arc<Shared>,
    pub(super) rx: flume::Receiver<Event>,
    pub(super) net: Net,
    pub(super) dir: PathBuf,
    pub(super) saved: (u64, u64),
    /// Readies whose entries wait to be durable: (number, last entry's index and term (0, 0: no
    /// entries), messages to send then).
    pub(super) unpersisted: VecDeque<(u64, (u64, u64), Vec<Message>)>,
    /// The other nodes.
    pub(super) peers: Vec<u64>,
    pub(super) next_probe: Instant,
    /// When the consensus clock ticks next.
    pub(super) next_tick: Instant,
    /// Entries in the window, with their sizes.
    pub(super) window: VecDeque<(u64, u64)>,
    pub(super) window_bytes: u64,
    /// The engine is to take a step once the driver's lock is released (see `Shared::wake`).
    pub(super) engine_wanted: bool,
    pub(super) snapshots: Arc<Snapshots>,
    pub(super) restart: Arc<dyn Fn() + Send + Sync>,
    pub(super) window_entries: usize,
    /// The members as last applied here.
    pub(super) members: super::members::Members,
    /// Learners whose promotion was asked for.
    pub(super) promoting: std::collections::HashSet<u64>,
}

/// The raft thread: ticks the consensus clock; everything else steps the driver where it
/// happens (see `shared`).
pub(super) fn run(shared: &Shared) {
    let Some(driver) = shared.driver.get() else { return };
    loop {
        let wait = lock(driver).next_tick.saturating_duration_since(Instant::now());
        std::thread::sleep(wait);
        if stepped(|| lock(driver).step(true)) {
            (shared.wake_engine)();
        }
    }
}

/// Runs one step of the driver. raft-rs stops on a broken invariant by panicking, on whichever
/// thread steps it: a node whose consensus state may be half-changed must not go on answering
/// as if it were part of the cluster.
pub(super) fn stepped<T>(step: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)) {
        Ok(t) => t,
        Err(_) => {
            tracing::error!(
                "the consensus state machine stopped on an internal error; exiting so the node restarts"
            );
            std::process::exit(70);
        }
    }
}

impl Driver {
    /// Steps the events queued for the driver (and the clock, when `tick` and its time has
    /// come), then handles what raft-rs has ready. True when the engine is to take a step.
    pub(super) fn step(&mut self, tick: bool) -> bool {
        let events: Vec<Event> = self.rx.try_iter().collect();
        let shared = self.shared.clone();
        let mut raw = lock(&shared.raw);
        if tick && Instant::now() >= self.next_tick {
            self.tick(&mut raw);
            self.next_tick = Instant::now() + TICK;
        }
        for ev in events {
            self.event(&mut raw, ev);
        }
        self.send_passed(&raw);
        self.ready(&mut raw);
        self.persisted(&mut raw);
        self.publish(&raw);
        std::mem::take(&mut self.engine_wanted)
    }

    /// Steps one event.
    fn event(&mut self, raw: &mut RawNode<LogStore>, ev: Event) {
        match ev {
            Event::Msg(m) => {
                let from = m.from;
                self.shared.state.update_node(from, |n| n.last_contact_ms = Some(now_ms()));
                let _ = raw.step(m);
            }
            Event::Clock { from, sample, at_mono_us } => {
                if let Err(e) = lock(&self.shared.clocks).record(from, sample, at_mono_us) {
                    tracing::debug!(peer = from, error = %e, "clock probe not used");
                }
            }
            Event::SnapshotFetched { from } => {
                info!(node = from, "node fetched its snapshot");
                lock(&self.snapshots.sent).remove(&from);
                raw.report_snapshot(from, raft::SnapshotStatus::Finish);
            }
            Event::Removed { by } => {
                if by == raw.raft.leader_id && !self.members.voters.is_empty() {
                    warn!(leader = by, "the leader removed this node from the cluster: stopping");
                    std::process::exit(0);
                }
            }
            Event::Passed { from, p } => {
                if from == raw.raft.leader_id && raw.raft.state != StateRole::Leader {
                    *lock(&self.shared.passed_in) = Some(p);
                }
            }
        }
    }

    /// One tick of the consensus clock, and the clock checks: probes out every second, whether
    /// this node's clock lets it lead, and how far the engine's clock is held back. A node
    /// refused for its clock gets no vote from a node with as long a log; leading (possible only
    /// when its log is the longest), it accepts no writes, fires nothing and hands the lead to
    /// the node with the most of the log.
    pub(super) fn tick(&mut self, raw: &mut RawNode<LogStore>) {
        let stamps = &self.shared.stamps;
        if Instant::now() >= self.next_probe {
            for peer in &self.peers {
                self.net.probe(*peer, stamps.wall_us(), stamps.mono_us());
            }
            self.next_probe = Instant::now() + PROBE_EVERY;
        }
        self.expire_snapshots(raw);
        self.promote_caught_up(raw);
        // Fails replies that waited too long for a majority (none comes while it is cut off).
        self.shared.release_waiting();
        // Entries this node's store has not taken yet (its append failed: a full disk) are
        // tried again at every tick, not only when more arrive.
        if self.shared.state.indexes().3 < raw.raft.raft_log.last_index() {
            self.engine_wanted = true;
        }
        self.tick_by_clock(raw);
    }

    /// Snapshots sent too long ago without word of their fetch count as failed (sent again when
    /// needed).
    fn expire_snapshots(&mut self, raw: &mut RawNode<LogStore>) {
        let stale: Vec<u64> = {
            let mut sent = lock(&self.snapshots.sent);
            let stale: Vec<u64> =
                sent.iter().filter(|(_, at)| at.elapsed() > SNAPSHOT_TIMEOUT).map(|(id, _)| *id).collect();
            for id in &stale {
                sent.remove(id);
            }
            stale
        };
        for id in stale {
            warn!(node = id, "no word of the snapshot sent to a node; it is sent again when needed");
            raw.report_snapshot(id, raft::SnapshotStatus::Failure);
        }
    }

    /// Ticks raft-rs with this node's election priority as its clock allows (see `tick`).
    fn tick_by_clock(&mut self, raw: &mut RawNode<LogStore>) {
        let stamps = &self.shared.stamps;
        let (mono, local) = (stamps.mono_us(), stamps.wall_us());
        let (verdict, majority) = {
            let view = lock(&self.shared.clocks);
            (
                view.may_lead(self.shared.max_skew_ms, mono),
                view.majority_clock(local, mono, self.shared.voters.load(Ordering::Relaxed)),
            )
        };
        self.shared.behind_us.store((local - majority).max(0) as u64, Ordering::Relaxed);
        let state = &self.shared.state;
        match verdict {
            Ok(()) => {
                if !state.may_lead() {
                    info!("clock within max_clock_skew of the cluster again: this node may lead");
                    state.set_refused(None);
                }
                raw.set_priority(MAY_LEAD_PRIORITY);
                raw.tick();
            }
            Err(report) => {
                if state.may_lead() {
                    warn!(report = %report, "this node's clock is off from the cluster's by more than max_clock_skew: it will not lead");
                }
                state.set_refused(Some(report.to_string()));
                // A voter with a log as long as this node's refuses it its vote (raft-rs's
                // election priority); it can win only with a longer log than every other
                // voter's, when no other node could, and then it hands the lead over below.
                raw.set_priority(0);
                raw.tick();
                if raw.raft.state == StateRole::Leader {
                    state.set_leading(false);
                    // Hand the lead to the node that holds most of the log.
                    hand_over_lead(raw);
                }
            }
        }
    }

    /// On the leader: sends its newest queue positions to every other node.
    pub(super) fn send_passed(&mut self, raw: &RawNode<LogStore>) {
        let Some(p) = lock(&self.shared.passed_out).take() else { return };
        if raw.raft.state != StateRole::Leader {
            return;
        }
        let me = raw.raft.id;
        let ids: Vec<u64> = raw.raft.prs().iter().map(|(id, _)| *id).filter(|id| *id != me).collect();
        for id in ids {
            self.net.passed(id, &p);
        }
    }

    /// Handles one `Ready`: messages out, term and vote saved, entries handed to the engine.
    pub(super) fn ready(&mut self, raw: &mut RawNode<LogStore>) {
        if !raw.has_ready() {
            return;
        }
        let mut rd = raw.ready();
        for m in rd.take_messages() {
            self.net.send(m);
        }
        if !rd.snapshot().is_empty() {
            // Copied before the store opens: recorded durably, then the node starts again.
            let snap = rd.snapshot();
            let (index, term) = (snap.get_metadata().index, snap.get_metadata().term);
            // The members at the snapshot's entry are not in the log this node will have: kept
            // beside it (a new node learns it is a member this way).
            let cs = snap.get_metadata().get_conf_state();
            let mut members = self.members.clone();
            members.voters = cs.get_voters().to_vec();
            members.learners = cs.get_learners().to_vec();
            if let Err(e) = members.save(&self.dir) {
                tracing::error!(error = %e, "cannot save the snapshot's members");
                return;
            }
            info!(index, term, leader = raw.raft.leader_id, "a snapshot arrived: restarting to install it");
            match super::recover::request_snapshot(&self.dir, raw.raft.leader_id, index, term, &snap.data) {
                Ok(()) => (self.restart)(),
                Err(e) => tracing::error!(error = %e, "cannot record the snapshot to install"),
            }
            return;
        }
        if let Some(hs) = rd.hs() {
            if (hs.term, hs.vote) != self.saved {
                if let Err(e) = save_hard_state(&self.dir, hs) {
                    // Without its vote on disk the node could vote twice in a term: stop here.
                    tracing::error!(error = %e, "cannot save the raft state; stopping this node's consensus");
                    std::process::exit(1);
                }
                self.saved = (hs.term, hs.vote);
            }
            raw.mut_store().0.wl().set_hardstate(hs.clone());
        }
        let entries = rd.take_entries();
        let last = entries.last().map(|e| (e.index, e.term));
        if !entries.is_empty() {
            self.remember(&entries);
            if let Err(e) = raw.mut_store().0.wl().append(&entries) {
                warn!(error = %e, "raft entries out of order");
            }
            // The engine appends a proposal's mark itself right after proposing it: a wake-up
            // for that one would cost a context switch for a step with nothing to do.
            let own = entries.len() == 1 && last.is_some_and(|(i, t)| *lock(&self.shared.proposed) == (t, i));
            if !own {
                self.engine_wanted = true;
            }
        }
        let committed = rd.take_committed_entries();
        for e in committed.iter().filter(|e| e.get_entry_type() == EntryType::EntryConfChangeV2) {
            self.apply_change(raw, e);
        }
        let persisted = rd.take_persisted_messages();
        self.unpersisted.push_back((rd.number(), last.unwrap_or((0, 0)), persisted));
        raw.advance_append_async(rd);
        if let Some(last_committed) = committed.last().map(|e| e.index) {
            raw.advance_apply_to(last_committed);
        }
    }

    /// Applies a committed membership change: Raft's configuration, the members file, the links,
    /// the clocks probed and `/v1/cluster`; answers whoever asked for it. A node removed stops.
    pub(super) fn apply_change(&mut self, raw: &mut RawNode<LogStore>, e: &Entry) {
        let waiter = lock(&self.shared.state.change_waiters).remove(&e.index);
        let Some((cc, change)) = super::members::Change::decode(&e.data) else {
            warn!(index = e.index, "a membership entry does not decode; skipped");
            return;
        };
        let cs = match raw.apply_conf_change(&cc) {
            Ok(cs) => cs,
            Err(err) => {
                warn!(index = e.index, error = %err, "membership change refused by raft");
                if let Some(w) = waiter {
                    let _ = w.send(Err(format!("refused: {err}")));
                }
                return;
            }
        };
        raw.mut_store().0.wl().set_conf_state(cs.clone());
        self.members.apply(&cs, &change);
        if let Err(err) = self.members.save(&self.dir) {
            tracing::error!(error = %err, "cannot save the members; they are read from peers at the next start");
        }
        let state = &self.shared.state;
        match &change {
            super::members::Change::Add { id, addr } => {
                self.net.add_peer(*id, addr);
                state.add_node(*id, addr);
            }
            super::members::Change::Remove { id } => {
                if raw.raft.state == StateRole::Leader {
                    self.net.farewell(*id);
                } else {
                    self.net.remove_peer(*id);
                }
                state.remove_node(*id);
                self.promoting.remove(id);
            }
            super::members::Change::Promote { id } => {
                self.promoting.remove(id);
            }
        }
        let me = raw.raft.id;
        lock(&self.shared.clocks)
            .set_peers(cs.get_voters().iter().chain(cs.get_learners()).copied().filter(|id| *id != me));
        self.shared.voters.store(cs.get_voters().len().max(1), Ordering::Relaxed);
        info!(index = e.index, ?change, voters = ?cs.get_voters(), learners = ?cs.get_learners(), "membership changed");
        if let Some(w) = waiter {
            let _ = w.send(Ok(()));
        }
        if change == (super::members::Change::Remove { id: me }) {
            warn!("this node was removed from the cluster: stopping");
            std::process::exit(0);
        }
    }

    /// On the leader: learners that have caught up are made voters (one change at a time).
    pub(super) fn promote_caught_up(&mut self, raw: &RawNode<LogStore>) {
        if raw.raft.state != StateRole::Leader || !self.shared.state.leading() {
            return;
        }
        let last = raw.raft.raft_log.last_index();
        let ready: Vec<u64> = raw
            .raft
            .prs()
            .conf()
            .learners()
            .iter()
            .filter(|id| raw.raft.prs().get(**id).is_some_and(|p| p.matched + CAUGHT_UP_ENTRIES >= last))
            .copied()
            .filter(|id| !self.promoting.contains(id))
            .collect();
        if let Some(id) = ready.first() {
            info!(node = id, "learner caught up: making it a voter");
            self.promoting.insert(*id);
            lock(&self.shared.state.requests).push(super::members::Request {
                change: super::members::Change::Promote { id: *id },
                reply: None,
            });
            self.engine_wanted = true;
        }
    }

    /// Entries appended to the window; the oldest leave it past its bounds (never one not yet
    /// committed).
    pub(super) fn remember(&mut self, entries: &[Entry]) {
        if let Some(first) = entries.first() {
            while self.window.back().is_some_and(|(i, _)| *i >= first.index) {
                if let Some((_, b)) = self.window.pop_back() {
                    self.window_bytes -= b;
                }
            }
        }
        for e in entries {
            self.window.push_back((e.index, e.data.len() as u64));
            self.window_bytes += e.data.len() as u64;
        }
    }

    /// Tells Raft which readies are durable now, sending the messages that waited on them.
    pub(super) fn persisted(&mut self, raw: &mut RawNode<LogStore>) {
        let durable = lock(&self.shared.progress).local_durable;
        // The store must hold these very entries, by index and term: by index alone, a deposed
        // leader's own entries would acknowledge the new leader's that replaced them, which it
        // never stored (and cuts on its restart, below what the leader counted it for). Raft
        // may also replace a ready's entries by a later ready's before the store has them: once
        // a later one is held, the earlier ones are done, and their acknowledgements dropped.
        let shared = &self.shared;
        let held = |index: u64, term: u64| index == 0 || shared.holds(index, term, durable);
        let newest = self.unpersisted.iter().rposition(|(_, (i, t), _)| *i != 0 && held(*i, *t));
        let mut k = 0;
        while let Some((number, (index, term), _)) = self.unpersisted.front() {
            let is_held = held(*index, *term);
            if !is_held && newest.is_none_or(|p| k >= p) {
                break;
            }
            let number = *number;
            if let Some((_, _, msgs)) = self.unpersisted.pop_front() {
                if is_held {
                    for m in msgs {
                        self.net.send(m);
                    }
                }
            }
            raw.on_persist_ready(number);
            k += 1;
        }
        // A leader's own durable entries count toward the majority as soon as they are durable,
        // not only once the whole ready is: the flusher waits on the majority for one batch while
        // the rest of the ready's entries are in batches queued behind it, so with one follower
        // down the leader's acknowledgement never came and writes stalled until MAJORITY_WAIT.
        if raw.raft.state == StateRole::Leader && !self.unpersisted.is_empty() {
            let index = self.shared.index_at(durable);
            if raw.raft.raft_log.term(index).is_ok_and(|t| t == raw.raft.term) {
                let term = raw.raft.term;
                raw.raft.on_persist_entries(index, term);
            }
        }
        if raw.has_ready() {
            self.ready(raw);
        }
    }

    /// Publishes role, term, leader, indexes and progress, releases replies now committed and
    /// trims what no longer needs keeping.
    pub(super) fn publish(&mut self, raw: &RawNode<LogStore>) {
        let r = &raw.raft;
        let role = match r.state {
            StateRole::Leader => Role::Leader,
            StateRole::Candidate | StateRole::PreCandidate => Role::Candidate,
            StateRole::Follower => Role::Follower,
        };
        let state = &self.shared.state;
        if role != state.role() || r.term != state.term() || r.leader_id != state.leader_id().unwrap_or(0) {
            info!(role = role.name(), term = r.term, leader = r.leader_id, "raft role");
            state.set_soft(role, r.term, r.leader_id);
            self.shared.changed.notify_all();
            if role == Role::Leader {
                self.engine_wanted = true;
            }
        }
        let commit = r.raft_log.committed;
        state.set_indexes(commit, r.raft_log.last_index());
        if role == Role::Leader {
            let log_end = lock(&self.shared.marks).back().map_or(0, |(_, _, end)| *end);
            for (id, pr) in r.prs().iter() {
                let matched = pr.matched;
                let lag_bytes = self.shared.end_of(matched).map(|end| log_end.saturating_sub(end));
                state.update_node(*id, |n| {
                    n.match_index = matched;
                    n.lag_bytes = lag_bytes;
                });
            }
        }
        if let Some((index, term, end)) = self.shared.newest_agreed(commit, &r.raft_log) {
            if index == commit {
                *lock(&self.snapshots.point) = Some(SnapPoint { index, term, end });
            }
            let mut p = lock(&self.shared.progress);
            if end > p.committed_end {
                p.committed_end = end;
                self.shared.changed.notify_all();
            }
        }
        self.trim(raw, commit);
        self.shared.release_waiting();
    }

    /// Forgets marks both durable and committed, and compacts the window past its bounds.
    pub(super) fn trim(&mut self, raw: &RawNode<LogStore>, commit: u64) {
        let durable = lock(&self.shared.progress).local_durable;
        // A leader keeps the marks of entries its followers still lack, to tell their lag in bytes
        // (bounded: a follower further behind than the window needs a snapshot anyway).
        let slowest = if raw.raft.state == StateRole::Leader {
            raw.raft.prs().iter().map(|(_, p)| p.matched).min().unwrap_or(commit)
        } else {
            commit
        };
        let mut keep_from = commit
            .min(self.shared.index_at(durable))
            .min(slowest.max(commit.saturating_sub(self.window_entries as u64)));
        // A ready still waiting needs its last entry's mark to tell when it is durable.
        if let Some((_, (index, _), _)) = self.unpersisted.iter().find(|(_, (i, _), _)| *i != 0) {
            keep_from = keep_from.min(*index);
        }
        {
            // A mark goes only while the next one agrees with Raft's log: a deposed leader whose
            // own entries Raft replaced keeps the last mark both logs share, the point its log is
            // cut back to (see `StoreSide::missing`). Without it, a node that had piled up many
            // entries of its own cut them one per restart.
            let mut marks = lock(&self.shared.marks);
            while marks.len() > 1
                && marks.front().is_some_and(|(i, _, _)| *i < keep_from)
                && marks.get(1).is_some_and(|(i, t, _)| agrees(&raw.raft.raft_log, *i, *t))
            {
                marks.pop_front();
            }
        }
        let mut compact_to = None;
        while self.window.len() > self.window_entries || self.window_bytes > WINDOW_BYTES {
            match self.window.front() {
                Some((i, b)) if *i < commit => {
                    compact_to = Some(*i + 1);
                    self.window_bytes -= *b;
                    self.window.pop_front();
                }
                _ => break,
            }
        }
        // The first members are not an entry of the log: a node that needs entry 1 (a new one)
        // must get a snapshot, which carries them.
        let stored = raw.store().0.last_index().unwrap_or(0);
        // (Only once entry 2 is there: raft-rs's in-memory storage must keep one entry.)
        if commit >= 2 && stored >= 2 && raw.store().0.first_index().is_ok_and(|f| f <= 1) {
            compact_to = Some(compact_to.map_or(2, |to| to.max(2)));
        }
        // Never past what the storage holds (raft-rs panics there).
        if let Some(to) = compact_to.map(|to| to.min(stored + 1)) {
            let _ = raw.store().0.wl().compact(to);
        }
    }
}
