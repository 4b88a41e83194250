//! The process as systemd runs it: a busy port refused before anything touches the data
//! directory, and logs without terminal colour codes.

mod common;

use common::{run_binary, Server};

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

#[test]
fn logs_carry_no_colour_codes_when_stderr_is_not_a_terminal() {
    let mut s = Server::start(&[("DELAYD_LOG_LEVEL", "debug")]);
    assert_eq!(s.get("/v1/messages/none").0, 404);
    assert!(s.terminate().success());
    let log = s.log();
    assert!(log.contains("delayd started") && log.contains("stopped cleanly"), "{log}");
    assert!(!log.contains('\u{1b}'), "escape codes in a log written to a file:\n{log:?}");
}
