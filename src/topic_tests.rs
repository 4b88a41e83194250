//! What a topic costs: allocated disk per topic, open files and mappings bounded by
//! `open_queues`, and emptied topics forgotten.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::broker::{BrokerConfig, ProduceRequest, When};
use crate::engine::Engine;
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
    assert_eq!(disk, s.log.disk_bytes() + s.index.disk_bytes() + n as u64 * 20 * 1024, "stats agree");
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
        // Each open queue holds at most its two newest files here (4 entries per file).
        let (fds, maps) = held_under(&topic_root);
        assert!(fds <= 2 * k && maps <= 2 * k, "{fds} handles and {maps} mappings under cq/topic");
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
