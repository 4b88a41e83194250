//! Recovery never undoes an acknowledgement, and damaged derived files are rebuilt, not trusted:
//! a commit log shorter than what was durable, and flipped bytes in the checkpoint, a queue file,
//! the id index and a record, each on a manual clock.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::config::{BrokerConfig, StartCheck};
use crate::engine::Engine;
use crate::error::Error;
use crate::message::{MessageState, ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::ManualClock;
use crate::storage::commitlog::{list_numbered, RecoveryMode};
use crate::storage::format::slot::slot_position;
use crate::storage::store::OpenReport;

const T0: u64 = 1_700_000_000_000;

fn config(dir: &Path, mode: RecoveryMode) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 64 << 10;
    c.cq_entries_per_file = 256;
    c.index_initial_slots = 64;
    c.recovery = mode;
    c
}

fn open(dir: &Path, clock: &Arc<ManualClock>, mode: RecoveryMode) -> crate::Result<(Engine, OpenReport)> {
    Engine::open(config(dir, mode), clock.clone(), Arc::new(Metrics::default()))
}

/// Opens with `check_on_start = always`: files damaged while delayd was stopped after a clean
/// shutdown are only looked for then.
fn open_checking(dir: &Path, clock: &Arc<ManualClock>) -> crate::Result<(Engine, OpenReport)> {
    let mut c = config(dir, RecoveryMode::Strict);
    c.check_on_start = StartCheck::Always;
    Engine::open(c, clock.clone(), Arc::new(Metrics::default()))
}

fn req(id: &str, when: When) -> ProduceRequest {
    ProduceRequest {
        id: Some(id.to_string()),
        body: Bytes::from(format!("body of {id} {}", "x".repeat(80))),
        when,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn topics() -> Vec<String> {
    vec!["t".to_string()]
}

/// `n` ready messages; the first `acked` popped and acked, the next `reserved` popped and held.
/// Returns the ids acked and reserved.
fn fill(e: &mut Engine, n: usize, acked: usize, reserved: usize) -> (Vec<String>, Vec<String>) {
    for i in 0..n {
        e.produce("t", req(&format!("m{i}"), When::Now)).unwrap();
    }
    let ds = e.pop(&topics(), acked + reserved, None).unwrap();
    assert_eq!(ds.len(), acked + reserved);
    let mut a = vec![];
    let mut r = vec![];
    for (i, d) in ds.into_iter().enumerate() {
        if i < acked {
            e.ack(&d.receipt).unwrap();
            a.push(d.id);
        } else {
            r.push(d.id);
        }
    }
    e.flush().unwrap();
    (a, r)
}

/// The newest segment holding data (a segment made ahead for the next roll may follow it, empty).
fn last_segment(dir: &Path) -> PathBuf {
    let bases = list_numbered(&dir.join("commitlog")).unwrap();
    let path = |base: &u64| dir.join("commitlog").join(format!("{base:020}"));
    bases.iter().rev().map(path).find(|p| written_len(p) > 0).unwrap_or_else(|| path(&bases[0]))
}

fn written_len(path: &Path) -> usize {
    let b = std::fs::read(path).unwrap();
    b.iter().rposition(|x| *x != 0).map_or(0, |p| p + 1)
}

/// Cuts the newest segment to half of its written bytes: by truncating the file (as the
/// adversarial run did) or by zeroing its tail (as a lost page cache would).
fn cut_log(dir: &Path, truncate_file: bool) -> u64 {
    let seg = last_segment(dir);
    let base: u64 = seg.file_name().unwrap().to_string_lossy().parse().unwrap();
    let keep = written_len(&seg) / 2;
    if truncate_file {
        std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(keep as u64).unwrap();
    } else {
        let mut b = std::fs::read(&seg).unwrap();
        b[keep..].fill(0);
        std::fs::write(&seg, &b).unwrap();
    }
    base + keep as u64
}

/// Drains topic `t` at the current time: the ids popped (each acked).
fn drain(e: &mut Engine) -> Vec<String> {
    let mut out = vec![];
    loop {
        while e.run_due(usize::MAX).unwrap() > 0 {}
        let ds = e.pop(&topics(), 1000, None).unwrap();
        if ds.is_empty() {
            return out;
        }
        for d in ds {
            e.ack(&d.receipt).unwrap();
            out.push(d.id);
        }
    }
}

#[test]
fn strict_refuses_a_log_that_ends_before_the_checkpoint_and_truncate_reports_the_loss() {
    // After a crash (no clean marker: the checkpoint vouches) and after a clean stop (the
    // marker vouches too); the log cut by truncating the file or by zeroing its tail.
    for clean in [false, true] {
        for truncate_file in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let clock = Arc::new(ManualClock::at_ms(T0));
            let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
            let (acked, _) = fill(&mut e, 600, 400, 0);
            if clean {
                e.close().unwrap();
            } else {
                e.checkpoint().unwrap();
                drop(e);
            }
            let seg = last_segment(dir.path());
            let cut = cut_log(dir.path(), truncate_file);
            let size_before = std::fs::metadata(&seg).unwrap().len();
            let case = format!("clean {clean}, truncated file {truncate_file}");
            match open(dir.path(), &clock, RecoveryMode::Strict) {
                Err(Error::Corrupt { file, offset, reason }) => {
                    assert!(file.ends_with(&*seg.file_name().unwrap().to_string_lossy()), "{case}: {file}");
                    // The last record before the cut may survive it (a trailing zero field).
                    assert!(offset <= cut + 73, "{case}: refused at {offset}, cut at {cut}");
                    assert!(reason.contains("durable up to offset"), "{case}: {reason}");
                    let claimant = if clean { "clean_shutdown" } else { "checkpoint" };
                    assert!(reason.contains(claimant), "{case}: {reason}");
                    assert!(reason.contains("recovery = \"truncate\""), "{case}: {reason}");
                }
                Err(other) => panic!("{case}: wrong error {other}"),
                Ok(_) => panic!("{case}: strict mode accepted a log shorter than the checkpoint"),
            }
            // Refusing changed nothing: the cut file is as it was, so it can still be restored.
            assert_eq!(std::fs::metadata(&seg).unwrap().len(), size_before, "{case}");
            // A clean start consumed the marker: the next start has only the checkpoint to go
            // on, and still refuses.
            assert!(open(dir.path(), &clock, RecoveryMode::Strict).is_err(), "{case}: second start");

            let (mut e, report) = open(dir.path(), &clock, RecoveryMode::Truncate).unwrap();
            assert!(report.log.durable_bytes_lost > 0, "{case}: {report:?}");
            assert!(report.log.claimed_end.is_some_and(|c| c > report.log.end), "{case}: {report:?}");
            assert!(report.messages_lost + report.messages_reverted > 0, "{case}: {report:?}");
            assert!(report.rebuilt, "{case}: derived files ahead of the log are rebuilt");
            // What is left is a consistent prefix: every message answers, none is damaged.
            let mut present = 0;
            for i in 0..600 {
                match e.get(&format!("m{i}")) {
                    Ok(_) => present += 1,
                    Err(Error::NotFound(_)) => {}
                    Err(other) => panic!("{case}: m{i}: {other}"),
                }
            }
            // The report says exactly what was lost: messages gone, and acks undone.
            assert_eq!(600 - present, report.messages_lost, "{case}");
            let undone =
                acked.iter().filter(|id| e.get(id).is_ok_and(|m| m.state != MessageState::Done)).count();
            assert_eq!(undone as u64, report.messages_reverted, "{case}");
            drain(&mut e);
        }
    }
}

#[test]
fn a_damaged_checkpoint_is_rebuilt_from_the_log_and_nothing_is_lost_or_redelivered() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    let (acked, reserved) = fill(&mut e, 300, 120, 30);
    for i in 0..50 {
        e.produce("t", req(&format!("d{i}"), When::DelayMs(10_000))).unwrap();
    }
    e.flush().unwrap();
    e.checkpoint().unwrap();
    drop(e);
    let path = dir.path().join("checkpoint");
    let mut b = std::fs::read(&path).unwrap();
    for x in b.iter_mut().skip(8).take(16) {
        *x ^= 0xA5;
    }
    // Both modes rebuild rather than refuse, and leave a checkpoint of the rebuilt state behind.
    for mode in [RecoveryMode::Strict, RecoveryMode::Truncate] {
        std::fs::write(&path, &b).unwrap();
        let (e, report) = open(dir.path(), &clock, mode).unwrap();
        assert!(report.checkpoint_rebuilt && report.rebuilt, "{report:?}");
        drop(e);
        let cp = crate::storage::checkpoint::Checkpoint::load(&path).unwrap();
        assert!(cp.dispatched > 0, "the rebuild was checkpointed: {cp:?}");
    }
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    for id in &acked {
        assert_eq!(e.get(id).unwrap().state, MessageState::Done, "{id}");
    }
    for id in &reserved {
        assert_eq!(e.get(id).unwrap().state, MessageState::Reserved, "{id}");
    }
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    let want: BTreeSet<String> = (150..300).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "exactly the unpopped messages, once each");
    clock.advance_ms(10_000);
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    assert_eq!(got, (0..50).map(|i| format!("d{i}")).collect::<BTreeSet<_>>(), "the delayed ones, on time");
    // The counters came back from the log: 30 reserved.
    let stats = e.stats();
    assert_eq!(stats.topics.iter().find(|t| t.topic == "t").unwrap().reserved, 30);
}

/// XORs `len` bytes of `path` at `at` with a pattern that changes every byte.
fn flip(path: &Path, at: usize, len: usize) {
    let mut b = std::fs::read(path).unwrap();
    for (i, x) in b[at..at + len].iter_mut().enumerate() {
        *x ^= 0x5A ^ (i as u8).wrapping_mul(31) | 1;
    }
    std::fs::write(path, &b).unwrap();
}

#[test]
fn a_damaged_topic_queue_file_is_detected_at_start_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    let (acked, _) = fill(&mut e, 240, 50, 0);
    e.close().unwrap();
    // 200 bytes (10 entries) of the unread part, as in the adversarial run.
    flip(&dir.path().join("cq/topic/t-t").join(format!("{:020}", 0)), 60 * 20, 200);
    let (mut e, report) = open_checking(dir.path(), &clock).unwrap();
    assert!(report.checked && report.queue_damaged && report.rebuilt, "{report:?}");
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    assert_eq!(got, (50..240).map(|i| format!("m{i}")).collect::<BTreeSet<_>>());
    assert!(acked.iter().all(|id| !got.contains(id)));
}

#[test]
fn a_queue_file_damaged_while_running_is_repaired_from_the_log_at_the_next_pop() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let (mut e, _) =
        Engine::open(config(dir.path(), RecoveryMode::Strict), clock.clone(), metrics.clone()).unwrap();
    let (_, _) = fill(&mut e, 240, 50, 0);
    for i in 0..40 {
        e.produce("t", req(&format!("late{i}"), When::DelayMs(5_000))).unwrap();
    }
    // The files are mapped: writing them on disk changes what the running engine reads.
    flip(&dir.path().join("cq/topic/t-t").join(format!("{:020}", 0)), 60 * 20, 200);
    // The 5 s level holds the delayed messages' timers (entries 5..8 damaged).
    flip(&dir.path().join("cq/level/000000005000").join(format!("{:020}", 0)), 5 * 20, 60);
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    assert_eq!(got, (50..240).map(|i| format!("m{i}")).collect::<BTreeSet<_>>());
    clock.advance_ms(5_000);
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    assert_eq!(got, (0..40).map(|i| format!("late{i}")).collect::<BTreeSet<_>>());
    assert!(metrics.queue_repairs.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    // The repair is durable like any append: a restart finds consistent queues.
    e.close().unwrap();
    let (mut e, report) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    assert!(!report.rebuilt && !report.queue_damaged, "{report:?}");
    assert!(drain(&mut e).is_empty());
}

#[test]
fn a_damaged_id_index_is_detected_at_start_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    let (acked, _) = fill(&mut e, 3000, 500, 0);
    // Let any resize finish, so `ids` alone holds the table.
    while e.store_for_tests().index_migrating() {
        e.maintain().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    e.close().unwrap();
    let ids = dir.path().join("index/ids");
    let size = std::fs::metadata(&ids).unwrap().len() as usize;
    assert!(size > 16 << 10);
    // 4 KiB in the middle of the table, as in the adversarial run.
    flip(&ids, size / 2 / 4096 * 4096, 4096);
    let (mut e, report) = open_checking(dir.path(), &clock).unwrap();
    assert!(report.index_damaged && report.rebuilt, "{report:?}");
    for i in 0..3000 {
        let id = format!("m{i}");
        let want = if i < 500 { MessageState::Done } else { MessageState::Ready };
        assert_eq!(e.get(&id).unwrap().state, want, "{id}");
    }
    let got: BTreeSet<String> = drain(&mut e).into_iter().collect();
    assert_eq!(got.len(), 2500);
    assert!(acked.iter().all(|id| !got.contains(id)));
}

#[test]
fn a_slot_that_disagrees_with_its_record_is_damage() {
    // One slot's state byte changed to another valid state: only the check against the log
    // notices (the table's structure is intact). Only damage to the file does this, which
    // `check_on_start = always` looks for at every start, after a crash or a clean shutdown;
    // the default start after a crash checks the structure and the bounds alone.
    for crashed in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::at_ms(T0));
        let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
        fill(&mut e, 10, 0, 0);
        e.close().unwrap();
        let ids = dir.path().join("index/ids");
        let mut b = std::fs::read(&ids).unwrap();
        let slot = (0..64).map(slot_position).find(|p| b[p + 31] & 1 == 1).unwrap();
        assert_eq!(b[slot + 30], MessageState::Ready as u8 - 1 + 2, "a Ready slot (state 2)");
        b[slot + 30] = 4; // Done: the message would never be delivered
        std::fs::write(&ids, &b).unwrap();
        if crashed {
            std::fs::remove_file(dir.path().join("clean_shutdown")).unwrap();
            let copy = tempfile::tempdir().unwrap();
            copy_dir(dir.path(), copy.path());
            let (_, report) = open(copy.path(), &clock, RecoveryMode::Strict).unwrap();
            assert!(report.checked && !report.checked_records, "{report:?}");
        }
        let (mut e, report) = open_checking(dir.path(), &clock).unwrap();
        assert!(report.checked_records && report.index_damaged, "crashed {crashed}: {report:?}");
        assert_eq!(drain(&mut e).len(), 10);
    }
}

#[test]
fn a_slot_whose_record_length_is_wrong_is_damage() {
    // The length a slot keeps is what reclaim counts as live after a crash, unread from the log:
    // a check against the log compares it with the record's own.
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    fill(&mut e, 10, 0, 0);
    let live = e.store_for_tests().count_live_bytes();
    e.close().unwrap();
    let ids = dir.path().join("index/ids");
    let mut b = std::fs::read(&ids).unwrap();
    let slot = (0..64).map(slot_position).find(|p| b[p + 31] & 1 == 1).unwrap();
    let len = u32::from_le_bytes(b[slot + 32..slot + 36].try_into().unwrap());
    assert_eq!(u64::from(len) * 10, live, "ten messages of one length: the slot holds it");
    b[slot + 32..slot + 36].copy_from_slice(&(len + 1).to_le_bytes());
    std::fs::write(&ids, &b).unwrap();
    let (mut e, report) = open_checking(dir.path(), &clock).unwrap();
    assert!(report.index_damaged && report.rebuilt, "{report:?}");
    assert_eq!(e.store_for_tests().count_live_bytes(), live);
    assert_eq!(e.store_for_tests().live_bytes(), live, "the rebuilt slots' lengths are counted");
    assert_eq!(drain(&mut e).len(), 10);
}

/// Copies the files of data directory `from` into `to` (for a second open of the same state).
fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_dir(&e.path(), &target);
        } else if e.file_name() != "LOCK" {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// After a clean shutdown the default start takes the derived files and the counts the close
/// recorded, without a pass over the index or a read per message; what it takes is what a
/// recount finds. A start that must rebuild recounts.
#[test]
fn a_clean_shutdown_hands_its_counts_to_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    // Acked, reserved, ready and delayed messages over several 64 KiB segments, and a pause.
    let (_, reserved) = fill(&mut e, 1500, 300, 40);
    for i in 0..400 {
        e.produce("t", req(&format!("d{i}"), When::DelayMs(60_000))).unwrap();
    }
    e.set_paused("other", true).unwrap();
    let (live, segs) = {
        let s = e.store_for_tests();
        assert_eq!(s.segment_counts_differ(), None, "the running counts are right to begin with");
        assert!(s.log_segments() > 3, "{} segments", s.log_segments());
        (s.live_bytes(), s.segment_counts())
    };
    e.close().unwrap();

    let (mut e, report) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    assert!(report.clean && !report.checked && !report.rebuilt, "{report:?}");
    let s = e.store_for_tests();
    assert_eq!((s.live_bytes(), s.segment_counts()), (live, segs), "the counts the close recorded");
    assert_eq!(s.segment_counts_differ(), None);
    assert_eq!(s.live_bytes(), s.count_live_bytes());
    assert_eq!(s.index_len(), 1500 + 400, "every message but none forgotten is in the index");
    for id in &reserved {
        assert_eq!(e.get(id).unwrap().state, MessageState::Reserved, "{id}");
    }
    clock.advance_ms(60_000);
    // The reservations' 30 s ran out too: every message not acked comes back.
    assert_eq!(drain(&mut e).len(), 1500 - 300 + 400, "the ready, reserved and delayed ones");
    e.close().unwrap();

    // Derived files gone: the open rebuilds them and recounts, whatever the marker says.
    std::fs::remove_dir_all(dir.path().join("index")).unwrap();
    let (e, report) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    assert!(report.rebuilt, "{report:?}");
    let s = e.store_for_tests();
    assert_eq!(s.segment_counts_differ(), None);
    assert_eq!(s.live_bytes(), s.count_live_bytes());
}

#[test]
fn a_pop_over_a_damaged_record_reserves_nothing_it_does_not_return() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let metrics = Arc::new(Metrics::default());
    let (mut e, _) =
        Engine::open(config(dir.path(), RecoveryMode::Strict), clock.clone(), metrics.clone()).unwrap();
    for i in 0..100 {
        e.produce("t", req(&format!("m{i}"), When::Now)).unwrap();
    }
    e.flush().unwrap();
    // Damage the body of m50's Put in place (the segment is mapped: the engine sees it at once).
    let seg = dir.path().join("commitlog").join(format!("{:020}", 0));
    let b = std::fs::read(&seg).unwrap();
    let needle = b"body of m50 ";
    let at = b.windows(needle.len()).position(|w| w == needle).unwrap();
    flip(&seg, at + 2, 1);
    let ds = e.pop(&topics(), 1000, None).unwrap();
    assert_eq!(ds.len(), 99);
    assert!(ds.iter().all(|d| d.id != "m50"));
    // Every reservation made was returned: the topic counts exactly the deliveries.
    let stats = e.stats();
    assert_eq!(stats.topics.iter().find(|t| t.topic == "t").unwrap().reserved, 99);
    assert_eq!(metrics.corrupt_records.load(std::sync::atomic::Ordering::Relaxed), 1);
    // The pop did not stop at the damage, and a later pop has nothing hidden.
    assert!(e.pop(&topics(), 1000, None).unwrap().is_empty());
}

/// After a crash the index check's pass also counts live bytes and segments; with nothing to
/// replay those counts stand, and they are what a recount finds. With records to replay, the
/// open recounts after the replay.
#[test]
fn after_a_crash_the_index_check_counts_what_it_checks() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    fill(&mut e, 1200, 200, 30);
    for i in 0..300 {
        e.produce("t", req(&format!("d{i}"), When::DelayMs(60_000))).unwrap();
    }
    e.set_paused("other", true).unwrap();
    e.close().unwrap();
    std::fs::remove_file(dir.path().join("clean_shutdown")).unwrap();
    let (mut e, report) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    assert!(report.checked && !report.rebuilt && report.redispatched == 0, "{report:?}");
    let s = e.store_for_tests();
    assert_eq!(s.segment_counts_differ(), None, "the check's counts, with the pause's record");
    assert_eq!(s.live_bytes(), s.count_live_bytes());

    // Changes past the last checkpoint, then a crash (no close): they are replayed.
    let ds = e.pop(&topics(), 100, None).unwrap();
    for d in &ds[..50] {
        e.ack(&d.receipt).unwrap();
    }
    drop(e);
    let (e, report) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    assert!(report.checked && report.redispatched > 0, "{report:?}");
    let s = e.store_for_tests();
    assert_eq!(s.segment_counts_differ(), None);
    assert_eq!(s.live_bytes(), s.count_live_bytes());
}

#[test]
fn the_open_reports_how_long_each_of_its_parts_took() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let (mut e, _) = open(dir.path(), &clock, RecoveryMode::Strict).unwrap();
    fill(&mut e, 20_000, 0, 0);
    e.close().unwrap();
    let started = std::time::Instant::now();
    let (_e, report) = open_checking(dir.path(), &clock).unwrap();
    assert!(report.checked, "{report:?}");
    let whole = started.elapsed().as_millis() as u64;
    let t = report.took;
    // The parts are measured one after the other inside the open: together never more than it.
    let parts = t.log_ms + t.check_ms + t.replay_ms;
    assert!(parts <= whole, "{t:?} add up to {parts} ms, the whole open took {whole} ms");
    // Checking 20,000 slots against the log is the open's largest part.
    assert!(t.check_ms >= t.replay_ms && t.check_ms >= t.log_ms, "{t:?}");
}
