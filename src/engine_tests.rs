//! Engine tests on a manual clock: hours of scheduling run in milliseconds.

use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;

use crate::config::BrokerConfig;
use crate::engine::{Engine, Receipts};
use crate::message::{MessageState, Nacked, ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::ManualClock;
use crate::storage::format::Record;

const T0: u64 = 1_700_000_000_000;

fn config(dir: &std::path::Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 64 << 10;
    c.cq_entries_per_file = 256;
    c.index_initial_slots = 64;
    c
}

fn open(dir: &std::path::Path, clock: &Arc<ManualClock>) -> Engine {
    Engine::open(config(dir), clock.clone(), Arc::new(Metrics::default())).unwrap().0
}

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

fn topics(t: &str) -> Vec<String> {
    vec![t.to_string()]
}

/// Runs the engine on the manual clock up to `until`, jumping straight to each next due time (as
/// the real engine sleeps until it), at most `step` ms at a time. Pops and acks everything, and
/// returns (id, deliver_at, popped at).
fn run_until(e: &mut Engine, clock: &ManualClock, until: u64, step: u64) -> Vec<(String, u64, u64)> {
    let mut out = vec![];
    loop {
        while e.run_due(usize::MAX).unwrap() > 0 {}
        let now = clock.now_ms_for_tests();
        for d in e.pop(&topics("t"), 1000, None).unwrap() {
            e.ack(&d.receipt).unwrap();
            out.push((d.id, d.deliver_at_ms, now));
        }
        if now >= until {
            return out;
        }
        let next = e.next_due().unwrap_or(until).clamp(now + 1, (now + step).min(until));
        clock.set_ms(next);
    }
}

impl ManualClock {
    fn now_ms_for_tests(&self) -> u64 {
        use crate::schedule::clock::Clock;
        self.now_ms()
    }
}

/// The level of every hop a message took, from its Put's route and its Hop records.
fn hops_of(e: &Engine, id: &str) -> Vec<u64> {
    use crate::storage::format::Route;
    let store = e.store_for_tests();
    let (_, slot) = store.find_id(id.as_bytes(), 0).unwrap();
    let mut out = vec![];
    let mut at = store.log_start().get();
    while let Some((off, rec, next)) = store.log().next(at).unwrap() {
        match rec {
            Record::Put(p) if off == slot.msg_offset.get() => {
                if let Route::Level { level_ms, .. } = p.route {
                    out.push(level_ms)
                }
            }
            Record::Hop(h) if h.msg_offset == slot.msg_offset.get() => {
                if let Route::Level { level_ms, due_ms } = h.route {
                    out.push(level_ms);
                    assert!(due_ms <= h.target_ms, "a hop never ends after the target");
                }
            }
            _ => {}
        }
        at = next;
    }
    out
}

#[test]
fn a_chained_delay_hops_level_by_level_and_fires_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let p = e.produce("t", req("order-1", When::DelayMs(3_725_250))).unwrap();
    assert_eq!(p.deliver_at_ms, T0 + 3_725_250);
    let got = run_until(&mut e, &clock, T0 + 3_800_000, 1 << 40);
    assert_eq!(got.len(), 1);
    let (id, due, popped) = &got[0];
    assert_eq!((id.as_str(), *due, *popped), ("order-1", T0 + 3_725_250, T0 + 3_725_250));
    // 1h + 2m + 5s + 250ms: the body was written once, each hop is a small record.
    // The 250 ms remainder rides the smallest (1 s) level with its exact due time.
    assert_eq!(hops_of(&e, "order-1"), vec![3_600_000, 120_000, 5_000, 1_000]);
}

/// After downtime one call to `run_due` fires every overdue entry, several in a row from the same
/// level (whose scheduler holds one entry at a time), and a chain whose entry fires late plans its
/// next hop from the time of the fire: straight to the level that ends it on its exact time, never
/// to a level already past.
#[test]
fn after_downtime_one_run_fires_every_overdue_entry_and_a_late_hop_is_planned_from_now() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let delays = [3_725_250u64, 3_725_100, 3_722_000, 3_602_500, 3_660_000, 125_000, 65_500, 1_500];
    for (i, d) in delays.iter().enumerate() {
        e.produce("t", req(&format!("m{i}"), When::DelayMs(*d))).unwrap();
    }
    // m0 (1h + 2m + 5s + 250 ms) would hop 1h -> 2m -> 5s -> 1s on time; five messages wait on
    // the 1h level, the others on shorter ones.
    let now = T0 + 3_725_150;
    clock.set_ms(now);
    let fired = e.run_due(usize::MAX).unwrap();
    let mut got: Vec<String> = e.pop(&topics("t"), 1000, None).unwrap().into_iter().map(|d| d.id).collect();
    got.sort();
    let want: Vec<String> = (1..delays.len()).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "every message due by now is ready after one run");
    assert_eq!(fired, want.len() + 1, "and m0's entry on the 1h level");
    // Fired 2m 5.15 s late, 100 ms before its time: onto the 1 s level, due at its time.
    assert_eq!(hops_of(&e, "m0"), vec![3_600_000, 1_000]);
    assert_eq!(e.run_due(usize::MAX).unwrap(), 0, "m0's last hop is not due yet");
    clock.set_ms(T0 + 3_725_250);
    assert_eq!(e.run_due(usize::MAX).unwrap(), 1);
    let last: Vec<String> = e.pop(&topics("t"), 10, None).unwrap().into_iter().map(|d| d.id).collect();
    assert_eq!(last, vec!["m0".to_string()]);
}

/// A catch-up makes overdue messages ready in due order, also when a message's entry was an
/// earlier hop of its chain (due before entries of messages due sooner, on their last hop).
#[test]
fn after_downtime_chained_messages_become_ready_in_due_order() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("a", When::DelayMs(1_300))).unwrap();
    e.produce("t", req("b", When::DelayMs(1_900))).unwrap();
    clock.set_ms(T0 + 250);
    e.produce("t", req("c", When::DelayMs(1_200))).unwrap();
    // a and b hop onto their remainders (due T0+1300, T0+1900); c's first hop, due at T0+1250
    // before a's last one, has not fired when the broker goes down.
    clock.set_ms(T0 + 1_000);
    assert_eq!(e.run_due(usize::MAX).unwrap(), 2);
    clock.set_ms(T0 + 3_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    let got: Vec<(String, u64)> =
        e.pop(&topics("t"), 10, None).unwrap().into_iter().map(|d| (d.id, d.deliver_at_ms - T0)).collect();
    let want = [("a", 1_300), ("c", 1_450), ("b", 1_900)].map(|(id, at)| (id.to_string(), at));
    assert_eq!(got, want);
}

#[test]
fn a_first_delivery_records_how_long_after_its_due_time_it_was_reserved() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let mut e = Engine::open(config(dir.path()), clock.clone(), metrics.clone()).unwrap().0;
    e.produce("t", req("a", When::DelayMs(1_000))).unwrap();
    // Fired 300 ms late, popped 400 ms after that.
    clock.set_ms(T0 + 1_300);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    clock.set_ms(T0 + 1_700);
    let d = e.pop(&topics("t"), 1, Some(100)).unwrap().remove(0);
    let fired = metrics.lateness_ms.prometheus();
    let delivered = metrics.delivery_lateness_ms.prometheus();
    assert_eq!((fired.get_sample_count(), delivered.get_sample_count()), (1, 1));
    assert!((fired.get_sample_sum() - 0.3).abs() < 1e-9, "{}", fired.get_sample_sum());
    assert!((delivered.get_sample_sum() - 0.7).abs() < 1e-9, "{}", delivered.get_sample_sum());
    // A redelivery (here after a nack) is not a first delivery: not counted again.
    e.nack(&d.receipt, Some(0)).unwrap();
    clock.set_ms(T0 + 1_800);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(e.pop(&topics("t"), 1, Some(100)).unwrap().len(), 1);
    assert_eq!(delivered.get_sample_count(), 1);
}

#[test]
fn lookup_reports_every_state() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("a", When::DelayMs(5_000))).unwrap();
    let info = e.get("a").unwrap();
    assert_eq!(
        (info.state, info.deliver_at_ms, info.attempt, info.topic.as_str()),
        (MessageState::Delayed, T0 + 5000, 0, "t")
    );
    clock.advance_ms(5_000);
    e.run_due(100).unwrap();
    assert_eq!(e.get("a").unwrap().state, MessageState::Ready);
    let d = e.pop(&topics("t"), 10, Some(1_000)).unwrap().remove(0);
    let info = e.get("a").unwrap();
    assert_eq!((info.state, info.attempt), (MessageState::Reserved, 1));
    e.ack(&d.receipt).unwrap();
    assert_eq!(e.get("a").unwrap().state, MessageState::Done);
    assert!(matches!(e.cancel("a"), Err(crate::Error::Conflict(_))));
    e.produce("t", req("b", When::Now)).unwrap();
    e.cancel("b").unwrap();
    assert_eq!(e.get("b").unwrap().state, MessageState::Cancelled);
    assert!(e.pop(&topics("t"), 10, None).unwrap().is_empty());
    e.produce("t", ProduceRequest { max_attempts: Some(1), ..req("c", When::Now) }).unwrap();
    let d = e.pop(&topics("t"), 10, None).unwrap().remove(0);
    assert!(matches!(e.nack(&d.receipt, None).unwrap(), Nacked::DeadLettered { .. }));
    assert_eq!(e.get("c").unwrap().state, MessageState::Dead);
    assert!(matches!(e.get("nope"), Err(crate::Error::NotFound(_))));
}

#[test]
fn reservations_expire_with_attempt_plus_one_and_nack_walks_the_backoff_to_the_dlq() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce(
        "t",
        ProduceRequest {
            max_attempts: Some(3),
            backoff_ms: Some(vec![2_000, 10_000]),
            ..req("m", When::Now)
        },
    )
    .unwrap();
    let d1 = e.pop(&topics("t"), 1, Some(1_500)).unwrap().remove(0);
    assert_eq!(d1.attempt, 1);
    clock.advance_ms(1_499);
    e.run_due(100).unwrap();
    assert!(e.pop(&topics("t"), 1, None).unwrap().is_empty(), "reservation must hold until its ttr");
    clock.advance_ms(1);
    e.run_due(100).unwrap();
    let d2 = e.pop(&topics("t"), 1, None).unwrap().remove(0);
    assert_eq!(d2.attempt, 2);
    assert!(e.ack(&d1.receipt).is_err(), "an expired receipt is refused");
    // Backoff step for attempt 2 is the second entry: 10 s.
    assert_eq!(e.nack(&d2.receipt, None).unwrap(), Nacked::Retry { deliver_at_ms: T0 + 1_500 + 10_000 });
    clock.advance_ms(9_999);
    e.run_due(100).unwrap();
    assert!(e.pop(&topics("t"), 1, None).unwrap().is_empty());
    clock.advance_ms(1);
    e.run_due(100).unwrap();
    let d3 = e.pop(&topics("t"), 1, None).unwrap().remove(0);
    assert_eq!(d3.attempt, 3);
    assert_eq!(e.nack(&d3.receipt, None).unwrap(), Nacked::DeadLettered { topic: "t.dlq".into() });
    let dead = e.pop(&topics("t.dlq"), 1, None).unwrap().remove(0);
    assert_eq!((dead.id.as_str(), dead.attempt), ("m", 4));
    e.ack(&dead.receipt).unwrap();
    let stats = e.stats();
    let t = stats.topics.iter().find(|t| t.topic == "t").unwrap();
    assert_eq!((t.reserved, t.dead_lettered), (0, 1));
}

#[test]
fn idempotent_produce_and_conflicts() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let first = e.produce("t", req("x", When::DelayMs(1000))).unwrap();
    clock.advance_ms(300);
    let again = e.produce("t", req("x", When::DelayMs(1000))).unwrap();
    assert!(first.created && !again.created);
    assert_eq!(again.deliver_at_ms, first.deliver_at_ms);
    assert!(matches!(e.produce("t", req("x", When::DelayMs(2000))), Err(crate::Error::Conflict(_))));
    assert!(matches!(e.produce("u", req("x", When::DelayMs(1000))), Err(crate::Error::Conflict(_))));
    assert!(matches!(
        e.produce("t", req("y", When::DelayMs(31 * 86_400_000))),
        Err(crate::Error::Invalid { .. })
    ));
    assert!(matches!(e.produce("bad topic", req("z", When::Now)), Err(crate::Error::Invalid { .. })));
    // Whitespace in ids is the native HTTP API's rule (compat ids may have it); control
    // characters are refused everywhere.
    assert!(matches!(e.produce("t", req("bell\u{7}", When::Now)), Err(crate::Error::Invalid { .. })));
    assert!(matches!(e.produce("t", req("lvl", When::LevelIndex(22))), Err(crate::Error::Invalid { .. })));
    let generated = e.produce("t", ProduceRequest { id: None, ..req("", When::Now) }).unwrap();
    assert!(e.get(&generated.id).is_ok());
}

#[test]
fn state_survives_reopen_and_cancel_holds_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    {
        let mut e = open(dir.path(), &clock);
        e.produce("t", req("keep", When::DelayMs(10_000))).unwrap();
        e.produce("t", req("drop", When::DelayMs(10_000))).unwrap();
        e.produce("t", req("drop-later", When::DelayMs(10_000))).unwrap();
        e.cancel("drop").unwrap();
        e.flush().unwrap();
        // No checkpoint, no clean close: recovery replays from the start.
    }
    let mut e = open(dir.path(), &clock);
    e.cancel("drop-later").unwrap();
    e.close().unwrap();
    let mut e = open(dir.path(), &clock);
    let got = run_until(&mut e, &clock, T0 + 20_000, 100);
    let ids: Vec<&str> = got.iter().map(|g| g.0.as_str()).collect();
    assert_eq!(ids, vec!["keep"]);
    assert!(got[0].2 >= T0 + 10_000);
}

#[test]
fn deleted_queues_and_index_are_rebuilt_identically() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    for i in 0..300u64 {
        e.produce("t", req(&format!("m{i}"), When::DelayMs((i * 7919) % 100_000))).unwrap();
        if i % 50 == 0 {
            clock.advance_ms(1_000);
            e.run_due(usize::MAX).unwrap();
            for d in e.pop(&topics("t"), 5, None).unwrap() {
                e.ack(&d.receipt).unwrap();
            }
        }
    }
    // An unread message keeps "t" from being forgotten as emptied at close; the rebuild restarts
    // readers at entry 0, so it would not forget it, and the files would differ by that topic.
    e.produce("t", req("unread", When::Now)).unwrap();
    e.close().unwrap();
    let snapshot = |root: &std::path::Path| {
        let mut files = std::collections::BTreeMap::new();
        for sub in ["cq"] {
            let mut stack = vec![root.join(sub)];
            while let Some(d) = stack.pop() {
                for ent in std::fs::read_dir(&d).unwrap() {
                    let p = ent.unwrap().path();
                    if p.is_dir() {
                        stack.push(p);
                    } else {
                        files.insert(p.strip_prefix(root).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
                    }
                }
            }
        }
        files
    };
    // The index is compared by content: where a slot lands depends on when the background resize
    // thread finished, so its bytes may differ while it holds the same messages.
    let slots = |root: &std::path::Path| {
        let idx = crate::storage::index::IdIndex::open(
            &root.join("index").join("ids"),
            64,
            &crate::storage::durability::Durability::new(root),
        )
        .unwrap();
        let mut v = Vec::new();
        idx.for_each(|s| v.push(s));
        v.sort_by_key(|s| s.msg_offset);
        v
    };
    let before = snapshot(dir.path());
    let slots_before = slots(dir.path());
    assert!(slots_before.len() > 100, "the index holds the messages: {}", slots_before.len());
    std::fs::remove_dir_all(dir.path().join("cq")).unwrap();
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let e = open(dir.path(), &clock);
    e.close().unwrap();
    let after = snapshot(dir.path());
    let keys =
        |m: &std::collections::BTreeMap<std::path::PathBuf, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&before), keys(&after));
    for (k, v) in &before {
        assert!(after[k] == *v, "{} differs after rebuild", k.display());
    }
    assert!(slots(dir.path()) == slots_before, "the rebuilt index holds different messages");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Messages produced over time, the broker down from `down` on, then one catch-up: what
    /// it makes ready comes out in due order, whatever stage of its chain each message was at.
    #[test]
    fn a_catch_up_makes_chained_messages_ready_in_due_order(
        msgs in proptest::collection::vec((0u64..400_000, 0u64..60_000), 1..40),
        down in 0u64..300_000,
        downtime in 1u64..600_000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::at_ms(T0));
        let mut e = open(dir.path(), &clock);
        let mut sorted = msgs.clone();
        sorted.sort_by_key(|m| m.1);
        let mut before = 0;
        for (i, (delay, at)) in sorted.iter().enumerate() {
            before += run_until(&mut e, &clock, T0 + at, 1_000).len();
            e.produce("t", req(&format!("m{i}"), When::DelayMs(*delay))).unwrap();
        }
        before += run_until(&mut e, &clock, T0 + down.max(sorted.last().map_or(0, |m| m.1)), 1_000).len();
        let up = clock.now_ms_for_tests() + downtime;
        clock.set_ms(up);
        while e.run_due(usize::MAX).unwrap() > 0 {}
        let due: Vec<u64> = e.pop(&topics("t"), 1000, None).unwrap().iter().map(|d| d.deliver_at_ms).collect();
        prop_assert!(due.iter().all(|d| *d <= up));
        prop_assert!(due.windows(2).all(|w| w[0] <= w[1]), "made ready out of due order: {:?}", due);
        let overdue = sorted.iter().filter(|(d, at)| T0 + at + d <= up).count();
        prop_assert_eq!(before + due.len(), overdue);
    }

    #[test]
    fn never_early_and_on_time_for_random_chained_delays(
        msgs in proptest::collection::vec((0u64..8_000_000, 0u64..5_000), 1..25),
        step in 50u64..600_000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::at_ms(T0));
        let mut e = open(dir.path(), &clock);
        let mut due = std::collections::HashMap::new();
        let mut sorted = msgs.clone();
        sorted.sort_by_key(|m| m.1);
        let mut got = vec![];
        for (i, (delay, at)) in sorted.iter().enumerate() {
            // A consumer polls all along, so messages that come due while others are still being
            // produced are popped at their due time, not when production ends.
            got.extend(run_until(&mut e, &clock, T0 + at, step));
            let id = format!("m{i}");
            e.produce("t", req(&id, When::DelayMs(*delay))).unwrap();
            due.insert(id, T0 + at + delay);
        }
        let end = T0 + 5_000 + 8_000_000 + 10;
        got.extend(run_until(&mut e, &clock, end, step));
        prop_assert_eq!(got.len(), due.len());
        for (id, deliver_at, popped) in got {
            prop_assert_eq!(deliver_at, due[&id]);
            prop_assert!(popped >= deliver_at, "{} popped at {} before {}", id, popped, deliver_at);
            // The clock jumps to each due time, as the engine's sleep does: delivery is exact.
            prop_assert_eq!(popped, deliver_at, "{} late", id);
        }
    }
}

#[test]
fn removed_levels_drain_after_a_config_change() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    {
        let mut e = open(dir.path(), &clock);
        e.produce("t", req("chained", When::DelayMs(3_725_250))).unwrap();
        e.produce("t", req("level", When::LevelIndex(4))).unwrap();
        e.close().unwrap();
    }
    // The new list drops 1h, 30s and 1s; entries already on those queues still fire on time,
    // and later hops use the new levels.
    let mut cfg = config(dir.path());
    cfg.levels_ms = vec![2_000, 60_000, 600_000];
    let mut e = Engine::open(cfg, clock.clone(), Arc::new(Metrics::default())).unwrap().0;
    let got = run_until(&mut e, &clock, T0 + 4_000_000, 1 << 40);
    let mut got: Vec<(String, u64, u64)> = got;
    got.sort();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], ("chained".into(), T0 + 3_725_250, T0 + 3_725_250));
    assert_eq!(got[1], ("level".into(), T0 + 30_000, T0 + 30_000));
}

#[test]
fn round_policy_uses_the_nearest_level() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut cfg = config(dir.path());
    cfg.delay_policy = crate::config::DelayPolicy::Round;
    let mut e = Engine::open(cfg, clock.clone(), Arc::new(Metrics::default())).unwrap().0;
    let p = e.produce("t", req("r", When::DelayMs(4_200))).unwrap();
    assert_eq!(p.deliver_at_ms, T0 + 5_000);
    let got = run_until(&mut e, &clock, T0 + 10_000, 1 << 40);
    assert_eq!(got, vec![("r".to_string(), T0 + 5_000, T0 + 5_000)]);
}

#[test]
fn receipts_carry_a_tag_that_only_this_data_directory_accepts() {
    let a = Receipts::new(b"key one");
    let b = Receipts::new(b"key two");
    let r = a.encode(4096, 7);
    assert_eq!(a.decode(&r).unwrap(), (4096, 7));
    assert!(b.decode(&r).is_err(), "another key's receipt is refused");
    for i in 0..r.len() {
        let mut bytes = r.clone().into_bytes();
        bytes[i] = if bytes[i] == b'0' { b'1' } else { b'0' };
        let forged = String::from_utf8(bytes).unwrap();
        assert!(a.decode(&forged).is_err(), "one changed digit ({i}) must be refused: {forged}");
    }
    assert!(a.decode(&r[..24]).is_err(), "the unsigned layout is refused");
}

fn with_body(id: &str, body: &str, when: When) -> ProduceRequest {
    ProduceRequest { body: Bytes::from(body.to_string()), ..req(id, when) }
}

/// Pops everything ready in `topic` and acks it; returns (id, body).
fn drain(e: &mut Engine, topic: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    for d in e.pop(&topics(topic), 1000, None).unwrap() {
        e.ack(&d.receipt).unwrap();
        out.push((d.id, String::from_utf8_lossy(&d.body).into_owned()));
    }
    out
}

#[test]
fn a_replacing_produce_wins_over_every_state_of_the_old_message_and_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    // Pending (delayed) -> replaced with a new topic, body and delay.
    e.produce("t", with_body("a", "a1", When::DelayMs(5_000))).unwrap();
    e.replace("u", with_body("a", "a2", When::DelayMs(1_000))).unwrap();
    // Reserved -> replaced: the consumer's receipt is dead.
    e.produce("t", with_body("b", "b1", When::Now)).unwrap();
    let held = e.pop(&topics("t"), 10, None).unwrap();
    assert_eq!(held.len(), 1);
    e.replace("t", with_body("b", "b2", When::DelayMs(2_000))).unwrap();
    assert!(e.ack(&held[0].receipt).is_err(), "the replaced delivery's receipt must be refused");
    // Done -> a new message.
    e.produce("t", with_body("c", "c1", When::Now)).unwrap();
    assert_eq!(drain(&mut e, "t"), vec![("c".to_string(), "c1".to_string())]);
    e.replace("t", with_body("c", "c2", When::Now)).unwrap();
    // Dead -> a new message in the main topic.
    e.produce("t", ProduceRequest { max_attempts: Some(1), ..with_body("d", "d1", When::Now) }).unwrap();
    let got = e.pop(&topics("t"), 10, None).unwrap();
    let d = got.iter().find(|m| m.id == "d").unwrap();
    assert!(matches!(e.nack(&d.receipt, Some(0)).unwrap(), Nacked::DeadLettered { .. }));
    for m in got.iter().filter(|m| m.id != "d") {
        e.ack(&m.receipt).unwrap();
    }
    e.replace("t", with_body("d", "d2", When::Now)).unwrap();
    assert_eq!(e.get("d").unwrap().state, MessageState::Ready);
    assert!(e.pop(&topics("t.dlq"), 10, None).unwrap().is_empty(), "the dead copy must be gone");
    // The same replacing request twice is two pushes: the second replaces the first.
    e.replace("t", with_body("c", "c3", When::Now)).unwrap();
    e.flush().unwrap();
    drop(e);

    // After a reopen (a replay of the log past the checkpoint) only the latest of each id is there.
    let mut e = open(dir.path(), &clock);
    assert_eq!(e.get("a").unwrap().topic, "u");
    let mut seen = drain(&mut e, "t");
    clock.set_ms(T0 + 3_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    seen.extend(drain(&mut e, "t"));
    seen.extend(drain(&mut e, "u"));
    seen.sort();
    let want: Vec<(String, String)> = [("a", "a2"), ("b", "b2"), ("c", "c3"), ("d", "d2")]
        .iter()
        .map(|(i, b)| (i.to_string(), b.to_string()))
        .collect();
    assert_eq!(seen, want, "only the replacing messages are delivered, once each");
    clock.set_ms(T0 + 60_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert!(
        drain(&mut e, "t").is_empty() && drain(&mut e, "u").is_empty() && drain(&mut e, "t.dlq").is_empty()
    );
}

#[test]
fn a_refused_replacing_produce_leaves_the_old_message_alone() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", with_body("a", "a1", When::DelayMs(1_000))).unwrap();
    let r = e.replace("t", ProduceRequest { ttr_ms: Some(0), ..with_body("a", "a2", When::Now) });
    assert!(r.is_err());
    assert_eq!(e.get("a").unwrap().state, MessageState::Delayed);
    clock.set_ms(T0 + 1_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(drain(&mut e, "t"), vec![("a".to_string(), "a1".to_string())]);
}

#[test]
fn delays_count_from_the_receive_time_rounded_up_for_produce_and_nack() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    // 0.4 ms into a millisecond: a 1 s delay is due 1 s after the next whole millisecond.
    clock.set_us(T0 * 1000 + 400);
    let p = e.produce("t", req("r", When::DelayMs(1000))).unwrap();
    assert_eq!(p.deliver_at_ms, T0 + 1 + 1000);
    let ready = e.produce("t", req("now", When::Now)).unwrap();
    assert_eq!(ready.deliver_at_ms, T0, "ready at once: visible from the receive time");
    let got = e.pop(&topics("t"), 1, None).unwrap();
    clock.set_us((T0 + 5) * 1000 + 1);
    match e.nack(&got[0].receipt, Some(250)).unwrap() {
        Nacked::Retry { deliver_at_ms } => assert_eq!(deliver_at_ms, T0 + 6 + 250),
        other => panic!("{other:?}"),
    }
    assert_eq!(e.get("now").unwrap().deliver_at_ms, T0 + 6 + 250);
}

fn level_backlog(e: &mut Engine, level_ms: u64) -> u64 {
    e.stats().levels.iter().find(|l| l.level_ms == level_ms).map_or(0, |l| l.backlog)
}

fn topic_ready(e: &mut Engine, topic: &str) -> u64 {
    e.stats().topics.iter().find(|t| t.topic == topic).map_or(0, |t| t.ready)
}

#[test]
fn stats_count_only_the_entries_of_live_messages() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);

    // Cancelled while delayed: its timer stays in the 5 s queue but is not counted.
    e.produce("t", req("d1", When::DelayMs(5_000))).unwrap();
    e.produce("t", req("d2", When::DelayMs(5_000))).unwrap();
    assert_eq!(level_backlog(&mut e, 5_000), 2);
    e.cancel("d1").unwrap();
    assert_eq!(level_backlog(&mut e, 5_000), 1);

    // Ready, then cancelled or finished by id: the topic entry is not counted.
    for id in ["r1", "r2", "r3"] {
        e.produce("t", req(id, When::Now)).unwrap();
    }
    assert_eq!(topic_ready(&mut e, "t"), 3);
    e.cancel("r1").unwrap();
    e.ack_id("r2").unwrap();
    assert_eq!(topic_ready(&mut e, "t"), 1);

    // Popped, then acked before its time-to-run: the reservation's timer is not counted.
    let got = e.pop(&topics("t"), 10, Some(30_000)).unwrap();
    assert_eq!(got.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["r3"]);
    assert_eq!(topic_ready(&mut e, "t"), 0);
    assert_eq!(level_backlog(&mut e, 30_000), 1, "a live reservation's timer counts");
    e.ack(&got[0].receipt).unwrap();
    assert_eq!(level_backlog(&mut e, 30_000), 0);

    // d2 falls due; popped and nacked for an immediate retry, it is ready again, and the timer of
    // the reservation it left is not counted.
    clock.set_ms(T0 + 5_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(level_backlog(&mut e, 5_000), 0);
    let got = e.pop(&topics("t"), 10, Some(30_000)).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(e.nack(&got[0].receipt, Some(0)).unwrap(), Nacked::Retry { deliver_at_ms: T0 + 5_000 });
    assert_eq!(level_backlog(&mut e, 30_000), 0);
    assert_eq!(topic_ready(&mut e, "t"), 1);

    // The entries left behind are skipped when reached, and nothing is subtracted twice.
    clock.set_ms(T0 + 40_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    let stats = e.stats();
    assert!(stats.levels.iter().all(|l| l.backlog == 0), "{:?}", stats.levels);
    assert_eq!(topic_ready(&mut e, "t"), 1);
    e.produce("t", req("d3", When::DelayMs(30_000))).unwrap();
    assert_eq!(level_backlog(&mut e, 30_000), 1);
}

#[test]
fn a_cancelled_timer_that_already_hopped_counts_until_its_hop_falls_due() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    // 7 s: 5 s on the 5 s level, then hops on the 1 s level.
    e.produce("t", req("h", When::DelayMs(7_000))).unwrap();
    clock.set_ms(T0 + 5_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(level_backlog(&mut e, 1_000), 1);
    e.cancel("h").unwrap();
    // The slot does not say where the hop went: documented, and bounded by the level's length.
    assert_eq!(level_backlog(&mut e, 1_000), 1);
    clock.set_ms(T0 + 6_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(level_backlog(&mut e, 1_000), 0);
}

#[test]
fn timers_fired_again_after_a_crash_do_not_hop_twice() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    // 3h 7s: 2 h on the 2 h level, 1 h on the 1 h level, then 5 s, then 1 s twice.
    e.produce("t", req("h", When::DelayMs(3 * 3_600_000 + 7_000))).unwrap();
    e.produce("t", req("other", When::DelayMs(3 * 3_600_000 + 7_000))).unwrap();
    e.checkpoint().unwrap();
    clock.set_ms(T0 + 2 * 3_600_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    clock.set_ms(T0 + 3 * 3_600_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    e.cancel("other").unwrap();
    assert_eq!(hops_of(&e, "h"), vec![7_200_000, 3_600_000, 5_000]);
    // A crash: no checkpoint since the produce, so both level entries fire again after the
    // restart; the Hops they wrote before it are replayed.
    drop(e);
    let mut e = open(dir.path(), &clock);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    assert_eq!(hops_of(&e, "h"), vec![7_200_000, 3_600_000, 5_000], "no second chain");
    let got = run_until(&mut e, &clock, T0 + 3 * 3_600_000 + 20_000, 1_000);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, "h");
    assert_eq!(got[0].1, T0 + 3 * 3_600_000 + 7_000);
    assert_eq!(hops_of(&e, "h"), vec![7_200_000, 3_600_000, 5_000, 1_000, 1_000]);
    // Every timer ended, so nothing is remembered for them any more.
    assert!(e.store_for_tests().replayed_hops_left() == 0);
}

/// The body checks each path may make (issue 26): a pop checks the body it hands out once; an
/// ack, a nack and a cancel never check (nor read) a body, whatever way the message became ready.
#[test]
fn a_pop_checks_the_body_once_and_ack_nack_cancel_never_do() {
    use crate::storage::format::body_checks;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let big = |id: &str, when| with_body(id, &"x".repeat(32 << 10), when);
    // Due now (its Put is the topic entry), and due later (a Transition makes it ready).
    e.produce("t", big("now", When::Now)).unwrap();
    e.produce("t", big("later", When::DelayMs(1_000))).unwrap();
    e.produce("t", big("gone", When::DelayMs(60_000))).unwrap();
    clock.set_ms(T0 + 1_000);
    while e.run_due(usize::MAX).unwrap() > 0 {}
    body_checks::take();
    for expect in ["now", "later"] {
        let d = e.pop(&topics("t"), 1, None).unwrap().remove(0);
        assert_eq!(d.id, expect);
        assert_eq!(body_checks::take(), 1, "pop of {expect}");
        if expect == "now" {
            e.ack(&d.receipt).unwrap();
            assert_eq!(body_checks::take(), 0, "ack");
        } else {
            e.nack(&d.receipt, Some(1)).unwrap();
            assert_eq!(body_checks::take(), 0, "nack");
        }
    }
    e.cancel("gone").unwrap();
    assert_eq!(body_checks::take(), 0, "cancel");
    e.ack_id("later").unwrap();
    assert_eq!(body_checks::take(), 0, "ack by id");
}
