//! `delayd-cli` against the real `delayd` binary: every command, `--json`, auth, and the exit codes
//! (1 API error, 2 usage or input error, 3 server unreachable).

mod common;

use std::io::Write;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;

use common::{now_ms, Server, NEVER_HANG};
use serde_json::{json, Value};

/// Reservations last an hour unless a flag says otherwise, so a message that comes back within
/// a pop's 20 s wait proves the `--ttr` flag reached the server.
const ENV: [(&str, &str); 1] = [("DELAYD_DEFAULT_TTR", "1h")];

/// What one run of the CLI did.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// Panics with the run's output unless it exited 0.
    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "stdout:\n{}\nstderr:\n{}", self.stdout, self.stderr);
        self
    }

    /// Stdout parsed as one JSON document.
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.stdout))
    }
}

/// Runs `delayd-cli` with `args`, extra `env` and `stdin`, outside the developer's DELAYD_* settings.
fn cli_with(args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_delayd-cli"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("DELAYD_")) {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start delayd-cli");
    let pid = child.id();
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin).expect("write stdin");
    drop(input);
    // Collected on a thread so a hung CLI fails the test instead of hanging it.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(NEVER_HANG) {
        Ok(out) => out.expect("wait for delayd-cli"),
        Err(_) => {
            let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
            panic!("delayd-cli {args:?} did not exit within {NEVER_HANG:?}");
        }
    };
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `delayd-cli --url <server> args...`.
fn cli(s: &Server, args: &[&str]) -> Run {
    let mut all = vec!["--url", s.base.as_str()];
    all.extend_from_slice(args);
    cli_with(&all, &[], b"")
}

/// `get --json ID`, parsed.
fn get(s: &Server, id: &str) -> Value {
    cli(s, &["--json", "get", id]).ok().json()
}

/// Pops one message of `topic` with `--json`, waiting up to 20 s; returns it.
fn pop_one(s: &Server, topic: &str, extra: &[&str]) -> Value {
    let mut args = vec!["--json", "pop", topic, "--wait", "20s"];
    args.extend_from_slice(extra);
    let v = cli(s, &args).ok().json();
    let msgs = v["messages"].as_array().expect("messages");
    assert_eq!(msgs.len(), 1, "{v}");
    msgs[0].clone()
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_else(|| panic!("no string {key} in {v}"))
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no number {key} in {v}"))
}

#[test]
fn produce_sends_every_flag() {
    let s = Server::start(&ENV);

    // --id and --delay: the answer is a table with the id; the message waits an hour.
    let before = now_ms();
    let r = cli(&s, &["produce", "orders", "{\"n\":1}", "--id", "o-1", "--delay", "1h"]).ok();
    let after = now_ms();
    assert!(r.stdout.starts_with("ID  "), "{}", r.stdout);
    assert!(r.stdout.contains("DELIVER_AT") && r.stdout.contains("o-1"), "{}", r.stdout);
    let m = get(&s, "o-1");
    assert_eq!(
        (str_of(&m, "topic"), str_of(&m, "state"), str_of(&m, "body")),
        ("orders", "delayed", "{\"n\":1}")
    );
    let at = u64_of(&m, "deliver_at_ms");
    assert!(before + 3_600_000 <= at && at <= after + 3_600_000, "{before} {at} {after}");

    // The same produce again is the API's safe retry (200), which the table says.
    let r = cli(&s, &["produce", "orders", "{\"n\":1}", "--id", "o-1", "--delay", "1h"]).ok();
    assert!(r.stdout.contains("already produced"), "{}", r.stdout);

    // --at as unix ms and as an RFC 3339 time.
    let when = (now_ms() + 3_600_000).to_string();
    cli(&s, &["produce", "orders", "x", "--id", "at-ms", "--at", &when]).ok();
    assert_eq!(u64_of(&get(&s, "at-ms"), "deliver_at_ms").to_string(), when);
    let future = humantime::format_rfc3339_seconds(
        std::time::SystemTime::now() + std::time::Duration::from_secs(7 * 86_400),
    )
    .to_string();
    cli(&s, &["produce", "orders", "x", "--id", "at-rfc", "--at", &future]).ok();
    let want = humantime::parse_rfc3339(&future).expect("rfc3339");
    let want_ms = want.duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis() as u64;
    assert_eq!(u64_of(&get(&s, "at-rfc"), "deliver_at_ms"), want_ms);

    // --ttr: a 1 s reservation (the server's default is an hour) lapses within the pop's wait.
    cli(&s, &["produce", "ttr", "x", "--id", "t-1", "--ttr", "1s"]).ok();
    assert_eq!(u64_of(&pop_one(&s, "ttr", &[]), "attempt"), 1);
    assert_eq!(u64_of(&pop_one(&s, "ttr", &[]), "attempt"), 2, "the 1s ttr did not bring it back");

    // --backoff: a nack without a delay retries after the first step.
    cli(&s, &["produce", "backoff", "x", "--id", "b-1", "--backoff", "7m 9m"]).ok();
    let receipt = str_of(&pop_one(&s, "backoff", &[]), "receipt").to_string();
    let before = now_ms();
    let n = cli(&s, &["--json", "nack", &receipt]).ok().json();
    let after = now_ms();
    assert_eq!(str_of(&n, "state"), "retry", "{n}");
    let at = u64_of(&n, "deliver_at_ms");
    assert!(before + 420_000 <= at && at <= after + 420_000, "{before} {at} {after}");

    // --max-attempts 1: the first nack dead-letters it, and the sentence names the topic.
    cli(&s, &["produce", "once", "x", "--id", "m-1", "--max-attempts", "1"]).ok();
    let receipt = str_of(&pop_one(&s, "once", &[]), "receipt").to_string();
    let r = cli(&s, &["nack", &receipt]).ok();
    assert_eq!(r.stdout, "dead-lettered to once.dlq\n");
    assert_eq!(str_of(&get(&s, "m-1"), "dead_letter_topic"), "once.dlq");

    // --level, as a duration of a configured level.
    let before = now_ms();
    cli(&s, &["produce", "orders", "x", "--id", "lvl", "--level", "1m"]).ok();
    let at = u64_of(&get(&s, "lvl"), "deliver_at_ms");
    assert!(before + 60_000 <= at && at <= now_ms() + 60_000, "{at}");
}

/// `--delay` needs a unit (ouqiang's `delay` is seconds, delayd's milliseconds), `0` alone is now;
/// `--at` takes RFC 3339 offsets and fractions.
#[test]
fn delay_needs_a_unit_and_at_takes_offsets() {
    let s = Server::start(&ENV);
    for args in
        [&["produce", "units", "x", "--delay", "5"][..], &["produce", "units", "x", "--delay", "1_000"]]
    {
        let r = cli(&s, args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stdout);
        assert!(r.stderr.contains("has no unit") && r.stderr.contains("s for seconds"), "{}", r.stderr);
    }
    assert_eq!(cli(&s, &["topics"]).ok().stdout, "no topics\n", "a refused produce stored something");
    cli(&s, &["produce", "units", "now", "--id", "d0", "--delay", "0"]).ok();
    assert_eq!(str_of(&get(&s, "d0"), "state"), "ready");

    // An instant a day ahead, whole seconds, written in UTC, at +02:00 and at -05:30.
    let utc_ms = (now_ms() / 1000 + 86_400) * 1000;
    let wall = |offset_min: i64, extra_ms: u64| {
        let local = (utc_ms + extra_ms) as i64 + offset_min * 60_000;
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(local as u64);
        humantime::format_rfc3339_millis(at).to_string().trim_end_matches('Z').to_string()
    };
    let cases = [
        (format!("{}Z", wall(0, 0)), utc_ms),
        (format!("{}+02:00", wall(120, 0)), utc_ms),
        (format!("{}-05:30", wall(-330, 0)), utc_ms),
        (format!("{}+02:00", wall(120, 250)), utc_ms + 250),
    ];
    for (i, (at, want)) in cases.iter().enumerate() {
        let id = format!("at-{i}");
        cli(&s, &["produce", "units", "x", "--id", &id, "--at", at]).ok();
        assert_eq!(u64_of(&get(&s, &id), "deliver_at_ms"), *want, "--at {at}");
    }
    let r = cli(&s, &["produce", "units", "x", "--at", "2026-12-01T09:00:00+25:00"]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(r.stderr.contains("+HH:MM"), "{}", r.stderr);
}

#[test]
fn produce_reads_the_body_from_stdin_byte_for_byte() {
    let s = Server::start(&ENV);
    let url = s.base.as_str();
    let body = "line one\n\ttabbed \"quoted\" ünïcödé\n";
    let r =
        cli_with(&["--url", url, "--json", "produce", "in", "-", "--id", "stdin-1"], &[], body.as_bytes());
    assert_eq!(str_of(&r.ok().json(), "id"), "stdin-1");
    assert_eq!(str_of(&get(&s, "stdin-1"), "body"), body);

    // An empty stdin is an empty body, which the API allows.
    cli_with(&["--url", url, "produce", "in", "-", "--id", "stdin-2"], &[], b"").ok();
    assert_eq!(str_of(&get(&s, "stdin-2"), "body"), "");

    // The API carries bodies as JSON strings: bytes that are not UTF-8 are an input error.
    let r = cli_with(&["--url", url, "produce", "in", "-"], &[], &[0xff, 0xfe]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not UTF-8"), "{}", r.stderr);

    // The readable pop escapes control characters so each message keeps one row.
    let r = cli(&s, &["pop", "in"]).ok();
    assert!(r.stdout.contains("line one\\n\\ttabbed \"quoted\" ünïcödé\\n"), "{}", r.stdout);
}

#[test]
fn pop_ack_nack_get_cancel() {
    let s = Server::start(&ENV);
    for i in 1..=3 {
        cli(&s, &["produce", "jobs", &format!("body {i}"), "--id", &format!("j-{i}")]).ok();
    }

    // --max: a table with a header row and one row per message.
    let r = cli(&s, &["pop", "jobs", "--max", "2"]).ok();
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", r.stdout);
    for h in ["ID", "ATTEMPT", "RECEIPT", "BODY"] {
        assert!(lines[0].contains(h), "{}", r.stdout);
    }
    assert!(lines[1].starts_with("j-1 ") && lines[1].ends_with("body 1"), "{}", r.stdout);
    assert!(lines[2].starts_with("j-2 ") && lines[2].ends_with("body 2"), "{}", r.stdout);

    // --json with --max above what is ready: the one left.
    let v = cli(&s, &["--json", "pop", "jobs", "--max", "5"]).ok().json();
    let msgs = v["messages"].as_array().expect("messages");
    assert_eq!(msgs.len(), 1, "{v}");
    assert_eq!(str_of(&msgs[0], "id"), "j-3");
    let receipt = str_of(&msgs[0], "receipt").to_string();

    // Nothing ready and no wait: an empty answer is not an error.
    assert_eq!(cli(&s, &["pop", "jobs"]).ok().stdout, "no messages\n");

    // ack: done; a second ack of the same receipt is the API's 404, exit 1.
    assert_eq!(cli(&s, &["ack", &receipt]).ok().stdout, "acked\n");
    assert_eq!(str_of(&get(&s, "j-3"), "state"), "done");
    let r = cli(&s, &["ack", &receipt]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: not_found: "), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "{}", r.stdout);

    // --wait: a message due in a second arrives during the wait; --ttr 1s makes it come back.
    cli(&s, &["produce", "later", "soon", "--id", "w-1", "--delay", "1s"]).ok();
    let m = pop_one(&s, "later", &["--ttr", "1s"]);
    assert_eq!((str_of(&m, "id"), u64_of(&m, "attempt")), ("w-1", 1));
    let m = pop_one(&s, "later", &[]);
    assert_eq!((str_of(&m, "id"), u64_of(&m, "attempt")), ("w-1", 2), "the 1s ttr did not bring it back");

    // nack --delay: retried after that delay, not the backoff.
    let receipt = str_of(&m, "receipt").to_string();
    let before = now_ms();
    let r = cli(&s, &["nack", &receipt, "--delay", "10m"]).ok();
    let after = now_ms();
    assert!(r.stdout.starts_with("retry at 20") && r.stdout.ends_with("Z\n"), "{}", r.stdout);
    let g = get(&s, "w-1");
    assert_eq!(str_of(&g, "state"), "delayed");
    let at = u64_of(&g, "deliver_at_ms");
    assert!(before + 600_000 <= at && at <= after + 600_000, "{before} {at} {after}");

    // get, readable: one field a line.
    let r = cli(&s, &["get", "w-1"]).ok();
    for line in
        ["id          w-1", "topic       later", "state       delayed", "attempt     2", "body        soon"]
    {
        assert!(r.stdout.lines().any(|l| l == line), "{line:?} missing in\n{}", r.stdout);
    }

    // cancel: the sentence names the id, get shows it cancelled; unknown ids are exit 1.
    assert_eq!(cli(&s, &["cancel", "w-1"]).ok().stdout, "cancelled w-1\n");
    assert_eq!(str_of(&get(&s, "w-1"), "state"), "cancelled");
    let r = cli(&s, &["cancel", "nope"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: not_found: "), "{}", r.stderr);
    let r = cli(&s, &["get", "nope"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: not_found: "), "{}", r.stderr);

    // Ids with `/`, `?`, `#` and Unicode are percent-encoded into the path.
    let odd = "a/b?c#d-é";
    cli(&s, &["produce", "jobs", "x", "--id", odd, "--delay", "1h"]).ok();
    assert_eq!(str_of(&get(&s, odd), "id"), odd);
    cli(&s, &["cancel", odd]).ok();
}

#[test]
fn stats_and_json_output() {
    let s = Server::start(&ENV);
    let produced = cli(&s, &["--json", "produce", "metrics", "x", "--id", "s-1"]).ok().json();
    assert_eq!(str_of(&produced, "id"), "s-1");
    assert!(produced["deliver_at_ms"].is_u64(), "{produced}");

    cli(&s, &["produce", "metrics", "later", "--id", "s-later", "--delay", "1h"]).ok();
    let r = cli(&s, &["stats"]).ok();
    assert!(r.stdout.starts_with("LEVEL  BACKLOG  NEXT_DUE\n1s "), "{}", r.stdout);
    assert!(
        r.stdout.contains(
            "TOPIC    READY  RESERVED  DELAYED  DEAD_LETTERED\nmetrics  1      0         1        0\n"
        ),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("store        writable"), "{}", r.stdout);

    // --json prints the API's document, a single JSON value, for every command.
    let v = cli(&s, &["--json", "stats"]).ok().json();
    let topics = v["topics"].as_array().expect("topics");
    assert!(topics.iter().any(|t| t["topic"] == "metrics" && t["ready"] == 1), "{v}");
    assert!(v["levels"].as_array().is_some_and(|l| !l.is_empty()), "{v}");

    let m = pop_one(&s, "metrics", &[]);
    let nack = cli(&s, &["--json", "nack", str_of(&m, "receipt"), "--delay", "0"]).ok().json();
    assert_eq!(str_of(&nack, "state"), "retry");
    let m = pop_one(&s, "metrics", &[]);
    assert_eq!(
        cli(&s, &["--json", "ack", str_of(&m, "receipt")]).ok().json(),
        serde_json::json!({"acked": true})
    );
    assert_eq!(str_of(&get(&s, "s-1"), "state"), "done");
    cli(&s, &["produce", "metrics", "y", "--id", "s-2", "--delay", "1h"]).ok();
    let c = cli(&s, &["--json", "cancel", "s-2"]).ok().json();
    assert_eq!(c, serde_json::json!({"id": "s-2", "state": "cancelled"}));
    assert_eq!(cli(&s, &["--json", "pop", "metrics"]).ok().json(), serde_json::json!({"messages": []}));
}

#[test]
fn auth_token_from_flag_or_environment() {
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", "s3cret")]);
    let url = s.base.as_str();

    let r = cli(&s, &["stats"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: unauthorized: missing or wrong bearer token"), "{}", r.stderr);
    let r = cli(&s, &["--token", "wrong", "produce", "a", "x"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: unauthorized: "), "{}", r.stderr);

    cli(&s, &["--token", "s3cret", "produce", "a", "x", "--id", "tok-1"]).ok();
    // The flag may come after the command too (it is global).
    cli(&s, &["get", "tok-1", "--token", "s3cret"]).ok();
    // DELAYD_AUTH_TOKEN, the server's own variable, and DELAYD_URL instead of --url.
    let env = [("DELAYD_AUTH_TOKEN", "s3cret"), ("DELAYD_URL", url)];
    let r = cli_with(&["--json", "get", "tok-1"], &env, b"").ok();
    assert_eq!(str_of(&r.json(), "id"), "tok-1");
    // The flag wins over the variable.
    let r = cli_with(&["--token", "wrong", "get", "tok-1"], &env, b"");
    assert_eq!(r.code, 1, "{}", r.stdout);

    // --help names the variable but never prints the secret in it.
    let r = cli_with(&["--help"], &env, b"").ok();
    assert!(r.stdout.contains("DELAYD_AUTH_TOKEN") && !r.stdout.contains("s3cret"), "{}", r.stdout);
}

#[test]
fn api_errors_exit_1_with_code_and_message() {
    let s = Server::start(&ENV);
    let r = cli(&s, &["produce", "orders", "x", "--max-attempts", "0"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "error: invalid_argument: invalid max_attempts: must be at least 1\n");
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    // Any name is a topic (a compat one may hold spaces); one too long to store is not.
    let too_long = "t".repeat(129);
    let r = cli(&s, &["produce", &too_long, "x"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: invalid_argument: "), "{}", r.stderr);
    cli(&s, &["produce", "orders", "x", "--id", "dup"]).ok();
    let r = cli(&s, &["--json", "produce", "orders", "other", "--id", "dup"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: conflict: "), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "--json prints nothing on stdout for a failure: {}", r.stdout);
}

#[test]
fn usage_errors_exit_2() {
    // None of these reaches a server: the URL points nowhere on purpose.
    let nowhere = "http://127.0.0.1:9";
    let cases: &[&[&str]] = &[
        &[],
        &["frobnicate"],
        &["produce", "orders"],
        &["produce", "orders", "x", "--delay", "soon"],
        &["produce", "orders", "x", "--delay", "5"],
        &["nack", "r", "--delay", "30"],
        &["purge", "orders"],
        &["produce", "orders", "x", "--delay", "1s", "--at", "5"],
        &["produce", "orders", "x", "--at", "next tuesday"],
        &["produce", "orders", "x", "--backoff", "1m never"],
        &["produce", "orders", "x", "--max-attempts", "-1"],
        &["pop", "orders", "--wait", "1fortnight"],
        &["nack", "r", "--delay", "x"],
        &["get", ".."],
        &["cancel", ""],
        &["--url", "ftp://example.com", "stats"],
        &["--url", "not a url", "stats"],
    ];
    for args in cases {
        let mut all = vec!["--url", nowhere];
        all.extend_from_slice(args);
        let r = cli_with(&all, &[], b"");
        assert_eq!(r.code, 2, "{args:?}: stdout {:?} stderr {:?}", r.stdout, r.stderr);
        assert!(r.stderr.contains("error") || r.stderr.contains("Usage"), "{args:?}: {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{args:?}: {}", r.stderr);
    }
}

#[test]
fn unreachable_server_exits_3_naming_the_url() {
    // A port that was free a moment ago and has no listener now.
    let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let url = format!("http://127.0.0.1:{port}");
    for args in [&["stats"][..], &["produce", "t", "x"], &["pop", "t", "--wait", "1s"]] {
        let mut all = vec!["--url", url.as_str()];
        all.extend_from_slice(args);
        let r = cli_with(&all, &[], b"");
        assert_eq!(r.code, 3, "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with(&format!("error: cannot reach delayd at {url}: ")), "{}", r.stderr);
        assert!(r.stdout.is_empty());
    }
}

/// `topics`, `pause` and `resume` against the real server: tables, `--json`, and the pause taking
/// effect.
#[test]
fn topics_pause_and_resume() {
    let s = Server::start(&ENV);
    assert_eq!(cli(&s, &["topics"]).stdout, "no topics\n");
    cli(&s, &["produce", "orders", "now"]);
    cli(&s, &["produce", "orders", "later", "--delay", "1h"]);
    let r = cli(&s, &["pause", "orders"]);
    assert_eq!((r.code, r.stdout.as_str()), (0, "paused\n"), "{}", r.stderr);
    let r = cli(&s, &["topics"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut lines = r.stdout.lines();
    let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(head, ["TOPIC", "READY", "RESERVED", "DELAYED", "DEAD_LETTERED", "PAUSED"]);
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(row, ["orders", "1", "0", "1", "0", "true"], "{}", r.stdout);
    let r = cli(&s, &["pop", "orders", "--wait", "200ms"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, "no messages\n", "a paused topic delivered");
    let paused = "note: topic orders is paused: pops find nothing until `delayd-cli resume orders`\n";
    assert_eq!(r.stderr, paused);
    // --json: stdout stays the API's document; the note goes to stderr all the same.
    let r = cli(&s, &["--json", "pop", "orders"]).ok();
    assert_eq!((r.json(), r.stderr.as_str()), (json!({"messages": []}), paused));
    // An empty topic that is not paused gets no note.
    let r = cli(&s, &["pop", "idle"]).ok();
    assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("no messages\n", ""));
    let r = cli(&s, &["--json", "resume", "orders"]);
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v, json!({"topic": "orders", "paused": false}));
    let v: Value = serde_json::from_str(&cli(&s, &["--json", "topics"]).stdout).unwrap();
    assert_eq!(v["topics"][0]["paused"], false);
    assert_eq!(pop_one(&s, "orders", &[])["body"], "now");
    let r = cli(&s, &["pause", &"n".repeat(129)]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: invalid_argument: "), "{}", r.stderr);
}

/// `flow`: set, show, replace and clear a topic's flow control; bad values are usage errors.
#[test]
fn flow_shows_sets_and_clears() {
    let s = Server::start(&ENV);
    let r = cli(&s, &["flow", "orders"]);
    assert_eq!(r.code, 1, "none set yet: {}", r.stdout);
    assert!(r.stderr.starts_with("error: not_found: "), "{}", r.stderr);
    let r = cli(&s, &["flow", "orders", "--max-per-second", "50", "--max-reserved", "8"]).ok();
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines[..4],
        ["flow control of orders", "  max_per_second 50", "  burst          50", "  max_reserved   8"]
    );
    assert!(lines[4].starts_with("  updated        20"), "{}", r.stdout);
    let v = cli(&s, &["--json", "flow", "orders"]).ok().json();
    assert_eq!(
        (v["max_per_second"].clone(), v["burst"].clone(), v["max_reserved"].clone()),
        (json!(50), json!(50), json!(8))
    );
    // Setting replaces the whole of it: a limit left out is none.
    let v = cli(&s, &["--json", "flow", "orders", "--max-per-second", "5", "--burst", "1"]).ok().json();
    assert_eq!((v["burst"].clone(), v.get("max_reserved")), (json!(1), None), "{v}");
    let r = cli(&s, &["flow", "orders"]).ok();
    assert!(r.stdout.contains("  max_reserved   none\n"), "{}", r.stdout);
    assert_eq!(cli(&s, &["topics", "--json"]).ok().json()["topics"][0]["flow"]["max_per_second"], 5);
    assert_eq!(cli(&s, &["flow", "orders", "--clear"]).ok().stdout, "flow control of orders removed\n");
    assert_eq!(cli(&s, &["flow", "orders"]).code, 1);
    for bad in [
        &["flow", "orders", "--max-per-second", "0"][..],
        &["flow", "orders", "--max-per-second", "1000001"],
        &["flow", "orders", "--burst", "5"],
        &["flow", "orders", "--clear", "--max-reserved", "1"],
    ] {
        assert_eq!(cli(&s, bad).code, 2, "{bad:?}");
    }
}

/// `browse`, `redrive` and `purge` against the real server.
#[test]
fn browse_redrive_purge() {
    let s = Server::start(&ENV);
    for i in 0..3 {
        cli(&s, &["produce", "jobs", &format!("body {i}"), "--id", &format!("j{i}"), "--max-attempts", "1"]);
    }
    cli(&s, &["produce", "jobs", "later", "--id", "later", "--delay", "1h"]);
    // Dead-letter two of them.
    for _ in 0..2 {
        let d = pop_one(&s, "jobs", &[]);
        let r = cli(&s, &["nack", str_of(&d, "receipt")]);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    let r = cli(&s, &["browse", "jobs", "--state", "delayed"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let rows: Vec<Vec<&str>> = r.stdout.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0], ["ID", "STATE", "DELIVER_AT", "ATTEMPT", "BODY"]);
    assert_eq!((rows[1][0], rows[1][1], rows[1][3], rows[1][4]), ("later", "delayed", "0", "later"));
    assert_eq!(rows.len(), 2, "{}", r.stdout);
    // Paging: one per page, following the cursor the table prints.
    let r = cli(&s, &["browse", "jobs", "--state", "dead", "--limit", "1"]);
    let more =
        r.stdout.lines().find_map(|l| l.strip_prefix("more: --cursor ")).expect("a next page").to_string();
    let r2 = cli(&s, &["--json", "browse", "jobs", "--state", "dead", "--limit", "1", "--cursor", &more]);
    let v: Value = serde_json::from_str(&r2.stdout).unwrap();
    assert_eq!(v["messages"].as_array().unwrap().len(), 1, "{v}");
    assert!(!r.stdout.contains(v["messages"][0]["id"].as_str().unwrap()), "page 2 repeats page 1");
    let r = cli(&s, &["browse", "jobs", "--cursor", "bogus"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: invalid_argument: invalid cursor"), "{}", r.stderr);

    let r = cli(&s, &["redrive", "jobs", "--id", "j0", "--id", "nope"]);
    assert_eq!((r.code, r.stdout.as_str()), (0, "moved 1\n"), "{}", r.stderr);
    // The dead-letter topic's name, as `topics` shows it, means the topic it belongs to.
    let r = cli(&s, &["--json", "redrive", "jobs.dlq"]);
    assert_eq!(serde_json::from_str::<Value>(&r.stdout).unwrap(), json!({"moved": 1}), "{}", r.stderr);
    assert_eq!(r.stderr, "note: jobs.dlq holds the dead letters of jobs: moving them back to jobs\n");
    assert_eq!(str_of(&get(&s, "j1"), "state"), "ready");
    assert_eq!(cli(&s, &["redrive", "empty"]).stdout, "moved 0\n");

    // purge asks for --yes; without it nothing is cancelled.
    let r = cli(&s, &["purge", "jobs"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("add --yes") && r.stdout.is_empty(), "{}", r.stderr);
    assert_eq!(str_of(&get(&s, "later"), "state"), "delayed");
    // A topic that does not exist is an error, not "cancelled 0".
    let r = cli(&s, &["purge", "jbos", "--yes"]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.stderr.starts_with("error: no topic \"jbos\"") && r.stdout.is_empty(), "{}", r.stderr);
    let r = cli(&s, &["purge", "jobs", "--yes"]);
    assert_eq!((r.code, r.stdout.as_str()), (0, "cancelled 4\n"), "{}", r.stderr);
    assert_eq!(str_of(&get(&s, "later"), "state"), "cancelled");
}

/// A topic made through the compat API with an ouqiang-style name, under that name in every command.
#[test]
fn compat_topic_names_work_in_every_topic_command() {
    let s = Server::start(&ENV);
    for (id, delay) in [("c-now", 0), ("c-later", 3600)] {
        let job = json!({"topic": "order:close", "id": id, "delay": delay, "ttr": 60, "body": id});
        let (st, v) = s.post("/push", &job);
        assert_eq!((st, &v["code"]), (200, &json!(0)), "{v}");
    }
    let r = cli(&s, &["topics"]).ok();
    let row: Vec<&str> = r.stdout.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row, ["order:close", "1", "0", "1", "0", "false"], "{}", r.stdout);
    let r = cli(&s, &["stats"]).ok();
    assert!(r.stdout.lines().any(|l| l.starts_with("order:close ")), "{}", r.stdout);
    let r = cli(&s, &["browse", "order:close", "--state", "delayed"]).ok();
    assert!(r.stdout.lines().nth(1).is_some_and(|l| l.starts_with("c-later ")), "{}", r.stdout);

    assert_eq!(cli(&s, &["pause", "order:close"]).ok().stdout, "paused\n");
    assert_eq!(cli(&s, &["--json", "topics"]).json()["topics"][0]["paused"], true);
    assert_eq!(cli(&s, &["resume", "order:close"]).ok().stdout, "resumed\n");

    // Dead-letter one through the CLI, then redrive it by either name.
    cli(&s, &["produce", "order:close", "x", "--id", "n1", "--max-attempts", "1"]).ok();
    let popped = pop_one(&s, "order:close", &[]);
    assert_eq!(str_of(&popped, "id"), "c-now");
    let popped = pop_one(&s, "order:close", &[]);
    assert_eq!(
        cli(&s, &["nack", str_of(&popped, "receipt")]).ok().stdout,
        "dead-lettered to order:close.dlq\n"
    );
    assert_eq!(cli(&s, &["redrive", "order:close.dlq"]).ok().stdout, "moved 1\n");
    assert_eq!(str_of(&get(&s, "n1"), "state"), "ready");

    let r = cli(&s, &["purge", "order:close", "--yes"]).ok();
    assert_eq!(r.stdout, "cancelled 3\n", "c-now (reserved), c-later, n1");
    assert_eq!(str_of(&get(&s, "c-later"), "state"), "cancelled");
}

// ---- following the cluster's leader, against canned servers (no delayd) ----

/// One request as a canned server read it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// What a canned server answers to its `n`th request (from 0).
type Reply = dyn Fn(&Seen, usize) -> String + Send + Sync;

/// A tiny HTTP/1.1 server on 127.0.0.1: one request per connection, each answered by `reply`;
/// it records what it was sent and stops when dropped.
struct Canned {
    url: String,
    addr: std::net::SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Canned {
    fn start(reply: impl Fn(&Seen, usize) -> String + Send + Sync + 'static) -> Canned {
        use std::sync::{atomic::AtomicBool, Arc, Mutex};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let reply: Box<Reply> = Box::new(reply);
        let (seen2, stop2) = (Arc::clone(&seen), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                let Some(req) = read_request(&mut conn) else { continue };
                let n = {
                    let mut all = seen2.lock().expect("seen");
                    all.push(req.clone());
                    all.len() - 1
                };
                let _ = conn.write_all(reply(&req, n).as_bytes());
            }
        });
        Canned { url: format!("http://{addr}"), addr, seen, stop, thread: Some(thread) }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

impl Drop for Canned {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = std::net::TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request (head and a Content-Length body); None for a connection that sent none.
fn read_request(conn: &mut std::net::TcpStream) -> Option<Seen> {
    use std::io::Read;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5))).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, target) = (first.next()?.to_string(), first.next()?.to_string());
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize =
        headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Seen { method, target, headers, body })
}

/// A whole answer that closes its connection, so each request of the CLI is a new one.
fn http(status: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut out = format!("HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    out
}

/// delayd's answer to a write while the cluster has no leader.
fn no_leader(retry_after: &str) -> String {
    let body = r#"{"error":{"code":"no_leader","message":"no leader is known; retry shortly"}}"#;
    http(
        "503 Service Unavailable",
        &[("retry-after", retry_after), ("content-type", "application/json")],
        body,
    )
}

fn produced(id: &str) -> String {
    let body = json!({"id": id, "deliver_at_ms": 1_796_115_600_000u64}).to_string();
    http("201 Created", &[("content-type", "application/json")], &body)
}

/// A follower's 307 (then 308) sends the produce to the leader: the same method, path, body and
/// bearer token arrive there, and nothing extra is printed unless `-v` asks.
#[test]
fn redirects_to_the_leader_are_followed_with_body_and_token() {
    let leader = Canned::start(|_, _| produced("r-1"));
    let leader_url = leader.url.clone();
    let follower = Canned::start(move |req, n| {
        let status = if n == 0 { "307 Temporary Redirect" } else { "308 Permanent Redirect" };
        let location = format!("{leader_url}{}", req.target);
        http(status, &[("location", &location)], "")
    });
    let args = ["--url", &follower.url, "--token", "s3cret", "produce", "orders", "hello", "--id", "r-1"];
    let r = cli_with(&args, &[], b"").ok();
    assert!(r.stdout.starts_with("ID   DELIVER_AT\nr-1  2026-12-01T09:00:00.000Z"), "{}", r.stdout);
    assert_eq!(r.stderr, "", "a followed redirect prints nothing extra");

    let mut verbose = args.to_vec();
    verbose.insert(0, "-v");
    let r = cli_with(&verbose, &[], b"").ok();
    assert!(
        r.stderr.contains(&format!("308 from {}: following to {}", follower.url, leader.url)),
        "{}",
        r.stderr
    );

    let (at_follower, at_leader) = (follower.seen(), leader.seen());
    assert_eq!((at_follower.len(), at_leader.len()), (2, 2));
    for (f, l) in at_follower.iter().zip(&at_leader) {
        assert_eq!((l.method.as_str(), l.target.as_str()), ("POST", "/v1/topics/orders/messages"));
        assert_eq!(l.header("authorization"), Some("Bearer s3cret"));
        assert_eq!(l.header("content-type"), Some("application/json"));
        assert_eq!(l.body, f.body, "the leader got another body than the follower");
        let body: Value = serde_json::from_slice(&l.body).expect("JSON body");
        assert_eq!(body, json!({"body": "hello", "id": "r-1"}));
    }
}

/// Nodes that keep redirecting (to themselves here) are given up on after five hops, exit 1.
#[test]
fn a_redirect_loop_stops_after_five_hops() {
    let lost = Canned::start(|req, _| {
        let location = req.target.clone();
        http("307 Temporary Redirect", &[("location", &location)], "")
    });
    let r = cli_with(&["--url", &lost.url, "cancel", "x"], &[], b"");
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.starts_with("error: more than 5 redirects"), "{}", r.stderr);
    assert_eq!(lost.seen().len(), 6, "the request and five redirects");
    assert!(lost.seen().iter().all(|s| s.method == "DELETE" && s.target == "/v1/messages/x"));
}

/// A leader that cannot be reached after a redirect is exit 3, as an unreachable server is,
/// and the message names both nodes.
#[test]
fn a_redirect_to_a_dead_leader_exits_3() {
    let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let dead = format!("http://127.0.0.1:{port}");
    let target = dead.clone();
    let follower = Canned::start(move |req, _| {
        let location = format!("{target}{}", req.target);
        http("307 Temporary Redirect", &[("location", &location)], "")
    });
    let r = cli_with(&["--url", &follower.url, "produce", "t", "x"], &[], b"");
    assert_eq!(r.code, 3, "{}", r.stderr);
    let want = format!("error: cannot reach delayd at {dead} (redirected there by {}): ", follower.url);
    assert!(r.stderr.starts_with(&want), "{}", r.stderr);
}

/// `503 no_leader` is waited out: Retry-After is obeyed but capped at 2 s, and the request
/// succeeds once a leader answers.
#[test]
fn no_leader_is_retried_until_one_answers() {
    let node = Canned::start(|_, n| match n {
        0 => no_leader("30"),
        1 => no_leader("1"),
        _ => produced("nl-1"),
    });
    let started = std::time::Instant::now();
    let r = cli_with(&["--url", &node.url, "--json", "produce", "t", "x", "--id", "nl-1"], &[], b"").ok();
    let took = started.elapsed();
    assert_eq!(str_of(&r.json(), "id"), "nl-1");
    assert_eq!(r.stderr, "");
    assert_eq!(node.seen().len(), 3);
    // 2 s (30 capped) + 1 s, and far less than the 30 s asked.
    assert!(took >= std::time::Duration::from_millis(2_900), "{took:?}");
    assert!(took < std::time::Duration::from_secs(8), "{took:?}");
    let bodies: Vec<Vec<u8>> = node.seen().into_iter().map(|s| s.body).collect();
    assert!(bodies.iter().all(|b| *b == bodies[0]), "every retry sends the same body");
}

/// A cluster that stays without a leader fails the command after about 10 s, exit 1.
#[test]
fn no_leader_for_good_fails_after_ten_seconds() {
    let node = Canned::start(|_, _| no_leader("1"));
    let started = std::time::Instant::now();
    let r = cli_with(&["--url", &node.url, "produce", "t", "x"], &[], b"");
    let took = started.elapsed();
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("error: no leader: the cluster is electing one or has lost its majority"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    assert!(took >= std::time::Duration::from_millis(9_900), "{took:?}");
    assert!(took <= std::time::Duration::from_secs(12), "{took:?}");
    // One a second, give or take: retried, but not hammered.
    let asked = node.seen().len();
    assert!((9..=13).contains(&asked), "{asked} requests");
}

/// `cluster status` against a canned `/v1/cluster` of three nodes: the leader line and the table,
/// with this node starred and absent fields as `-`; `--json` prints the document.
#[test]
fn cluster_status_renders_the_nodes() {
    let doc = json!({
        "node_id": 2, "role": "follower", "term": 7, "leader_id": 1,
        "leader_url": "http://10.0.0.1:9277",
        "nodes": [
            {"node_id": 1, "api_url": "http://10.0.0.1:9277", "cluster_addr": "10.0.0.1:9300"},
            {"node_id": 2, "api_url": "http://10.0.0.2:9277", "cluster_addr": "10.0.0.2:9300",
             "match_index": 1042, "lag_entries": 0, "last_contact_ms": 12},
            {"node_id": 3, "api_url": "http://10.0.0.3:9277", "cluster_addr": "10.0.0.3:9300",
             "match_index": 998, "lag_entries": 44},
        ],
    });
    let text = doc.to_string();
    let node = Canned::start(move |_, _| http("200 OK", &[("content-type", "application/json")], &text));
    let r = cli_with(&["--url", &node.url, "cluster", "status"], &[], b"").ok();
    assert_eq!(
        r.stdout,
        "leader: 1 http://10.0.0.1:9277  term: 7\n\
         NODE  ROLE       API_URL               CLUSTER_ADDR   MATCH_INDEX  LAG_ENTRIES  LAST_CONTACT_MS\n\
         1     leader     http://10.0.0.1:9277  10.0.0.1:9300  -            -            -\n\
         2     follower*  http://10.0.0.2:9277  10.0.0.2:9300  1042         0            12\n\
         3     -          http://10.0.0.3:9277  10.0.0.3:9300  998          44           -\n"
    );
    assert_eq!(node.seen()[0].target, "/v1/cluster");
    assert_eq!(node.seen()[0].method, "GET");
    assert_eq!(cli_with(&["--url", &node.url, "--json", "cluster", "status"], &[], b"").ok().json(), doc);
}

/// A cluster without a leader, and a single node: "leader: none", and no replication columns.
#[test]
fn cluster_status_without_a_leader() {
    let doc = json!({
        "node_id": 3, "role": "candidate", "term": 9, "leader_id": null, "leader_url": null,
        "nodes": [{"node_id": 3, "api_url": "http://127.0.0.1:9277", "cluster_addr": "127.0.0.1:9300"}],
    });
    let text = doc.to_string();
    let node = Canned::start(move |_, _| http("200 OK", &[], &text));
    let r = cli_with(&["--url", &node.url, "cluster", "status"], &[], b"").ok();
    assert_eq!(
        r.stdout,
        "leader: none  term: 9\n\
         NODE  ROLE        API_URL                CLUSTER_ADDR\n\
         3     candidate*  http://127.0.0.1:9277  127.0.0.1:9300\n"
    );
}

#[test]
fn reschedule_takes_a_delay_or_a_time_and_says_where_it_went() {
    let s = Server::start(&ENV);
    cli(&s, &["produce", "rs", "x", "--id", "r-1", "--delay", "1h"]).ok();
    // A bare number has no unit, as for produce; one of --delay and --at is required.
    for args in [&["reschedule", "r-1", "--delay", "5"][..], &["reschedule", "r-1"]] {
        assert_eq!(cli(&s, args).code, 2, "{args:?}");
    }
    let before = now_ms();
    let out = cli(&s, &["reschedule", "r-1", "--delay", "2h"]).ok().stdout;
    assert!(out.contains("r-1") && out.contains("delayed"), "{out}");
    let due = u64_of(&get(&s, "r-1"), "deliver_at_ms");
    assert!(due >= before + 7_200_000 && due <= now_ms() + 7_200_001, "{due}");

    let at = (now_ms() / 1000 + 3_600) * 1000;
    let local = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at + 2 * 3_600_000);
    let text = humantime::format_rfc3339_seconds(local).to_string().replace('Z', "+02:00");
    let v = cli(&s, &["--json", "reschedule", "r-1", "--at", &text, "--ttr", "30s", "--max-attempts", "3"])
        .ok()
        .json();
    assert_eq!((str_of(&v, "state"), u64_of(&v, "deliver_at_ms")), ("delayed", at), "{v}");

    let v = cli(&s, &["--json", "reschedule", "r-1", "--delay", "0"]).ok().json();
    assert_eq!(str_of(&v, "state"), "ready");
    let m = pop_one(&s, "rs", &[]);
    assert_eq!(str_of(&m, "id"), "r-1");
    let r = cli(&s, &["reschedule", "r-1", "--delay", "1m"]);
    assert_eq!(r.code, 1, "reserved without --force: {}", r.stdout);
    assert!(r.stderr.contains("conflict"), "{}", r.stderr);
    cli(&s, &["reschedule", "r-1", "--delay", "1m", "--force"]).ok();
    assert_eq!(cli(&s, &["reschedule", "nope", "--delay", "1m"]).code, 1);
}

#[test]
fn touch_extends_a_reservation_and_keeps_the_receipt() {
    let s = Server::start(&ENV);
    cli(&s, &["produce", "tc", "x", "--id", "t-1"]).ok();
    let m = pop_one(&s, "tc", &["--ttr", "5s"]);
    let receipt = str_of(&m, "receipt");
    let before = now_ms();
    let out = cli(&s, &["touch", receipt, "--ttr", "1h"]).ok().stdout;
    assert!(out.starts_with("reserved until 20"), "{out}");
    let v = cli(&s, &["--json", "touch", receipt, "--ttr", "2h"]).ok().json();
    assert!(u64_of(&v, "expires_at_ms") >= before + 7_200_000, "{v}");
    assert_eq!(u64_of(&get(&s, "t-1"), "deliver_at_ms"), u64_of(&v, "expires_at_ms"));
    assert_eq!(cli(&s, &["touch", receipt]).code, 2, "--ttr is required");
    cli(&s, &["ack", receipt]).ok();
    let r = cli(&s, &["touch", receipt, "--ttr", "1m"]);
    assert_eq!(r.code, 1, "an acked delivery's receipt: {}", r.stdout);
    assert!(r.stderr.contains("not_found"), "{}", r.stderr);
}

#[test]
fn nack_takes_an_error_and_get_shows_it() {
    let s = Server::start(&ENV);
    cli(&s, &["produce", "ne", "x", "--id", "n-1"]).ok();
    let before = cli(&s, &["get", "n-1"]).ok().stdout;
    assert!(!before.contains("last_error"), "{before}");
    let m = pop_one(&s, "ne", &[]);
    let receipt = str_of(&m, "receipt");
    cli(&s, &["nack", receipt, "--delay", "1h", "--error", "KeyError: 'sku'\nin handle"]).ok();
    let out = cli(&s, &["get", "n-1"]).ok().stdout;
    assert!(
        out.lines().any(|l| l.starts_with("last_error ") && l.ends_with(r"KeyError: 'sku'\nin handle")),
        "a newline shows escaped: {out}"
    );
    assert!(out.lines().any(|l| l.starts_with("last_error_at ") && l.ends_with("(attempt 1)")), "{out}");
}
