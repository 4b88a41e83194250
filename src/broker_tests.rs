//! The broker's two ways in: a request applied on the caller's thread when the engine is free and
//! idle, and the hand-off to the engine thread otherwise.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;

fn req(delay_ms: u64) -> ProduceRequest {
    ProduceRequest {
        id: None,
        body: Bytes::from_static(b"hello"),
        when: if delay_ms == 0 { When::Now } else { When::DelayMs(delay_ms) },
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn open(dir: &std::path::Path, flush: FlushMode) -> Broker {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 1 << 20;
    c.flush = flush;
    Broker::open(c).unwrap()
}

fn counter(b: &Broker, c: fn(&Metrics) -> &std::sync::atomic::AtomicU64) -> u64 {
    c(b.metrics()).load(Ordering::Relaxed)
}

/// Waits (up to a minute: this is liveness, not speed) until the engine thread sleeps.
fn until_engine_sleeps(b: &Broker) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sleeping = b.shared.core.lock().unwrap().as_ref().is_some_and(|c| c.sleeping_until.is_some());
        if sleeping {
            return;
        }
        assert!(Instant::now() < deadline, "the engine thread never went to sleep");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_at_a_time_is_applied_inline_in_both_flush_modes() {
    for flush in [FlushMode::Sync, FlushMode::Async] {
        let dir = tempfile::tempdir().unwrap();
        let b = open(dir.path(), flush);
        let topics = vec!["t".to_string()];
        for _ in 0..100 {
            b.produce("t", req(0)).await.unwrap();
            let got =
                b.pop(PopRequest { topics: topics.clone(), max: 1, wait_ms: 0, ttr_ms: None }).await.unwrap();
            assert_eq!(got.len(), 1);
            b.ack(&got[0].receipt).await.unwrap();
        }
        let (inline, queued) = (counter(&b, |m| &m.requests_inline), counter(&b, |m| &m.requests_queued));
        assert_eq!(inline + queued, 300, "{flush:?}: every request counted once");
        // The engine thread holds the lock during its own steps (a checkpoint, a reclaim tick),
        // so a few requests may meet it busy; one at a time, nearly all must go inline.
        assert!(inline >= 270, "{flush:?}: only {inline} of 300 requests applied inline");
        let s = b.stats().await.unwrap();
        assert_eq!(s.topics.iter().map(|t| t.ready + t.reserved).sum::<u64>(), 0, "{flush:?}: all acked");
        b.shutdown().await.unwrap();
    }
}

/// Waits (up to a minute: liveness, not speed) until `n` pops wait and `done` of `pops` are answered.
async fn until_pops(
    b: &Broker,
    pops: &[tokio::task::JoinHandle<Result<Vec<Delivery>>>],
    n: u64,
    done: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let finished = pops.iter().filter(|p| p.is_finished()).count();
        if counter(b, |m| &m.pops_waiting) == n && finished == done {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {n} pops waiting and {done} answered ({finished} answered)"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A new entry wakes one waiting pop, not all of them: each woken pop asks the engine again, and
/// all but one would find nothing. Two entries wake two; a resumed topic still wakes every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_new_entry_wakes_one_waiting_pop_and_a_resume_wakes_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    let asked = |b: &Broker| counter(b, |m| &m.requests_inline) + counter(b, |m| &m.requests_queued);
    let pops: Vec<_> = (0..8)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move {
                b.pop(PopRequest { topics: vec!["t".into()], max: 1, wait_ms: 60_000, ttr_ms: None }).await
            })
        })
        .collect();
    until_pops(&b, &pops, 8, 0).await;
    let before = asked(&b);
    b.produce("t", req(0)).await.unwrap();
    until_pops(&b, &pops, 7, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The produce and the woken pop's second look; one spare for a pop that met the entry
    // before it waited. Waking all eight asked nine times or more.
    let one = asked(&b) - before;
    assert!(one <= 3, "one entry: the engine was asked {one} times");
    assert_eq!(pops.iter().filter(|p| p.is_finished()).count(), 1, "one entry answered one pop");

    let before = asked(&b);
    b.produce_batch("t", vec![req(0), req(0)]).await.unwrap();
    until_pops(&b, &pops, 5, 3).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let two = asked(&b) - before;
    assert!(two <= 4, "two entries: the engine was asked {two} times");

    // A resume changes what the topic may hand out as a whole: every waiting pop looks again
    // (and waits on, as the topic is empty).
    b.set_paused("t", true).await.unwrap();
    let before = asked(&b);
    b.set_paused("t", false).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while asked(&b) - before < 6 {
        assert!(Instant::now() < deadline, "a resume woke {} of 5 waiting pops", asked(&b) - before - 1);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    until_pops(&b, &pops, 5, 3).await;
    for (i, p) in pops.into_iter().enumerate() {
        if p.is_finished() {
            assert_eq!(p.await.unwrap().unwrap().len(), 1, "pop {i}");
        } else {
            p.abort();
        }
    }
    b.shutdown().await.unwrap();
}

/// A pop woken for an entry that goes away before it looks (its client hung up) passes the
/// wake-up on to the next waiting pop, which gets the entry instead of waiting out its time.
/// One runtime thread, blocked while the engine thread makes the entry ready, so the first pop is
/// woken and dropped without ever running in between.
#[tokio::test(flavor = "current_thread")]
async fn a_woken_pop_that_goes_away_passes_its_wake_up_on() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    let pop = |b: &Broker| {
        let b = b.clone();
        tokio::spawn(async move {
            b.pop(PopRequest { topics: vec!["t".into()], max: 1, wait_ms: 60_000, ttr_ms: None }).await
        })
    };
    let first = pop(&b);
    until_pops(&b, std::slice::from_ref(&first), 1, 0).await;
    let second = pop(&b);
    until_pops(&b, std::slice::from_ref(&second), 2, 0).await;
    let p = b.produce("t", req(50)).await.unwrap();
    // The engine thread makes the entry ready meanwhile and wakes the pop that waited first.
    let deadline = Instant::now() + Duration::from_secs(60);
    while b.metrics().lateness_ms.prometheus().get_sample_count() == 0 {
        assert!(Instant::now() < deadline, "the entry was never made ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The count moves as the timer fires; the wake-up comes at the end of the same engine step,
    // after the commit. Still blocking, give that step time to finish, so the abort below meets a
    // pop already woken (were it aborted first, the second pop would be woken directly and the
    // test would pass without passing anything on).
    std::thread::sleep(Duration::from_millis(200));
    first.abort();
    let got = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("the second pop was not woken: the wake-up was lost with the first")
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id, p.id);
    b.shutdown().await.unwrap();
}

/// The steps that copy id index slots for a resize report that time, and only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_that_resize_the_id_index_report_the_time_it_took() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = BrokerConfig::with_defaults(dir.path());
    c.segment_bytes = 1 << 20;
    c.index_initial_slots = 64;
    let b = Broker::open(c).unwrap();
    let resizing_steps = |b: &Broker| b.metrics().index_resize_step_us.prometheus().get_sample_count();
    // 3/4 of the 64 slots start a resize; 40 messages do not.
    for _ in 0..40 {
        b.produce("t", req(60_000)).await.unwrap();
    }
    until_engine_sleeps(&b);
    assert_eq!(b.stats().await.unwrap().index_slots, 64);
    assert_eq!(resizing_steps(&b), 0, "steps without a resize counted as resizing");
    for _ in 0..200 {
        b.produce("t", req(60_000)).await.unwrap();
    }
    // The idle engine finishes whatever copy the produces left.
    let deadline = Instant::now() + Duration::from_secs(60);
    while b.stats().await.unwrap().index_slots < 256
        || b.shared.core.lock().unwrap().as_ref().is_some_and(|c| c.engine.index_resizing_for_bench())
    {
        assert!(Instant::now() < deadline, "the index never grew");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(resizing_steps(&b) > 0, "resizing steps were not counted");
    assert!(b.metrics().index_resize_step_us.max() > 0);
    b.shutdown().await.unwrap();
}

/// A request that meets the engine busy goes to the engine thread and is answered from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// Holding the engine across awaits is the point: the produce must meet it busy.
#[allow(clippy::await_holding_lock)]
async fn a_request_meeting_a_busy_engine_is_handed_off_and_answered() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    let held = b.shared.core.clone();
    let guard = held.lock().unwrap();
    let producer = tokio::spawn({
        let b = b.clone();
        async move { b.produce("t", req(0)).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while counter(&b, |m| &m.requests_queued) == 0 {
        assert!(Instant::now() < deadline, "the produce was never handed off");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(!producer.is_finished(), "answered while the engine was held");
    drop(guard);
    producer.await.unwrap().unwrap();
    assert_eq!(counter(&b, |m| &m.requests_inline), 0);
    let got = b.pop(PopRequest { topics: vec!["t".into()], max: 1, wait_ms: 0, ttr_ms: None }).await.unwrap();
    assert_eq!(got.len(), 1, "the handed-off produce was applied");
    b.shutdown().await.unwrap();
}

/// An inline produce that makes something due before the sleeping engine thread would look again
/// wakes it: a short timer here. The message then arrives, never early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_produce_of_an_earlier_timer_wakes_the_engine_thread() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    until_engine_sleeps(&b);
    let woken = counter(&b, |m| &m.engine_wakeups);
    let p = b.produce("t", req(50)).await.unwrap();
    assert_eq!(counter(&b, |m| &m.requests_inline), 1);
    assert_eq!(counter(&b, |m| &m.engine_wakeups), woken + 1, "the sleeping engine was not woken");
    let got =
        b.pop(PopRequest { topics: vec!["t".into()], max: 1, wait_ms: 30_000, ttr_ms: None }).await.unwrap();
    assert_eq!(got.len(), 1);
    let now_ms = SystemClock.now_ms();
    assert!(now_ms >= p.deliver_at_ms, "delivered early: at {now_ms}, due {}", p.deliver_at_ms);
    b.shutdown().await.unwrap();
}

/// In async mode an inline produce leaves the log dirty: the sleeping engine thread is woken to
/// flush it within `flush_interval_ms` rather than at its next reclaim tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_async_produce_wakes_the_engine_thread_to_flush() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Async);
    until_engine_sleeps(&b);
    let woken = counter(&b, |m| &m.engine_wakeups);
    b.produce("t", req(600_000)).await.unwrap();
    assert_eq!(counter(&b, |m| &m.engine_wakeups), woken + 1, "the sleeping engine was not woken");
    let deadline = Instant::now() + Duration::from_secs(60);
    while b.shared.core.lock().unwrap().as_ref().is_some_and(|c| c.engine.dirty()) {
        assert!(Instant::now() < deadline, "the produce was never flushed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.shutdown().await.unwrap();
}

/// Once shut down, the core is gone: a request is refused, not applied to a closed store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_shutdown_a_request_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    b.produce("t", req(0)).await.unwrap();
    b.shutdown().await.unwrap();
    assert!(b.shared.core.lock().unwrap().is_none(), "the core outlived the shutdown");
    match b.produce("t", req(0)).await {
        Err(Error::Unavailable(_)) => {}
        other => panic!("a produce after shutdown answered {other:?}"),
    }
    let before = counter(&b, |m| &m.requests_inline);
    assert!(b.get("x").await.is_err());
    assert_eq!(counter(&b, |m| &m.requests_inline), before);
}

/// On a single-threaded runtime an inline fdatasync would stall every connection: a lone sync
/// request is still applied inline but synced by the flusher, so concurrent requests queue up
/// and share fdatasyncs (with the stall, each of them paid one).
#[tokio::test(flavor = "current_thread")]
async fn one_worker_never_fdatasyncs_inline_so_concurrent_requests_share_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), FlushMode::Sync);
    let before = b.metrics().flush_us.prometheus().get_sample_count();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move {
                for _ in 0..20 {
                    b.produce("t", req(600_000)).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let flushes = b.metrics().flush_us.prometheus().get_sample_count() - before;
    assert!(flushes * 2 <= 320, "{flushes} flushes for 320 produces: no group commit");
    b.shutdown().await.unwrap();
}

/// A follower's entries come in through the replicator and are appended by the commit's seal. A
/// lone one must be synced on the thread that hands it in (a link's reader), not handed to the
/// flusher thread and back: that round trip was most of a follower's part in a lone write, and
/// asking whether the batch was alone before the seal appended anything sent every one there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_lone_entry_is_synced_on_the_thread_that_hands_it_in() {
    use crate::storage::replica::{Diverged, Passed, ReplicaEntry, Replicator, Sealed};
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};
    use std::thread::ThreadId;

    type Inbox = Arc<Mutex<Vec<ReplicaEntry>>>;
    struct Follower(Inbox);
    impl Replicator for Follower {
        fn missing(&mut self, _: Sealed) -> std::result::Result<Vec<ReplicaEntry>, Diverged> {
            Ok(std::mem::take(&mut *self.0.lock().unwrap()))
        }
        fn propose(&mut self, _: Vec<u8>, _: u64) -> Option<(u64, u64)> {
            None
        }
        fn sealed(&mut self, _: Sealed) {}
        fn leading(&self) -> bool {
            false
        }
        fn committed_end(&self) -> u64 {
            0
        }
        fn diverged(&mut self, d: Diverged) {
            panic!("diverged: {}", d.why);
        }
        fn membership(&mut self) -> Vec<ReplicaEntry> {
            Vec::new()
        }
        fn passed(&mut self, _: Passed) {}
        fn take_passed(&mut self, _: Sealed) -> Option<Passed> {
            None
        }
        fn refuse(&mut self, why: &str) {
            panic!("refused: {why}");
        }
    }
    type Seen = Arc<Mutex<Vec<(u64, ThreadId)>>>;
    struct Majority(Seen);
    impl crate::storage::writer::Condition for Majority {
        fn reach(&mut self, _: &[&PathBuf], end: u64, _owed: bool) -> Result<()> {
            self.0.lock().unwrap().push((end, std::thread::current().id()));
            Ok(())
        }
        fn defers(&self) -> bool {
            true
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let mut c = BrokerConfig::with_defaults(dir.path());
    c.segment_bytes = 1 << 20;
    c.flush = FlushMode::Sync;
    let (inbox, seen): (Inbox, Seen) = Default::default();
    let replication = Replication {
        replicator: Box::new(Follower(inbox.clone())),
        sealed: Sealed::default(),
        condition: Box::new(Majority(seen.clone())),
        fire_clock: Arc::new(SystemClock),
    };
    let b = Broker::open_replicated(c, Arc::new(SystemClock), Some(replication)).unwrap();
    let wake_here = b.inline_waker();
    for index in 1..=3 {
        until_engine_sleeps(&b);
        let entry = ReplicaEntry {
            term: 1,
            index,
            origin_start: None,
            kind: crate::storage::format::EntryKind::Normal,
            records: Vec::new(),
            payload: Vec::new(),
        };
        inbox.lock().unwrap().push(entry);
        seen.lock().unwrap().clear();
        wake_here();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "entry {index}: the conditions were not met during the wake-up: {seen:?}");
        assert_eq!(seen[0].1, std::thread::current().id(), "entry {index} was synced on another thread");
        assert!(seen[0].0 > 0, "nothing was appended for entry {index}");
    }
    b.shutdown().await.unwrap();
}
