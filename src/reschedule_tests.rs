//! Reschedule and touch on a manual clock: the new due time holds (never early, never the old
//! one), across a restart and a carry, and the settings it sets apply to later deliveries; a
//! touched reservation ends at its new time and keeps its receipt.

use std::sync::Arc;

use bytes::Bytes;

use crate::engine::Engine;
use crate::error::Error;
use crate::message::{MessageState, Nacked, ProduceRequest, RescheduleRequest, When};
use crate::schedule::clock::{Clock, ManualClock};

const T0: u64 = 1_700_000_000_000;

use crate::test_support::{open_small as open, traffic_until_carried};

fn req(id: &str, when: When) -> ProduceRequest {
    ProduceRequest {
        id: Some(id.to_string()),
        body: Bytes::from(format!("body of {id}")),
        when,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn to(when: When) -> RescheduleRequest {
    RescheduleRequest { when, ttr_ms: None, max_attempts: None, force: false }
}

fn t() -> Vec<String> {
    vec!["t".to_string()]
}

/// Steps the clock 1 ms at a time from now to `until`, firing timers and popping (and acking)
/// whatever comes; returns the ids with the time each was popped.
fn deliveries(e: &mut Engine, clock: &ManualClock, until: u64) -> Vec<(String, u64)> {
    let mut out = vec![];
    loop {
        while e.run_due(usize::MAX).unwrap() > 0 {}
        for d in e.pop(&t(), 100, None).unwrap() {
            e.ack(&d.receipt).unwrap();
            out.push((d.id, clock.now_ms()));
        }
        let now = clock.now_ms();
        if now >= until {
            return out;
        }
        // Jump to the next due time, but never past one: every firing is seen at its millisecond.
        let next = e.next_due().unwrap_or(until).clamp(now + 1, until);
        clock.set_ms(next);
    }
}

fn counts(e: &Engine) {
    let store = e.store_for_tests();
    assert_eq!(store.state_counts(), store.recount_states().unwrap(), "counters match the index");
}

#[test]
fn a_later_time_holds_and_the_old_timer_fires_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("a", When::DelayMs(5_000))).unwrap();
    let r = e.reschedule("a", &to(When::DelayMs(65_000))).unwrap();
    assert_eq!((r.state, r.deliver_at_ms), (MessageState::Delayed, T0 + 65_000));
    assert_eq!(e.get("a").unwrap().deliver_at_ms, T0 + 65_000);
    counts(&e);
    assert_eq!(deliveries(&mut e, &clock, T0 + 64_999), vec![], "not at the old time, not early");
    assert_eq!(deliveries(&mut e, &clock, T0 + 70_000), vec![("a".to_string(), T0 + 65_000)]);
    let events: Vec<_> = e.history("a").unwrap().0.iter().map(|h| h.event).collect();
    assert_eq!(events, ["ack", "reserve", "due", "reschedule", "produced"]);
    counts(&e);
}

#[test]
fn an_earlier_time_and_now_deliver_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("early", When::DelayMs(3_600_000))).unwrap();
    e.produce("t", req("now", When::DelayMs(3_600_000))).unwrap();
    e.reschedule("early", &to(When::AtMs(T0 + 2_500))).unwrap();
    let r = e.reschedule("now", &to(When::AtMs(0))).unwrap();
    assert_eq!((r.state, r.deliver_at_ms), (MessageState::Ready, T0));
    counts(&e);
    let got = deliveries(&mut e, &clock, T0 + 3_700_000);
    assert_eq!(got, vec![("now".to_string(), T0), ("early".to_string(), T0 + 2_500)]);
    counts(&e);
}

#[test]
fn a_ready_message_moved_later_is_not_popped_until_then() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("r", When::Now)).unwrap();
    e.reschedule("r", &to(When::DelayMs(10_000))).unwrap();
    assert_eq!(e.topics().iter().find(|x| x.topic == "t").map(|x| (x.ready, x.delayed)), Some((0, 1)));
    assert_eq!(deliveries(&mut e, &clock, T0 + 20_000), vec![("r".to_string(), T0 + 10_000)]);
}

#[test]
fn final_unknown_and_reserved_messages_are_refused_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    assert!(matches!(e.reschedule("nope", &to(When::DelayMs(1))), Err(Error::NotFound(_))));
    e.produce("t", req("done", When::Now)).unwrap();
    let d = e.pop(&t(), 1, None).unwrap();
    e.ack(&d[0].receipt).unwrap();
    assert!(matches!(e.reschedule("done", &to(When::DelayMs(1))), Err(Error::Conflict(_))));
    e.produce("t", req("gone", When::DelayMs(1000))).unwrap();
    e.cancel("gone").unwrap();
    assert!(matches!(e.reschedule("gone", &to(When::DelayMs(1))), Err(Error::Conflict(_))));

    e.produce("t", req("held", When::Now)).unwrap();
    let d = e.pop(&t(), 1, None).unwrap().remove(0);
    let end = e.log_end();
    assert!(matches!(e.reschedule("held", &to(When::DelayMs(5_000))), Err(Error::Conflict(_))));
    assert_eq!(e.log_end(), end, "a refused reschedule writes nothing");
    let forced = RescheduleRequest { force: true, ..to(When::DelayMs(5_000)) };
    assert_eq!(e.reschedule("held", &forced).unwrap().state, MessageState::Delayed);
    assert!(matches!(e.ack(&d.receipt), Err(Error::NotFound(_))), "the old receipt no longer works");
    counts(&e);
    // Its reservation's expiry timer is stale too: it comes back once, at the new time.
    assert_eq!(deliveries(&mut e, &clock, T0 + 400_000), vec![("held".to_string(), T0 + 5_000)]);
    e.produce("t", req("x", When::DelayMs(1000))).unwrap();
    for bad in [
        to(When::LevelIndex(1)),
        to(When::DelayMs(u64::MAX)),
        RescheduleRequest { ttr_ms: Some(0), ..to(When::DelayMs(1)) },
        RescheduleRequest { max_attempts: Some(0), ..to(When::DelayMs(1)) },
    ] {
        assert!(matches!(e.reschedule("x", &bad), Err(Error::Invalid { .. })), "{bad:?}");
    }
}

/// The time-to-run and attempt limit a reschedule sets apply to later deliveries, also after a
/// restart and after reclaim carried the message (the Carry holds them).
#[test]
fn new_settings_apply_across_a_restart_and_a_carry() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("s", When::DelayMs(1_000))).unwrap();
    let first = e.store_for_tests().find_id(b"s", 0).unwrap().1.msg_offset;
    let r = RescheduleRequest { ttr_ms: Some(7_000), max_attempts: Some(2), ..to(When::DelayMs(600_000)) };
    e.reschedule("s", &r).unwrap();
    drop(e);
    let mut e = open(dir.path(), &clock);
    assert_eq!(e.get("s").unwrap().ttr_ms, 7_000, "kept across a restart");
    // Traffic on another topic until the message's segment is reclaimed and it is carried.
    traffic_until_carried(&mut e, &clock, b"s", first.get());
    assert_eq!(e.get("s").unwrap().ttr_ms, 7_000, "the Carry holds the new time-to-run");
    clock.set_ms(T0 + 600_001);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    let d = e.pop(&t(), 1, None).unwrap().remove(0);
    assert_eq!(d.ttr_ms, 7_000);
    assert!(matches!(e.nack(&d.receipt, Some(0)).unwrap(), Nacked::Retry { .. }));
    let d = e.pop(&t(), 1, None).unwrap().remove(0);
    assert_eq!(d.attempt, 2);
    // The second delivery was the last one the new limit allows.
    assert!(matches!(e.nack(&d.receipt, Some(0)).unwrap(), Nacked::DeadLettered { .. }));
    counts(&e);
}

/// Fires due timers at every millisecond from now to `until`; returns what `t` then pops.
fn pop_at(e: &mut Engine, clock: &ManualClock, until: u64) -> Vec<crate::message::Delivery> {
    while clock.now_ms() < until {
        let next = e.next_due().unwrap_or(until).clamp(clock.now_ms() + 1, until);
        clock.set_ms(next);
        while e.run_due(usize::MAX).unwrap() > 0 {}
        let got = e.pop(&t(), 10, Some(1_000_000)).unwrap();
        if !got.is_empty() {
            return got;
        }
    }
    vec![]
}

#[test]
fn a_touch_moves_the_reservations_end_and_keeps_its_receipt() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("a", When::Now)).unwrap();
    e.produce("t", req("b", When::Now)).unwrap();
    let d = e.pop(&t(), 2, Some(10_000)).unwrap();
    let (a, b) = (d[0].receipt.clone(), d[1].receipt.clone());
    clock.set_ms(T0 + 5_000);
    assert_eq!(e.touch(&a, 20_000).unwrap(), T0 + 25_000);
    assert_eq!(e.touch(&b, 20_000).unwrap(), T0 + 25_000);
    clock.set_ms(T0 + 6_000);
    assert_eq!(e.touch(&b, 30_000).unwrap(), T0 + 36_000, "touched twice, same receipt");
    assert_eq!(e.get("b").unwrap().deliver_at_ms, T0 + 36_000);
    assert!(matches!(e.touch(&b, 0), Err(Error::Invalid { .. })));
    counts(&e);
    // Survives a restart; the old ends (10 s, then 25 s for b) fire nothing.
    drop(e);
    let mut e = open(dir.path(), &clock);
    e.ack(&a).unwrap();
    assert_eq!(e.get("a").unwrap().deliver_at_ms, T0, "an ack keeps the delivery's due time");
    assert!(pop_at(&mut e, &clock, T0 + 35_999).is_empty(), "b came back before its touched end");
    let back = pop_at(&mut e, &clock, T0 + 40_000);
    assert_eq!((back.len(), back[0].id.as_str(), back[0].attempt), (1, "b", 2));
    assert_eq!(clock.now_ms(), T0 + 36_000, "back at its new end, not before");
    // The first delivery's receipt ended with it.
    assert!(matches!(e.touch(&b, 1_000), Err(Error::NotFound(_))));
    assert!(matches!(e.ack(&b), Err(Error::NotFound(_))));
    e.touch(&back[0].receipt, 1_000).unwrap();
    e.ack(&back[0].receipt).unwrap();
    let events: Vec<_> = e.history("b").unwrap().0.iter().map(|h| h.event).collect();
    assert_eq!(events, ["ack", "touch", "reserve", "expire", "touch", "touch", "reserve", "produced"]);
    counts(&e);
}
