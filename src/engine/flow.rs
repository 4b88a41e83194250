//! Flow control per topic: a token bucket limiting how fast its messages are handed out, and a cap
//! on how many are reserved at once. Both only ever hold a delivery back, never bring one forward.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::message::FlowConfig;
use crate::storage::format::{self, Record};

use super::{validate_topic, Engine};

/// How soon a pop held back by `max_reserved` looks again, ms: a reservation ends by an ack, a
/// nack or its expiry, none of which wakes a waiting pop.
pub(super) const RESERVED_RECHECK_MS: u64 = 20;

/// One topic's token bucket, in memory: a restart starts it full.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bucket {
    /// Tokens now (at `at_ms`), at most the burst.
    tokens: f64,
    /// When `tokens` was last brought up to date, unix ms.
    at_ms: u64,
}

/// What flow control lets one pop of a topic take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Allowance {
    /// Messages the pop may take now.
    pub take: usize,
    /// Which limit held it below what was asked, and when asking again may find room (unix ms).
    pub held: Option<(&'static str, u64)>,
}

/// Per-topic buckets, and how far throttled time was counted per topic and limit (so overlapping
/// waits count once).
#[derive(Debug, Default)]
pub(super) struct FlowState {
    buckets: HashMap<String, Bucket>,
    counted_to: HashMap<(String, &'static str), u64>,
}

impl Engine {
    /// Sets (or replaces) `topic`'s flow control, or removes it (`None`); durable, one Flow
    /// record. Removing flow control there is none of is `NotFound`.
    pub fn set_flow(&mut self, topic: &str, cfg: Option<&FlowConfig>) -> Result<()> {
        self.writable()?;
        validate_topic(topic)?;
        if cfg.is_none() && self.store.flow_at(topic).is_none() {
            return Err(Error::NotFound(format!("topic {topic:?} has no flow control")));
        }
        if cfg.is_some() {
            self.may_name_topic(topic)?;
        }
        let rate = cfg.and_then(|c| c.max_per_second).unwrap_or(0);
        let burst = cfg.and_then(|c| c.burst).unwrap_or(if rate == 0 { 0 } else { rate.max(1) });
        let rec = format::Flow {
            time_ms: self.now(),
            max_per_second: rate,
            burst,
            max_reserved: cfg.and_then(|c| c.max_reserved).unwrap_or(0),
            topic: topic.as_bytes(),
        };
        if cfg.is_some() && rec.is_clear() {
            return Err(Error::invalid("flow", "give max_per_second or max_reserved (DELETE removes flow control)"));
        }
        self.append(&Record::Flow(rec))?;
        // A new rate starts from a full bucket of its own burst.
        self.flow.buckets.remove(topic);
        self.store.touch(topic);
        Ok(())
    }

    /// `topic`'s flow control, if it has any (read from the record in effect).
    pub fn flow_of(&self, topic: &str) -> Result<Option<FlowConfig>> {
        let Some(at) = self.store.flow_at(topic) else { return Ok(None) };
        match self.store.record_at(at)? {
            Record::Flow(f) => {
                let some = |v: u32| (v != 0).then_some(v);
                Ok(Some(FlowConfig {
                    max_per_second: some(f.max_per_second),
                    burst: some(f.burst),
                    max_reserved: some(f.max_reserved),
                    updated_at_ms: f.time_ms,
                }))
            }
            _ => Err(Error::Corrupt {
                file: "commitlog".into(),
                offset: at.get(),
                reason: format!("the flow control of {topic:?} does not point at a Flow record"),
            }),
        }
    }

    /// How many of `want` messages a pop of `topic` may take now.
    pub(super) fn flow_allowance(&mut self, topic: &str, want: usize) -> Result<Allowance> {
        let Some(cfg) = self.flow_of(topic)? else { return Ok(Allowance { take: want, held: None }) };
        let now = self.now();
        let mut take = want;
        let mut held = None;
        if let Some(cap) = cfg.max_reserved {
            let reserved = self.store.topic_queue(topic).map_or(0, |q| q.reserved);
            let room = u64::from(cap).saturating_sub(reserved) as usize;
            if room < take {
                take = room;
                held = Some(("max_reserved", now + RESERVED_RECHECK_MS));
            }
        }
        if let (Some(rate), Some(burst)) = (cfg.max_per_second, cfg.burst) {
            let b = self.flow.buckets.entry(topic.to_string()).or_insert(Bucket { tokens: f64::from(burst), at_ms: now });
            if now > b.at_ms {
                b.tokens = (b.tokens + (now - b.at_ms) as f64 * f64::from(rate) / 1000.0).min(f64::from(burst));
            }
            // A wall clock stepped back counts as no time passed, not as time to wait out: the
            // bucket refills from the new time on, instead of holding the topic until the clock
            // is back where it was.
            b.at_ms = now;
            let whole = b.tokens.floor().max(0.0) as usize;
            if whole < take {
                take = whole;
                // The next whole token, rounded up: asking sooner finds none.
                let wait = ((1.0 - b.tokens.fract()) * 1000.0 / f64::from(rate)).ceil() as u64;
                held = Some(("max_per_second", now + wait.max(1)));
            }
        }
        Ok(Allowance { take, held })
    }

    /// Spends a token per message a pop of `topic` took, and counts the time its ready messages
    /// wait on a limit (`held`) when some are left behind.
    pub(super) fn flow_took(&mut self, topic: &str, took: usize, held: Option<(&'static str, u64)>) {
        if let Some(b) = self.flow.buckets.get_mut(topic) {
            b.tokens -= took as f64;
        }
        let Some((limit, until)) = held else { return };
        if self.store.topic_queue(topic).map_or(0, |q| q.ready) == 0 {
            return;
        }
        let now = self.now();
        let counted = self.flow.counted_to.entry((topic.to_string(), limit)).or_insert(0);
        let from = now.max(*counted);
        if until > from {
            self.metrics.note_throttled(topic, limit, until - from);
            *counted = until;
        }
    }
}
