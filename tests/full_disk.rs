//! Black-box test on a small real filesystem: a 64 MiB tmpfs fills up under load while messages
//! fall due. delayd must answer 503, idle (CPU from /proc/<pid>/stat), keep serving reads, restart
//! cleanly on the full disk, and deliver every acknowledged message once space is freed.
//!
//! Needs root to mount the tmpfs: the tests are ignored by a plain `cargo test`; `.ci/run` runs
//! them as root with `--ignored`.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::tmpfs::{free_bytes, Tmpfs};
use common::{client, Server};
use serde_json::json;

/// utime + stime of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
#[ignore = "needs root to mount a tmpfs; .ci/run runs this as root"]
fn a_full_disk_refuses_writes_idles_restarts_and_delivers_every_acknowledged_message() {
    let fs = Tmpfs::mount("64m").expect("mount a tmpfs");
    let data = fs.0.join("data");
    let mut s = Server::start_at(&data, &[("DELAYD_LEVELS", "1s 5s")]);
    // Leave ~10 MiB for delayd: the disk fills within a few hundred 16 KiB messages.
    let filler = fs.0.join("filler");
    let fill = free_bytes(&fs.0).saturating_sub(10 << 20);
    std::fs::write(&filler, vec![1u8; fill as usize]).expect("write the filler");

    // Load: four writers, every message due 1-3 s later, until the disk is full for a while.
    let body = "x".repeat(16 << 10);
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let refusals = Arc::new(Mutex::new(Vec::<serde_json::Value>::new()));
    let base = s.base.clone();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (acked, refusals, base, body) = (acked.clone(), refusals.clone(), base.clone(), body.clone());
            std::thread::spawn(move || {
                let http = client();
                for i in 0..2000 {
                    let id = format!("w{w}-{i}");
                    let r = http
                        .post(format!("{base}/v1/topics/full/messages"))
                        .json(&json!({"id": id, "body": body, "delay_ms": 1000 + (i % 20) * 100}))
                        .send();
                    let (st, v) = common::answer(r);
                    match st {
                        201 => acked.lock().unwrap().push(id),
                        503 => {
                            let mut r = refusals.lock().unwrap();
                            r.push(v);
                            if r.len() >= 40 {
                                return;
                            }
                        }
                        _ => panic!("produce answered {st} {v}"),
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    let acked: Vec<String> = acked.lock().unwrap().clone();
    let refusals = refusals.lock().unwrap().clone();
    let mount = fs.0.to_str().expect("a UTF-8 temp path");
    assert!(refusals.len() >= 40, "the disk never filled: {} acknowledged", acked.len());
    assert!(acked.len() > 50, "too few messages stored before the disk filled: {}", acked.len());
    for v in &refusals {
        assert_eq!(v["error"]["code"], "unavailable", "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("No space left on device"), "the refusal must say why: {v}");
        // The file it failed on goes to the log, not to the client.
        assert!(!msg.contains(mount) && !msg.contains("commitlog/"), "the refusal names a file: {v}");
    }

    // Messages fall due on the full disk: the server must idle, not spin.
    std::thread::sleep(Duration::from_secs(4));
    let pid = s.pid();
    let (cpu0, log0) = (cpu_ticks(pid), s.log().len());
    std::thread::sleep(Duration::from_secs(3));
    let (cpu1, log1) = (cpu_ticks(pid), s.log().len());
    println!("full disk, 3 s: {} CPU ticks, {} bytes logged", cpu1 - cpu0, log1 - log0);
    assert!(cpu1 - cpu0 <= 60, "the server used {} CPU ticks in 3 s on a full disk", cpu1 - cpu0);
    assert!(log1 - log0 <= 16 << 10, "the server logged {} bytes in 3 s on a full disk", log1 - log0);
    assert_eq!(s.get("/healthz").0, 200);
    let (st, v) = s.get(&format!("/v1/messages/{}", acked[0]));
    assert_eq!(st, 200, "reads keep working on a full disk: {v}");
    // Writes fail for want of space (new messages, and timers that cannot move due messages):
    // the gauge an operator alerts on says so. Read until it does, for a few seconds: a small
    // record (a timer's move) may still fit in what the log has left, and each write that goes
    // through makes the store writable again until the next one fails (a CI run read 1 once).
    // So each reading follows a produce, which the full disk must refuse: the due messages may
    // all have moved by now (another CI run read 1 for the whole 5 s, nothing else writing).
    let http = client();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut readings = 0;
    let shows_zero = loop {
        let r = http.post(format!("{}/v1/topics/full/messages", s.base)).json(&json!({"body": body})).send();
        let (st, v) = common::answer(r);
        assert_eq!(st, 503, "a produce on the full disk must be refused: {v}");
        let (st, text) = s.get_text("/metrics");
        assert_eq!(st, 200);
        readings += 1;
        let zero = text.lines().any(|l| l == "delayd_store_writable 0");
        if zero || Instant::now() > deadline {
            break zero;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(shows_zero, "store_writable never read 0 on a full disk in {readings} readings");

    // A clean stop and a start, both on the full disk.
    let status = s.terminate();
    assert!(status.success(), "shutdown on a full disk must be clean; log:\n{}", s.log());
    assert!(data.join("clean_shutdown").exists(), "no clean-shutdown marker on the full disk");
    s.respawn();
    let (st, v) = s.get(&format!("/v1/messages/{}", acked[acked.len() - 1]));
    assert_eq!(st, 200, "reads after a restart on a full disk: {v}");

    // Space is freed: every acknowledged message is delivered.
    std::fs::remove_file(&filler).expect("remove the filler");
    let mut missing: HashSet<String> = acked.iter().cloned().collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !missing.is_empty() {
        assert!(
            Instant::now() < deadline,
            "acknowledged but not delivered: {} e.g. {:?}; log:\n{}",
            missing.len(),
            missing.iter().next(),
            s.log()
        );
        let (st, v) = s.post_raw("/v1/topics/full/pop?max=100&wait_ms=1000", None, Vec::new());
        assert_eq!(st, 200, "pop after space was freed: {v}");
        for m in v["messages"].as_array().unwrap() {
            let id = m["id"].as_str().unwrap().to_string();
            assert_eq!(m["body"].as_str().unwrap().len(), body.len(), "{id} body damaged");
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
            missing.remove(&id);
        }
    }
    let (st, v) = s.post("/v1/topics/full/messages", &json!({"body": "after"}));
    assert_eq!(st, 201, "writable again once space is back: {v}");
    s.terminate();
}

/// Eight clients writing to a full disk: one ERROR line for the failure, not one per refusal.
#[test]
#[ignore = "needs root to mount a tmpfs; .ci/run runs this as root"]
fn a_full_disk_logs_each_distinct_failure_once_not_once_per_request() {
    let fs = Tmpfs::mount("16m").expect("mount a tmpfs");
    let data = fs.0.join("data");
    let s = Server::start_at(&data, &[]);
    let filler = fs.0.join("filler");
    let fill = free_bytes(&fs.0).saturating_sub(1 << 20);
    std::fs::write(&filler, vec![1u8; fill as usize]).expect("write the filler");
    let body = "x".repeat(32 << 10);
    let refused = Arc::new(Mutex::new(0usize));
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let (refused, base, body) = (refused.clone(), s.base.clone(), body.clone());
            std::thread::spawn(move || {
                let http = client();
                for i in 0..150 {
                    let r = http
                        .post(format!("{base}/v1/topics/full/messages"))
                        .json(&json!({"id": format!("w{w}-{i}"), "body": body, "delay_ms": 3_600_000}))
                        .send();
                    let (st, v) = common::answer(r);
                    match st {
                        201 => {}
                        503 => *refused.lock().unwrap() += 1,
                        _ => panic!("produce answered {st} {v}"),
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    let refused = *refused.lock().unwrap();
    assert!(refused >= 500, "the disk never filled: {refused} refusals");
    let log = s.log();
    let errors = log.lines().filter(|l| l.contains("ERROR")).count();
    println!("{refused} refused requests, {errors} ERROR lines");
    assert!(errors <= 10, "{errors} ERROR lines for {refused} refusals:\n{log}");
    assert!(errors >= 1, "the failure must be logged once:\n{log}");
}
