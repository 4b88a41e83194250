//! Scheduler benchmark (harness = false): lateness percentiles at paced rates, catch-up rate after
//! downtime, anonymous memory per pending message, the engine steps of a real broker while the backlog
//! and its id index grow, how long the machine itself pauses a thread that only spins, and bytes
//! written per delivered message.
//!
//! Run: `cargo bench --bench scheduler` (env `PENDING=N` changes the 10,000,000 pending messages of
//! the memory and step figures, `PENDING_ONLY=1` runs only those, `STEPS_ONLY=1` only the steps,
//! `CATCHUP_ONLY=1` only the catch-ups; `QUICK=1` shrinks everything).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, FlushMode, PopRequest, ProduceRequest, When};
use delayd::engine::Engine;
use delayd::metrics::Metrics;
use delayd::schedule::clock::{Clock, ManualClock, SystemClock};

// The server's allocator, so the broker measured here allocates as the server does: with glibc's,
// the engine thread slept on its arena lock (in `realloc`) thousands of times in the steps run.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn quick() -> bool {
    std::env::var("QUICK").is_ok()
}

fn config(dir: &std::path::Path, flush: FlushMode) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.flush = flush;
    c.segment_bytes = 256 << 20;
    c
}

fn req(delay_ms: u64, body: &Bytes) -> ProduceRequest {
    ProduceRequest {
        id: None,
        body: body.clone(),
        when: When::DelayMs(delay_ms),
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// A paced producer (batches every 10 ms) with random 1–3 s delays; one consumer long-polls and
/// acks. Lateness = pop time − due time, in ms.
fn lateness(rate: u64, seconds: u64) -> (usize, i64, i64, i64, i64, usize) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    rt.block_on(async move {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker = Broker::open(config(dir.path(), FlushMode::Sync)).expect("open");
        let total = (rate * seconds) as usize;
        let consumer = {
            let b = broker.clone();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(total);
                let mut acks = Vec::with_capacity(total);
                let stop = Instant::now() + Duration::from_secs(seconds + 10);
                while lat.len() < total && Instant::now() < stop {
                    let got = b
                        .pop(PopRequest {
                            topics: vec!["lat".into()],
                            max: 1000,
                            wait_ms: 1000,
                            ttr_ms: None,
                        })
                        .await
                        .expect("pop");
                    let at = now_ms() as i64;
                    // Ack in the background: a sequential ack per message (one sync flush each)
                    // would make the consumer, not the scheduler, the bottleneck.
                    for d in got {
                        lat.push(at - d.deliver_at_ms as i64);
                        let b = b.clone();
                        acks.push(tokio::spawn(async move { b.ack(&d.receipt).await.expect("ack") }));
                    }
                }
                for a in acks {
                    a.await.expect("ack task");
                }
                lat
            })
        };
        let body = Bytes::from(vec![b'x'; 100]);
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let per_tick = (rate / 100).max(1);
        let start = Instant::now();
        let mut sent = 0;
        let mut tick = 0u64;
        while sent < total {
            let batch: Vec<ProduceRequest> = (0..per_tick.min((total - sent) as u64))
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    req(1000 + seed % 2000, &body)
                })
                .collect();
            sent += batch.len();
            broker.produce_batch("lat", batch).await.expect("produce");
            tick += 1;
            let next = start + Duration::from_millis(tick * 10);
            tokio::time::sleep_until(next.into()).await;
        }
        let mut lat = consumer.await.expect("consumer");
        broker.shutdown().await.expect("shutdown");
        lat.sort_unstable();
        let early = lat.iter().filter(|l| **l < 0).count();
        (
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 0.999),
            *lat.last().unwrap_or(&0),
            early,
        )
    })
}

/// Produces `n` messages due in 1 s, stops the engine for 3 s, reopens and times firing all of them.
fn catch_up(n: usize, delay_ms: u64) -> (usize, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = Bytes::from(vec![b'x'; 100]);
    {
        let (mut e, _) = Engine::open(
            config(dir.path(), FlushMode::Async),
            Arc::new(SystemClock),
            Arc::new(Metrics::default()),
        )
        .expect("open");
        for _ in 0..n {
            e.produce("cu", req(delay_ms, &body)).expect("produce");
        }
        e.close().expect("close");
    }
    std::thread::sleep(Duration::from_secs(3));
    let (mut e, _) = Engine::open(
        config(dir.path(), FlushMode::Async),
        Arc::new(SystemClock),
        Arc::new(Metrics::default()),
    )
    .expect("reopen");
    let started = Instant::now();
    let mut fired = 0;
    loop {
        let f = e.run_due(100_000).expect("run");
        if f == 0 {
            break;
        }
        fired += f;
    }
    e.flush().expect("flush");
    let secs = started.elapsed().as_secs_f64();
    (fired, fired as f64 / secs)
}

fn rss_anon_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// What growing the backlog (and the id index) to `n` pending messages cost.
struct Pending {
    rss_before_kib: u64,
    rss_after_kib: u64,
    anon_per_msg: f64,
    disk: u64,
    /// Longest single produce call.
    longest_call: Duration,
    /// 99.9th percentile of produce calls (upper edge of its 1 µs bucket).
    p999_call: Duration,
    /// Index slots when the run ended.
    index_slots: u64,
}

/// Anonymous memory growth while `n` messages sit pending on the 1 h level (the id index grows
/// from its default size to hold them all), measured on the engine alone so nothing else allocates.
fn pending_memory(n: usize) -> Pending {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(dir.path(), FlushMode::Async);
    cfg.segment_bytes = 1 << 30;
    let (mut e, _) = Engine::open(cfg, Arc::new(SystemClock), Arc::new(Metrics::default())).expect("open");
    let body = Bytes::from(vec![b'x'; 100]);
    // Call times by whole microseconds (the last bucket takes the rest): fixed memory, allocated
    // and touched before the baseline is read.
    let mut calls = vec![0u64; 100_000];
    let before = rss_anon_kib();
    let mut longest_call = Duration::ZERO;
    for i in 0..n {
        let t = Instant::now();
        e.produce("mem", req(3_600_000, &body)).expect("produce");
        let took = t.elapsed();
        let last = calls.len() - 1;
        calls[(took.as_micros() as usize).min(last)] += 1;
        longest_call = longest_call.max(took);
        if i % 1024 == 1023 {
            e.maintain().expect("maintain");
            e.flush().expect("flush");
        }
    }
    e.flush().expect("flush");
    let after = rss_anon_kib();
    let (mut seen, want) = (0, (n as u64 * 999).div_ceil(1000));
    let p999_us = calls.iter().position(|c| {
        seen += c;
        seen >= want
    });
    let disk = e.stats().disk_bytes;
    Pending {
        rss_before_kib: before,
        rss_after_kib: after,
        anon_per_msg: (after.saturating_sub(before) * 1024) as f64 / n as f64,
        disk,
        longest_call,
        p999_call: Duration::from_micros(p999_us.unwrap_or(0) as u64 + 1),
        index_slots: e.index_slots_for_bench(),
    }
}

/// Engine steps of a real broker (its own loop, flusher and checkpoint threads, sync mode) while
/// `producers` clients push `n` messages on the 1 h level in batches of `batch`: the id index
/// grows from its default size to hold them all.
struct Steps {
    n: usize,
    secs: f64,
    /// Steps counted, and how many took over 10 ms of wall time / of CPU time.
    count: u64,
    over_10ms_wall: u64,
    over_10ms_cpu: u64,
    /// Upper bucket edges of the median and 99.9th percentile step, wall and CPU (µs).
    p50: (u64, u64),
    p999: (u64, u64),
    /// Longest step, wall and CPU.
    max: (Duration, Duration),
    /// Steps that did id index resize work, how many of those parts took over 10 ms, the longest.
    resize: (u64, u64, Duration),
}

fn broker_steps(n: usize, producers: usize, batch: usize) -> Steps {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("rt");
    rt.block_on(async move {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = config(dir.path(), FlushMode::Sync);
        cfg.segment_bytes = 1 << 30;
        let broker = Broker::open(cfg).expect("open");
        let body = Bytes::from(vec![b'x'; 100]);
        let started = Instant::now();
        let per = n / producers;
        let tasks: Vec<_> = (0..producers)
            .map(|_| {
                let (b, body) = (broker.clone(), body.clone());
                tokio::spawn(async move {
                    let mut sent = 0;
                    while sent < per {
                        let k = batch.min(per - sent);
                        let reqs = (0..k).map(|_| req(3_600_000, &body)).collect();
                        let out = b.produce_batch("steps", reqs).await.expect("produce");
                        assert!(out.iter().all(|r| r.is_ok()));
                        sent += k;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("producer");
        }
        let secs = started.elapsed().as_secs_f64();
        let m = broker.metrics();
        let over = |h: &delayd::metrics::Histogram| {
            let (bounds, counts, _, _) = h.snapshot();
            // Inclusive upper bounds: a step over 10 ms is in a later bucket or the overflow.
            bounds.iter().zip(&counts).filter(|(b, _)| **b > 10_000).map(|(_, c)| c).sum::<u64>()
                + counts.last().copied().unwrap_or(0)
        };
        let pct = |h: &delayd::metrics::Histogram, q: f64| {
            let (bounds, counts, _, count) = h.snapshot();
            let want = (count as f64 * q).ceil() as u64;
            let mut seen = 0;
            for (b, c) in bounds.iter().zip(&counts) {
                seen += c;
                if seen >= want {
                    return *b;
                }
            }
            u64::MAX
        };
        let (wall, cpu) = (&m.engine_step_us, &m.engine_step_cpu_us);
        let out = Steps {
            n: per * producers,
            secs,
            count: wall.snapshot().3,
            over_10ms_wall: over(wall),
            over_10ms_cpu: over(cpu),
            p50: (pct(wall, 0.5), pct(cpu, 0.5)),
            p999: (pct(wall, 0.999), pct(cpu, 0.999)),
            max: (Duration::from_micros(wall.max()), Duration::from_micros(cpu.max())),
            resize: (
                m.index_resize_step_us.snapshot().3,
                over(&m.index_resize_step_us),
                Duration::from_micros(m.index_resize_step_us.max()),
            ),
        };
        broker.shutdown().await.expect("shutdown");
        out
    })
}

/// Log and queue bytes per message for a 1h59m59s delay with a 1 KiB body, on the manual clock.
fn bytes_per_message(n: usize) -> (f64, f64, usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = Arc::new(ManualClock::at_ms(1_700_000_000_000));
    let (mut e, _) =
        Engine::open(config(dir.path(), FlushMode::Async), clock.clone(), Arc::new(Metrics::default()))
            .expect("open");
    let body = Bytes::from(vec![b'x'; 1024]);
    let log0 = e.log_end_for_bench();
    for _ in 0..n {
        e.produce("b", req(7_199_000, &body)).expect("produce");
    }
    let mut delivered = 0;
    while delivered < n {
        while e.run_due(usize::MAX).expect("run") > 0 {}
        for d in e.pop(&["b".to_string()], 1000, None).expect("pop") {
            e.ack(&d.receipt).expect("ack");
            delivered += 1;
        }
        match e.next_due() {
            Some(d) => clock.set_ms(d.max(clock.now_ms())),
            None if delivered < n => clock.advance_ms(1),
            None => {}
        }
    }
    let log_bytes = (e.log_end_for_bench() - log0) as f64 / n as f64;
    let cq_bytes = e.queue_entries_for_bench() as f64 * 20.0 / n as f64;
    (log_bytes, cq_bytes, e.hops_for_bench() / n)
}

/// What the machine itself does to a thread that only spins: for `secs` on each CPU in turn (one
/// pinned thread, nothing else of ours running), the gaps of 10 ms or more between two consecutive
/// clock reads, as (cpu, that count, longest gap, CPU-clock time of the longest). An engine step cannot
/// be shorter than such a gap when one lands in it; a gap whose CPU-clock time is as long as its
/// wall time is time the host or an interrupt took while the thread was nominally running.
#[allow(unsafe_code)]
fn machine_pauses(secs: u64) -> Vec<(usize, usize, Duration, Duration)> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..cpus)
        .map(|cpu| {
            std::thread::spawn(move || {
                // SAFETY: a zeroed cpu_set_t is the empty set; the calls only read and write it.
                unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                let end = Instant::now() + Duration::from_secs(secs);
                let (mut gaps, mut longest, mut longest_cpu) = (0, Duration::ZERO, Duration::ZERO);
                let (mut last, mut last_cpu) = (Instant::now(), delayd::storage::mmap::thread_cpu_ns());
                while last < end {
                    let (now, now_cpu) = (Instant::now(), delayd::storage::mmap::thread_cpu_ns());
                    let gap = now - last;
                    gaps += usize::from(gap >= Duration::from_millis(10));
                    if gap > longest {
                        longest = gap;
                        longest_cpu = Duration::from_nanos(now_cpu.saturating_sub(last_cpu));
                    }
                    (last, last_cpu) = (now, now_cpu);
                }
                (cpu, gaps, longest, longest_cpu)
            })
            .join()
            .unwrap_or((cpu, 0, Duration::ZERO, Duration::ZERO))
        })
        .collect()
}

fn main() {
    // `RUST_LOG=delayd=debug` shows each slow engine step with its parts.
    if std::env::var("RUST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    // `cargo bench` passes "--bench"; nothing else is expected.
    let q = quick();
    println!("# delayd scheduler benchmark\n");
    let all = ["PENDING_ONLY", "STEPS_ONLY", "CATCHUP_ONLY"].iter().all(|v| std::env::var(v).is_err());
    println!("| workload | messages | p50 ms | p99 ms | p99.9 ms | max ms | early |");
    println!("|---|---|---|---|---|---|---|");
    for rate in [1_000u64, 10_000].into_iter().filter(|_| all) {
        let secs = if q { 1 } else { 10 };
        let (n, p50, p99, p999, max, early) = lateness(rate, secs);
        println!("| lateness at {rate}/s (sync) | {n} | {p50} | {p99} | {p999} | {max} | {early} |");
    }
    let catch_up_only = std::env::var("CATCHUP_ONLY").is_ok();
    if all || catch_up_only {
        let n = if q { 20_000 } else { 500_000 };
        let (fired, rate) = catch_up(n, 1_000);
        println!("\ncatch-up after 3 s downtime: {fired} overdue messages fired at {rate:.0} msgs/s");
        // 1 s then 500 ms: every message's entry read after the downtime is its first hop, due
        // before the message itself (the case the scheduler defers to keep due order).
        let (fired, rate) = catch_up(n, 1_500);
        println!(
            "catch-up after 3 s downtime, chained 1 s + 500 ms: {fired} entries fired at {rate:.0} a second"
        );
    }
    if catch_up_only {
        return;
    }
    let pending = std::env::var("PENDING").ok().and_then(|v| v.parse().ok()).unwrap_or(if q {
        100_000
    } else {
        10_000_000
    });
    // `STEPS_ONLY=1`: only the broker's engine steps, for repeated A/B runs of that figure.
    if std::env::var("STEPS_ONLY").is_err() {
        let p = pending_memory(pending);
        println!(
            "pending capacity: {pending} messages on the 1h level: RssAnon {} KiB -> {} KiB = {:.2} bytes/message anonymous; {:.1} bytes/message on disk",
            p.rss_before_kib,
            p.rss_after_kib,
            p.anon_per_msg,
            p.disk as f64 / pending as f64
        );
        println!(
            "while the id index grew to {} slots: longest produce call {:.2?}, p99.9 {:?}",
            p.index_slots, p.longest_call, p.p999_call
        );
    }
    let producers = 4;
    let st = broker_steps(pending, producers, 1000);
    println!(
        "broker engine steps while {} messages were produced ({producers} clients, batches of 1000, sync, {:.0} msgs/s): {} steps; \
         over 10 ms: {} by wall time, {} by CPU time; median step <= {} us wall / <= {} us CPU; p99.9 <= {} us wall / <= {} us CPU; \
         longest {:.2?} wall, {:.2?} CPU; {} steps resized the id index, {} of them for over 10 ms, longest {:.2?}",
        st.n,
        st.n as f64 / st.secs,
        st.count,
        st.over_10ms_wall,
        st.over_10ms_cpu,
        st.p50.0,
        st.p50.1,
        st.p999.0,
        st.p999.1,
        st.max.0,
        st.max.1,
        st.resize.0,
        st.resize.1,
        st.resize.2,
    );
    let secs = if q { 1 } else { 30 };
    for (cpu, gaps, longest, cpu_time) in machine_pauses(secs) {
        println!(
            "machine pauses: a thread spinning alone on CPU {cpu} for {secs} s saw {gaps} gaps over 10 ms \
             between two clock reads; longest {longest:.2?} wall, {cpu_time:.2?} of it on its CPU clock"
        );
    }
    if !all {
        return;
    }
    let (log_b, cq_b, hops) = bytes_per_message(if q { 100 } else { 2_000 });
    println!(
        "1h59m59s delay, 1 KiB body: {log_b:.0} commit-log bytes + {cq_b:.0} consume-queue bytes per delivered message ({hops} hops each)"
    );
}
