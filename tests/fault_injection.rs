//! Fault-injection tests of durability: a failed sync in any thread poisons the store and nothing
//! issued after it is acknowledged; running out of file handles or disk space fails only the
//! request that met it.
//!
//! Faults are injected through `delayd::storage::io`, matched by each test's own temp dir, so the
//! tests run in parallel without seeing each other's faults.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, PopRequest, ProduceRequest, When};
use delayd::storage::io::{Fault, FaultGuard, Op};
use delayd::Error;

fn config(dir: &std::path::Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 1 << 20;
    c.cq_entries_per_file = 4096;
    c.index_initial_slots = 4096;
    c
}

fn req(id: String, body_bytes: usize, when: When) -> ProduceRequest {
    ProduceRequest {
        id: Some(id),
        body: Bytes::from(vec![b'x'; body_bytes]),
        when,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

/// Waits (without asserting anything about time) until `f` holds; panics after a generous limit.
async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One produce's outcome: whether it was issued after the fault was hit, and its result.
type Outcome = (bool, Result<(), String>);

/// Starts `n` writers producing in a loop until `stop`; each records whether `issued_after()` held
/// when it sent the request.
fn writers(
    b: &Broker,
    name: &'static str,
    n: usize,
    body: usize,
    stop: &Arc<AtomicBool>,
    issued_after: Arc<dyn Fn() -> bool + Send + Sync>,
) -> Vec<tokio::task::JoinHandle<Vec<Outcome>>> {
    (0..n)
        .map(|w| {
            let (b, stop, issued_after) = (b.clone(), stop.clone(), issued_after.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Acquire) {
                    let after = issued_after();
                    let r = b.produce("t", req(format!("{name}{w}-{i}"), body, When::DelayMs(60_000))).await;
                    out.push((after, r.map(|_| ()).map_err(|e| e.to_string())));
                    i += 1;
                }
                out
            })
        })
        .collect()
}

async fn join(tasks: Vec<tokio::task::JoinHandle<Vec<Outcome>>>) -> Vec<Outcome> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("writer task"));
    }
    all
}

/// Asserts that no produce issued after the failure was acknowledged, and that some were issued.
fn assert_none_acknowledged_after(all: &[Outcome], what: &str) {
    let after: Vec<&Outcome> = all.iter().filter(|o| o.0).collect();
    assert!(!after.is_empty(), "no produce was issued after the {what} failed: the test proved nothing");
    let acked = after.iter().filter(|o| o.1.is_ok()).count();
    assert_eq!(
        acked,
        0,
        "{acked} of {} produces issued after the {what} failed were acknowledged",
        after.len()
    );
}

fn assert_refused_with_reason(r: Result<impl std::fmt::Debug, Error>, op: &str) {
    match r {
        Err(Error::Unavailable(why)) => {
            assert!(why.contains(op), "the refusal does not name the operation {op}: {why}");
            assert!(why.contains("Input/output error"), "the refusal does not give the OS error: {why}");
            assert!(why.contains('/'), "the refusal does not name the file: {why}");
        }
        other => panic!("a poisoned store must refuse writes with 503, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_flusher_sync_poisons_and_nothing_queued_behind_it_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    // The flusher's 4th fdatasync of the log fails, after waiting at a gate: writers keep sending
    // meanwhile, so batches queue up behind the failing one.
    let fault: Arc<FaultGuard> = Arc::new(
        Fault::new(Op::Sync, dir.path(), libc::EIO)
            .path_contains("commitlog")
            .on_thread("delayd-flusher")
            .skip(3)
            .times(1)
            .inject_gated(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let hit = {
        let fault = fault.clone();
        Arc::new(move || fault.failed() > 0)
    };
    let mut tasks = writers(&b, "w", 16, 100, &stop, hit.clone());
    wait_until("the flusher reaches the failing sync", || hit()).await;
    // Fresh writers send while that sync is held: their batches queue at the flusher behind it.
    tasks.extend(writers(&b, "late", 16, 100, &stop, Arc::new(|| true)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    fault.release();
    wait_until("the store is poisoned", || !b.store_writable()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Release);
    let all = join(tasks).await;
    assert_none_acknowledged_after(&all, "flusher's fdatasync");
    assert!(
        all.iter().any(|o| o.1.is_ok()),
        "nothing was acknowledged before the failure: {:?}",
        all.first()
    );
    assert_refused_with_reason(b.produce("t", req("late".into(), 10, When::Now)).await, "fdatasync");
    // Reads keep working.
    assert!(b.stats().await.is_ok(), "stats must keep answering");
    b.shutdown().await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_checkpoint_sync_poisons_and_nothing_after_it_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    b.produce("t", req("before".into(), 100, When::Now)).await.unwrap();
    // The checkpoint thread's first sync (5 s after start) fails.
    let fault = Arc::new(
        Fault::new(Op::Sync, dir.path(), libc::EIO).on_thread("delayd-checkpoint").times(1).inject(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let seen_poisoned = Arc::new(AtomicBool::new(false));
    let after = {
        let seen = seen_poisoned.clone();
        Arc::new(move || seen.load(Ordering::Acquire))
    };
    let tasks = writers(&b, "w", 8, 100, &stop, after);
    wait_until("the checkpointer's sync fails", || fault.failed() > 0).await;
    wait_until("the store is poisoned", || !b.store_writable()).await;
    seen_poisoned.store(true, Ordering::Release);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Release);
    let all = join(tasks).await;
    assert_none_acknowledged_after(&all, "checkpointer's sync");
    assert_refused_with_reason(b.produce("t", req("late".into(), 10, When::Now)).await, "sync");
    let got = b.get("before").await.expect("look-ups keep working on a poisoned store");
    assert_eq!(got.id, "before");
    b.shutdown().await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_warmer_sync_poisons_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    // Some writes first, so that the sync that fails is one made while writers are running.
    for i in 0..20 {
        b.produce("t", req(format!("before-{i}"), 4096, When::DelayMs(60_000))).await.unwrap();
    }
    let fault =
        Arc::new(Fault::new(Op::Sync, dir.path(), libc::EIO).on_thread("delayd-warmer").times(1).inject());
    let stop = Arc::new(AtomicBool::new(false));
    let seen_poisoned = Arc::new(AtomicBool::new(false));
    let after = {
        let seen = seen_poisoned.clone();
        Arc::new(move || seen.load(Ordering::Acquire))
    };
    // 4 KiB bodies move the appender across the warmer's 64 KiB chunks quickly.
    let tasks = writers(&b, "w", 8, 4096, &stop, after);
    wait_until("the warmer's sync fails", || fault.failed() > 0).await;
    wait_until("the store is poisoned", || !b.store_writable()).await;
    seen_poisoned.store(true, Ordering::Release);
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Release);
    let all = join(tasks).await;
    assert_none_acknowledged_after(&all, "warmer's sync");
    assert_refused_with_reason(b.produce("t", req("late".into(), 10, When::Now)).await, "sync");
    b.shutdown().await.ok();
}

#[test]
fn a_checkpoint_job_that_fails_leaves_its_queue_files_to_the_next_one() {
    use delayd::engine::Engine;
    use delayd::metrics::Metrics;
    use delayd::schedule::clock::SystemClock;
    let dir = tempfile::tempdir().unwrap();
    let (mut e, _) =
        Engine::open(config(dir.path()), Arc::new(SystemClock), Arc::new(Metrics::default())).unwrap();
    for i in 0..3 {
        e.produce("q", req(format!("m{i}"), 10, When::Now)).unwrap();
    }
    e.flush().unwrap();
    let in_queue = |p: &std::path::PathBuf| p.to_string_lossy().contains("t-q");
    let job = e.checkpoint_job().unwrap();
    assert!(job.queue_files.iter().any(in_queue), "the job must sync the topic's queue file");
    {
        // Opening the queue file to sync it runs out of file handles: the job fails.
        let _g = Fault::new(Op::Open, dir.path(), libc::EMFILE).path_contains("t-q").inject();
        assert!(job.run().is_err(), "the job should have failed");
    }
    let next = e.checkpoint_job().unwrap();
    assert!(
        next.queue_files.iter().any(in_queue),
        "the queue file the failed job owned is not synced by the next one: a checkpoint could claim \
         entries that never reached the disk"
    );
    next.run().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_handles_for_a_new_topic_fails_that_request_only() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    b.produce("old", req("o1".into(), 10, When::Now)).await.unwrap();
    let g = Fault::new(Op::Open, dir.path(), libc::EMFILE).path_contains("t-new").inject();
    match b.produce("new", req("n1".into(), 10, When::Now)).await {
        Err(Error::Unavailable(why)) => assert!(why.contains("Too many open files"), "{why}"),
        other => panic!("expected 503 for lack of file handles, got {other:?}"),
    }
    assert!(!b.store_writable(), "a store refusing writes reports store_writable = 0");
    assert!(b.store_failure().unwrap_or_default().contains("Too many open files"));
    // Other topics keep working meanwhile.
    b.produce("old", req("o2".into(), 10, When::Now)).await.unwrap();
    drop(g);
    b.produce("new", req("n1".into(), 10, When::Now)).await.expect("the cause is gone: writable again");
    assert!(b.store_writable());
    let got =
        b.pop(PopRequest { topics: vec!["new".into()], max: 10, wait_ms: 0, ttr_ms: None }).await.unwrap();
    assert_eq!(got.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["n1"], "one message, not two");
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_at_the_next_segment_fails_produces_keeps_acks_and_leaves_no_partial_segment() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    for i in 0..20 {
        b.produce("t", req(format!("ready-{i}"), 100, When::Now)).await.unwrap();
    }
    let segments = |dir: &std::path::Path| -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = std::fs::read_dir(dir.join("commitlog"))
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
            .collect();
        v.sort();
        v
    };
    let before = segments(dir.path());
    // Preallocating the next segment runs out of space half-way.
    let g = Fault::new(Op::Preallocate, dir.path(), libc::ENOSPC).path_contains("commitlog").short().inject();
    let mut refused = None;
    for i in 0..200 {
        match b.produce("t", req(format!("big-{i}"), 16 << 10, When::DelayMs(60_000))).await {
            Ok(_) => {}
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    match refused {
        Some(Error::Unavailable(why)) => assert!(why.contains("No space left on device"), "{why}"),
        other => panic!("expected 503 for a full disk, got {other:?}"),
    }
    assert_eq!(segments(dir.path()), before, "a refused segment must leave no file behind");
    // Produces that keep coming are refused without preallocating a whole segment each: the log
    // tries the next segment again at most once a second.
    let (tried, started) = (g.seen(), std::time::Instant::now());
    for i in 0..50 {
        let r = b.produce("t", req(format!("again-{i}"), 16 << 10, When::DelayMs(60_000))).await;
        assert!(matches!(r, Err(Error::Unavailable(_))), "{r:?}");
    }
    let allowed = started.elapsed().as_secs() + 1;
    assert!(g.seen() - tried <= allowed, "{} preallocations for 50 refused produces", g.seen() - tried);
    // Deliveries and acks still have room: the segment keeps a tail for state changes.
    let got =
        b.pop(PopRequest { topics: vec!["t".into()], max: 20, wait_ms: 0, ttr_ms: None }).await.unwrap();
    assert_eq!(got.len(), 20);
    for d in &got {
        b.ack(&d.receipt).await.expect("acks must go through on a full disk");
    }
    drop(g);
    // Space is back: within a retry interval produces go through again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while let Err(e) = b.produce("t", req("after".into(), 16 << 10, When::DelayMs(60_000))).await {
        assert!(std::time::Instant::now() < deadline, "still refused after space came back: {e}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(b.store_writable());
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rename_retiring_the_old_index_table_refuses_writes_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    // The index outgrows its 4,096 slots; the rename that makes the new table `ids` fails.
    let g = Fault::new(Op::Rename, dir.path(), libc::EIO).path_contains("ids.next").inject();
    let mut acked = Vec::new();
    let mut refused = None;
    for i in 0..20_000 {
        let id = format!("m{i}");
        match b.produce("t", req(id.clone(), 10, When::DelayMs(600_000))).await {
            Ok(_) => acked.push(id),
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    assert!(g.failed() >= 1, "the resize never reached its rename ({} produced)", acked.len());
    match refused {
        Some(Error::Unavailable(why)) => assert!(why.contains("rename"), "the refusal must say why: {why}"),
        other => panic!("expected 503 after the failed rename, got {other:?}"),
    }
    let again = b.produce("t", req("x".into(), 10, When::Now)).await;
    assert!(matches!(again, Err(Error::Unavailable(_))), "writes stay refused until a restart: {again:?}");
    let info = b.get(&acked[0]).await.expect("look-ups keep working");
    assert_eq!(info.id, acked[0]);
    let _ = b.shutdown().await;
    drop(b);
    drop(g);

    // The restart finishes the resize from the files on disk: every acknowledged message is there.
    let b = Broker::open(config(dir.path())).unwrap();
    for id in &acked {
        b.get(id).await.unwrap_or_else(|e| panic!("{id} lost after the failed rename: {e}"));
    }
    b.produce("t", req("after".into(), 10, When::Now)).await.expect("writable after a restart");
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_store_refuses_a_backup() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(config(dir.path())).unwrap();
    b.produce("t", req("before".into(), 10, When::Now)).await.unwrap();
    let to = tempfile::tempdir().unwrap();
    let ok = b.backup(to.path().join("good")).await;
    assert!(ok.is_ok(), "a healthy store backs up: {ok:?}");
    let fault = Fault::new(Op::Sync, dir.path(), libc::EIO).path_contains("commitlog").inject();
    let r = b.produce("t", req("poison".into(), 10, When::Now)).await;
    assert!(r.is_err(), "the failed sync is not acknowledged: {r:?}");
    drop(fault);
    wait_until("the store is poisoned", || !b.store_writable()).await;
    let refused = b.backup(to.path().join("bad")).await;
    assert_refused_with_reason(refused, "fdatasync");
    assert!(!to.path().join("bad").exists(), "nothing was written for the refused backup");
    b.shutdown().await.ok();
}
