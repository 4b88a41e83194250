//! Counters and histograms the engine and the broker update, and `/metrics` exposes.
//!
//! Histograms are recorded in whole units (ms, µs) where they are measured and exposed in
//! seconds, Prometheus' base unit.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Upper bounds (inclusive) of the lateness histogram buckets, in ms.
pub const LATENESS_BUCKETS_MS: [u64; 12] = [0, 1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 5000];
/// Upper bounds of the flush latency histogram buckets, in microseconds.
pub const FLUSH_BUCKETS_US: [u64; 10] = [100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 100_000, 1_000_000];
/// Upper bounds of the engine step histograms, in microseconds: fine around the 10 ms target.
pub const STEP_BUCKETS_US: [u64; 12] =
    [50, 100, 250, 500, 1000, 2000, 4000, 6000, 8000, 10_000, 25_000, 100_000];

/// Values recorded per second in a histogram of milliseconds.
pub const MS_PER_SECOND: u64 = 1000;
/// Values recorded per second in a histogram of microseconds.
pub const US_PER_SECOND: u64 = 1_000_000;

/// A fixed-bucket histogram recorded in a whole unit and exposed in seconds, with the largest
/// value observed.
///
/// The buckets live in a `prometheus::Histogram`, whose reads see count, sum and buckets of one
/// instant even while other threads observe.
#[derive(Debug)]
pub struct Histogram {
    name: &'static str,
    bounds: &'static [u64],
    per_second: u64,
    inner: prometheus::Histogram,
    max: AtomicU64,
}

impl Histogram {
    /// A histogram named `name` (in seconds) with inclusive upper bounds in units of
    /// `1 / per_second` s.
    ///
    /// # Panics
    /// On a name Prometheus refuses or bounds that are not ascending (constants of this crate).
    pub fn new(name: &'static str, help: &str, bounds: &'static [u64], per_second: u64) -> Self {
        let buckets = bounds.iter().map(|b| *b as f64 / per_second as f64).collect();
        let opts = prometheus::HistogramOpts::new(name, help).buckets(buckets);
        let inner = prometheus::Histogram::with_opts(opts).expect("valid histogram name and bounds");
        Histogram { name, bounds, per_second, inner, max: AtomicU64::new(0) }
    }

    /// Records one observation, in the histogram's unit.
    pub fn observe(&self, value: u64) {
        self.inner.observe(value as f64 / self.per_second as f64);
        self.max.fetch_max(value, Ordering::Relaxed);
    }

    /// Largest value observed, in the histogram's unit.
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// Largest value observed, in seconds.
    pub fn max_seconds(&self) -> f64 {
        self.max() as f64 / self.per_second as f64
    }

    /// The metric name, in seconds.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The histogram as Prometheus sees it (values in seconds), for registering.
    pub fn prometheus(&self) -> &prometheus::Histogram {
        &self.inner
    }

    /// Bucket bounds and their non-cumulative counts (the last count is the overflow), the sum
    /// and the count, in the histogram's unit, all read at one instant.
    pub fn snapshot(&self) -> (&'static [u64], Vec<u64>, u64, u64) {
        use prometheus::core::Metric;
        let m = self.inner.metric();
        let h = m.get_histogram();
        let mut counts = Vec::with_capacity(self.bounds.len() + 1);
        let mut below = 0;
        for b in h.get_bucket() {
            counts.push(b.cumulative_count() - below);
            below = b.cumulative_count();
        }
        counts.push(h.get_sample_count() - below);
        let sum = (h.get_sample_sum() * self.per_second as f64).round() as u64;
        (self.bounds, counts, sum, h.get_sample_count())
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
    /// Messages moved to a new due time by an operator.
    pub rescheduled: AtomicU64,
    /// Reservations extended by their consumer.
    pub touched: AtomicU64,
    /// Messages moved to a dead-letter topic.
    pub dead_lettered: AtomicU64,
    /// Dead letters moved back to their topic by an operator.
    pub redriven: AtomicU64,
    /// Reservations that expired and came back.
    pub ttr_expired: AtomicU64,
    /// Level hops performed by schedulers.
    pub hops: AtomicU64,
    /// Commit-log records found damaged outside the recovery scan (their messages cannot be read).
    pub corrupt_records: AtomicU64,
    /// Consume-queue entries found disagreeing with the log, each followed by a repair of its queue.
    pub queue_repairs: AtomicU64,
    /// Pops parked now, waiting for a message to arrive (long-polls).
    pub pops_waiting: AtomicU64,
    /// Requests applied on the thread that read them (the engine was free and idle).
    pub requests_inline: AtomicU64,
    /// Requests handed to the engine thread over its channel.
    pub requests_queued: AtomicU64,
    /// Inline requests that woke the sleeping engine thread for a deadline they moved earlier.
    pub engine_wakeups: AtomicU64,
    /// When the last checkpoint became durable, unix ms (0: none known).
    pub last_checkpoint_ms: AtomicU64,
    /// Time ready messages of a topic waited on its flow control, ms, by (topic, limit).
    pub flow_throttled_ms: std::sync::Mutex<std::collections::BTreeMap<(String, &'static str), u64>>,
    /// Lateness of messages becoming ready: actual ready time minus due time, ms.
    pub lateness_ms: Histogram,
    /// Lateness of first deliveries: the time a pop first reserved a message minus its due time, ms.
    pub delivery_lateness_ms: Histogram,
    /// Duration of commit-log flushes, us.
    pub flush_us: Histogram,
    /// Wall time of each engine step (requests, timers, maintenance, hand-off), us.
    pub engine_step_us: Histogram,
    /// Time the engine thread was on a CPU during each step, us.
    pub engine_step_cpu_us: Histogram,
    /// Wall time a step spent on an id index resize, for the steps that did any, us.
    pub index_resize_step_us: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            produced: AtomicU64::new(0),
            popped: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            nacked: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            rescheduled: AtomicU64::new(0),
            touched: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            redriven: AtomicU64::new(0),
            ttr_expired: AtomicU64::new(0),
            hops: AtomicU64::new(0),
            corrupt_records: AtomicU64::new(0),
            queue_repairs: AtomicU64::new(0),
            pops_waiting: AtomicU64::new(0),
            requests_inline: AtomicU64::new(0),
            requests_queued: AtomicU64::new(0),
            engine_wakeups: AtomicU64::new(0),
            last_checkpoint_ms: AtomicU64::new(0),
            flow_throttled_ms: Default::default(),
            lateness_ms: Histogram::new(
                "delayd_lateness_seconds",
                "Time from a message's due time until it became ready.",
                &LATENESS_BUCKETS_MS,
                MS_PER_SECOND,
            ),
            delivery_lateness_ms: Histogram::new(
                "delayd_delivery_lateness_seconds",
                "Time from a message's due time until a pop or a push first reserved it.",
                &LATENESS_BUCKETS_MS,
                MS_PER_SECOND,
            ),
            flush_us: Histogram::new(
                "delayd_flush_duration_seconds",
                "Duration of commit-log flushes.",
                &FLUSH_BUCKETS_US,
                US_PER_SECOND,
            ),
            engine_step_us: Histogram::new(
                "delayd_engine_step_seconds",
                "Wall time of each engine step: a time-bounded slice of requests, due timers and maintenance, then the hand-off to the flusher.",
                &STEP_BUCKETS_US,
                US_PER_SECOND,
            ),
            engine_step_cpu_us: Histogram::new(
                "delayd_engine_step_cpu_seconds",
                "Time the engine thread spent on a CPU in each of its steps (requests applied inline are not counted).",
                &STEP_BUCKETS_US,
                US_PER_SECOND,
            ),
            index_resize_step_us: Histogram::new(
                "delayd_index_resize_step_seconds",
                "Wall time an engine step (on the engine thread or a request applied inline) spent on an id index resize: copying slots into the new table, or waiting for it. Only steps that did some are counted.",
                &STEP_BUCKETS_US,
                US_PER_SECOND,
            ),
        }
    }
}

impl Metrics {
    /// Counts `ms` more of `topic`'s ready messages waiting on its flow control's `limit`.
    pub fn note_throttled(&self, topic: &str, limit: &'static str, ms: u64) {
        // A poisoned lock only means a panic elsewhere mid-update: the counts are still usable.
        let mut m = self.flow_throttled_ms.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((topic.to_string(), limit)).or_insert(0) += ms;
    }

    /// Every (topic, limit) with the ms its ready messages waited on it.
    pub fn throttled(&self) -> Vec<(String, &'static str, u64)> {
        let m = self.flow_throttled_ms.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().map(|((t, l), ms)| (t.clone(), *l, *ms)).collect()
    }
}

/// Adds one to a counter.
pub fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Counts one in `gauge` for as long as it lives.
#[derive(Debug)]
pub struct GaugeGuard<'a>(&'a AtomicU64);

impl<'a> GaugeGuard<'a> {
    /// Adds one to `gauge` until the guard is dropped.
    pub fn hold(gauge: &'a AtomicU64) -> Self {
        gauge.fetch_add(1, Ordering::Relaxed);
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Upper bounds of the delivery-latency histogram, seconds: a fast local endpoint answers in well
/// under a millisecond, a slow one may use its whole timeout.
const LATENCY_BUCKETS_SECONDS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Push delivery metrics, per topic. Kept here rather than in `push` so the broker, which owns
/// them, does not import the push workers that import the broker.
pub struct PushMetrics {
    pub(crate) attempts: IntCounterVec,
    pub(crate) latency: HistogramVec,
    pub(crate) in_flight: IntGaugeVec,
    pub(crate) in_flight_limit: IntGauge,
    /// Each subscription's recent outcomes, for `GET /v1/topics/{topic}/push`.
    pub(crate) health: crate::push_health::Health,
}

impl PushMetrics {
    /// Empty push metrics.
    pub fn new() -> PushMetrics {
        // The `expect`s cannot fire: names, labels and buckets are constants Prometheus accepts,
        // and the unit tests build them.
        let attempts = IntCounterVec::new(
            Opts::new(
                "delayd_push_attempts_total",
                "Push deliveries tried, by topic and outcome (ok, refused: a non-2xx answer, failed: no answer in time or no connection).",
            ),
            &["topic", "outcome"],
        )
        .expect("valid counter");
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "delayd_push_duration_seconds",
                "Time from sending a push delivery until its answer (or its failure), by topic.",
            )
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
            &["topic"],
        )
        .expect("valid histogram");
        let in_flight = IntGaugeVec::new(
            Opts::new("delayd_push_in_flight", "Push deliveries under way now, by topic."),
            &["topic"],
        )
        .expect("valid gauge");
        let in_flight_limit = IntGauge::new(
            "delayd_push_in_flight_limit",
            "Most push deliveries under way at once over every topic (push_max_in_flight).",
        )
        .expect("valid gauge");
        PushMetrics { attempts, latency, in_flight, in_flight_limit, health: Default::default() }
    }

    /// Adds the families to `reg` for a scrape.
    pub fn register(&self, reg: &Registry) -> prometheus::Result<()> {
        reg.register(Box::new(self.attempts.clone()))?;
        reg.register(Box::new(self.latency.clone()))?;
        reg.register(Box::new(self.in_flight.clone()))?;
        reg.register(Box::new(self.in_flight_limit.clone()))
    }
}

impl Default for PushMetrics {
    fn default() -> Self {
        PushMetrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_back_what_was_observed_in_the_recording_unit() {
        let h = Histogram::new("t_seconds", "t", &LATENESS_BUCKETS_MS, MS_PER_SECOND);
        for v in [0, 3, 5, 99_999] {
            h.observe(v);
        }
        let (bounds, counts, sum, count) = h.snapshot();
        assert_eq!(bounds, &LATENESS_BUCKETS_MS);
        assert_eq!(counts.len(), bounds.len() + 1);
        // 0 → le 0; 3 and 5 → le 5 (inclusive bounds survive the scaling to seconds); 99,999 → overflow.
        assert_eq!(counts[0], 1);
        assert_eq!(counts[3], 2);
        assert_eq!(*counts.last().unwrap(), 1);
        assert_eq!((sum, count), (100_007, 4));
        assert_eq!(h.max(), 99_999);
    }

    #[test]
    fn a_gauge_guard_counts_while_held() {
        let g = AtomicU64::new(0);
        {
            let _a = GaugeGuard::hold(&g);
            let _b = GaugeGuard::hold(&g);
            assert_eq!(g.load(Ordering::Relaxed), 2);
        }
        assert_eq!(g.load(Ordering::Relaxed), 0);
    }
}
