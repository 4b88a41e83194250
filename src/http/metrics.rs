//! `GET /metrics`: the Prometheus text format (0.0.4), written by the `prometheus` crate.
//!
//! A scrape gathers one registry made for it: the broker's counters and histograms, gauges of a
//! stats snapshot taken on the engine thread, the HTTP request metrics the [`track`] middleware
//! keeps, process metrics from `/proc/self`, and `delayd_build_info`. Names use base units
//! (`_seconds`, `_bytes`, `_timestamp_seconds`) so that `promtool check metrics` passes.

use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus::{
    CounterVec, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

use super::error::ApiError;
use super::process::{self, ProcessStats};
use super::AppState;
use crate::message::{Stats, TopicStats};
use crate::metrics::{Histogram, Metrics};
use crate::units::fmt_ms;

/// The content type Prometheus expects for the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The `route` label of a request no route matched: one value, so that a scanner trying paths
/// cannot create a series per path.
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// Upper bounds of the HTTP latency buckets, seconds: from sub-millisecond reads to long-polls
/// that wait up to `max_wait`.
const HTTP_BUCKETS_SECONDS: [f64; 16] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Requests served, by route template, method and status: kept for the life of the server.
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
}

impl HttpMetrics {
    /// Empty request metrics.
    pub fn new() -> HttpMetrics {
        // The `expect`s cannot fire: names, labels and buckets are constants Prometheus accepts,
        // and every unit test of this module builds them.
        let labels = ["route", "method", "status"];
        let requests = IntCounterVec::new(
            Opts::new(
                "delayd_http_requests_total",
                "HTTP requests answered, by route template, method and status.",
            ),
            &labels,
        )
        .expect("valid counter");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "delayd_http_request_duration_seconds",
                "Time from a request's arrival until its response was ready (a long-poll's wait included), by route template, method and status.",
            )
            .buckets(HTTP_BUCKETS_SECONDS.to_vec()),
            &labels,
        )
        .expect("valid histogram");
        HttpMetrics { requests, duration }
    }

    fn observe(&self, route: &str, method: &str, status: StatusCode, seconds: f64) {
        let labels = [route, method, status.as_str()];
        self.requests.with_label_values(&labels).inc();
        self.duration.with_label_values(&labels).observe(seconds);
    }

    fn register(&self, reg: &Registry) -> prometheus::Result<()> {
        reg.register(Box::new(self.requests.clone()))?;
        reg.register(Box::new(self.duration.clone()))
    }
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics::new()
    }
}

/// Middleware: counts and times every request by the route template it matched (never the raw
/// path, whose ids and topics would make a series each).
pub(crate) async fn track(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = method_label(req.method());
    let started = Instant::now();
    let resp = next.run(req).await;
    let route = route.as_ref().map_or(UNMATCHED_ROUTE, MatchedPath::as_str);
    st.http_metrics().observe(route, method, resp.status(), started.elapsed().as_secs_f64());
    resp
}

/// The standard methods by name; any other (HTTP allows extension tokens) is `other`, so a
/// client cannot create series with made-up methods.
fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// `GET /metrics`
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    operation_id = "metrics",
    summary = "Prometheus text exposition (format 0.0.4)",
    responses((status = 200, description = "The metrics", content_type = "text/plain; version=0.0.4; charset=utf-8", body = String))
)]
pub(crate) async fn handler(State(st): State<AppState>) -> Result<Response, ApiError> {
    let stats = st.broker().stats().await?;
    // Reading /proc is file I/O (one entry per open file for the fd count): off the runtime.
    let dir = st.broker().config().data_dir.clone();
    let (proc, free) = tokio::task::spawn_blocking(move || (process::read(), process::free_bytes(&dir)))
        .await
        .unwrap_or_default();
    let text = scrape(st.broker().metrics(), &stats, st.http_metrics(), &proc).and_then(|text| {
        // Push families come last, from their own registry (they have their own owner).
        let reg = Registry::new();
        st.broker().push_metrics().register(&reg)?;
        if let Some(free) = free {
            gauge(
                &reg,
                "delayd_data_disk_free_bytes",
                "Bytes free for delayd on the file system of the data directory.",
                free as f64,
            )?;
        }
        if let Some(c) = st.cluster() {
            cluster_metrics(&reg, c)?;
        }
        Ok(text + &encode(&reg)?)
    });
    let text = text.map_err(|e| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("cannot encode metrics: {e}"))
    })?;
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response())
}

/// A cluster node's families: its role and indexes, elections and leader changes seen, each
/// follower's lag (on the leader), and how long replies waited for a majority.
fn cluster_metrics(reg: &Registry, c: &crate::cluster::ClusterState) -> prometheus::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let (term, commit, last, applied) = c.indexes();
    let leading = c.role() == crate::cluster::Role::Leader;
    gauge(
        reg,
        "delayd_cluster_is_leader",
        "1 on the node that leads the cluster, else 0.",
        f64::from(u8::from(leading)),
    )?;
    gauge(reg, "delayd_cluster_term", "The current consensus term.", term as f64)?;
    gauge(
        reg,
        "delayd_cluster_commit_index",
        "Highest entry known to be durable on a majority.",
        commit as f64,
    )?;
    gauge(reg, "delayd_cluster_last_index", "Highest entry in this node's consensus log.", last as f64)?;
    gauge(reg, "delayd_cluster_applied_index", "Highest entry in this node's store.", applied as f64)?;
    counter(
        reg,
        "delayd_cluster_elections_total",
        "Elections this node stood in.",
        c.elections.load(Relaxed),
    )?;
    counter(
        reg,
        "delayd_cluster_leader_changes_total",
        "Changes of leader this node saw.",
        c.leader_changes.load(Relaxed),
    )?;
    let lags = c.lags();
    let entries = lags.iter().filter_map(|(id, e, _)| e.map(|e| (id.to_string(), e as f64)));
    gauge_by(
        reg,
        "delayd_cluster_replication_lag_entries",
        "Entries each follower lacks (on the leader).",
        "node",
        entries,
    )?;
    let bytes = lags.iter().filter_map(|(id, _, b)| b.map(|b| (id.to_string(), b as f64)));
    gauge_by(
        reg,
        "delayd_cluster_replication_lag_bytes",
        "Log bytes each follower lacks (on the leader).",
        "node",
        bytes,
    )?;
    histogram_with_max(reg, &c.quorum_wait_us)
}

/// The whole exposition: the broker's families, HTTP requests, the process and build info.
pub fn scrape(
    m: &Metrics,
    stats: &Stats,
    http: &HttpMetrics,
    proc: &ProcessStats,
) -> prometheus::Result<String> {
    let reg = broker_registry(m, stats)?;
    http.register(&reg)?;
    register_process(&reg, proc)?;
    let info = GaugeVec::new(
        Opts::new("delayd_build_info", "Always 1; the labels say which build of delayd is running."),
        &["version"],
    )?;
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1.0);
    reg.register(Box::new(info))?;
    encode(&reg)
}

/// The broker's families alone: its counters and histograms, and gauges of `stats`.
pub fn render(m: &Metrics, stats: &Stats) -> prometheus::Result<String> {
    encode(&broker_registry(m, stats)?)
}

fn encode(reg: &Registry) -> prometheus::Result<String> {
    prometheus::TextEncoder::new().encode_to_string(&reg.gather())
}

fn counter(reg: &Registry, name: &str, help: &str, value: u64) -> prometheus::Result<()> {
    let c = IntCounter::new(name, help)?;
    c.inc_by(value);
    reg.register(Box::new(c))
}

fn gauge(reg: &Registry, name: &str, help: &str, value: f64) -> prometheus::Result<()> {
    let g = Gauge::new(name, help)?;
    g.set(value);
    reg.register(Box::new(g))
}

fn gauge_by(
    reg: &Registry,
    name: &str,
    help: &str,
    label: &str,
    values: impl IntoIterator<Item = (String, f64)>,
) -> prometheus::Result<()> {
    let g = GaugeVec::new(Opts::new(name, help), &[label])?;
    for (l, v) in values {
        g.with_label_values(&[l.as_str()]).set(v);
    }
    reg.register(Box::new(g))
}

/// A histogram with a gauge of its largest observation since the start.
fn histogram_with_max(reg: &Registry, h: &Histogram) -> prometheus::Result<()> {
    reg.register(Box::new(h.prometheus().clone()))?;
    let name = h.name();
    gauge(
        reg,
        &format!("{name}_max"),
        &format!("Longest observation of {name} since the start."),
        h.max_seconds(),
    )
}

/// A per-topic gauge: name, help text and how to read it.
type TopicGauge = (&'static str, &'static str, fn(&TopicStats) -> u64);

fn broker_registry(m: &Metrics, stats: &Stats) -> prometheus::Result<Registry> {
    let reg = Registry::new();
    request_metrics(&reg, m)?;
    level_and_topic_gauges(&reg, stats)?;
    reg.register(Box::new(m.lateness_ms.prometheus().clone()))?;
    reg.register(Box::new(m.delivery_lateness_ms.prometheus().clone()))?;
    reg.register(Box::new(m.flush_us.prometheus().clone()))?;
    histogram_with_max(&reg, &m.engine_step_us)?;
    histogram_with_max(&reg, &m.engine_step_cpu_us)?;
    histogram_with_max(&reg, &m.index_resize_step_us)?;
    reclaim_counters(&reg, stats)?;
    store_gauges(&reg, m, stats)?;
    flow_throttled(&reg, m)?;
    Ok(reg)
}

/// `delayd_topic_throttled_seconds_total{topic,limit}`: time ready messages waited on flow control.
fn flow_throttled(reg: &Registry, m: &Metrics) -> prometheus::Result<()> {
    let c = CounterVec::new(
        Opts::new(
            "delayd_topic_throttled_seconds_total",
            "Time a topic's ready messages waited on its flow control, by topic and limit (max_per_second, max_reserved).",
        ),
        &["topic", "limit"],
    )?;
    for (topic, limit, ms) in m.throttled() {
        c.with_label_values(&[crate::http::topic_name::shown(&topic).as_str(), limit])
            .inc_by(ms as f64 / 1000.0);
    }
    reg.register(Box::new(c))
}

/// The counters of requests, deliveries and repairs, and the long polls waiting now.
fn request_metrics(reg: &Registry, m: &Metrics) -> prometheus::Result<()> {
    let counters = [
        ("delayd_produced_total", "Messages accepted by produce.", &m.produced),
        ("delayd_popped_total", "Deliveries handed out by pop.", &m.popped),
        ("delayd_acked_total", "Acks accepted.", &m.acked),
        ("delayd_nacked_total", "Nacks accepted.", &m.nacked),
        ("delayd_cancelled_total", "Cancels accepted.", &m.cancelled),
        ("delayd_rescheduled_total", "Reschedules accepted.", &m.rescheduled),
        ("delayd_touched_total", "Reservations extended by a touch.", &m.touched),
        ("delayd_redriven_total", "Dead letters moved back to their topic by an operator.", &m.redriven),
        ("delayd_dead_lettered_total", "Messages moved to a dead-letter topic.", &m.dead_lettered),
        ("delayd_ttr_expired_total", "Reservations whose time-to-run expired.", &m.ttr_expired),
        ("delayd_hops_total", "Level hops performed by the schedulers.", &m.hops),
        (
            "delayd_corrupt_records_total",
            "Commit-log records found damaged outside the recovery scan.",
            &m.corrupt_records,
        ),
        (
            "delayd_queue_repairs_total",
            "Consume-queue entries that disagreed with the log; each queue was repaired from the log.",
            &m.queue_repairs,
        ),
        (
            "delayd_requests_inline_total",
            "Requests applied on the thread that read them, the engine being free and idle (no hand-off).",
            &m.requests_inline,
        ),
        (
            "delayd_requests_queued_total",
            "Requests handed to the engine thread, to be applied in its next batch.",
            &m.requests_queued,
        ),
        (
            "delayd_engine_wakeups_total",
            "Inline requests that woke the sleeping engine thread for a deadline they moved earlier.",
            &m.engine_wakeups,
        ),
    ];
    for (name, help, c) in counters {
        counter(reg, name, help, c.load(Ordering::Relaxed))?;
    }
    gauge(
        reg,
        "delayd_long_polls_waiting",
        "Pops parked now, waiting for a message to arrive.",
        m.pops_waiting.load(Ordering::Relaxed) as f64,
    )
}

/// Each level's backlog and next due time, and each topic's counts.
fn level_and_topic_gauges(reg: &Registry, stats: &Stats) -> prometheus::Result<()> {
    gauge_by(
        reg,
        "delayd_level_backlog",
        "Timers on a delay level not yet fired, counting only those of live messages (see docs/operations.md, Metrics, for the exceptions).",
        "level",
        stats.levels.iter().map(|l| (fmt_ms(l.level_ms), l.backlog as f64)),
    )?;
    gauge_by(
        reg,
        "delayd_level_next_due_timestamp_seconds",
        "Due time of a level's head entry, unix seconds (absent when the level is empty).",
        "level",
        stats.levels.iter().filter_map(|l| Some((fmt_ms(l.level_ms), l.next_due_ms? as f64 / 1000.0))),
    )?;
    let now_ms = super::now_ms();
    gauge_by(
        reg,
        "delayd_topic_oldest_ready_age_seconds",
        "How long a topic's oldest ready message has waited since it became due, seconds (0 without one).",
        "topic",
        stats.topics.iter().map(|t| {
            let age_ms = t.oldest_ready_ms.map_or(0, |due| now_ms.saturating_sub(due));
            (super::topic_name::shown(&t.topic), age_ms as f64 / 1000.0)
        }),
    )?;
    let topic_counters: [TopicGauge; 4] = [
        ("delayd_topic_produced_total", "Messages produced to a topic since the start.", |t| {
            t.counts.produced
        }),
        ("delayd_topic_acked_total", "Acks of a topic's deliveries since the start.", |t| t.counts.acked),
        ("delayd_topic_nacked_total", "Nacks of a topic's deliveries since the start.", |t| t.counts.nacked),
        (
            "delayd_topic_dead_letters_total",
            "Messages of a topic moved to its dead-letter topic since the start.",
            |t| t.counts.dead_lettered,
        ),
    ];
    for (name, help, get) in topic_counters {
        let c = IntCounterVec::new(Opts::new(name, help), &["topic"])?;
        for t in &stats.topics {
            c.with_label_values(&[super::topic_name::shown(&t.topic).as_str()]).inc_by(get(t));
        }
        reg.register(Box::new(c))?;
    }
    let topic_gauges: [TopicGauge; 4] = [
        ("delayd_topic_ready", "Live messages in a topic queue not yet popped.", |t| t.ready),
        ("delayd_topic_reserved", "Messages popped and not yet acked.", |t| t.reserved),
        ("delayd_topic_delayed", "Messages of a topic waiting for their due time.", |t| t.delayed),
        ("delayd_topic_dead_lettered", "Messages of a topic moved to its dead-letter topic.", |t| {
            t.dead_lettered
        }),
    ];
    for (name, help, get) in topic_gauges {
        gauge_by(
            reg,
            name,
            help,
            "topic",
            stats.topics.iter().map(|t| (super::topic_name::shown(&t.topic), get(t) as f64)),
        )?;
    }
    Ok(())
}

/// What reclaim carried, deleted and forgot, and the bytes ever written to the log.
fn reclaim_counters(reg: &Registry, stats: &Stats) -> prometheus::Result<()> {
    let r = &stats.reclaim;
    let reclaim_counters = [
        ("delayd_carried_total", "Live messages carried forward out of an old segment.", r.carried),
        (
            "delayd_carried_bytes_total",
            "Bytes of Carry records written (reclaim's extra writes).",
            r.carried_bytes,
        ),
        ("delayd_segments_deleted_total", "Commit-log segments deleted by reclaim.", r.segments_deleted),
        (
            "delayd_segment_bytes_deleted_total",
            "Bytes of commit-log segments deleted.",
            r.segment_bytes_deleted,
        ),
        (
            "delayd_queue_files_deleted_total",
            "Consume-queue files deleted behind their reader.",
            r.queue_files_deleted,
        ),
        ("delayd_expired_total", "Final messages forgotten after done_retention.", r.expired),
        (
            "delayd_log_written_bytes_total",
            "Bytes ever appended to the commit log, carries included (write amplification: carried / this).",
            stats.log_written_bytes,
        ),
        (
            "delayd_topics_forgotten_total",
            "Emptied topics whose queue files and directory were deleted.",
            r.topics_forgotten,
        ),
    ];
    for (name, help, v) in reclaim_counters {
        counter(reg, name, help, v)?;
    }
    Ok(())
}

/// Disk use, open queues, the id index's size and whether the store takes writes.
fn store_gauges(reg: &Registry, m: &Metrics, stats: &Stats) -> prometheus::Result<()> {
    let load =
        if stats.index_slots == 0 { 0.0 } else { stats.index_entries as f64 / stats.index_slots as f64 };
    let gauges = [
        ("delayd_disk_bytes", "Bytes used by the data directory's files.", stats.disk_bytes as f64),
        ("delayd_log_bytes", "Bytes of commit-log segment files.", stats.log_bytes as f64),
        ("delayd_live_bytes", "Bytes of the records of every message not yet expired.", stats.live_bytes as f64),
        (
            "delayd_open_queues",
            "Topic queues whose files are open now (at most open_queues).",
            stats.open_queues as f64,
        ),
        (
            "delayd_index_entries",
            "Messages in the id index: live, or final within done_retention.",
            stats.index_entries as f64,
        ),
        ("delayd_index_slots", "Slots of the id index table new messages go to.", stats.index_slots as f64),
        (
            "delayd_index_load_ratio",
            "Id index entries per slot; the index grows before this gets high.",
            load,
        ),
        (
            "delayd_last_checkpoint_timestamp_seconds",
            "When the last checkpoint became durable, unix seconds (0 before the first one).",
            m.last_checkpoint_ms.load(Ordering::Relaxed) as f64 / 1000.0,
        ),
        (
            "delayd_store_writable",
            "1 while the store takes writes; 0 after a failed sync (until a restart) or while writes fail for lack of disk space or file handles.",
            f64::from(u8::from(stats.store_writable)),
        ),
    ];
    for (name, help, v) in gauges {
        gauge(reg, name, help, v)?;
    }
    Ok(())
}

/// The standard `process_*` metrics, each only when `/proc` gave it.
fn register_process(reg: &Registry, p: &ProcessStats) -> prometheus::Result<()> {
    if let Some(cpu) = p.cpu_seconds {
        let c = prometheus::Counter::new(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
        )?;
        c.inc_by(cpu);
        reg.register(Box::new(c))?;
    }
    let gauges = [
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            p.resident_memory_bytes.map(|v| v as f64),
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            p.virtual_memory_bytes.map(|v| v as f64),
        ),
        ("process_open_fds", "Number of open file descriptors.", p.open_fds.map(|v| v as f64)),
        ("process_max_fds", "Maximum number of open file descriptors.", p.max_fds.map(|v| v as f64)),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            p.start_time_seconds,
        ),
        ("process_threads", "Number of OS threads in the process.", p.threads.map(|v| v as f64)),
    ];
    for (name, help, v) in gauges {
        if let Some(v) = v {
            gauge(reg, name, help, v)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::LevelStats;

    fn stats() -> Stats {
        Stats {
            levels: vec![
                LevelStats { level_ms: 1000, backlog: 4, next_due_ms: Some(1_700_000_000_123) },
                LevelStats { level_ms: 60_000, backlog: 0, next_due_ms: None },
            ],
            topics: vec![
                TopicStats {
                    topic: "orders".into(),
                    ready: 5,
                    reserved: 1,
                    delayed: 3,
                    dead_lettered: 2,
                    counts: crate::message::TopicCounts {
                        produced: 9,
                        acked: 4,
                        nacked: 3,
                        dead_lettered: 2,
                    },
                    // Far in the future: the age is never negative, and 0 is exact.
                    oldest_ready_ms: Some(u64::MAX),
                },
                TopicStats {
                    topic: "odd\"name\\".into(),
                    ready: 0,
                    reserved: 0,
                    delayed: 0,
                    dead_lettered: 0,
                    counts: Default::default(),
                    oldest_ready_ms: None,
                },
            ],
            disk_bytes: 4096,
            open_queues: 3,
            log_bytes: 2048,
            log_written_bytes: 9000,
            live_bytes: 100,
            index_entries: 1024,
            index_slots: 4096,
            reclaim: crate::message::ReclaimCounts { carried: 7, ..Default::default() },
            store_writable: false,
            store_error: Some("fdatasync /data/commitlog/0: Input/output error".into()),
        }
    }

    #[test]
    fn renders_every_family_in_base_units_with_cumulative_buckets() {
        let m = Metrics::default();
        m.produced.fetch_add(3, Ordering::Relaxed);
        m.acked.fetch_add(2, Ordering::Relaxed);
        m.pops_waiting.fetch_add(2, Ordering::Relaxed);
        m.lateness_ms.observe(0);
        m.lateness_ms.observe(3);
        m.lateness_ms.observe(99_999);
        m.flush_us.observe(300);
        m.engine_step_us.observe(12_000);
        m.index_resize_step_us.observe(3_000);
        m.last_checkpoint_ms.store(1_700_000_000_500, Ordering::Relaxed);
        let text = render(&m, &stats()).unwrap();
        for line in [
            "delayd_produced_total 3",
            "delayd_acked_total 2",
            "delayd_popped_total 0",
            "delayd_long_polls_waiting 2",
            "delayd_level_backlog{level=\"1s\"} 4",
            "delayd_level_backlog{level=\"1m\"} 0",
            "delayd_level_next_due_timestamp_seconds{level=\"1s\"} 1700000000.123",
            "delayd_topic_ready{topic=\"orders\"} 5",
            "delayd_topic_ready{topic=\"odd\\\"name\\\\\"} 0",
            "delayd_topic_reserved{topic=\"orders\"} 1",
            "delayd_topic_delayed{topic=\"orders\"} 3",
            "delayd_topic_dead_lettered{topic=\"orders\"} 2",
            "delayd_topic_produced_total{topic=\"orders\"} 9",
            "delayd_topic_acked_total{topic=\"orders\"} 4",
            "delayd_topic_nacked_total{topic=\"orders\"} 3",
            "delayd_topic_dead_letters_total{topic=\"orders\"} 2",
            "delayd_topic_produced_total{topic=\"odd\\\"name\\\\\"} 0",
            "delayd_topic_oldest_ready_age_seconds{topic=\"orders\"} 0",
            "# TYPE delayd_topic_acked_total counter",
            "# TYPE delayd_topic_oldest_ready_age_seconds gauge",
            "delayd_last_checkpoint_timestamp_seconds 1700000000.5",
            "delayd_open_queues 3",
            "delayd_lateness_seconds_bucket{le=\"0\"} 1",
            "delayd_lateness_seconds_bucket{le=\"0.002\"} 1",
            "delayd_lateness_seconds_bucket{le=\"0.005\"} 2",
            "delayd_lateness_seconds_bucket{le=\"5\"} 2",
            "delayd_lateness_seconds_bucket{le=\"+Inf\"} 3",
            "delayd_lateness_seconds_sum 100.002",
            "delayd_lateness_seconds_count 3",
            "delayd_flush_duration_seconds_bucket{le=\"0.00025\"} 0",
            "delayd_flush_duration_seconds_bucket{le=\"0.0005\"} 1",
            "delayd_engine_step_seconds_max 0.012",
            "delayd_engine_step_cpu_seconds_max 0",
            "delayd_index_resize_step_seconds_max 0.003",
            "delayd_index_resize_step_seconds_count 1",
            "delayd_disk_bytes 4096",
            "delayd_log_bytes 2048",
            "delayd_live_bytes 100",
            "delayd_index_entries 1024",
            "delayd_index_slots 4096",
            "delayd_index_load_ratio 0.25",
            "delayd_carried_total 7",
            "delayd_log_written_bytes_total 9000",
            "delayd_store_writable 0",
            "# TYPE delayd_store_writable gauge",
            "# TYPE delayd_lateness_seconds histogram",
            "# TYPE delayd_produced_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("next_due_timestamp_seconds{level=\"1m\"}"));
        assert!(!text.contains("_ms") && !text.contains("_us"), "abbreviated units in\n{text}");
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let value = l.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{l}");
        }
    }

    #[test]
    fn a_scrape_adds_http_process_and_build_info() {
        let http = HttpMetrics::new();
        http.observe("/v1/stats", "GET", StatusCode::OK, 0.003);
        http.observe(UNMATCHED_ROUTE, "other", StatusCode::NOT_FOUND, 0.0001);
        let proc = ProcessStats { cpu_seconds: Some(1.25), open_fds: Some(12), ..Default::default() };
        let text = scrape(&Metrics::default(), &stats(), &http, &proc).unwrap();
        for line in [
            "delayd_http_requests_total{method=\"GET\",route=\"/v1/stats\",status=\"200\"} 1",
            "delayd_http_requests_total{method=\"other\",route=\"unmatched\",status=\"404\"} 1",
            "delayd_http_request_duration_seconds_bucket{method=\"GET\",route=\"/v1/stats\",status=\"200\",le=\"0.005\"} 1",
            "delayd_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/stats\",status=\"200\"} 1",
            "process_cpu_seconds_total 1.25",
            "process_open_fds 12",
            &format!("delayd_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION")),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Values /proc did not give are left out, not reported as 0.
        assert!(!text.contains("process_max_fds"), "{text}");
    }

    #[test]
    fn unknown_methods_share_one_label_value() {
        assert_eq!(method_label(&Method::DELETE), "DELETE");
        assert_eq!(method_label(&Method::from_bytes(b"SCAN").unwrap()), "other");
    }
}
