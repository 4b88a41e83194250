//! The backlog workload: what a large backlog of messages pending for days costs everything else.
//! For each backlog size and each delayd binary (interleaved, so both see the same machine drift):
//! a fresh server is filled with messages due in three days, left idle while its CPU time is read
//! from /proc, then a steady stream of short delays is produced, popped and acked, and its
//! lateness measured. Only delayd runs it; it is meant to compare two builds of it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::queue::Job;
use crate::report::percentile;
use crate::servers::Programs;
use crate::systems::{Engine, System};
use crate::workloads::{end_to_end, process_cpu_secs, topic, E2e, Params, Running};

/// Due time of the backlog: far enough that nothing of it fires during a run.
const BACKLOG_DELAY_MS: u64 = 3 * 86_400_000;
/// Pause after the fill (index resize, checkpoint, first look at the oldest segment).
const SETTLE: Duration = Duration::from_secs(5);

/// The workload's knobs.
#[derive(Debug, Clone)]
pub struct BacklogParams {
    /// Binaries compared, with their labels.
    pub bins: Vec<(String, PathBuf)>,
    /// Backlog sizes.
    pub pending: Vec<usize>,
    /// Rounds: each runs every binary once per size, in order.
    pub rounds: usize,
    /// Idle time whose CPU use is measured.
    pub idle: Duration,
    /// Stream: rate, msgs/s.
    pub rate: u64,
    /// Stream: delay range, ms.
    pub delay_ms: (u64, u64),
    /// Stream: how long the producer runs, s.
    pub stream_secs: f64,
}

/// One run: one binary, one backlog size.
#[derive(Debug, Clone)]
pub struct BacklogRun {
    /// Binary label.
    pub label: String,
    /// Backlog size asked for.
    pub pending: usize,
    /// Round number, from 1.
    pub round: usize,
    /// Messages the fill got acknowledged.
    pub filled: usize,
    /// Fill rate, msgs/s.
    pub fill_rate: f64,
    /// Server CPU while idle, percent of one core.
    pub idle_cpu_pct: f64,
    /// The stream's outcome.
    pub stream: E2e,
}

/// Fills `run` with `pending` messages due in days, from `p.clients` clients in batches of 1000.
async fn fill(run: &Running, p: &Params, pending: usize) -> Result<usize, String> {
    let topic = topic("backlog");
    let per = pending.div_ceil(p.clients);
    let mut tasks = Vec::new();
    for w in 0..p.clients {
        let mut q = run.queue(p)?;
        let topic = topic.clone();
        let count = per.min(pending.saturating_sub(w * per));
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut sent) = (0usize, 0usize);
            while sent < count {
                let n = 1000.min(count - sent);
                let jobs: Vec<Job> = (0..n)
                    .map(|i| Job {
                        seq: (1 << 50) + ((w as u64) << 32) + (sent + i) as u64,
                        delay_ms: BACKLOG_DELAY_MS,
                        ttr_ms: 30_000,
                    })
                    .collect();
                ok += q.produce(&topic, &jobs).await?.iter().filter(|b| **b).count();
                sent += n;
            }
            Ok::<usize, String>(ok)
        }));
    }
    let mut filled = 0;
    for t in tasks {
        filled += t.await.map_err(|e| e.to_string())??;
    }
    Ok(filled)
}

async fn one(
    label: &str,
    bin: &Path,
    pending: usize,
    round: usize,
    progs: &Programs,
    p: &Params,
    bp: &BacklogParams,
) -> Result<BacklogRun, String> {
    let progs = Programs { delayd: bin.to_path_buf(), ..progs.clone() };
    let run = Running::start(System::single(Engine::Delayd, true), &progs, p).await?;
    let outcome = async {
        let t0 = Instant::now();
        let filled = fill(&run, p, pending).await?;
        let fill_rate = filled as f64 / t0.elapsed().as_secs_f64().max(1e-9);
        tokio::time::sleep(SETTLE).await;
        let pid = run.server.pid().ok_or("server not running")?;
        let cpu0 = process_cpu_secs(pid).ok_or("cannot read /proc/PID/stat")?;
        let t1 = Instant::now();
        tokio::time::sleep(bp.idle).await;
        let cpu1 = process_cpu_secs(pid).ok_or("cannot read /proc/PID/stat")?;
        let idle_cpu_pct = (cpu1 - cpu0) / t1.elapsed().as_secs_f64() * 100.0;
        let sp = Params {
            e2e_secs: bp.stream_secs,
            delay_min_ms: bp.delay_ms.0,
            delay_max_ms: bp.delay_ms.1,
            ..p.clone()
        };
        let stream = end_to_end(&run, &sp, bp.rate, round).await?;
        Ok::<BacklogRun, String>(BacklogRun {
            label: label.to_string(),
            pending,
            round,
            filled,
            fill_rate,
            idle_cpu_pct,
            stream,
        })
    }
    .await;
    let stopped = run.shutdown().await;
    let r = outcome?;
    stopped?;
    Ok(r)
}

/// Runs every size, every round, every binary in turn; stops at the first failure.
pub async fn run(progs: &Programs, p: &Params, bp: &BacklogParams) -> Result<Vec<BacklogRun>, String> {
    let mut out = Vec::new();
    for &pending in &bp.pending {
        for round in 1..=bp.rounds {
            for (label, bin) in &bp.bins {
                eprintln!(
                    "delayd-bench: backlog {pending} pending, {label} (round {round}/{}) ...",
                    bp.rounds
                );
                let r = one(label, bin, pending, round, progs, p, bp).await?;
                let l = &r.stream.lateness;
                eprintln!(
                    "  filled {} at {:.0}/s; idle CPU {:.2} %; stream {} delivered, {} missing, {} early, \
                     lateness p50 {:?} p99 {:?} max {:?} ms",
                    r.filled,
                    r.fill_rate,
                    r.idle_cpu_pct,
                    r.stream.delivered,
                    r.stream.missing,
                    r.stream.early,
                    percentile(l, 50.0),
                    percentile(l, 99.0),
                    l.last()
                );
                out.push(r);
            }
        }
    }
    Ok(out)
}

fn ms(v: Option<i64>) -> String {
    v.map_or("–".to_string(), |x| x.to_string())
}

/// The Markdown table of every run, then the median of the rounds per size and binary.
pub fn markdown(header: &[String], runs: &[BacklogRun], bp: &BacklogParams) -> String {
    let mut s = String::from("# Backlog: idle CPU and stream lateness with messages pending for days\n\n");
    for h in header {
        s.push_str(&format!("- {h}\n"));
    }
    s.push_str(&format!(
        "- Binaries: {}\n- Each run: a fresh server (DELAYD_FLUSH=sync), filled with the backlog (100-byte \
         bodies, due in 3 days, batches of 1000), {} s to settle, {} s idle (server CPU from \
         /proc/PID/stat utime+stime, no requests), then {} msgs/s for {} s with delays {}–{} ms, popped \
         and acked by 16 consumers; lateness = pop return time − deliver_at_ms, ms. Order: for each \
         size, round by round, the binaries in the order listed.\n\n",
        bp.bins.iter().map(|(l, b)| format!("{l} = {}", b.display())).collect::<Vec<_>>().join(", "),
        SETTLE.as_secs(),
        bp.idle.as_secs(),
        bp.rate,
        bp.stream_secs,
        bp.delay_ms.0,
        bp.delay_ms.1,
    ));
    s.push_str(
        "| pending | binary | round | fill msgs/s | idle CPU % of a core | delivered | missing | early | \
         p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let l = &r.stream.lateness;
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.2} | {} | {} | {} | {} | {} | {} |\n",
            r.pending,
            r.label,
            r.round,
            r.fill_rate,
            r.idle_cpu_pct,
            r.stream.delivered,
            r.stream.missing,
            r.stream.early,
            ms(percentile(l, 50.0)),
            ms(percentile(l, 99.0)),
            ms(l.last().copied())
        ));
    }
    s.push_str("\nMedian of the rounds:\n\n| pending | binary | idle CPU % | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|\n");
    for &pending in &bp.pending {
        for (label, _) in &bp.bins {
            let of: Vec<&BacklogRun> =
                runs.iter().filter(|r| r.pending == pending && &r.label == label).collect();
            if of.is_empty() {
                continue;
            }
            let med = |mut v: Vec<f64>| -> f64 {
                v.sort_by(f64::total_cmp);
                let n = v.len();
                if n == 0 {
                    f64::NAN
                } else if n % 2 == 1 {
                    v[n / 2]
                } else {
                    (v[n / 2 - 1] + v[n / 2]) / 2.0
                }
            };
            let q = |f: &dyn Fn(&BacklogRun) -> Option<i64>| {
                med(of.iter().filter_map(|r| f(r)).map(|x| x as f64).collect::<Vec<_>>())
            };
            s.push_str(&format!(
                "| {pending} | {label} | {:.2} | {:.1} | {:.1} | {:.1} |\n",
                med(of.iter().map(|r| r.idle_cpu_pct).collect()),
                q(&|r| percentile(&r.stream.lateness, 50.0)),
                q(&|r| percentile(&r.stream.lateness, 99.0)),
                q(&|r| r.stream.lateness.last().copied()),
            ));
        }
    }
    s
}
