//! The one way a message's state changes: a Transition record built from a [`Change`].

use super::Engine;
use crate::error::Result;
use crate::storage::format::{Cause, DeliverySettings, Home, Record, Route, State, Transition};
use crate::storage::index::Slot;

/// The state of a message in `home` that a consumer can pop: ready, or dead in its dead-letter queue.
pub(super) fn ready_state(home: Home) -> State {
    match home {
        Home::Main => State::Ready,
        Home::DeadLetter => State::Dead,
    }
}

/// What a Transition record says of the message after it (the record adds the message, its seq
/// and the link to the record before).
pub(super) struct Change {
    /// The clock reading the change was decided on; it also planned `deliver_at_ms` and `route`.
    pub(super) time_ms: u64,
    pub(super) state: State,
    pub(super) cause: Cause,
    pub(super) home: Home,
    pub(super) attempt: u32,
    pub(super) deliver_at_ms: u64,
    pub(super) route: Route,
    /// A Reserve's delivery due time, kept by a later ack or cancel.
    pub(super) due_ms: Option<u64>,
}

impl Engine {
    pub(super) fn transition(&mut self, slot: &Slot, change: Change) -> Result<u32> {
        self.transition_with(slot, change, None, None)
    }

    /// A [`transition`](Self::transition) that also sets the message's delivery settings from
    /// now on (a Reschedule, record version 5), or records why a delivery failed (a Nack or
    /// DeadLetter, record version 7).
    pub(super) fn transition_with(
        &mut self,
        slot: &Slot,
        change: Change,
        settings: Option<DeliverySettings>,
        error: Option<&str>,
    ) -> Result<u32> {
        let seq = slot.seq + 1;
        self.append(&Record::Transition(Transition {
            msg_offset: slot.msg_offset.get(),
            id_hash: slot.hash.get(),
            seq,
            prev_state: slot.state,
            state: change.state,
            cause: change.cause,
            home: change.home,
            attempt: change.attempt,
            time_ms: change.time_ms,
            deliver_at_ms: change.deliver_at_ms,
            route: change.route,
            due_ms: change.due_ms,
            prev_offset: Some(slot.last_offset.get()),
            settings,
            error: error.map(str::as_bytes),
        }))?;
        Ok(seq)
    }
}
