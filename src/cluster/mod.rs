//! Replication and automatic failover: several delayd nodes keep one replicated commit log with
//! Raft (TiKV's raft-rs), and the leader alone accepts writes and fires timers.
//!
//! - [`node`]: the Raft driver thread, the store's [`Replicator`](crate::storage::replica::Replicator)
//!   and the "durable on a majority" condition of the writer.
//! - [`net`]: the node-to-node links (authenticated TCP streams).
//! - [`recover`]: what a node does to its log before it opens: cuts records no entry holds and
//!   finds where its replicated log ends.
//!
//! With no `peers` none of this runs: a single node is exactly what it was.

pub mod clock;
mod driver;
mod log_store;
pub mod members;
pub mod net;
pub mod node;
mod persist;
pub mod recover;
mod shared;
mod store_side;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::config::Config;
use crate::error::{Error, Result};

/// How a node takes part: read from the configuration.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's id.
    pub node_id: u64,
    /// Every node, this one included: id and cluster address.
    pub peers: Vec<(u64, String)>,
    /// Where this node listens for node-to-node traffic.
    pub listen: String,
    /// The secret every node proves it holds.
    pub secret: String,
    /// This node's client API URL as others give it to clients.
    pub advertise_url: String,
    /// A node further ahead of the others than this does not lead.
    pub max_clock_skew_ms: u64,
    /// A new member of a running cluster: it waits to be added instead of forming a cluster.
    pub join: bool,
    /// The node's data directory (its Raft state lives in `cluster/` there).
    pub data_dir: PathBuf,
}

impl ClusterConfig {
    /// The cluster part of `cfg`, or `None` for a single node. `bound` is the address the client
    /// API is bound to (the default advertised URL).
    pub fn from_config(cfg: &Config, bound: std::net::SocketAddr) -> Result<Option<ClusterConfig>> {
        let peers = cfg.cluster_peers()?;
        if peers.is_empty() {
            return Ok(None);
        }
        let missing = |key: &str| Error::Config(format!("{key}: must be set when peers is"));
        Ok(Some(ClusterConfig {
            node_id: cfg.node_id.ok_or_else(|| missing("node_id"))? as u64,
            peers,
            listen: cfg.cluster_listen.clone().ok_or_else(|| missing("cluster_listen"))?,
            secret: cfg.cluster_secret.clone().ok_or_else(|| missing("cluster_secret"))?,
            advertise_url: cfg.advertise_url.clone().unwrap_or_else(|| format!("http://{bound}")),
            max_clock_skew_ms: cfg.max_clock_skew,
            join: cfg.cluster_join,
            data_dir: cfg.data_dir.clone(),
        }))
    }

    /// The other nodes.
    pub fn others(&self) -> impl Iterator<Item = &(u64, String)> {
        self.peers.iter().filter(move |(id, _)| *id != self.node_id)
    }
}

/// The clocks a node stamps clock probes with: its wall clock (the step-safe clock it stamps
/// due times with) and a monotonic one for round trips and ages.
pub struct Stamps {
    wall: std::sync::Arc<dyn crate::schedule::clock::Clock>,
    epoch: std::time::Instant,
}

impl Stamps {
    /// Stamps from `wall`, the monotonic clock counting from now.
    pub fn new(wall: std::sync::Arc<dyn crate::schedule::clock::Clock>) -> Stamps {
        Stamps { wall, epoch: std::time::Instant::now() }
    }

    /// The wall clock, unix µs.
    pub fn wall_us(&self) -> i64 {
        i64::try_from(self.wall.now_us()).unwrap_or(i64::MAX)
    }

    /// Monotonic µs since the node started.
    pub fn mono_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// The clock a cluster node's engine runs on: the system clock held back by how far this node
/// reads ahead of a majority of the cluster (measured over the links, see `clock`), so a leader
/// whose clock runs fast neither fires early nor stamps due times late. Never goes backward.
pub struct ClusterClock {
    inner: std::sync::Arc<dyn crate::schedule::clock::Clock>,
    /// Microseconds to hold the clock back by, set by the raft thread at each tick.
    behind_us: std::sync::Arc<AtomicU64>,
    last_us: AtomicU64,
}

impl crate::schedule::clock::Clock for ClusterClock {
    fn now_us(&self) -> u64 {
        let t = self.inner.now_us().saturating_sub(self.behind_us.load(Ordering::Relaxed));
        let prev = self.last_us.fetch_max(t, Ordering::AcqRel);
        prev.max(t)
    }
}

/// The variable that shifts a cluster node's clock, for tests of clock skew between real
/// processes (libfaketime also shifts the monotonic clock, which stalls the consensus ticks).
pub const TEST_CLOCK_OFFSET: &str = "DELAYD_TEST_CLOCK_OFFSET_MS";

fn test_clock_offset_ms() -> Option<i64> {
    std::env::var(TEST_CLOCK_OFFSET).ok()?.trim().parse().ok()
}

/// The system clock shifted by a fixed offset (tests only, see [`TEST_CLOCK_OFFSET`]).
struct ShiftedClock {
    ms: i64,
}

impl crate::schedule::clock::Clock for ShiftedClock {
    fn now_us(&self) -> u64 {
        let now = crate::schedule::clock::SystemClock.now_us() as i64;
        now.saturating_add(self.ms.saturating_mul(1000)).max(0) as u64
    }
}

/// A node's role, as `/v1/cluster` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Follows a leader (or waits for one).
    Follower = 0,
    /// Asks for votes.
    Candidate = 1,
    /// Accepts writes and fires timers.
    Leader = 2,
    /// Receives the log but does not vote.
    Learner = 3,
}

impl Role {
    fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Candidate,
            2 => Role::Leader,
            3 => Role::Learner,
            _ => Role::Follower,
        }
    }

    /// The name `/v1/cluster` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Role::Follower => "follower",
            Role::Candidate => "candidate",
            Role::Leader => "leader",
            Role::Learner => "learner",
        }
    }
}

/// What this node knows of another.
#[derive(Debug, Clone, Default)]
pub struct NodeInfo {
    /// Its cluster address, from `peers`.
    pub cluster_addr: String,
    /// Its client API URL, as it said in its last handshake.
    pub api_url: Option<String>,
    /// Highest entry it is known to hold (on a leader).
    pub match_index: u64,
    /// Unix ms of the last message received from it.
    pub last_contact_ms: Option<u64>,
    /// Log bytes it lacks (on a leader; `None` when its entries are older than those tracked).
    pub lag_bytes: Option<u64>,
}

/// The cluster's state as this node sees it, shared with the HTTP layer and the engine.
pub struct ClusterState {
    /// This node's id.
    pub node_id: u64,
    role: AtomicU8,
    term: AtomicU64,
    leader_id: AtomicU64,
    /// Leader, with every entry of its term before its own in the store: writes may be applied.
    leading: AtomicBool,
    commit_index: AtomicU64,
    last_index: AtomicU64,
    sealed_index: AtomicU64,
    /// Why this node may not lead now (its clock is ahead), if so.
    refused: Mutex<Option<String>>,
    nodes: Mutex<BTreeMap<u64, NodeInfo>>,
    /// Elections this node stood in.
    pub elections: AtomicU64,
    /// Changes of leader this node saw (to another node or to none).
    pub leader_changes: AtomicU64,
    /// How long replies waited for a majority after the local sync.
    pub quorum_wait_us: crate::metrics::Histogram,
    /// Called when this node stops leading (wakes the pops waiting here).
    on_lose_lead: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Membership changes asked for, not yet proposed (the leader's engine proposes them).
    pub(crate) requests: Mutex<Vec<members::Request>>,
    /// Who waits for the membership change at each entry index to take effect.
    pub(crate) change_waiters:
        Mutex<BTreeMap<u64, tokio::sync::oneshot::Sender<std::result::Result<(), String>>>>,
    /// Makes the engine take a step (to propose what `requests` holds).
    wake_engine: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for ClusterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterState").field("node_id", &self.node_id).field("role", &self.role()).finish()
    }
}

impl ClusterState {
    /// The state of a node that has not heard from anyone yet.
    pub fn new(cfg: &ClusterConfig) -> ClusterState {
        let nodes = cfg
            .peers
            .iter()
            .map(|(id, addr)| {
                let api_url = (*id == cfg.node_id).then(|| cfg.advertise_url.clone());
                (*id, NodeInfo { cluster_addr: addr.clone(), api_url, ..Default::default() })
            })
            .collect();
        ClusterState {
            node_id: cfg.node_id,
            role: AtomicU8::new(Role::Follower as u8),
            term: AtomicU64::new(0),
            leader_id: AtomicU64::new(0),
            leading: AtomicBool::new(false),
            commit_index: AtomicU64::new(0),
            last_index: AtomicU64::new(0),
            sealed_index: AtomicU64::new(0),
            refused: Mutex::new(None),
            nodes: Mutex::new(nodes),
            elections: AtomicU64::new(0),
            leader_changes: AtomicU64::new(0),
            on_lose_lead: std::sync::OnceLock::new(),
            requests: Mutex::new(Vec::new()),
            change_waiters: Mutex::new(BTreeMap::new()),
            wake_engine: std::sync::OnceLock::new(),
            quorum_wait_us: crate::metrics::Histogram::new(
                "delayd_cluster_quorum_wait_seconds",
                "Time a batch of replies waited, after the local sync, for a majority of nodes to have it durable.",
                &crate::metrics::FLUSH_BUCKETS_US,
                crate::metrics::US_PER_SECOND,
            ),
        }
    }

    /// This node's role.
    pub fn role(&self) -> Role {
        Role::from_u8(self.role.load(Ordering::Acquire))
    }

    /// True when this node is the leader and its store holds every entry before its term's own:
    /// a write applied here now is replicated in order.
    pub fn leading(&self) -> bool {
        self.leading.load(Ordering::Acquire)
    }

    /// The leader's id, if one is known.
    pub fn leader_id(&self) -> Option<u64> {
        Some(self.leader_id.load(Ordering::Acquire)).filter(|id| *id != 0)
    }

    /// The leader's client API URL, if a leader is known and has told its URL.
    pub fn leader_url(&self) -> Option<String> {
        let id = self.leader_id()?;
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).get(&id)?.api_url.clone()
    }

    /// (id, lag in entries, lag in bytes) of every other node, as the leader knows them.
    pub fn lags(&self) -> Vec<(u64, Option<u64>, Option<u64>)> {
        let last = self.last_index.load(Ordering::Acquire);
        let leader = self.role() == Role::Leader;
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(id, _)| **id != self.node_id)
            .map(|(id, n)| {
                let entries = leader.then(|| last.saturating_sub(n.match_index));
                (*id, entries, n.lag_bytes.filter(|_| leader))
            })
            .collect()
    }

    /// Term, commit index, last index and applied index.
    pub fn indexes(&self) -> (u64, u64, u64, u64) {
        (
            self.term(),
            self.commit_index.load(Ordering::Acquire),
            self.last_index.load(Ordering::Acquire),
            self.sealed_index.load(Ordering::Acquire),
        )
    }

    pub(crate) fn set_soft(&self, role: Role, term: u64, leader_id: u64) {
        if role == Role::Candidate && self.role() != Role::Candidate {
            self.elections.fetch_add(1, Ordering::Relaxed);
        }
        if leader_id != self.leader_id.load(Ordering::Acquire) {
            self.leader_changes.fetch_add(1, Ordering::Relaxed);
        }
        self.role.store(role as u8, Ordering::Release);
        self.term.store(term, Ordering::Release);
        self.leader_id.store(leader_id, Ordering::Release);
        if role != Role::Leader {
            self.set_leading(false);
        }
    }

    pub(crate) fn set_leading(&self, on: bool) {
        if !self.leading.swap(on, Ordering::AcqRel) || on {
            return;
        }
        if let Some(f) = self.on_lose_lead.get() {
            f();
        }
    }

    /// Asks the cluster for a membership change and waits (up to 10 s) until it took effect on
    /// this node; the message says why not.
    pub async fn change(&self, change: members::Change) -> std::result::Result<(), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(members::Request { change, reply: Some(tx) });
        if let Some(wake) = self.wake_engine.get() {
            wake();
        }
        match tokio::time::timeout(std::time::Duration::from_secs(10), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err("the change was dropped (this node stopped leading); retry".into()),
            Err(_) => {
                Err("the change did not take effect within 10 s; see /v1/cluster before retrying".into())
            }
        }
    }

    /// A member added: shown in `/v1/cluster` from now on.
    pub(crate) fn add_node(&self, id: u64, addr: &str) {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_insert_with(|| NodeInfo { cluster_addr: addr.to_string(), ..Default::default() });
    }

    /// A member removed.
    pub(crate) fn remove_node(&self, id: u64) {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Sets what runs when this node stops leading (once).
    pub fn on_lose_lead(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_lose_lead.set(f);
    }

    pub(crate) fn term(&self) -> u64 {
        self.term.load(Ordering::Acquire)
    }

    pub(crate) fn set_indexes(&self, commit: u64, last: u64) {
        self.commit_index.store(commit, Ordering::Release);
        self.last_index.store(last, Ordering::Release);
    }

    pub(crate) fn set_sealed(&self, index: u64) {
        self.sealed_index.store(index, Ordering::Release);
    }

    /// False while this node's clock keeps it from leading.
    pub fn may_lead(&self) -> bool {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    pub(crate) fn set_refused(&self, why: Option<String>) {
        *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = why;
    }

    pub(crate) fn update_node(&self, id: u64, f: impl FnOnce(&mut NodeInfo)) {
        if let Some(n) = self.nodes.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&id) {
            f(n);
        }
    }

    /// The answer of `GET /v1/cluster`.
    pub fn status_json(&self) -> Value {
        let nodes: Vec<Value> = self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, n)| {
                json!({
                    "node_id": id,
                    "api_url": n.api_url,
                    "cluster_addr": n.cluster_addr,
                    "match_index": (self.role() == Role::Leader).then_some(n.match_index),
                    "lag_entries": (self.role() == Role::Leader)
                        .then(|| self.last_index.load(Ordering::Acquire).saturating_sub(n.match_index)),
                    "lag_bytes": n.lag_bytes.filter(|_| self.role() == Role::Leader),
                    "last_contact_ms": n.last_contact_ms,
                })
            })
            .collect();
        json!({
            "node_id": self.node_id,
            "role": self.role().name(),
            "term": self.term(),
            "leader_id": self.leader_id(),
            "leader_url": self.leader_url(),
            "leading": self.leading(),
            "commit_index": self.commit_index.load(Ordering::Acquire),
            "last_index": self.last_index.load(Ordering::Acquire),
            "applied_index": self.sealed_index.load(Ordering::Acquire),
            "may_lead": self.refused.lock().unwrap_or_else(|p| p.into_inner()).is_none(),
            "not_leading_because": *self.refused.lock().unwrap_or_else(|p| p.into_inner()),
            "nodes": nodes,
        })
    }
}

/// `GET /v1/cluster` of a single node: its own leader, a cluster of one.
pub fn single_node_json(api_url: &str) -> Value {
    json!({
        "node_id": 1,
        "role": "leader",
        "term": 0,
        "leader_id": 1,
        "leader_url": api_url,
        "leading": true,
        "commit_index": 0,
        "last_index": 0,
        "applied_index": 0,
        "may_lead": true,
        "not_leading_because": null,
        "nodes": [{"node_id": 1, "api_url": api_url, "cluster_addr": null}],
    })
}

/// Opens this node's broker as a member of the cluster: cuts its log to what the replicated log
/// holds, starts Raft and the node-to-node links on `rt`, and hands the store its side. `listen`
/// is the client API's bound address (kept when the node restarts to rejoin).
pub fn open_broker(
    cfg: &Config,
    cc: &ClusterConfig,
    rt: &tokio::runtime::Handle,
    listen: std::net::SocketAddr,
) -> Result<(crate::Broker, std::sync::Arc<ClusterState>)> {
    use std::sync::{Arc, OnceLock};
    let (members, effective) = current_members(cfg, cc)?;
    let cc = &effective;
    let recovered = recover::prepare(&cfg.data_dir, cfg.segment_bytes, cfg.recovery, cc)?;
    let sealed = recovered.last;
    let state = Arc::new(ClusterState::new(cc));
    type Waker = Box<dyn Fn() + Send + Sync>;
    let waker: Arc<OnceLock<Waker>> = Arc::new(OnceLock::new());
    let waker_here: Arc<OnceLock<Waker>> = Arc::new(OnceLock::new());
    let call = |slot: &Arc<OnceLock<Waker>>| -> Waker {
        let slot = slot.clone();
        Box::new(move || {
            if let Some(w) = slot.get() {
                w();
            }
        })
    };
    let (wake_engine, wake_engine_here) = (call(&waker), call(&waker_here));
    let restart: Arc<dyn Fn() + Send + Sync> = Arc::new(move || restart_self(listen));
    let net_state = state.clone();
    let system = system_clock();
    let behind_us = Arc::new(AtomicU64::new(0));
    let clock = Arc::new(ClusterClock {
        inner: system.clone(),
        behind_us: behind_us.clone(),
        last_us: AtomicU64::new(0),
    });
    let node = node::Node::start(
        cc,
        state.clone(),
        recovered,
        |tx, stamps| net::Net::start(rt, cc, net_state, tx, stamps),
        node::Hooks {
            wake_engine,
            wake_engine_here,
            restart,
            stamps: Arc::new(Stamps::new(system.clone())),
            behind_us,
            members,
        },
    )?;
    let replication = crate::broker::Replication {
        replicator: node.replicator(),
        sealed,
        condition: node.condition(),
        fire_clock: clock,
    };
    let mut bc = cfg.broker_config();
    bc.receipt_secret = Some(cc.secret.clone());
    // Due times are stamped by this node's own clock; timers fire by the majority's (never
    // ahead of it): a correction that varies with each measurement then only ever delays.
    let broker = crate::Broker::open_replicated(bc, system.clone(), Some(replication))?;
    // Entries that arrive are appended on the link reader's thread when the engine is free:
    // a hand-off to the engine thread is most of a follower's part in a lone write's time.
    let _ = waker.set(broker.waker());
    let _ = waker_here.set(broker.inline_waker());
    let _ = state.wake_engine.set(broker.waker());
    broker.set_cluster(state.clone());
    let pops = broker.clone();
    state.on_lose_lead(Box::new(move || pops.wake_all_pops()));
    // Entries Raft already holds (a restart) go into the store now.
    (broker.waker())();
    // The node lives as long as the process: its threads stop with it.
    std::mem::forget(node);
    Ok((broker, state))
}

/// The members last applied here, which replace `peers` (naming the cluster as it was formed),
/// and the configuration with them as its peers (this node's own address kept).
fn current_members(cfg: &Config, cc: &ClusterConfig) -> Result<(members::Members, ClusterConfig)> {
    let members = match members::Members::load(&cfg.data_dir)? {
        Some(m) => m,
        // A joining node knows where the others are, but not yet that it is a member.
        None if cc.join => {
            members::Members { addrs: cc.peers.iter().cloned().collect(), ..Default::default() }
        }
        None => members::Members::from_peers(&cc.peers),
    };
    let mut effective = cc.clone();
    effective.peers = members.peers();
    if !effective.peers.iter().any(|(id, _)| *id == cc.node_id) {
        if let Some(own) = cc.peers.iter().find(|(id, _)| *id == cc.node_id) {
            effective.peers.push(own.clone());
        }
    }
    Ok((members, effective))
}

/// This node's own clock: the system's, or shifted by the tests' offset.
fn system_clock() -> std::sync::Arc<dyn crate::schedule::clock::Clock> {
    match test_clock_offset_ms() {
        Some(ms) => {
            tracing::warn!(
                offset_ms = ms,
                "{TEST_CLOCK_OFFSET} is set: this node's clock is shifted (tests only)"
            );
            std::sync::Arc::new(ShiftedClock { ms })
        }
        None => std::sync::Arc::new(crate::schedule::clock::SystemClock),
    }
}

/// Replaces this process with a fresh start of the same program on the same addresses, so a
/// node whose log must be cut back rebuilds its store from what is left (the cut was recorded
/// first, durably).
pub fn restart_self(listen: std::net::SocketAddr) {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(error = %e, "cannot find this program to restart it; exiting");
            std::process::exit(1);
        }
    };
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        if a == "--listen" {
            it.next();
        } else if !a.to_string_lossy().starts_with("--listen=") {
            args.push(a);
        }
    }
    args.push("--listen".into());
    args.push(listen.to_string().into());
    tracing::warn!("restarting this node to rejoin the cluster");
    let e = std::process::Command::new(exe).args(args).exec();
    tracing::error!(error = %e, "cannot restart this node; exiting");
    std::process::exit(1);
}
