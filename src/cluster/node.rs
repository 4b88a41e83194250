//! A cluster node: raft-rs's state machine restored from what recovery found in the log, the
//! state the raft thread (`driver`), the store's side (`store_side`) and the writer share, and
//! the raft thread started.
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
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use raft::prelude::{ConfState, Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use raft::RawNode;

use super::clock::{ClockView, FilterConfig};
use super::driver::{Driver, MAY_LEAD_PRIORITY};
use super::log_store::{entry_of, window_entries, LogStore, Snapshots};
use super::net::Net;
use super::persist::load_hard_state;
use super::recover::Recovered;
use super::shared::{lock, Progress, Shared};
use super::store_side::{MajorityDurable, StoreSide};
use super::{ClusterConfig, ClusterState, Stamps};
use crate::error::{Error, Result};
use crate::storage::replica::Replicator;
use crate::storage::writer::Condition;

/// Ticks without a leader's word before a follower stands for election (randomized up to
/// twice this): 0.8 to 1.6 s, so a failover completes within 2 s.
const ELECTION_TICKS: usize = 8;
/// Ticks between a leader's heartbeats.
const HEARTBEAT_TICKS: usize = 1;

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
    pub wake_engine: Box<dyn Fn() + Send + Sync>,
    /// Makes the engine take a step on the calling thread when it is free (else as above).
    pub wake_engine_here: Box<dyn Fn() + Send + Sync>,
    /// Restarts the process (after a divergence was recorded).
    pub restart: Arc<dyn Fn() + Send + Sync>,
    /// The clocks probes are stamped with.
    pub stamps: Arc<Stamps>,
    /// Where the engine's clock correction goes (see `ClusterClock`).
    pub behind_us: Arc<AtomicU64>,
    /// The members at the start.
    pub members: super::members::Members,
}

impl Node {
    /// Starts a node from what recovery found in its log; `wake_engine` makes the engine take
    /// a step (to append entries that arrived).
    pub fn start(
        cfg: &ClusterConfig,
        state: Arc<ClusterState>,
        recovered: Recovered,
        net_start: impl FnOnce(super::net::Inbound, Arc<Stamps>) -> Result<Net>,
        hooks: Hooks,
    ) -> Result<Node> {
        let Hooks { wake_engine, wake_engine_here, restart, stamps, behind_us, members } = hooks;
        let conf = members.conf_state();
        let store = MemStorage::new_with_conf_state(conf.clone());
        let mut hs = load_hard_state(&cfg.data_dir)?;
        let (window, window_bytes) = restore_log(&store, &recovered, conf, &mut hs)?;
        let raft_cfg = raft_config(cfg.node_id, hs.commit)?;
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
            driver: std::sync::OnceLock::new(),
            proposed: Mutex::new((0, 0)),
            waiting: Mutex::new(VecDeque::new()),
            wake_engine,
            wake_engine_here,
        });
        {
            let mut p = lock(&shared.progress);
            p.local_durable = recovered.last.end;
        }
        shared.state.set_sealed(recovered.last.index);
        let inbound: super::net::Inbound = {
            // Weak: the driver (inside `shared`) holds the links, whose readers hold this.
            let shared = Arc::downgrade(&shared);
            Arc::new(move |ev, step| {
                if let Some(s) = shared.upgrade() {
                    if step {
                        s.deliver(ev);
                    } else {
                        s.queue(ev);
                    }
                }
            })
        };
        let net = net_start(inbound, stamps)?;
        let driver = Driver {
            shared: shared.clone(),
            rx,
            net,
            dir: cfg.data_dir.clone(),
            saved: (hs.term, hs.vote),
            unpersisted: VecDeque::new(),
            peers: cfg.others().map(|(id, _)| *id).collect(),
            next_probe: Instant::now(),
            next_tick: Instant::now() + super::driver::TICK,
            window,
            window_bytes,
            snapshots,
            restart: restart.clone(),
            window_entries: window_entries(),
            members,
            promoting: std::collections::HashSet::new(),
            engine_wanted: false,
        };
        if shared.driver.set(Mutex::new(driver)).is_err() {
            return Err(Error::Config("raft driver started twice".into()));
        }
        let ticking = shared.clone();
        let thread = std::thread::Builder::new()
            .name("delayd-raft".into())
            .spawn(move || super::driver::run(&ticking))
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

/// Fills raft-rs's in-memory log with what recovery found (the entry it starts after, then the
/// entries since) and settles the hard state against it; returns the window's entries (index,
/// size) and their bytes.
fn restore_log(
    store: &MemStorage,
    recovered: &Recovered,
    conf: ConfState,
    hs: &mut HardState,
) -> Result<(VecDeque<(u64, u64)>, u64)> {
    let mut core = store.wl();
    if let Some((index, term)) = recovered.base {
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = index;
        snap.mut_metadata().term = term;
        snap.mut_metadata().set_conf_state(conf);
        core.apply_snapshot(snap).map_err(|e| Error::Config(format!("raft log: {e}")))?;
    }
    let entries: Vec<Entry> = recovered.entries.iter().map(entry_of).collect();
    let window: VecDeque<(u64, u64)> = entries.iter().map(|e| (e.index, e.data.len() as u64)).collect();
    let window_bytes = window.iter().map(|(_, b)| b).sum();
    core.append(&entries).map_err(|e| Error::Config(format!("raft log: {e}")))?;
    let first = recovered.base.map_or(0, |(i, _)| i);
    let last = entries.last().map_or(first, |e| e.index);
    hs.commit = hs.commit.clamp(first, last);
    // A fresh cluster starts at term 1, not 0: raft-rs refuses to send a vote refusal stamped
    // with term 0 (it panics), which a node refusing a lower-priority candidate before any
    // election would otherwise do.
    hs.term = hs.term.max(recovered.last.term).max(1);
    core.set_hardstate(hs.clone());
    Ok((window, window_bytes))
}

/// raft-rs's settings for node `id`, whose entries up to `applied` are applied.
fn raft_config(id: u64, applied: u64) -> Result<raft::Config> {
    let c = raft::Config {
        id,
        election_tick: ELECTION_TICKS,
        heartbeat_tick: HEARTBEAT_TICKS,
        applied,
        max_size_per_msg: 1 << 20,
        max_inflight_msgs: 256,
        check_quorum: true,
        pre_vote: true,
        priority: MAY_LEAD_PRIORITY,
        // raft-rs otherwise sends every follower an append carrying the new commit index each
        // time it moves, and each follower answers it: per write, twice the messages. Followers
        // learn it with the next append or heartbeat (one tick) instead, which nothing of theirs
        // waits on: a write is answered by the leader, and a follower's reclaim and queue
        // positions only trail by that tick.
        skip_bcast_commit: true,
        ..Default::default()
    };
    c.validate().map_err(|e| Error::Config(format!("raft: {e}")))?;
    Ok(c)
}

impl Drop for Node {
    fn drop(&mut self) {
        // The driver stops when every event sender is gone; it is not waited for here, as the
        // store's side may still hold one.
        self.thread.take();
    }
}
