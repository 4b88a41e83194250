//! The example workers in `examples/` (Python and Go), run against the real binary: they ack
//! what works, nack what fails with its error (kept as the message's last error), keep a job
//! longer than its time-to-run reserved by touching it, and on SIGTERM finish the job in hand
//! and exit 0.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Server, BASE_ENV};
use serde_json::{json, Value};

/// Reserved this long per pop: shorter than the long job, so only touching keeps it.
const TTR_MS: u64 = 1_500;

/// A worker process and the lines it printed so far.
struct Worker {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Worker {
    fn start(mut cmd: Command, server: &Server, topic: &str) -> Worker {
        cmd.arg(topic)
            .env("DELAYD_URL", &server.base)
            .env("DELAYD_TTR_MS", TTR_MS.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start the worker");
        let out = child.stdout.take().expect("worker stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Worker { child, lines, seen: Vec::new() }
    }

    /// Waits until the worker printed a line containing `what`; panics after `timeout`.
    fn wait_for(&mut self, what: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.seen.iter().any(|l| l.contains(what)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("the worker never printed {what:?}; it printed {:?}", self.seen),
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Produces the test's messages; returns their ids.
fn produce_jobs(s: &Server, topic: &str) -> (Vec<String>, String, String) {
    let plain: Vec<String> = (0..5).map(|i| format!("{topic}-plain-{i}")).collect();
    for id in &plain {
        let (st, b) = s.post(&format!("/v1/topics/{topic}/messages"), &json!({"id": id, "body": "{}"}));
        assert_eq!(st, 201, "{b}");
    }
    let failing = format!("{topic}-failing");
    let body = json!({"fail": "the mail server said 550"}).to_string();
    let (st, b) = s.post(
        &format!("/v1/topics/{topic}/messages"),
        &json!({"id": failing, "body": body, "max_attempts": 1}),
    );
    assert_eq!(st, 201, "{b}");
    // Works twice its time-to-run.
    let long = format!("{topic}-long");
    let body = json!({"sleep_ms": TTR_MS * 2}).to_string();
    let (st, b) = s.post(&format!("/v1/topics/{topic}/messages"), &json!({"id": long, "body": body}));
    assert_eq!(st, 201, "{b}");
    (plain, failing, long)
}

fn message(s: &Server, id: &str) -> Value {
    let (st, b) = s.get(&format!("/v1/messages/{id}"));
    assert_eq!(st, 200, "GET {id}: {b}");
    b
}

/// The whole exercise for one worker command.
fn exercise(cmd: Command) {
    let s = Server::start(&BASE_ENV);
    let topic = "jobs";
    let (plain, failing, long) = produce_jobs(&s, topic);
    let mut w = Worker::start(cmd, &s, topic);
    w.wait_for(&format!("{long} acked"), Duration::from_secs(60));
    for id in &plain {
        w.wait_for(&format!("{id} acked"), Duration::from_secs(10));
        assert_eq!(message(&s, id)["state"], "done", "{id}");
    }
    w.wait_for(&format!("{failing} nacked"), Duration::from_secs(10));
    let dead = message(&s, &failing);
    assert_eq!(dead["state"], "dead", "{dead}");
    let error = dead["last_error"]["message"].as_str().unwrap_or_default();
    assert!(error.contains("the mail server said 550"), "the nack's error is kept: {dead}");
    // Touched while it ran for twice its time-to-run: delivered once, acked by that delivery.
    let done = message(&s, &long);
    assert_eq!((done["state"].as_str(), done["attempt"].as_u64()), (Some("done"), Some(1)), "{done}");

    // A stop while a job runs: the job is finished (acked), then the worker exits 0.
    let last = format!("{topic}-at-stop");
    let body = json!({"sleep_ms": 1_000}).to_string();
    let (st, b) = s.post(&format!("/v1/topics/{topic}/messages"), &json!({"id": last, "body": body}));
    assert_eq!(st, 201, "{b}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while message(&s, &last)["state"] != "reserved" {
        assert!(Instant::now() < deadline, "the worker never popped {last}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let term = Command::new("kill").arg("-TERM").arg(w.child.id().to_string()).status().expect("kill");
    assert!(term.success());
    w.wait_for(&format!("{last} acked"), Duration::from_secs(10));
    w.wait_for("worker stopped", Duration::from_secs(15));
    let status = w.child.wait().expect("wait for the worker");
    assert!(status.success(), "the worker exits 0 on SIGTERM: {status}");
    assert_eq!(message(&s, &last)["state"], "done");
}

fn examples() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/examples"))
}

#[test]
#[ignore = "needs python3; .ci/run installs it and runs this"]
fn the_python_worker_acks_nacks_touches_and_stops_gracefully() {
    let mut cmd = Command::new("python3");
    cmd.arg("-u").arg(examples().join("python/worker.py"));
    exercise(cmd);
}

#[test]
#[ignore = "needs go (apt-get install golang-go); .ci/run installs it and runs this"]
fn the_go_worker_acks_nacks_touches_and_stops_gracefully() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-worker");
    let built = Command::new("go")
        .args(["build", "-o"])
        .arg(&out)
        .arg(".")
        .current_dir(examples().join("go"))
        .env("GOCACHE", Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-cache"))
        .env("GOFLAGS", "-mod=mod")
        .status()
        .expect("run go build");
    assert!(built.success(), "go build of examples/go failed");
    exercise(Command::new(out));
}
