//! `GET /v1/stats/history`: the last hour of rates and lateness for the dashboard's charts, and
//! the process facts of its health strip.
//!
//! A background task reads the broker's counters and lateness histogram every ten seconds and
//! keeps the differences in a ring of 360 samples: bounded memory, nothing on disk, gone after a
//! restart (Prometheus keeps the long history; this is the hour an operator looks at first).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, Weak};
use std::time::Duration;

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::error::ApiError;
use super::{topic_name, AppState, Inner};
use crate::metrics::Metrics;

/// Time between two samples.
pub(crate) const INTERVAL: Duration = Duration::from_secs(10);
/// Samples kept: one hour at one per `INTERVAL`.
pub(crate) const CAPACITY: usize = 360;

/// One interval's rates and lateness.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub(crate) struct Sample {
    /// End of the interval, unix ms.
    time_ms: u64,
    /// Messages accepted by produce, per second.
    produced_per_s: f64,
    /// Deliveries handed out (pops, push deliveries included), per second.
    delivered_per_s: f64,
    /// Acks, per second.
    acked_per_s: f64,
    /// Nacks, per second.
    nacked_per_s: f64,
    /// Messages moved to a dead-letter topic, per second.
    dead_lettered_per_s: f64,
    /// Median lateness of the messages that became ready in the interval, ms; null when none did.
    lateness_p50_ms: Option<f64>,
    /// 99th percentile of that lateness, ms; null when none became ready.
    lateness_p99_ms: Option<f64>,
}

/// The counters as read at one instant.
#[derive(Debug, Clone, Default, PartialEq)]
struct Reading {
    time_ms: u64,
    produced: u64,
    popped: u64,
    acked: u64,
    nacked: u64,
    dead_lettered: u64,
    /// Lateness bucket counts (non-cumulative; the last is the overflow).
    lateness: Vec<u64>,
}

impl Reading {
    fn take(m: &Metrics, time_ms: u64) -> Reading {
        Reading {
            time_ms,
            produced: m.produced.load(Relaxed),
            popped: m.popped.load(Relaxed),
            acked: m.acked.load(Relaxed),
            nacked: m.nacked.load(Relaxed),
            dead_lettered: m.dead_lettered.load(Relaxed),
            lateness: m.lateness_ms.snapshot().1,
        }
    }

    /// The sample of the interval from `prev` to `self`.
    fn since(&self, prev: &Reading, bounds: &[u64]) -> Sample {
        let secs = (self.time_ms.saturating_sub(prev.time_ms) as f64 / 1000.0).max(0.001);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / secs;
        let counts: Vec<u64> = self
            .lateness
            .iter()
            .enumerate()
            .map(|(i, c)| c.saturating_sub(prev.lateness.get(i).copied().unwrap_or(0)))
            .collect();
        Sample {
            time_ms: self.time_ms,
            produced_per_s: rate(self.produced, prev.produced),
            delivered_per_s: rate(self.popped, prev.popped),
            acked_per_s: rate(self.acked, prev.acked),
            nacked_per_s: rate(self.nacked, prev.nacked),
            dead_lettered_per_s: rate(self.dead_lettered, prev.dead_lettered),
            lateness_p50_ms: quantile(bounds, &counts, 0.5),
            lateness_p99_ms: quantile(bounds, &counts, 0.99),
        }
    }
}

/// The `q` quantile of bucketed observations, interpolated inside its bucket as Prometheus'
/// `histogram_quantile` does; the overflow bucket answers its lower bound (the largest bound).
fn quantile(bounds: &[u64], counts: &[u64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 && (below + c) as f64 >= rank {
            let Some(&upper) = bounds.get(i) else { return bounds.last().map(|b| *b as f64) };
            let lower = if i == 0 { 0 } else { bounds[i - 1] };
            let within = ((rank - below as f64) / c as f64).clamp(0.0, 1.0);
            return Some(lower as f64 + (upper - lower) as f64 * within);
        }
        below += c;
    }
    bounds.last().map(|b| *b as f64)
}

/// The ring of samples and the reading the next one is taken against.
#[derive(Debug)]
pub(crate) struct History {
    started_at_ms: u64,
    ring: Mutex<(VecDeque<Sample>, Option<Reading>)>,
}

impl History {
    /// An empty history of a process started now.
    pub(crate) fn new(now_ms: u64) -> History {
        History { started_at_ms: now_ms, ring: Mutex::new((VecDeque::with_capacity(CAPACITY), None)) }
    }

    /// Reads the counters: the first reading only sets the baseline, each later one adds a sample.
    fn record(&self, m: &Metrics, now_ms: u64) {
        let reading = Reading::take(m, now_ms);
        let bounds = m.lateness_ms.snapshot().0;
        // A poisoned lock only means a panic elsewhere mid-push: the ring itself is still whole.
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(prev) = &ring.1 {
            let s = reading.since(prev, bounds);
            if ring.0.len() == CAPACITY {
                ring.0.pop_front();
            }
            ring.0.push_back(s);
        }
        ring.1 = Some(reading);
    }

    fn samples(&self) -> Vec<Sample> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner()).0.iter().copied().collect()
    }
}

/// Samples every `INTERVAL` for as long as the state lives; called once per state, inside a
/// Tokio runtime (a state built outside one keeps an empty history).
pub(crate) fn start_sampler(state: Weak<Inner>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
    rt.spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(inner) = state.upgrade() else { return };
            inner.history.record(inner.broker.metrics(), super::now_ms());
        }
    });
}

/// Facts about the running process, for the dashboard's health strip.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ProcessFacts {
    /// The delayd version running.
    version: &'static str,
    /// When this process started serving, unix ms.
    started_at_ms: u64,
    /// Time since then, ms.
    uptime_ms: u64,
    /// Bytes free for delayd on the data directory's file system; null when it cannot be read.
    data_disk_free_bytes: Option<u64>,
}

/// How long a topic's oldest ready message has waited.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TopicAge {
    /// The topic, as written.
    topic: String,
    /// Time since its oldest ready message became due, ms; null when none is ready.
    oldest_ready_age_ms: Option<u64>,
}

/// The answer of `GET /v1/stats/history`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HistoryAnswer {
    /// Time between samples, ms.
    interval_ms: u64,
    /// Most samples kept (the last hour).
    capacity: usize,
    /// Oldest first; empty until the second reading, one interval after the start.
    samples: Vec<Sample>,
    /// The process now.
    process: ProcessFacts,
    /// Each topic's oldest ready message, now.
    topics: Vec<TopicAge>,
}

/// `GET /v1/stats/history`
#[utoipa::path(
    get,
    path = "/v1/stats/history",
    tag = "operations",
    operation_id = "stats_history",
    summary = "The last hour of rates and lateness (in memory), the version, uptime and free disk",
    responses((status = 200, description = "The samples and facts", body = HistoryAnswer))
)]
pub(crate) async fn history(State(st): State<AppState>) -> Result<Json<HistoryAnswer>, ApiError> {
    let stats = st.broker().stats().await?;
    let now = super::now_ms();
    let dir = st.broker().config().data_dir.clone();
    let free = tokio::task::spawn_blocking(move || super::process::free_bytes(&dir)).await.ok().flatten();
    let h = &st.inner.history;
    let topics = stats
        .topics
        .iter()
        .map(|t| TopicAge {
            topic: topic_name::shown(&t.topic),
            oldest_ready_age_ms: t.oldest_ready_ms.map(|due| now.saturating_sub(due)),
        })
        .collect();
    Ok(Json(HistoryAnswer {
        interval_ms: INTERVAL.as_millis() as u64,
        capacity: CAPACITY,
        samples: h.samples(),
        process: ProcessFacts {
            version: env!("CARGO_PKG_VERSION"),
            started_at_ms: h.started_at_ms,
            uptime_ms: now.saturating_sub(h.started_at_ms),
            data_disk_free_bytes: free,
        },
        topics,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        let bounds = [10, 100, 1000];
        assert_eq!(quantile(&bounds, &[0, 0, 0, 0], 0.5), None);
        // 10 observations in (10, 100]: the median is half way through it.
        assert_eq!(quantile(&bounds, &[0, 10, 0, 0], 0.5), Some(55.0));
        assert_eq!(quantile(&bounds, &[100, 0, 0, 0], 0.99), Some(9.9));
        // Past the last bound: the largest bound, never a made-up figure.
        assert_eq!(quantile(&bounds, &[0, 0, 0, 5], 0.99), Some(1000.0));
        let p = quantile(&bounds, &[99, 0, 0, 1], 0.5).unwrap();
        assert!((p - 10.0 * 50.0 / 99.0).abs() < 1e-9, "{p}");
    }

    #[test]
    fn the_ring_keeps_rates_of_the_last_hour_only() {
        let m = Metrics::default();
        let h = History::new(0);
        h.record(&m, 0);
        assert!(h.samples().is_empty(), "the first reading is the baseline");
        for i in 1..=(CAPACITY as u64 + 5) {
            m.produced.fetch_add(20, Relaxed);
            m.lateness_ms.observe(3);
            h.record(&m, i * 10_000);
        }
        let s = h.samples();
        assert_eq!(s.len(), CAPACITY);
        assert_eq!(s[0].time_ms, 6 * 10_000, "the oldest samples were dropped");
        assert!(s.iter().all(|s| s.produced_per_s == 2.0 && s.acked_per_s == 0.0));
        assert!(s.iter().all(|s| s.lateness_p50_ms.is_some_and(|p| p > 0.0 && p <= 5.0)), "{:?}", s[0]);
    }
}
