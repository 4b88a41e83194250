//! Reclaim tests on a manual clock: expiry, carrying forward, segment and queue-file deletion, and
//! a model of the whole store under random operations with crashes.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;

use crate::config::BrokerConfig;
use crate::engine::Engine;
use crate::error::Error;
use crate::message::{MessageState, ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::{Clock, ManualClock};

const T0: u64 = 1_700_000_000_000;
const RETENTION_MS: u64 = 10_000;

fn config(dir: &std::path::Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 64 << 10;
    c.cq_entries_per_file = 64;
    c.index_initial_slots = 64;
    c.done_retention_ms = RETENTION_MS;
    c.default_ttr_ms = c.max_delay_ms;
    c.default_max_attempts = 10_000;
    c
}

fn open(dir: &std::path::Path, clock: &Arc<ManualClock>) -> Engine {
    Engine::open(config(dir), clock.clone(), Arc::new(Metrics::default())).unwrap().0
}

fn req(id: &str, body_len: usize, when: When) -> ProduceRequest {
    let mut body = format!("body of {id} ").into_bytes();
    body.resize(body_len.max(body.len()), b'.');
    ProduceRequest {
        id: Some(id.to_string()),
        body: Bytes::from(body),
        when,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

/// The model test's topics: few enough that they empty (and are forgotten) often, more than its
/// `open_queues`, so queues are closed and reopened too.
fn model_topics() -> Vec<String> {
    (0..3).map(|t| format!("t{t}")).collect()
}

fn topics() -> Vec<String> {
    vec!["t".to_string()]
}

/// Fires due timers and lets reclaim run to rest, with a durable checkpoint in between (as the
/// broker's checkpointer does every few seconds).
fn settle(e: &mut Engine) {
    settle_with(e, true)
}

/// Like [`settle`]; without checkpoints, carried messages wait for a checkpoint before their old
/// segment can go, which is the window a crash must survive.
fn settle_with(e: &mut Engine, checkpoints: bool) {
    while e.run_due(usize::MAX).unwrap() > 0 {}
    for _ in 0..10_000 {
        e.maintain().unwrap();
        if checkpoints {
            e.checkpoint().unwrap();
        }
        if !e.maintenance_due() {
            break;
        }
    }
}

/// Segment files holding data: the next segment, made ahead while the active one fills up, holds
/// only zeroes until the log rolls into it.
fn segment_files(dir: &std::path::Path) -> usize {
    let has_data = |p: std::path::PathBuf| std::fs::read(p).unwrap().iter().any(|b| *b != 0);
    std::fs::read_dir(dir.join("commitlog")).unwrap().filter(|e| has_data(e.as_ref().unwrap().path())).count()
}

#[test]
fn done_ids_expire_after_the_retention_and_may_be_produced_again() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    e.produce("t", req("a", 10, When::Now)).unwrap();
    e.produce("t", req("c", 10, When::DelayMs(60_000))).unwrap();
    let d = e.pop(&topics(), 10, None).unwrap();
    e.ack(&d[0].receipt).unwrap();
    e.cancel("c").unwrap();
    clock.advance_ms(RETENTION_MS - 1);
    settle(&mut e);
    assert_eq!(e.get("a").unwrap().state, MessageState::Done, "still within the retention");
    assert!(!e.produce("t", req("a", 10, When::Now)).unwrap().created, "idempotent within the retention");
    clock.advance_ms(2);
    settle(&mut e);
    assert!(matches!(e.get("a"), Err(Error::NotFound(_))));
    assert!(matches!(e.get("c"), Err(Error::NotFound(_))));
    // The id is free: a different body is a new message, not a conflict.
    let p = e.produce("t", req("a", 99, When::Now)).unwrap();
    assert!(p.created);
    let d = e.pop(&topics(), 10, None).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].body.len(), 99);
    // The cancelled message's timer finds nothing and fires nothing.
    clock.advance_ms(60_000);
    settle(&mut e);
    assert!(e.pop(&topics(), 10, None).unwrap().is_empty());
    // Expiry survives a restart without its index: the rebuilt index forgets the same ids.
    drop(e);
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let mut e = open(dir.path(), &clock);
    settle(&mut e);
    assert!(matches!(e.get("c"), Err(Error::NotFound(_))));
    assert_eq!(e.get("a").unwrap().state, MessageState::Reserved);
}

/// An open finds an index slot ahead of the log but not a missing one, so a slot is removed only
/// once the final record it expires on is durable: before that, a power cut could keep the removal
/// and lose the record (the model found it: the message's topic then counted it as ready forever).
/// Both removals wait: the expiry walk's, and reclaim's for a final message in the segment it
/// frees (it carries the message instead). Readers see it expired on time all the same.
#[test]
fn expired_slots_leave_the_index_only_once_their_final_record_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let later = || When::DelayMs(600_000);
    // The first segment: fillers, then the five messages; more fillers start the next segment.
    let (fill, n) = (110, 5);
    for i in 0..fill {
        if i == 50 {
            for m in 0..n {
                e.produce("t", req(&format!("m{m}"), 1000, later())).unwrap();
            }
        }
        e.produce("t", req(&format!("f{i}"), 1000, later())).unwrap();
    }
    e.flush().unwrap();
    e.checkpoint().unwrap();
    assert!(e.store_for_tests().log_disk_bytes() > 64 << 10, "the Puts fill more than one segment");
    // The fillers' cancels are durable; the messages' are not.
    for i in 0..fill {
        e.cancel(&format!("f{i}")).unwrap();
    }
    e.flush().unwrap();
    for m in 0..n {
        e.cancel(&format!("m{m}")).unwrap();
    }
    clock.advance_ms(RETENTION_MS + 1);
    settle_with(&mut e, false);
    assert!(matches!(e.get("m0"), Err(Error::NotFound(_))), "expired for readers on time");
    assert_eq!(e.store_for_tests().index_len(), n, "only slots whose final record is durable removed");
    e.flush().unwrap();
    settle_with(&mut e, false);
    assert_eq!(e.store_for_tests().index_len(), 0, "removed once the log is synced");
}

#[test]
fn long_delays_are_carried_forward_and_old_segments_and_queue_files_are_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let ten_days = 10 * 86_400_000;
    e.produce("t", req("long", 500, When::DelayMs(ten_days))).unwrap();
    e.produce("t", req("ready", 500, When::Now)).unwrap();
    let mut max_segments = 0;
    // 2,000 short messages of ~1 KiB, each delivered and acked: ~30 segments of history.
    for round in 0..200u64 {
        for i in 0..10 {
            e.produce("t", req(&format!("s{round}-{i}"), 1000, When::DelayMs(1_000))).unwrap();
        }
        clock.advance_ms(1_000);
        while e.run_due(usize::MAX).unwrap() > 0 {}
        for d in e.pop(&["u".to_string()], 100, None).unwrap() {
            e.ack(&d.receipt).unwrap();
        }
        // "ready" sits unpopped in topic t; the short ones go through topic t as well.
        let ds = e.pop(&topics(), 100, None).unwrap();
        for d in ds {
            if d.id == "ready" {
                e.nack(&d.receipt, Some(0)).unwrap();
            } else {
                e.ack(&d.receipt).unwrap();
            }
        }
        settle(&mut e);
        max_segments = max_segments.max(segment_files(dir.path()));
    }
    clock.advance_ms(RETENTION_MS + 1);
    settle(&mut e);
    let store = e.store_for_tests();
    let stats = store.reclaim_stats();
    assert!(stats.segments_deleted >= 20, "{stats:?}");
    assert!(stats.carried >= 1, "the long delay was carried: {stats:?}");
    assert!(stats.queue_files_deleted > 0, "{stats:?}");
    assert!(max_segments <= 6, "the log stayed small: at most {max_segments} segments");
    assert!(store.log_start().get() > 0);
    let live = store.live_bytes();
    assert!(live < 4_000, "only two messages are live: {live} bytes");
    assert_eq!(e.get("long").unwrap().state, MessageState::Delayed);
    assert_eq!(e.get("ready").unwrap().state, MessageState::Ready);
    // Its history starts at the Carry: the records before it went with their segments.
    let (h, complete) = e.history("long").unwrap();
    assert_eq!((h.iter().map(|x| x.event).collect::<Vec<_>>(), complete), (vec!["carried"], false));
    // After a restart the carried message is still there and fires on time, never early.
    drop(e);
    let mut e = open(dir.path(), &clock);
    let due = T0 + ten_days;
    let ds = e.pop(&topics(), 100, None).unwrap();
    assert_eq!(ds.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), vec!["ready"]);
    e.ack(&ds[0].receipt).unwrap();
    loop {
        let next = e.next_due().expect("the long delay still has a timer");
        assert!(next <= due);
        clock.set_ms(next.max(clock.now_ms()));
        while e.run_due(usize::MAX).unwrap() > 0 {}
        let ds = e.pop(&topics(), 100, None).unwrap();
        if let Some(d) = ds.first() {
            assert_eq!((d.id.as_str(), d.deliver_at_ms), ("long", due));
            assert_eq!(clock.now_ms(), due, "fired exactly on time");
            break;
        }
        settle(&mut e);
    }
}

#[test]
fn one_durable_checkpoint_frees_a_run_of_empty_segments() {
    // A busy log fills segments faster than checkpoints come (4 MiB every ~3 s at 600 msgs/s of
    // 2 KiB, checkpoints every 5 s): freeing one segment per checkpoint would let it grow forever.
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    for i in 0..600 {
        e.produce("t", req(&format!("m{i}"), 1000, When::Now)).unwrap();
    }
    for d in e.pop(&topics(), 1000, None).unwrap() {
        e.ack(&d.receipt).unwrap();
    }
    e.produce("t", req("tail", 10, When::Now)).unwrap();
    let before = segment_files(dir.path());
    assert!(before >= 8, "enough history: {before} segments");
    clock.advance_ms(RETENTION_MS + 1);
    e.checkpoint().unwrap();
    settle_with(&mut e, false);
    let freed = e.store_for_tests().reclaim_stats().segments_deleted;
    assert!(freed == 0, "nothing is deleted before a checkpoint covers the decision: {freed}");
    e.checkpoint().unwrap();
    settle_with(&mut e, false);
    let after = segment_files(dir.path());
    assert!(after <= 2, "one checkpoint freed {before} -> {after} segments");
    assert_eq!(e.get("tail").unwrap().state, MessageState::Ready);
    assert!(matches!(e.get("m0"), Err(Error::NotFound(_))));
}

#[test]
fn final_messages_that_pin_a_log_over_its_bound_are_carried_and_still_expire_on_time() {
    // One message in ten of every segment is acked half a retention after the rest: once the rest
    // expire, those few would pin every segment for another half retention while the log is ten
    // times the live set. Carried, they keep the time they became final.
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    for i in 0..600 {
        e.produce("t", req(&format!("m{i}"), 1000, When::Now)).unwrap();
    }
    let mut late = Vec::new();
    for d in e.pop(&topics(), 1000, None).unwrap() {
        let n: usize = d.id[1..].parse().unwrap();
        if n.is_multiple_of(10) {
            late.push(d);
        } else {
            e.ack(&d.receipt).unwrap();
        }
    }
    e.produce("t", req("tail", 10, When::Now)).unwrap();
    let before = segment_files(dir.path());
    assert!(before >= 9, "enough history: {before} segments");
    clock.advance_ms(RETENTION_MS / 2);
    for d in &late {
        e.ack(&d.receipt).unwrap();
    }
    let late_final = clock.now_ms();
    settle(&mut e);
    assert_eq!(e.store_for_tests().reclaim_stats().carried, 0, "within the retention everything is live");
    clock.advance_ms(RETENTION_MS / 2 + 1);
    settle(&mut e);
    let stats = e.store_for_tests().reclaim_stats();
    let after = segment_files(dir.path());
    assert!(after <= 3, "{before} -> {after} segments ({stats:?})");
    assert!(stats.carried >= late.len() as u64, "the late-acked messages were carried: {stats:?}");
    assert!(matches!(e.get("m1"), Err(Error::NotFound(_))));
    for d in &late {
        assert_eq!(e.get(&d.id).unwrap().state, MessageState::Done, "{} still within its retention", d.id);
    }
    // Carried, and then found again from the log alone.
    drop(e);
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let mut e = open(dir.path(), &clock);
    settle(&mut e);
    assert_eq!(e.get(&late[0].id).unwrap().state, MessageState::Done);
    assert!(
        !e.produce("t", req(&late[0].id, 1000, When::Now)).unwrap().created,
        "idempotent within the retention"
    );
    // They expire at their own final time plus the retention, not at the carry's.
    clock.set_ms(late_final + RETENTION_MS - 1);
    assert_eq!(e.get(&late[1].id).unwrap().state, MessageState::Done);
    clock.set_ms(late_final + RETENTION_MS);
    for d in &late {
        assert!(matches!(e.get(&d.id), Err(Error::NotFound(_))), "{} expired", d.id);
    }
    assert!(e.produce("t", req(&late[2].id, 99, When::Now)).unwrap().created, "the id is free again");
    settle(&mut e);
    assert!(matches!(e.get(&late[3].id), Err(Error::NotFound(_))));
    let ds = e.pop(&topics(), 10, None).unwrap();
    // Carrying a ready message puts it at the back of its topic queue: compare as a set.
    let mut got: Vec<(&str, usize)> = ds.iter().map(|d| (d.id.as_str(), d.body.len())).collect();
    got.sort();
    let mut want = vec![("tail", e.get("tail").unwrap().body.len()), (late[2].id.as_str(), 99)];
    want.sort();
    assert_eq!(got, want, "the new message, not the expired one");
    assert_eq!(e.store_for_tests().live_bytes(), e.store_for_tests().count_live_bytes());
}

/// What the model expects of one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Deliverable from this time on.
    Pending(u64),
    /// Popped; the receipt index says which delivery.
    Reserved,
    /// Acked or cancelled at this time.
    Final(u64),
}

#[derive(Debug, Clone)]
enum Op {
    Produce {
        id: u8,
        delay_s: u64,
        body: usize,
    },
    Advance {
        ms: u64,
        checkpoint: bool,
    },
    Pop,
    Ack {
        pick: usize,
    },
    Nack {
        pick: usize,
        delay_s: u64,
    },
    Cancel {
        id: u8,
    },
    /// Capture a checkpoint for a later `Durable`, as the broker hands one to its checkpoint thread.
    Capture,
    /// Run the oldest captured checkpoint and report it durable.
    Durable,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..40, prop_oneof![Just(0u64), 1u64..10, 100u64..100_000], 10usize..3000)
            .prop_map(|(id, delay_s, body)| Op::Produce { id, delay_s, body }),
        3 => (prop_oneof![1u64..2_000, 5_000u64..30_000, 1_000_000u64..5_000_000], any::<bool>())
            .prop_map(|(ms, checkpoint)| Op::Advance { ms, checkpoint }),
        3 => Just(Op::Pop),
        3 => any::<usize>().prop_map(|pick| Op::Ack { pick }),
        1 => (any::<usize>(), 0u64..5).prop_map(|(pick, delay_s)| Op::Nack { pick, delay_s }),
        1 => (0u8..40).prop_map(|id| Op::Cancel { id }),
        1 => Just(Op::Capture),
        1 => Just(Op::Durable),
        1 => Just(Op::Crash),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::test_support::model_cases(32), ..ProptestConfig::default() })]

    /// Random produce/pop/ack/nack/cancel/time steps with reclaim running, crashes (the engine
    /// dropped without a clean close, as SIGKILL leaves it) and reopens: what the store delivers
    /// and reports always matches the model of acknowledged operations.
    #[test]
    fn the_store_with_reclaim_and_crashes_matches_the_model(ops in proptest::collection::vec(op(), 1..150)) {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::at_ms(T0));
        let small = |dir: &std::path::Path, clock: &Arc<ManualClock>| {
            // Small segments, so a short run rolls and reclaims many of them; small queue files, so
            // read ones are deleted often; two open topic queues for three topics.
            let c =
                BrokerConfig { segment_bytes: 16 << 10, cq_entries_per_file: 4, open_queues: 2, ..config(dir) };
            Engine::open(c, clock.clone(), Arc::new(Metrics::default())).unwrap().0
        };
        let mut e = small(dir.path(), &clock);
        let mut deleted = 0;
        let mut model: BTreeMap<String, Expect> = BTreeMap::new();
        let mut receipts: Vec<(String, String)> = vec![];
        let mut gen: BTreeMap<String, u32> = BTreeMap::new();
        // At most two, like the broker: one being made durable, one captured meanwhile.
        let mut captured: std::collections::VecDeque<crate::storage::checkpoint::CheckpointJob> =
            std::collections::VecDeque::new();
        for op in ops {
            let op_name = format!("{op:?}");
            let now = clock.now_ms();
            match op {
                Op::Produce { id: id_n, delay_s, body } => {
                    let id = format!("m{id_n}");
                    let expired = matches!(model.get(&id), Some(Expect::Final(t)) if now >= t + RETENTION_MS);
                    let fresh = !model.contains_key(&id) || expired;
                    // A new generation gets a new body, so a stale id with new content is a conflict.
                    let g = *gen.entry(id.clone()).and_modify(|g| if fresh { *g += 1 }).or_insert(0);
                    // The topic follows from the id, so a repeated id names the same topic.
                    let topic = &model_topics()[usize::from(id_n) % 3];
                    let r = e.produce(topic, req(&format!("{id}-{g}"), body, When::DelayMs(delay_s * 1000)).with_id(&id));
                    if fresh {
                        let p = r.unwrap();
                        prop_assert!(p.created, "{id} is new");
                        model.insert(id, Expect::Pending(now + delay_s * 1000));
                    } else {
                        // A remembered id: an idempotent answer or a conflict, never a new message.
                        prop_assert!(r.map(|p| !p.created).unwrap_or(true));
                    }
                }
                Op::Advance { ms, checkpoint } => {
                    clock.advance_ms(ms);
                    if checkpoint {
                        // Checkpoints are written in the order they were captured.
                        for job in captured.drain(..) {
                            let cp = job.checkpoint.clone();
                            job.run().unwrap();
                            e.checkpoint_durable(&cp);
                        }
                    }
                    settle_with(&mut e, checkpoint);
                }
                Op::Pop => {
                    for d in e.pop(&model_topics(), 100, None).unwrap() {
                        let exp = model.get(&d.id).copied();
                        match exp {
                            Some(Expect::Pending(at)) => {
                                prop_assert!(now >= at, "{} delivered early: now {now}, due {at}", d.id);
                                prop_assert!(d.deliver_at_ms >= at);
                            }
                            other => prop_assert!(false, "{} delivered while {other:?}", d.id),
                        }
                        model.insert(d.id.clone(), Expect::Reserved);
                        receipts.push((d.id, d.receipt));
                    }
                }
                Op::Ack { pick } => {
                    if !receipts.is_empty() {
                        let (id, receipt) = receipts.remove(pick % receipts.len());
                        if model.get(&id) == Some(&Expect::Reserved) {
                            e.ack(&receipt).unwrap();
                            model.insert(id, Expect::Final(now));
                        } else {
                            prop_assert!(e.ack(&receipt).is_err());
                        }
                    }
                }
                Op::Nack { pick, delay_s } => {
                    if !receipts.is_empty() {
                        let (id, receipt) = receipts.remove(pick % receipts.len());
                        if model.get(&id) == Some(&Expect::Reserved) {
                            e.nack(&receipt, Some(delay_s * 1000)).unwrap();
                            model.insert(id, Expect::Pending(now + delay_s * 1000));
                        }
                    }
                }
                Op::Cancel { id } => {
                    let id = format!("m{id}");
                    match model.get(&id).copied() {
                        Some(Expect::Pending(_)) | Some(Expect::Reserved) => {
                            e.cancel(&id).unwrap();
                            model.insert(id.clone(), Expect::Final(now));
                            receipts.retain(|(r, _)| *r != id);
                        }
                        Some(Expect::Final(t)) if now < t + RETENTION_MS => {
                            // Already final and still remembered: never resurrected.
                            let _ = e.cancel(&id);
                        }
                        _ => {}
                    }
                }
                Op::Capture => {
                    if captured.len() < 2 {
                        captured.push_back(e.checkpoint_job().unwrap());
                    }
                }
                Op::Durable => {
                    if let Some(job) = captured.pop_front() {
                        let cp = job.checkpoint.clone();
                        job.run().unwrap();
                        e.checkpoint_durable(&cp);
                    }
                }
                Op::Crash => {
                    // Captured checkpoints die with the process, never written.
                    captured.clear();
                    deleted += e.store_for_tests().reclaim_stats().segments_deleted;
                    drop(e);
                    e = small(dir.path(), &clock);
                    // The broker's loop runs reclaim at once after a start.
                    settle_with(&mut e, false);
                }
            }
            // Carries, expiry, crashes and rebuilds from a reclaimed log keep the state counts exact.
            let store = e.store_for_tests();
            prop_assert_eq!(store.state_counts(), store.recount_states().unwrap(), "after {}", op_name);
            // So do the per-segment counts that decide whether reclaim scans at all.
            let differ = store.segment_counts_differ();
            prop_assert!(differ.is_none(), "segment counts after {}: {:?}", op_name, differ);
            // Every remembered id answers as the model says.
            let now = clock.now_ms();
            for (id, exp) in &model {
                let got = e.get(id);
                match exp {
                    // Time only moves with a reclaim round after it, so expiry is exact.
                    Expect::Final(t) if now >= t + RETENTION_MS => {
                        prop_assert!(matches!(got, Err(Error::NotFound(_))), "{id} outlived its retention: {got:?}");
                    }
                    Expect::Final(_) => {
                        let info = got.unwrap();
                        prop_assert!(matches!(info.state, MessageState::Done | MessageState::Cancelled), "{id}: {:?}", info.state);
                    }
                    Expect::Reserved => prop_assert_eq!(got.unwrap().state, MessageState::Reserved),
                    Expect::Pending(_) => {
                        let s = got.unwrap().state;
                        prop_assert!(matches!(s, MessageState::Delayed | MessageState::Ready), "{id}: {s:?}");
                    }
                }
            }
        }
        // Drain: everything pending is delivered exactly once, on time; nothing final comes back.
        // The clock may already be past every due time, so the first round pops at the current time.
        let last_due = model.values().filter_map(|x| match x { Expect::Pending(at) => Some(*at), _ => None }).max();
        while let Some(last) = last_due {
            settle(&mut e);
            for d in e.pop(&model_topics(), 1000, None).unwrap() {
                let now = clock.now_ms();
                match model.get(&d.id).copied() {
                    Some(Expect::Pending(at)) => prop_assert!(now >= at, "{} early", d.id),
                    other => prop_assert!(false, "{} delivered while {other:?}", d.id),
                }
                e.ack(&d.receipt).unwrap();
                model.insert(d.id.clone(), Expect::Final(now));
            }
            if !model.values().any(|x| matches!(x, Expect::Pending(_))) || clock.now_ms() > last + 60_000 {
                break;
            }
            clock.set_ms((clock.now_ms() + 600_000).min(last + 60_001));
        }
        deleted += e.store_for_tests().reclaim_stats().segments_deleted;
        let stats = e.store_for_tests().reclaim_stats();
        eprintln!("segments deleted: {deleted}, carried: {}, topics forgotten: {}", stats.carried, stats.topics_forgotten);
        let left: Vec<_> = model.iter().filter(|(_, x)| matches!(x, Expect::Pending(_))).collect();
        prop_assert!(left.is_empty(), "never delivered: {left:?}");
    }
}

trait WithId {
    fn with_id(self, id: &str) -> Self;
}

impl WithId for ProduceRequest {
    fn with_id(mut self, id: &str) -> Self {
        self.id = Some(id.to_string());
        self
    }
}

/// A pause is one record in the log: reclaim copies it forward before deleting its segment, so
/// it survives a restart, and a rebuild from the log alone, for as long as the topic is paused.
#[test]
fn a_pause_outlives_its_segment_and_a_rebuild_and_a_resume_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let paused = vec!["p".to_string()];
    e.produce("p", req("held", 100, When::Now)).unwrap();
    e.set_paused("p", true).unwrap();
    let first = e.store_for_tests().paused_at("p").unwrap();
    // A push subscription is a setting like a pause: it must outlive its segment too.
    let hook = crate::message::PushConfig {
        topic: "p".into(),
        url: "http://127.0.0.1:9/hook".into(),
        nats_subject: None,
        secret: Some("s".into()),
        timeout_ms: 1000,
        max_in_flight: 2,
        created_at_ms: 0,
    };
    e.set_push("p", Some(&hook)).unwrap();
    let first_push = e.store_for_tests().push_at("p").unwrap();
    // And flow control (a cap only: a rate would hold back the pops below).
    let flow = crate::message::FlowConfig {
        max_per_second: None,
        burst: None,
        max_reserved: Some(4),
        updated_at_ms: 0,
    };
    e.set_flow("p", Some(&flow)).unwrap();
    let first_flow = e.store_for_tests().flow_at("p").unwrap();
    // Pausing twice writes nothing.
    let end = e.log_end();
    e.set_paused("p", true).unwrap();
    assert_eq!(e.log_end(), end);
    // Enough traffic on another topic that the pause's segment is reclaimed.
    for round in 0..60u64 {
        for i in 0..10 {
            e.produce("q", req(&format!("q{round}-{i}"), 1000, When::Now)).unwrap();
        }
        for d in e.pop(&["q".to_string()], 100, None).unwrap() {
            e.ack(&d.receipt).unwrap();
        }
        assert!(e.pop(&paused, 10, None).unwrap().is_empty(), "a paused topic delivers nothing");
        clock.advance_ms(1_000);
        settle(&mut e);
    }
    let store = e.store_for_tests();
    assert!(store.log_start() > first, "the pause's segment was reclaimed");
    assert!(store.paused_at("p").unwrap() >= store.log_start(), "the pause was copied forward");
    assert!(
        store.log_start() > first_push && store.push_at("p").unwrap() >= store.log_start(),
        "the push was copied forward"
    );
    assert!(
        store.log_start() > first_flow && store.flow_at("p").unwrap() >= store.log_start(),
        "the flow control was copied forward"
    );
    assert_eq!(e.flow_of("p").unwrap().map(|f| (f.max_per_second, f.max_reserved)), Some((None, Some(4))));
    let kept = e.push_of("p").unwrap().unwrap();
    assert_eq!(
        (kept.url.as_str(), kept.secret.as_deref(), kept.max_in_flight),
        (hook.url.as_str(), Some("s"), 2)
    );
    assert_eq!(e.topics().iter().find(|t| t.topic == "p").map(|t| (t.ready, t.paused)), Some((1, true)));
    // A restart keeps it (from the checkpoint), and so does a rebuild from the log alone.
    drop(e);
    let mut e = open(dir.path(), &clock);
    assert!(e.pop(&paused, 10, None).unwrap().is_empty());
    e.checkpoint().unwrap();
    drop(e);
    std::fs::remove_file(dir.path().join("checkpoint")).unwrap();
    let mut e = open(dir.path(), &clock);
    assert!(e.store_for_tests().is_paused("p"));
    assert_eq!(e.push_of("p").unwrap().map(|c| c.url), Some(hook.url.clone()), "the rebuild found the push");
    assert_eq!(
        e.flow_of("p").unwrap().and_then(|f| f.max_reserved),
        Some(4),
        "the rebuild found the flow control"
    );
    assert!(e.pop(&paused, 10, None).unwrap().is_empty());
    e.set_paused("p", false).unwrap();
    let ds = e.pop(&paused, 10, None).unwrap();
    assert_eq!(ds.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), vec!["held"]);
    // Resumed is the default: no record is needed to keep it so.
    drop(e);
    let e = open(dir.path(), &clock);
    assert!(e.store_for_tests().paused_topics().next().is_none());
    assert_eq!(e.topics().iter().find(|t| t.topic == "p").map(|t| t.paused), Some(false));
}

/// Redrive and purge walk the queues in bounded slices, change exactly the messages they should,
/// and leave the state counts equal to a recount, also after a restart.
#[test]
fn redrive_and_purge_change_exactly_their_messages_in_slices() {
    use crate::engine::WalkPos;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let check = |e: &Engine| {
        let s = e.store_for_tests();
        assert_eq!(s.state_counts(), s.recount_states().unwrap());
    };
    // 5,000 dead letters: more than one walk slice.
    let n = 5_000;
    for i in 0..n {
        let mut r = req(&format!("d{i}"), 10, When::Now);
        r.max_attempts = Some(1);
        e.produce("j", r).unwrap();
    }
    // Popped and never acked: when the reservations end, attempts are used up and each is
    // dead-lettered.
    while !e.pop(&["j".to_string()], 1000, Some(1_000)).unwrap().is_empty() {}
    clock.advance_ms(1_001);
    settle(&mut e);
    check(&e);
    let dlq = e.topics().into_iter().find(|t| t.topic == "j.dlq").unwrap();
    assert_eq!(dlq.ready, n);
    // One popped from the dead-letter topic is reserved there: a redrive leaves it alone.
    let held = e.pop(&["j.dlq".to_string()], 1, None).unwrap();
    // By ids: the held one and an unknown id are skipped.
    let ids = vec!["d7".to_string(), held[0].id.clone(), "nope".to_string()];
    let (moved, next) = e.redrive("j", Some(&ids), WalkPos::default(), e.log_end()).unwrap();
    assert_eq!((moved, next), (if held[0].id == "d7" { 0 } else { 1 }, None));
    check(&e);
    // All, in slices, stopping at the log end when it began.
    let until = e.log_end();
    let (mut total, mut at, mut slices) = (moved, Some(WalkPos::default()), 0);
    while let Some(pos) = at {
        let (m, next) = e.redrive("j", None, pos, until).unwrap();
        total += m;
        at = next;
        slices += 1;
    }
    assert!(slices > 1, "{n} dead letters took one slice");
    assert_eq!(total, n - 1, "every dead letter but the reserved one");
    check(&e);
    let j = e.topics().into_iter().find(|t| t.topic == "j").unwrap();
    assert_eq!((j.ready, j.dead_lettered), (n - 1, 1));
    let d = e.get("d9").unwrap();
    assert_eq!((d.state, d.attempt, d.dead_letter_topic), (MessageState::Ready, 0, None));

    // Purge: delayed, ready and reserved messages of "j" are cancelled; "j.dlq" is another topic.
    e.produce("j", req("later", 10, When::DelayMs(3_600_000))).unwrap();
    let r = e.pop(&["j".to_string()], 3, None).unwrap();
    assert_eq!(r.len(), 3);
    let until = e.log_end();
    let (mut cancelled, mut at) = (0, Some(WalkPos::default()));
    while let Some(pos) = at {
        let (c, next) = e.purge("j", pos, until).unwrap();
        cancelled += c;
        at = next;
    }
    assert_eq!(cancelled, n - 1 + 1, "the redriven ones and the delayed one (3 of them reserved)");
    assert_eq!(e.get("later").unwrap().state, MessageState::Cancelled);
    assert_eq!(e.get(&r[0].id).unwrap().state, MessageState::Cancelled);
    assert!(e.ack(&r[0].receipt).is_err(), "a purged reservation cannot be acked");
    check(&e);
    let j = e.topics().into_iter().find(|t| t.topic == "j").unwrap();
    assert_eq!((j.ready, j.reserved, j.delayed), (0, 0, 0));
    assert_eq!(e.get(&held[0].id).unwrap().state, MessageState::Reserved, "j.dlq untouched");
    drop(e);
    let e = open(dir.path(), &clock);
    check(&e);
}

/// A head segment full of messages pending for days cannot be freed or carried: reclaim must not
/// read it again and again (it did every second, which cost a large backlog its timers' lateness
/// and an idle server a share of a core), only once something there changes.
#[test]
fn a_head_of_pending_messages_is_not_scanned_while_nothing_in_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    let day = 86_400_000;
    let mut n = 0;
    while e.store_for_tests().log().segment_count() < 4 {
        e.produce("t", req(&format!("p{n}"), 100, When::DelayMs(3 * day))).unwrap();
        n += 1;
    }
    settle(&mut e);
    let scanned = |e: &Engine| e.store_for_tests().reclaim_stats().scanned_records;
    let before = scanned(&e);
    for _ in 0..120 {
        clock.advance_ms(1_000);
        settle(&mut e);
        assert!(!e.maintenance_due());
    }
    assert_eq!(scanned(&e), before, "nothing changed in the head, so nothing was read again");
    assert!(e.store_for_tests().segment_counts_differ().is_none());

    // Cancelling most of the head makes it worth carrying: now it is scanned, carried and freed.
    let head = e.store_for_tests().log_start();
    for i in 0..n {
        let id = format!("p{i}");
        if i % 8 != 0
            && e.store_for_tests()
                .find_id(id.as_bytes(), 0)
                .is_some_and(|(_, s)| s.msg_offset < head.plus(64 << 10))
        {
            e.cancel(&id).unwrap();
        }
    }
    clock.advance_ms(RETENTION_MS + 1);
    settle(&mut e);
    assert!(scanned(&e) > before);
    assert!(e.store_for_tests().reclaim_stats().segments_deleted >= 1);
    assert!(e.store_for_tests().segment_counts_differ().is_none());
    for i in (0..n).step_by(8) {
        assert_eq!(e.get(&format!("p{i}")).unwrap().state, MessageState::Delayed);
    }
}

/// A carry checks each live body it copies once, and no other body (issue 26): reclaim's scan
/// reads ids and lengths only, and the carried record is dispatched from the record built.
#[test]
fn a_carry_checks_each_live_body_once_and_no_other() {
    use crate::storage::format::body_checks;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open(dir.path(), &clock);
    for i in 0..5 {
        e.produce("t", req(&format!("long{i}"), 2_000, When::DelayMs(10 * 86_400_000))).unwrap();
    }
    let (mut checks, mut carried) = (0, 0);
    for round in 0..60u64 {
        for i in 0..10 {
            e.produce("t", req(&format!("s{round}-{i}"), 1000, When::DelayMs(1_000))).unwrap();
        }
        clock.advance_ms(1_000);
        while e.run_due(usize::MAX).unwrap() > 0 {}
        for d in e.pop(&topics(), 100, None).unwrap() {
            e.ack(&d.receipt).unwrap();
        }
        for _ in 0..1_000 {
            let before = e.store_for_tests().reclaim_stats().carried;
            body_checks::take();
            e.maintain().unwrap();
            checks += body_checks::take();
            carried += e.store_for_tests().reclaim_stats().carried - before;
            e.checkpoint().unwrap();
            if !e.maintenance_due() {
                break;
            }
        }
    }
    assert!(carried >= 5, "the long delays were carried (some more than once): {carried}");
    assert_eq!(checks, carried, "one body check per carried message");
}
