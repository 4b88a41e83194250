//! The Jepsen-style workload of the cluster tests: client threads producing (with delays, some
//! cancelled), popping with a short time-to-run, acking, nacking, into one history the checker
//! verifies; the drain that ends a run; helpers to watch the nodes. Used by `tests/cluster.rs`
//! (fixed scenarios) and `tests/nemesis.rs` (a randomized run of chosen length).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::checker::{Event, History, ProduceOutcome, Report};
use super::cluster::{agreed_leader, Cluster, ClusterClient, Reply};
use super::now_ms;

/// Longest delay a produce asks for.
pub const MAX_DELAY_MS: u64 = 5_000;
/// The time-to-run every pop asks for: short, so lost reservations come back within a scenario.
pub const TTR_MS: u64 = 2_000;
/// The redelivery delay of a nack.
pub const NACK_DELAY_MS: u64 = 300;
/// Longest a scenario waits for a leader (elections take 1-2 s).
pub const ELECTION: Duration = Duration::from_secs(10);
/// How often scenario 1 kills the leader.
pub const LEADER_KILLS: usize = 20;
/// Failover time the test accepts (the 2 s target is the benchmark's).
pub const FAILOVER_LIMIT: Duration = Duration::from_secs(5);

/// One scenario at a time: three nodes and their clients already fill this machine's cores, and
/// the failover times must not measure another scenario's load.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A small xorshift generator: the timings are random per run, and the seed is printed so a
/// failing run's timing can be told apart.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// A seed from the clock, printed with the scenario's name.
    pub fn seed(scenario: &str) -> u64 {
        let seed = now_ms().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(std::process::id());
        eprintln!("{scenario}: seed {seed}");
        seed
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from + 1))
    }
}

pub fn sleep(d: Duration) {
    std::thread::sleep(d);
}

/// What the workload threads share.
pub struct Shared {
    pub topic: String,
    pub history: History,
    pub stop: AtomicBool,
    /// The latest due time any produce asked for, by the client's clock.
    pub last_due: AtomicU64,
    /// Answers by operation and status (for the test output).
    pub statuses: Mutex<std::collections::BTreeMap<String, usize>>,
    /// Who answered each 2xx produce, when, and what it said: shown for a lost message.
    pub acked_by: Mutex<std::collections::HashMap<String, String>>,
}

impl Shared {
    /// An empty history of `topic`, its clients running.
    pub fn new(topic: &str) -> Arc<Shared> {
        Arc::new(Shared {
            topic: topic.to_string(),
            history: History::new(),
            stop: AtomicBool::new(false),
            last_due: AtomicU64::new(0),
            statuses: Mutex::new(Default::default()),
            acked_by: Mutex::new(Default::default()),
        })
    }

    pub fn count(&self, op: &str, r: &Result<Reply, String>) {
        let key = match r {
            Ok(r) if r.status >= 500 => format!("{op} {} {}", r.status, r.body["error"]["message"]),
            Ok(r) => format!("{op} {}", r.status),
            Err(_) => format!("{op} no answer"),
        };
        *self.statuses.lock().expect("statuses lock").entry(key).or_default() += 1;
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// Producer and consumer threads recording into one history.
pub struct Workload {
    pub shared: Arc<Shared>,
    pub threads: Vec<JoinHandle<()>>,
}

impl Workload {
    /// Starts two producers and two consumers on `topic`, each with its own cluster client.
    pub fn start(c: &Cluster, topic: &str, seed: u64) -> Workload {
        let shared = Shared::new(topic);
        let mut threads = Vec::new();
        for who in 0..2u64 {
            let (s, client, rng) = (shared.clone(), c.client(), Rng::new(seed ^ ((who + 1) * 7919)));
            threads.push(std::thread::spawn(move || produce_loop(&s, &client, who, rng)));
            let (s, client, rng) = (shared.clone(), c.client(), Rng::new(seed ^ ((who + 11) * 104_729)));
            threads.push(std::thread::spawn(move || consume_loop(&s, &client, rng)));
        }
        Workload { shared, threads }
    }

    /// Stops the threads and waits for them (each finishes its current request).
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("a workload thread panicked");
        }
    }

    pub fn history(&self) -> &History {
        &self.shared.history
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// Records a produce's outcome as the client knows it; true for a 2xx.
pub fn record_produce(s: &Shared, id: &str, due: u64, r: &Result<Reply, String>) -> bool {
    s.count("produce", r);
    match r {
        Ok(r) if r.ok() => {
            s.history.produced(id, due, true);
            let said = format!(
                "{} from {} sent {} received {}: {}",
                r.status, r.node, r.sent_ms, r.received_ms, r.body
            );
            s.acked_by.lock().expect("acked_by lock").insert(id.to_string(), said);
            true
        }
        Ok(r) if refused(r) => {
            s.history.produced(id, due, false);
            false
        }
        // No answer, or a 503 that says the write may or may not have been applied.
        _ => {
            s.history.produced_maybe(id, due);
            false
        }
    }
}

/// An answer that says nothing was stored: no leader, a redirect not followed, a client error.
pub fn refused(r: &Reply) -> bool {
    let no_leader = r.status == 503 && r.body["error"]["code"] == "no_leader";
    let client_error = (400..500).contains(&r.status) && !matches!(r.status, 408 | 409);
    no_leader || client_error || matches!(r.status, 307 | 308)
}

/// Produces `id` due in `delay` ms, retrying an unknown outcome twice (a produce with an id is
/// idempotent); true once it is answered 2xx.
pub fn produce_one(s: &Shared, client: &ClusterClient, id: &str, delay: u64) -> (bool, u64) {
    let body = json!({"id": id, "body": "x", "delay_ms": delay});
    let mut due = 0;
    for _ in 0..3 {
        let sent = now_ms();
        due = sent + delay;
        s.last_due.fetch_max(due, Ordering::SeqCst);
        let r = client.produce(&s.topic, &body);
        // The server counts the delay from when it stored the message, which may be a retry
        // through a failover many seconds after `sent`: no later than the answer, or than the
        // client gave up. The drain waits for this bound; `due` stays the never-early bound.
        s.last_due.fetch_max(now_ms() + delay, Ordering::SeqCst);
        if record_produce(s, id, due, &r) {
            return (true, due);
        }
        if matches!(&r, Ok(r) if refused(r)) || s.stopping() {
            break;
        }
        sleep(Duration::from_millis(50));
    }
    (false, due)
}

pub fn produce_loop(s: &Shared, client: &ClusterClient, who: u64, mut rng: Rng) {
    let mut n = 0;
    while !s.stopping() {
        n += 1;
        let id = format!("{}-p{who}-{n}", s.topic);
        let delay = rng.below(MAX_DELAY_MS + 1);
        let (ok, due) = produce_one(s, client, &id, delay);
        // Cancel some long ones right away, so no delivery can be in flight meanwhile.
        if ok && delay >= 2_000 && rng.below(10) == 0 {
            cancel_one(s, client, &id, due);
        }
        sleep(Duration::from_millis(rng.below(40)));
    }
}

/// Cancels `id`. A cancel answered before the message fell due ends it from its send time; one
/// answered later (it waited out a failover) only from its answer, as a pop answered meanwhile
/// was in flight.
pub fn cancel_one(s: &Shared, client: &ClusterClient, id: &str, due: u64) {
    let sent = now_ms();
    let r = client.cancel(id);
    s.count("cancel", &r);
    match r {
        Ok(r) if r.ok() => {
            s.history.cancelled(id, if r.received_ms < due { sent } else { r.received_ms }, true)
        }
        // A 409 says it was acked already: not cancelled either.
        Ok(r) if refused(&r) || r.status == 409 => s.history.cancelled(id, sent, false),
        // No answer, or a 503 that says it may or may not have been applied.
        _ => s.history.cancelled_maybe(id),
    }
}

pub fn consume_loop(s: &Shared, client: &ClusterClient, mut rng: Rng) {
    while !s.stopping() {
        let r = client.pop(&s.topic, 10, 500, Some(TTR_MS));
        s.count("pop", &r);
        let reply = match r {
            Ok(r) if r.ok() => r,
            _ => {
                sleep(Duration::from_millis(100));
                continue;
            }
        };
        for m in reply.messages() {
            let (id, receipt) = delivery(&m);
            s.history.delivered(id, reply.received_ms);
            match rng.below(10) {
                0 => {
                    let r = client.nack(receipt, Some(NACK_DELAY_MS));
                    s.count("nack", &r);
                }
                // Left to its time-to-run, which gives it back.
                1 => {}
                _ => ack_one(s, client, id, receipt),
            }
        }
    }
}

pub fn delivery(m: &Value) -> (&str, &str) {
    let id = m["id"].as_str().unwrap_or_else(|| panic!("a delivery without an id: {m}"));
    let receipt = m["receipt"].as_str().unwrap_or_else(|| panic!("a delivery without a receipt: {m}"));
    (id, receipt)
}

/// Acks a delivery, recording it from its send time (an ack is applied only while the
/// reservation holds, so no redelivery can be in flight after it).
pub fn ack_one(s: &Shared, client: &ClusterClient, id: &str, receipt: &str) {
    let sent = now_ms();
    let r = client.ack(receipt);
    s.count("ack", &r);
    s.history.acked(id, sent, matches!(&r, Ok(r) if r.ok()));
}

/// Pops and acks everything left until nothing has come for longer than a time-to-run and a
/// nack's delay, every produce is past its due time and the leader counts nothing left; panics
/// after a minute without a quiet spell, and stops at the minute while the leader still counts
/// messages (for [`assert_topic_empty`] to explain).
pub fn drain(c: &Cluster, w: &Workload) {
    let s = &w.shared;
    let client = c.client();
    let deadline = Instant::now() + Duration::from_secs(60);
    let quiet = Duration::from_millis(TTR_MS + NACK_DELAY_MS + 1_000);
    let mut last_seen = Instant::now();
    loop {
        let r = client.pop(&s.topic, 50, 500, Some(TTR_MS));
        s.count("drain pop", &r);
        if let Some(reply) = r.as_ref().ok().filter(|r| r.ok()) {
            for m in reply.messages() {
                let (id, receipt) = delivery(&m);
                s.history.delivered(id, reply.received_ms);
                ack_one(s, &client, id, receipt);
                last_seen = Instant::now();
            }
        }
        let settled = last_seen.elapsed() > quiet && now_ms() > s.last_due.load(Ordering::SeqCst) + 1_000;
        if settled && (left(&topic_left(c, &s.topic)) == 0 || Instant::now() >= deadline) {
            break;
        }
        assert!(Instant::now() < deadline, "the drain did not end within a minute\n{}", c.describe());
    }
}

/// What the leader's `GET /v1/topics` counts for `topic` (ready, reserved, delayed); zero when
/// it does not list it.
fn topic_left(c: &Cluster, topic: &str) -> Value {
    let r = match c.client().request("GET", "/v1/topics", None, 0) {
        Ok(r) => r,
        Err(e) => {
            // A node that does not answer at all after the faults is a failure of its own: the
            // logs and each node's view say which and why.
            save_logs(c, "topics-unanswered");
            panic!("GET /v1/topics answered: {e}");
        }
    };
    let topics = r.body["topics"].as_array().cloned().unwrap_or_default();
    topics.iter().find(|t| t["topic"] == topic).cloned().unwrap_or(Value::Null)
}

/// Messages a topic's counts (from [`topic_left`]) say are left: ready, reserved or delayed.
fn left(t: &Value) -> u64 {
    ["ready", "reserved", "delayed"].iter().map(|k| t[k].as_u64().unwrap_or(0)).sum()
}

/// The leader's counts of `topic` say nothing is left in it. On failure, prints what each node
/// counts and browses, and every message the leader still holds live, with its history.
pub fn assert_topic_empty(c: &Cluster, w: &Workload, scenario: &str) {
    let t = topic_left(c, &w.shared.topic);
    if left(&t) == 0 {
        return;
    }
    let topic = &w.shared.topic;
    let probe = super::cluster::short_client(Duration::from_secs(5));
    for i in (1..=c.size()).filter(|&i| c.is_running(i)) {
        let base = c.url(i);
        let counts = probe.get(format!("{base}/v1/topics")).send().and_then(|r| r.text());
        eprintln!("{scenario}: node {i} /v1/topics: {counts:?}");
        for state in ["delayed", "ready", "reserved"] {
            let page = probe
                .get(format!("{base}/v1/topics/{topic}/messages?state={state}"))
                .send()
                .and_then(|r| r.text());
            eprintln!("{scenario}: node {i} browse {state}: {page:?}");
        }
    }
    // Every message the clients may have stored, asked of the leader: the one counted live and
    // never delivered again is among those it does not call done or cancelled.
    let client = c.client();
    let mut ids: Vec<String> = w
        .history()
        .events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Produced { id, outcome, .. } if outcome != ProduceOutcome::Refused => Some(id),
            _ => None,
        })
        .collect();
    ids.sort();
    ids.dedup();
    for id in &ids {
        let Ok(r) = client.get(id) else { continue };
        let state = r.body["state"].as_str().unwrap_or("");
        if r.ok() && !matches!(state, "done" | "cancelled") {
            let history = client
                .request("GET", &format!("/v1/messages/{id}/history"), None, 0)
                .map(|r| r.body.to_string());
            eprintln!("{scenario}: live on the leader: {}\n  history: {history:?}", r.body);
        }
    }
    save_logs(c, scenario);
    save_data(c, scenario);
    panic!("the drained topic still counts messages: {t}\n{}", c.describe());
}

/// Stops the workload, drains, checks the history and prints its counts.
pub fn finish(c: &Cluster, w: &mut Workload, scenario: &str) -> Report {
    w.stop();
    drain(c, w);
    let report = w.history().check();
    eprintln!("{scenario}: {}", report.counts());
    eprintln!("{scenario}: answers {:?}", w.shared.statuses.lock().expect("statuses lock"));
    if !report.violations.is_empty() {
        explain(c, w, &report, scenario);
    }
    report.assert_ok();
    assert!(report.acked_produces >= 20, "{scenario}: too little was acknowledged to tell anything");
    assert_topic_empty(c, w, scenario);
    report
}

/// Prints what the cluster says now of each message the checker flagged, and who acknowledged
/// it, and saves every node's whole log, for the failure's diagnosis.
pub fn explain(c: &Cluster, w: &Workload, report: &Report, scenario: &str) {
    let client = c.client();
    for v in report.violations.iter().take(10) {
        let Some(id) = v.split_whitespace().nth(1) else { continue };
        let acked_by = w.shared.acked_by.lock().expect("acked_by lock").get(id).cloned();
        let got = client.get(id).map(|r| r.body.to_string());
        let history =
            client.request("GET", &format!("/v1/messages/{id}/history"), None, 0).map(|r| r.body.to_string());
        eprintln!("{scenario}: {v}\n  acknowledged: {acked_by:?}\n  now: {got:?}\n  history: {history:?}");
    }
    save_logs(c, scenario);
}

/// Saves every node's whole log (the failure message shows only their tails) and prints where.
pub fn save_logs(c: &Cluster, scenario: &str) {
    let name = format!("delayd-cluster-{scenario}-{}", std::process::id()).replace(' ', "-");
    let dir = std::env::temp_dir().join(name);
    if std::fs::create_dir_all(&dir).is_ok() {
        for i in 1..=c.size() {
            let _ = std::fs::write(dir.join(format!("node{i}.log")), c.node(i).log());
        }
        eprintln!("{scenario}: the nodes' logs are in {}", dir.display());
    }
    eprintln!("{}", c.describe());
}

/// Copies every node's data directory next to the saved logs (`cp -a`, while they run: a
/// snapshot good enough to read the log and the checkpoint).
fn save_data(c: &Cluster, scenario: &str) {
    let name = format!("delayd-cluster-{scenario}-{}", std::process::id()).replace(' ', "-");
    let dir = std::env::temp_dir().join(name);
    for i in 1..=c.size() {
        let to = dir.join(format!("node{i}-data"));
        let _ = std::process::Command::new("cp").arg("-a").arg(c.node(i).data_dir()).arg(&to).status();
    }
}

/// A node other than `not`.
pub fn other_than(not: usize, rng: &mut Rng) -> usize {
    let others: Vec<usize> = (1..=3).filter(|&i| i != not).collect();
    others[rng.below(others.len() as u64) as usize]
}

/// A field of node `i`'s `/v1/cluster` answer as a number (None when it does not answer).
pub fn view_u64(c: &Cluster, i: usize, field: &str) -> Option<u64> {
    c.views()[i - 1].as_ref().and_then(|v| v[field].as_u64())
}

/// Waits until node `i` holds every entry the leader had committed when this was called.
pub fn wait_caught_up(c: &Cluster, i: usize, timeout: Duration) {
    let leader = c.wait_leader(ELECTION);
    let target = view_u64(c, leader, "commit_index").expect("the leader's commit index");
    let deadline = Instant::now() + timeout;
    while view_u64(c, i, "applied_index").is_none_or(|a| a < target) {
        assert!(Instant::now() < deadline, "node {i} did not catch up to entry {target}\n{}", c.describe());
        sleep(Duration::from_millis(100));
    }
}

/// The leader a majority agrees on, once it is not `old`.
pub fn wait_new_leader(c: &Cluster, old: usize, timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(l) = agreed_leader(&c.views(), c.size()).filter(|&l| l != old) {
            return l;
        }
        assert!(Instant::now() < deadline, "no new leader within {timeout:?}\n{}", c.describe());
        sleep(Duration::from_millis(50));
    }
}

pub fn start_cluster() -> Cluster {
    let level = std::env::var("JEPSEN_NODE_LOG").unwrap_or_else(|_| "info".into());
    let c = Cluster::start(3, &[("DELAYD_LOG_LEVEL", level.as_str())]);
    c.wait_leader(ELECTION);
    c
}
