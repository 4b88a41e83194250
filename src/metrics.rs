//! Lock-free counters and histograms the engine updates and `/metrics` renders.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (inclusive) of the lateness histogram buckets, in ms.
pub const LATENESS_BUCKETS_MS: [u64; 12] = [0, 1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 5000];
/// Upper bounds of the flush latency histogram buckets, in microseconds.
pub const FLUSH_BUCKETS_US: [u64; 10] = [100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 100_000, 1_000_000];
/// Upper bounds of the engine step histograms, in microseconds: fine around the 10 ms target.
pub const STEP_BUCKETS_US: [u64; 12] =
    [50, 100, 250, 500, 1000, 2000, 4000, 6000, 8000, 10_000, 25_000, 100_000];

/// A fixed-bucket histogram: counts per bucket plus one overflow, a sum and a count.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [u64],
    buckets: Vec<AtomicU64>,
    sum: AtomicU64,
    count: AtomicU64,
    max: AtomicU64,
}

impl Histogram {
    /// A histogram with the given inclusive upper bounds.
    pub fn new(bounds: &'static [u64]) -> Self {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
            count: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, value: u64) {
        let i = self.bounds.iter().position(|b| value <= *b).unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.max.fetch_max(value, Ordering::Relaxed);
    }

    /// Largest value observed.
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// Bucket bounds and their non-cumulative counts; the last count is the overflow.
    pub fn snapshot(&self) -> (&'static [u64], Vec<u64>, u64, u64) {
        let counts = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        (self.bounds, counts, self.sum.load(Ordering::Relaxed), self.count.load(Ordering::Relaxed))
    }
}

/// Counters shared by the engine (writer) and the HTTP layer (reader).
#[derive(Debug)]
pub struct Metrics {
    /// Messages accepted by produce.
    pub produced: AtomicU64,
    /// Deliveries handed out by pop.
    pub popped: AtomicU64,
    /// Acks accepted.
    pub acked: AtomicU64,
    /// Nacks accepted.
    pub nacked: AtomicU64,
    /// Cancels accepted.
    pub cancelled: AtomicU64,
    /// Messages moved to a dead-letter topic.
    pub dead_lettered: AtomicU64,
    /// Reservations that expired and came back.
    pub ttr_expired: AtomicU64,
    /// Level hops performed by schedulers.
    pub hops: AtomicU64,
    /// Commit-log records found damaged outside the recovery scan (their messages cannot be read).
    pub corrupt_records: AtomicU64,
    /// Consume-queue entries found disagreeing with the log, each followed by a repair of its queue.
    pub queue_repairs: AtomicU64,
    /// Lateness of messages becoming ready: actual ready time minus due time, ms.
    pub lateness_ms: Histogram,
    /// Duration of commit-log flushes, us.
    pub flush_us: Histogram,
    /// Wall time of each engine step (requests, timers, maintenance, hand-off), us.
    pub engine_step_us: Histogram,
    /// Time the engine thread was on a CPU during each step, us.
    pub engine_step_cpu_us: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            produced: AtomicU64::new(0),
            popped: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            nacked: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            ttr_expired: AtomicU64::new(0),
            hops: AtomicU64::new(0),
            corrupt_records: AtomicU64::new(0),
            queue_repairs: AtomicU64::new(0),
            lateness_ms: Histogram::new(&LATENESS_BUCKETS_MS),
            flush_us: Histogram::new(&FLUSH_BUCKETS_US),
            engine_step_us: Histogram::new(&STEP_BUCKETS_US),
            engine_step_cpu_us: Histogram::new(&STEP_BUCKETS_US),
        }
    }
}

/// Adds one to a counter.
pub fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
