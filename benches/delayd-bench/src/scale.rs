//! The scale workload (issue 29): one server per system, filled cumulatively to each backlog size in
//! turn with messages due in days, and at each size the cost of every operation measured: produce
//! (one at a time and in batches), pop + ack, the lateness of a steady stream, memory and disk,
//! look-ups of old ids (delayd), the longest engine step (delayd), restarts after SIGTERM and
//! SIGKILL, and a catch-up of many messages falling due at once.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::HttpConn;
use crate::queue::{now_ms, Job, Queue};
use crate::servers::Programs;
use crate::systems::{Engine, System};
use crate::workloads::{end_to_end, throughput, topic, Case, E2e, Params, Rng, Running, Throughput};

const DAY_MS: u64 = 86_400_000;

/// Time-to-run of the catch-up's reservations, ms: their timers come due this long after each pop.
const CATCHUP_TTR_MS: u64 = 60_000;
/// Ids of the oldest delayd messages kept for the look-ups.
const KEEP_IDS: usize = 100_000;
/// Look-ups timed at each size.
const LOOKUPS: usize = 1_000;
/// Seq ranges of the workload's own messages, apart from every other workload's (the Lua Redis
/// queue keys a job by its seq, and refuses a second job with the same one).
const FILL_SEQ: u64 = 1 << 60;
const CATCHUP_SEQ: u64 = 1 << 61;
const PROBE_SEQ: u64 = 1 << 59;
/// Acks each catch-up consumer has in flight at once.
const ACK_WORKERS: usize = 16;

/// The workload's knobs.
#[derive(Debug, Clone)]
pub struct ScaleParams {
    /// Backlog sizes, ascending; one server per system is filled to each in turn.
    pub sizes: Vec<usize>,
    /// Body bytes of the backlog's messages.
    pub body_bytes: usize,
    /// The backlog's delays, whole days, uniform in this range.
    pub delay_days: (u64, u64),
    /// Systems, each on its own server, one after another.
    pub systems: Vec<System>,
    /// beanstalkd's fill stops once its RSS passes this many bytes.
    pub rss_cap: u64,
    /// Redis `maxmemory` (with `noeviction`), as redis-server takes it.
    pub redis_maxmemory: String,
    /// Messages falling due at once in the catch-up (0: no catch-up).
    pub catchup: usize,
    /// Each throughput case is measured this long.
    pub measure: Duration,
    /// The 1,000 msgs/s stream is produced this long.
    pub stream_secs: f64,
    /// Server CPU is read over this much idle time at each size (zero: not measured).
    pub idle: Duration,
    /// Messages made ready before the pop + ack case, which ends once they are all acked.
    pub pop_preload: usize,
}

/// Restart until the first successful pop.
#[derive(Debug, Clone)]
pub struct Restart {
    /// SIGTERM until the process exited (None after a SIGKILL, or when it had to be killed).
    pub exit_ms: Option<f64>,
    /// Spawn until a pop returned the ready message.
    pub first_pop_ms: f64,
}

/// Many messages due at once.
#[derive(Debug, Clone)]
pub struct CatchUp {
    /// Messages the catch-up produced.
    pub produced: usize,
    /// Of them, produced after the shared due time had passed (due at once when produced).
    pub late_produced: usize,
    /// Due time until every one was ready or popped, s (None: not within the limit).
    pub ready_secs: Option<f64>,
    /// Due time until every one was acked, s.
    pub acked_secs: Option<f64>,
    /// Messages acked.
    pub acked: usize,
}

/// delayd's engine-step and index figures from `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Steps {
    /// Longest engine step, wall time, s.
    pub max_s: Option<f64>,
    /// Longest engine step, the engine thread's CPU time, s.
    pub cpu_max_s: Option<f64>,
    /// Steps over 10 ms of the engine's CPU time.
    pub cpu_over_10ms: Option<u64>,
    /// Longest part of one step spent on the id index's resize (wall time, which bounds its CPU
    /// time), s.
    pub resize_max_s: Option<f64>,
    /// Steps whose resize part took over 10 ms.
    pub resize_over_10ms: Option<u64>,
    /// Slots of the id index.
    pub index_slots: Option<u64>,
    /// Entries of the id index.
    pub index_entries: Option<u64>,
    /// Level hops the schedulers performed (since the server started).
    pub hops: Option<u64>,
}

/// Everything measured at one size on one system.
#[derive(Debug, Clone)]
pub struct Point {
    /// The size asked for.
    pub target: usize,
    /// Backlog messages acknowledged (the fill stops early on a refusal or the RSS cap).
    pub pending: usize,
    /// Messages the server held when its memory and disk were read: the backlog plus what the
    /// measurements so far left (produces due in an hour, preloaded messages not popped).
    pub held: usize,
    /// Messages this size's measurements left behind (counted in later sizes' `held`).
    pub left: usize,
    /// Why the fill stopped early: "refused at N (...)" or "RSS cap at N".
    pub stopped: Option<String>,
    /// Fill rate of this step, msgs/s.
    pub fill_rate: f64,
    /// Server CPU while nothing was asked of it, % of one core.
    pub idle_cpu_pct: Result<f64, String>,
    /// Produce, one client, one message per call.
    pub single: Result<Throughput, String>,
    /// Produce, `clients` clients, batches.
    pub batch: Result<Throughput, String>,
    /// Pop ≤ `pop_batch` + ack each, 16 consumers.
    pub pop_ack: Result<Throughput, String>,
    /// The steady stream's lateness.
    pub stream: Result<E2e, String>,
    /// RssAnon of the freshly started server, bytes: the part of RssAnon that is not the backlog's.
    pub rss_anon_base: Option<u64>,
    /// RssAnon, bytes.
    pub rss_anon: Option<u64>,
    /// VmRSS, bytes.
    pub rss: Option<u64>,
    /// Allocated bytes of the data directory.
    pub disk_alloc: u64,
    /// `GET /v1/messages/{id}` latencies of random old ids, µs, sorted (delayd only).
    pub lookup_us: Result<Vec<i64>, String>,
    /// Engine steps and index (delayd only).
    pub steps: Result<Steps, String>,
    /// Restart after SIGTERM.
    pub term: Result<Restart, String>,
    /// Restart after SIGKILL.
    pub kill: Result<Restart, String>,
    /// The catch-up.
    pub catchup: Result<CatchUp, String>,
}

/// One system's run over every size.
#[derive(Debug, Clone)]
pub struct SystemRun {
    /// Which system.
    pub system: System,
    /// One point per size reached.
    pub points: Vec<Point>,
    /// What ended the run early, if anything.
    pub error: Option<String>,
}

/// Parses a count such as `50000`, `20k`, `1M`, `1.5M`, `2G` (decimal multiples).
pub fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1e3),
        Some((i, 'm' | 'M')) => (&t[..i], 1e6),
        Some((i, 'g' | 'G')) => (&t[..i], 1e9),
        _ => (t, 1.0),
    };
    let bad = || format!("{s:?} is not a count (examples: 50000, 20k, 1M, 1.5M)");
    if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(bad());
    }
    let n = num.parse::<f64>().map_err(|_| bad())? * mult;
    if n.fract() != 0.0 || n > 1e12 {
        return Err(bad());
    }
    Ok(n as usize)
}

/// Parses the backlog's delay range in whole days, `A-B` with 1 ≤ A ≤ B.
pub fn parse_days(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("--scale-delay-days wants A-B in whole days with 1 <= A <= B, got {s:?}");
    let (a, b) = s.split_once('-').ok_or_else(bad)?;
    let a: u64 = a.trim().parse().map_err(|_| bad())?;
    let b: u64 = b.trim().parse().map_err(|_| bad())?;
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// Sizes as given, checked: positive and ascending (the fill is cumulative).
pub fn parse_sizes(list: &[String]) -> Result<Vec<usize>, String> {
    let sizes = list.iter().map(|s| parse_count(s)).collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() || sizes.contains(&0) || sizes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("--pending for scale wants ascending positive sizes, got {sizes:?}"));
    }
    Ok(sizes)
}

/// Runs every system over every size, one after another; `save` is called after each size so an
/// interrupted run keeps what it measured.
pub async fn run(
    progs: &Programs,
    p: &Params,
    sp: &ScaleParams,
    save: &dyn Fn(&[SystemRun]),
) -> Vec<SystemRun> {
    let mut runs: Vec<SystemRun> = Vec::new();
    for &sys in &sp.systems {
        runs.push(SystemRun { system: sys, points: Vec::new(), error: None });
        let i = runs.len() - 1;
        let outcome = one_system(sys, progs, p, sp, &mut runs, i, save).await;
        if let Err(e) = outcome {
            eprintln!("delayd-bench: scale on {} FAILED: {e}", sys.name());
            runs[i].error = Some(e);
        }
        save(&runs);
    }
    runs
}

async fn start(sys: System, progs: &Programs, p: &Params, sp: &ScaleParams) -> Result<Running, String> {
    let extra = match sys.engine {
        // No automatic AOF rewrite: its fork's copy-on-write under the fill could take a Redis
        // at its maxmemory past the machine's memory.
        Engine::RedisLua | Engine::RedisPlain => [
            "--maxmemory",
            &sp.redis_maxmemory,
            "--maxmemory-policy",
            "noeviction",
            "--auto-aof-rewrite-percentage",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        Engine::Delayd | Engine::Beanstalkd => Vec::new(),
    };
    Running::start_single_with(sys, progs, p, extra).await
}

async fn one_system(
    sys: System,
    progs: &Programs,
    p: &Params,
    sp: &ScaleParams,
    runs: &mut [SystemRun],
    i: usize,
    save: &dyn Fn(&[SystemRun]),
) -> Result<(), String> {
    let mut run = start(sys, progs, p, sp).await?;
    let rss_anon_base = run.server.rss_anon_bytes();
    let mut ids = Vec::new();
    let seq = Arc::new(AtomicU64::new(FILL_SEQ));
    let (mut pending, mut left) = (0usize, 0usize);
    // Until then, reservations an earlier size's catch-up made are still running out: each
    // acked one leaves a timer that comes due and is read and skipped, work that is not idle.
    let mut quiet_at = Instant::now();
    let outcome = async {
        for (k, &target) in sp.sizes.iter().enumerate() {
            eprintln!("delayd-bench: scale on {}: filling {pending} -> {target} ...", sys.name());
            let probes = (probe(&run, p, k, false).await, probe(&run, p, k, true).await);
            let keep = if k == 0 { Some(&mut ids) } else { None };
            let spec = FillSpec { topic: "backlog", count: target - pending, due_at_ms: None };
            let f = fill(&run, p, sp, spec, &seq, keep).await?;
            pending += f.acked;
            let step = Step { k, pending, left_before: left, f: &f, ids: &ids, probes, quiet_at };
            let mut point = measure(&mut run, p, sp, step).await;
            quiet_at = Instant::now() + Duration::from_millis(CATCHUP_TTR_MS);
            left += point.left;
            point.target = target;
            point.rss_anon_base = rss_anon_base;
            log_point(sys, &point);
            let stopped = point.stopped.is_some();
            runs[i].points.push(point);
            save(runs);
            if stopped {
                break;
            }
        }
        Ok::<(), String>(())
    }
    .await;
    let stopped = run.shutdown().await;
    outcome?;
    stopped.map(|_| ())
}

/// What one fill step did.
struct Filled {
    acked: usize,
    /// Messages sent with no delay left: their shared due time had passed (catch-up only).
    late: usize,
    secs: f64,
    stopped: Option<Stop>,
}

/// Why a fill stopped before its count.
#[derive(Debug, Clone)]
enum Stop {
    /// beanstalkd's RSS passed the cap.
    RssCap,
    /// The system refused a write (the first such reply).
    Refused(String),
}

impl Stop {
    /// "RSS cap at N" or "refused at N (reply)", N being the messages it holds.
    fn at(&self, n: usize) -> String {
        match self {
            Stop::RssCap => format!("RSS cap at {n}"),
            Stop::Refused(r) => format!("refused at {n} ({})", r.chars().take(80).collect::<String>()),
        }
    }
}

/// What to produce: `count` messages on `topic`, due in `sp.delay_days` or all at `due_at_ms`.
struct FillSpec<'a> {
    topic: &'a str,
    count: usize,
    due_at_ms: Option<i64>,
}

/// Produces `spec.count` messages from `clients` clients in batches; stops early (not an error)
/// when the system refuses writes or beanstalkd's RSS passes the cap.
async fn fill(
    run: &Running,
    p: &Params,
    sp: &ScaleParams,
    spec: FillSpec<'_>,
    seq: &Arc<AtomicU64>,
    keep_ids: Option<&mut Vec<String>>,
) -> Result<Filled, String> {
    let t0 = Instant::now();
    let left = Arc::new(AtomicUsize::new(spec.count));
    let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let why = Arc::new(std::sync::Mutex::new(None::<Stop>));
    let keep = keep_ids.is_some();
    let chunk = ((2 << 20) / sp.body_bytes.max(1)).clamp(1, 1000);
    let cap = (run.server.system.engine == Engine::Beanstalkd).then_some((run.server.pid(), sp.rss_cap));
    let mut tasks = Vec::new();
    for w in 0..p.clients {
        let mut q = Queue::connect(run.server.system, run.server.port, sp.body_bytes)?;
        let (left, counts, stop, why, seq) =
            (left.clone(), counts.clone(), stop.clone(), why.clone(), seq.clone());
        let mut rng = Rng::new(p.seed, 7_000 + w as u64 + seq.load(Ordering::Relaxed));
        let (days, due_at, topic) = (sp.delay_days, spec.due_at_ms, spec.topic.to_string());
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| Some(l - l.min(chunk)));
                let n = n.unwrap_or(0).min(chunk);
                if n == 0 {
                    break;
                }
                let base = seq.fetch_add(n as u64, Ordering::Relaxed);
                let left_ms = due_at.map(|d| (d - now_ms()).max(0) as u64);
                if left_ms == Some(0) {
                    counts.1.fetch_add(n, Ordering::Relaxed);
                }
                let jobs: Vec<Job> = (0..n as u64)
                    .map(|i| {
                        let delay_ms = left_ms.unwrap_or_else(|| rng.range(days.0 * DAY_MS, days.1 * DAY_MS));
                        Job { seq: base + i, delay_ms, ttr_ms: 30_000 }
                    })
                    .collect();
                let refusal = match q.produce_ids(&topic, &jobs).await {
                    Ok((ok, got)) => {
                        let good = ok.iter().filter(|b| **b).count();
                        counts.0.fetch_add(good, Ordering::Relaxed);
                        if keep && ids.len() < KEEP_IDS {
                            ids.extend(got);
                        }
                        (good < n).then(|| format!("{} of {n} refused", n - good))
                    }
                    Err(e) if e.contains("OOM") || e.contains("OUT_OF_MEMORY") => Some(e),
                    Err(e) => return Err(e),
                };
                let over = cap.and_then(|(pid, cap)| {
                    (pid.and_then(|p| crate::servers::status_bytes(p, "VmRSS"))? > cap).then_some(())
                });
                let reason = match (over, refusal) {
                    (Some(()), _) => Some(Stop::RssCap),
                    (None, Some(r)) => Some(Stop::Refused(r)),
                    (None, None) => None,
                };
                if let Some(reason) = reason {
                    stop.store(true, Ordering::Relaxed);
                    why.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(reason);
                }
            }
            Ok::<Vec<String>, String>(ids)
        }));
    }
    let mut all_ids = Vec::new();
    for t in tasks {
        all_ids.extend(t.await.map_err(|e| e.to_string())??);
    }
    if let Some(k) = keep_ids {
        k.extend(all_ids.into_iter().take(KEEP_IDS));
    }
    let stopped = why.lock().unwrap_or_else(|e| e.into_inner()).take();
    let (acked, late) = (counts.0.load(Ordering::Relaxed), counts.1.load(Ordering::Relaxed));
    Ok(Filled { acked, late, secs: t0.elapsed().as_secs_f64(), stopped })
}

/// One size's fill and what its measurements need from it.
struct Step<'a> {
    k: usize,
    pending: usize,
    /// Messages earlier sizes' measurements left on the server.
    left_before: usize,
    f: &'a Filled,
    ids: &'a [String],
    /// Topics with a ready message for the SIGTERM and the SIGKILL restart.
    probes: (Result<String, String>, Result<String, String>),
    /// When the timers of reservations earlier measurements made have all come due.
    quiet_at: Instant,
}

/// One throughput case at size `k`: 0.5 s of it unmeasured, then `sp.measure` measured. Returns the
/// measured run and how many messages both left on the server: every acknowledged produce (due in
/// an hour), and of a pop + ack case the preloaded messages it did not ack.
async fn counted_case(
    run: &Running,
    p: &Params,
    sp: &ScaleParams,
    case: Case,
    k: usize,
) -> (Result<Throughput, String>, usize) {
    // Seq ranges of their own at every size, the warm-up's apart (the Lua queue keys jobs by seq).
    let (rep, warm_rep) = (1024 + k, 2048 + k);
    let preload = if case == Case::PopAckBatch { sp.pop_preload } else { p.preload };
    let warm = Params {
        measure: Duration::from_millis(500),
        warmup: Duration::ZERO,
        preload: (preload / 10).max(1),
        ..p.clone()
    };
    let real = Params { measure: sp.measure, warmup: Duration::ZERO, preload, ..p.clone() };
    let left = |t: &Result<Throughput, String>, preload: usize| match (case, t) {
        (Case::PopAckBatch, Ok(t)) => preload.saturating_sub(t.ok),
        (Case::PopAckBatch, Err(_)) => preload,
        (_, Ok(t)) => t.ok,
        (_, Err(_)) => 0,
    };
    let w = throughput(run, &warm, case, warm_rep).await;
    let t = throughput(run, &real, case, rep).await;
    let n = left(&w, warm.preload) + left(&t, real.preload);
    (t, n)
}

/// Server CPU over `idle` with no requests and nothing due (after a settle of a few seconds, and
/// not before `quiet_at`), % of one core.
async fn idle_cpu(run: &Running, idle: Duration, quiet_at: Instant) -> Result<f64, String> {
    if idle.is_zero() {
        return Err("not measured (--scale-idle-secs 0)".to_string());
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    tokio::time::sleep_until(quiet_at.into()).await;
    let cpu0 = run.cpu_secs().ok_or("cannot read /proc/PID/stat")?;
    let t0 = Instant::now();
    tokio::time::sleep(idle).await;
    let cpu1 = run.cpu_secs().ok_or("cannot read /proc/PID/stat")?;
    Ok((cpu1 - cpu0) / t0.elapsed().as_secs_f64() * 100.0)
}

/// Every measurement at one size, in an order that keeps each from disturbing the next: the
/// throughput cases and the stream, then what only reads (look-ups, metrics, memory, disk), then
/// the catch-up, then the two restarts.
async fn measure(run: &mut Running, p: &Params, sp: &ScaleParams, step: Step<'_>) -> Point {
    let Step { k, pending, left_before, f, ids, probes, quiet_at } = step;
    let idle_cpu_pct = idle_cpu(run, sp.idle, quiet_at).await;
    // Seq ranges of their own at every size (throughput keys its messages by this number).
    let (single, a) = counted_case(run, p, sp, Case::Single, k).await;
    let (batch, b) = counted_case(run, p, sp, Case::BatchN, k).await;
    let (pop_ack, c) = counted_case(run, p, sp, Case::PopAckBatch, k).await;
    let left_by_cases = a + b + c;
    let stream_p =
        Params { e2e_secs: sp.stream_secs, delay_min_ms: 1_000, delay_max_ms: 10_000, ..p.clone() };
    let stream = end_to_end(run, &stream_p, 1_000, k).await;
    let lookup_us = lookups(run, ids, p.seed.wrapping_add(k as u64)).await;
    let steps = steps(run).await;
    let (rss_anon, rss) = (run.server.rss_anon_bytes(), run.server.rss_bytes());
    let disk_alloc = run.server.disk_bytes().0;
    let fill_rate = f.acked as f64 / f.secs.max(1e-9);
    let catchup = match (&f.stopped, sp.catchup) {
        (Some(_), _) => Err("skipped: the system is at its limit".to_string()),
        (None, 0) => Err("not run (--scale-catchup 0)".to_string()),
        // A range of its own at each size: an earlier one's unacked messages keep their seqs.
        (None, n) => catch_up(run, p, sp, n, fill_rate, CATCHUP_SEQ + ((k as u64) << 40)).await,
    };
    let left_by_catchup = catchup.as_ref().map_or(0, |c| c.produced.saturating_sub(c.acked));
    let term = restart(run, p, false, &probes.0).await;
    let kill = restart(run, p, true, &probes.1).await;
    Point {
        target: 0,
        pending,
        held: pending + left_before + left_by_cases,
        left: left_by_cases + left_by_catchup,
        stopped: f.stopped.as_ref().map(|s| s.at(pending)),
        fill_rate,
        idle_cpu_pct,
        single,
        batch,
        pop_ack,
        stream,
        rss_anon_base: None,
        rss_anon,
        rss,
        disk_alloc,
        lookup_us,
        steps,
        term,
        kill,
        catchup,
    }
}

/// Times `GET /v1/messages/{id}` of random ids among the oldest produced (delayd only).
async fn lookups(run: &Running, ids: &[String], seed: u64) -> Result<Vec<i64>, String> {
    if !run.server.system.is_delayd() {
        return Err("delayd only".to_string());
    }
    if ids.is_empty() {
        return Err("no ids were kept".to_string());
    }
    let mut http = HttpConn::new(run.server.port);
    let mut rng = Rng::new(seed, 9_000);
    let mut v = Vec::with_capacity(LOOKUPS);
    for _ in 0..LOOKUPS {
        let id = &ids[rng.range(0, ids.len() as u64 - 1) as usize];
        let t = Instant::now();
        let a = http.call("GET", &format!("/v1/messages/{id}"), None).await?;
        if !(200..300).contains(&a.status) {
            return Err(format!("GET /v1/messages/{id}: {}", a.error()));
        }
        v.push(t.elapsed().as_micros() as i64);
    }
    v.sort_unstable();
    Ok(v)
}

/// delayd's engine-step and index figures, read from `/metrics`.
async fn steps(run: &Running) -> Result<Steps, String> {
    if !run.server.system.is_delayd() {
        return Err("delayd only".to_string());
    }
    let a = HttpConn::new(run.server.port).call("GET", "/metrics", None).await?;
    if !(200..300).contains(&a.status) {
        return Err(format!("GET /metrics: {}", a.error()));
    }
    Ok(parse_metrics(&String::from_utf8_lossy(&a.body)))
}

/// The figures [`Steps`] holds, from a Prometheus text exposition; absent ones stay None.
pub fn parse_metrics(text: &str) -> Steps {
    let mut s = Steps::default();
    let (mut within_10ms, mut count) = (None, None);
    let (mut resize_within_10ms, mut resize_count) = (None, None);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        match name.trim() {
            "delayd_engine_step_seconds_max" => s.max_s = Some(v),
            "delayd_engine_step_cpu_seconds_max" => s.cpu_max_s = Some(v),
            "delayd_engine_step_cpu_seconds_bucket{le=\"0.01\"}" => within_10ms = Some(v as u64),
            "delayd_engine_step_cpu_seconds_count" => count = Some(v as u64),
            "delayd_index_resize_step_seconds_max" => s.resize_max_s = Some(v),
            "delayd_index_resize_step_seconds_bucket{le=\"0.01\"}" => resize_within_10ms = Some(v as u64),
            "delayd_index_resize_step_seconds_count" => resize_count = Some(v as u64),
            "delayd_index_slots" => s.index_slots = Some(v as u64),
            "delayd_index_entries" => s.index_entries = Some(v as u64),
            "delayd_hops_total" => s.hops = Some(v as u64),
            _ => {}
        }
    }
    s.cpu_over_10ms = count.zip(within_10ms).map(|(c, b)| c.saturating_sub(b));
    s.resize_over_10ms = resize_count.zip(resize_within_10ms).map(|(c, b)| c.saturating_sub(b));
    s
}

/// Makes one message ready on a topic of its own for a restart to pop, before the fill: a system
/// that ends its fill at its memory limit refuses it afterwards.
async fn probe(run: &Running, p: &Params, k: usize, kill: bool) -> Result<String, String> {
    let topic = topic(if kill { "probe-kill" } else { "probe-term" });
    let mut q = run.queue(p)?;
    let job = Job { seq: PROBE_SEQ + 2 * k as u64 + u64::from(kill), delay_ms: 0, ttr_ms: 30_000 };
    if q.preload_ready(&topic, &[job]).await? != 1 {
        return Err("the probe message was refused".to_string());
    }
    let until = Instant::now() + Duration::from_secs(30);
    while q.ready_count(&topic).await? < 1 {
        if Instant::now() > until {
            return Err("the probe message was not ready after 30 s".to_string());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(topic)
}

/// Stops the server (SIGTERM, or SIGKILL when `kill`) with the probe ready on `probe`, restarts it
/// on the same data, and times spawn until a pop returns that message.
async fn restart(
    run: &mut Running,
    p: &Params,
    kill: bool,
    probe: &Result<String, String>,
) -> Result<Restart, String> {
    let topic = probe.clone()?;
    let exit_ms = if kill {
        run.server.kill9();
        None
    } else {
        let took = tokio::task::block_in_place(|| run.server.stop_within(Duration::from_secs(600)));
        Some(took.ok_or("did not exit within 600 s of SIGTERM (killed)")?.as_secs_f64() * 1000.0)
    };
    let t0 = Instant::now();
    run.server.spawn()?;
    let mut q = run.queue(p)?;
    loop {
        match q.pop(&topic, 1, 200, 30_000).await {
            Ok(got) if !got.is_empty() => {
                let first_pop_ms = t0.elapsed().as_secs_f64() * 1000.0;
                q.ack(&got[0]).await?;
                return Ok(Restart { exit_ms, first_pop_ms });
            }
            Ok(_) => {}
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
        if run.server.has_exited() {
            return Err(format!(
                "the server exited after its restart; its log says:\n{}",
                run.server.log_tail()
            ));
        }
        if t0.elapsed() > Duration::from_secs(1800) {
            return Err("no pop within 1800 s of the restart".to_string());
        }
    }
}

/// `n` messages produced with one shared due time a little ahead, then popped (batches of up to
/// 1,000) and acked by 16 consumers from that time on; times until all are ready and all acked.
async fn catch_up(
    run: &Running,
    p: &Params,
    sp: &ScaleParams,
    n: usize,
    fill_rate: f64,
    seq_base: u64,
) -> Result<CatchUp, String> {
    let topic = topic("catchup");
    // Far enough ahead that the produce ends before it at the fill's rate, with a margin.
    let due = now_ms() + (n as f64 / fill_rate.max(1.0) * 1500.0) as i64 + 5_000;
    let seq = Arc::new(AtomicU64::new(seq_base));
    let spec = FillSpec { topic: &topic, count: n, due_at_ms: Some(due) };
    let f = fill(run, p, sp, spec, &seq, None).await?;
    if let Some(why) = f.stopped {
        return Err(format!("catch-up produce stopped: {}", why.at(f.acked)));
    }
    tokio::time::sleep(Duration::from_millis((due - now_ms()).max(0) as u64)).await;
    let popped = Arc::new(AtomicUsize::new(0));
    let acked = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut consumers = Vec::new();
    for _ in 0..16 {
        let mut q = run.queue(p)?;
        let (topic, popped, acked, stop) = (topic.clone(), popped.clone(), acked.clone(), stop.clone());
        consumers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Ok(got) = q.pop(&topic, 1000, 200, CATCHUP_TTR_MS).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                popped.fetch_add(got.len(), Ordering::Relaxed);
                // A pop's acks go out ACK_WORKERS at a time, as a worker pool would send them: a
                // thousand at once would each open a connection.
                for chunk in got.chunks(ACK_WORKERS) {
                    let acks: Vec<_> = chunk
                        .iter()
                        .cloned()
                        .map(|d| {
                            let mut q = q.clone();
                            tokio::spawn(async move { q.ack(&d).await })
                        })
                        .collect();
                    for a in acks {
                        if let Ok(Ok(true)) = a.await {
                            acked.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }));
    }
    let out = watch_catch_up(run, p, &topic, f.acked, due, &popped, &acked).await;
    stop.store(true, Ordering::Relaxed);
    for c in consumers {
        let _ = c.await;
    }
    let (ready_secs, acked_secs) = out?;
    Ok(CatchUp {
        produced: f.acked,
        late_produced: f.late,
        ready_secs,
        acked_secs,
        acked: acked.load(Ordering::Relaxed),
    })
}

/// Samples the catch-up every 50 ms until all `n` are acked or the limit (at least 1,000/s) passes:
/// (due until all were ready or popped, due until all were acked), s.
async fn watch_catch_up(
    run: &Running,
    p: &Params,
    topic: &str,
    n: usize,
    due: i64,
    popped: &AtomicUsize,
    acked: &AtomicUsize,
) -> Result<(Option<f64>, Option<f64>), String> {
    let mut q = run.queue(p)?;
    let limit = Duration::from_secs((n as u64 / 1_000).max(120));
    let t0 = Instant::now();
    let since_due = || (now_ms() - due) as f64 / 1000.0;
    let mut ready = None;
    loop {
        if ready.is_none() {
            // Read the pops first: a message popped after the count is read is counted once, not missed.
            let got = popped.load(Ordering::Relaxed);
            if got + q.ready_count(topic).await.unwrap_or(0) >= n {
                ready = Some(since_due());
            }
        }
        if acked.load(Ordering::Relaxed) >= n {
            return Ok((ready.or(Some(since_due())), Some(since_due())));
        }
        if t0.elapsed() > limit {
            return Ok((ready, None));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn log_point(sys: System, pt: &Point) {
    let rate = |t: &Result<Throughput, String>| {
        t.as_ref().map_or("–".to_string(), |t| format!("{:.0}/s", t.rate()))
    };
    let l = pt.stream.as_ref().map(|e| &e.lateness[..]).unwrap_or(&[]);
    eprintln!(
        "  {} at {} pending{}: produce 1×1 {}, batches {}, pop+ack {}; stream p99 {:?} ms (early {}); \
         RssAnon {:?} B, disk {} B; SIGTERM first pop {:?} ms, SIGKILL {:?} ms; catch-up {:?}",
        sys.name(),
        pt.pending,
        pt.stopped.as_ref().map_or(String::new(), |s| format!(" ({s})")),
        rate(&pt.single),
        rate(&pt.batch),
        rate(&pt.pop_ack),
        crate::report::percentile(l, 99.0),
        pt.stream.as_ref().map_or(0, |e| e.early),
        pt.rss_anon,
        pt.disk_alloc,
        pt.term.as_ref().map(|r| r.first_pop_ms.round()),
        pt.kill.as_ref().map(|r| r.first_pop_ms.round()),
        pt.catchup.as_ref().map(|c| (c.produced, c.ready_secs, c.acked_secs)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_decimal_suffixes_and_bad_ones_are_refused() {
        assert_eq!(parse_count("50000"), Ok(50_000));
        assert_eq!(parse_count("20k"), Ok(20_000));
        assert_eq!(parse_count("1M"), Ok(1_000_000));
        assert_eq!(parse_count("1.5M"), Ok(1_500_000));
        assert_eq!(parse_count("100M"), Ok(100_000_000));
        assert_eq!(parse_count("2G"), Ok(2_000_000_000));
        for bad in ["", "M", "1.5", "-3", "1e6", "10MB", "1.0000005M", "ten"] {
            assert!(parse_count(bad).is_err(), "{bad:?} should be refused");
        }
        let sizes = |v: &[&str]| parse_sizes(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            sizes(&["1M", "10M", "30M", "100M"]),
            Ok(vec![1_000_000, 10_000_000, 30_000_000, 100_000_000])
        );
        assert!(sizes(&["10M", "1M"]).is_err(), "the fill is cumulative: sizes must ascend");
        assert!(sizes(&["0", "1M"]).is_err());
        assert!(sizes(&[]).is_err());
    }

    #[test]
    fn day_ranges_parse() {
        assert_eq!(parse_days("1-30"), Ok((1, 30)));
        assert_eq!(parse_days("7-7"), Ok((7, 7)));
        for bad in ["0-30", "30-1", "5", "a-b", "1-"] {
            assert!(parse_days(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn engine_steps_and_index_are_read_from_metrics() {
        let text = "# HELP delayd_engine_step_seconds_max Longest\n\
                    delayd_engine_step_seconds_max 0.012\n\
                    delayd_engine_step_cpu_seconds_max 0.0105\n\
                    delayd_engine_step_cpu_seconds_bucket{le=\"0.005\"} 90\n\
                    delayd_engine_step_cpu_seconds_bucket{le=\"0.01\"} 97\n\
                    delayd_engine_step_cpu_seconds_count 100\n\
                    delayd_index_resize_step_seconds_max 0.0123\n\
                    delayd_index_resize_step_seconds_bucket{le=\"0.01\"} 40\n\
                    delayd_index_resize_step_seconds_count 41\n\
                    delayd_index_slots 2097152\n\
                    delayd_index_entries 1000000\n\
                    delayd_hops_total 42\n";
        let s = parse_metrics(text);
        assert_eq!(s.max_s, Some(0.012));
        assert_eq!(s.cpu_max_s, Some(0.0105));
        assert_eq!(s.cpu_over_10ms, Some(3));
        assert_eq!(s.resize_max_s, Some(0.0123));
        assert_eq!(s.resize_over_10ms, Some(1));
        assert_eq!(s.index_slots, Some(2_097_152));
        assert_eq!(s.index_entries, Some(1_000_000));
        assert_eq!(s.hops, Some(42));
        assert_eq!(parse_metrics("unrelated 1\n"), Steps::default());
    }
}
