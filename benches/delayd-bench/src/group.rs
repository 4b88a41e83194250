//! The replicated systems' servers: a three-node delayd cluster on loopback (found leader and all)
//! and a Redis master with one replica.

use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::http::HttpConn;
use crate::servers::{Programs, Server};
use crate::systems::{Engine, System};

/// The cluster secret every benchmark node shares (loopback only).
const SECRET: &str = "delayd-bench-cluster-secret";
/// How long a fresh cluster may take to elect its first leader, or a replica to come online.
const FORM_TIMEOUT: Duration = Duration::from_secs(60);

/// `k` distinct free loopback ports: every listener is held until all are bound, so the kernel
/// cannot hand the same port out twice.
pub fn free_ports(k: usize) -> Result<Vec<u16>, String> {
    let listeners: Vec<std::net::TcpListener> = (0..k)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("no free port: {e}"))?;
    listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| format!("no free port: {e}")))
        .collect()
}

/// Starts `system`'s servers: (the one the load goes to, the others). The leader of a delayd
/// cluster (once elected), the master of a Redis pair (once its replica is in sync).
pub async fn start(system: System, progs: &Programs) -> Result<(Server, Vec<Server>), String> {
    match system.engine {
        Engine::Delayd => start_cluster(system, progs, 3).await,
        Engine::RedisLua | Engine::RedisPlain => start_redis_pair(system, progs).await,
        Engine::Beanstalkd => Err("beanstalkd has no replicated setup here".to_string()),
    }
}

/// `n` delayd nodes with one `peers` list, as the docs start a cluster on one machine.
async fn start_cluster(system: System, progs: &Programs, n: usize) -> Result<(Server, Vec<Server>), String> {
    let ports = free_ports(2 * n)?;
    let (api, link) = ports.split_at(n);
    let peers = link
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut nodes = Vec::new();
    for i in 0..n {
        let env = vec![
            ("DELAYD_NODE_ID".to_string(), (i + 1).to_string()),
            ("DELAYD_PEERS".to_string(), peers.clone()),
            ("DELAYD_CLUSTER_LISTEN".to_string(), format!("127.0.0.1:{}", link[i])),
            ("DELAYD_CLUSTER_SECRET".to_string(), SECRET.to_string()),
        ];
        let label = format!("{}-node{}", system.name(), i + 1);
        nodes.push(Server::prepare(system, progs, &label, api[i], Vec::new(), env)?);
    }
    // All at once: a node waits for its peers before the cluster can elect anyone.
    let t0 = Instant::now();
    for node in &mut nodes {
        node.spawn()?;
    }
    for node in &mut nodes {
        node.wait_ready(t0).await?;
    }
    let (leader, _) = match find_leader(&nodes, None, FORM_TIMEOUT).await {
        Ok(found) => found,
        Err(e) => {
            let logs: Vec<String> =
                nodes.iter().map(|s| format!("node on port {}:\n{}", s.port, s.log_tail())).collect();
            return Err(format!("{e}; the nodes' logs say:\n{}", logs.join("\n")));
        }
    };
    let leader = nodes.remove(leader);
    Ok((leader, nodes))
}

/// One node's `GET /v1/cluster`, the fields the benchmark reads.
#[derive(Debug, Clone, Deserialize)]
pub struct View {
    /// The node's id.
    pub node_id: u64,
    /// "leader", "follower", "candidate" or "learner".
    pub role: String,
    /// Its term.
    pub term: u64,
    /// The leader it knows of.
    pub leader_id: Option<u64>,
    /// Leader with its term's entries in store: it takes writes.
    #[serde(default)]
    pub leading: bool,
}

/// `GET /v1/cluster` of the node on `port`; None when it does not answer within a second.
pub async fn view(port: u16) -> Option<View> {
    let mut http = HttpConn::following(&[port], port, Duration::from_secs(1));
    let a = http.call("GET", "/v1/cluster", None).await.ok()?;
    if a.status != 200 {
        return None;
    }
    serde_json::from_slice(&a.body).ok()
}

/// Waits until one of `nodes` (those not in `skip`) leads and takes writes, and every other one
/// that answers names it as leader; returns its index in `nodes` and its view.
pub async fn find_leader(
    nodes: &[Server],
    skip: Option<usize>,
    timeout: Duration,
) -> Result<(usize, View), String> {
    let deadline = Instant::now() + timeout;
    let mut last = Vec::new();
    loop {
        let mut views = Vec::new();
        for (i, s) in nodes.iter().enumerate() {
            if Some(i) != skip {
                views.push((i, view(s.port).await));
            }
        }
        let leaders: Vec<&(usize, Option<View>)> = views
            .iter()
            .filter(|(_, v)| v.as_ref().is_some_and(|v| v.role == "leader" && v.leading))
            .collect();
        if let [(i, Some(lv))] = leaders[..] {
            let agreed =
                views.iter().all(|(_, v)| v.as_ref().is_none_or(|v| v.leader_id == Some(lv.node_id)));
            if agreed {
                return Ok((*i, lv.clone()));
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no agreed leader within {timeout:?}; last views: {last:?}"));
        }
        last = views;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A Redis master and one replica of it, both as the single-server system configures one; returns
/// once the replica is online (so `WAIT 1 0` cannot block for good).
async fn start_redis_pair(system: System, progs: &Programs) -> Result<(Server, Vec<Server>), String> {
    let ports = free_ports(2)?;
    let name = system.name();
    let mut master =
        Server::prepare(system, progs, &format!("{name}-master"), ports[0], Vec::new(), Vec::new())?;
    master.spawn_and_wait().await?;
    let of = vec!["--replicaof".to_string(), "127.0.0.1".to_string(), ports[0].to_string()];
    let mut replica = Server::prepare(system, progs, &format!("{name}-replica"), ports[1], of, Vec::new())?;
    replica.spawn_and_wait().await?;
    let client =
        redis::Client::open(format!("redis://127.0.0.1:{}/", master.port)).map_err(|e| e.to_string())?;
    let mut con = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
    let deadline = Instant::now() + FORM_TIMEOUT;
    loop {
        let info: String =
            redis::cmd("INFO").arg("replication").query_async(&mut con).await.map_err(|e| e.to_string())?;
        if info.lines().any(|l| l.starts_with("slave0:") && l.contains("state=online")) {
            return Ok((master, vec![replica]));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the replica did not come online within {FORM_TIMEOUT:?}; master says:\n{info}\nreplica log:\n{}",
                replica.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
