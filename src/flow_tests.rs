//! Flow control in the engine, on a manual clock: the token bucket's arithmetic, the reserved
//! cap, and the wait a held-back pop is told about.

use std::sync::Arc;

use bytes::Bytes;

use crate::config::BrokerConfig;
use crate::engine::Engine;
use crate::message::{FlowConfig, ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::ManualClock;

const T0: u64 = 1_700_000_000_000;

fn open(dir: &std::path::Path, clock: &Arc<ManualClock>, metrics: &Arc<Metrics>) -> Engine {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 1 << 20;
    c.index_initial_slots = 64;
    Engine::open(c, clock.clone(), metrics.clone()).unwrap().0
}

fn produce(e: &mut Engine, topic: &str, n: usize) {
    for i in 0..n {
        let r = ProduceRequest {
            id: Some(format!("{topic}-{i}")),
            body: Bytes::from_static(b"b"),
            when: When::Now,
            ttr_ms: None,
            max_attempts: None,
            backoff_ms: None,
        };
        e.produce(topic, r).unwrap();
    }
}

fn flow(rate: Option<u32>, burst: Option<u32>, reserved: Option<u32>) -> FlowConfig {
    FlowConfig { max_per_second: rate, burst, max_reserved: reserved, updated_at_ms: 0 }
}

#[test]
fn the_bucket_gives_its_burst_then_one_token_per_interval_and_says_when_the_next_comes() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let mut e = open(dir.path(), &clock, &metrics);
    produce(&mut e, "t", 20);
    // 10 a second, 2 at once.
    e.set_flow("t", Some(&flow(Some(10), Some(2), None))).unwrap();
    let t = ["t".to_string()];
    let (got, wait) = e.pop_flow(&t, 10, None).unwrap();
    assert_eq!((got.len(), wait), (2, Some(100)), "the burst, then a token in 100 ms");
    let (got, wait) = e.pop_flow(&t, 10, None).unwrap();
    assert_eq!((got.len(), wait), (0, Some(100)));
    clock.advance_ms(60);
    let (got, wait) = e.pop_flow(&t, 10, None).unwrap();
    assert_eq!((got.len(), wait), (0, Some(40)), "never before the token");
    clock.advance_ms(40);
    assert_eq!(e.pop_flow(&t, 10, None).unwrap().0.len(), 1);
    // A long quiet spell fills the bucket to its burst, never past it.
    clock.advance_ms(10_000);
    assert_eq!(e.pop_flow(&t, 10, None).unwrap().0.len(), 2);
    // The time those left waited is counted once, however often they were asked for: 100 ms after
    // each pop that found fewer tokens than messages (the three that took some).
    let throttled = metrics.throttled();
    assert_eq!(throttled.len(), 1);
    let (topic, limit, ms) = &throttled[0];
    assert_eq!((topic.as_str(), *limit), ("t", "max_per_second"));
    assert_eq!(*ms, 300);
    // Removing it lets the rest go at once.
    e.set_flow("t", None).unwrap();
    let (got, wait) = e.pop_flow(&t, 100, None).unwrap();
    assert_eq!((got.len(), wait), (15, None));
}

#[test]
fn a_clock_stepped_back_does_not_hold_the_topic_until_it_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let mut e = open(dir.path(), &clock, &metrics);
    produce(&mut e, "t", 10);
    e.set_flow("t", Some(&flow(Some(10), Some(1), None))).unwrap();
    let t = ["t".to_string()];
    assert_eq!(e.pop_flow(&t, 10, None).unwrap().0.len(), 1, "the burst");
    // An hour back: the next token still comes 100 ms later by the new time.
    clock.set_ms(T0 - 3_600_000);
    assert_eq!(e.pop_flow(&t, 10, None).unwrap().0.len(), 0);
    clock.advance_ms(100);
    assert_eq!(
        e.pop_flow(&t, 10, None).unwrap().0.len(),
        1,
        "refilled by the new time, not held for an hour"
    );
}

#[test]
fn max_reserved_caps_what_is_reserved_and_an_ack_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let mut e = open(dir.path(), &clock, &metrics);
    produce(&mut e, "r", 10);
    e.set_flow("r", Some(&flow(None, None, Some(3)))).unwrap();
    let r = ["r".to_string(), "other".to_string()];
    let got = e.pop(&r, 10, None).unwrap();
    assert_eq!(got.len(), 3);
    let (none, wait) = e.pop_flow(&r, 10, None).unwrap();
    assert!(none.is_empty() && wait.is_some(), "held back, and told to look again");
    e.ack(&got[0].receipt).unwrap();
    assert_eq!(e.pop(&r, 10, None).unwrap().len(), 1);
    // Settings in effect and removed, durably: a reopen reads them back from the log.
    drop(e);
    let mut e = open(dir.path(), &clock, &metrics);
    assert_eq!(e.flow_of("r").unwrap().and_then(|f| f.max_reserved), Some(3));
    assert!(e.pop(&r, 10, None).unwrap().is_empty());
    e.set_flow("r", None).unwrap();
    assert!(e.set_flow("r", None).is_err(), "none left to remove");
    assert_eq!(e.pop(&r, 10, None).unwrap().len(), 6);
}

#[test]
fn a_flow_without_a_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock, &Arc::new(Metrics::default()));
    assert!(e.set_flow("t", Some(&flow(None, None, None))).is_err());
    assert!(e.set_flow("t", Some(&flow(Some(2_000_000), None, None))).is_err());
    assert!(e.flow_of("t").unwrap().is_none());
}
