//! A nack's reason on a manual clock: the message's last error is its latest failed delivery's,
//! kept across a restart and across reclaim carrying the message (the Carry holds it, the
//! records before it going with their segment), and the dead-lettering nack records its own.

use std::sync::Arc;

use bytes::Bytes;

use crate::message::{LastError, Nacked, ProduceRequest, When};
use crate::schedule::clock::{Clock, ManualClock};

const T0: u64 = 1_700_000_000_000;

use crate::test_support::{open_small as open, traffic_until_carried as until_carried};

fn req(id: &str, max_attempts: Option<u32>) -> ProduceRequest {
    ProduceRequest {
        id: Some(id.to_string()),
        body: Bytes::from(vec![b'.'; 1000]),
        when: When::Now,
        ttr_ms: None,
        max_attempts,
        backoff_ms: None,
    }
}

#[test]
fn the_last_error_survives_a_restart_and_a_carry_and_the_dead_letter_has_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("f", Some(2))).unwrap();
    let first = e.store_for_tests().find_id(b"f", 0).unwrap().1.msg_offset.get();
    let t = vec!["t".to_string()];
    let d = e.pop(&t, 1, None).unwrap().remove(0);
    clock.advance_ms(5);
    // Retried in 10 minutes: it stays live while the other topic's traffic fills segments.
    e.nack_with_error(&d.receipt, Some(600_000), Some("boom: db down")).unwrap();
    let want = LastError { message: "boom: db down".into(), time_ms: T0 + 5, attempt: 1 };
    assert_eq!(e.get("f").unwrap().last_error, Some(want.clone()));
    drop(e);
    let mut e = open(dir.path(), &clock);
    assert_eq!(e.get("f").unwrap().last_error, Some(want.clone()), "kept across a restart");
    until_carried(&mut e, &clock, b"f", first);
    assert_eq!(e.get("f").unwrap().last_error, Some(want.clone()), "the Carry holds it");
    let (history, _) = e.history("f").unwrap();
    let carried = history.iter().find(|h| h.event == "carried").expect("a carried event");
    assert_eq!(carried.last_error, Some(want.clone()));
    drop(e);
    let mut e = open(dir.path(), &clock);
    assert_eq!(e.get("f").unwrap().last_error, Some(want), "a Carry's reason is read back after a restart");
    clock.set_ms(T0 + 600_000 + 400_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    let d = e.pop(&t, 1, None).unwrap().remove(0);
    assert_eq!(d.attempt, 2);
    let now = clock.now_ms();
    let nacked = e.nack_with_error(&d.receipt, None, Some("still down")).unwrap();
    assert!(matches!(nacked, Nacked::DeadLettered { .. }), "{nacked:?}");
    let last = e.get("f").unwrap().last_error;
    assert_eq!(last, Some(LastError { message: "still down".into(), time_ms: now, attempt: 2 }));
}
