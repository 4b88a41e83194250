//! The Raft driver: one thread that owns the consensus state machine (raft-rs's `RawNode`),
//! ticks it, feeds it the messages other nodes send, and turns its output into messages out,
//! entries for the store and released replies.
//!
//! How an entry travels (see `storage::replica` for the store's side):
//! - on the leader, the engine's commit proposes the step's records ([`Replicator::propose`]
//!   gives the entry its index at once) and appends the entry's mark; the writer syncs the log,
//!   then [`MajorityDurable`] tells this thread how far the log is durable and waits until the
//!   entry is committed (a majority has it durable) before the replies go out;
//! - on a follower, entries arrive in a `Ready`; this thread wakes the engine, whose commit
//!   appends them ([`Replicator::missing`]) and syncs them; once durable they are acknowledged to
//!   the leader.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use raft::prelude::{ConfState, Entry, EntryType, HardState, Message, Snapshot};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, RawNode, StateRole, Storage};
use tracing::{info, warn};

use std::sync::atomic::{AtomicU64, Ordering};

use super::clock::{ClockView, FilterConfig};
use super::net::Net;
use super::recover::Recovered;
use super::{ClusterConfig, ClusterState, Role, Stamps};
use crate::error::{Error, Result};
use crate::storage::format::EntryKind;
use crate::storage::replica::{Diverged, Passed, ReplicaEntry, Replicator, Sealed};
use crate::storage::writer::Condition;

/// One tick of the consensus clock.
pub const TICK: Duration = Duration::from_millis(100);
/// Ticks without a leader's word before a follower stands for election (randomized up to
/// twice this): 0.8 to 1.6 s, so a failover completes within 2 s.
const ELECTION_TICKS: usize = 8;
/// Ticks between a leader's heartbeats.
const HEARTBEAT_TICKS: usize = 1;
/// Entries kept in memory to send to a follower that fell behind, in bytes and in number.
const WINDOW_BYTES: u64 = 64 << 20;
/// See [`WINDOW_BYTES`].
const WINDOW_ENTRIES: usize = 100_000;
/// Shrinks the window (in entries) so tests reach a snapshot without writing 64 MiB.
pub const TEST_WINDOW_ENTRIES: &str = "DELAYD_TEST_RAFT_WINDOW_ENTRIES";

fn window_entries() -> usize {
    std::env::var(TEST_WINDOW_ENTRIES).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(WINDOW_ENTRIES)
}
/// Election priority of a node whose clock lets it lead (one whose clock does not has 0).
const MAY_LEAD_PRIORITY: i64 = 1;
/// A learner this close to the leader's last entry is promoted to voter.
const CAUGHT_UP_ENTRIES: u64 = 16;
/// How often the other nodes' clocks are probed.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Longest a reply waits for a majority before it is answered 503.
const MAJORITY_WAIT: Duration = Duration::from_secs(10);

/// What the driver thread is told.
pub enum Event {
    /// A message from another node.
    Msg(Message),
    /// Something changed (a proposal, the durable end of the log): look again.
    Wake,
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
        /// This node's monotonic ms when it came back.
        at_mono_ms: u64,
    },
    /// Node `from` says how far its readers had passed its queues (believed only if it leads).
    Passed {
        /// The node that says so.
        from: u64,
        /// Its positions.
        p: Passed,
    },
}

/// Raft's view of the log: the entries of a bounded window in memory (to send to followers);
/// the commit log is the durable copy. A follower behind the window gets a snapshot: the
/// newest committed entry's place in the log, and the list of segment files up to it, which it
/// then copies from this node's data directory (see `recover`).
pub struct LogStore(MemStorage, Arc<Snapshots>);

/// The newest committed entry with its mark in this log: where a snapshot can stand.
#[derive(Debug, Clone, Copy)]
struct SnapPoint {
    index: u64,
    term: u64,
    /// Log offset one past its mark.
    end: u64,
}

/// What a leader knows of the snapshots it can send and has sent.
struct Snapshots {
    dir: PathBuf,
    point: Mutex<Option<SnapPoint>>,
    /// Followers a snapshot was sent to, and when: unanswered for long, it is given up.
    sent: Mutex<std::collections::HashMap<u64, Instant>>,
}

/// Gives up on a snapshot a follower did not report fetched within this (it is sent again).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

impl Snapshots {
    /// The snapshot standing at the current point: its metadata, and as data the log's end at
    /// that entry and every segment file (base, size) below it.
    fn make(&self, conf: ConfState, to: u64) -> raft::Result<Snapshot> {
        let unavailable = || raft::Error::Store(raft::StorageError::SnapshotTemporarilyUnavailable);
        let point = (*lock(&self.point)).ok_or_else(unavailable)?;
        let log_dir = self.dir.join("commitlog");
        let bases = crate::storage::commitlog::list_numbered(&log_dir).map_err(|_| unavailable())?;
        let mut data = Vec::with_capacity(12 + bases.len() * 16);
        data.extend_from_slice(&point.end.to_le_bytes());
        let mut files = Vec::new();
        for base in bases.into_iter().filter(|b| *b < point.end) {
            let path = log_dir.join(crate::storage::commitlog::segment_name(base));
            let size = std::fs::metadata(&path).map_err(|_| unavailable())?.len();
            files.push((base, size));
        }
        data.extend_from_slice(&(files.len() as u32).to_le_bytes());
        for (base, size) in files {
            data.extend_from_slice(&base.to_le_bytes());
            data.extend_from_slice(&size.to_le_bytes());
        }
        let mut snap = Snapshot { data: data.into(), ..Default::default() };
        snap.mut_metadata().index = point.index;
        snap.mut_metadata().term = point.term;
        snap.mut_metadata().set_conf_state(conf);
        lock(&self.sent).insert(to, Instant::now());
        info!(
            node = to,
            index = point.index,
            "node is behind the entries kept in memory: sending it a snapshot"
        );
        Ok(snap)
    }
}

impl Storage for LogStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.0.initial_state()
    }
    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.0.entries(low, high, max_size, context)
    }
    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.0.term(idx)
    }
    fn first_index(&self) -> raft::Result<u64> {
        self.0.first_index()
    }
    fn last_index(&self) -> raft::Result<u64> {
        self.0.last_index()
    }
    fn snapshot(&self, _request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let conf = self.0.initial_state()?.conf_state;
        self.1.make(conf, to)
    }
}

/// How far the local log is durable and how far a majority has it, in log offsets.
#[derive(Default)]
struct Progress {
    local_durable: u64,
    committed_end: u64,
}

/// What the driver, the engine's commit and the writer's flusher share.
pub struct Shared {
    raw: Mutex<RawNode<LogStore>>,
    state: Arc<ClusterState>,
    progress: Mutex<Progress>,
    changed: Condvar,
    /// (index, term, end offset of its mark) of entries in the local log not yet both durable
    /// and committed.
    marks: Mutex<VecDeque<(u64, u64, u64)>>,
    events: flume::Sender<Event>,
    /// Offsets of the other nodes' clocks.
    clocks: Mutex<ClockView>,
    stamps: Arc<Stamps>,
    /// How far the engine's clock is held back (see `ClusterClock`).
    behind_us: Arc<AtomicU64>,
    max_skew_ms: u64,
    voters: std::sync::atomic::AtomicUsize,
    /// On a leader: queue positions to send the followers (see [`Passed`]).
    passed_out: Mutex<Option<Passed>>,
    /// On a follower: the leader's newest queue positions, not yet applied.
    passed_in: Mutex<Option<Passed>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn wake(&self) {
        let _ = self.events.try_send(Event::Wake);
    }

    /// The highest entry whose mark ends at or before `offset`.
    fn index_at(&self, offset: u64) -> u64 {
        lock(&self.marks).iter().take_while(|(_, _, end)| *end <= offset).last().map_or(0, |(i, _, _)| *i)
    }

    /// The end offset of the highest local entry at or below `index`.
    fn end_of(&self, index: u64) -> Option<u64> {
        lock(&self.marks).iter().take_while(|(i, _, _)| *i <= index).last().map(|(_, _, end)| *end)
    }

    /// Whether the local log holds entry (`index`, `term`) durably (its mark ends at or before
    /// `offset`). The term matters: after a leader change Raft may replace entries this log still
    /// holds (a deposed leader's own), and those must not count as the new ones being durable.
    fn holds(&self, index: u64, term: u64, offset: u64) -> bool {
        lock(&self.marks).iter().any(|(i, t, end)| *i == index && *t == term && *end <= offset)
    }
}

/// The store's side: see [`Replicator`].
pub struct StoreSide {
    shared: Arc<Shared>,
    dir: PathBuf,
    restart: Arc<dyn Fn() + Send + Sync>,
}

impl Replicator for StoreSide {
    fn missing(&mut self, sealed: Sealed) -> std::result::Result<Vec<ReplicaEntry>, Diverged> {
        let raw = lock(&self.shared.raw);
        let log = &raw.raft.raft_log;
        let (last, committed) = (log.last_index(), log.committed);
        // Cut back to the newest entry both logs hold (same index and term: all before it then
        // agree too). Not to the commit index: Raft's may already count the leader's entries at
        // indexes where this log still holds a deposed leader's own, and not one entry a
        // restart either.
        let agreed = |below: u64| {
            let marks = lock(&self.shared.marks);
            let found = marks.iter().rev().filter(|(i, _, _)| *i <= below);
            found
                .map(|(i, t, _)| (*i, *t))
                .find(|(i, t)| log.term(*i).is_ok_and(|lt| lt == *t))
                .map(|(i, _)| i)
        };
        if sealed.index > last {
            return Err(Diverged {
                keep: agreed(last).unwrap_or(committed.min(last)),
                why: "the leader's log is shorter than this node's",
            });
        }
        if sealed.index > 0 {
            if let Ok(t) = log.term(sealed.index) {
                if t != sealed.term {
                    return Err(Diverged {
                        keep: agreed(sealed.index - 1).unwrap_or(committed.min(sealed.index - 1)),
                        why: "this node's last entry is not the leader's",
                    });
                }
            }
        }
        if sealed.index == last {
            return Ok(Vec::new());
        }
        let entries = log
            .entries(sealed.index + 1, None, GetEntriesContext::empty(false))
            .map_err(|_| Diverged { keep: committed.min(sealed.index), why: "entries no longer held" })?;
        Ok(entries.into_iter().map(replica_entry).collect())
    }

    fn propose(&mut self, records: Vec<u8>, data_start: u64) -> Option<(u64, u64)> {
        let mut raw = lock(&self.shared.raw);
        if raw.raft.state != StateRole::Leader || !self.shared.state.leading() {
            return None;
        }
        // The context carries where the records start in the leader's log: a follower checks it
        // places them at the same offsets (records refer to each other by offset).
        raw.propose(data_start.to_le_bytes().to_vec(), records).ok()?;
        let at = (raw.raft.term, raw.raft.raft_log.last_index());
        drop(raw);
        self.shared.wake();
        Some(at)
    }

    fn sealed(&mut self, sealed: Sealed) {
        lock(&self.shared.marks).push_back((sealed.index, sealed.term, sealed.end));
        self.shared.state.set_sealed(sealed.index);
        let state = &self.shared.state;
        if state.role() == Role::Leader && sealed.term == state.term() && !state.leading() && state.may_lead()
        {
            info!(
                term = sealed.term,
                index = sealed.index,
                "leader caught up with its log; accepting writes"
            );
            state.set_leading(true);
        }
    }

    fn leading(&self) -> bool {
        self.shared.state.leading()
    }

    fn passed(&mut self, p: Passed) {
        *lock(&self.shared.passed_out) = Some(p);
        self.shared.wake();
    }

    fn take_passed(&mut self, sealed: Sealed) -> Option<Passed> {
        // Taken out before Raft's lock: the driver holds that one while it fills this slot.
        let p = lock(&self.shared.passed_in).take()?;
        let (committed, term) = {
            let raw = lock(&self.shared.raw);
            let log = &raw.raft.raft_log;
            (log.committed, log.term(p.index).ok())
        };
        if p.index > sealed.index || p.index > committed {
            // Not yet here: kept, unless newer positions arrived meanwhile.
            lock(&self.shared.passed_in).get_or_insert(p);
            return None;
        }
        // The same entry here (index and term) means the same log up to it: the positions are
        // of records this node holds, committed. Otherwise (another leader's entry replaced it,
        // or it left the window) they are dropped.
        (term == Some(p.term)).then_some(p)
    }

    fn committed_end(&self) -> u64 {
        lock(&self.shared.progress).committed_end
    }

    fn membership(&mut self) -> Vec<ReplicaEntry> {
        let requests: Vec<super::members::Request> = std::mem::take(&mut *lock(&self.shared.state.requests));
        if requests.is_empty() {
            return Vec::new();
        }
        let mut raw = lock(&self.shared.raw);
        let mut out = Vec::new();
        for mut req in requests {
            let mut reply = req.reply.take();
            let mut refuse = |why: String| {
                if let Some(r) = reply.take() {
                    let _ = r.send(Err(why));
                }
            };
            if raw.raft.state != StateRole::Leader || !self.shared.state.leading() {
                refuse("this node is not the leader".into());
                continue;
            }
            if req.change == (super::members::Change::Remove { id: raw.raft.id }) {
                // The leader leaves last: it hands the lead over and the next leader removes it.
                hand_over_lead(&mut raw);
                refuse(
                    "this node leads: the lead is being handed over first; retry on the new leader".into(),
                );
                continue;
            }
            if raw.propose_conf_change(Vec::new(), req.change.encode()).is_err() {
                refuse("raft refused the change".into());
                continue;
            }
            let index = raw.raft.raft_log.last_index();
            let Some(e) = raw
                .raft
                .raft_log
                .entries(index, None, GetEntriesContext::empty(false))
                .ok()
                .and_then(|v| v.into_iter().next())
            else {
                refuse("the change was not appended".into());
                continue;
            };
            if e.get_entry_type() == EntryType::EntryConfChangeV2 {
                if let Some(r) = reply.take() {
                    lock(&self.shared.state.change_waiters).insert(index, r);
                }
            } else {
                // raft-rs turns a change proposed while another is pending into an empty entry.
                refuse("another membership change is still in progress; retry when it is done".into());
            }
            out.push(replica_entry(e));
        }
        drop(raw);
        self.shared.wake();
        out
    }

    fn refuse(&mut self, why: &str) {
        tracing::error!("{why}; stopping this node");
        std::process::exit(2);
    }

    fn diverged(&mut self, d: Diverged) {
        warn!(
            keep_index = d.keep,
            why = d.why,
            "this node's log diverged from the leader's; restarting to cut it back"
        );
        self.shared.state.set_leading(false);
        match super::recover::request_cut(&self.dir, d.keep) {
            Ok(()) => (self.restart)(),
            Err(e) => {
                tracing::error!(error = %e, "cannot record where to cut the log; stopping");
                std::process::exit(1);
            }
        }
    }
}

fn replica_entry(e: Entry) -> ReplicaEntry {
    let conf = e.get_entry_type() != EntryType::EntryNormal;
    let (term, index) = (e.term, e.index);
    let data = e.data.to_vec();
    let origin_start = <[u8; 8]>::try_from(&e.context[..]).ok().map(u64::from_le_bytes);
    ReplicaEntry {
        term,
        index,
        origin_start,
        kind: if conf { EntryKind::ConfChange } else { EntryKind::Normal },
        records: if conf { Vec::new() } else { data.clone() },
        payload: if conf { data } else { Vec::new() },
    }
}

/// The writer's second durability condition in a cluster: the batch's entries are durable on a
/// majority of nodes.
pub struct MajorityDurable(pub Arc<Shared>);

impl Condition for MajorityDurable {
    fn reach(&mut self, _paths: &[&PathBuf], end: u64, owed: bool) -> Result<()> {
        let shared = &self.0;
        {
            let mut p = lock(&shared.progress);
            p.local_durable = p.local_durable.max(end);
        }
        shared.wake();
        // A follower's appends of the leader's entries answer no client, and a leader does not
        // wait for a batch that owes no reply (the entries of a former leader it appended as it
        // took over): they commit only with a later entry of its own term, which this wait
        // would hold back behind them.
        if !owed {
            return Ok(());
        }
        // Only a leader releases replies, once a majority has the batch: a batch that waited in
        // the flusher behind the one that saw this node step down holds records of its own,
        // never committed, and must not be answered 2xx.
        if shared.state.role() != Role::Leader {
            return Err(Error::Unavailable(
                "this node no longer leads; the write may or may not be applied: retry on the leader".into(),
            ));
        }
        let term = shared.state.term();
        let started = Instant::now();
        let mut p = lock(&shared.progress);
        while p.committed_end < end {
            if shared.state.role() != Role::Leader || shared.state.term() != term {
                return Err(Error::Unavailable(
                    "leadership changed before a majority had this write; it may or may not be applied: retry on the leader"
                        .into(),
                ));
            }
            if started.elapsed() > MAJORITY_WAIT {
                return Err(Error::Unavailable(
                    "no majority acknowledged this write in time; it may or may not be applied".into(),
                ));
            }
            p = shared
                .changed
                .wait_timeout(p, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        shared.state.quorum_wait_us.observe(started.elapsed().as_micros() as u64);
        Ok(())
    }
}

/// The persisted part of Raft's state: term, vote and commit index, in `cluster/raft_state`.
fn hard_state_path(dir: &Path) -> PathBuf {
    dir.join("cluster").join("raft_state")
}

/// Reads the persisted term, vote and commit (zeroes when there is none yet).
pub fn load_hard_state(dir: &Path) -> Result<HardState> {
    let path = hard_state_path(dir);
    let mut hs = HardState::default();
    match std::fs::read(&path) {
        Ok(b) if b.len() == 28 && crc32fast::hash(&b[..24]).to_le_bytes() == b[24..28] => {
            let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            hs.term = word(0);
            hs.vote = word(1);
            hs.commit = word(2);
            Ok(hs)
        }
        Ok(_) => Err(Error::Corrupt {
            file: path.display().to_string(),
            offset: 0,
            reason: "raft state file damaged (bad length or CRC); the node's vote is unknown".into(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(hs),
        Err(e) => Err(Error::io_at("read", &path, e)),
    }
}

/// Writes term, vote and commit durably before any message that depends on them goes out.
pub(crate) fn save_hard_state(dir: &Path, hs: &HardState) -> Result<()> {
    let path = hard_state_path(dir);
    let mut b = Vec::with_capacity(28);
    for v in [hs.term, hs.vote, hs.commit] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&crc32fast::hash(&b).to_le_bytes());
    write_durably(&path, &b).map_err(|e| Error::io_at("write", &path, e))
}

/// Replaces `path` with `bytes` atomically and durably: a private temporary file synced,
/// renamed over it, and the directory synced (created 0700, itself synced into its parent, the
/// first time).
pub(crate) fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.is_dir() {
        crate::storage::io::create_private_dir(dir).map_err(std::io::Error::other)?;
        if let Some(parent) = dir.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_data()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// A running node: its shared state and driver thread.
pub struct Node {
    /// Shared with the store and the writer.
    pub shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: PathBuf,
    restart: Arc<dyn Fn() + Send + Sync>,
}

/// What a node is given by the process around it.
pub struct Hooks {
    /// Makes the engine take a step (to append entries that arrived).
    pub wake_engine: Box<dyn Fn() + Send>,
    /// Restarts the process (after a divergence was recorded).
    pub restart: Arc<dyn Fn() + Send + Sync>,
    /// The clocks probes are stamped with.
    pub stamps: Arc<Stamps>,
    /// Where the engine's clock correction goes (see `ClusterClock`).
    pub behind_us: Arc<AtomicU64>,
    /// The members at the start.
    pub members: super::members::Members,
}

/// What the driver thread owns.
struct Driver {
    shared: Arc<Shared>,
    rx: flume::Receiver<Event>,
    net: Net,
    dir: PathBuf,
    saved: (u64, u64),
    /// Readies whose entries wait to be durable: (number, last entry's index and term (0, 0: no
    /// entries), messages to send then).
    unpersisted: VecDeque<(u64, (u64, u64), Vec<Message>)>,
    /// The other nodes.
    peers: Vec<u64>,
    next_probe: Instant,
    /// Entries in the window, with their sizes.
    window: VecDeque<(u64, u64)>,
    window_bytes: u64,
    wake_engine: Box<dyn Fn() + Send>,
    snapshots: Arc<Snapshots>,
    restart: Arc<dyn Fn() + Send + Sync>,
    window_entries: usize,
    /// The members as last applied here.
    members: super::members::Members,
    /// Learners whose promotion was asked for.
    promoting: std::collections::HashSet<u64>,
}

impl Node {
    /// Starts a node from what recovery found in its log; `wake_engine` makes the engine take
    /// a step (to append entries that arrived).
    pub fn start(
        cfg: &ClusterConfig,
        state: Arc<ClusterState>,
        recovered: Recovered,
        net_start: impl FnOnce(flume::Sender<Event>, Arc<Stamps>) -> Result<Net>,
        hooks: Hooks,
    ) -> Result<Node> {
        let Hooks { wake_engine, restart, stamps, behind_us, members } = hooks;
        let conf = members.conf_state();
        let store = MemStorage::new_with_conf_state(conf.clone());
        let mut hs = load_hard_state(&cfg.data_dir)?;
        let mut window = VecDeque::new();
        let mut window_bytes = 0;
        {
            let mut core = store.wl();
            if let Some((index, term)) = recovered.base {
                let mut snap = Snapshot::default();
                snap.mut_metadata().index = index;
                snap.mut_metadata().term = term;
                snap.mut_metadata().set_conf_state(conf);
                core.apply_snapshot(snap).map_err(|e| Error::Config(format!("raft log: {e}")))?;
            }
            let entries: Vec<Entry> = recovered.entries.iter().map(entry_of).collect();
            for e in &entries {
                window.push_back((e.index, e.data.len() as u64));
                window_bytes += e.data.len() as u64;
            }
            core.append(&entries).map_err(|e| Error::Config(format!("raft log: {e}")))?;
            let first = recovered.base.map_or(0, |(i, _)| i);
            let last = entries.last().map_or(first, |e| e.index);
            hs.commit = hs.commit.clamp(first, last);
            // A fresh cluster starts at term 1, not 0: raft-rs refuses to send a vote refusal
            // stamped with term 0 (it panics), which a node refusing a lower-priority candidate
            // before any election would otherwise do.
            hs.term = hs.term.max(recovered.last.term).max(1);
            core.set_hardstate(hs.clone());
        }
        let raft_cfg = raft::Config {
            id: cfg.node_id,
            election_tick: ELECTION_TICKS,
            heartbeat_tick: HEARTBEAT_TICKS,
            applied: hs.commit,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            priority: MAY_LEAD_PRIORITY,
            ..Default::default()
        };
        raft_cfg.validate().map_err(|e| Error::Config(format!("raft: {e}")))?;
        let logger = super::net::raft_logger();
        let snapshots = Arc::new(Snapshots {
            dir: cfg.data_dir.clone(),
            point: Mutex::new(None),
            sent: Mutex::new(std::collections::HashMap::new()),
        });
        let raw = RawNode::new(&raft_cfg, LogStore(store, snapshots.clone()), &logger)
            .map_err(|e| Error::Config(format!("raft: {e}")))?;
        let (tx, rx) = flume::bounded(65_536);
        let shared = Arc::new(Shared {
            raw: Mutex::new(raw),
            state,
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            marks: Mutex::new(recovered.marks.into_iter().collect()),
            events: tx.clone(),
            clocks: Mutex::new(ClockView::new(cfg.others().map(|(id, _)| *id), FilterConfig::default())),
            stamps: stamps.clone(),
            behind_us,
            max_skew_ms: cfg.max_clock_skew_ms,
            voters: std::sync::atomic::AtomicUsize::new(members.voters.len().max(1)),
            passed_out: Mutex::new(None),
            passed_in: Mutex::new(None),
        });
        {
            let mut p = lock(&shared.progress);
            p.local_durable = recovered.last.end;
        }
        shared.state.set_sealed(recovered.last.index);
        let net = net_start(tx, stamps)?;
        let mut driver = Driver {
            shared: shared.clone(),
            rx,
            net,
            dir: cfg.data_dir.clone(),
            saved: (hs.term, hs.vote),
            unpersisted: VecDeque::new(),
            peers: cfg.others().map(|(id, _)| *id).collect(),
            next_probe: Instant::now(),
            window,
            window_bytes,
            wake_engine,
            snapshots,
            restart: restart.clone(),
            window_entries: window_entries(),
            members,
            promoting: std::collections::HashSet::new(),
        };
        let thread = std::thread::Builder::new()
            .name("delayd-raft".into())
            .spawn(move || {
                // raft-rs stops on a broken invariant by panicking: a node without its consensus
                // thread must not go on answering as if it were part of the cluster.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.run())).is_err() {
                    tracing::error!(
                        "the consensus thread stopped on an internal error; exiting so the node restarts"
                    );
                    std::process::exit(70);
                }
            })
            .map_err(|e| Error::io("spawn raft thread", e))?;
        Ok(Node { shared, thread: Some(thread), dir: cfg.data_dir.clone(), restart })
    }

    /// The store's side of this node.
    pub fn replicator(&self) -> Box<dyn Replicator> {
        Box::new(StoreSide {
            shared: self.shared.clone(),
            dir: self.dir.clone(),
            restart: self.restart.clone(),
        })
    }

    /// The writer's majority condition.
    pub fn condition(&self) -> Box<dyn Condition> {
        Box::new(MajorityDurable(self.shared.clone()))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The driver stops when every event sender is gone; it is not waited for here, as the
        // store's side may still hold one.
        self.thread.take();
    }
}

fn entry_of(e: &ReplicaEntry) -> Entry {
    let mut out = Entry { term: e.term, index: e.index, ..Default::default() };
    if let Some(start) = e.origin_start {
        out.context = start.to_le_bytes().to_vec().into();
    }
    if e.kind == EntryKind::ConfChange {
        out.set_entry_type(EntryType::EntryConfChangeV2);
        out.data = e.payload.clone().into();
    } else {
        out.data = e.records.clone().into();
    }
    out
}

impl Driver {
    fn run(&mut self) {
        let mut next_tick = Instant::now() + TICK;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            let mut events = Vec::new();
            match self.rx.recv_timeout(wait) {
                Ok(ev) => events.push(ev),
                Err(flume::RecvTimeoutError::Timeout) => {}
                Err(flume::RecvTimeoutError::Disconnected) => return,
            }
            events.extend(self.rx.try_iter());
            let shared = self.shared.clone();
            let mut raw = lock(&shared.raw);
            if Instant::now() >= next_tick {
                self.tick(&mut raw);
                next_tick = Instant::now() + TICK;
            }
            for ev in events {
                match ev {
                    Event::Msg(m) => {
                        let from = m.from;
                        self.shared.state.update_node(from, |n| n.last_contact_ms = Some(now_ms()));
                        let _ = raw.step(m);
                    }
                    Event::Clock { from, sample, at_mono_ms } => {
                        if let Err(e) = lock(&self.shared.clocks).record(from, sample, at_mono_ms) {
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
                    Event::Wake => {}
                }
            }
            self.send_passed(&raw);
            self.ready(&mut raw);
            self.persisted(&mut raw);
            self.publish(&raw);
        }
    }

    /// One tick of the consensus clock, and the clock checks: probes out every second, whether
    /// this node's clock lets it lead, and how far the engine's clock is held back. A node
    /// refused for its clock gets no vote from a node with as long a log; leading (possible only
    /// when its log is the longest), it accepts no writes, fires nothing and hands the lead to
    /// the node with the most of the log.
    fn tick(&mut self, raw: &mut RawNode<LogStore>) {
        let stamps = &self.shared.stamps;
        if Instant::now() >= self.next_probe {
            for peer in &self.peers {
                self.net.probe(*peer, stamps.wall_ms(), stamps.mono_ms());
            }
            self.next_probe = Instant::now() + PROBE_EVERY;
        }
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
        self.promote_caught_up(raw);
        // Entries this node's store has not taken yet (its append failed: a full disk) are
        // tried again at every tick, not only when more arrive.
        if self.shared.state.indexes().3 < raw.raft.raft_log.last_index() {
            (self.wake_engine)();
        }
        let stamps = &self.shared.stamps;
        let (mono, local) = (stamps.mono_ms(), stamps.wall_ms());
        let (verdict, majority) = {
            let view = lock(&self.shared.clocks);
            (
                view.may_lead(self.shared.max_skew_ms, mono),
                view.majority_clock(local, mono, self.shared.voters.load(Ordering::Relaxed)),
            )
        };
        self.shared.behind_us.store((local - majority).max(0) as u64 * 1000, Ordering::Relaxed);
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
    fn send_passed(&mut self, raw: &RawNode<LogStore>) {
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
    fn ready(&mut self, raw: &mut RawNode<LogStore>) {
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
            (self.wake_engine)();
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
    fn apply_change(&mut self, raw: &mut RawNode<LogStore>, e: &Entry) {
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
    fn promote_caught_up(&mut self, raw: &RawNode<LogStore>) {
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
            (self.wake_engine)();
        }
    }

    /// Entries appended to the window; the oldest leave it past its bounds (never one not yet
    /// committed).
    fn remember(&mut self, entries: &[Entry]) {
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
    fn persisted(&mut self, raw: &mut RawNode<LogStore>) {
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
    fn publish(&mut self, raw: &RawNode<LogStore>) {
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
                (self.wake_engine)();
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
        if let Some(end) = self.shared.end_of(commit) {
            if let Ok(term) = r.raft_log.term(commit) {
                if lock(&self.shared.marks).iter().any(|(i, _, _)| *i == commit) {
                    *lock(&self.snapshots.point) = Some(SnapPoint { index: commit, term, end });
                }
            }
            let mut p = lock(&self.shared.progress);
            if end > p.committed_end {
                p.committed_end = end;
                self.shared.changed.notify_all();
            }
        }
        self.trim(raw, commit);
    }

    /// Forgets marks both durable and committed, and compacts the window past its bounds.
    fn trim(&mut self, raw: &RawNode<LogStore>, commit: u64) {
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
            let mut marks = lock(&self.shared.marks);
            while marks.len() > 1 && marks.front().is_some_and(|(i, _, _)| *i < keep_from) {
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

/// Hands the lead to the node that holds most of the log (a leader refused for its clock, or
/// being removed).
fn hand_over_lead(raw: &mut RawNode<LogStore>) {
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
