//! The program as a process: SIGKILL under load, graceful SIGTERM, the data-dir lock, config errors.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{now_ms, run_binary, Server};
use serde_json::json;

/// What the load threads saw before the crash.
#[derive(Default)]
struct Seen {
    /// Ids whose produce got a 201, with their due time.
    produced: HashMap<String, u64>,
    /// Ids whose produce was sent (the outcome of one cut off by the kill is unknown).
    attempted: HashSet<String>,
    /// Ids delivered before the crash, with the time the first pop answer arrived.
    delivered: HashMap<String, u64>,
    /// Ids whose ack returned 200.
    acked: HashSet<String>,
    /// Ids popped and deliberately left unacked: (time the pop was sent, attempt).
    left_reserved: HashMap<String, (u64, u64)>,
    /// Ids whose ack was sent but cut off by the kill: it may or may not have been applied.
    ack_unknown: HashSet<String>,
}

/// A small deterministic generator, so a failure can be replayed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

const TTR_MS: u64 = 1500;

#[test]
fn sigkill_under_load_loses_nothing_acknowledged() {
    kill_under_load("sync");
}

/// In async mode the answer comes before the flush, but the bytes are already in the shared mapping, so
/// killing only the process (not the machine) must lose nothing either.
#[test]
fn sigkill_under_load_in_async_mode_loses_nothing_acknowledged() {
    kill_under_load("async");
}

fn kill_under_load(flush: &str) {
    let mut s = Server::start(&[("DELAYD_FLUSH", flush), ("DELAYD_FLUSH_INTERVAL_MS", "200")]);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let base = s.base.clone();

    let producer = {
        let (seen, stop, base) = (seen.clone(), stop.clone(), base.clone());
        std::thread::spawn(move || {
            let c = common::client();
            let mut rng = Lcg(0x5eed);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("m-{i}");
                i += 1;
                let delay = rng.next(1500);
                seen.lock().unwrap().attempted.insert(id.clone());
                let r = c
                    .post(format!("{base}/v1/topics/load/messages"))
                    .json(&json!({"id": id, "body": format!("body of {id}"), "delay_ms": delay}))
                    .send();
                let Ok(r) = r else { break };
                if r.status() != 201 {
                    break;
                }
                let v: serde_json::Value = r.json().expect("json");
                seen.lock().unwrap().produced.insert(id, v["deliver_at_ms"].as_u64().unwrap());
            }
        })
    };
    let consumer = {
        let (seen, stop, base) = (seen.clone(), stop.clone(), base.clone());
        std::thread::spawn(move || {
            let c = common::client();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let sent = now_ms();
                let r =
                    c.post(format!("{base}/v1/topics/load/pop?max=10&wait_ms=200&ttr_ms={TTR_MS}")).send();
                let Ok(r) = r else { break };
                let Ok(v) = r.json::<serde_json::Value>() else { break };
                let at = now_ms();
                for m in v["messages"].as_array().cloned().unwrap_or_default() {
                    let id = m["id"].as_str().unwrap().to_string();
                    let redelivered = {
                        let mut g = seen.lock().unwrap();
                        g.delivered.entry(id.clone()).or_insert(at);
                        match g.left_reserved.get(&id) {
                            Some((sent, attempt)) => {
                                let attempt_now = m["attempt"].as_u64().unwrap();
                                assert!(attempt_now > *attempt, "{id}: attempt did not grow: {m}");
                                assert!(at >= sent + TTR_MS, "{id} back before its ttr");
                                true
                            }
                            None => false,
                        }
                    };
                    n += 1;
                    if n.is_multiple_of(5) && !redelivered {
                        let attempt = m["attempt"].as_u64().unwrap();
                        seen.lock().unwrap().left_reserved.insert(id, (sent, attempt));
                        continue;
                    }
                    let ack = c.post(format!("{base}/v1/ack")).json(&json!({"receipt": m["receipt"]})).send();
                    match ack {
                        Ok(r) if r.status() == 200 => {
                            let mut g = seen.lock().unwrap();
                            g.left_reserved.remove(&id);
                            g.acked.insert(id);
                        }
                        // On a badly overloaded machine the reservation may expire before the ack:
                        // then the message is simply due again, which the checks allow.
                        Ok(r) if r.status() == 404 => {}
                        Ok(r) => panic!("ack of a fresh receipt answered {}", r.status()),
                        Err(_) => {
                            let mut g = seen.lock().unwrap();
                            g.left_reserved.remove(&id);
                            g.ack_unknown.insert(id);
                            return;
                        }
                    }
                }
            }
        })
    };

    std::thread::sleep(Duration::from_millis(2000));
    s.kill9();
    stop.store(true, Ordering::Relaxed);
    producer.join().expect("producer");
    consumer.join().expect("consumer");
    let seen = Arc::try_unwrap(seen).ok().unwrap().into_inner().unwrap();
    eprintln!(
        "{flush}: before the kill: {} produced, {} delivered, {} acked, {} left reserved",
        seen.produced.len(),
        seen.delivered.len(),
        seen.acked.len(),
        seen.left_reserved.len()
    );
    assert!(seen.produced.len() >= 20, "too little load to mean anything: {}", seen.produced.len());
    assert!(!seen.acked.is_empty() && !seen.left_reserved.is_empty());
    // Checked here rather than in the consumer: a pop may return a message before its produce answer arrives.
    for (id, at) in &seen.delivered {
        if let Some(due) = seen.produced.get(id) {
            assert!(at >= due, "{id} popped at {at} before the crash, due {due}");
        }
    }

    s.restart();
    let latest_due = seen.produced.values().copied().max().unwrap_or(0);
    let deadline =
        Instant::now() + Duration::from_millis(latest_due.saturating_sub(now_ms()) + TTR_MS + 20_000);
    let mut after: HashMap<String, u32> = HashMap::new();
    let must_see: HashSet<&String> = seen
        .produced
        .keys()
        .filter(|id| !seen.delivered.contains_key(*id))
        .chain(seen.left_reserved.keys())
        .collect();
    // A message whose ack the kill cut off is either done or comes back; both are right.
    let settled = |after: &HashMap<String, u32>| {
        must_see.iter().all(|id| after.contains_key(*id))
            && seen
                .ack_unknown
                .iter()
                .all(|id| after.contains_key(id) || s.get(&format!("/v1/messages/{id}")).1["state"] == "done")
    };
    while !settled(&after) {
        if Instant::now() >= deadline {
            // Say what the broker thinks of each: lost (404) and stuck (a state) are different bugs.
            let missing: Vec<String> = must_see
                .iter()
                .copied()
                .chain(&seen.ack_unknown)
                .filter(|id| !after.contains_key(*id))
                .take(5)
                .map(|id| {
                    let (status, info) = s.get(&format!("/v1/messages/{id}"));
                    let before = if seen.left_reserved.contains_key(id) {
                        "left reserved"
                    } else if seen.ack_unknown.contains(id) {
                        "ack cut off"
                    } else {
                        "not delivered"
                    };
                    format!("{id} ({before}; due {:?}; now {status} {info})", seen.produced.get(id))
                })
                .collect();
            let (_, stats) = s.get("/v1/stats");
            panic!("{flush}: never delivered after restart: {missing:#?}\nstats: {stats}");
        }
        let (msgs, at) = s.pop("load", 50, 1000, None);
        for m in msgs {
            let id = m["id"].as_str().unwrap().to_string();
            assert!(seen.attempted.contains(&id), "unknown id {id}");
            assert!(!seen.acked.contains(&id), "{id} was acked before the crash but delivered again");
            if let Some(due) = seen.produced.get(&id) {
                assert!(at >= *due, "{id} popped at {at} after restart, due {due}");
            }
            if let Some((sent, attempt)) = seen.left_reserved.get(&id) {
                assert!(at >= sent + TTR_MS, "{id} back {}ms after its pop, ttr {TTR_MS}", at - sent);
                assert!(m["attempt"].as_u64().unwrap() > *attempt, "{id}: attempt did not grow: {m}");
            }
            *after.entry(id).or_default() += 1;
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
        }
    }
    eprintln!("{flush}: after the restart: {} delivered", after.len());
    let dupes: Vec<_> = after.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dupes.is_empty(), "acked after restart yet delivered again: {dupes:?}");
    for m in s.pop("load", 50, 500, None).0 {
        let id = m["id"].as_str().unwrap().to_string();
        assert!(seen.attempted.contains(&id), "unknown id {id}");
        assert!(!seen.acked.contains(&id) && !after.contains_key(&id), "{id} delivered again after its ack");
    }
}

#[test]
fn sigterm_finishes_in_flight_requests_and_exits_zero() {
    let mut s = Server::start(&[]);
    for i in 0..5 {
        s.produce("g", &json!({"id": format!("g-{i}"), "body": "b", "delay_ms": 1500}));
    }
    // A long-poll in flight must not hold the shutdown for its whole wait.
    let url = s.url("/v1/topics/idle/pop?wait_ms=20000");
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        let r = common::answer(common::client().post(url).send());
        (r, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let status = s.terminate();
    assert_eq!(status.code(), Some(0), "log:\n{}", s.log());
    let ((st, v), took) = waiter.join().unwrap();
    assert_eq!((st, v), (200, json!({"messages": []})));
    assert!(took < Duration::from_secs(15), "the long-poll held the shutdown for {took:?}");

    s.restart();
    let mut got = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while got.len() < 5 {
        assert!(Instant::now() < deadline, "after a clean restart only {got:?} came back");
        let (msgs, at) = s.pop("g", 10, 2000, None);
        for m in msgs {
            assert!(at >= m["deliver_at_ms"].as_u64().unwrap());
            got.insert(m["id"].as_str().unwrap().to_string());
        }
    }
}

#[test]
fn a_second_server_on_the_same_data_dir_is_refused() {
    let s = Server::start(&[]);
    let dir = s.data_dir();
    let (status, log) = run_binary(
        &["--listen", "127.0.0.1:0", "--data-dir", dir.to_str().unwrap()],
        &[("DELAYD_SEGMENT_BYTES", "1MiB"), ("DELAYD_MAX_BODY_BYTES", "64KiB")],
        s.tmp(),
    );
    assert!(!status.success(), "second server started; log:\n{log}");
    assert!(log.contains("data directory") || log.contains("data dir"), "unclear message:\n{log}");
    assert_eq!(s.get("/healthz").0, 200, "the first server must keep running");
}

#[test]
fn bad_configuration_is_reported_and_exits_2() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("bad.toml");
    std::fs::write(&file, "listen = \"127.0.0.1:0\"\nmax_dealy = \"1d\"\n").unwrap();
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (vec!["--config", file.to_str().unwrap()], vec![], "max_dealy"),
        (vec!["--config", "/no/such/file.toml"], vec![], "/no/such/file.toml"),
        (vec![], vec![("DELAYD_FLUSH", "maybe")], "DELAYD_FLUSH"),
        (vec![], vec![("DELAYD_LEVELS", "5s 1s")], "levels"),
        (vec!["--listen", "nowhere"], vec![], "listen"),
    ];
    for (args, env, needle) in cases {
        let (status, log) = run_binary(&args, &env, tmp.path());
        assert_eq!(status.code(), Some(2), "{args:?} {env:?}: {log}");
        assert!(log.contains(needle), "{args:?} {env:?}: message should mention {needle}: {log}");
    }
}

#[test]
fn file_env_and_flags_layer_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(&file, "levels = \"1s 5s\"\nmax_batch = 2\nlisten = \"127.0.0.1:1\"\n").unwrap();
    let s = Server::start_with_args(
        &[("DELAYD_LEVELS", "1s 2s 3s"), ("DELAYD_MAX_DELAY", "1h"), ("DELAYD_BACKOFF", "1s 1m")],
        &["--config", file.to_str().unwrap()],
    );
    // --listen 127.0.0.1:0 (a flag) beat the file's port 1, or the server would not be up.
    let (_, stats) = s.get("/v1/stats");
    let levels: Vec<u64> =
        stats["levels"].as_array().unwrap().iter().map(|l| l["level_ms"].as_u64().unwrap()).collect();
    assert_eq!(levels, [1000, 2000, 3000], "the environment beats the file");
    let three: Vec<_> = (0..3).map(|i| json!({"body": i.to_string()})).collect();
    let (st, _) = s.post("/v1/topics/x/messages/batch", &json!({ "messages": three }));
    assert_eq!(st, 413, "max_batch from the file applies");
    let (st, v) = s.post("/v1/topics/x/messages", &json!({"body": "b", "delay_ms": 3_600_001}));
    assert_eq!(st, 400, "DELAYD_MAX_DELAY=1h applies: {v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_delay 1h"), "{v}");
    assert_eq!(s.post("/v1/topics/x/messages", &json!({"body": "b", "delay_ms": 3_600_000})).0, 201);
}

/// Makes every directory under `root` immutable (no file can be created in it), and undoes it on drop.
struct Immutable(std::path::PathBuf);

impl Immutable {
    fn set(root: &std::path::Path, on: bool) {
        let flag = if on { "+i" } else { "-i" };
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("find '{}' -type d -exec chattr {flag} {{}} +", root.display()))
            .output()
            .expect("run chattr");
        assert!(
            out.status.success(),
            "chattr {flag} failed (the test needs root and a filesystem with the immutable flag, e.g. ext4): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        Immutable::set(&self.0, false);
    }
}

#[test]
#[ignore = "needs root and a filesystem with the immutable flag (chattr +i, ext4); .ci/run runs this as root"]
fn a_store_that_refuses_writes_answers_503_and_keeps_what_was_acknowledged() {
    let mut s = Server::start(&[]);
    let body = "x".repeat(16 * 1024);
    let mut acknowledged = Vec::new();
    for i in 0..10 {
        let id = format!("before-{i}");
        s.produce("full", &json!({"id": id, "body": body, "delay_ms": 500}));
        acknowledged.push(id);
    }
    let guard = Immutable(s.data_dir());
    Immutable::set(&guard.0, true);
    // 1MiB segments and 16KiB bodies: the commit log must open a new segment within ~64 produces.
    let mut refused = None;
    for i in 0..200 {
        let id = format!("during-{i}");
        let (st, v) = s.post("/v1/topics/full/messages", &json!({"id": id, "body": body, "delay_ms": 500}));
        match st {
            201 => acknowledged.push(id),
            503 => {
                refused = Some(v);
                break;
            }
            _ => panic!("produce answered {st} {v}"),
        }
    }
    let v = refused.expect("the store never refused a write it could not make");
    Server::assert_error(503, &v, 503, "unavailable");
    assert_eq!(s.get("/healthz").0, 200, "the server must keep answering");
    let (st, v) = s.post("/v1/topics/full/messages", &json!({"body": "more"}));
    assert_eq!(st, 503, "after a failed write the store stays read-only until restart: {v}");
    let (st, v) = s.get("/v1/messages/before-0");
    assert_eq!(st, 200, "look-ups keep working while writes are refused: {v}");
    drop(guard);

    s.restart();
    let mut missing: HashSet<String> = acknowledged.iter().cloned().collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !missing.is_empty() {
        assert!(
            Instant::now() < deadline,
            "acknowledged but lost: {} e.g. {:?}",
            missing.len(),
            missing.iter().next()
        );
        for m in s.pop("full", 100, 1000, None).0 {
            let id = m["id"].as_str().unwrap().to_string();
            assert_eq!(m["body"].as_str().unwrap().len(), body.len(), "{id} body damaged");
            missing.remove(&id);
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
        }
    }
    assert_eq!(s.post("/v1/topics/full/messages", &json!({"body": "works again"})).0, 201);
}

#[test]
fn log_format_json_writes_one_json_object_per_line() {
    let mut s = Server::start(&[("DELAYD_LOG_FORMAT", "json"), ("DELAYD_LOG_LEVEL", "info")]);
    assert_eq!(s.terminate().code(), Some(0));
    let log = s.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "nothing logged");
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
    }
    assert!(lines.iter().any(|l| l.contains("delayd started")), "{log}");
}
