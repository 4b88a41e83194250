//! The process as systemd runs it: readiness on `$NOTIFY_SOCKET` once it serves, a busy port
//! refused before anything touches the data directory, and logs without terminal colour codes.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Instant;

use common::{run_binary, wait_timeout, Server, NEVER_HANG};

#[test]
fn a_busy_port_fails_the_start_at_once_and_leaves_no_data_directory() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let (status, log) =
        run_binary(&["--listen", &addr, "--data-dir", data.to_str().unwrap()], &[], tmp.path());
    assert_eq!(status.code(), Some(1), "a busy port is a run-time failure, not a config error (2): {log}");
    assert!(log.contains(&format!("cannot listen on {addr}")), "{log}");
    assert!(log.contains("Address already in use"), "{log}");
    assert!(!data.exists(), "the refused start created the data directory");
}

/// Receives one notification datagram, as text; on a timeout, panics with the server's log.
fn notification(sock: &UnixDatagram, log: &std::path::Path) -> String {
    let mut buf = [0u8; 4096];
    match sock.recv(&mut buf) {
        Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
        Err(e) => panic!("no notification ({e}); log:\n{}", std::fs::read_to_string(log).unwrap_or_default()),
    }
}

#[test]
fn readiness_is_notified_once_recovered_and_serving_and_stopping_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let sock_path = tmp.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).expect("bind the notify socket");
    sock.set_read_timeout(Some(NEVER_HANG)).unwrap();
    let data = tmp.path().join("data");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_delayd"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("DELAYD_")) {
        cmd.env_remove(k);
    }
    let log = tmp.path().join("stderr.log");
    let mut child = cmd
        .args(["--listen", "127.0.0.1:0", "--data-dir", data.to_str().unwrap()])
        .args(["--segment-bytes", "1MiB", "--max-body-bytes", "64KiB", "--index-initial-slots", "4096"])
        .env("NOTIFY_SOCKET", &sock_path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start delayd");

    assert_eq!(notification(&sock, &log).trim(), "READY=1");
    // READY=1 means recovered (the data directory exists) and serving: one request, no retry.
    assert!(data.join("commitlog").is_dir(), "READY=1 before the store was opened");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("the listening line");
    let base = line.trim().strip_prefix("delayd listening on ").expect("listening line").to_string();
    let r = common::client().get(format!("{base}/healthz")).send().expect("served once ready");
    assert_eq!(r.status(), 200);

    let started = Instant::now();
    let ok = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().expect("kill");
    assert!(ok.success());
    assert_eq!(notification(&sock, &log).trim(), "STOPPING=1");
    let status = wait_timeout(&mut child, NEVER_HANG).expect("exit after SIGTERM");
    assert!(status.success(), "exit {status:?} after {:?}", started.elapsed());
}

#[test]
fn logs_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    let mut s = Server::start(&[("DELAYD_LOG_LEVEL", "debug")]);
    assert_eq!(s.get("/v1/messages/none").0, 404);
    assert!(s.terminate().success());
    let log = s.log();
    assert!(log.contains("delayd started") && log.contains("stopped cleanly"), "{log}");
    assert!(!log.contains('\u{1b}'), "escape codes in a log written to a file:\n{log:?}");
}

#[test]
fn requests_are_logged_only_when_log_level_asks_for_tower_http_debug() {
    let quiet = Server::start(&[("DELAYD_LOG_LEVEL", "info")]);
    let traced = Server::start(&[("DELAYD_LOG_LEVEL", "info,tower_http=debug")]);
    for s in [&quiet, &traced] {
        assert_eq!(s.get("/healthz").0, 200);
    }
    // tower-http's on_response line comes after the answer is sent: give it a moment.
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while !traced.log().contains("finished processing request") && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(traced.log().contains("finished processing request"), "{}", traced.log());
    assert!(!quiet.log().contains("finished processing request"), "{}", quiet.log());
}
