//! Reclaim's CPU per carried message: live messages (due in 10 days) sit in the oldest segments
//! while a stream of messages is produced, popped and acked behind them, so reclaim carries the
//! live ones forward again and again. The thread CPU time of the maintenance calls (scan, expiry,
//! carry, deletion) is divided by the messages carried.
//!
//! Run: `cargo bench --bench carry` (`BODY=65536` for 64 KiB bodies, default 100; `LIVE=` live
//! messages, default 20,000 at 100 B and 400 at 64 KiB). It uses only the engine API that delayd has
//! had since reclaim, so the same file builds against an older tree for a side-by-side run.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use delayd::broker::{BrokerConfig, ProduceRequest, When};
use delayd::engine::Engine;
use delayd::metrics::Metrics;
use delayd::schedule::clock::SystemClock;
use delayd::storage::mmap::thread_cpu_ns;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn req(body: &Bytes, when: When) -> ProduceRequest {
    ProduceRequest { id: None, body: body.clone(), when, ttr_ms: None, max_attempts: None, backoff_ms: None }
}

fn main() {
    let body_len = env("BODY", 100);
    let live = env("LIVE", if body_len >= 4096 { 400 } else { 20_000 });
    let body = Bytes::from(vec![b'x'; body_len]);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut c = BrokerConfig::with_defaults(dir.path());
    c.segment_bytes = 4 << 20;
    c.done_retention_ms = 1;
    let (mut e, _) = Engine::open(c, Arc::new(SystemClock), Arc::new(Metrics::default())).expect("open");
    let topics = vec!["t".to_string()];
    for _ in 0..live {
        e.produce("t", req(&body, When::DelayMs(10 * 86_400_000))).expect("produce live");
    }
    // The stream: about one segment's worth of records per round.
    let per_round = ((4 << 20) / (body_len + 200)).max(1);
    let (mut cpu_ns, mut rounds) = (0u64, 0);
    let started = Instant::now();
    while e.stats().reclaim.carried < 3 * live as u64 && rounds < 100_000 && started.elapsed().as_secs() < 300
    {
        rounds += 1;
        for _ in 0..per_round {
            e.produce("t", req(&body, When::Now)).expect("produce");
        }
        loop {
            let got = e.pop(&topics, 1000, None).expect("pop");
            if got.is_empty() {
                break;
            }
            for d in got {
                e.ack(&d.receipt).expect("ack");
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
        for _ in 0..100_000 {
            let t = thread_cpu_ns();
            e.maintain().expect("maintain");
            cpu_ns += thread_cpu_ns() - t;
            e.checkpoint().expect("checkpoint");
            if !e.maintenance_due() {
                break;
            }
        }
    }
    let carried = e.stats().reclaim.carried;
    println!(
        "carry body={body_len}B live={live}: carried {carried} in {rounds} rounds, reclaim CPU {:.2} us per carried message ({:.1} ms in all)",
        cpu_ns as f64 / 1000.0 / carried.max(1) as f64,
        cpu_ns as f64 / 1e6
    );
}
