//! SIGKILL of the real binary while chained delays are hopping: level entries fired since the
//! last checkpoint fire again after the restart, and each must not write a second Hop (which would
//! start a parallel chain to the same target). The Hops are counted in the commit log itself,
//! read with the crate's own record decoder.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use common::{now_ms, Server, NEVER_HANG};
use delayd::storage::format::{self, Record};
use serde_json::{json, Value};

const MESSAGES: usize = 40;
/// 4 s levels and a 13.5 s delay: hops at +4 s, +8 s and +12 s (the 1.5 s remainder), due at
/// +13.5 s. The count is exact as long as the fires are less than 1.5 s late in all.
const LEVELS: &str = "4s";
const DELAY_MS: u64 = 13_500;
const HOPS_PER_MESSAGE: usize = 3;

/// Hop records per message id, from every segment of the commit log in `data`.
fn hops_per_id(data: &Path) -> HashMap<String, usize> {
    let dir = data.join("commitlog");
    let mut names: Vec<u64> = std::fs::read_dir(&dir)
        .expect("commitlog dir")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    names.sort_unstable();
    let (mut ids, mut hops) = (HashMap::new(), HashMap::<u64, usize>::new());
    for base in names {
        let bytes = std::fs::read(dir.join(format!("{base:020}"))).expect("read segment");
        let mut pos = 0;
        while pos < bytes.len() {
            let Ok((rec, len)) = format::decode(&bytes[pos..]) else { break };
            match rec {
                Record::Put(p) => {
                    ids.insert(base + pos as u64, String::from_utf8_lossy(p.id).into_owned());
                }
                Record::Hop(h) => *hops.entry(h.msg_offset).or_default() += 1,
                Record::EndOfSegment => break,
                _ => {}
            }
            pos += len;
        }
    }
    ids.into_iter().map(|(at, id)| (id, hops.get(&at).copied().unwrap_or(0))).collect()
}

fn metric(s: &Server, name: &str) -> u64 {
    let (st, text) = s.get_text("/metrics");
    assert_eq!(st, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics")) as u64
}

fn checkpoint_mtime(data: &Path) -> Option<SystemTime> {
    std::fs::metadata(data.join("checkpoint")).and_then(|m| m.modified()).ok()
}

#[test]
fn a_sigkill_while_delays_hop_writes_no_second_hop() {
    let mut s = Server::start(&[("DELAYD_LEVELS", LEVELS), ("DELAYD_DONE_RETENTION", "1h")]);
    let data = s.data_dir();
    // Checkpoints come every 5 s (when something was written). Find their phase from the file,
    // then produce mid-way between two, so the first hops fall after one and the kill before
    // the next: the entries that hopped are past the checkpointed cursor and fire again.
    s.produce("warm", &json!({"body": "x"}));
    let deadline = Instant::now() + NEVER_HANG;
    while checkpoint_mtime(&data).is_none() {
        assert!(Instant::now() < deadline, "no checkpoint written");
        std::thread::sleep(Duration::from_millis(10));
    }
    let written = checkpoint_mtime(&data).expect("checkpoint");
    let since = written.elapsed().unwrap_or_default();
    std::thread::sleep(Duration::from_millis(2_500).saturating_sub(since));
    let batch: Vec<Value> =
        (0..MESSAGES).map(|i| json!({"id": format!("m{i}"), "body": "b", "delay_ms": DELAY_MS})).collect();
    let produced_at = now_ms();
    let (st, v) = s.post("/v1/topics/t/messages/batch", &json!({ "messages": batch }));
    assert_eq!(st, 201, "{v}");

    // Kill right after the first hop of every message (about 6.5 s after the checkpoint).
    let deadline = Instant::now() + NEVER_HANG;
    while metric(&s, "delayd_hops_total") < MESSAGES as u64 {
        assert!(Instant::now() < deadline, "the first hops never came");
        std::thread::sleep(Duration::from_millis(10));
    }
    s.kill9();
    let first = hops_per_id(&data);
    assert!(
        first.iter().filter(|(id, _)| id.starts_with('m')).all(|(_, &n)| n == 1),
        "one hop each before the kill: {first:?}"
    );
    s.respawn();

    let mut delivered: HashMap<String, usize> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while delivered.len() < MESSAGES {
        assert!(Instant::now() < deadline, "only {} of {MESSAGES} delivered", delivered.len());
        let (msgs, at) = s.pop("t", 100, 1_000, None);
        for m in msgs {
            assert!(at >= produced_at + DELAY_MS, "delivered early: {m}");
            *delivered.entry(m["id"].as_str().expect("id").to_string()).or_default() += 1;
            assert_eq!(s.ack(m["receipt"].as_str().expect("receipt")), 200);
        }
    }
    // A duplicate chain would bring nothing more (its final hop finds the message moved on),
    // but its Hops are in the log.
    let (msgs, _) = s.pop("t", 100, 1_500, None);
    assert!(msgs.is_empty(), "delivered twice: {msgs:?}");
    assert!(delivered.values().all(|&n| n == 1), "{delivered:?}");
    s.terminate();
    let hops = hops_per_id(&data);
    let wrong: Vec<_> = hops.iter().filter(|(id, &n)| id.starts_with('m') && n != HOPS_PER_MESSAGE).collect();
    assert!(wrong.is_empty(), "messages with other than {HOPS_PER_MESSAGE} hops: {wrong:?}");
    assert_eq!(hops.keys().filter(|id| id.starts_with('m')).count(), MESSAGES);
}
