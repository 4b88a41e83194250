//! Reschedule: a pending message moved to a new due time in one Transition record, keeping its id.

use crate::error::{Error, Result};
use crate::limits::{MAX_ATTEMPTS_LIMIT, UNLIMITED_ATTEMPTS};
use crate::message::{RescheduleRequest, Rescheduled, When};
use crate::metrics::inc;
use crate::schedule::levels::plan_hop;
use crate::storage::format::{Cause, DeliverySettings, Route, State};

use super::reads::message_state;
use super::transition::{ready_state, Change};
use super::Engine;

impl Engine {
    /// Moves the delayed, ready, retrying or dead message `id` to a new due time (a reserved one
    /// only with `force`), with the time-to-run and attempt limit the request sets. Its entries
    /// already queued name its old sequence number, so they are stale from this record on: the old
    /// timer fires nothing and an old ready entry pops nothing.
    pub fn reschedule(&mut self, id: &str, req: &RescheduleRequest) -> Result<Rescheduled> {
        self.writable()?;
        let (_, slot) = self.by_id(id)?;
        match slot.state {
            State::Done => {
                return Err(Error::Conflict(format!("message {id:?} was already delivered and acked")))
            }
            State::Cancelled => return Err(Error::Conflict(format!("message {id:?} is cancelled"))),
            State::Reserved if !req.force => {
                return Err(Error::Conflict(format!(
                    "message {id:?} is reserved by a consumer; send \"force\": true to move it anyway \
                     (its receipt stops working)"
                )))
            }
            _ => {}
        }
        let settings = self.reschedule_settings(&slot, req)?;
        let now_us = self.clock.now_us();
        // As for a produce: a delay counts from the receive time rounded up, never early.
        let (now, from) = (now_us / 1000, now_us.div_ceil(1000));
        let (deliver_at_ms, route) = self.plan_reschedule(&req.when, now, from)?;
        let state = if route == Route::Topic { ready_state(slot.home) } else { State::Delayed };
        let change = Change {
            time_ms: now,
            state,
            cause: Cause::Reschedule,
            home: slot.home,
            attempt: u32::from(slot.attempt),
            deliver_at_ms,
            route,
            due_ms: None,
        };
        self.transition_with(&slot, change, Some(settings), None)?;
        self.note_left_behind(&slot);
        inc(&self.metrics.rescheduled);
        Ok(Rescheduled { id: id.to_string(), state: message_state(state), deliver_at_ms })
    }

    /// The settings the message keeps after the reschedule: the request's, checked, else its own.
    fn reschedule_settings(
        &self,
        slot: &crate::storage::index::Slot,
        req: &RescheduleRequest,
    ) -> Result<DeliverySettings> {
        let max = self.cfg.max_delay_ms;
        if req.ttr_ms.is_some_and(|t| t == 0 || t > max) {
            return Err(Error::invalid("ttr_ms", format!("must be 1 to {max} ms")));
        }
        if req.max_attempts.is_some_and(|m| m == 0 || (m > MAX_ATTEMPTS_LIMIT && m != UNLIMITED_ATTEMPTS)) {
            return Err(Error::invalid("max_attempts", format!("must be 1 to {MAX_ATTEMPTS_LIMIT}")));
        }
        let put = self.store.message_fields_at(slot.msg_offset)?;
        let own = self.store.delivery_settings(slot, &put)?;
        Ok(DeliverySettings {
            ttr_ms: req.ttr_ms.unwrap_or(own.ttr_ms),
            max_attempts: req.max_attempts.unwrap_or(own.max_attempts),
        })
    }

    /// The new due time and first queue entry. Always chained through the levels (never rounded to
    /// one, which could make it early), as a nack's retry is.
    fn plan_reschedule(&self, when: &When, now: u64, from: u64) -> Result<(u64, Route)> {
        let max = self.cfg.max_delay_ms;
        let (base, delay) = match *when {
            When::DelayMs(d) if d > max => {
                return Err(Error::invalid("delay_ms", format!("{d} exceeds max_delay of {max} ms")))
            }
            When::DelayMs(d) => (from, d),
            When::AtMs(t) if t <= now => (now, 0),
            When::AtMs(t) if t - now > max => {
                let why = format!("is more than max_delay ({max} ms) ahead");
                return Err(Error::invalid("deliver_at_ms", why));
            }
            When::AtMs(t) => (now, t - now),
            When::Now => (now, 0),
            When::LevelIndex(_) => {
                return Err(Error::invalid("level", "a reschedule takes delay_ms or deliver_at_ms"))
            }
        };
        if delay == 0 {
            return Ok((now, Route::Topic));
        }
        Ok((base + delay, plan_hop(&self.cfg.levels_ms, base, delay)))
    }
}
