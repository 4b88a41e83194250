//! Health of each push subscription, in memory: last success, last error, failures in a row,
//! deliveries and failures in the last minute, and when to log. Lost on restart (a restart starts
//! every subscription healthy and unknown); one entry per subscription this node delivers for.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds the `_1m` counts cover; one bucket each.
const WINDOW_S: usize = 60;
/// A subscription that keeps failing is logged again at most this often.
pub const REMIND_EVERY: Duration = Duration::from_secs(60);
/// Most characters of a failure's message (an endpoint's answer is cut to fit).
pub const MAX_ERROR_CHARS: usize = 200;

/// The last failure of a subscription.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct LastError {
    /// What happened: the HTTP status and the start of the answer, a timeout, or a connection
    /// error.
    pub message: String,
    /// When, unix ms.
    pub time_ms: u64,
}

/// A subscription's health as `GET /v1/topics/{topic}/push` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthView {
    /// Last delivery acknowledged by the target, unix ms.
    pub last_success_ms: Option<u64>,
    /// The last failed delivery.
    pub last_error: Option<LastError>,
    /// Failed deliveries since the last success.
    pub consecutive_failures: u64,
    /// Deliveries that succeeded in the last 60 s.
    pub delivered_1m: u64,
    /// Deliveries that failed in the last 60 s.
    pub failed_1m: u64,
}

/// What a delivery's outcome asks to be logged, at most one line per subscription per
/// [`REMIND_EVERY`] while it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLine {
    /// Nothing.
    Quiet,
    /// The subscription was healthy (or new) and this delivery failed.
    StartedFailing,
    /// Still failing; `failures` since the last line, `in_a_row` since the last success.
    StillFailing { failures: u64, in_a_row: u64 },
    /// Delivered after `failures` failures in a row.
    Recovered { failures: u64 },
}

/// One subscription's record.
struct Sub {
    view: HealthView,
    /// Per second of the last minute: (unix second, delivered, failed), at `second % 60`.
    window: [(u64, u64, u64); WINDOW_S],
    /// When the last failure line was logged.
    logged_at: Option<Instant>,
    /// Failures since the last failure line.
    unlogged: u64,
}

impl Default for Sub {
    fn default() -> Self {
        Sub { view: HealthView::default(), window: [(0, 0, 0); WINDOW_S], logged_at: None, unlogged: 0 }
    }
}

impl Sub {
    fn count(&mut self, now_ms: u64, ok: bool) {
        let sec = now_ms / 1000;
        let b = &mut self.window[(sec % WINDOW_S as u64) as usize];
        if b.0 != sec {
            *b = (sec, 0, 0);
        }
        if ok {
            b.1 += 1;
        } else {
            b.2 += 1;
        }
    }

    fn view(&self, now_ms: u64) -> HealthView {
        let sec = now_ms / 1000;
        let recent = self.window.iter().filter(|b| b.0 + (WINDOW_S as u64) > sec && b.0 <= sec);
        let (delivered_1m, failed_1m) = recent.fold((0, 0), |(d, f), b| (d + b.1, f + b.2));
        HealthView { delivered_1m, failed_1m, ..self.view.clone() }
    }

    fn success(&mut self, now_ms: u64) -> LogLine {
        self.count(now_ms, true);
        self.view.last_success_ms = Some(now_ms);
        let failures = std::mem::take(&mut self.view.consecutive_failures);
        self.logged_at = None;
        self.unlogged = 0;
        if failures > 0 {
            LogLine::Recovered { failures }
        } else {
            LogLine::Quiet
        }
    }

    fn failure(&mut self, now_ms: u64, now: Instant, message: String) -> LogLine {
        self.count(now_ms, false);
        self.view.last_error = Some(LastError { message, time_ms: now_ms });
        self.view.consecutive_failures += 1;
        self.unlogged += 1;
        match self.logged_at {
            None => {
                self.logged_at = Some(now);
                self.unlogged = 0;
                LogLine::StartedFailing
            }
            Some(t) if now.saturating_duration_since(t) >= REMIND_EVERY => {
                self.logged_at = Some(now);
                LogLine::StillFailing {
                    failures: std::mem::take(&mut self.unlogged),
                    in_a_row: self.view.consecutive_failures,
                }
            }
            Some(_) => LogLine::Quiet,
        }
    }
}

/// Every subscription's health, by topic.
#[derive(Default)]
pub struct Health {
    subs: Mutex<HashMap<String, Sub>>,
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sub>> {
        // Nothing under the lock can panic half-way through a change.
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts recording `topic`'s deliveries (a worker for it started), from a clean slate.
    pub fn start(&self, topic: &str) {
        self.lock().insert(topic.to_string(), Sub::default());
    }

    /// Forgets every subscription `keep` refuses (removed, replaced, or no longer delivered
    /// here), so memory follows the subscriptions.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|t, _| keep(t));
    }

    /// Records one delivery's outcome (`Err` with what went wrong) at `now_ms`; a delivery
    /// finishing after its subscription was forgotten records nothing.
    pub fn record(&self, topic: &str, outcome: Result<(), String>, now_ms: u64, now: Instant) -> LogLine {
        let mut subs = self.lock();
        let Some(sub) = subs.get_mut(topic) else { return LogLine::Quiet };
        match outcome {
            Ok(()) => sub.success(now_ms),
            Err(message) => sub.failure(now_ms, now, message),
        }
    }

    /// `topic`'s health at `now_ms`; all empty when nothing was recorded (no delivery yet, or
    /// this node does not deliver).
    pub fn view(&self, topic: &str, now_ms: u64) -> HealthView {
        self.lock().get(topic).map(|s| s.view(now_ms)).unwrap_or_default()
    }
}

/// An endpoint's answer as a failure message says it: at most [`MAX_ERROR_CHARS`] characters,
/// control characters (line breaks included) shown as spaces, so one answer cannot forge log
/// lines or flood the API.
pub fn sanitize(text: &str, max_chars: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max_chars)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if text.chars().nth(max_chars).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000_000;

    #[test]
    fn failures_log_once_then_at_most_once_a_period_and_recovery_once() {
        let h = Health::default();
        h.start("t");
        let now = Instant::now();
        assert_eq!(h.record("t", Err("a".into()), T0, now), LogLine::StartedFailing);
        for i in 1..100 {
            assert_eq!(
                h.record("t", Err("b".into()), T0 + i, now + Duration::from_millis(i)),
                LogLine::Quiet
            );
        }
        let later = now + REMIND_EVERY;
        assert_eq!(
            h.record("t", Err("c".into()), T0 + 60_000, later),
            LogLine::StillFailing { failures: 100, in_a_row: 101 }
        );
        assert_eq!(h.record("t", Err("d".into()), T0 + 60_001, later), LogLine::Quiet);
        let v = h.view("t", T0 + 60_001);
        assert_eq!(v.consecutive_failures, 102);
        assert_eq!(v.last_error, Some(LastError { message: "d".into(), time_ms: T0 + 60_001 }));
        assert_eq!(v.last_success_ms, None);
        assert_eq!(h.record("t", Ok(()), T0 + 60_002, later), LogLine::Recovered { failures: 102 });
        assert_eq!(h.record("t", Ok(()), T0 + 60_003, later), LogLine::Quiet);
        let v = h.view("t", T0 + 60_003);
        assert_eq!((v.consecutive_failures, v.last_success_ms), (0, Some(T0 + 60_003)));
        // The last error stays shown after recovery; a new failure logs a new first line.
        assert_eq!(v.last_error.map(|e| e.message), Some("d".into()));
        assert_eq!(h.record("t", Err("e".into()), T0 + 60_004, later), LogLine::StartedFailing);
    }

    #[test]
    fn the_minute_counts_forget_what_is_older_than_sixty_seconds() {
        let h = Health::default();
        h.start("t");
        let now = Instant::now();
        for i in 0..5 {
            h.record("t", Ok(()), T0 + i * 1000, now);
        }
        h.record("t", Err("x".into()), T0 + 30_000, now);
        let v = h.view("t", T0 + 30_000);
        assert_eq!((v.delivered_1m, v.failed_1m), (5, 1));
        // At T0 + 62 s the deliveries of seconds 0..=2 are out of the window.
        let v = h.view("t", T0 + 62_000);
        assert_eq!((v.delivered_1m, v.failed_1m), (2, 1));
        let v = h.view("t", T0 + 200_000);
        assert_eq!((v.delivered_1m, v.failed_1m), (0, 0));
        // A bucket reused a minute later starts from zero.
        h.record("t", Ok(()), T0 + 60_000, now);
        assert_eq!(h.view("t", T0 + 60_000).delivered_1m, 5);
    }

    #[test]
    fn memory_follows_the_subscriptions() {
        let h = Health::default();
        h.start("a");
        h.start("b");
        assert_eq!(h.record("gone", Err("x".into()), T0, Instant::now()), LogLine::Quiet);
        assert_eq!(h.lock().len(), 2);
        h.retain(|t| t == "a");
        assert_eq!(h.lock().len(), 1);
        assert_eq!(h.view("b", T0), HealthView::default());
    }

    #[test]
    fn an_answer_is_cut_and_cannot_forge_lines() {
        assert_eq!(sanitize("bad\r\nWARN forged\tline", 200), "bad WARN forged line");
        let long = "é".repeat(300);
        let cut = sanitize(&long, 200);
        assert_eq!(cut.chars().count(), 201);
        assert!(cut.ends_with('…'));
        assert_eq!(sanitize("short", 200), "short");
    }
}
