//! The four comparison workloads: throughput (produce, and pop + ack), end-to-end lateness, pending
//! capacity, crash recovery; and the consumer and paced-producer pieces the soak workload shares with them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::queue::{now_ms, spawn_mover, Delivery, Job, Queue};
use crate::servers::{Programs, Server};
use crate::systems::System;

/// Deterministic generator (SplitMix64): the same seed gives the same delays in every run.
pub struct Rng(u64);

impl Rng {
    /// A generator for one stream of a run.
    pub fn new(seed: u64, stream: u64) -> Self {
        Rng(seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Every size and knob of a run.
#[derive(Debug, Clone)]
pub struct Params {
    /// Seed for all random delays.
    pub seed: u64,
    /// Bytes per message body.
    pub body_bytes: usize,
    /// Repeats of each throughput case (each repeat runs every system, in a rotating order).
    pub repeats: usize,
    /// How long each throughput case is measured.
    pub measure: Duration,
    /// The unmeasured run of the same case just before it.
    pub warmup: Duration,
    /// Messages per produce batch call.
    pub batch_size: usize,
    /// Concurrent clients of the batched produce case and the capacity fill.
    pub clients: usize,
    /// Messages a consumer reserves per pop in the batched cases (pop + ack, end-to-end, crash,
    /// soak): the same on every system.
    pub pop_batch: usize,
    /// Messages made ready before a pop + ack case; the case ends early if its consumers ack them all.
    pub preload: usize,
    /// End-to-end producer rates in messages per second.
    pub rates: Vec<u64>,
    /// How long the paced producer runs.
    pub e2e_secs: f64,
    /// Shortest random delay.
    pub delay_min_ms: u64,
    /// Longest random delay.
    pub delay_max_ms: u64,
    /// Repeats of each end-to-end, capacity and crash run.
    pub e2e_repeats: usize,
    /// Messages held pending in the capacity workload.
    pub pending: usize,
    /// Pause after the capacity fill so async flushes reach the disk before it is measured.
    pub settle_ms: u64,
    /// How long the crash workload runs before the kill.
    pub crash_load_secs: f64,
    /// Random delay range in the crash workload, ms.
    pub crash_delay_ms: (u64, u64),
    /// Time-to-run in the crash workload.
    pub crash_ttr_ms: u64,
    /// Produce rate during the crash workload's load, msgs/s (paced so every system keeps up).
    pub crash_rate: u64,
    /// Consumers in the end-to-end and crash workloads.
    pub consumers: usize,
    /// Extra time allowed after the longest delay (and TTR) for stragglers before a message counts
    /// as missing or lost.
    pub grace_ms: u64,
    /// The Lua design's mover period.
    pub lua_tick: Duration,
}

/// Throughput cases: produces (messages acknowledged per second) and pops with acks (acknowledged
/// messages per second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// One client, one message per call.
    Single,
    /// 16 clients, one message per call each (the shape of a fleet of application servers).
    Conc16,
    /// 64 clients, one message per call each.
    Conc64,
    /// One client, batches.
    Batch1,
    /// `clients` clients, batches.
    BatchN,
    /// One consumer: pop 1, ack it, repeat.
    PopAck1,
    /// 16 consumers, each popping 1 and acking it.
    PopAck16,
    /// 16 consumers, each reserving up to `pop_batch` per pop and acking each.
    PopAckBatch,
}

impl Case {
    /// Every case, in report order.
    pub const ALL: [Case; 8] = [
        Case::Single,
        Case::Conc16,
        Case::Conc64,
        Case::Batch1,
        Case::BatchN,
        Case::PopAck1,
        Case::PopAck16,
        Case::PopAckBatch,
    ];

    /// The produce cases.
    pub const PRODUCE: [Case; 5] = [Case::Single, Case::Conc16, Case::Conc64, Case::Batch1, Case::BatchN];

    /// The pop + ack cases.
    pub const POP_ACK: [Case; 3] = [Case::PopAck1, Case::PopAck16, Case::PopAckBatch];

    /// (clients, messages per call) of this case.
    pub fn shape(self, p: &Params) -> (usize, usize) {
        match self {
            Case::Single => (1, 1),
            Case::Conc16 => (16, 1),
            Case::Conc64 => (64, 1),
            Case::Batch1 => (1, p.batch_size),
            Case::BatchN => (p.clients, p.batch_size),
            Case::PopAck1 => (1, 1),
            Case::PopAck16 => (16, 1),
            Case::PopAckBatch => (16, p.pop_batch),
        }
    }

    /// Column heading.
    pub fn label(self, p: &Params) -> String {
        let (n, per) = self.shape(p);
        let who = |what: &str| if n == 1 { format!("1 {what}") } else { format!("{n} {what}s") };
        match self {
            Case::Single | Case::Conc16 | Case::Conc64 => format!("{}, one at a time", who("client")),
            Case::Batch1 | Case::BatchN => format!("{}, batches of {per}", who("client")),
            Case::PopAck1 | Case::PopAck16 => format!("{}, pop 1 + ack 1", who("consumer")),
            Case::PopAckBatch => format!("{}, pop ≤ {per} + ack each", who("consumer")),
        }
    }
}

/// One throughput measurement.
#[derive(Debug, Clone)]
pub struct Throughput {
    /// Which case.
    pub case: Case,
    /// Messages acknowledged by the system (produces, or acks in the pop + ack cases).
    pub ok: usize,
    /// Messages refused or lost to errors.
    pub failed: usize,
    /// Wall time.
    pub secs: f64,
    /// First error seen, if any.
    pub error: Option<String>,
    /// CPU time the server process used meanwhile (user + system, every thread), when readable.
    pub server_cpu_secs: Option<f64>,
}

impl Throughput {
    /// Acknowledged messages per second.
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.secs.max(1e-9)
    }

    /// Server CPU time per acknowledged message, in µs: with the server pinned to one CPU, its
    /// throughput can be no more than one message per this long.
    pub fn cpu_us_per_msg(&self) -> Option<f64> {
        Some(self.server_cpu_secs? * 1e6 / (self.ok as f64).max(1.0))
    }
}

/// CPU time `pid` has used so far, user and system, summed over every thread it has had (exited
/// ones included), from `/proc/PID/stat`.
pub fn process_cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields are counted after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // utime and stime are the 14th and 15th fields of the line, the 12th and 13th after the name.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // /proc counts in USER_HZ, which Linux fixes at 100 for this interface on every architecture.
    Some((utime + stime) as f64 / 100.0)
}

/// One end-to-end run at one rate.
#[derive(Debug, Clone, Default)]
pub struct E2e {
    /// Target rate.
    pub rate: u64,
    /// Produces acknowledged.
    pub produced: usize,
    /// Produces that failed.
    pub produce_failed: usize,
    /// Rate the producer achieved.
    pub achieved_rate: f64,
    /// Distinct messages delivered.
    pub delivered: usize,
    /// Acknowledged produces never delivered before the deadline.
    pub missing: usize,
    /// First deliveries before their due time.
    pub early: usize,
    /// Deliveries beyond the first.
    pub duplicates: usize,
    /// Lateness (delivery − due) in ms of each first delivery, sorted.
    pub lateness: Vec<i64>,
}

/// One pending-capacity run.
#[derive(Debug, Clone, Default)]
pub struct Capacity {
    /// Messages the system acknowledged.
    pub pending: usize,
    /// RssAnon before filling.
    pub rss_before: u64,
    /// RssAnon after filling.
    pub rss_after: u64,
    /// Allocated bytes of the data files after filling.
    pub disk_alloc: u64,
    /// Apparent (logical) bytes of the data files after filling.
    pub disk_apparent: u64,
    /// Fill rate.
    pub fill_rate: f64,
}

/// One crash run.
#[derive(Debug, Clone, Default)]
pub struct Crash {
    /// Produces acknowledged (before the kill).
    pub acked: usize,
    /// Acknowledged produces never delivered.
    pub lost: usize,
    /// Messages delivered two or more times.
    pub twice: usize,
    /// Messages delivered again after their ack had succeeded.
    pub after_ack: usize,
    /// Restart until the server answers.
    pub ready_ms: f64,
    /// Restart until the first pop returns a message.
    pub first_pop_ms: Option<f64>,
}

/// Starts a fresh server plus, for the Redis designs, its mover; stops both on drop.
pub struct Running {
    /// The server process the load goes to: the only one, a cluster's leader, a Redis master.
    pub server: Server,
    /// The other servers of a replicated system: a cluster's other nodes, a Redis replica.
    pub peers: Vec<Server>,
    stop: Arc<AtomicBool>,
    movers: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Starts `system` fresh.
    pub async fn start(system: System, progs: &Programs, p: &Params) -> Result<Running, String> {
        let (server, peers) = if system.replicated {
            crate::group::start(system, progs).await?
        } else {
            (Server::start(system, progs).await?, Vec::new())
        };
        let stop = Arc::new(AtomicBool::new(false));
        let movers = spawn_mover(system, server.port, p.lua_tick, stop.clone());
        Ok(Running { server, peers, stop, movers })
    }

    /// Starts one server of `system` fresh, with `extra_args` after its usual arguments.
    pub async fn start_single_with(
        system: System,
        progs: &Programs,
        p: &Params,
        extra_args: Vec<String>,
    ) -> Result<Running, String> {
        let port = crate::servers::free_port().map_err(|e| format!("no free port: {e}"))?;
        let mut server = Server::prepare(system, progs, &system.name(), port, extra_args, Vec::new())?;
        server.spawn_and_wait().await?;
        let stop = Arc::new(AtomicBool::new(false));
        let movers = spawn_mover(system, server.port, p.lua_tick, stop.clone());
        Ok(Running { server, peers: Vec::new(), stop, movers })
    }

    /// Stops mover and servers and waits until the servers are gone: processes exited and reaped,
    /// data dirs removed, ports free, so the next server starts on a quiet machine. Returns how
    /// long the servers took to exit, or what was left behind.
    pub async fn shutdown(mut self) -> Result<Duration, String> {
        self.stop.store(true, Ordering::Relaxed);
        for m in self.movers.drain(..) {
            m.abort();
            let _ = m.await;
        }
        let servers: Vec<Server> = std::iter::once(self.server).chain(self.peers).collect();
        tokio::task::spawn_blocking(move || {
            let mut took = Duration::ZERO;
            let mut first_err = None;
            for s in servers {
                match s.finish() {
                    Ok(d) => took += d,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            first_err.map_or(Ok(took), Err)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// CPU time every server process of the system has used so far; None when one is unreadable.
    pub fn cpu_secs(&self) -> Option<f64> {
        std::iter::once(&self.server).chain(&self.peers).map(|s| s.pid().and_then(process_cpu_secs)).sum()
    }

    /// The start of a measured run: now, and the servers' CPU time so far.
    fn start_clock(&self) -> (Instant, Option<f64>) {
        (Instant::now(), self.cpu_secs())
    }

    /// The client API ports of every node (the load's server first).
    pub fn ports(&self) -> Vec<u16> {
        std::iter::once(&self.server).chain(&self.peers).map(|s| s.port).collect()
    }

    /// A client for this system with `p`'s body size. A delayd cluster's client follows the
    /// leader should it change.
    pub fn queue(&self, p: &Params) -> Result<Queue, String> {
        Queue::connect_group(self.server.system, self.server.port, &self.ports(), p.body_bytes)
    }
}

static TOPIC_N: AtomicU64 = AtomicU64::new(0);

/// A topic name unique within this run, so workloads on one server never see each other's messages.
pub fn topic(label: &str) -> String {
    format!("bench-{label}-{}", TOPIC_N.fetch_add(1, Ordering::Relaxed))
}

/// Runs one throughput case: an unmeasured warm-up of the same case on its own topic, then the
/// measured run.
pub async fn throughput(run: &Running, p: &Params, case: Case, rep: usize) -> Result<Throughput, String> {
    let warm = (p.warmup, (p.preload / 10).max(1));
    if !warm.0.is_zero() {
        run_case(run, p, case, rep, true, warm).await?;
    }
    run_case(run, p, case, rep, false, (p.measure, p.preload)).await
}

async fn run_case(
    run: &Running,
    p: &Params,
    case: Case,
    rep: usize,
    warm: bool,
    (length, preload): (Duration, usize),
) -> Result<Throughput, String> {
    let topic = topic(if warm { "warmup" } else { "throughput" });
    let base = (rep as u64) << 44 | (case as u64) << 40 | u64::from(warm) << 39;
    if Case::POP_ACK.contains(&case) {
        pop_ack(run, p, case, &topic, base, length, preload).await
    } else {
        produce(run, p, case, &topic, base, length).await
    }
}

/// Produces for `length`: every client sends its next call as soon as the last one is answered.
async fn produce(
    run: &Running,
    p: &Params,
    case: Case,
    topic: &str,
    base: u64,
    length: Duration,
) -> Result<Throughput, String> {
    let (clients, batch) = case.shape(p);
    let mut queues = Vec::new();
    for _ in 0..clients {
        queues.push(run.queue(p)?);
    }
    let (t0, cpu0) = run.start_clock();
    let mut tasks = Vec::new();
    for (w, mut q) in queues.into_iter().enumerate() {
        let topic = topic.to_string();
        let base = base | (w as u64) << 32;
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut err) = (0usize, 0usize, None);
            let mut sent = 0usize;
            while t0.elapsed() < length {
                let jobs: Vec<Job> = (0..batch)
                    .map(|i| Job { seq: base + (sent + i) as u64, delay_ms: 3_600_000, ttr_ms: 30_000 })
                    .collect();
                match q.produce(&topic, &jobs).await {
                    Ok(v) => {
                        let good = v.iter().filter(|b| **b).count();
                        ok += good;
                        failed += batch - good;
                    }
                    Err(e) => {
                        failed += batch;
                        err.get_or_insert(e);
                    }
                }
                sent += batch;
            }
            (ok, failed, err)
        }));
    }
    collect(run, case, (t0, cpu0), tasks).await
}

async fn collect(
    run: &Running,
    case: Case,
    (t0, cpu0): (Instant, Option<f64>),
    tasks: Vec<tokio::task::JoinHandle<(usize, usize, Option<String>)>>,
) -> Result<Throughput, String> {
    let mut r = Throughput { case, ok: 0, failed: 0, secs: 0.0, error: None, server_cpu_secs: None };
    for t in tasks {
        let (ok, failed, err) = t.await.map_err(|e| e.to_string())?;
        r.ok += ok;
        r.failed += failed;
        if r.error.is_none() {
            r.error = err;
        }
    }
    r.secs = t0.elapsed().as_secs_f64();
    let cpu1 = run.cpu_secs();
    r.server_cpu_secs = cpu0.zip(cpu1).map(|(a, b)| b - a);
    if r.ok == 0 {
        return Err(r.error.unwrap_or_else(|| "nothing was acknowledged".to_string()));
    }
    Ok(r)
}

/// Makes `preload` messages ready (not measured), then consumers pop and ack them for `length` or
/// until all are acked, each acking its whole pop before the next one.
async fn pop_ack(
    run: &Running,
    p: &Params,
    case: Case,
    topic: &str,
    base: u64,
    length: Duration,
    preload: usize,
) -> Result<Throughput, String> {
    let (consumers, max) = case.shape(p);
    let mut q = run.queue(p)?;
    let mut accepted = 0;
    let mut seq = base;
    // At most 1,000 messages and about 2 MiB of bodies per request, well under delayd's default
    // request limit (4 MiB of body plus 64 KiB) whatever the body size.
    let chunk = ((2 << 20) / p.body_bytes.max(1)).clamp(1, 1000);
    while accepted < preload {
        let jobs: Vec<Job> = (0..chunk.min(preload - accepted))
            .map(|i| Job { seq: seq + i as u64, delay_ms: 0, ttr_ms: 30_000 })
            .collect();
        seq += jobs.len() as u64;
        let n = q.preload_ready(topic, &jobs).await?;
        if n == 0 {
            return Err("the preload was refused".to_string());
        }
        accepted += n;
    }
    // The Lua queue's mover promotes them on its next ticks; delayd makes them ready at once.
    let wait_until = Instant::now() + Duration::from_secs(30);
    while q.ready_count(topic).await? < accepted {
        if Instant::now() > wait_until {
            return Err(format!("{accepted} preloaded messages were not all ready after 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut queues = Vec::new();
    for _ in 0..consumers {
        queues.push(run.queue(p)?);
    }
    let acked_total = Arc::new(AtomicU64::new(0));
    let target = accepted as u64;
    let (t0, cpu0) = run.start_clock();
    let mut tasks = Vec::new();
    for mut q in queues {
        let (topic, acked_total) = (topic.to_string(), acked_total.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut err) = (0usize, 0usize, None);
            while t0.elapsed() < length && acked_total.load(Ordering::Relaxed) < target {
                let got = match q.pop(&topic, max, 100, 30_000).await {
                    Ok(g) => g,
                    Err(e) => {
                        err.get_or_insert(e);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                for d in got {
                    match q.ack(&d).await {
                        Ok(true) => {
                            ok += 1;
                            acked_total.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(false) => failed += 1,
                        Err(e) => {
                            failed += 1;
                            err.get_or_insert(e);
                        }
                    }
                }
            }
            (ok, failed, err)
        }));
    }
    collect(run, case, (t0, cpu0), tasks).await
}

/// Every delivery the consumers saw.
#[derive(Default)]
pub struct Seen {
    /// When each message was first delivered (unix ms), by sequence number.
    pub first: HashMap<u64, i64>,
    /// The due time each first delivery carried (unix ms), by sequence number.
    pub due: HashMap<u64, i64>,
    /// Deliveries per message.
    pub count: HashMap<u64, u32>,
    /// Lateness (delivery − due, ms) of each first delivery, in the order they were recorded.
    pub lateness: Vec<i64>,
    acked_at: HashMap<u64, i64>,
    /// Messages delivered again after their ack had succeeded.
    pub after_ack: HashSet<u64>,
    first_pop_after: Option<Instant>,
}

impl Seen {
    fn record(&mut self, d: &Delivery, restart: Option<Instant>) {
        if let Some(acked) = self.acked_at.get(&d.seq) {
            if d.at_ms >= *acked {
                self.after_ack.insert(d.seq);
            }
        }
        *self.count.entry(d.seq).or_insert(0) += 1;
        if let std::collections::hash_map::Entry::Vacant(v) = self.first.entry(d.seq) {
            v.insert(d.at_ms);
            self.due.insert(d.seq, d.due_ms);
            self.lateness.push(d.at_ms - d.due_ms);
        }
        if let Some(r) = restart {
            if self.first_pop_after.is_none() {
                self.first_pop_after = Some(Instant::now().max(r));
            }
        }
    }

    /// Distinct messages whose ack succeeded.
    pub fn acked(&self) -> usize {
        self.acked_at.len()
    }
}

/// What consumers share with the workload driving them.
#[derive(Clone, Default)]
pub struct Shared {
    /// What was delivered and acked.
    pub seen: Arc<Mutex<Seen>>,
    /// Set to make the consumers return.
    pub stop: Arc<AtomicBool>,
    restart_at: Arc<Mutex<Option<Instant>>>,
}

/// Consumers that pop and ack until `stop`, recording every delivery.
pub fn spawn_consumers(
    run: &Running,
    p: &Params,
    topic: &str,
    ttr_ms: u64,
    shared: &Shared,
) -> Result<Vec<tokio::task::JoinHandle<()>>, String> {
    let mut v = Vec::new();
    let pop_batch = p.pop_batch;
    for _ in 0..p.consumers {
        let mut q = run.queue(p)?;
        let topic = topic.to_string();
        let Shared { seen, stop, restart_at } = shared.clone();
        v.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let got = match q.pop(&topic, pop_batch, 200, ttr_ms).await {
                    Ok(g) => g,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                if got.is_empty() {
                    continue;
                }
                {
                    let restart = *restart_at.lock().unwrap_or_else(|e| e.into_inner());
                    let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                    for d in &got {
                        s.record(d, restart);
                    }
                }
                // Acks go out concurrently, as a consumer with a worker pool would send them.
                let mut acks = Vec::new();
                for d in got {
                    let mut q2 = q.clone();
                    acks.push(tokio::spawn(async move { (q2.ack(&d).await, d.seq) }));
                }
                for a in acks {
                    if let Ok((Ok(true), seq)) = a.await {
                        seen.lock().unwrap_or_else(|e| e.into_inner()).acked_at.insert(seq, now_ms());
                    }
                }
            }
        }));
    }
    Ok(v)
}

/// What a paced producer has had acknowledged or refused so far; readable while it runs.
#[derive(Clone, Default)]
pub struct ProduceLog {
    /// Sequence numbers of acknowledged produces.
    pub ok: Arc<Mutex<Vec<u64>>>,
    /// Produces refused or lost to errors.
    pub failed: Arc<AtomicU64>,
}

impl ProduceLog {
    /// Acknowledged produces so far.
    pub fn produced(&self) -> usize {
        self.ok.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Sends `total` messages to `topic` at `rate` msgs/s with delays drawn uniformly from `delay_ms`,
/// recording the outcome in `log`; returns once every call has been answered.
#[allow(clippy::too_many_arguments)]
pub async fn paced_produce(
    q: Queue,
    topic: String,
    seq_base: u64,
    rate: u64,
    total: u64,
    delay_ms: (u64, u64),
    mut rng: Rng,
    log: ProduceLog,
) {
    let inflight = Arc::new(tokio::sync::Semaphore::new(64));
    let tick = Duration::from_millis(10);
    let t0 = Instant::now();
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = 0u64;
    let mut producers = Vec::new();
    while sent < total {
        interval.tick().await;
        // Send what the schedule says should be out by now, so a slow call does not lower the rate.
        let due_by_now = ((t0.elapsed().as_secs_f64() * rate as f64) as u64).min(total);
        if due_by_now <= sent {
            continue;
        }
        let jobs: Vec<Job> = (sent..due_by_now)
            .map(|i| Job { seq: seq_base + i, delay_ms: rng.range(delay_ms.0, delay_ms.1), ttr_ms: 30_000 })
            .collect();
        sent = due_by_now;
        let Ok(permit) = inflight.clone().acquire_owned().await else { break };
        let (mut q, topic, log) = (q.clone(), topic.clone(), log.clone());
        producers.push(tokio::spawn(async move {
            let _permit = permit;
            let mut ok = Vec::new();
            for chunk in jobs.chunks(1000) {
                match q.produce(&topic, chunk).await {
                    Ok(v) => {
                        for (j, good) in chunk.iter().zip(v) {
                            if good {
                                ok.push(j.seq);
                            } else {
                                log.failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err(_) => {
                        log.failed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    }
                }
            }
            log.ok.lock().unwrap_or_else(|e| e.into_inner()).extend(ok);
        }));
        // Finished calls are dropped as we go, so a long run does not hold a handle per call.
        producers.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
    }
    for t in producers {
        let _ = t.await;
    }
}

/// The unmeasured warm-up before an end-to-end rate: the same producer rate and consumers for the
/// warm-up time, with short delays so it drains quickly.
pub async fn warm_up_e2e(run: &Running, p: &Params, rate: u64) -> Result<(), String> {
    if p.warmup.is_zero() {
        return Ok(());
    }
    let warm = Params {
        e2e_secs: p.warmup.as_secs_f64(),
        delay_min_ms: 10,
        delay_max_ms: 100,
        grace_ms: p.grace_ms.min(2_000),
        ..p.clone()
    };
    end_to_end(run, &warm, rate, usize::MAX).await.map(|_| ())
}

/// A paced producer at `rate` msgs/s with random delays, consumers popping and acking.
pub async fn end_to_end(run: &Running, p: &Params, rate: u64, rep: usize) -> Result<E2e, String> {
    let topic = topic(&format!("e2e{rate}"));
    let shared = Shared::default();
    let (seen, stop) = (shared.seen.clone(), shared.stop.clone());
    let consumers = spawn_consumers(run, p, &topic, 30_000, &shared)?;
    let rng = Rng::new(p.seed, (1000 + rate * 10).wrapping_add(rep as u64));
    let log = ProduceLog::default();
    let total = (rate as f64 * p.e2e_secs).round() as u64;
    let t0 = Instant::now();
    // The Redis designs key jobs by this number, so each run on a server gets its own range.
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let seq_base = RUNS.fetch_add(1, Ordering::Relaxed) << 40;
    paced_produce(
        run.queue(p)?,
        topic.clone(),
        seq_base,
        rate,
        total,
        (p.delay_min_ms, p.delay_max_ms),
        rng,
        log.clone(),
    )
    .await;
    let produce_secs = t0.elapsed().as_secs_f64();
    let produced: Vec<u64> = std::mem::take(&mut *log.ok.lock().unwrap_or_else(|e| e.into_inner()));
    let failed = log.failed;
    // Wait for every acknowledged message, but no longer than its delay plus a generous grace.
    let deadline = Instant::now() + Duration::from_millis(p.delay_max_ms + p.grace_ms);
    loop {
        let n = seen.lock().unwrap_or_else(|e| e.into_inner()).first.len();
        if n >= produced.len() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A short quiet period lets duplicate deliveries show up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for c in consumers {
        let _ = c.await;
    }
    let mut s = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    s.lateness.sort_unstable();
    // Each message's due and first-delivery times, to line the late ones up with a server trace.
    match std::env::var("DELAYD_BENCH_E2E_DUMP") {
        Ok(path) if rep != usize::MAX => {
            let mut out = String::new();
            for (seq, at) in &s.first {
                out.push_str(&format!("{} {}\n", s.due.get(seq).copied().unwrap_or(0), at));
            }
            let file = format!("{path}.{rate}.{rep}");
            if let Err(e) = std::fs::write(&file, out) {
                eprintln!("could not write {file}: {e}");
            }
        }
        _ => {}
    }
    let missing = produced.iter().filter(|seq| !s.first.contains_key(seq)).count();
    Ok(E2e {
        rate,
        produced: produced.len(),
        produce_failed: failed.load(Ordering::Relaxed) as usize,
        achieved_rate: produced.len() as f64 / produce_secs.max(1e-9),
        delivered: s.first.len(),
        missing,
        early: s.lateness.iter().filter(|l| **l < 0).count(),
        duplicates: s.count.values().map(|c| (*c as usize).saturating_sub(1)).sum(),
        lateness: s.lateness,
    })
}

/// Fills the system with `pending` messages due in an hour and reads memory and disk.
pub async fn capacity(run: &Running, p: &Params) -> Result<Capacity, String> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_before = run.server.rss_anon_bytes().ok_or("cannot read RssAnon")?;
    let topic = topic("capacity");
    let per = p.pending.div_ceil(p.clients);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..p.clients {
        let mut q = run.queue(p)?;
        let topic = topic.clone();
        let count = per.min(p.pending.saturating_sub(w * per));
        tasks.push(tokio::spawn(async move {
            let mut ok = 0usize;
            let mut sent = 0usize;
            while sent < count {
                let n = 1000.min(count - sent);
                let jobs: Vec<Job> = (0..n)
                    .map(|i| Job {
                        seq: ((w as u64) << 32) + (sent + i) as u64,
                        delay_ms: 3_600_000,
                        ttr_ms: 30_000,
                    })
                    .collect();
                match q.produce(&topic, &jobs).await {
                    Ok(v) => ok += v.iter().filter(|b| **b).count(),
                    Err(e) => return Err(e),
                }
                sent += n;
            }
            Ok(ok)
        }));
    }
    let mut pending = 0;
    for t in tasks {
        pending += t.await.map_err(|e| e.to_string())??;
    }
    let fill_secs = t0.elapsed().as_secs_f64();
    // Let async flushes (delayd async, AOF everysec) land before reading the disk.
    tokio::time::sleep(Duration::from_millis(p.settle_ms)).await;
    let rss_after = run.server.rss_anon_bytes().ok_or("cannot read RssAnon")?;
    let (disk_alloc, disk_apparent) = run.server.disk_bytes();
    Ok(Capacity {
        pending,
        rss_before,
        rss_after,
        disk_alloc,
        disk_apparent,
        fill_rate: pending as f64 / fill_secs,
    })
}

/// Produce/pop/ack load, SIGKILL, restart, drain; counts losses and duplicates.
pub async fn crash(run: &mut Running, p: &Params) -> Result<Crash, String> {
    if run.server.system.replicated && run.server.system.is_delayd() {
        // Its clients would follow the new leader while this waits for the old one to restart.
        return Err("the crash workload restarts one server in place; a cluster's is `failover`".to_string());
    }
    let topic = topic("crash");
    let ttr = p.crash_ttr_ms;
    let shared = Shared::default();
    let (seen, stop, restart_at) = (shared.seen.clone(), shared.stop.clone(), shared.restart_at.clone());
    let consumers = spawn_consumers(run, p, &topic, ttr, &shared)?;
    let stop_produce = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let next_seq = Arc::new(AtomicI64::new(0));
    let (dmin, dmax) = p.crash_delay_ms;
    let mut producers = Vec::new();
    for w in 0..2u64 {
        let mut q = run.queue(p)?;
        let (topic, stop_produce, acked, next_seq) =
            (topic.clone(), stop_produce.clone(), acked.clone(), next_seq.clone());
        let mut rng = Rng::new(p.seed, 5000 + w);
        // Two producers of 10-message batches share the rate.
        let mut pace = tokio::time::interval(Duration::from_secs_f64(20.0 / p.crash_rate.max(1) as f64));
        producers.push(tokio::spawn(async move {
            while !stop_produce.load(Ordering::Relaxed) {
                pace.tick().await;
                let jobs: Vec<Job> = (0..10)
                    .map(|_| Job {
                        seq: next_seq.fetch_add(1, Ordering::Relaxed) as u64,
                        delay_ms: rng.range(dmin, dmax),
                        ttr_ms: ttr,
                    })
                    .collect();
                match q.produce(&topic, &jobs).await {
                    Ok(v) => {
                        let ok: Vec<u64> =
                            jobs.iter().zip(v).filter(|(_, g)| *g).map(|(j, _)| j.seq).collect();
                        acked.lock().unwrap_or_else(|e| e.into_inner()).extend(ok);
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(p.crash_load_secs)).await;
    // A kill before any produce was acknowledged tests nothing; when the disk's syncs stall (a large
    // file just deleted) the first one can outlast a short load, so the load goes on until one is.
    let give_up = Instant::now() + crate::http::CALL_TIMEOUT;
    while acked.lock().unwrap_or_else(|e| e.into_inner()).is_empty() && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.server.kill9();
    stop_produce.store(true, Ordering::Relaxed);
    for t in producers {
        let _ = t.await;
    }
    let t_restart = Instant::now();
    *restart_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(t_restart);
    // Deliveries recorded before this point happened before the kill.
    seen.lock().unwrap_or_else(|e| e.into_inner()).first_pop_after = None;
    let ready = run.server.spawn_and_wait().await;
    let ready = match ready {
        Ok(d) => d,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            return Err(format!("restart failed: {e}"));
        }
    };
    let acked: Vec<u64> = std::mem::take(&mut *acked.lock().unwrap_or_else(|e| e.into_inner()));
    let deadline = Instant::now() + Duration::from_millis(dmax + ttr + p.grace_ms);
    loop {
        let done = {
            let s = seen.lock().unwrap_or_else(|e| e.into_inner());
            acked.iter().all(|q| s.first.contains_key(q))
        };
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Messages reserved at the kill come back after their TTR (and, for the plain design, the next
    // 1-second tick): wait that long so their second delivery is counted.
    tokio::time::sleep(Duration::from_millis(ttr + 1_200)).await;
    stop.store(true, Ordering::Relaxed);
    for c in consumers {
        let _ = c.await;
    }
    let s = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Crash {
        acked: acked.len(),
        lost: acked.iter().filter(|q| !s.first.contains_key(q)).count(),
        twice: s.count.values().filter(|c| **c >= 2).count(),
        after_ack: s.after_ack.len(),
        ready_ms: ready.as_secs_f64() * 1000.0,
        first_pop_ms: s.first_pop_after.map(|t| t.duration_since(t_restart).as_secs_f64() * 1000.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_cpu_time_is_read_and_grows_with_work() {
        let me = std::process::id();
        let before = process_cpu_secs(me).expect("own /proc stat");
        let give_up = Instant::now() + Duration::from_secs(20);
        let mut x = 0u64;
        // Spin until the kernel has charged a few 10 ms ticks to this process.
        while process_cpu_secs(me).expect("stat") < before + 0.05 {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            assert!(Instant::now() < give_up, "CPU time did not grow");
        }
        assert!(process_cpu_secs(u32::MAX).is_none(), "no such process");
    }

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let a: Vec<u64> = {
            let mut r = Rng::new(42, 1);
            (0..100).map(|_| r.range(1000, 5000)).collect()
        };
        let mut r = Rng::new(42, 1);
        let b: Vec<u64> = (0..100).map(|_| r.range(1000, 5000)).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|x| (1000..=5000).contains(x)));
        let mut other = Rng::new(43, 1);
        assert_ne!(a[0..10], (0..10).map(|_| other.range(1000, 5000)).collect::<Vec<_>>()[..]);
    }
}
