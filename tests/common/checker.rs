//! A history of what clients were told (produces, deliveries, acks, cancels, on the client's own
//! clock) and the checker that finds lost, early and resurrected messages in it.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// What a client learnt from one produce request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProduceOutcome {
    /// A 2xx answer: the message must be delivered.
    Acked,
    /// An answer saying it was not stored (4xx, a 307 not followed, 503 `no_leader`).
    Refused,
    /// No answer (timeout, connection error): it may or may not be stored.
    Maybe,
}

/// One thing a client was told, times by the client's clock in Unix milliseconds.
#[derive(Clone, Debug)]
pub enum Event {
    /// A produce of `id`, due at `due_ms` if it was stored by this request.
    Produced { id: String, due_ms: u64, outcome: ProduceOutcome },
    /// `id` was delivered (popped or pushed), received at `at_ms`.
    Delivered { id: String, at_ms: u64 },
    /// An ack of a delivery of `id` sent at `sent_ms`; `ok` when answered 2xx.
    Acked { id: String, sent_ms: u64, ok: bool },
    /// A cancel of `id` sent at `sent_ms`; `ok` when answered 2xx.
    Cancelled { id: String, sent_ms: u64, ok: bool },
    /// A cancel of `id` whose outcome is unknown (no answer): it may have been applied.
    CancelMaybe { id: String },
}

/// A thread-safe record of client events; share it behind an `Arc` between workload threads.
#[derive(Default)]
pub struct History {
    events: Mutex<Vec<Event>>,
}

/// What the checker found.
#[derive(Debug, Default)]
pub struct Report {
    /// Every broken guarantee, one line each.
    pub violations: Vec<String>,
    /// Ids with at least one 2xx produce.
    pub acked_produces: usize,
    /// Ids whose produces all had unknown outcomes (or unknown and refused).
    pub maybe_produces: usize,
    /// Deliveries received, duplicates included.
    pub deliveries: usize,
    /// Deliveries beyond the first of each id (redeliveries after a nack or an expired
    /// reservation count too): reported, not a failure.
    pub duplicates: usize,
    /// Ids cancelled with a 2xx answer.
    pub cancelled: usize,
    /// Ids acked with a 2xx answer.
    pub acked: usize,
}

impl Report {
    /// Panics listing the violations (and the counts) unless there are none.
    pub fn assert_ok(&self) {
        if self.violations.is_empty() {
            return;
        }
        let shown: Vec<&str> = self.violations.iter().take(50).map(String::as_str).collect();
        panic!(
            "{} violation(s) in the history ({} shown):\n  {}\ncounts: {}",
            self.violations.len(),
            shown.len(),
            shown.join("\n  "),
            self.counts()
        );
    }

    /// The counts on one line, for test output.
    pub fn counts(&self) -> String {
        format!(
            "acked produces {}, maybe produces {}, deliveries {}, duplicates {}, acked {}, cancelled {}",
            self.acked_produces,
            self.maybe_produces,
            self.deliveries,
            self.duplicates,
            self.acked,
            self.cancelled
        )
    }
}

/// Everything the history says about one id.
#[derive(Default)]
struct IdFacts {
    produces: Vec<(u64, ProduceOutcome)>,
    deliveries: Vec<u64>,
    /// Send times of the 2xx acks and cancels: no delivery may be received after the earliest.
    acks_ok: Vec<u64>,
    cancels_ok: Vec<u64>,
    /// A cancel that may have been applied excuses a message never delivered.
    cancel_maybe: bool,
}

impl History {
    /// An empty history.
    pub fn new() -> History {
        History::default()
    }

    /// Records any event.
    pub fn record(&self, e: Event) {
        self.events.lock().expect("history lock").push(e);
    }

    /// A produce of `id` due at `due_ms` by the client's clock (send time + delay, or the
    /// `deliver_at_ms` asked for): `acked_2xx` true for a 2xx, false for an answer refusing it.
    pub fn produced(&self, id: &str, due_ms: u64, acked_2xx: bool) {
        let outcome = if acked_2xx { ProduceOutcome::Acked } else { ProduceOutcome::Refused };
        self.record(Event::Produced { id: id.to_string(), due_ms, outcome });
    }

    /// A produce of `id` whose outcome is unknown (timeout or connection error).
    pub fn produced_maybe(&self, id: &str, due_ms: u64) {
        self.record(Event::Produced { id: id.to_string(), due_ms, outcome: ProduceOutcome::Maybe });
    }

    /// A delivery of `id` (pop answer or push request) received at `at_ms`.
    pub fn delivered(&self, id: &str, at_ms: u64) {
        self.record(Event::Delivered { id: id.to_string(), at_ms });
    }

    /// An ack of `id` sent at `sent_ms`, `ok` when it was answered 2xx.
    pub fn acked(&self, id: &str, sent_ms: u64, ok: bool) {
        self.record(Event::Acked { id: id.to_string(), sent_ms, ok });
    }

    /// A cancel of `id` sent at `sent_ms`, `ok` when it was answered 2xx.
    pub fn cancelled(&self, id: &str, sent_ms: u64, ok: bool) {
        self.record(Event::Cancelled { id: id.to_string(), sent_ms, ok });
    }

    /// A cancel of `id` whose outcome is unknown (timeout or connection error): a message never
    /// delivered is then not lost.
    pub fn cancelled_maybe(&self, id: &str) {
        self.record(Event::CancelMaybe { id: id.to_string() });
    }

    /// A copy of the events so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().expect("history lock").clone()
    }

    /// Checks the whole history; call it once the workload has stopped and drained.
    pub fn check(&self) -> Report {
        let facts = by_id(&self.events());
        let mut report = Report::default();
        for (id, f) in &facts {
            count(f, &mut report);
            check_id(id, f, &mut report.violations);
        }
        report
    }
}

fn by_id(events: &[Event]) -> BTreeMap<String, IdFacts> {
    let mut facts: BTreeMap<String, IdFacts> = BTreeMap::new();
    for e in events {
        match e {
            Event::Produced { id, due_ms, outcome } => {
                facts.entry(id.clone()).or_default().produces.push((*due_ms, *outcome))
            }
            Event::Delivered { id, at_ms } => facts.entry(id.clone()).or_default().deliveries.push(*at_ms),
            Event::Acked { id, sent_ms, ok } => {
                let f = facts.entry(id.clone()).or_default();
                if *ok {
                    f.acks_ok.push(*sent_ms);
                }
            }
            Event::Cancelled { id, sent_ms, ok } => {
                let f = facts.entry(id.clone()).or_default();
                if *ok {
                    f.cancels_ok.push(*sent_ms);
                }
            }
            Event::CancelMaybe { id } => facts.entry(id.clone()).or_default().cancel_maybe = true,
        }
    }
    facts
}

fn count(f: &IdFacts, r: &mut Report) {
    let had = |want: ProduceOutcome| f.produces.iter().any(|(_, o)| *o == want);
    if had(ProduceOutcome::Acked) {
        r.acked_produces += 1;
    } else if had(ProduceOutcome::Maybe) {
        r.maybe_produces += 1;
    }
    r.deliveries += f.deliveries.len();
    r.duplicates += f.deliveries.len().saturating_sub(1);
    r.acked += usize::from(!f.acks_ok.is_empty());
    r.cancelled += usize::from(!f.cancels_ok.is_empty());
}

fn check_id(id: &str, f: &IdFacts, v: &mut Vec<String>) {
    let acked = f.produces.iter().any(|(_, o)| *o == ProduceOutcome::Acked);
    if acked && f.deliveries.is_empty() && f.cancels_ok.is_empty() && !f.cancel_maybe {
        v.push(format!("lost: {id} was produced with a 2xx and never delivered nor cancelled"));
    }
    // The earliest due time any request that may have stored the message asked for: a retry
    // answered "identical repeat" keeps the first request's due time.
    let due = f.produces.iter().filter(|(_, o)| *o != ProduceOutcome::Refused).map(|(d, _)| *d).min();
    let Some(due) = due else {
        if let Some(at) = f.deliveries.first() {
            let why = if f.produces.is_empty() { "never produced" } else { "every produce was refused" };
            v.push(format!("phantom: {id} delivered at {at} but {why}"));
        }
        return;
    };
    for at in &f.deliveries {
        if *at < due {
            v.push(format!("early: {id} delivered at {at}, {} ms before its due time {due}", due - at));
        }
    }
    // A delivery received by the time the ack or cancel was sent was already in flight.
    for (what, ends) in [("acked", &f.acks_ok), ("cancelled", &f.cancels_ok)] {
        let Some(end) = ends.iter().min() else { continue };
        if let Some(at) = f.deliveries.iter().filter(|at| *at > end).min() {
            v.push(format!("resurrected: {id} delivered at {at} after it was {what} (sent at {end})"));
        }
    }
}
