//! The engine loop works in time-bounded steps: a long catch-up of due timers or a large produce
//! batch is spread over many steps, requests are answered between them, and every step is timed
//! into `delayd_engine_step_seconds` (whose bound is checked by `cargo bench --bench scheduler`,
//! not here: timings on a shared machine prove nothing in a test).

use std::sync::Arc;

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, ProduceRequest, When};
use delayd::schedule::clock::ManualClock;

const T0: u64 = 1_700_000_000_000;

fn req(id: Option<String>, delay_ms: u64) -> ProduceRequest {
    ProduceRequest {
        id,
        body: Bytes::from_static(b"x"),
        when: When::DelayMs(delay_ms),
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

async fn ready(b: &Broker, topic: &str) -> u64 {
    let s = b.stats().await.unwrap();
    s.topics.iter().find(|t| t.topic == topic).map_or(0, |t| t.ready)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_answered_while_a_long_catch_up_is_under_way() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let b = Broker::open_with_clock(BrokerConfig::with_defaults(dir.path()), clock.clone()).unwrap();
    let total = 40_000u64;
    for _ in 0..total / 1000 {
        let out = b.produce_batch("t", (0..1000).map(|_| req(None, 1_000)).collect()).await.unwrap();
        assert!(out.iter().all(|r| r.is_ok()));
    }
    assert_eq!(ready(&b, "t").await, 0);
    // Every timer is overdue at once: the engine has tens of thousands to fire.
    clock.advance_ms(2_000);
    let mut seen = Vec::new();
    loop {
        let n = ready(&b, "t").await;
        seen.push(n);
        if n == total {
            break;
        }
        tokio::task::yield_now().await;
    }
    let mid = seen.iter().filter(|&&n| n > 0 && n < total).count();
    assert!(mid > 0, "no request was answered during the catch-up: {seen:?}");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "ready counts went back: {seen:?}");
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_produce_batch_spread_over_steps_is_answered_whole_in_order_beside_other_clients() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(BrokerConfig::with_defaults(dir.path())).unwrap();
    let others = {
        let b = b.clone();
        tokio::spawn(async move {
            for i in 0..200 {
                let p = b.produce("other", req(Some(format!("o{i}")), 60_000)).await.unwrap();
                assert_eq!(p.id, format!("o{i}"));
            }
        })
    };
    let mut batches = Vec::new();
    for k in 0..3 {
        let b = b.clone();
        batches.push(tokio::spawn(async move {
            let reqs = (0..1000).map(|i| req(Some(format!("b{k}-{i}")), 60_000)).collect();
            b.produce_batch("big", reqs).await.unwrap()
        }));
    }
    for (k, h) in batches.into_iter().enumerate() {
        let out = h.await.unwrap();
        assert_eq!(out.len(), 1000);
        for (i, r) in out.into_iter().enumerate() {
            let p = r.unwrap();
            assert_eq!(p.id, format!("b{k}-{i}"), "results out of order");
            assert!(p.created);
        }
    }
    others.await.unwrap();
    for k in 0..3 {
        for i in [0, 31, 32, 33, 999] {
            b.get(&format!("b{k}-{i}")).await.unwrap();
        }
    }
    let steps = b.metrics().engine_step_us.snapshot().3;
    assert!(steps > 0, "engine steps are not counted");
    let text = delayd::http::metrics::render(b.metrics(), &b.stats().await.unwrap()).unwrap();
    for line in [
        "# TYPE delayd_engine_step_seconds histogram",
        "delayd_engine_step_seconds_bucket{le=\"0.01\"}",
        "# TYPE delayd_engine_step_cpu_seconds histogram",
        "delayd_engine_step_seconds_max ",
    ] {
        assert!(text.contains(line), "metrics lack {line:?}:\n{text}");
    }
    b.shutdown().await.unwrap();
}
