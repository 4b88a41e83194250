//! Sustained `sync` produce load through the broker, in-process: N concurrent writers, one durable
//! produce at a time each. Prints messages/s, flushes and the average batch per flush.
//!
//! Run: `cargo run --release --example sync_load -- 64` (env `N` = total messages, default 200000).

use std::time::Instant;

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, FlushMode, ProduceRequest, When};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let writers: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(64).max(1);
    let total: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let dir = tempfile::tempdir()?;
    let mut cfg = BrokerConfig::with_defaults(dir.path());
    cfg.flush = FlushMode::Sync;
    cfg.segment_bytes = 256 << 20;
    cfg.index_initial_slots = 1 << 22;
    let broker = Broker::open(cfg)?;
    let per = total / writers;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for _ in 0..writers {
        let broker = broker.clone();
        tasks.push(tokio::spawn(async move {
            let body = Bytes::from(vec![b'x'; 100]);
            for _ in 0..per {
                let req = ProduceRequest {
                    id: None,
                    body: body.clone(),
                    when: When::DelayMs(3_600_000),
                    ttr_ms: None,
                    max_attempts: None,
                    backoff_ms: None,
                };
                broker.produce("load", req).await?;
            }
            Ok::<(), delayd::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let (bounds, counts, sum_us, flushes) = broker.metrics().flush_us.snapshot();
    let hist: Vec<String> =
        bounds.iter().zip(&counts).filter(|(_, c)| **c > 0).map(|(b, c)| format!("<={b}us:{c}")).collect();
    println!("flush time histogram: {} overflow:{}", hist.join(" "), counts.last().copied().unwrap_or(0));
    let n = (per * writers) as f64;
    println!(
        "writers {writers}: {:.0} msgs/s, {flushes} flushes, {:.1} messages per flush, {:.0} us per flush",
        n / secs,
        n / flushes.max(1) as f64,
        sum_us as f64 / flushes.max(1) as f64
    );
    broker.shutdown().await?;
    Ok(())
}
