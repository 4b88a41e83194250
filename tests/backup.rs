//! `POST /v1/admin/backup` and `delayd-cli backup` against the real binary: a backup taken while
//! producers and consumers keep the broker busy, restored by starting a second broker on the
//! copy, holds every change acknowledged before the backup was asked for (messages, acks,
//! reservations with their receipts, due times) and none made after it answered; nothing is
//! delivered early or twice. Bad targets, the read-only token and a cluster node are refused.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::{now_ms, Server};
use serde_json::{json, Value};

/// Delays the producer cycles through: due during the test, and far later.
const DELAYS_MS: [u64; 6] = [0, 300, 1_000, 2_500, 60_000, 3_600_000];

/// A produce: the message, its due time, and when its request left and its 201 arrived.
struct Produced {
    id: String,
    deliver_at_ms: u64,
    sent: Instant,
    answered: Instant,
}

/// An ack (or a reservation kept without one): the message, its receipt, when it left and came back.
struct Done {
    id: String,
    receipt: String,
    /// When the pop that reserved it answered.
    popped: Instant,
    sent: Instant,
    answered: Instant,
}

#[derive(Default)]
struct Journal {
    produced: Vec<Produced>,
    acked: Vec<Done>,
    /// Popped and never acked on the first broker: still reserved in any copy.
    kept: Vec<Done>,
}

fn producer(s: Arc<Server>, stop: Arc<AtomicBool>, journal: Arc<Mutex<Journal>>) {
    let body = "x".repeat(1024);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("m{n}");
        let delay = DELAYS_MS[n as usize % DELAYS_MS.len()];
        let sent = Instant::now();
        let v = s.produce("work", &json!({"id": id, "body": body, "delay_ms": delay}));
        let deliver_at_ms = v["deliver_at_ms"].as_u64().expect("deliver_at_ms");
        journal.lock().unwrap().produced.push(Produced { id, deliver_at_ms, sent, answered: Instant::now() });
        n += 1;
    }
}

/// Pops with a long time-to-run; acks two messages of three and keeps the third reserved.
fn consumer(s: Arc<Server>, stop: Arc<AtomicBool>, journal: Arc<Mutex<Journal>>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let (msgs, _) = s.pop("work", 8, 100, Some(600_000));
        let popped = Instant::now();
        for m in msgs {
            let id = m["id"].as_str().expect("id").to_string();
            let receipt = m["receipt"].as_str().expect("receipt").to_string();
            n += 1;
            let sent = Instant::now();
            if n.is_multiple_of(3) {
                journal.lock().unwrap().kept.push(Done { id, receipt, popped, sent, answered: sent });
                continue;
            }
            assert_eq!(s.ack(&receipt), 200, "ack {id}");
            journal.lock().unwrap().acked.push(Done { id, receipt, popped, sent, answered: Instant::now() });
        }
    }
}

/// Runs the load for `before`, takes a backup into `to`, runs it for `after` more; returns the
/// journal, when the backup request left and when its answer came, and the answer.
fn backup_under_load(
    s: &Arc<Server>,
    to: &Path,
    before: Duration,
    after: Duration,
) -> (Journal, Instant, Instant, Value) {
    let stop = Arc::new(AtomicBool::new(false));
    let journal = Arc::new(Mutex::new(Journal::default()));
    let threads: Vec<_> = [producer as fn(_, _, _), consumer]
        .into_iter()
        .map(|f| {
            let (s, stop, journal) = (s.clone(), stop.clone(), journal.clone());
            std::thread::spawn(move || f(s, stop, journal))
        })
        .collect();
    std::thread::sleep(before);
    let sent = Instant::now();
    let (st, report) = s.post("/v1/admin/backup", &json!({"to": to}));
    let answered = Instant::now();
    assert_eq!(st, 200, "{report}");
    std::thread::sleep(after);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("load thread");
    }
    let journal = Arc::try_unwrap(journal).ok().expect("threads joined").into_inner().unwrap();
    (journal, sent, answered, report)
}

/// Small segments, and done messages forgotten after 5 s, so reclaim deletes segments.
const RECLAIMING: [(&str, &str); 2] = [("DELAYD_SEGMENT_BYTES", "128KiB"), ("DELAYD_DONE_RETENTION", "5s")];

/// Produces and acks messages that fill a few segments, then waits until reclaim has deleted
/// some: the backup then starts past offset 0, as a long-running broker's does.
fn reclaim_some_segments(s: &Server) {
    let body = "w".repeat(1024);
    for n in 0..600 {
        s.produce("warm", &json!({"id": format!("w{n}"), "body": body}));
    }
    let mut acked = 0;
    while acked < 600 {
        let (msgs, _) = s.pop("warm", 100, 1_000, None);
        for m in msgs {
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200);
            acked += 1;
        }
    }
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let deleted = s.get("/v1/stats").1["reclaim"]["segments_deleted"].as_u64().unwrap_or(0);
        if deleted > 0 {
            return;
        }
        assert!(Instant::now() < until, "reclaim deleted no segment");
        // Checkpoints, which deletions wait for, come while records are written.
        s.produce("tick", &json!({"body": "t", "delay_ms": 3_600_000}));
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_backup_under_load_restores_every_acknowledged_change_and_none_after_it() {
    let s = Arc::new(Server::start(&RECLAIMING));
    reclaim_some_segments(&s);
    let tmp = tempfile::tempdir().unwrap();
    let to = tmp.path().join("backups/first");
    let (j, sent, answered, report) =
        backup_under_load(&s, &to, Duration::from_millis(1_500), Duration::from_millis(500));
    let before = |i: Instant| i < sent;
    let produced_before: Vec<&Produced> = j.produced.iter().filter(|p| before(p.answered)).collect();
    assert!(produced_before.len() >= 30, "too little load: {}", produced_before.len());
    assert!(j.acked.iter().filter(|a| before(a.answered)).count() >= 5, "too few acks before the backup");
    assert!(j.kept.iter().any(|k| before(k.answered)), "no reservation kept before the backup");
    assert!(j.produced.iter().any(|p| p.sent > answered), "no produce after the backup answered");
    assert!(report["files"].as_u64() >= Some(2) && report["bytes"].as_u64() > Some(0), "{report}");
    assert!(report["log_start"].as_u64() > Some(0), "reclaim deleted the oldest segments: {report}");
    assert!(
        report["log_end"].as_u64() > report["log_start"].as_u64() && report["took_ms"].is_u64(),
        "{report}"
    );
    assert!(report["files"].as_u64() >= Some(3), "several segments: {report}");
    assert_eq!(report["to"], to.to_str().unwrap());
    assert_private(&to);
    eprintln!(
        "backup {report}; produced {} ({} before it), acked {}, kept reserved {}",
        j.produced.len(),
        produced_before.len(),
        j.acked.len(),
        j.kept.len()
    );

    let b = Server::start_at(&to, &[]);
    check_messages(&b, &j, sent, answered);
    check_receipts(&b, &j, sent, answered);
    check_deliveries(&b, &j, sent);
    // The first broker went on undisturbed.
    let (st, v) = s.get("/v1/stats");
    assert_eq!(st, 200, "{v}");
}

/// Every produce answered before the backup began is in the copy with its due time; an ack
/// answered before is there, one sent after the answer is not; produces sent after it are absent.
fn check_messages(b: &Server, j: &Journal, sent: Instant, answered: Instant) {
    let acked_before: HashSet<&str> =
        j.acked.iter().filter(|a| a.answered < sent).map(|a| a.id.as_str()).collect();
    // Reserved before the backup began, acked only after it answered: reserved in the copy.
    let acked_after: HashSet<&str> =
        j.acked.iter().filter(|a| a.popped < sent && a.sent > answered).map(|a| a.id.as_str()).collect();
    let acked_ever: HashSet<&str> = j.acked.iter().map(|a| a.id.as_str()).collect();
    let kept_before: HashSet<&str> =
        j.kept.iter().filter(|k| k.answered < sent).map(|k| k.id.as_str()).collect();
    let mut checked = 0;
    for p in &j.produced {
        let (st, v) = b.get(&format!("/v1/messages/{}", p.id));
        if p.sent > answered {
            assert_eq!(st, 404, "{} was produced after the backup answered, yet the copy has it: {v}", p.id);
            continue;
        }
        if p.answered > sent {
            continue; // concurrent with the backup: either way is right
        }
        checked += 1;
        assert_eq!(st, 200, "{} was acknowledged before the backup began: {v}", p.id);
        let state = v["state"].as_str().unwrap_or_default();
        let v = json!({"state": state, "deliver_at_ms": v["deliver_at_ms"], "attempt": v["attempt"]});
        // While reserved, `deliver_at_ms` is the end of the reservation; otherwise the due time.
        let due = v["deliver_at_ms"].as_u64().unwrap_or_default();
        if state == "reserved" {
            assert!(due > p.deliver_at_ms, "{} reserved: {v}", p.id);
        } else {
            assert_eq!(due, p.deliver_at_ms, "{} kept its due time: {v}", p.id);
        }
        if acked_before.contains(p.id.as_str()) {
            assert_eq!(state, "done", "{} was acked before the backup: {v}", p.id);
        } else if acked_after.contains(p.id.as_str()) {
            assert_eq!(state, "reserved", "{} was acked only after the backup answered: {v}", p.id);
        } else if kept_before.contains(p.id.as_str()) {
            assert_eq!(state, "reserved", "{} was reserved before the backup: {v}", p.id);
        } else if !acked_ever.contains(p.id.as_str()) {
            assert_ne!(state, "done", "{} was never acked: {v}", p.id);
        }
    }
    assert!(checked >= 30, "{checked}");
}

/// A reservation made before the backup keeps its receipt in the copy (the receipt key came
/// with it); one made after the backup answered names nothing there.
fn check_receipts(b: &Server, j: &Journal, sent: Instant, answered: Instant) {
    let mut acked = 0;
    for k in &j.kept {
        if k.answered < sent {
            assert_eq!(b.ack(&k.receipt), 200, "receipt of {} from before the backup", k.id);
            acked += 1;
        } else if k.sent > answered {
            assert_eq!(b.ack(&k.receipt), 404, "receipt of {} from after the backup", k.id);
        }
    }
    assert!(acked >= 1);
}

/// Pops the copy until the messages due by then have come: each one that was pending before the
/// backup comes once, never before its due time, and nothing acked before comes again.
fn check_deliveries(b: &Server, j: &Journal, sent: Instant) {
    let due: HashMap<&str, u64> = j.produced.iter().map(|p| (p.id.as_str(), p.deliver_at_ms)).collect();
    let handled: HashSet<&str> =
        j.acked.iter().chain(&j.kept).filter(|a| a.sent < sent).map(|a| a.id.as_str()).collect();
    let mut delivered = HashSet::new();
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let (msgs, at) = b.pop("work", 64, 300, Some(600_000));
        for m in msgs {
            let id = m["id"].as_str().expect("id").to_string();
            let due_at = due.get(id.as_str()).copied().or(m["deliver_at_ms"].as_u64()).expect("due");
            assert!(at >= due_at, "{id} delivered at {at}, before its due time {due_at}");
            assert!(
                !handled.contains(id.as_str()),
                "{id} was acked or reserved before the backup, yet delivered"
            );
            assert!(delivered.insert(id.clone()), "{id} delivered twice");
        }
    }
    let now = now_ms();
    let pending_before = j
        .produced
        .iter()
        .filter(|p| {
            p.answered < sent && p.deliver_at_ms + 1_000 < now && !j.acked.iter().any(|a| a.id == p.id)
        })
        .filter(|p| !j.kept.iter().any(|k| k.id == p.id));
    for p in pending_before {
        assert!(delivered.contains(&p.id), "{} was pending before the backup and due, never delivered", p.id);
    }
    assert!(!delivered.is_empty(), "nothing was delivered from the copy");
}

/// The copy is its owner's alone: the directory 0700, the receipt key 0600.
fn assert_private(to: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(to), 0o700);
    assert_eq!(mode(&to.join("receipt_key")), 0o600);
    assert!(to.join("commitlog").is_dir());
    let names: Vec<String> = std::fs::read_dir(to)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["commitlog", "receipt_key"], "only the log and the key are copied");
}

const FULL: &str = "full-token";
const READ: &str = "read-only-token";

fn backup_as(s: &Server, token: Option<&str>, to: &Value) -> (u16, Value) {
    let mut req = s.http().post(s.url("/v1/admin/backup")).json(&json!({ "to": to }));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    common::answer(req.send())
}

fn cli(s: &Server, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_delayd-cli"))
        .args(["--url", &s.base, "--token", FULL])
        .args(args)
        .env_remove("DELAYD_URL")
        .env_remove("DELAYD_AUTH_TOKEN")
        .output()
        .expect("run delayd-cli");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[test]
fn bad_targets_and_the_read_only_token_are_refused_and_the_cli_backs_up() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", FULL), ("DELAYD_READ_TOKEN", READ)]);
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep"), b"x").unwrap();
    let fresh = tmp.path().join("fresh");
    let cases = [
        (Some(READ), json!(fresh), 403, "forbidden"),
        (None, json!(fresh), 401, "unauthorized"),
        (Some(FULL), json!(full), 409, "conflict"),
        (Some(FULL), json!("relative/dir"), 400, "invalid_argument"),
        (Some(FULL), json!(s.data_dir().join("inside")), 400, "invalid_argument"),
        (Some(FULL), json!(""), 400, "invalid_argument"),
    ];
    for (token, to, status, code) in cases {
        let (st, v) = backup_as(&s, token, &to);
        Server::assert_error(st, &v, status, code);
    }
    assert!(!fresh.exists(), "a refused backup wrote nothing");
    assert_eq!(std::fs::read_dir(&full).unwrap().count(), 1, "a non-empty target is left alone");
    assert!(!s.data_dir().join("inside").exists());

    let produce = s.http().post(s.url("/v1/topics/t/messages")).bearer_auth(FULL).json(&json!({"body": "b"}));
    assert_eq!(common::answer(produce.send()).0, 201);
    let (code, out, err) = cli(&s, &["backup", "--to", fresh.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("backed up ") && out.contains(fresh.to_str().unwrap()), "{out}");
    assert!(fresh.join("commitlog").is_dir() && fresh.join("receipt_key").is_file());
    // The same directory again: no longer empty.
    let (code, _, err) = cli(&s, &["backup", "--to", fresh.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not empty"), "{err}");
    let (code, _, err) = cli(&s, &["backup", "--to", "relative"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("absolute"), "{err}");
}

/// CRC-32 (IEEE), as storage-format.md defines it.
fn crc32(parts: &[&[u8]]) -> u32 {
    let mut crc = !0u32;
    for b in parts.iter().flat_map(|p| p.iter()) {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// What an older delayd meets in a newer backup: an intact record of a version it does not know.
/// It refuses to start (in every recovery mode) and changes nothing; the same copy unmarked starts.
#[test]
fn a_record_of_an_unknown_version_in_a_backup_is_refused_not_cut() {
    let s = Server::start(&[]);
    s.produce("t", &json!({"id": "kept", "body": "b", "delay_ms": 3_600_000}));
    let tmp = tempfile::tempdir().unwrap();
    let to = tmp.path().join("b");
    let (st, v) = s.post("/v1/admin/backup", &json!({ "to": to }));
    assert_eq!(st, 200, "{v}");
    let seg = to.join("commitlog").join(format!("{:020}", v["log_start"].as_u64().unwrap()));
    let original = std::fs::read(&seg).unwrap();
    let mut bytes = original.clone();
    let len = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
    bytes[6] = 0xEE;
    let crc = crc32(&[&bytes[0..8], &bytes[12..len]]);
    bytes[8..12].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&seg, &bytes).unwrap();
    for mode in ["strict", "truncate"] {
        let args = ["--listen", "127.0.0.1:0", "--data-dir", to.to_str().unwrap()];
        let (status, log) = common::run_binary(&args, &[("DELAYD_RECOVERY", mode)], tmp.path());
        assert!(!status.success(), "{mode}: started on a record of an unknown version");
        assert!(log.contains("newer delayd"), "{mode}: {log}");
        // Its own segment_bytes may extend the last segment with zeros; no byte in it changes.
        let after = std::fs::read(&seg).unwrap();
        assert!(after[..bytes.len()] == bytes[..], "{mode}: the refused log was changed");
        assert!(after[bytes.len()..].iter().all(|b| *b == 0), "{mode}: the refused log grew data");
    }
    std::fs::write(&seg, &original).unwrap();
    let _ = std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(original.len() as u64);
    let b = Server::start_at(&to, &[]);
    assert_eq!(b.get("/v1/messages/kept").1["state"], "delayed");
}

#[test]
fn a_cluster_node_refuses_a_backup() {
    let c = Cluster::start(1, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let tmp = tempfile::tempdir().unwrap();
    let to = tmp.path().join("b");
    let (st, v) = c.node(leader).post("/v1/admin/backup", &json!({ "to": to }));
    Server::assert_error(st, &v, 409, "conflict");
    assert!(v["error"]["message"].as_str().unwrap().contains("cluster node"), "{v}");
    assert!(!to.exists());
}
