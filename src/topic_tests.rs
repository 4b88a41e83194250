//! What a topic costs: allocated disk per topic, open files and mappings bounded by
//! `open_queues`, and emptied topics forgotten.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::config::BrokerConfig;
use crate::engine::Engine;
use crate::message::{ProduceRequest, When};
use crate::metrics::Metrics;
use crate::schedule::clock::ManualClock;

const T0: u64 = 1_700_000_000_000;

fn open_with(dir: &Path, clock: &Arc<ManualClock>, edit: impl Fn(&mut BrokerConfig)) -> Engine {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 1 << 20;
    c.index_initial_slots = 64;
    edit(&mut c);
    Engine::open(c, clock.clone(), Arc::new(Metrics::default())).unwrap().0
}

fn req(id: &str) -> ProduceRequest {
    ProduceRequest {
        id: Some(id.to_string()),
        body: Bytes::from(format!("body of {id}")),
        when: When::Now,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    }
}

fn topic(i: usize) -> String {
    format!("topic-{i}")
}

/// Bytes allocated on disk (not the apparent size) by the files under `dir`, and how many files.
fn allocated(dir: &Path) -> (u64, usize) {
    let (mut bytes, mut files) = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                bytes += m.blocks() * 512;
                files += 1;
            }
        }
    }
    (bytes, files)
}

/// File handles and mappings this process holds on files under `dir` (other tests running in the
/// same process use other directories).
fn held_under(dir: &Path) -> (usize, usize) {
    let dir = dir.canonicalize().unwrap();
    let fds = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|p| p.starts_with(&dir))
        .count();
    let prefix = format!("{}/", dir.display());
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let maps =
        maps.lines().filter(|l| l.split_whitespace().nth(5).is_some_and(|p| p.starts_with(&prefix))).count();
    (fds, maps)
}

#[test]
fn a_one_message_topic_costs_one_small_file() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    // The default 300,000 entries per file, which used to be preallocated in full (6 MB a topic).
    let mut e = open_with(dir.path(), &clock, |c| c.max_topics = 1000);
    let n = 400;
    for i in 0..n {
        e.produce(&topic(i), req(&format!("m{i}"))).unwrap();
    }
    e.checkpoint().unwrap();
    let (bytes, files) = allocated(&dir.path().join("cq").join("topic"));
    assert_eq!(files, n, "one file per topic");
    let per_topic = bytes / n as u64;
    // 1,024 entries of 20 bytes, preallocated for real (not a sparse file), and no more.
    assert!((20 << 10..=24 << 10).contains(&per_topic), "{per_topic} bytes allocated per topic");
    let disk = e.stats().disk_bytes;
    let s = e.store_for_tests();
    assert_eq!(disk, s.log_disk_bytes() + s.index().disk_bytes() + n as u64 * 20 * 1024, "stats agree");
    eprintln!("{n} one-message topics: {} KiB allocated in queue files", bytes >> 10);
}

#[test]
fn open_queue_files_stay_within_open_queues_while_every_topic_works() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let k = 5;
    let topics = 40;
    let cfg = |c: &mut BrokerConfig| {
        c.open_queues = k;
        c.cq_entries_per_file = 4;
    };
    let mut e = open_with(dir.path(), &clock, cfg);
    let topic_root = dir.path().join("cq").join("topic");
    let check = |e: &Engine| {
        let open = e.store_for_tests().open_topic_queues();
        assert!(open <= k, "{open} topic queues open");
        // Each open queue holds at most three files here (4 entries per file): its two newest and,
        // once reopened from disk, the empty one made ahead for its next append; or, while a
        // helper is making that one, those and the helper's one handle at a time (it maps
        // nothing). The helper used to hold the previous file, the new one and their directory at
        // once, which took this over the bound when it was slow (seen under load).
        let (fds, maps) = held_under(&topic_root);
        assert!(fds <= 4 * k && maps <= 3 * k, "{fds} handles and {maps} mappings under cq/topic");
    };
    // Six messages per topic, produced round-robin so every append evicts some queue.
    for round in 0..6 {
        for t in 0..topics {
            e.produce(&topic(t), req(&format!("m{t}-{round}"))).unwrap();
            check(&e);
        }
        if round == 2 {
            e.checkpoint().unwrap();
        }
    }
    // Stats need no open file.
    let stats = e.stats();
    assert_eq!(stats.topics.len(), topics);
    assert!(stats.topics.iter().all(|s| s.ready == 6), "{:?}", stats.topics);
    assert!(stats.open_queues <= k);
    // Pop three from each topic, in an order that keeps evicting.
    let mut receipts = vec![];
    for t in (0..topics).rev() {
        let got = e.pop(&[topic(t)], 3, None).unwrap();
        let ids: Vec<_> = got.iter().map(|d| d.id.clone()).collect();
        assert_eq!(ids, (0..3).map(|r| format!("m{t}-{r}")).collect::<Vec<_>>());
        receipts.extend(got.into_iter().map(|d| d.receipt));
        check(&e);
    }
    for r in &receipts {
        e.ack(r).unwrap();
    }
    // A crash (no clean close) after a checkpoint that synced closed queues by path.
    e.checkpoint().unwrap();
    drop(e);
    let mut e = open_with(dir.path(), &clock, cfg);
    check(&e);
    for t in 0..topics {
        let got = e.pop(&[topic(t)], 10, None).unwrap();
        let ids: Vec<_> = got.iter().map(|d| d.id.clone()).collect();
        assert_eq!(ids, (3..6).map(|r| format!("m{t}-{r}")).collect::<Vec<_>>(), "topic {t} after the crash");
        check(&e);
    }
    assert!(e.stats().topics.iter().all(|s| s.ready == 0 && s.reserved == 3));
    let (fds, maps) = held_under(&topic_root);
    assert!(fds > 0 && maps > 0, "the check above counts something");
}

fn topic_dirs(data: &Path) -> Vec<String> {
    let mut names: Vec<String> = match std::fs::read_dir(data.join("cq").join("topic")) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => vec![],
    };
    names.sort();
    names
}

fn stat_topics(e: &mut Engine) -> Vec<(String, u64, u64)> {
    e.stats().topics.into_iter().map(|t| (t.topic, t.ready, t.reserved)).collect()
}

fn pop_ids(e: &mut Engine, t: &str) -> Vec<String> {
    let got = e.pop(&[t.to_string()], 100, None).unwrap();
    for d in &got {
        e.ack(&d.receipt).unwrap();
    }
    got.into_iter().map(|d| d.id).collect()
}

#[test]
fn an_emptied_topic_is_forgotten_after_a_durable_checkpoint_and_can_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let cfg = |c: &mut BrokerConfig| c.max_topics = 2;
    let mut e = open_with(dir.path(), &clock, cfg);
    e.produce("a", req("a1")).unwrap();
    e.produce("b", req("b1")).unwrap();
    assert!(matches!(e.produce("c", req("c1")), Err(crate::Error::TooManyTopics(_))));

    // Read, but no checkpoint has shown it yet: still there.
    assert_eq!(pop_ids(&mut e, "a"), ["a1"]);
    assert_eq!(stat_topics(&mut e), [("a".into(), 0, 0), ("b".into(), 1, 0)]);
    assert_eq!(topic_dirs(dir.path()), ["t-a", "t-b"]);

    // A checkpoint that shows "a" emptied, made durable after "a" got a new message: kept.
    let job = e.checkpoint_job().unwrap();
    let cp = job.checkpoint.clone();
    e.produce("a", req("a2")).unwrap();
    job.run().unwrap();
    e.checkpoint_durable(&cp);
    assert_eq!(pop_ids(&mut e, "a"), ["a2"]);

    // A reserved message keeps "b" until it is acked.
    let held = e.pop(&["b".to_string()], 1, None).unwrap();
    e.checkpoint().unwrap();
    assert_eq!(stat_topics(&mut e), [("b".into(), 0, 1)], "a is forgotten, b is held");
    assert_eq!(topic_dirs(dir.path()), ["t-b"]);
    assert_eq!(e.store_for_tests().reclaim_stats().topics_forgotten, 1);
    e.ack(&held[0].receipt).unwrap();
    e.checkpoint().unwrap();
    assert!(stat_topics(&mut e).is_empty());
    assert!(topic_dirs(dir.path()).is_empty());
    assert_eq!(e.stats().disk_bytes, {
        let s = e.store_for_tests();
        s.log_disk_bytes() + s.index().disk_bytes() + s.levels().map(|(_, q)| q.cq.disk_bytes()).sum::<u64>()
    });

    // Forgotten topics no longer count against max_topics, and come back fresh when used.
    e.produce("c", req("c1")).unwrap();
    e.produce("a", req("a3")).unwrap();
    assert!(matches!(e.produce("d", req("d1")), Err(crate::Error::TooManyTopics(_))));
    assert_eq!(stat_topics(&mut e), [("a".into(), 1, 0), ("c".into(), 1, 0)]);
    // Done messages of a forgotten topic stay what they were; nothing is delivered twice.
    assert_eq!(e.get("a1").unwrap().state, crate::message::MessageState::Done);
    assert_eq!(pop_ids(&mut e, "a"), ["a3"]);
    assert_eq!(pop_ids(&mut e, "b"), Vec::<String>::new());

    // A clean shutdown leaves a checkpoint that lists exactly the queues on disk.
    e.close().unwrap();
    assert_eq!(topic_dirs(dir.path()), ["t-c"]);
    let cp = crate::storage::checkpoint::Checkpoint::load(&dir.path().join("checkpoint")).unwrap();
    let topics: Vec<_> =
        cp.queues.iter().filter(|q| q.kind == crate::storage::checkpoint::QueueKind::Topic).collect();
    assert_eq!(topics.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(), ["c"]);
    let mut e = open_with(dir.path(), &clock, cfg);
    assert_eq!(pop_ids(&mut e, "c"), ["c1"]);
    assert_eq!(pop_ids(&mut e, "a"), Vec::<String>::new());
}

#[test]
fn crashes_around_forgetting_lose_and_resurrect_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let cfg = |c: &mut BrokerConfig| c.cq_entries_per_file = 4;
    let mut e = open_with(dir.path(), &clock, cfg);
    // Six messages read (two files, the last partly used), then forgotten: the checkpoint written
    // just before lists "t" with len 6 and cursor 6, and the crash comes before the next one.
    for i in 0..6 {
        e.produce("t", req(&format!("old{i}"))).unwrap();
    }
    assert_eq!(pop_ids(&mut e, "t").len(), 6);
    e.checkpoint().unwrap();
    assert!(topic_dirs(dir.path()).is_empty(), "forgotten");
    drop(e);
    let mut e = open_with(dir.path(), &clock, cfg);
    assert_eq!(pop_ids(&mut e, "t"), Vec::<String>::new(), "nothing acked comes back");
    assert_eq!(e.get("old5").unwrap().state, crate::message::MessageState::Done);

    // Forgotten, then recreated with more entries than the old checkpoint's length before the
    // crash: the recreated queue's entries start at 0 again, and all of them must survive.
    e.checkpoint().unwrap();
    assert!(topic_dirs(dir.path()).is_empty(), "forgotten again");
    for i in 0..9 {
        e.produce("t", req(&format!("new{i}"))).unwrap();
    }
    drop(e);
    let mut e = open_with(dir.path(), &clock, cfg);
    let want: Vec<String> = (0..9).map(|i| format!("new{i}")).collect();
    assert_eq!(pop_ids(&mut e, "t"), want, "every new message, once, in order");
    assert_eq!(pop_ids(&mut e, "t"), Vec::<String>::new());

    // Partly deleted files (a crash in the middle of forgetting): the same.
    e.checkpoint().unwrap();
    for i in 0..6 {
        e.produce("u", req(&format!("u{i}"))).unwrap();
    }
    assert_eq!(pop_ids(&mut e, "u").len(), 6);
    e.checkpoint().unwrap();
    std::fs::create_dir_all(dir.path().join("cq/topic/t-u")).unwrap();
    std::fs::write(dir.path().join("cq/topic/t-u/00000000000000000004"), vec![0u8; 40]).unwrap();
    e.produce("v", req("v0")).unwrap();
    drop(e);
    let mut e = open_with(dir.path(), &clock, cfg);
    assert_eq!(pop_ids(&mut e, "u"), Vec::<String>::new());
    assert_eq!(pop_ids(&mut e, "v"), ["v0"]);
    e.close().unwrap();
    assert_eq!(topic_dirs(dir.path()), Vec::<String>::new());
}

#[test]
fn a_checkpoint_older_than_a_recreated_topic_does_not_touch_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open_with(dir.path(), &clock, |c| c.cq_entries_per_file = 4);
    for i in 0..10 {
        e.produce("t", req(&format!("old{i}"))).unwrap();
    }
    assert_eq!(pop_ids(&mut e, "t").len(), 10);
    // Two checkpoints both show "t" emptied (len 10, cursor 10); the second was captured before
    // the first became durable, as the broker's checkpoint thread allows.
    let (first, second) = (e.checkpoint_job().unwrap(), e.checkpoint_job().unwrap());
    let (cp1, cp2) = (first.checkpoint.clone(), second.checkpoint.clone());
    first.run().unwrap();
    e.checkpoint_durable(&cp1);
    assert!(topic_dirs(dir.path()).is_empty(), "forgotten");
    // Recreated from entry 0 with six unread messages, in files 0 and 4.
    for i in 0..6 {
        e.produce("t", req(&format!("new{i}"))).unwrap();
    }
    // The older checkpoint's cursor (10) and emptiness describe the topic before it was forgotten:
    // they must neither delete the new files nor forget the new topic.
    second.run().unwrap();
    e.checkpoint_durable(&cp2);
    let want: Vec<String> = (0..6).map(|i| format!("new{i}")).collect();
    assert_eq!(pop_ids(&mut e, "t"), want);
}

#[test]
fn topic_counts_go_with_a_forgotten_topic_and_the_oldest_ready_skips_stale_entries() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open_with(dir.path(), &clock, |_| {});
    let counts =
        |e: &mut Engine, t: &str| e.stats().topics.into_iter().find(|s| s.topic == t).map(|s| s.counts);
    let oldest =
        |e: &mut Engine, t: &str| e.stats().topics.into_iter().find(|s| s.topic == t)?.oldest_ready_ms;

    // Two ready messages, 5 s apart; the older one cancelled leaves a stale entry at the head.
    e.produce("a", req("a1")).unwrap();
    clock.advance_ms(5_000);
    e.produce("a", req("a2")).unwrap();
    assert_eq!(oldest(&mut e, "a"), Some(T0));
    e.cancel("a1").unwrap();
    assert_eq!(oldest(&mut e, "a"), Some(T0 + 5_000), "the cancelled message is not the oldest ready");
    assert_eq!(pop_ids(&mut e, "a"), ["a2"]);
    assert_eq!(oldest(&mut e, "a"), None);
    let c = counts(&mut e, "a").expect("a listed");
    assert_eq!((c.produced, c.acked, c.nacked, c.dead_lettered), (2, 1, 0, 0));

    // Emptied and checkpointed, "a" is forgotten with its counts; used again, it starts afresh.
    e.checkpoint().unwrap();
    assert_eq!(counts(&mut e, "a"), None);
    e.produce("a", req("a3")).unwrap();
    assert_eq!(counts(&mut e, "a").map(|c| c.produced), Some(1));
}

#[test]
fn a_stats_read_does_not_open_a_closed_queue_whose_reader_has_not_moved() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::at_ms(T0));
    let mut e = open_with(dir.path(), &clock, |c| c.open_queues = 1);
    let oldest = |e: &mut Engine| {
        let stats = e.stats().topics;
        stats.iter().map(|t| (t.topic.clone(), t.oldest_ready_ms)).collect::<Vec<_>>()
    };
    let open = |e: &Engine, t: &str| e.store_for_tests().topic_queue(t).is_some_and(|q| q.is_open());
    e.produce("a", req("a1")).unwrap();
    clock.advance_ms(1_000);
    e.produce("b", req("b1")).unwrap();
    let want = vec![("a".to_string(), Some(T0)), ("b".to_string(), Some(T0 + 1_000))];
    assert_eq!(oldest(&mut e), want);
    // Another message for "a" opens its queue and closes "b"'s; "b"'s reader has not moved.
    clock.advance_ms(1_000);
    e.produce("a", req("a2")).unwrap();
    assert!(open(&e, "a") && !open(&e, "b"));
    assert_eq!(oldest(&mut e), want, "b's answer is reused");
    assert!(open(&e, "a") && !open(&e, "b"), "the read left the open queues as they were");
    // Once b's reader moves, its answer is found again.
    assert_eq!(pop_ids(&mut e, "b"), ["b1"]);
    clock.advance_ms(1_000);
    e.produce("b", req("b2")).unwrap();
    e.produce("a", req("a3")).unwrap();
    assert_eq!(oldest(&mut e)[1], ("b".to_string(), Some(T0 + 3_000)));
}
