//! Starts a cluster of real `delayd` processes on loopback, every node-to-node link through its
//! own [`LinkProxy`], and the nemesis controls (kill, stop, restart, partitions, clock offsets)
//! and the leader-following client the cluster tests use.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::proxy::{LinkProxy, Mode};
use super::Server;

/// Where distributions install libfaketime.
const LIBFAKETIME: [&str; 5] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
];

/// The installed libfaketime, if any.
pub fn libfaketime() -> Option<PathBuf> {
    LIBFAKETIME.iter().map(PathBuf::from).find(|p| p.exists())
}

/// Environment that runs a node's wall clock `offset_ms` ahead of real time (behind when
/// negative), through libfaketime; monotonic time is left alone so timers keep working. Given
/// in seconds because libfaketime reads "+200ms" as 200 minutes. Panics without libfaketime.
pub fn clock_offset_env(offset_ms: i64) -> Vec<(String, String)> {
    let lib = libfaketime().expect("libfaketime is not installed (apt-get install libfaketime)");
    vec![
        ("LD_PRELOAD".to_string(), lib.display().to_string()),
        ("FAKETIME".to_string(), format!("{:+.3}", offset_ms as f64 / 1000.0)),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
    ]
}

/// Extra environment for node `i` (1-based), added after everything else.
type PerNodeEnv = Box<dyn Fn(usize) -> Vec<(String, String)>>;

/// A running cluster: nodes are numbered from 1, as their `node_id`.
pub struct Cluster {
    /// Index 0 is node 1.
    nodes: Vec<Server>,
    running: Vec<bool>,
    cluster_addrs: Vec<SocketAddr>,
    /// The proxy of every directed link (from, to).
    links: BTreeMap<(usize, usize), LinkProxy>,
    secret: String,
    env: Vec<(String, String)>,
    per_node_env: PerNodeEnv,
    /// The API base URL of every running node, shared with the clients.
    urls: Arc<RwLock<Vec<Option<String>>>>,
    /// Asks the nodes for `/v1/cluster`; short, as a stopped node never answers.
    probe: reqwest::blocking::Client,
}

/// Binds `n` free loopback ports and keeps them until dropped, so the proxies bound meanwhile
/// cannot take them; the nodes bind them for good once they are released.
fn hold_ports(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let held: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").expect("bind")).collect();
    let addrs = held.iter().map(|l| l.local_addr().expect("local address")).collect();
    (held, addrs)
}

/// A secret that differs per run, so two test clusters never accept each other's traffic.
fn test_secret() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("delayd-test-{}-{nanos}", std::process::id())
}

impl Cluster {
    /// Starts `n` nodes with `env` added to the test servers' base settings.
    pub fn start(n: usize, env: &[(&str, &str)]) -> Cluster {
        Cluster::start_with(n, env, |_| Vec::new())
    }

    /// Starts `n` nodes; node `i` also gets `per_node_env(i)` (e.g. a clock offset).
    pub fn start_with(
        n: usize,
        env: &[(&str, &str)],
        per_node_env: impl Fn(usize) -> Vec<(String, String)> + 'static,
    ) -> Cluster {
        assert!(n >= 1, "a cluster has at least one node");
        let (held, cluster_addrs) = hold_ports(n);
        let mut c = Cluster {
            nodes: Vec::new(),
            running: Vec::new(),
            cluster_addrs,
            links: BTreeMap::new(),
            secret: test_secret(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            per_node_env: Box::new(per_node_env),
            urls: Arc::new(RwLock::new(Vec::new())),
            probe: short_client(Duration::from_millis(500)),
        };
        for i in 1..=n {
            for j in (1..=n).filter(|&j| j != i) {
                c.links.insert((i, j), LinkProxy::start(c.cluster_addr(j)));
            }
        }
        let envs: Vec<Vec<(String, String)>> = (1..=n).map(|i| c.node_env(i, n)).collect();
        drop(held);
        // In parallel: a node may not answer its health check before it has met the others.
        let nodes: Vec<Server> = std::thread::scope(|s| {
            let started: Vec<_> = envs.iter().map(|e| s.spawn(move || start_server(e))).collect();
            started.into_iter().map(|h| h.join().expect("node start")).collect()
        });
        c.running = vec![true; n];
        *c.urls.write().expect("urls lock") = nodes.iter().map(|s| Some(s.base.clone())).collect();
        c.nodes = nodes;
        c
    }

    /// The environment of node `i` in a cluster whose peers are nodes 1..=`peers`.
    fn node_env(&self, i: usize, peers: usize) -> Vec<(String, String)> {
        let me = self.cluster_addr(i);
        let peer_list: Vec<String> = (1..=peers)
            .map(|j| {
                let addr = if j == i { me } else { self.link(i, j).addr() };
                format!("{j}={addr}")
            })
            .collect();
        let mut env = vec![
            ("DELAYD_NODE_ID".to_string(), i.to_string()),
            ("DELAYD_PEERS".to_string(), peer_list.join(",")),
            ("DELAYD_CLUSTER_LISTEN".to_string(), me.to_string()),
            ("DELAYD_CLUSTER_SECRET".to_string(), self.secret.clone()),
        ];
        env.extend(self.env.iter().cloned());
        env.extend((self.per_node_env)(i));
        env
    }

    /// How many nodes the cluster has had (running or not).
    pub fn size(&self) -> usize {
        self.nodes.len()
    }

    /// Node `i` (1-based): its `base` URL, `pid()`, `log()` and request helpers.
    pub fn node(&self, i: usize) -> &Server {
        &self.nodes[i - 1]
    }

    /// The API base URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        self.node(i).base.clone()
    }

    /// The process id of node `i`, which must be running.
    pub fn pid(&self, i: usize) -> u32 {
        assert!(self.running[i - 1], "node {i} is not running");
        self.node(i).pid()
    }

    /// Whether node `i`'s process is running (a stopped one counts as running).
    pub fn is_running(&self, i: usize) -> bool {
        self.running[i - 1]
    }

    /// Node `i`'s own cluster address (the others reach it through their links' proxies).
    pub fn cluster_addr(&self, i: usize) -> SocketAddr {
        self.cluster_addrs[i - 1]
    }

    /// The proxy of the directed link from node `i` to node `j`.
    pub fn link(&self, i: usize, j: usize) -> &LinkProxy {
        self.links.get(&(i, j)).unwrap_or_else(|| panic!("no link {i} -> {j}"))
    }

    /// Cuts both directions of every link of node `i`.
    pub fn isolate(&self, i: usize) {
        for ((from, to), link) in &self.links {
            if *from == i || *to == i {
                link.set(Mode::Cut);
            }
        }
    }

    /// Puts every link back to `Pass`.
    pub fn heal(&self) {
        for link in self.links.values() {
            link.set(Mode::Pass);
        }
    }

    /// SIGKILLs node `i` (nothing flushed, nothing cleaned up).
    pub fn kill9(&mut self, i: usize) {
        self.nodes[i - 1].kill9();
        self.set_running(i, false);
    }

    /// SIGTERMs node `i` and waits for it to exit (continuing it first, should it be stopped).
    pub fn terminate(&mut self, i: usize) {
        signal(self.pid(i), "-CONT");
        self.nodes[i - 1].terminate();
        self.set_running(i, false);
    }

    /// SIGSTOPs node `i`: it holds its sockets but answers nothing until [`cont`](Self::cont).
    pub fn stop(&self, i: usize) {
        signal(self.pid(i), "-STOP");
    }

    /// SIGCONTs node `i` after [`stop`](Self::stop).
    pub fn cont(&self, i: usize) {
        signal(self.pid(i), "-CONT");
    }

    /// Starts node `i` again (SIGKILLing it first if it runs): same data dir, cluster port and
    /// environment, a new API port.
    pub fn restart(&mut self, i: usize) {
        self.nodes[i - 1].restart();
        self.set_running(i, true);
    }

    /// SIGTERMs every running node at once and waits for each to exit: its exit status, by node.
    pub fn terminate_all(&mut self) -> Vec<(usize, std::process::ExitStatus)> {
        let running: Vec<usize> = (1..=self.size()).filter(|&i| self.running[i - 1]).collect();
        for &i in &running {
            signal(self.pid(i), "-CONT");
        }
        // At once: nodes that wait for each other while shutting down must not wait in turn.
        let statuses = std::thread::scope(|s| {
            let stopping: Vec<_> = self
                .nodes
                .iter_mut()
                .enumerate()
                .filter(|(k, _)| running.contains(&(k + 1)))
                .map(|(k, node)| (k + 1, s.spawn(move || node.terminate())))
                .collect();
            stopping.into_iter().map(|(i, h)| (i, h.join().expect("terminate"))).collect()
        });
        for i in running {
            self.set_running(i, false);
        }
        statuses
    }

    /// Starts every node that is not running, all at once (same data dirs, cluster ports and
    /// environment, new API ports).
    pub fn start_stopped(&mut self) {
        let stopped: Vec<usize> = (1..=self.size()).filter(|&i| !self.running[i - 1]).collect();
        std::thread::scope(|s| {
            for (k, node) in self.nodes.iter_mut().enumerate() {
                if stopped.contains(&(k + 1)) {
                    s.spawn(move || node.respawn());
                }
            }
        });
        for i in stopped {
            self.set_running(i, true);
        }
    }

    /// Starts node n+1 with every existing node and itself as peers, and the links to and from
    /// it; the existing nodes learn of it only through a membership change. Returns its number.
    pub fn add_node(&mut self) -> usize {
        let i = self.nodes.len() + 1;
        let (held, addrs) = hold_ports(1);
        self.cluster_addrs.push(addrs[0]);
        for j in 1..i {
            self.links.insert((i, j), LinkProxy::start(self.cluster_addr(j)));
            self.links.insert((j, i), LinkProxy::start(self.cluster_addr(i)));
        }
        let env = self.node_env(i, i);
        drop(held);
        self.nodes.push(start_server(&env));
        self.running.push(true);
        self.urls.write().expect("urls lock").push(Some(self.url(i)));
        i
    }

    fn set_running(&mut self, i: usize, running: bool) {
        self.running[i - 1] = running;
        let url = running.then(|| self.url(i));
        self.urls.write().expect("urls lock")[i - 1] = url;
    }

    /// `GET /v1/cluster` of every running node (None for one that did not answer in time),
    /// asked all at once so a stopped node costs one timeout, not one per node.
    pub fn views(&self) -> Vec<Option<Value>> {
        let urls: Vec<Option<String>> = self.urls.read().expect("urls lock").clone();
        let probe = &self.probe;
        std::thread::scope(|s| {
            let asked: Vec<_> = urls
                .iter()
                .map(|url| s.spawn(move || url.as_ref().and_then(|u| cluster_view(probe, u))))
                .collect();
            asked.into_iter().map(|h| h.join().ok().flatten()).collect()
        })
    }

    /// The leader, once one is found within `timeout`: a node that says it is leader and that a
    /// majority of all nodes (itself included) name as `leader_id`. Of all nodes, not of the
    /// running ones: a lone survivor calling itself leader has no quorum and is no leader.
    pub fn leader(&self, timeout: Duration) -> Option<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = agreed_leader(&self.views(), self.size()) {
                return Some(l);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The leader within `timeout`; panics with every node's `/v1/cluster` answer and log tail.
    pub fn wait_leader(&self, timeout: Duration) -> usize {
        if let Some(l) = self.leader(timeout) {
            return l;
        }
        panic!("no leader within {timeout:?}\n{}", self.describe());
    }

    /// Every node's `/v1/cluster` answer and the tail of its log, for failure messages.
    pub fn describe(&self) -> String {
        let views = self.views();
        let mut out = String::new();
        for i in 1..=self.size() {
            let view = views[i - 1].as_ref().map_or("no answer".to_string(), |v| v.to_string());
            let log = self.node(i).log();
            let tail: Vec<&str> = log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect();
            let state = if self.running[i - 1] { "running" } else { "not running" };
            out.push_str(&format!("--- node {i} ({state}) /v1/cluster: {view}\n{}\n", tail.join("\n")));
        }
        out
    }

    /// A client that finds the leader by itself; it follows restarts of nodes.
    pub fn client(&self) -> ClusterClient {
        ClusterClient::new(Arc::clone(&self.urls))
    }
}

/// A node's `/v1/cluster` answer, None when it does not answer 2xx in time.
fn cluster_view(probe: &reqwest::blocking::Client, base: &str) -> Option<Value> {
    let r = probe.get(format!("{base}/v1/cluster")).send().ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json::<Value>().ok()
}

/// Starts one node's process with its full environment.
fn start_server(env: &[(String, String)]) -> Server {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Server::start(&env)
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill").arg(sig).arg(pid.to_string()).status().expect("run kill");
    assert!(ok.success(), "kill {sig} {pid} failed");
}

/// The node a majority of `n` nodes agree is leader, from their `/v1/cluster` answers.
pub fn agreed_leader(views: &[Option<Value>], n: usize) -> Option<usize> {
    let said_leader = |v: &Value| v["role"] == "leader";
    views.iter().flatten().filter(|v| said_leader(v)).find_map(|v| {
        let id = v["node_id"].as_u64()?;
        let named = views.iter().flatten().filter(|w| w["leader_id"].as_u64() == Some(id)).count();
        (named > n / 2).then_some(id as usize)
    })
}

/// A blocking HTTP client that does not follow redirects, with `timeout` per request.
pub fn short_client(timeout: Duration) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("http client")
}

/// One answer of the cluster, after redirects and `no_leader` retries.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The final status.
    pub status: u16,
    /// The JSON body (`{"raw": text}` when it was not JSON).
    pub body: Value,
    /// The base URL of the node that gave the final answer.
    pub node: String,
    /// How many redirects were followed.
    pub redirects: usize,
    /// When the first attempt was sent, by the client's clock (Unix ms).
    pub sent_ms: u64,
    /// When the final answer arrived (Unix ms).
    pub received_ms: u64,
}

impl Reply {
    /// Whether the status is 2xx.
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The `messages` of a pop answer (empty for any other answer).
    pub fn messages(&self) -> Vec<Value> {
        self.body["messages"].as_array().cloned().unwrap_or_default()
    }
}

/// A client of the whole cluster: starts at the last node that answered, follows `307` to the
/// leader (same method, body and headers), and on `503 no_leader` or a refused connection waits
/// (the `Retry-After`, or a moment) and tries the next node, until its deadline.
pub struct ClusterClient {
    urls: Arc<RwLock<Vec<Option<String>>>>,
    http: reqwest::blocking::Client,
    headers: Vec<(String, String)>,
    /// How long one call keeps retrying.
    deadline: Duration,
    /// Per attempt, on top of a pop's `wait_ms`.
    timeout: Duration,
    last: std::sync::Mutex<Option<String>>,
}

/// Redirects followed in a row before a call gives up (a loop between nodes that disagree).
const MAX_REDIRECTS: usize = 10;

impl ClusterClient {
    /// A client of fixed nodes (base URLs), for nodes not started by a [`Cluster`].
    pub fn with_urls(urls: Vec<String>) -> ClusterClient {
        ClusterClient::new(Arc::new(RwLock::new(urls.into_iter().map(Some).collect())))
    }

    fn new(urls: Arc<RwLock<Vec<Option<String>>>>) -> ClusterClient {
        ClusterClient {
            urls,
            http: short_client(super::NEVER_HANG),
            headers: Vec::new(),
            deadline: Duration::from_secs(15),
            timeout: Duration::from_secs(5),
            last: std::sync::Mutex::new(None),
        }
    }

    /// Sets how long one call keeps retrying redirects, `no_leader` and refused connections.
    pub fn with_deadline(mut self, deadline: Duration) -> ClusterClient {
        self.deadline = deadline;
        self
    }

    /// Sets the time one attempt may take (a pop's `wait_ms` comes on top).
    pub fn with_timeout(mut self, timeout: Duration) -> ClusterClient {
        self.timeout = timeout;
        self
    }

    /// Adds a header to every request (e.g. `authorization`).
    pub fn with_header(mut self, name: &str, value: &str) -> ClusterClient {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Sends `method path` with an optional JSON body. `Err` means the outcome is unknown: the
    /// request may have been applied (a timeout, a connection lost after sending) or the
    /// deadline passed with no node reachable. A `503` at the deadline is returned as an answer.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        wait_ms: u64,
    ) -> Result<Reply, String> {
        let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + self.deadline;
        let sent_ms = super::now_ms();
        let mut base = self.first_node().ok_or("no node is running")?;
        let mut url = format!("{base}{path}");
        let mut redirects = 0;
        // Redirects in a row: a node that points at a dead leader (during an election) sends
        // the client round more than once, which is no loop.
        let mut in_a_row = 0;
        loop {
            let resp = match self.send(&method, &url, body, wait_ms) {
                Ok(resp) => resp,
                Err(e) if e.is_connect() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                    base = self.next_node(&base).ok_or("no node is running")?;
                    url = format!("{base}{path}");
                    in_a_row = 0;
                    continue;
                }
                Err(e) => return Err(format!("{method} {url}: {e}")),
            };
            let status = resp.status().as_u16();
            if matches!(status, 307 | 308) && in_a_row < MAX_REDIRECTS {
                url = redirect_target(&url, &resp)?;
                base = origin(&url)?;
                redirects += 1;
                in_a_row += 1;
                continue;
            }
            let retry_after = retry_after(&resp);
            let (status, body_json) = read_answer(resp, &url)?;
            if status == 503 && body_json["error"]["code"] == "no_leader" && Instant::now() < deadline {
                std::thread::sleep(retry_after.min(deadline.saturating_duration_since(Instant::now())));
                base = self.next_node(&base).ok_or("no node is running")?;
                url = format!("{base}{path}");
                in_a_row = 0;
                continue;
            }
            *self.last.lock().expect("last lock") = Some(base.clone());
            let received_ms = super::now_ms();
            return Ok(Reply { status, body: body_json, node: base, redirects, sent_ms, received_ms });
        }
    }

    fn send(
        &self,
        method: &reqwest::Method,
        url: &str,
        body: Option<&Value>,
        wait_ms: u64,
    ) -> reqwest::Result<reqwest::blocking::Response> {
        let mut req =
            self.http.request(method.clone(), url).timeout(self.timeout + Duration::from_millis(wait_ms));
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        req.send()
    }

    /// The node that answered last, if still running, else the first running one.
    fn first_node(&self) -> Option<String> {
        let urls = self.urls.read().expect("urls lock");
        let last = self.last.lock().expect("last lock").clone();
        last.filter(|l| urls.iter().flatten().any(|u| u == l))
            .or_else(|| urls.iter().flatten().next().cloned())
    }

    /// The running node after `base` in node order (wrapping), or the first one.
    fn next_node(&self, base: &str) -> Option<String> {
        let urls = self.urls.read().expect("urls lock");
        let running: Vec<&String> = urls.iter().flatten().collect();
        let at = running.iter().position(|u| u.as_str() == base);
        let next = at.map_or(0, |p| (p + 1) % running.len().max(1));
        running.get(next).map(|u| u.to_string())
    }

    /// `POST /v1/topics/{topic}/messages`.
    pub fn produce(&self, topic: &str, body: &Value) -> Result<Reply, String> {
        self.request("POST", &format!("/v1/topics/{topic}/messages"), Some(body), 0)
    }

    /// `POST /v1/topics/{topic}/pop`, waiting up to `wait_ms`.
    pub fn pop(&self, topic: &str, max: usize, wait_ms: u64, ttr_ms: Option<u64>) -> Result<Reply, String> {
        let mut path = format!("/v1/topics/{topic}/pop?max={max}&wait_ms={wait_ms}");
        if let Some(t) = ttr_ms {
            path.push_str(&format!("&ttr_ms={t}"));
        }
        self.request("POST", &path, None, wait_ms)
    }

    /// `POST /v1/ack`.
    pub fn ack(&self, receipt: &str) -> Result<Reply, String> {
        self.request("POST", "/v1/ack", Some(&serde_json::json!({ "receipt": receipt })), 0)
    }

    /// `POST /v1/nack`, redelivering after `delay_ms` when given.
    pub fn nack(&self, receipt: &str, delay_ms: Option<u64>) -> Result<Reply, String> {
        let mut body = serde_json::json!({ "receipt": receipt });
        if let Some(d) = delay_ms {
            body["delay_ms"] = d.into();
        }
        self.request("POST", "/v1/nack", Some(&body), 0)
    }

    /// `DELETE /v1/messages/{id}`.
    pub fn cancel(&self, id: &str) -> Result<Reply, String> {
        self.request("DELETE", &format!("/v1/messages/{id}"), None, 0)
    }

    /// `GET /v1/messages/{id}`.
    pub fn get(&self, id: &str) -> Result<Reply, String> {
        self.request("GET", &format!("/v1/messages/{id}"), None, 0)
    }
}

/// The absolute URL a redirect points to (a relative `Location` is resolved against `url`).
fn redirect_target(url: &str, resp: &reqwest::blocking::Response) -> Result<String, String> {
    let location = resp
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| format!("{} from {url} without a Location", resp.status()))?;
    let from = reqwest::Url::parse(url).map_err(|e| format!("{url}: {e}"))?;
    from.join(location).map(|u| u.to_string()).map_err(|e| format!("Location {location:?}: {e}"))
}

/// `scheme://host:port` of `url`, as the nodes' base URLs are written.
fn origin(url: &str) -> Result<String, String> {
    let u = reqwest::Url::parse(url).map_err(|e| format!("{url}: {e}"))?;
    Ok(u.origin().ascii_serialization())
}

/// The `Retry-After` of an answer (whole seconds), one second when absent or unreadable.
fn retry_after(resp: &reqwest::blocking::Response) -> Duration {
    let secs =
        resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok());
    Duration::from_secs(secs.unwrap_or(1))
}

/// Status and JSON body; a body cut off midway leaves the outcome unknown.
fn read_answer(resp: reqwest::blocking::Response, url: &str) -> Result<(u16, Value), String> {
    let status = resp.status().as_u16();
    let text = resp.text().map_err(|e| format!("{url}: answer {status} cut off: {e}"))?;
    let v = serde_json::from_str(&text).unwrap_or_else(|_| serde_json::json!({ "raw": text }));
    Ok((status, v))
}
