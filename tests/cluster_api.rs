//! The cluster as a client meets it, on three real processes: `/v1/cluster` on every node, a
//! follower's 307 to the leader with the same path and query, `503 no_leader` without a
//! majority, the cluster's metrics, and reservations, receipts, touches and reschedules across a
//! leader's death.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{short_client, Cluster};
use common::now_ms;
use serde_json::{json, Value};

fn follower_of(c: &Cluster, leader: usize) -> usize {
    (1..=c.size()).find(|i| *i != leader && c.is_running(*i)).expect("a running follower")
}

#[test]
fn every_node_answers_cluster_and_a_follower_redirects_with_path_and_query() {
    let c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let leader_url = c.url(leader);
    for i in 1..=3 {
        let v: Value = short_client(Duration::from_secs(5))
            .get(format!("{}/v1/cluster", c.url(i)))
            .send()
            .and_then(|r| r.json())
            .expect("cluster view");
        assert_eq!(v["node_id"], json!(i));
        assert_eq!(v["leader_id"], json!(leader), "{v}");
        assert_eq!(v["leader_url"], json!(leader_url), "{v}");
        assert_eq!(v["role"], json!(if i == leader { "leader" } else { "follower" }), "{v}");
        assert_eq!(v["nodes"].as_array().map(Vec::len), Some(3), "{v}");
        for key in ["term", "commit_index", "last_index", "applied_index"] {
            assert!(v[key].as_u64().is_some(), "{key} in {v}");
        }
    }
    let f = follower_of(&c, leader);
    let http = short_client(Duration::from_secs(5));
    let r = http
        .post(format!("{}/v1/topics/t1/pop?max=2&wait_ms=0", c.url(f)))
        .send()
        .expect("pop on a follower");
    assert_eq!(r.status().as_u16(), 307);
    let location = r.headers()["location"].to_str().expect("location").to_string();
    assert_eq!(location, format!("{leader_url}/v1/topics/t1/pop?max=2&wait_ms=0"));
    // Reads by id go to the leader too (a follower's answer could be stale).
    let r = http.get(format!("{}/v1/messages/nope", c.url(f))).send().expect("get on a follower");
    assert_eq!(r.status().as_u16(), 307);
    // The leader's metrics say it leads, and how far each follower is behind.
    let text = http.get(format!("{leader_url}/metrics")).send().and_then(|r| r.text()).expect("metrics");
    assert!(text.contains("delayd_cluster_is_leader 1"), "{text}");
    assert!(text.contains("delayd_cluster_replication_lag_entries{node="), "{text}");
    assert!(text.contains("delayd_cluster_quorum_wait_seconds_bucket"), "{text}");
    // A follower serves its own metrics instead of redirecting.
    let r = http.get(format!("{}/metrics", c.url(f))).send().expect("follower metrics");
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().expect("text").contains("delayd_cluster_is_leader 0"));
}

#[test]
fn without_a_majority_writes_get_503_no_leader_with_retry_after() {
    let mut c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let survivor = follower_of(&c, leader);
    for i in (1..=3).filter(|i| *i != survivor) {
        c.kill9(i);
    }
    let http = short_client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = http
            .post(format!("{}/v1/topics/t/messages", c.url(survivor)))
            .json(&json!({"body": "x"}))
            .send()
            .expect("produce");
        let status = r.status().as_u16();
        let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap_or_default().to_string());
        let body: Value = r.json().unwrap_or(Value::Null);
        if status == 503 && body["error"]["code"] == json!("no_leader") {
            assert_eq!(retry.as_deref(), Some("1"));
            break;
        }
        // Until it notices the leader is gone it still redirects there.
        assert!(status == 307 || status == 503, "{status} {body}");
        assert!(Instant::now() < deadline, "never answered no_leader: {status} {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let v: Value =
        http.get(format!("{}/v1/cluster", c.url(survivor))).send().and_then(|r| r.json()).expect("view");
    assert_eq!(v["leader_id"], Value::Null, "{v}");
}

#[test]
fn a_reservation_and_its_receipt_survive_the_leaders_death() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    for k in 0..2 {
        let r = client.produce("ttr", &json!({"body": format!("m{k}")})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    // Reserve both for 4 s on the first leader.
    let r = client.pop("ttr", 2, 2_000, Some(4_000)).expect("pop");
    // The reservation began after the pop was sent and before its answer came: its time-to-run
    // ends no earlier than 4 s after the sending (the answer's arrival would be too late a bound
    // by however long the answer took).
    let popped_at = r.sent_ms;
    let msgs = r.messages();
    assert_eq!(msgs.len(), 2, "{:?}", r.body);
    let first_leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(first_leader);
    c.wait_leader(Duration::from_secs(15));
    // The receipt the old leader handed out acks on the new one.
    let acked = client.ack(msgs[0]["receipt"].as_str().expect("receipt")).expect("ack");
    assert!(acked.ok(), "ack after failover: {} {:?}", acked.status, acked.body);
    // The other comes back after its time-to-run, not before, and the acked one never does.
    let mut back = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while back.is_empty() && Instant::now() < until {
        let r = client.pop("ttr", 2, 1_000, None).expect("pop");
        let at = now_ms();
        for m in r.messages() {
            back.push((m["id"].as_str().unwrap_or_default().to_string(), at));
        }
    }
    assert_eq!(back.len(), 1, "{back:?}");
    assert_eq!(back[0].0, msgs[1]["id"].as_str().expect("id"));
    assert!(
        back[0].1 >= popped_at + 4_000,
        "came back {} ms before its TTR ran out",
        popped_at + 4_000 - back[0].1
    );
}

/// A reschedule is one replicated record: after the leader that answered it dies, the new
/// leader delivers the message at its new time, never before, and not at its old one.
#[test]
fn a_rescheduled_message_survives_the_leaders_death() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    let r =
        client.produce("moved", &json!({"id": "m", "body": "m", "delay_ms": 3_600_000})).expect("produce");
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = client.request("PATCH", "/v1/messages/m", Some(&json!({"delay_ms": 5_000})), 0).expect("patch");
    assert_eq!(r.status, 200, "{:?}", r.body);
    let due = r.body["deliver_at_ms"].as_u64().expect("deliver_at_ms");
    let first_leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(first_leader);
    c.wait_leader(Duration::from_secs(15));
    let m = client.get("m").expect("get");
    assert_eq!((m.body["state"].as_str(), m.body["deliver_at_ms"].as_u64()), (Some("delayed"), Some(due)));
    let mut back = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while back.is_empty() && Instant::now() < until {
        let r = client.pop("moved", 2, 1_000, None).expect("pop");
        let at = now_ms();
        back.extend(r.messages().into_iter().map(|m| (m["id"].clone(), at)));
    }
    assert_eq!(back.len(), 1, "delivered at its new time, not its old one: {back:?}");
    assert!(back[0].1 >= due, "came {} ms before its new time", due - back[0].1);
}

/// A touch is one replicated record: after the leader that answered it dies, the reservation
/// still ends at its new time on the new leader, and the receipt still acks it.
#[test]
fn a_touched_reservation_survives_the_leaders_death() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    for id in ["t1", "t2"] {
        let r = client.produce("touch", &json!({"id": id, "body": id})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    let msgs = client.pop("touch", 2, 2_000, Some(2_000)).expect("pop").messages();
    assert_eq!(msgs.len(), 2);
    let mut expires = 0;
    for m in &msgs {
        let r = client
            .request("POST", "/v1/touch", Some(&json!({"receipt": m["receipt"], "ttr_ms": 8_000})), 0)
            .expect("touch");
        assert_eq!(r.status, 200, "{:?}", r.body);
        expires = r.body["expires_at_ms"].as_u64().expect("expires_at_ms");
    }
    let first_leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(first_leader);
    c.wait_leader(Duration::from_secs(15));
    let acked = client.ack(msgs[0]["receipt"].as_str().expect("receipt")).expect("ack");
    assert!(acked.ok(), "the touched receipt acks on the new leader: {} {:?}", acked.status, acked.body);
    let mut back = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while back.is_empty() && Instant::now() < until {
        let r = client.pop("touch", 2, 1_000, None).expect("pop");
        let at = now_ms();
        back.extend(r.messages().into_iter().map(|m| (m["id"].clone(), at)));
    }
    assert_eq!(back.len(), 1, "{back:?}");
    assert_eq!(back[0].0, msgs[1]["id"]);
    assert!(back[0].1 >= expires, "came back {} ms before its touched end", expires - back[0].1);
}

/// A nack's reason rides in the nack's own replicated record: after the leader that took it
/// dies, the new leader shows the same last error.
#[test]
fn a_nack_reason_survives_the_leaders_death() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    let r = client.produce("why", &json!({"id": "w", "body": "w"})).expect("produce");
    assert_eq!(r.status, 201, "{:?}", r.body);
    let msgs = client.pop("why", 1, 2_000, None).expect("pop").messages();
    assert_eq!(msgs.len(), 1);
    let nack = json!({"receipt": msgs[0]["receipt"], "delay_ms": 3_600_000, "error": "TimeoutError: db"});
    let r = client.request("POST", "/v1/nack", Some(&nack), 0).expect("nack");
    assert_eq!(r.status, 200, "{:?}", r.body);
    let before = client.get("w").expect("get").body["last_error"].clone();
    assert_eq!((before["message"].as_str(), before["attempt"].as_u64()), (Some("TimeoutError: db"), Some(1)));
    let first_leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(first_leader);
    c.wait_leader(Duration::from_secs(15));
    let after = client.get("w").expect("get").body;
    assert_eq!(after["last_error"], before, "the new leader shows the same last error: {after}");
}

#[test]
fn flow_control_survives_the_leaders_death_and_holds_on_the_new_leader() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    let set = json!({"max_per_second": 100, "max_reserved": 2});
    let r = client.request("PUT", "/v1/topics/capped/flow", Some(&set), 0).expect("put flow");
    assert_eq!(r.status, 200, "{:?}", r.body);
    let before = r.body.clone();
    for i in 0..5 {
        let r = client.produce("capped", &json!({"id": format!("c-{i}"), "body": "c"})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    // The Flow record reached the followers with the log, and the one elected applies it.
    let first_leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(first_leader);
    c.wait_leader(Duration::from_secs(15));
    let after = client.request("GET", "/v1/topics/capped/flow", None, 0).expect("get flow");
    assert_eq!((after.status, &after.body), (200, &before), "the new leader has the same flow control");
    let msgs = client.pop("capped", 5, 0, None).expect("pop").messages();
    assert_eq!(msgs.len(), 2, "max_reserved holds on the new leader");
}

/// How many commit-log flushes node `i` has made (its flush-duration histogram's count).
fn flushes(c: &Cluster, i: usize) -> u64 {
    let text = short_client(Duration::from_secs(2))
        .get(format!("{}/metrics", c.url(i)))
        .send()
        .and_then(|r| r.text())
        .expect("metrics");
    text.lines()
        .find_map(|l| l.strip_prefix("delayd_flush_duration_seconds_count "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no flush count in node {i}'s metrics"))
}

#[test]
fn async_answers_once_a_majority_has_a_write_and_flushes_only_periodically() {
    let mut c = Cluster::start(3, &[("DELAYD_FLUSH", "async"), ("DELAYD_FLUSH_INTERVAL_MS", "2s")]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    let before: Vec<u64> = (1..=3).map(|i| flushes(&c, i)).collect();
    let started = Instant::now();
    for k in 0..200 {
        let r = client.produce("a", &json!({"body": "b", "id": format!("a{k}")})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    let periods = started.elapsed().as_secs() / 2 + 1;
    let made: Vec<u64> = (1..=3).map(|i| flushes(&c, i) - before[i - 1]).collect();
    // In `sync` each of these writes would be flushed on every node: 200 flushes at least.
    assert!(
        made.iter().all(|n| *n <= periods + 2),
        "flushes per node {made:?} for 200 writes in about {periods} flush periods"
    );
    // Answered only once a majority had each write: the leader's death, its periodic flush not
    // yet run, loses none (a killed process leaves its writes in the page cache; what `async`
    // risks is a power cut).
    c.kill9(leader);
    c.wait_leader(Duration::from_secs(15));
    let mut got = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < 200 && Instant::now() < deadline {
        for m in client.pop("a", 100, 500, None).expect("pop").messages() {
            got.insert(m["id"].as_str().expect("id").to_string());
        }
    }
    assert_eq!(got.len(), 200, "every acknowledged write survives the leader's death");
}

/// Segment files in node `i`'s commit log.
fn segments(c: &Cluster, i: usize) -> usize {
    std::fs::read_dir(c.node(i).data_dir().join("commitlog")).map_or(0, |d| d.count())
}

#[test]
fn reclaim_deletes_old_segments_on_every_node() {
    let c = Cluster::start(3, &[("DELAYD_DONE_RETENTION", "1s")]);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    // About 6 MiB of messages through 1 MiB segments, each consumed at once.
    let body = "x".repeat(16 << 10);
    for round in 0..64 {
        let msgs: Vec<Value> = (0..6).map(|k| json!({"body": body, "id": format!("r{round}-{k}")})).collect();
        let r = client
            .request("POST", "/v1/topics/big/messages/batch", Some(&json!({"messages": msgs})), 0)
            .expect("batch");
        assert_eq!(r.status, 201, "{:?}", r.body);
        let mut left = 6;
        while left > 0 {
            let r = client.pop("big", 6, 1_000, None).expect("pop");
            for m in r.messages() {
                let a = client.ack(m["receipt"].as_str().expect("receipt")).expect("ack");
                assert!(a.ok(), "{:?}", a.body);
                left -= 1;
            }
        }
    }
    let peak: Vec<usize> = (1..=3).map(|i| segments(&c, i)).collect();
    assert!(peak.iter().all(|n| *n >= 5), "the log should have grown past several segments: {peak:?}");
    // Done messages expire after 1 s; checkpoints every 5 s let reclaim delete what they free.
    // A trickle of traffic goes on: an idle log takes no checkpoint to wait for.
    trickle_until(
        &c,
        "segments not reclaimed on every node",
        &peak,
        |i| segments(&c, i),
        |now| now.iter().all(|n| *n <= 2),
    );
}

/// Keeps a trickle of traffic going (an idle log takes no checkpoint, and reclaim waits for
/// checkpoints) until `done` holds of every node's `count`; fails with `what` after 40 s.
fn trickle_until(
    c: &Cluster,
    what: &str,
    peak: &[usize],
    count: impl Fn(usize) -> usize,
    done: impl Fn(&[usize]) -> bool,
) {
    let client = c.client();
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut tick = 0;
    loop {
        tick += 1;
        let r = client.produce("trickle", &json!({"body": "t", "id": format!("t{tick}")})).expect("produce");
        assert_eq!(r.status, 201);
        for m in client.pop("trickle", 8, 0, None).expect("pop").messages() {
            client.ack(m["receipt"].as_str().expect("receipt")).expect("ack");
        }
        let now: Vec<usize> = (1..=c.size()).map(&count).collect();
        if done(&now) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {peak:?} -> {now:?}\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until node `behind` has applied every entry node `leader` holds.
fn wait_caught_up(c: &Cluster, leader: usize, behind: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let views = c.views();
        let led = views[leader - 1].as_ref().and_then(|v| v["last_index"].as_u64()).unwrap_or(0);
        let got = views[behind - 1].as_ref().and_then(|v| v["applied_index"].as_u64()).unwrap_or(0);
        if got >= led && led > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "node {behind} stuck at {got} of {led}:\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Consume-queue files of node `i`: every level queue's, and topic `topic`'s.
fn queue_files(c: &Cluster, i: usize, topic: &str) -> usize {
    let cq = c.node(i).data_dir().join("cq");
    let count = |d: std::path::PathBuf| std::fs::read_dir(d).map_or(0, |d| d.count());
    let levels: usize = std::fs::read_dir(cq.join("level"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| count(e.path())).sum())
        .unwrap_or(0);
    levels + count(cq.join("topic").join(format!("t-{topic}")))
}

#[test]
fn followers_delete_consume_queue_files_as_the_leader_does() {
    // 20 entries per file: 600 delayed messages pass through several files of a level queue and
    // of their topic's queue on every node.
    let c = Cluster::start(3, &[("DELAYD_CQ_ENTRIES_PER_FILE", "20")]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    for round in 0..20 {
        let msgs: Vec<Value> =
            (0..30).map(|k| json!({"body": "b", "id": format!("d{round}-{k}"), "delay_ms": 1_000})).collect();
        let r = client
            .request("POST", "/v1/topics/q/messages/batch", Some(&json!({"messages": msgs})), 0)
            .expect("batch");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    let mut acked = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.len() < 600 {
        assert!(Instant::now() < deadline, "{} messages never came due", 600 - acked.len());
        // Each reservation is a timer on a level queue that its reader passes only when it is
        // due, acked or not: with the default 30 s time-to-run the files could go only after that,
        // which left the followers (a checkpoint behind the leader) too little of the time below.
        for m in client.pop("q", 100, 1_000, Some(5_000)).expect("pop").messages() {
            let a = client.ack(m["receipt"].as_str().expect("receipt")).expect("ack");
            // A redelivery after a slow ack under load is acked again (404: the first counted).
            assert!(a.ok() || a.status == 404, "{:?}", a.body);
            acked.insert(m["id"].as_str().expect("id").to_string());
        }
    }
    let peak: Vec<usize> = (1..=3).map(|i| queue_files(&c, i, "q")).collect();
    assert!(peak.iter().all(|n| *n >= 10), "the queues should span several files on every node: {peak:?}");
    // The leader deletes files behind its readers at its checkpoints (every 5 s, while the log
    // moves: a trickle of traffic goes on); the followers, whose readers never move, follow it.
    // What is left on the leader: each level's file taking the next append (and its successor
    // made ahead), and the topic's last file unless it was forgotten; a follower may be a
    // checkpoint behind.
    let what = format!("queue files not deleted on every node (leader {leader})");
    trickle_until(
        &c,
        &what,
        &peak,
        |i| queue_files(&c, i, "q"),
        |now| {
            let kept = now[leader - 1];
            kept * 2 < peak[leader - 1] && now.iter().all(|n| *n <= kept + 2)
        },
    );
}

#[test]
fn a_cluster_nodes_data_directory_is_refused_as_a_single_node() {
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    c.terminate(1);
    let data = c.node(1).data_dir();
    let tmp = tempfile::tempdir().expect("tmp");
    let (status, log) = common::run_binary(
        &["--listen", "127.0.0.1:0", "--data-dir", data.to_str().expect("utf-8 path")],
        &[],
        tmp.path(),
    );
    assert!(!status.success(), "{log}");
    assert!(log.contains("belongs to a cluster node"), "{log}");
}

#[test]
fn a_node_with_another_segment_size_stops_instead_of_misplacing_records() {
    // Node 3's segments are twice as large: once the others roll a segment, the leader's records
    // would land at other offsets there (records refer to each other by offset).
    let per_node = |i: usize| {
        if i == 3 {
            vec![("DELAYD_SEGMENT_BYTES".to_string(), "2MiB".to_string())]
        } else {
            Vec::new()
        }
    };
    let c = Cluster::start_with(3, &[], per_node);
    let mut leader = c.wait_leader(Duration::from_secs(15));
    if leader == 3 {
        // Let node 3 lose the lead: the others agree with each other.
        let mut c = c;
        c.kill9(3);
        leader = c.wait_leader(Duration::from_secs(15));
        c.restart(3);
        return check_segment_refusal(c, leader);
    }
    check_segment_refusal(c, leader);
}

fn check_segment_refusal(c: Cluster, leader: usize) {
    let client = c.client();
    let body = "y".repeat(32 << 10);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut k = 0;
    while alive(c.pid(3)) {
        assert!(Instant::now() < deadline, "node 3 kept running:\n{}", c.describe());
        let msgs: Vec<Value> = (0..3).map(|j| json!({"body": body, "id": format!("s{k}-{j}")})).collect();
        let r = client.request("POST", "/v1/topics/seg/messages/batch", Some(&json!({"messages": msgs})), 0);
        assert!(r.is_ok_and(|r| r.status == 201), "leader {leader} refused a write");
        k += 1;
    }
    let log = c.node(3).log();
    assert!(log.contains("every node must have the same segment_bytes"), "{log}");
}

/// Whether process `pid` still runs (an exited child stays a zombie until waited for).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

#[test]
fn a_long_poll_on_a_leader_that_loses_its_majority_ends_at_once() {
    let c = Cluster::start(3, &[("DELAYD_MAX_WAIT", "30s")]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let url = format!("{}/v1/topics/nothing/pop?max=1&wait_ms=30000", c.url(leader));
    let waiting = std::thread::spawn(move || {
        let started = Instant::now();
        let r = short_client(Duration::from_secs(40)).post(url).send().expect("long poll");
        (r.status().as_u16(), started.elapsed())
    });
    std::thread::sleep(Duration::from_millis(500));
    c.isolate(leader);
    let (status, took) = waiting.join().expect("poll thread");
    // The leader steps down once it misses its majority's heartbeats (an election timeout),
    // and the poll ends then, not after its 30 s.
    assert_eq!(status, 503, "answered {status} after {took:?}");
    assert!(took < Duration::from_secs(10), "the poll waited {took:?}");
}

#[test]
fn compat_requests_to_a_follower_are_answered_as_the_leader_answers() {
    let c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let f = follower_of(&c, leader);
    let other = (1..=3).find(|i| *i != leader && *i != f).expect("third node");
    let http = short_client(Duration::from_secs(10));
    let call = |node: usize, path: &str, body: &str| -> (u16, Value) {
        let r = http
            .post(format!("{}{path}", c.url(node)))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .expect("compat call");
        (r.status().as_u16(), r.json().unwrap_or(Value::Null))
    };
    // An ouqiang client does not follow redirects: the follower answers for the leader.
    let (status, v) = call(f, "/push", r#"{"topic":"order","id":"c-1","delay":0,"ttr":30,"body":"hi"}"#);
    assert_eq!((status, v.clone()), (200, json!({"code": 0, "message": "ok", "data": null})), "{v}");
    let (status, v) = call(other, "/get", r#"{"id":"c-1"}"#);
    assert_eq!(status, 200);
    assert_eq!(v["data"]["body"], json!("hi"), "{v}");
    let (status, v) = call(f, "/pop", r#"{"topic":"order"}"#);
    assert_eq!(status, 200);
    assert_eq!(v["data"]["id"], json!("c-1"), "{v}");
}

#[test]
fn a_follower_down_during_writes_catches_up_and_then_serves_them_as_leader() {
    let mut c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let behind = follower_of(&c, leader);
    c.kill9(behind);
    let client = c.client();
    let mut ids = Vec::new();
    for k in 0..200 {
        let r = client
            .produce("catchup", &json!({"body": format!("m{k}"), "id": format!("m{k}")}))
            .expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
        ids.push(format!("m{k}"));
    }
    c.restart(behind);
    // It catches up from the leader's log.
    wait_caught_up(&c, leader, behind, Duration::from_secs(20));
    // Now the other two die one after the other: the caught-up node and one more must hold all.
    c.kill9(leader);
    let next = c.wait_leader(Duration::from_secs(15));
    assert!(next != leader);
    let mut seen = std::collections::HashSet::new();
    let until = Instant::now() + Duration::from_secs(20);
    while seen.len() < ids.len() && Instant::now() < until {
        for m in client.pop("catchup", 100, 500, None).expect("pop").messages() {
            seen.insert(m["id"].as_str().unwrap_or_default().to_string());
            client.ack(m["receipt"].as_str().unwrap_or_default()).expect("ack");
        }
    }
    assert_eq!(seen.len(), ids.len(), "missing after failover:\n{}", c.describe());
}

#[test]
fn a_follower_behind_the_leaders_window_catches_up_from_a_snapshot() {
    // A window of 40 entries: a node that misses more is sent a snapshot (the leader's segment
    // files up to a committed entry, copied over the cluster link).
    let mut c = Cluster::start(3, &[("DELAYD_TEST_RAFT_WINDOW_ENTRIES", "40")]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let behind = follower_of(&c, leader);
    c.kill9(behind);
    let client = c.client();
    let body = "z".repeat(8 << 10);
    for k in 0..300 {
        let r = client.produce("snap", &json!({"body": body, "id": format!("s{k}")})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    c.restart(behind);
    wait_caught_up(&c, leader, behind, Duration::from_secs(30));
    assert!(c.node(behind).log().contains("snapshot installed"), "no snapshot:\n{}", c.describe());
    // The node that caught up by snapshot and one other hold every message.
    c.kill9(leader);
    c.wait_leader(Duration::from_secs(15));
    let mut seen = std::collections::HashSet::new();
    let until = Instant::now() + Duration::from_secs(30);
    while seen.len() < 300 && Instant::now() < until {
        for m in client.pop("snap", 100, 500, None).expect("pop").messages() {
            seen.insert(m["id"].as_str().unwrap_or_default().to_string());
            client.ack(m["receipt"].as_str().unwrap_or_default()).expect("ack");
        }
    }
    assert_eq!(seen.len(), 300, "missing after failover:\n{}", c.describe());
}

#[test]
fn a_node_is_added_under_load_and_the_old_leader_removed() {
    let joins = |i: usize| {
        if i == 4 {
            vec![("DELAYD_CLUSTER_JOIN".to_string(), "true".to_string())]
        } else {
            Vec::new()
        }
    };
    let mut c = Cluster::start_with(3, &[], joins);
    let old_leader = c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    let produce = |c: &Cluster, from: usize, to: usize| {
        for k in from..to {
            let r = client
                .produce("members", &json!({"body": format!("m{k}"), "id": format!("m{k}")}))
                .unwrap_or_else(|e| panic!("produce m{k}: {e}\n{}", c.describe()));
            assert_eq!(r.status, 201, "{:?}", r.body);
        }
    };
    produce(&c, 0, 100);
    let four = c.add_node();
    let add = client
        .request(
            "POST",
            "/v1/cluster/nodes",
            Some(&json!({"node_id": four, "cluster_addr": c.cluster_addr(four).to_string()})),
            0,
        )
        .expect("add");
    assert_eq!(add.status, 200, "{:?}", add.body);
    produce(&c, 100, 150);
    // The new node catches up (by snapshot: the first members are in none of the log's entries)
    // and is made a voter.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = c.node(old_leader).log();
        if log.contains("learner caught up: making it a voter") && log.contains("change=Promote { id: 4 }") {
            break;
        }
        assert!(Instant::now() < deadline, "node {four} never became a voter:\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(200));
    }
    // Removing the leader hands its lead over first; the client retries on the new leader.
    let pid = c.pid(old_leader);
    let removed =
        client.request("DELETE", &format!("/v1/cluster/nodes/{old_leader}"), None, 0).expect("remove");
    assert_eq!(removed.status, 200, "{:?}", removed.body);
    let deadline = Instant::now() + Duration::from_secs(15);
    while alive(pid) {
        assert!(Instant::now() < deadline, "the removed node keeps running:\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(100));
    }
    c.kill9(old_leader);
    produce(&c, 150, 200);
    let mut seen = std::collections::HashSet::new();
    let until = Instant::now() + Duration::from_secs(30);
    while seen.len() < 200 && Instant::now() < until {
        for m in client.pop("members", 100, 500, None).expect("pop").messages() {
            seen.insert(m["id"].as_str().unwrap_or_default().to_string());
            client.ack(m["receipt"].as_str().unwrap_or_default()).expect("ack");
        }
    }
    assert_eq!(seen.len(), 200, "missing:\n{}", c.describe());
    let v = c.views();
    let members = v.iter().flatten().next().map(|v| v["nodes"].as_array().map_or(0, Vec::len));
    assert_eq!(members, Some(3), "{v:?}");
}

#[test]
fn writes_under_load_do_not_stall_after_a_failover() {
    // A new leader appends the old leader's last entries with no reply owed; waiting for their
    // majority would hold back the entry of its own term that commits them (it did: 10 s).
    let mut c = Cluster::start(3, &[]);
    c.wait_leader(Duration::from_secs(15));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slowest = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Instant, Duration)>::new()));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (client, stop, slowest) = (c.client(), stop.clone(), slowest.clone());
            std::thread::spawn(move || {
                let mut k = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let started = Instant::now();
                    let r = client.produce("stall", &json!({"body": "x", "id": format!("w{w}-{k}")}));
                    if r.is_ok_and(|r| r.ok()) {
                        slowest.lock().expect("lock").push((started, started.elapsed()));
                    }
                    k += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let leader = c.wait_leader(Duration::from_secs(5));
    c.kill9(leader);
    c.wait_leader(Duration::from_secs(15));
    let elected = Instant::now();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writers.into_iter().for_each(|w| w.join().expect("writer"));
    let after: Vec<Duration> = slowest
        .lock()
        .expect("lock")
        .iter()
        .filter(|(at, _)| *at >= elected)
        .map(|(_, took)| *took)
        .collect();
    assert!(!after.is_empty(), "no write succeeded after the failover:\n{}", c.describe());
    let worst = after.iter().max().copied().unwrap_or_default();
    assert!(worst < Duration::from_secs(3), "a write sent after the new leader took over waited {worst:?}");
}
