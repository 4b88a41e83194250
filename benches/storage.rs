//! Storage micro-benchmarks: raw commit-log appends, engine produces, group-committed sync produces
//! through the broker, and sequential consume-queue reads.
//!
//! Run: `cargo bench --bench storage`. Throughput is reported per element (one append or one read).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use delayd::broker::{Broker, BrokerConfig, FlushMode, ProduceRequest, When};
use delayd::engine::Engine;
use delayd::metrics::Metrics;
use delayd::schedule::clock::SystemClock;
use delayd::storage::commitlog::{CommitLog, RecoveryMode};
use delayd::storage::consumequeue::{ConsumeQueue, Entry};
use delayd::storage::durability::Durability;
use delayd::storage::format::{encode_put, Put, Route};
use delayd::storage::{LogOffset, QueueIndex, UnixMs};

fn put_record(body: &[u8]) -> Vec<u8> {
    encode_put(&Put {
        created_ms: 1,
        deliver_at_ms: 2,
        ttr_ms: 30_000,
        max_attempts: 16,
        request_kind: 1,
        request_value: 1000,
        route: Route::Level { level_ms: 1000, due_ms: 2 },
        id: b"0123456789abcdef0123456789abcdef",
        topic: b"orders",
        backoff_ms: vec![],
        body,
        replaces: false,
    })
    .expect("encodable")
}

fn config(dir: &std::path::Path, flush: FlushMode) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.flush = flush;
    c.segment_bytes = 256 << 20;
    c.index_initial_slots = 1 << 22;
    c
}

fn req(body: &Bytes) -> ProduceRequest {
    ProduceRequest {
        id: None,
        body: body.clone(),
        when: When::DelayMs(3_600_000),
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn commit_log_append(c: &mut Criterion) {
    let mut g = c.benchmark_group("commitlog_append_async");
    g.throughput(Throughput::Elements(1));
    for size in [100usize, 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut log, _) =
            CommitLog::open(dir.path(), 256 << 20, 0, RecoveryMode::Strict, &[], Durability::new(dir.path()))
                .expect("open log");
        let rec = put_record(&vec![7u8; size]);
        g.bench_function(BenchmarkId::from_parameter(format!("{size}B")), |b| {
            b.iter(|| log.append(&rec).expect("append"))
        });
    }
    g.finish();
}

fn engine_produce(c: &mut Criterion) {
    // The whole produce path minus the channel: validate, encode, append, dispatch to queue + index.
    let mut g = c.benchmark_group("engine_produce_async");
    g.throughput(Throughput::Elements(1));
    for size in [100usize, 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut engine, _) = Engine::open(
            config(dir.path(), FlushMode::Async),
            Arc::new(SystemClock),
            Arc::new(Metrics::default()),
        )
        .expect("open engine");
        let body = Bytes::from(vec![b'x'; size]);
        g.bench_function(BenchmarkId::from_parameter(format!("{size}B")), |b| {
            b.iter(|| engine.produce("orders", req(&body)).expect("produce"))
        });
    }
    g.finish();
}

fn broker_produce_sync(c: &mut Criterion) {
    // Concurrent producers through the broker in sync mode: every produce returns only after its
    // msync; group commit lets one msync cover everything that queued up meanwhile.
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mut g = c.benchmark_group("broker_produce_sync");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(8));
    for size in [100usize, 1024] {
        for writers in [1usize, 16, 64] {
            let dir = tempfile::tempdir().expect("tempdir");
            let broker = Broker::open(config(dir.path(), FlushMode::Sync)).expect("open broker");
            let body = Bytes::from(vec![b'x'; size]);
            g.bench_function(BenchmarkId::new(format!("{size}B"), format!("{writers}_writers")), |b| {
                b.iter_custom(|iters| {
                    let per = iters.div_ceil(writers as u64);
                    let broker = broker.clone();
                    let body = body.clone();
                    rt.block_on(async move {
                        let started = Instant::now();
                        let mut tasks = Vec::with_capacity(writers);
                        for _ in 0..writers {
                            let (broker, body) = (broker.clone(), body.clone());
                            tasks.push(tokio::spawn(async move {
                                for _ in 0..per {
                                    broker.produce("orders", req(&body)).await.expect("produce");
                                }
                            }));
                        }
                        for t in tasks {
                            t.await.expect("task");
                        }
                        // Scale to the requested count so per-element figures stay honest.
                        started.elapsed().mul_f64(iters as f64 / (per * writers as u64) as f64)
                    })
                })
            });
            rt.block_on(broker.shutdown()).expect("shutdown");
        }
    }
    g.finish();
}

fn consume_queue_read(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut q =
        ConsumeQueue::open(dir.path(), 1 << 20, None, &Durability::new(dir.path())).expect("open queue");
    const N: u64 = 2_000_000;
    for i in 0..N {
        q.append(Entry { offset: LogOffset::new(i * 100), size: 100, tag: UnixMs::new(i) }).expect("append");
    }
    let mut g = c.benchmark_group("consume_queue_read");
    g.throughput(Throughput::Elements(N));
    g.bench_function("sequential_2M", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for i in 0..N {
                sum = sum.wrapping_add(q.get(QueueIndex::new(i)).map_or(0, |e| e.tag.get()));
            }
            sum
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = commit_log_append, engine_produce, broker_produce_sync, consume_queue_read
}
criterion_main!(benches);
