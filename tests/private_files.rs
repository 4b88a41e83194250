//! The data directory keeps its secrets to its owner, and a lost receipt key is not replaced in
//! silence: against the real binary.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;

use common::{client, Server, BASE_ENV, NEVER_HANG};
use serde_json::json;

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display())).permissions().mode()
        & 0o777
}

#[test]
fn the_data_directory_and_secret_files_are_private_whatever_the_umask() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    // umask 000: anything made without an explicit mode would come out readable (and writable)
    // by every user.
    let mut child = Command::new("sh")
        .args(["-c", "umask 000 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_delayd"))
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .envs(BASE_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start delayd");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("delayd listening on ") {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let base = rx.recv_timeout(NEVER_HANG).expect("delayd started");
    let http = client();
    // A webhook secret goes into the log.
    let put = http
        .put(format!("{base}/v1/topics/orders/push"))
        .json(&json!({ "url": "http://127.0.0.1:9/hook", "secret": "whsec_do_not_share" }))
        .send()
        .expect("PUT push");
    assert_eq!(put.status(), 200);
    let produced = http
        .post(format!("{base}/v1/topics/jobs/messages"))
        .json(&json!({ "body": "b" }))
        .send()
        .expect("produce");
    assert_eq!(produced.status(), 201);
    child.kill().expect("kill");
    child.wait().expect("reap");

    assert_eq!(mode(&data), 0o700, "the data directory");
    assert_eq!(mode(&data.join("receipt_key")), 0o600, "the receipt key");
    let segments: Vec<_> =
        std::fs::read_dir(data.join("commitlog")).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!segments.is_empty());
    let with_secret = segments.iter().filter(|p| {
        std::fs::read(p).unwrap().windows(b"whsec_do_not_share".len()).any(|w| w == b"whsec_do_not_share")
    });
    assert_eq!(with_secret.count(), 1, "the secret is in one segment");
    for seg in &segments {
        assert_eq!(mode(seg), 0o600, "{}", seg.display());
    }
}

/// Starts delayd on `data` under `umask`, stderr appended to `log`; returns it and its address.
fn start_under_umask(umask: &str, data: &Path, log: &Path) -> (std::process::Child, String) {
    let stderr = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log");
    let mut child = Command::new("sh")
        .args(["-c", &format!("umask {umask} && exec \"$0\" \"$@\"")])
        .arg(env!("CARGO_BIN_EXE_delayd"))
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .envs(BASE_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start delayd");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("delayd listening on ") {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let base = rx.recv_timeout(NEVER_HANG).expect("delayd started");
    (child, base)
}

#[test]
fn secret_files_are_0600_under_umask_022_and_wider_ones_are_narrowed_with_a_warning() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let (data, log) = (tmp.path().join("data"), tmp.path().join("stderr.log"));
    let (mut child, base) = start_under_umask("022", &data, &log);
    let produced = client()
        .post(format!("{base}/v1/topics/jobs/messages"))
        .json(&json!({ "body": "b" }))
        .send()
        .unwrap();
    assert_eq!(produced.status(), 201);
    child.kill().expect("kill");
    child.wait().expect("reap");
    let key = data.join("receipt_key");
    let segment = std::fs::read_dir(data.join("commitlog")).unwrap().next().unwrap().unwrap().path();
    assert_eq!(mode(&key), 0o600, "the receipt key");
    assert_eq!(mode(&segment), 0o600, "{}", segment.display());
    assert!(!std::fs::read_to_string(&log).unwrap().contains("narrowed"));

    // As an older delayd left them, or a copy made them: readable by every user.
    for f in [&key, &segment] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (mut child, _) = start_under_umask("022", &data, &log);
    child.kill().expect("kill");
    child.wait().expect("reap");
    assert_eq!(mode(&key), 0o600, "the receipt key is narrowed");
    assert_eq!(mode(&segment), 0o600, "the segment is narrowed");
    let text = std::fs::read_to_string(&log).unwrap();
    for (what, file) in [("the receipt key", &key), ("a commit log segment", &segment)] {
        let line = text
            .lines()
            .find(|l| l.contains(what) && l.contains("narrowed to 0600"))
            .unwrap_or_else(|| panic!("no line for {what}; log:\n{text}"));
        assert!(
            line.contains("WARN") && line.contains(&file.display().to_string()) && line.contains("0644"),
            "{line}"
        );
    }
}

#[test]
fn a_receipt_key_lost_from_a_used_data_directory_is_replaced_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut s = Server::start_at(&data, &[]);
    assert!(!s.log().contains("receipt key missing"), "a new directory gets its key quietly: {}", s.log());
    s.produce("jobs", &json!({ "body": "b" }));
    let (got, _) = s.pop("jobs", 1, 0, Some(60_000));
    let receipt = got[0]["receipt"].as_str().unwrap().to_string();
    s.terminate();
    std::fs::remove_file(data.join("receipt_key")).unwrap();
    s.respawn();
    let line = s
        .log()
        .lines()
        .find(|l| l.contains("receipt key missing"))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no warning; log:\n{}", s.log()));
    assert!(line.contains("WARN") && line.contains("receipt_key"), "{line}");
    // What the warning says: receipts handed out before are refused.
    let (st, v) = s.post("/v1/ack", &json!({ "receipt": receipt }));
    Server::assert_error(st, &v, 404, "not_found");
}
