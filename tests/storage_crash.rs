//! Durability of the store under SIGKILL and under a simulated power loss.
//!
//! The writer runs in a child process (this test binary re-run with one ignored test selected), so a
//! real SIGKILL hits it mid-stream.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, FlushMode, MessageState, ProduceRequest, When};

fn config(dir: &Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 256 << 10;
    c.cq_entries_per_file = 1024;
    c.index_initial_slots = 1024;
    c.flush = FlushMode::Sync;
    c
}

fn body_of(id: &str) -> Bytes {
    // Bodies differ in content and length so a torn or misplaced record cannot pass for another.
    Bytes::from(format!("{id}:{}", "x".repeat(id.len() * 37 % 700)))
}

/// The child: many concurrent producers in sync mode, printing each id once its produce returned.
#[test]
#[ignore = "run as a child process by sigkill_loses_no_acknowledged_append"]
fn crash_child_writer() {
    let Ok(dir) = std::env::var("DELAYD_CRASH_DIR") else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let broker = Broker::open(config(Path::new(&dir))).unwrap();
        let mut tasks = vec![];
        for w in 0..16 {
            let b = broker.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0.. {
                    let id = format!("w{w}-{i}");
                    let delay = if i % 3 == 0 { When::Now } else { When::DelayMs(3_600_000) };
                    let req = ProduceRequest {
                        id: Some(id.clone()),
                        body: body_of(&id),
                        when: delay,
                        ttr_ms: None,
                        max_attempts: None,
                        backoff_ms: None,
                    };
                    b.produce("crash", req).await.unwrap();
                    println!("\n@@ ok {id}");
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loses_no_acknowledged_append() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["crash_child_writer", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("DELAYD_CRASH_DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut acked = vec![];
    let started = Instant::now();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(id) = line.find("@@ ok ").map(|p| &line[p + 6..]) {
            acked.push(id.to_string());
        }
        // Kill mid-stream: after enough appends that segments have rolled, or after a time bound.
        if acked.len() >= 4000 || started.elapsed() > Duration::from_secs(20) {
            unsafe_kill(child.id());
            break;
        }
    }
    let _ = child.wait();
    assert!(acked.len() > 100, "the child wrote too little to test anything: {}", acked.len());

    let broker = Broker::open(config(dir.path())).unwrap();
    for id in &acked {
        let info = broker.get(id).await.unwrap_or_else(|e| panic!("acknowledged {id} lost: {e}"));
        assert_eq!(info.body, body_of(id), "{id} body damaged");
        assert_eq!(info.topic, "crash");
        assert!(matches!(info.state, MessageState::Ready | MessageState::Delayed));
    }
    // And the store keeps working after recovery.
    let p = broker
        .produce(
            "crash",
            ProduceRequest {
                id: Some("after".into()),
                body: Bytes::from_static(b"a"),
                when: When::Now,
                ttr_ms: None,
                max_attempts: None,
                backoff_ms: None,
            },
        )
        .await
        .unwrap();
    assert!(p.created);
    broker.shutdown().await.unwrap();
}

fn unsafe_kill(pid: u32) {
    let status = Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    assert!(status.success());
}

/// Power loss keeps only what was flushed: copy the data dir, cut the commit log at its flushed
/// end (zeroes after), keep the derived files as they were (possibly ahead of the log), reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_page_cache_after_the_last_flush_recovers_the_flushed_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.flush = FlushMode::Async;
    cfg.flush_interval_ms = 3_600_000;
    let broker = Broker::open(cfg.clone()).unwrap();
    let mk = |id: &str| ProduceRequest {
        id: Some(id.to_string()),
        body: body_of(id),
        when: When::Now,
        ttr_ms: None,
        max_attempts: None,
        backoff_ms: None,
    };
    for i in 0..200 {
        broker.produce("p", mk(&format!("durable-{i}"))).await.unwrap();
    }
    // Shutdown flushes; reopen async so later writes stay unflushed.
    broker.shutdown().await.unwrap();
    let seg = dir.path().join("commitlog").join(format!("{:020}", 0));
    let durable_len = {
        let bytes = std::fs::read(&seg).unwrap();
        bytes.iter().rposition(|b| *b != 0).unwrap() + 1
    };
    let broker = Broker::open(cfg.clone()).unwrap();
    for i in 0..200 {
        broker.produce("p", mk(&format!("volatile-{i}"))).await.unwrap();
    }
    // Let the checkpoint run so queues/index on disk know about records the log "loses".
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let image = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), image.path());
    drop(broker);
    let img_seg = image.path().join("commitlog").join(format!("{:020}", 0));
    let mut bytes = std::fs::read(&img_seg).unwrap();
    bytes[durable_len..].fill(0);
    std::fs::write(&img_seg, &bytes).unwrap();
    let _ = std::fs::remove_file(image.path().join("LOCK"));
    let _ = std::fs::remove_file(image.path().join("clean_shutdown"));

    let mut cfg2 = config(image.path());
    cfg2.flush = FlushMode::Sync;
    let b2 = Broker::open(cfg2).unwrap();
    for i in 0..200 {
        let id = format!("durable-{i}");
        assert_eq!(b2.get(&id).await.unwrap().body, body_of(&id));
        assert!(b2.get(&format!("volatile-{i}")).await.is_err(), "volatile-{i} survived a power loss");
    }
    let popped = b2
        .pop(delayd::broker::PopRequest { topics: vec!["p".into()], max: 1000, wait_ms: 0, ttr_ms: None })
        .await
        .unwrap();
    // Every durable message is poppable once and nothing from the lost tail shows up.
    assert_eq!(popped.len(), 200);
    assert!(popped.iter().all(|d| d.id.starts_with("durable-")));
    b2.shutdown().await.unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        let dest = to.join(e.file_name());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}
