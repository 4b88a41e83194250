//! SIGKILL and restart of a broker with messages due before, during and after the downtime, on the
//! real clock: none lost, none early, none cancelled delivered, the overdue ones in due order.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, PopRequest, ProduceRequest, When};

fn config(dir: &Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 1 << 20;
    c.cq_entries_per_file = 4096;
    c.index_initial_slots = 4096;
    c
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[test]
#[ignore = "run as a child process by restart_after_sigkill_delivers_everything_on_time"]
fn sched_child() {
    let Ok(dir) = std::env::var("DELAYD_SCHED_DIR") else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let broker = Broker::open(config(Path::new(&dir))).unwrap();
        for i in 0..150u64 {
            // Three groups: due before the kill, during the downtime, after the restart; the
            // odd millisecond counts exercise chained hops with sub-second remainders.
            let delay = match i % 3 {
                0 => 100 + i * 3,
                1 => 1_300 + i * 5,
                _ => 3_200 + i * 7,
            };
            let id = format!("m{i}");
            let req = ProduceRequest {
                id: Some(id.clone()),
                body: Bytes::from(id.clone()),
                when: When::DelayMs(delay),
                ttr_ms: Some(60_000),
                max_attempts: None,
                backoff_ms: None,
            };
            let p = broker.produce("s", req).await.unwrap();
            println!("\n@@ ok {id} {}", p.deliver_at_ms);
            if i % 7 == 0 {
                broker.cancel(&id).await.unwrap();
                println!("@@ cancel {id}");
            }
        }
        println!("@@ done");
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_sigkill_delivers_everything_on_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["sched_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("DELAYD_SCHED_DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut due: HashMap<String, u64> = HashMap::new();
    let mut cancelled = HashSet::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        // libtest prints "test name ... " before the test's own output on the same line.
        let Some(pos) = line.find("@@ ") else { continue };
        let parts: Vec<&str> = line[pos + 3..].split_whitespace().collect();
        match parts.as_slice() {
            ["ok", id, at] => {
                due.insert(id.to_string(), at.parse().unwrap());
            }
            ["cancel", id] => {
                cancelled.insert(id.to_string());
            }
            ["done"] => break,
            _ => {}
        }
    }
    assert_eq!(due.len(), 150);
    // Some messages fall due while the child still runs, then it dies without any shutdown.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let killed_at = now_ms();
    assert!(Command::new("kill").args(["-9", &child.id().to_string()]).status().unwrap().success());
    let _ = child.wait();
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let broker = Broker::open(config(dir.path())).unwrap();
    let restarted_at = now_ms();
    let mut delivered: Vec<(String, u64, u64)> = vec![];
    let deadline = Instant::now() + Duration::from_secs(20);
    let expected = due.len() - cancelled.len();
    while delivered.len() < expected && Instant::now() < deadline {
        let got = broker
            .pop(PopRequest { topics: vec!["s".into()], max: 100, wait_ms: 500, ttr_ms: None })
            .await
            .unwrap();
        let at = now_ms();
        for d in got {
            broker.ack(&d.receipt).await.unwrap();
            delivered.push((d.id, d.deliver_at_ms, at));
        }
    }
    let mut seen = HashSet::new();
    for (id, deliver_at, popped_at) in &delivered {
        assert!(!cancelled.contains(id), "cancelled {id} was delivered");
        assert!(seen.insert(id.clone()), "{id} delivered twice");
        assert_eq!(*deliver_at, due[id], "{id} reports another due time");
        assert!(*popped_at >= *deliver_at, "{id} popped at {popped_at}, before its due time {deliver_at}");
    }
    let missing: Vec<&String> =
        due.keys().filter(|id| !cancelled.contains(*id) && !seen.contains(*id)).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    // What fell due while the broker was down comes out in due order.
    let overdue: Vec<u64> = delivered
        .iter()
        .filter(|(_, d, _)| *d > killed_at && *d <= restarted_at)
        .map(|(_, d, _)| *d)
        .collect();
    assert!(overdue.len() > 5, "the test should have messages due during the downtime");
    assert!(overdue.windows(2).all(|w| w[0] <= w[1]), "overdue messages out of order: {overdue:?}");
    broker.shutdown().await.unwrap();
}
