//! Produce: checking a request, planning its way through the levels, and appending its Put.

use crate::config::DelayPolicy;
use crate::error::{Error, Result};
use crate::limits::{MAX_ATTEMPTS_LIMIT, MAX_BACKOFF_STEPS, UNLIMITED_ATTEMPTS};
use crate::message::{ProduceRequest, Produced, When};
use crate::metrics::inc;
use crate::schedule::levels::{nearest_level, plan_hop};
use crate::storage::format::{self, Put, Record, Route, State};

use super::{validate_id, validate_topic, Engine};

impl Engine {
    /// A fresh id, from the produce's own clock reading `now` (each reading takes a lock and two
    /// clock reads: a produce used to take three).
    fn new_id(&mut self, now: u64) -> String {
        let expired_at = self.expired_at_from(now);
        loop {
            self.id_counter += 1;
            let a = format::id_hash(&[self.id_seed.to_le_bytes(), self.id_counter.to_le_bytes()].concat());
            let id = format!("{:012x}{:016x}", now & 0xFFFF_FFFF_FFFF, a);
            if self.store.find_id(id.as_bytes(), expired_at).is_none() {
                return id;
            }
        }
    }

    /// Produces one message; a message with the same id answers as an idempotent retry (the same
    /// request) or a conflict.
    pub fn produce(&mut self, topic: &str, req: ProduceRequest) -> Result<Produced> {
        self.produce_as(topic, req, false)
    }

    /// Produces one message that its id names from now on, as the compat `/push` does: a pending,
    /// reserved or dead message with the same id is cancelled first (it is never delivered again)
    /// and a final one is forgotten. Everything that can refuse the request is checked before the
    /// old message changes. A failure between the two appends leaves the old message cancelled and
    /// the push unanswered, which its client retries.
    pub fn replace(&mut self, topic: &str, req: ProduceRequest) -> Result<Produced> {
        self.produce_as(topic, req, true)
    }

    fn produce_as(&mut self, topic: &str, req: ProduceRequest, replace: bool) -> Result<Produced> {
        // Even an idempotent repeat is refused by a poisoned store: the first produce's record
        // may be among the writes whose sync failed, and a 200 would acknowledge it.
        self.writable()?;
        validate_topic(topic)?;
        let settings = self.produce_settings(&req)?;
        let now_us = self.clock.now_us();
        let now = now_us / 1000;
        let (request_kind, request_value) = request_of(&req.when);
        // With `replace`, the message this one replaces, and whether it must be cancelled first.
        let replaces = match self.existing_id(topic, &req, (request_kind, request_value), replace, now)? {
            Existing::Free => None,
            Existing::Repeat(produced) => return Ok(produced),
            Existing::Replaces(cancel_first) => Some(cancel_first),
        };
        self.may_name_topic(topic)?;
        // A delay counts from the receive time rounded up, so the due time is never before the
        // client's send time plus the delay; a message ready at once is visible from `now` on.
        let (deliver_at_ms, route) = self.plan_produce(&req.when, now, now_us.div_ceil(1000))?;
        let id = match req.id {
            Some(id) => id,
            None => self.new_id(now),
        };
        let rec = Record::Put(Put {
            created_ms: now,
            deliver_at_ms,
            ttr_ms: settings.ttr_ms,
            max_attempts: settings.max_attempts,
            request_kind,
            request_value,
            route,
            id: id.as_bytes(),
            topic: topic.as_bytes(),
            backoff_ms: settings.backoff_ms,
            body: &req.body,
            replaces: replaces.is_some(),
        });
        // Encoded (and so checked) before a replaced message is cancelled.
        let bytes = rec.encode()?;
        if replaces == Some(true) {
            self.cancel(&id)?;
        }
        self.append_framed(&bytes, &rec)?;
        inc(&self.metrics.produced);
        self.count_topic(topic, |c| c.produced += 1);
        Ok(Produced { id, deliver_at_ms, created: true })
    }

    /// The request's body size, time-to-run, attempts and backoff checked against the limits,
    /// with the broker's defaults for those it leaves out.
    fn produce_settings(&self, req: &ProduceRequest) -> Result<Settings> {
        if req.body.len() > self.cfg.max_body_bytes {
            return Err(Error::TooLarge(format!(
                "body is {} bytes; the limit is {} (max_body_bytes)",
                req.body.len(),
                self.cfg.max_body_bytes
            )));
        }
        let ttr_ms = req.ttr_ms.unwrap_or(self.cfg.default_ttr_ms);
        if ttr_ms == 0 || ttr_ms > self.cfg.max_delay_ms {
            return Err(Error::invalid("ttr_ms", format!("must be 1 to {} ms", self.cfg.max_delay_ms)));
        }
        let max_attempts = req.max_attempts.unwrap_or(self.cfg.default_max_attempts);
        if max_attempts == 0 || (max_attempts > MAX_ATTEMPTS_LIMIT && max_attempts != UNLIMITED_ATTEMPTS) {
            return Err(Error::invalid("max_attempts", format!("must be 1 to {MAX_ATTEMPTS_LIMIT}")));
        }
        let backoff_ms = req.backoff_ms.clone().unwrap_or_default();
        if backoff_ms.len() > MAX_BACKOFF_STEPS || backoff_ms.iter().any(|b| *b > self.cfg.max_delay_ms) {
            let why = format!("at most {MAX_BACKOFF_STEPS} steps, each no longer than max_delay");
            return Err(Error::invalid("backoff", why));
        }
        Ok(Settings { ttr_ms, max_attempts, backoff_ms })
    }

    /// What the request's id already names at `now`. Without `replace`, a live message with that
    /// id is either the same request again (`request` is its `(request_kind, request_value)`),
    /// answered as the first produce was, or a conflict.
    fn existing_id(
        &self,
        topic: &str,
        req: &ProduceRequest,
        request: (u8, u64),
        replace: bool,
        now: u64,
    ) -> Result<Existing> {
        let Some(id) = &req.id else { return Ok(Existing::Free) };
        validate_id(id)?;
        let Some((_, slot)) = self.store.find_id(id.as_bytes(), self.expired_at_from(now)) else {
            return Ok(Existing::Free);
        };
        if replace {
            return Ok(Existing::Replaces(!matches!(slot.state, State::Done | State::Cancelled)));
        }
        let p = self.store.put_at(slot.msg_offset)?;
        let same = p.topic == topic.as_bytes()
            && p.body == &req.body[..]
            && p.request_kind == request.0
            && p.request_value == request.1;
        if same {
            return Ok(Existing::Repeat(Produced {
                id: id.clone(),
                deliver_at_ms: p.deliver_at_ms,
                created: false,
            }));
        }
        Err(Error::Conflict(format!("id {id:?} already exists with a different topic, body or delay")))
    }

    fn plan_produce(&self, when: &When, now: u64, delay_from: u64) -> Result<(u64, Route)> {
        let levels = &self.cfg.levels_ms;
        let max = self.cfg.max_delay_ms;
        let (base, delay) = match *when {
            When::Now => return Ok((now, Route::Topic)),
            When::LevelIndex(i) => {
                let Some(l) = (i as usize).checked_sub(1).and_then(|i| levels.get(i)) else {
                    return Err(Error::invalid("level", format!("must be 1 to {}", levels.len())));
                };
                return Ok((delay_from + l, Route::Level { level_ms: *l, due_ms: delay_from + l }));
            }
            When::DelayMs(d) => {
                if d > max {
                    return Err(Error::invalid("delay_ms", format!("{d} exceeds max_delay of {max} ms")));
                }
                (delay_from, d)
            }
            When::AtMs(t) => {
                if t <= now {
                    // Due already: the answer says when it really became ready.
                    return Ok((now, Route::Topic));
                }
                if t - now > max {
                    return Err(Error::invalid(
                        "deliver_at_ms",
                        format!("is more than max_delay ({max} ms) ahead"),
                    ));
                }
                (now, t - now)
            }
        };
        if delay == 0 {
            return Ok((now, Route::Topic));
        }
        match self.cfg.delay_policy {
            DelayPolicy::Chain => Ok((base + delay, plan_hop(levels, base, delay))),
            DelayPolicy::Round => {
                let l = nearest_level(levels, delay);
                Ok((base + l, Route::Level { level_ms: l, due_ms: base + l }))
            }
        }
    }
}

/// A produce's settings once checked, defaults filled in.
struct Settings {
    ttr_ms: u64,
    max_attempts: u32,
    backoff_ms: Vec<u64>,
}

/// What a produce's id already names.
enum Existing {
    /// No message (or the request has no id): nothing stands in the way.
    Free,
    /// The same request again: the first produce's answer, nothing appended.
    Repeat(Produced),
    /// A message the produce replaces; `true` when it is not final and must be cancelled first.
    Replaces(bool),
}

/// How the producer asked for the delay, as the Put records it: `(request_kind, request_value)`.
fn request_of(when: &When) -> (u8, u64) {
    match *when {
        When::Now => (0, 0),
        When::DelayMs(d) => (1, d),
        When::AtMs(t) => (2, t),
        When::LevelIndex(i) => (3, u64::from(i)),
    }
}
