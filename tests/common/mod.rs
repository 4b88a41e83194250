//! Starts the real `delayd` binary on a free loopback port with a temporary data dir, and talks to it.
//!
//! Each test binary uses only some helpers, hence the allow.
#![allow(dead_code)]

pub mod checker;
pub mod cluster;
pub mod jepsen;
pub mod proxy;
pub mod raw;
pub mod tmpfs;

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Longest time any single step may take before the test calls it a hang.
pub const NEVER_HANG: Duration = Duration::from_secs(30);

/// Settings every test server gets: small files so tests are quick and light on disk.
pub const BASE_ENV: [(&str, &str); 8] = [
    ("DELAYD_SEGMENT_BYTES", "1MiB"),
    ("DELAYD_MAX_BODY_BYTES", "64KiB"),
    ("DELAYD_CQ_ENTRIES_PER_FILE", "4096"),
    ("DELAYD_INDEX_INITIAL_SLOTS", "4096"),
    ("DELAYD_MAX_WAIT", "20s"),
    ("DELAYD_COMPAT_MAX_WAIT", "1s"),
    ("DELAYD_LOG_LEVEL", "info"),
    ("DELAYD_SHUTDOWN_GRACE", "5s"),
];

/// A running `delayd` child process and the temp dir holding its data and log.
pub struct Server {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`, the address of the current process.
    pub base: String,
    tmp: tempfile::TempDir,
    env: Vec<(String, String)>,
    args: Vec<String>,
    client: reqwest::blocking::Client,
    /// A data directory chosen by the test (e.g. on a small filesystem) instead of one in `tmp`.
    data: Option<PathBuf>,
}

/// Unix time in milliseconds, the clock the server uses too.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_millis() as u64
}

/// A blocking HTTP client with keep-alive and a never-hang timeout.
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(NEVER_HANG).build().expect("http client")
}

impl Server {
    /// Starts a server with the base settings plus `env` (later entries win).
    pub fn start(env: &[(&str, &str)]) -> Server {
        Server::start_with_args(env, &[])
    }

    /// Starts a server with extra command-line arguments (after `--listen 127.0.0.1:0 --data-dir DIR`).
    pub fn start_with_args(env: &[(&str, &str)], args: &[&str]) -> Server {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut all: Vec<(String, String)> =
            BASE_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let args = args.iter().map(|a| a.to_string()).collect();
        let mut s =
            Server { child: None, base: String::new(), tmp, env: all, args, client: client(), data: None };
        s.spawn();
        s
    }

    /// Starts a server with its data in `data` (which the test owns).
    pub fn start_at(data: &Path, env: &[(&str, &str)]) -> Server {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut all: Vec<(String, String)> =
            BASE_ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut s = Server {
            child: None,
            base: String::new(),
            tmp,
            env: all,
            args: Vec::new(),
            client: client(),
            data: Some(data.to_path_buf()),
        };
        s.spawn();
        s
    }

    /// Starts the binary again after [`terminate`](Self::terminate) (same data dir and settings).
    pub fn respawn(&mut self) {
        self.spawn();
    }

    /// The data directory, which survives restarts.
    pub fn data_dir(&self) -> PathBuf {
        self.data.clone().unwrap_or_else(|| self.tmp.path().join("data"))
    }

    /// The temp dir that holds the data dir and the log.
    pub fn tmp(&self) -> &Path {
        self.tmp.path()
    }

    /// Path of the file that collects the server's stderr (all runs appended).
    pub fn log_path(&self) -> PathBuf {
        self.tmp.path().join("stderr.log")
    }

    /// Everything the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// A command for the binary with this server's environment and data dir, not yet started.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_delayd"));
        cmd.arg("--listen").arg("127.0.0.1:0").arg("--data-dir").arg(self.data_dir());
        // Keep the developer's own DELAYD_* settings out of the tests.
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("DELAYD_")) {
            cmd.env_remove(k);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd.args(&self.args);
        cmd
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let log = OpenOptions::new().create(true).append(true).open(self.log_path()).expect("log file");
        let mut child = self
            .command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
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
        let base = match rx.recv_timeout(NEVER_HANG) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("delayd did not start; its log:\n{}", self.log());
            }
        };
        self.child = Some(child);
        self.base = base;
        let deadline = Instant::now() + NEVER_HANG;
        loop {
            if let Ok(r) = self.client.get(self.url("/healthz")).send() {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "healthz never answered; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Full URL of `path` on the current process.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Process id of the running server.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// Kills the server with SIGKILL (no chance to flush or clean up) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // `Child::kill` sends SIGKILL on Unix.
            child.kill().expect("SIGKILL delayd");
            child.wait().expect("reap delayd");
        }
    }

    /// Sends SIGTERM and waits for the process to exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("server running");
        let ok = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().expect("run kill");
        assert!(ok.success(), "kill -TERM failed");
        wait_timeout(&mut child, NEVER_HANG).unwrap_or_else(|| {
            let _ = child.kill();
            panic!("delayd did not exit within {NEVER_HANG:?} of SIGTERM; log:\n{}", self.log())
        })
    }

    /// Starts the binary again on the same data dir and settings (on a new port).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// The HTTP client this server's helpers use.
    pub fn http(&self) -> &reqwest::blocking::Client {
        &self.client
    }

    /// POSTs JSON, returning the status and the parsed JSON answer.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        answer(self.client.post(self.url(path)).json(body).send())
    }

    /// POSTs raw bytes with an optional Content-Type.
    pub fn post_raw(&self, path: &str, content_type: Option<&str>, body: Vec<u8>) -> (u16, Value) {
        let mut req = self.client.post(self.url(path)).body(body);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        answer(req.send())
    }

    /// GETs a JSON document.
    pub fn get(&self, path: &str) -> (u16, Value) {
        answer(self.client.get(self.url(path)).send())
    }

    /// DELETEs a resource.
    pub fn delete(&self, path: &str) -> (u16, Value) {
        answer(self.client.delete(self.url(path)).send())
    }

    /// GETs a text document.
    pub fn get_text(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().expect("request");
        let status = r.status().as_u16();
        (status, r.text().expect("body"))
    }

    /// Produces one message; panics unless the answer is 201.
    pub fn produce(&self, topic: &str, body: &Value) -> Value {
        let (status, v) = self.post(&format!("/v1/topics/{topic}/messages"), body);
        assert_eq!(status, 201, "produce {body} -> {v}");
        v
    }

    /// Pops up to `max`, waiting up to `wait_ms`; returns the messages and the time the answer arrived.
    pub fn pop(&self, topic: &str, max: usize, wait_ms: u64, ttr_ms: Option<u64>) -> (Vec<Value>, u64) {
        let mut path = format!("/v1/topics/{topic}/pop?max={max}&wait_ms={wait_ms}");
        if let Some(t) = ttr_ms {
            path.push_str(&format!("&ttr_ms={t}"));
        }
        let (status, v) = self.post_raw(&path, None, Vec::new());
        let at = now_ms();
        assert_eq!(status, 200, "pop -> {v}");
        (v["messages"].as_array().expect("messages").clone(), at)
    }

    /// Acks a receipt, returning the status.
    pub fn ack(&self, receipt: &str) -> u16 {
        self.post("/v1/ack", &serde_json::json!({ "receipt": receipt })).0
    }

    /// Checks that an error answer has the documented shape and code.
    pub fn assert_error(status: u16, v: &Value, want_status: u16, want_code: &str) {
        assert_eq!(status, want_status, "answer {v}");
        assert_eq!(v["error"]["code"], want_code, "answer {v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(!msg.is_empty(), "error message missing in {v}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Turns a response into (status, JSON); a non-JSON body becomes `{"raw": text}` so tests can show it.
pub fn answer(r: reqwest::Result<reqwest::blocking::Response>) -> (u16, Value) {
    let r = r.expect("request failed (server down or hung?)");
    let status = r.status().as_u16();
    let text = r.text().expect("body");
    let v = serde_json::from_str(&text).unwrap_or_else(|_| serde_json::json!({ "raw": text }));
    (status, v)
}

/// Waits for a child to exit, up to `limit`.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the binary to completion with extra args and env, returning its status and stderr.
pub fn run_binary(args: &[&str], env: &[(&str, &str)], dir: &Path) -> (ExitStatus, String) {
    let log = dir.join("run.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_delayd"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("DELAYD_")) {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(File::create(&log).expect("log")))
        .spawn()
        .expect("start delayd");
    let status = wait_timeout(&mut child, NEVER_HANG).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("delayd did not exit");
    });
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}
