//! Fixtures shared by engine tests on a manual clock: a small broker, and traffic that makes
//! reclaim carry a live message out of its segment.

use std::sync::Arc;

use bytes::Bytes;

use crate::config::BrokerConfig;
use crate::engine::Engine;
use crate::message::{ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::ManualClock;

/// Small files (64 KiB segments, 64-entry queue files) and a 10 s done retention, so a few
/// hundred messages reclaim a segment.
pub(crate) fn small_config(dir: &std::path::Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 64 << 10;
    c.cq_entries_per_file = 64;
    c.index_initial_slots = 64;
    c.done_retention_ms = 10_000;
    c
}

/// An engine on [`small_config`] and `clock`.
pub(crate) fn open_small(dir: &std::path::Path, clock: &Arc<ManualClock>) -> Engine {
    Engine::open(small_config(dir), clock.clone(), Arc::new(Metrics::default())).unwrap().0
}

/// Produces, pops and acks 1 KB messages on topic `q`, a second apart, until the segment that
/// held the record at `first` is reclaimed; then checks that message `id` was carried past it.
pub(crate) fn traffic_until_carried(e: &mut Engine, clock: &ManualClock, id: &[u8], first: u64) {
    for round in 0..300u64 {
        for i in 0..10 {
            let req = ProduceRequest {
                id: Some(format!("q{round}-{i}")),
                body: Bytes::from(vec![b'.'; 1000]),
                when: When::Now,
                ttr_ms: None,
                max_attempts: None,
                backoff_ms: None,
            };
            e.produce("q", req).unwrap();
        }
        for d in e.pop(&["q".to_string()], 100, None).unwrap() {
            e.ack(&d.receipt).unwrap();
        }
        clock.advance_ms(1_000);
        while e.run_due(usize::MAX).unwrap() > 0 {}
        for _ in 0..1_000 {
            e.maintain().unwrap();
            e.checkpoint().unwrap();
            if !e.maintenance_due() {
                break;
            }
        }
        if e.store_for_tests().log_start().get() > first {
            break;
        }
    }
    let store = e.store_for_tests();
    assert!(store.log_start().get() > first, "the message's segment was reclaimed");
    assert!(store.find_id(id, 0).unwrap().1.msg_offset.get() > first, "it was carried");
}

/// Cases for a randomized model test: `default`, or `PROPTEST_CASES` when set, for a longer run
/// (a case count in the test's config would override proptest's own reading of it).
pub(crate) fn model_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
