//! `GET /metrics`: Prometheus text exposition (format 0.0.4), rendered by hand from the broker's counters.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::AppState;
use crate::config::units::fmt_ms;
use crate::message::{Stats, TopicStats};
use crate::metrics::{Histogram, Metrics};

/// The content type Prometheus expects for the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `GET /metrics`
pub(crate) async fn handler(State(st): State<AppState>) -> Result<Response, ApiError> {
    let stats = st.broker().stats().await?;
    let text = render(st.broker().metrics(), &stats);
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response())
}

fn escape(label: &str) -> String {
    label.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    histogram_scaled(out, name, help, h, 1)
}

/// A histogram kept in microseconds, exposed in seconds (Prometheus' base unit), with a gauge of
/// its largest value.
fn histogram_seconds(out: &mut String, name: &str, help: &str, h: &Histogram) {
    histogram_scaled(out, name, help, h, 1_000_000);
    let max = format!("{name}_max");
    header(out, &max, "gauge", &format!("Longest observation of {name} since the start, in seconds."));
    let _ = writeln!(out, "{max} {}", h.max() as f64 / 1e6);
}

/// Renders `h` with its bounds and sum divided by `per_unit` (1 keeps them as recorded).
fn histogram_scaled(out: &mut String, name: &str, help: &str, h: &Histogram, per_unit: u64) {
    header(out, name, "histogram", help);
    let (bounds, counts, sum, count) = h.snapshot();
    let scaled =
        |v: u64| if per_unit == 1 { v.to_string() } else { (v as f64 / per_unit as f64).to_string() };
    let mut cumulative = 0u64;
    for (bound, c) in bounds.iter().zip(&counts) {
        cumulative += c;
        let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {cumulative}", scaled(*bound));
    }
    // The +Inf bucket is the total count by definition, overflow bucket included.
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum {}", scaled(sum));
    let _ = writeln!(out, "{name}_count {count}");
}

/// A per-topic gauge: name, help text and how to read it.
type TopicGauge = (&'static str, &'static str, fn(&TopicStats) -> u64);

/// Renders every counter, gauge and histogram as Prometheus text.
pub fn render(m: &Metrics, stats: &Stats) -> String {
    let mut out = String::with_capacity(4096);
    let counters = [
        ("delayd_produced_total", "Messages accepted by produce.", &m.produced),
        ("delayd_popped_total", "Deliveries handed out by pop.", &m.popped),
        ("delayd_acked_total", "Acks accepted.", &m.acked),
        ("delayd_nacked_total", "Nacks accepted.", &m.nacked),
        ("delayd_cancelled_total", "Cancels accepted.", &m.cancelled),
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
    ];
    for (name, help, c) in counters {
        header(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {}", c.load(Ordering::Relaxed));
    }

    header(&mut out, "delayd_level_backlog", "gauge", "Entries on a delay level not yet fired.");
    for l in &stats.levels {
        let _ = writeln!(out, "delayd_level_backlog{{level=\"{}\"}} {}", fmt_ms(l.level_ms), l.backlog);
    }
    header(
        &mut out,
        "delayd_level_next_due_timestamp_ms",
        "gauge",
        "Due time of a level's head entry, unix ms (absent when the level is empty).",
    );
    for l in &stats.levels {
        if let Some(due) = l.next_due_ms {
            let _ =
                writeln!(out, "delayd_level_next_due_timestamp_ms{{level=\"{}\"}} {due}", fmt_ms(l.level_ms));
        }
    }

    let topic_gauges: [TopicGauge; 3] = [
        ("delayd_topic_ready", "Messages in a topic queue not yet popped.", |t| t.ready),
        ("delayd_topic_reserved", "Messages popped and not yet acked.", |t| t.reserved),
        ("delayd_topic_dead_lettered", "Messages of a topic moved to its dead-letter topic.", |t| {
            t.dead_lettered
        }),
    ];
    for (name, help, get) in topic_gauges {
        header(&mut out, name, "gauge", help);
        for t in &stats.topics {
            let _ = writeln!(out, "{name}{{topic=\"{}\"}} {}", escape(&t.topic), get(t));
        }
    }

    histogram(
        &mut out,
        "delayd_lateness_ms",
        "Time from a message's due time until it became ready, in ms.",
        &m.lateness_ms,
    );
    histogram(
        &mut out,
        "delayd_flush_duration_us",
        "Duration of commit-log flushes, in microseconds.",
        &m.flush_us,
    );
    histogram_seconds(
        &mut out,
        "delayd_engine_step_seconds",
        "Wall time of each engine step: a time-bounded slice of requests, due timers and maintenance, then the hand-off to the flusher.",
        &m.engine_step_us,
    );
    histogram_seconds(
        &mut out,
        "delayd_engine_step_cpu_seconds",
        "Time the engine thread spent on a CPU in each engine step.",
        &m.engine_step_cpu_us,
    );

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
        header(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {v}");
    }
    let gauges = [
        ("delayd_disk_bytes", "Bytes used by the data directory's files.", stats.disk_bytes),
        ("delayd_log_bytes", "Bytes of commit-log segment files.", stats.log_bytes),
        ("delayd_live_bytes", "Bytes of the records of every message not yet expired.", stats.live_bytes),
        (
            "delayd_open_queues",
            "Topic queues whose files are open now (at most open_queues).",
            stats.open_queues as u64,
        ),
    ];
    for (name, help, v) in gauges {
        header(&mut out, name, "gauge", help);
        let _ = writeln!(out, "{name} {v}");
    }
    header(
        &mut out,
        "delayd_store_writable",
        "gauge",
        "1 while the store takes writes; 0 after a failed sync (until a restart) or while writes fail for lack of disk space or file handles.",
    );
    let _ = writeln!(out, "delayd_store_writable {}", u8::from(stats.store_writable));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::LevelStats;

    #[test]
    fn renders_every_family_with_cumulative_buckets() {
        let m = Metrics::default();
        m.produced.fetch_add(3, Ordering::Relaxed);
        m.acked.fetch_add(2, Ordering::Relaxed);
        m.lateness_ms.observe(0);
        m.lateness_ms.observe(3);
        m.lateness_ms.observe(99_999);
        m.flush_us.observe(300);
        let stats = Stats {
            levels: vec![
                LevelStats { level_ms: 1000, backlog: 4, next_due_ms: Some(1_700_000_000_123) },
                LevelStats { level_ms: 60_000, backlog: 0, next_due_ms: None },
            ],
            topics: vec![TopicStats { topic: "orders".into(), ready: 5, reserved: 1, dead_lettered: 2 }],
            disk_bytes: 4096,
            open_queues: 3,
            log_bytes: 2048,
            log_written_bytes: 9000,
            live_bytes: 100,
            reclaim: crate::storage::reclaim::ReclaimStats { carried: 7, ..Default::default() },
            store_writable: false,
            store_error: Some("fdatasync /data/commitlog/0: Input/output error".into()),
        };
        let text = render(&m, &stats);
        for line in [
            "delayd_produced_total 3",
            "delayd_acked_total 2",
            "delayd_popped_total 0",
            "delayd_level_backlog{level=\"1s\"} 4",
            "delayd_level_backlog{level=\"1m\"} 0",
            "delayd_level_next_due_timestamp_ms{level=\"1s\"} 1700000000123",
            "delayd_topic_ready{topic=\"orders\"} 5",
            "delayd_topic_reserved{topic=\"orders\"} 1",
            "delayd_topic_dead_lettered{topic=\"orders\"} 2",
            "delayd_open_queues 3",
            "delayd_lateness_ms_bucket{le=\"0\"} 1",
            "delayd_lateness_ms_bucket{le=\"2\"} 1",
            "delayd_lateness_ms_bucket{le=\"5\"} 2",
            "delayd_lateness_ms_bucket{le=\"5000\"} 2",
            "delayd_lateness_ms_bucket{le=\"+Inf\"} 3",
            "delayd_lateness_ms_sum 100002",
            "delayd_lateness_ms_count 3",
            "delayd_flush_duration_us_bucket{le=\"250\"} 0",
            "delayd_flush_duration_us_bucket{le=\"500\"} 1",
            "delayd_disk_bytes 4096",
            "delayd_log_bytes 2048",
            "delayd_live_bytes 100",
            "delayd_carried_total 7",
            "delayd_log_written_bytes_total 9000",
            "delayd_store_writable 0",
            "# TYPE delayd_store_writable gauge",
            "# TYPE delayd_lateness_ms histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("next_due_timestamp_ms{level=\"1m\"}"));
        // Every sample line is `name{labels} value` with a numeric value.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let value = l.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{l}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
