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
