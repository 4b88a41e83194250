//! Steps of the server's wall clock (NTP, `date -s`, a VM restored from a snapshot), made with
//! libfaketime against the real binary: nothing may be delivered before its `delay_ms` of real
//! time, no reservation may come back before its TTR, receipts stay valid, and an acked id is not
//! forgotten early. Real time here is the test's own monotonic clock, which libfaketime leaves
//! alone (the server's monotonic and boot-time clocks stay real too: DONT_FAKE_MONOTONIC).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Server;
use serde_json::{json, Value};

/// The test is ignored unless asked for; asked for, a missing libfaketime is a failure.
fn libfaketime() -> Option<PathBuf> {
    let found = common::cluster::libfaketime();
    assert!(found.is_some(), "libfaketime is not installed (apt-get install libfaketime)");
    found
}

/// Sets the server's wall clock to real time plus `secs`. libfaketime rereads the file at every
/// clock read (FAKETIME_NO_CACHE), so the file is replaced whole: a reader never sees it empty.
fn set_offset(file: &Path, secs: i64) {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, format!("{secs:+}\n")).expect("write offset");
    std::fs::rename(&tmp, file).expect("replace offset file");
    // Let the server's next readings see it before the test goes on.
    std::thread::sleep(Duration::from_millis(200));
}

/// Produces one message, returning when the request was sent (by the test's monotonic clock).
fn produce(s: &Server, topic: &str, body: &Value) -> Instant {
    let sent = Instant::now();
    s.produce(topic, body);
    sent
}

/// Pops up to `max` with a TTR, returning the messages and when the answer arrived.
fn pop(s: &Server, topic: &str, max: usize, wait_ms: u64, ttr_ms: u64) -> (Vec<Value>, Instant) {
    let (status, v) = s.post_raw(
        &format!("/v1/topics/{topic}/pop?max={max}&wait_ms={wait_ms}&ttr_ms={ttr_ms}"),
        None,
        vec![],
    );
    let at = Instant::now();
    assert_eq!(status, 200, "pop -> {v}");
    (v["messages"].as_array().expect("messages").clone(), at)
}

/// Whether the server logged a step in `direction` within a second of `near_ms`.
fn logged_step(log: &str, direction: &str, near_ms: u64) -> bool {
    let needle = format!("stepped {direction} by ");
    log.match_indices(&needle).any(|(at, _)| {
        let rest = &log[at + needle.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u64>().is_ok_and(|ms| ms.abs_diff(near_ms) < 1_000)
    })
}

#[test]
#[ignore = "needs libfaketime (apt-get install libfaketime); .ci/run installs it and runs this"]
fn clock_steps_deliver_nothing_early_expire_no_reservation_early_and_forget_no_id_early() {
    let Some(lib) = libfaketime() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let offset = dir.path().join("faketime.rc");
    std::fs::write(&offset, "+0\n").expect("offset file");
    let lib = lib.to_str().expect("utf-8 path").to_string();
    let offset_path = offset.to_str().expect("utf-8 path").to_string();
    let s = Server::start(&[
        ("LD_PRELOAD", &lib),
        ("FAKETIME_TIMESTAMP_FILE", &offset_path),
        ("FAKETIME_NO_CACHE", "1"),
        ("DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("DELAYD_DONE_RETENTION", "10m"),
    ]);

    // An id done at the real time, kept for 10 minutes of delayd's clock.
    s.produce("r", &json!({"id": "order-1", "body": "once"}));
    let (got, _) = pop(&s, "r", 1, 1000, 60_000);
    assert_eq!(got.len(), 1);
    assert_eq!(s.ack(got[0]["receipt"].as_str().unwrap()), 200);

    // Delays measured from the moment each produce was sent: (sent, delay_ms) by id.
    let mut due: HashMap<String, (Instant, u64)> = HashMap::new();
    let mut batch = |s: &Server, name: &str| {
        for (i, delay) in [3_000u64, 3_500, 4_000, 4_500, 5_000, 6_000].into_iter().enumerate() {
            let id = format!("{name}-{i}");
            let sent = produce(s, "d", &json!({"id": id, "body": name, "delay_ms": delay}));
            due.insert(id, (sent, delay));
        }
    };
    for i in 0..3 {
        s.produce("ttr", &json!({"id": format!("job-{i}"), "body": "work"}));
    }

    // Before any step: a batch and a reservation of 8 s.
    batch(&s, "before");
    let r1_sent = Instant::now();
    let (r1, _) = pop(&s, "ttr", 1, 1000, 8_000);
    assert_eq!(r1.len(), 1);

    // The wall clock steps back two minutes: a batch and two reservations then.
    set_offset(&offset, -120);
    batch(&s, "stepped-back");
    let r2_sent = Instant::now();
    let (r2, _) = pop(&s, "ttr", 2, 1000, 8_000);
    assert_eq!(r2.len(), 2);

    // ... and forward again: what was planned while it was back must not come due at once.
    set_offset(&offset, 0);
    batch(&s, "stepped-forward");

    // Fifteen minutes forward: past done_retention, so a clock that followed would forget order-1.
    set_offset(&offset, 900);
    std::thread::sleep(Duration::from_secs(1));
    let (status, v) = s.post("/v1/topics/r/messages", &json!({"id": "order-1", "body": "once"}));
    assert_eq!(status, 200, "the acked id was forgotten early (201 is a new message): {v}");
    let (status, v) = s.get("/v1/messages/order-1");
    assert_eq!((status, v["state"].as_str()), (200, Some("done")), "{v}");
    batch(&s, "stepped-far-forward");

    // A receipt of the reservations made while the clock was back still holds (8 s TTR, ~2 s on).
    assert!(r2_sent.elapsed() < Duration::from_secs(7), "the test ran too slowly to check receipts");
    assert_eq!(s.ack(r2[0]["receipt"].as_str().unwrap()), 200, "a receipt within its TTR was refused");

    // Collect everything by real time: each delivery no earlier than its delay, each expired
    // reservation no earlier than its TTR.
    let reserved = [(r1[0]["id"].clone(), r1_sent), (r2[1]["id"].clone(), r2_sent)];
    let mut back: Vec<Value> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !due.is_empty() || back.len() < reserved.len() {
        assert!(
            Instant::now() < deadline,
            "not delivered in time: {:?}, {} of 2 reservations back",
            due.keys(),
            back.len()
        );
        let (got, at) = pop(&s, "d", 100, 200, 60_000);
        for m in got {
            let id = m["id"].as_str().unwrap().to_string();
            let (sent, delay) = due.remove(&id).unwrap_or_else(|| panic!("{id} delivered twice or unknown"));
            let real = at.duration_since(sent);
            assert!(
                real >= Duration::from_millis(delay),
                "{id} (delay_ms {delay}) was delivered after only {real:?} of real time"
            );
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200, "ack {id}");
        }
        let (got, at) = pop(&s, "ttr", 10, 0, 60_000);
        for m in got {
            let (_, sent) = reserved
                .iter()
                .find(|(id, _)| *id == m["id"])
                .unwrap_or_else(|| panic!("{} came back but was acked or never reserved", m["id"]));
            let real = at.duration_since(*sent);
            assert!(
                real >= Duration::from_secs(8),
                "{} came back after only {real:?} of an 8 s TTR",
                m["id"]
            );
            assert_eq!(m["attempt"], 2, "{m}");
            back.push(m);
        }
    }
    // The idempotent re-produce made nothing new.
    let (got, _) = pop(&s, "r", 10, 500, 60_000);
    assert!(got.is_empty(), "order-1 was delivered again: {got:?}");

    // Each step was seen and said.
    let log = s.log();
    assert!(logged_step(&log, "backward", 120_000), "no WARN for the 120 s step back; log:\n{log}");
    assert!(logged_step(&log, "forward", 900_000), "no WARN for the 15 min step forward; log:\n{log}");
}
