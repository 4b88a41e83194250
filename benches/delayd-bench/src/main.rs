//! delayd-bench: runs delayd and two Redis-backed delay queues side by side on this machine, one after
//! another on fresh servers, and writes Markdown tables and a PNG chart of what it measured.
//!
//! `cargo build --release -p delayd -p delayd-bench && target/release/delayd-bench` runs the default
//! comparison (a few minutes); `--quick` is a seconds-long smoke run. See docs/benchmarks.md.

mod backlog;
mod beanstalk;
mod chart;
mod failover;
mod group;
mod http;
mod pin;
mod push;
mod queue;
mod report;
mod scale;
mod scale_report;
mod servers;
mod soak;
mod systems;
mod workloads;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;

use report::Results;
use servers::Programs;
use soak::SoakParams;
use systems::System;
use workloads::{Case, Params, Running};

/// Command line.
#[derive(Parser, Debug)]
#[command(name = "delayd-bench", about = "Benchmark delayd against Redis-backed delay queues")]
struct Cli {
    /// Tiny sizes for a smoke test (checks the tool works, says nothing about speed).
    #[arg(long)]
    quick: bool,
    /// Directory for results.md and bench.png.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// The delayd binary (default: `delayd` next to this program).
    #[arg(long)]
    delayd_bin: Option<PathBuf>,
    /// The redis-server binary (default: from PATH).
    #[arg(long)]
    redis_server: Option<PathBuf>,
    /// The beanstalkd binary (default: from PATH).
    #[arg(long)]
    beanstalkd: Option<PathBuf>,
    /// Comma-separated systems to run (default all single-server ones): delayd-sync, delayd-async,
    /// redis-lua-always, redis-lua-everysec, redis-plain-always, redis-plain-everysec,
    /// beanstalkd-fsync (or `beanstalkd`: binlog on, fsync after every write); and, only
    /// when named, delayd-cluster3-sync (three nodes) and redis-replica-wait (master + replica).
    #[arg(long, value_delimiter = ',')]
    systems: Vec<String>,
    /// Comma-separated workloads (default produce, e2e, capacity, crash); `soak`, `backlog` and
    /// `failover` run only when named.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Seed for every random delay.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Repeats of each throughput case; each repeat runs every system, in a rotating order.
    #[arg(long)]
    repeats: Option<usize>,
    /// Seconds each throughput case is measured (after its warm-up).
    #[arg(long)]
    measure_secs: Option<f64>,
    /// Seconds of unmeasured warm-up before each throughput case and each end-to-end rate.
    #[arg(long)]
    warmup_secs: Option<f64>,
    /// Messages a consumer reserves per pop in the batched consumer cases, on every system.
    #[arg(long)]
    pop_batch: Option<usize>,
    /// Messages made ready before each pop + ack case (default 20000; 200000 in the scale
    /// workload, whose pop + ack would otherwise be over in about a second; 300 with --quick).
    #[arg(long)]
    preload: Option<usize>,
    /// Do not pin the servers and the benchmark's clients to different CPUs.
    #[arg(long)]
    no_pin: bool,
    /// Repeats of each end-to-end, capacity and crash run (default 1, to keep the run short); capacity
    /// and crash repeats each get a fresh server.
    #[arg(long, alias = "e2e-repeats")]
    slow_repeats: Option<usize>,
    /// Concurrent clients of the batched produce case and the capacity fill.
    #[arg(long)]
    clients: Option<usize>,
    /// Consumers in the end-to-end and crash workloads.
    #[arg(long)]
    consumers: Option<usize>,
    /// Messages per batch.
    #[arg(long)]
    batch: Option<usize>,
    /// Messages pending in the capacity workload (issue 5 names 1000000); in the scale workload,
    /// the comma-separated ascending backlog sizes (default 1M,10M,30M,100M). Suffixes k, M, G.
    #[arg(long, value_delimiter = ',')]
    pending: Vec<String>,
    /// End-to-end producer rates, msgs/s.
    #[arg(long, value_delimiter = ',')]
    rates: Vec<u64>,
    /// Seconds the paced producer runs at each rate.
    #[arg(long)]
    e2e_secs: Option<f64>,
    /// Body size in bytes (default 100; 2048 in the soak workload).
    #[arg(long)]
    body_bytes: Option<usize>,
    /// Period of the Lua design's mover loop, ms.
    #[arg(long, default_value_t = 100)]
    lua_tick_ms: u64,
    /// Extra delayd setting as KEY=VALUE (e.g. DELAYD_SEGMENT_BYTES=64MiB); repeatable. `--quick`
    /// adds DELAYD_SEGMENT_BYTES=16MiB unless given, so a debug build starts in well under a second.
    #[arg(long = "delayd-env", value_name = "KEY=VALUE")]
    delayd_env: Vec<String>,
    /// Parent directory for the servers' temp data dirs (default: the system temp dir).
    #[arg(long)]
    tmp_dir: Option<PathBuf>,
    /// Soak: produce rate, msgs/s (default 600; 200 with --quick).
    #[arg(long)]
    soak_rate: Option<u64>,
    /// Soak: random delay range MIN,MAX in ms (default 1000,3000; 200,1000 with --quick).
    #[arg(long, value_delimiter = ',', value_name = "MIN,MAX")]
    soak_delay_ms: Vec<u64>,
    /// Soak: seconds the load runs per system (default 1800; 6 with --quick).
    #[arg(long)]
    soak_secs: Option<f64>,
    /// Soak: seconds between samples (default 10; 1 with --quick).
    #[arg(long)]
    soak_sample_secs: Option<f64>,
    /// Soak: DELAYD_DONE_RETENTION for the soak servers (default: the --delayd-env value, else 60s).
    #[arg(long)]
    soak_done_retention: Option<String>,
    /// Backlog: delayd binaries to compare as LABEL=PATH, comma-separated (default: the one
    /// delayd, as "delayd"); each round runs them in this order.
    #[arg(long, value_delimiter = ',', value_name = "LABEL=PATH")]
    backlog_bins: Vec<String>,
    /// Backlog: sizes of the backlog, messages due in days (default 100000,1000000).
    #[arg(long, value_delimiter = ',')]
    backlog_pending: Vec<usize>,
    /// Backlog: rounds (each runs every binary once per size).
    #[arg(long, default_value_t = 2)]
    backlog_rounds: usize,
    /// Backlog: seconds of idle whose server CPU is measured.
    #[arg(long, default_value_t = 60.0)]
    backlog_idle_secs: f64,
    /// Backlog: seconds the 1,000 msgs/s stream of 1-2 s delays is produced.
    #[arg(long, default_value_t = 20.0)]
    backlog_stream_secs: f64,
    /// Scale: body bytes of the backlog's messages.
    #[arg(long, default_value_t = 100)]
    scale_body_bytes: usize,
    /// Scale: the backlog's delays in whole days, A-B, uniform.
    #[arg(long, default_value = "1-30")]
    scale_delay_days: String,
    /// Scale: beanstalkd's fill stops once its RSS passes this (e.g. 16GiB).
    #[arg(long, default_value = "16GiB")]
    scale_rss_cap: String,
    /// Scale: Redis maxmemory (with noeviction), as redis-server takes it.
    #[arg(long, default_value = "16gb")]
    scale_redis_maxmemory: String,
    /// Scale: messages falling due at once in the catch-up at each size (0: none). Suffixes k, M.
    #[arg(long, default_value = "10M")]
    scale_catchup: String,
    /// Scale: seconds each throughput case is measured at each size (pop + ack ends sooner once
    /// its preload is all acked: see --preload).
    #[arg(long, default_value_t = 10.0)]
    scale_measure_secs: f64,
    /// Scale: seconds the 1,000 msgs/s stream of 1-10 s delays is produced at each size.
    #[arg(long, default_value_t = 20.0)]
    scale_stream_secs: f64,
    /// Scale: seconds of idle whose server CPU is measured at each size (0: not measured).
    #[arg(long, default_value_t = 60.0)]
    scale_idle_secs: f64,
    /// Failover: leader kills on the cluster (default 10; 2 with --quick).
    #[arg(long)]
    failover_repeats: Option<usize>,
    /// Failover: produce rate, msgs/s, one message per call (default 300; 200 with --quick).
    #[arg(long)]
    failover_rate: Option<u64>,
    /// Failover: random delay range MIN,MAX in ms (default 1000,3000).
    #[arg(long, value_delimiter = ',', value_name = "MIN,MAX")]
    failover_delay_ms: Vec<u64>,
    /// Failover: seconds of load before each kill (default 5; 3.5 with --quick).
    #[arg(long)]
    failover_load_secs: Option<f64>,
    /// Failover: seconds the load goes on after a new leader answers (default 3; 1 with --quick).
    #[arg(long)]
    failover_after_secs: Option<f64>,
}

/// The failover settings from the command line and the quick/full defaults.
fn failover_params(cli: &Cli, p: &Params) -> Result<failover::FailoverParams, String> {
    let (repeats, rate, load, after) = if cli.quick { (2, 200, 3.5, 1.0) } else { (10, 300, 5.0, 3.0) };
    let delay_ms = match cli.failover_delay_ms[..] {
        [] => (1_000, 3_000),
        [min, max] if min <= max => (min, max),
        _ => {
            return Err(format!(
                "--failover-delay-ms wants MIN,MAX with MIN <= MAX, got {:?}",
                cli.failover_delay_ms
            ))
        }
    };
    let fp = failover::FailoverParams {
        repeats: cli.failover_repeats.unwrap_or(repeats).max(1),
        rate: cli.failover_rate.unwrap_or(rate),
        producers: 4,
        delay_ms,
        load_secs: cli.failover_load_secs.unwrap_or(load),
        after_secs: cli.failover_after_secs.unwrap_or(after),
        ttr_ms: 2_000,
        consumers: p.consumers,
    };
    let fine = |x: f64| x.is_finite() && x >= 0.0;
    if fp.rate == 0 || !fine(fp.load_secs) || !fine(fp.after_secs) {
        return Err("--failover-rate must be positive, --failover-*-secs not negative".to_string());
    }
    Ok(fp)
}

fn params(cli: &Cli) -> Params {
    let mut p = if cli.quick {
        Params {
            seed: cli.seed,
            body_bytes: cli.body_bytes.unwrap_or(100),
            repeats: 2,
            measure: Duration::from_millis(200),
            warmup: Duration::from_millis(50),
            batch_size: 50,
            clients: 2,
            pop_batch: 16,
            preload: QUICK_PRELOAD,
            rates: vec![100, 500],
            e2e_secs: 0.3,
            delay_min_ms: 50,
            delay_max_ms: 300,
            e2e_repeats: 1,
            pending: 2_000,
            settle_ms: 300,
            crash_load_secs: 0.5,
            crash_delay_ms: (50, 300),
            crash_ttr_ms: 1_000,
            crash_rate: 500,
            consumers: 4,
            // The waits it bounds end as soon as everything has arrived, so on a quiet machine a long
            // grace costs nothing; a short one failed the smoke test whenever a sync stalled for a
            // second or two (a large file just deleted, another build writing).
            grace_ms: 30_000,
            lua_tick: Duration::from_millis(cli.lua_tick_ms),
        }
    } else {
        Params {
            seed: cli.seed,
            body_bytes: cli.body_bytes.unwrap_or(100),
            repeats: 3,
            measure: Duration::from_millis(1_000),
            warmup: Duration::from_millis(200),
            batch_size: 100,
            clients: 8,
            pop_batch: 16,
            preload: 20_000,
            rates: vec![1_000, 10_000],
            e2e_secs: 3.0,
            delay_min_ms: 1_000,
            delay_max_ms: 3_000,
            e2e_repeats: 1,
            pending: 200_000,
            settle_ms: 1_500,
            crash_load_secs: 3.0,
            crash_delay_ms: (200, 1_000),
            crash_ttr_ms: 2_000,
            crash_rate: 2_000,
            consumers: 16,
            grace_ms: 5_000,
            lua_tick: Duration::from_millis(cli.lua_tick_ms),
        }
    };
    let secs = |v: f64| Duration::from_secs_f64(if v.is_finite() { v.max(0.0) } else { 0.0 });
    if let Some(v) = cli.measure_secs {
        p.measure = secs(v).max(Duration::from_millis(50));
    }
    if let Some(v) = cli.warmup_secs {
        p.warmup = secs(v);
    }
    if let Some(v) = cli.pop_batch {
        p.pop_batch = v.clamp(1, 1000);
    }
    if let Some(v) = cli.preload {
        p.preload = v.max(1);
    }
    if let Some(v) = cli.repeats {
        p.repeats = v.max(1);
    }
    if let Some(v) = cli.slow_repeats {
        p.e2e_repeats = v.max(1);
    }
    if let Some(v) = cli.clients {
        p.clients = v.max(1);
    }
    if let Some(v) = cli.consumers {
        p.consumers = v.max(1);
    }
    if let Some(v) = cli.batch {
        p.batch_size = v.clamp(1, 1000);
    }
    // A list is the scale workload's; the capacity workload takes the last size.
    if let Some(v) = cli.pending.last().and_then(|v| scale::parse_count(v).ok()) {
        p.pending = v.max(1);
    }
    if !cli.rates.is_empty() {
        p.rates = cli.rates.clone();
    }
    if let Some(v) = cli.e2e_secs {
        p.e2e_secs = v.max(0.1);
    }
    p
}

/// The soak settings from the command line, the quick/full defaults and the delayd settings in effect.
fn soak_params(cli: &Cli, p: &Params, delayd_env: &[(String, String)]) -> Result<SoakParams, String> {
    let env = |key: &str| delayd_env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let (rate, delay, secs, sample) =
        if cli.quick { (200, (200, 1_000), 6.0, 1.0) } else { (600, (1_000, 3_000), 1800.0, 10.0) };
    let delay_ms = match cli.soak_delay_ms[..] {
        [] => delay,
        [min, max] if min <= max => (min, max),
        _ => {
            return Err(format!("--soak-delay-ms wants MIN,MAX with MIN <= MAX, got {:?}", cli.soak_delay_ms))
        }
    };
    let segment_bytes = match env("DELAYD_SEGMENT_BYTES") {
        Some(v) => delayd::config::units::parse_size(&v).map_err(|e| format!("DELAYD_SEGMENT_BYTES: {e}"))?,
        None => delayd::config::Config::default().segment_bytes,
    };
    let sp = SoakParams {
        rate: cli.soak_rate.unwrap_or(rate),
        body_bytes: cli.body_bytes.unwrap_or(2048),
        delay_ms,
        secs: cli.soak_secs.unwrap_or(secs),
        sample_secs: cli.soak_sample_secs.unwrap_or(sample),
        done_retention: cli
            .soak_done_retention
            .clone()
            .or_else(|| env("DELAYD_DONE_RETENTION"))
            .unwrap_or_else(|| "60s".to_string()),
        segment_bytes,
        grace_ms: p.grace_ms,
    };
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if sp.rate == 0 || !positive(sp.secs) || !positive(sp.sample_secs) {
        return Err("--soak-rate, --soak-secs and --soak-sample-secs must be positive".to_string());
    }
    Ok(sp)
}

/// delayd refuses to start when `max_body_bytes` + 4 KiB exceeds `segment_bytes`, so a small
/// `DELAYD_SEGMENT_BYTES` (4MiB, as a soak uses) without `DELAYD_MAX_BODY_BYTES` would fail at the
/// default 4 MiB limit. The limit only validates requests, so lower it to a quarter segment; the report
/// header lists it with the other settings.
fn fit_body_limit(delayd_env: &mut Vec<(String, String)>) -> Result<(), String> {
    let given = |key: &str| delayd_env.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let Some(seg) = given("DELAYD_SEGMENT_BYTES") else { return Ok(()) };
    let seg = delayd::config::units::parse_size(&seg).map_err(|e| format!("DELAYD_SEGMENT_BYTES: {e}"))?;
    let default_limit = delayd::config::Config::default().max_body_bytes;
    if given("DELAYD_MAX_BODY_BYTES").is_none() && default_limit + 4096 > seg {
        delayd_env.push(("DELAYD_MAX_BODY_BYTES".to_string(), (seg / 4).to_string()));
    }
    Ok(())
}

/// UTC date and time from the system clock, without a date crate.
fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The 1-minute load average: other work on the machine skews every figure, so the report shows it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string())
}

fn machine() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string());
    let mem = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|r| r.trim().trim_end_matches("kB").trim().to_string()))
        .and_then(|k| k.parse::<u64>().ok())
        .map(|k| format!("{:.1} GiB RAM", k as f64 / 1048576.0))
        .unwrap_or_default();
    // Every online CPU, not available_parallelism: this process is pinned to some of them.
    let cores = read("/proc/cpuinfo").lines().filter(|l| l.starts_with("processor")).count();
    format!(
        "{} ({cores} cores, {cpu}, {mem}, Linux {})",
        read("/proc/sys/kernel/hostname").trim(),
        read("/proc/sys/kernel/osrelease").trim()
    )
}

fn selected<T: Clone>(names: &[String], all: &[(String, T)]) -> Result<Vec<T>, String> {
    if names.is_empty() {
        return Ok(all.iter().map(|(_, t)| t.clone()).collect());
    }
    names
        .iter()
        .map(|n| {
            all.iter().find(|(k, _)| k == n.trim()).map(|(_, t)| t.clone()).ok_or_else(|| {
                format!(
                    "unknown name {n:?}; known: {}",
                    all.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", ")
                )
            })
        })
        .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before the runtime starts its threads, so they all inherit the client CPUs.
    let pinning = pin::pin(cli.no_pin);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("delayd-bench: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!("delayd-bench: {}", pinning.note);
    let outcome = runtime.block_on(run(cli, pinning));
    servers::finish_cleanup();
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("delayd-bench: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli, pinning: pin::Pinning) -> Result<bool, String> {
    let run_started = std::time::Instant::now();
    let p = params(&cli);
    let mut all_systems: Vec<(String, System)> = System::all().into_iter().map(|s| (s.name(), s)).collect();
    all_systems.push(("beanstalkd".to_string(), System::BEANSTALKD));
    let mut systems =
        if cli.systems.is_empty() { System::default_set() } else { selected(&cli.systems, &all_systems)? };
    let all_workloads: Vec<(String, &str)> =
        ["produce", "e2e", "capacity", "crash", "push", "soak", "backlog", "failover", "scale"]
            .iter()
            .map(|w| (w.to_string(), *w))
            .collect();
    let mut workloads = selected(&cli.workloads, &all_workloads)?;
    // The soak takes an hour at its defaults, the backlog compares builds of delayd: only when
    // asked for.
    if cli.workloads.is_empty() {
        workloads.retain(|w| *w != "soak" && *w != "backlog" && *w != "failover" && *w != "scale");
    }
    for alone in ["backlog", "scale"] {
        if workloads.contains(&alone) && workloads.len() > 1 {
            return Err(format!("the {alone} workload runs alone: name only it in --workloads"));
        }
    }
    // Soak compares reclaim on and off on delayd alone: delayd-sync unless --systems names others.
    let soak_systems: Vec<System> = if cli.systems.is_empty() {
        vec![System::single(systems::Engine::Delayd, true)]
    } else {
        systems.iter().copied().filter(|s| s.is_delayd()).collect()
    };
    if workloads.contains(&"soak") && soak_systems.is_empty() {
        return Err("the soak workload runs on delayd systems only; --systems names none".to_string());
    }
    // Failover kills a cluster's leader: delayd-cluster3-sync unless --systems names other clusters.
    let failover_systems: Vec<System> = if cli.systems.is_empty() {
        vec![System::CLUSTER3_SYNC]
    } else {
        systems.iter().copied().filter(|s| s.replicated && s.is_delayd()).collect()
    };
    if workloads.contains(&"failover") && failover_systems.is_empty() {
        return Err("the failover workload runs on a delayd cluster only; --systems names none".to_string());
    }

    let delayd = match &cli.delayd_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find my own path: {e}"))?
            .with_file_name("delayd"),
    };
    if !delayd.is_file() {
        return Err(format!(
            "no delayd binary at {}: build it with `cargo build --release --bin delayd` (or pass --delayd-bin)",
            delayd.display()
        ));
    }
    let mut r = Results::default();
    let redis = cli.redis_server.clone().or_else(|| servers::which("redis-server"));
    let redis = match redis {
        Some(p) if p.is_file() => Some(p),
        other => {
            let msg = format!(
                "redis-server not found{}: the Redis-backed queues were NOT run. Install it with \
                 `apt-get install redis-server` (Debian/Ubuntu) and run again; running delayd alone.",
                other.map(|p| format!(" at {}", p.display())).unwrap_or_default()
            );
            eprintln!("delayd-bench: WARNING: {msg}");
            r.notes.push(msg);
            systems.retain(|s| !s.needs_redis());
            None
        }
    };
    let beanstalkd = cli.beanstalkd.clone().or_else(|| servers::which("beanstalkd")).filter(|p| p.is_file());
    if beanstalkd.is_none() && systems.contains(&System::BEANSTALKD) {
        let msg = "beanstalkd not found: it was NOT run. Install it with `apt-get install beanstalkd` \
                   (Debian/Ubuntu) or pass --beanstalkd PATH."
            .to_string();
        eprintln!("delayd-bench: WARNING: {msg}");
        r.notes.push(msg);
        systems.retain(|s| *s != System::BEANSTALKD);
    }
    let mut delayd_env = Vec::new();
    for kv in &cli.delayd_env {
        let (k, v) = kv.split_once('=').ok_or_else(|| format!("--delayd-env wants KEY=VALUE, got {kv:?}"))?;
        delayd_env.push((k.to_string(), v.to_string()));
    }
    if cli.quick && !delayd_env.iter().any(|(k, _)| k == "DELAYD_SEGMENT_BYTES") {
        delayd_env.push(("DELAYD_SEGMENT_BYTES".to_string(), "16MiB".to_string()));
    }
    fit_body_limit(&mut delayd_env)?;
    let progs = Programs {
        delayd: delayd.clone(),
        redis: redis.clone(),
        beanstalkd: beanstalkd.clone(),
        tmp_base: cli.tmp_dir.clone(),
        delayd_env: delayd_env.clone(),
        server_cpus: pinning.server.clone(),
    };
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("cannot create {}: {e}", cli.out.display()))?;
    if workloads.contains(&"backlog") {
        return run_backlog(&cli, &p, &progs, &pinning).await;
    }
    if workloads.contains(&"scale") {
        let sys = if cli.systems.is_empty() { scale_default_systems(&progs) } else { systems.clone() };
        return run_scale(&cli, &p, &progs, &pinning, sys).await;
    }
    let results_path = cli.out.join("results.md");
    let chart_path = cli.out.join("bench.png");
    let soak_chart_path = cli.out.join("soak.png");
    if workloads.contains(&"soak") {
        r.soak_params = Some(soak_params(&cli, &p, &delayd_env)?);
    }
    if workloads.contains(&"failover") {
        r.failover_params = Some(failover_params(&cli, &p)?);
    }

    let profile =
        if delayd.components().any(|c| c.as_os_str() == "release") { "release" } else { "not release" };
    if profile != "release" {
        r.notes.push(format!(
            "delayd binary {} is not a release build: its figures are not representative (fine for --quick).",
            delayd.display()
        ));
    }
    r.header = run_header();
    r.header.extend([
        format!(
            "delayd: {} ({profile}), defaults{}",
            delayd.display(),
            delayd_env.iter().map(|(k, v)| format!(" + {k}={v}")).collect::<String>()
        ),
        format!("redis-server: {}", redis.as_deref().map(servers::redis_version).unwrap_or_else(|| "not installed".into())),
        format!(
            "beanstalkd: {} (binlog on, `-f 0`: fsync after every write; delays, TTRs and reserve \
             timeouts are whole seconds, so its delays are rounded up and its lateness is measured \
             from that rounded-up due time)",
            beanstalkd.as_deref().map(servers::beanstalkd_version).unwrap_or_else(|| "not installed".into())
        ),
        format!("CPU pinning: {}", pinning.note),
        format!(
            "Order: each repeat runs every system on a fresh server, in an order rotated by one system per \
             repeat; a server starts only once the previous one has exited, its data dir is removed and its \
             port is free. Each throughput case and each end-to-end rate is preceded by {} s of the same \
             load, unmeasured.",
            p.warmup.as_secs_f64()
        ),
        format!(
            "Sizes: seed {}, body {} B; throughput: each case measured for {} s, {} repeats, batches of {}, {} \
             clients in the batched case, {} messages made ready before each pop + ack case, consumers \
             reserve up to {} per pop in the batched cases on every system; {} repeat(s) of end-to-end, \
             capacity and crash; end-to-end {} s at {:?} msgs/s with delays {}–{} ms, {} consumers; {} \
             pending; crash after {} s load at {} msgs/s with delays {}–{} ms and TTR {} ms; Lua mover \
             tick {} ms{}",
            p.seed,
            p.body_bytes,
            p.measure.as_secs_f64(),
            p.repeats,
            p.batch_size,
            p.clients,
            p.preload,
            p.pop_batch,
            p.e2e_repeats,
            p.e2e_secs,
            p.rates,
            p.delay_min_ms,
            p.delay_max_ms,
            p.consumers,
            p.pending,
            p.crash_load_secs,
            p.crash_rate,
            p.crash_delay_ms.0,
            p.crash_delay_ms.1,
            p.crash_ttr_ms,
            p.lua_tick.as_millis(),
            if cli.quick { " (--quick)" } else { "" }
        ),
        format!(
            "Chart colours: {}",
            systems.iter().map(|s| format!("{} {}", s.name(), chart::color(*s).1)).collect::<Vec<_>>().join(", ")
        ),
    ]);
    if let Some(sp) = &r.soak_params {
        r.header.push(format!(
            "Soak: {} msgs/s, body {} B, delays {}–{} ms, {} s per run, a sample every {} s, \
             DELAYD_DONE_RETENTION={}, segment {}, on {} with reclaim on and off",
            sp.rate,
            sp.body_bytes,
            sp.delay_ms.0,
            sp.delay_ms.1,
            sp.secs,
            sp.sample_secs,
            sp.done_retention,
            soak::size(sp.segment_bytes),
            soak_systems.iter().map(System::name).collect::<Vec<_>>().join(", ")
        ));
    }

    let mut all_ok = true;
    let mut failure = |r: &mut Results, what: &str, sys: System, e: &str| {
        eprintln!("delayd-bench: {what} on {} FAILED: {e}", sys.name());
        r.notes.push(format!("{what} on {} failed: {}", sys.name(), e.lines().next().unwrap_or("")));
        all_ok = false;
    };
    for w in &workloads {
        if *w == "push" {
            // delayd delivers to a webhook itself; the Redis designs have no such thing.
            for sys in systems.iter().copied().filter(|s| s.is_delayd()) {
                eprintln!("delayd-bench: push on {} ...", sys.name());
                let outcome = match Running::start(sys, &progs, &p).await {
                    Ok(run) => {
                        // A smoke run only checks that each run works: 10,000 a second through a
                        // debug build took most of `--quick`'s time.
                        let (burst, rates, secs): (usize, &[u64], f64) = if cli.quick {
                            (500, &[200, 1_000], 1.0)
                        } else {
                            (20_000, &[1_000, 10_000], 10.0)
                        };
                        let o = push::run(&run.server, burst, rates, secs, p.body_bytes).await;
                        let stopped = run.shutdown().await;
                        o.and_then(|o| stopped.map(|_| o))
                    }
                    Err(e) => Err(e),
                };
                match &outcome {
                    Ok(runs) => {
                        for x in runs {
                            eprintln!(
                                "  {}: {} delivered, {:.0}/s, lateness p99 {:?} ms",
                                if x.rate == 0 { "burst".to_string() } else { format!("{} msgs/s", x.rate) },
                                x.delivered,
                                x.per_sec,
                                report::percentile(&x.lateness, 99.0)
                            );
                        }
                    }
                    Err(e) => failure(&mut r, "push", sys, e),
                }
                r.push.push((sys.name(), outcome));
            }
            continue;
        }
        if let ("failover", Some(fp)) = (*w, r.failover_params.clone()) {
            for &sys in &failover_systems {
                let outcome = run_failover(sys, &progs, &p, &fp).await;
                if let Err(e) = &outcome {
                    failure(&mut r, "failover", sys, e);
                }
                r.failover.push((sys.name(), outcome));
            }
            std::fs::write(&results_path, report::markdown(&r, &p))
                .map_err(|e| format!("cannot write {}: {e}", results_path.display()))?;
            continue;
        }
        if let ("soak", Some(sp)) = (*w, r.soak_params.clone()) {
            for &sys in &soak_systems {
                // Reclaim on and off run side by side, so both see the same machine noise and
                // their lateness compares fairly.
                let (on, off) = (soak::label(sys, true), soak::label(sys, false));
                eprintln!("delayd-bench: soak on {on} and {off} side by side ({} s) ...", sp.secs);
                let (a, b) = tokio::join!(
                    soak::run(sys, true, &progs, &p, &sp),
                    soak::run(sys, false, &progs, &p, &sp)
                );
                for (label, o) in [(on, a), (off, b)] {
                    if let Err(e) = &o {
                        failure(&mut r, &format!("soak ({label})"), sys, e);
                    }
                    r.soak.push((label, o));
                }
                // Written after each system: a soak takes long, and an interrupted one keeps its data.
                std::fs::write(&results_path, report::markdown(&r, &p))
                    .map_err(|e| format!("cannot write {}: {e}", results_path.display()))?;
            }
            continue;
        }
        let repeats = if *w == "produce" { p.repeats } else { p.e2e_repeats };
        for rep in 0..repeats {
            // Rotating the order spreads drifts of the machine (other load, disk state) over every
            // system instead of always hitting the same one.
            let mut order = systems.clone();
            let n = order.len().max(1);
            order.rotate_left(rep % n);
            for &sys in &order {
                eprintln!("delayd-bench: {w} on {} (repeat {}/{repeats}) ...", sys.name(), rep + 1);
                let started = std::time::Instant::now();
                let run = match Running::start(sys, &progs, &p).await {
                    Ok(run) => run,
                    Err(e) => {
                        failure(&mut r, w, sys, &e);
                        r.record(w, sys, Err(e));
                        continue;
                    }
                };
                let mut run = Some(run);
                let outcome = workload(w, run.as_mut(), &p, rep).await;
                if let Err(e) = &outcome {
                    failure(&mut r, w, sys, e);
                }
                r.record(w, sys, outcome);
                if let Some(run) = run {
                    match run.shutdown().await {
                        Ok(stop) => eprintln!(
                            "  ({:.1} s in all, {:.1} s to stop)",
                            started.elapsed().as_secs_f64(),
                            stop.as_secs_f64()
                        ),
                        Err(e) => failure(&mut r, &format!("{w} (cleanup)"), sys, &e),
                    }
                }
            }
        }
        // Written after every workload so an interrupted run keeps what it measured.
        std::fs::write(&results_path, report::markdown(&r, &p))
            .map_err(|e| format!("cannot write {}: {e}", results_path.display()))?;
    }
    r.header.push(format!(
        "1-minute load average at end: {}; whole run took {:.0} s",
        loadavg(),
        run_started.elapsed().as_secs_f64()
    ));
    std::fs::write(&results_path, report::markdown(&r, &p))
        .map_err(|e| format!("cannot write {}: {e}", results_path.display()))?;
    match chart::draw(&chart_path, &r, &p.rates, &systems) {
        Ok(true) => {}
        Ok(false) => eprintln!(
            "delayd-bench: no TTF font found, so the chart has no text (colours are listed in results.md); \
             `apt-get install fonts-dejavu-core` adds labels"
        ),
        Err(e) => {
            eprintln!("delayd-bench: {e}");
            all_ok = false;
        }
    }
    println!("{}", report::targets(&r, &p.rates).join("\n"));
    let t27 = report::targets27(&r, &p.rates);
    if !t27.is_empty() {
        println!("issue 27:\n{}", t27.join("\n"));
    }
    if let Some(sp) = &r.soak_params {
        if let Err(e) = soak::draw(&soak_chart_path, &r.soak) {
            eprintln!("delayd-bench: {e}");
            all_ok = false;
        }
        println!("{}", soak::targets(&r.soak, sp).join("\n"));
    }
    println!("results: {}", results_path.display());
    println!("chart:   {}", chart_path.display());
    if r.soak_params.is_some() {
        println!("soak chart: {}", soak_chart_path.display());
    }
    Ok(all_ok)
}

/// The failover workload on one fresh cluster: every kill, then the cluster stopped.
async fn run_failover(
    sys: System,
    progs: &Programs,
    p: &Params,
    fp: &failover::FailoverParams,
) -> Result<Vec<failover::FailoverRun>, String> {
    eprintln!("delayd-bench: failover on {} ({} leader kills) ...", sys.name(), fp.repeats);
    let mut run = Running::start(sys, progs, p).await?;
    let o = failover::run(&mut run, p, fp).await;
    let stopped = run.shutdown().await;
    o.and_then(|o| stopped.map(|_| o))
}

/// The backlog workload: every size, round and binary, then `backlog.md` in the output directory.
async fn run_backlog(
    cli: &Cli,
    p: &Params,
    progs: &Programs,
    pinning: &pin::Pinning,
) -> Result<bool, String> {
    let started = std::time::Instant::now();
    let mut bins = Vec::new();
    for b in &cli.backlog_bins {
        let (label, path) =
            b.split_once('=').ok_or_else(|| format!("--backlog-bins wants LABEL=PATH, got {b:?}"))?;
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(format!("--backlog-bins: no binary at {}", path.display()));
        }
        bins.push((label.to_string(), path));
    }
    if bins.is_empty() {
        bins.push(("delayd".to_string(), progs.delayd.clone()));
    }
    let secs = |v: f64, what: &str| {
        (v.is_finite() && v > 0.0)
            .then(|| Duration::from_secs_f64(v))
            .ok_or(format!("{what} must be positive"))
    };
    let bp = backlog::BacklogParams {
        bins,
        pending: if cli.backlog_pending.is_empty() {
            vec![100_000, 1_000_000]
        } else {
            cli.backlog_pending.clone()
        },
        rounds: cli.backlog_rounds.max(1),
        idle: secs(cli.backlog_idle_secs, "--backlog-idle-secs")?,
        rate: 1_000,
        delay_ms: (1_000, 2_000),
        stream_secs: secs(cli.backlog_stream_secs, "--backlog-stream-secs")?.as_secs_f64(),
    };
    let mut header = run_header();
    header.extend([
        format!(
            "delayd settings: defaults + DELAYD_FLUSH=sync{}",
            progs.delayd_env.iter().map(|(k, v)| format!(" + {k}={v}")).collect::<String>()
        ),
        format!("CPU pinning: {}", pinning.note),
    ]);
    let path = cli.out.join("backlog.md");
    let outcome = backlog::run(progs, p, &bp).await;
    let (runs, ok) = match outcome {
        Ok(runs) => (runs, true),
        Err(e) => {
            eprintln!("delayd-bench: backlog FAILED: {e}");
            header.push(format!("FAILED: {e}"));
            (Vec::new(), false)
        }
    };
    header.push(format!(
        "1-minute load average at end: {}; whole run took {:.0} s",
        loadavg(),
        started.elapsed().as_secs_f64()
    ));
    let md = backlog::markdown(&header, &runs, &bp);
    std::fs::write(&path, &md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("{md}");
    println!("results: {}", path.display());
    Ok(ok)
}

/// The scale workload's systems when `--systems` names none: delayd-sync and its durable peers
/// that are installed.
/// The first lines of every results file: date, machine, load, command.
fn run_header() -> Vec<String> {
    vec![
        format!("Date: {}", utc_now()),
        format!("Machine: {}", machine()),
        format!("1-minute load average at start: {}", loadavg()),
        format!("Command: `{}`", std::env::args().collect::<Vec<_>>().join(" ")),
    ]
}

fn scale_default_systems(progs: &Programs) -> Vec<System> {
    let mut v = vec![System::single(systems::Engine::Delayd, true)];
    if progs.redis.is_some() {
        v.push(System::single(systems::Engine::RedisLua, true));
    }
    if progs.beanstalkd.is_some() {
        v.push(System::BEANSTALKD);
    }
    v
}

/// Messages made ready before the scale workload's pop + ack case: at about 20,000 acks a second
/// the case then lasts around ten seconds, long enough to take in a checkpoint or two (each one
/// fdatasyncs the id index), where 20,000 were over in one.
const SCALE_POP_PRELOAD: usize = 200_000;

/// Messages made ready before a pop + ack case with `--quick`, the scale workload's included: a
/// smoke run checks that the case works, and 200,000 made ready took most of its time.
const QUICK_PRELOAD: usize = 300;

/// The scale settings from the command line, checked.
fn scale_params(cli: &Cli, systems: Vec<System>) -> Result<scale::ScaleParams, String> {
    let sizes = if cli.pending.is_empty() {
        vec![1_000_000, 10_000_000, 30_000_000, 100_000_000]
    } else {
        scale::parse_sizes(&cli.pending)?
    };
    if let Some(s) = systems.iter().find(|s| s.replicated) {
        return Err(format!("the scale workload runs single servers; --systems names {}", s.name()));
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if !positive(cli.scale_measure_secs) || !positive(cli.scale_stream_secs) || cli.scale_body_bytes == 0 {
        return Err(
            "--scale-measure-secs, --scale-stream-secs and --scale-body-bytes must be positive".into()
        );
    }
    if !(cli.scale_idle_secs.is_finite() && cli.scale_idle_secs >= 0.0) {
        return Err("--scale-idle-secs must not be negative".into());
    }
    Ok(scale::ScaleParams {
        sizes,
        body_bytes: cli.scale_body_bytes,
        delay_days: scale::parse_days(&cli.scale_delay_days)?,
        systems,
        rss_cap: delayd::config::units::parse_size(&cli.scale_rss_cap)
            .map_err(|e| format!("--scale-rss-cap: {e}"))?,
        redis_maxmemory: cli.scale_redis_maxmemory.clone(),
        catchup: scale::parse_count(&cli.scale_catchup).map_err(|e| format!("--scale-catchup: {e}"))?,
        measure: Duration::from_secs_f64(cli.scale_measure_secs),
        stream_secs: cli.scale_stream_secs,
        idle: Duration::from_secs_f64(cli.scale_idle_secs),
        pop_preload: cli.preload.unwrap_or(if cli.quick { QUICK_PRELOAD } else { SCALE_POP_PRELOAD }).max(1),
    })
}

/// The scale workload: every system over every size, then `scale.md` and `scale.png`.
async fn run_scale(
    cli: &Cli,
    p: &Params,
    progs: &Programs,
    pinning: &pin::Pinning,
    systems: Vec<System>,
) -> Result<bool, String> {
    let started = std::time::Instant::now();
    let sp = scale_params(cli, systems)?;
    let mut header = run_header();
    header.extend([
        format!(
            "delayd: {}, DELAYD_FLUSH=sync{}",
            progs.delayd.display(),
            progs.delayd_env.iter().map(|(k, v)| format!(" + {k}={v}")).collect::<String>()
        ),
        format!(
            "redis-server: {}",
            progs.redis.as_deref().map(servers::redis_version).unwrap_or("not installed".into())
        ),
        format!(
            "beanstalkd: {}",
            progs.beanstalkd.as_deref().map(servers::beanstalkd_version).unwrap_or("not installed".into())
        ),
        format!("CPU pinning: {}", pinning.note),
    ]);
    let md_path = cli.out.join("scale.md");
    let save = |runs: &[scale::SystemRun]| {
        let md = scale_report::markdown(&header, runs, &sp, p);
        if let Err(e) = std::fs::write(&md_path, md) {
            eprintln!("delayd-bench: cannot write {}: {e}", md_path.display());
        }
    };
    let runs = scale::run(progs, p, &sp, &save).await;
    header.push(format!(
        "1-minute load average at end: {}; whole run took {:.0} s",
        loadavg(),
        started.elapsed().as_secs_f64()
    ));
    let md = scale_report::markdown(&header, &runs, &sp, p);
    std::fs::write(&md_path, &md).map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
    let chart_path = cli.out.join("scale.png");
    if let Err(e) = scale_report::draw(&chart_path, &runs) {
        eprintln!("delayd-bench: {e}");
        return Ok(false);
    }
    println!("{md}");
    println!("results: {}\nchart:   {}", md_path.display(), chart_path.display());
    Ok(runs.iter().all(|r| r.error.is_none()))
}

/// One repeat of a comparison workload on a fresh server: every throughput case, every end-to-end
/// rate, one capacity fill or one crash.
async fn workload(w: &str, run: Option<&mut Running>, p: &Params, rep: usize) -> Result<report::Rep, String> {
    let Some(run) = run else { return Err("no server".to_string()) };
    match w {
        "produce" => {
            let mut v = Vec::new();
            for case in Case::ALL {
                let t = workloads::throughput(run, p, case, rep).await?;
                eprintln!("  {}: {:.0} msgs/s ({} failed)", case.label(p), t.rate(), t.failed);
                v.push(t);
            }
            Ok(report::Rep::Throughput(v))
        }
        "e2e" => {
            let mut v = Vec::new();
            for &rate in &p.rates {
                workloads::warm_up_e2e(run, p, rate).await?;
                let e = workloads::end_to_end(run, p, rate, rep).await?;
                eprintln!(
                    "  {rate} msgs/s: {} produced, {} delivered, {} missing, {} early, p99 {:?} ms",
                    e.produced,
                    e.delivered,
                    e.missing,
                    e.early,
                    report::percentile(&e.lateness, 99.0)
                );
                v.push(e);
            }
            Ok(report::Rep::E2e(v))
        }
        "capacity" => {
            let c = workloads::capacity(run, p).await?;
            eprintln!(
                "  {} pending: RssAnon +{} B, disk {} B",
                c.pending,
                c.rss_after.saturating_sub(c.rss_before),
                c.disk_alloc
            );
            Ok(report::Rep::Capacity(c))
        }
        _ => {
            let c = workloads::crash(run, p).await?;
            eprintln!(
                "  {} acked, {} lost, {} twice, {} after ack, first pop after {:?} ms",
                c.acked, c.lost, c.twice, c.after_ack, c.first_pop_ms
            );
            Ok(report::Rep::Crash(c))
        }
    }
}
