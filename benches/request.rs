//! Per-request cost inside the process (no HTTP): one request at a time applied on the caller's
//! thread (the default) against the same request handed to the engine thread, side by side in
//! one run, for produce, pop + ack and a long poll's wake-up, in both flush modes.
//!
//! Run: `cargo bench --bench request` (`QUICK=1` shrinks it). Prints medians and p99 per call, and
//! calls per second; each case alternates the two paths over `ROUNDS` rounds so both meet the
//! same machine noise, and reports the median of the rounds.

use std::time::Instant;

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, FlushMode, PopRequest, ProduceRequest, When};

fn quick() -> bool {
    std::env::var("QUICK").is_ok()
}

fn open(dir: &std::path::Path, flush: FlushMode, inline: bool) -> Broker {
    let mut c = BrokerConfig::with_defaults(dir);
    c.flush = flush;
    c.segment_bytes = 256 << 20;
    c.index_initial_slots = 1 << 20;
    c.inline_requests = inline;
    Broker::open(c).expect("open broker")
}

fn req(when: When) -> ProduceRequest {
    ProduceRequest {
        id: None,
        body: Bytes::from_static(&[b'x'; 100]),
        when,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn pop_one(topic: &str, wait_ms: u64) -> PopRequest {
    PopRequest { topics: vec![topic.to_string()], max: 1, wait_ms, ttr_ms: None }
}

/// Per-call latencies of one round, in microseconds.
type Round = Vec<f64>;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    percentile(&v, 0.5)
}

/// One client producing one message at a time (delay 1 h, so nothing falls due).
async fn produce_round(b: &Broker, n: usize) -> Round {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        b.produce("p", req(When::DelayMs(3_600_000))).await.expect("produce");
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    out
}

/// One consumer popping one ready message and acking it, per call pair (the time of both).
async fn pop_ack_round(b: &Broker, n: usize) -> Round {
    for _ in 0..n {
        b.produce("q", req(When::Now)).await.expect("produce");
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let got = b.pop(pop_one("q", 0)).await.expect("pop");
        let d = got.first().expect("a ready message");
        b.ack(&d.receipt).await.expect("ack");
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    out
}

/// A consumer long-polls an empty topic; the producer produces one ready message; the time from
/// just before the produce to the consumer holding it.
async fn wakeup_round(b: &Broker, n: usize) -> Round {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let consumer = tokio::spawn({
            let b = b.clone();
            async move {
                let got = b.pop(pop_one("w", 10_000)).await.expect("pop");
                let at = Instant::now();
                for d in &got {
                    b.ack(&d.receipt).await.expect("ack");
                }
                (got.len(), at)
            }
        });
        // Let the consumer park first: only its wake-up is timed.
        while b.metrics().pops_waiting.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        let t = Instant::now();
        b.produce("w", req(When::Now)).await.expect("produce");
        let (got, at) = consumer.await.expect("consumer");
        assert_eq!(got, 1, "the long poll got its message");
        out.push(at.duration_since(t).as_secs_f64() * 1e6);
    }
    out
}

#[derive(Clone, Copy)]
enum Case {
    Produce,
    PopAck,
    Wakeup,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Produce => "produce, 1 client",
            Case::PopAck => "pop + ack, 1 consumer",
            Case::Wakeup => "long-poll wake-up",
        }
    }
}

async fn round(case: Case, b: &Broker, n: usize) -> Round {
    match case {
        Case::Produce => produce_round(b, n).await,
        Case::PopAck => pop_ack_round(b, n).await,
        Case::Wakeup => wakeup_round(b, n).await,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (rounds, n) = if quick() { (2, 200) } else { (5, 4_000) };
    println!("delayd per-request cost in process: median of {rounds} alternating rounds of {n} calls");
    println!();
    println!("| case | flush | path | p50 µs | p99 µs | calls/s | inline share |");
    println!("|---|---|---|---|---|---|---|");
    for case in [Case::Produce, Case::PopAck, Case::Wakeup] {
        for flush in [FlushMode::Async, FlushMode::Sync] {
            let dirs = [tempfile::tempdir().expect("tmp"), tempfile::tempdir().expect("tmp")];
            let brokers = [open(dirs[0].path(), flush, true), open(dirs[1].path(), flush, false)];
            // Warm-up: page in the files and the code paths.
            for b in &brokers {
                round(case, b, n / 4).await;
            }
            let before: Vec<(u64, u64)> = brokers.iter().map(counts).collect();
            let mut stats: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
            for r in 0..rounds {
                // Alternate which path goes first.
                for k in [r % 2, 1 - r % 2] {
                    let t = Instant::now();
                    let mut lat = round(case, &brokers[k], n).await;
                    let rate = n as f64 / t.elapsed().as_secs_f64();
                    lat.sort_by(|a, b| a.total_cmp(b));
                    stats[k].push((percentile(&lat, 0.5), percentile(&lat, 0.99), rate));
                }
            }
            for (k, path) in ["inline", "hand-off"].iter().enumerate() {
                let (i0, q0) = before[k];
                let (i1, q1) = counts(&brokers[k]);
                let share = (i1 - i0) as f64 / ((i1 - i0) + (q1 - q0)).max(1) as f64;
                let s = &stats[k];
                println!(
                    "| {} | {:?} | {path} | {:.0} | {:.0} | {:.0} | {:.0}% |",
                    case.name(),
                    flush,
                    median(s.iter().map(|x| x.0).collect()),
                    median(s.iter().map(|x| x.1).collect()),
                    median(s.iter().map(|x| x.2).collect()),
                    share * 100.0
                );
            }
            for b in brokers {
                b.shutdown().await.expect("shutdown");
            }
        }
    }
}

fn counts(b: &Broker) -> (u64, u64) {
    let m = b.metrics();
    (
        m.requests_inline.load(std::sync::atomic::Ordering::Relaxed),
        m.requests_queued.load(std::sync::atomic::Ordering::Relaxed),
    )
}
