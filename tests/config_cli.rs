//! The configuration as a user meets it, against the real binary: `--help`, refused settings (exit
//! code 2 and a message naming what is wrong), and units that mean what they say.

mod common;

use std::process::Command;

use common::{run_binary, Server};
use delayd::config::{env_var, flag, Config, KEYS};
use serde_json::json;

/// Runs the binary with `--help` and no DELAYD_* variables of the caller's; returns stdout.
fn help() -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_delayd"));
    for (k, _) in std::env::vars_os().filter(|(k, _)| k.as_encoded_bytes().starts_with(b"DELAYD_")) {
        cmd.env_remove(k);
    }
    let out = cmd.arg("--help").output().expect("run delayd --help");
    assert!(out.status.success(), "--help failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// Runs the binary expecting it to refuse the configuration: exit code 2, and `needles` in stderr.
fn refused(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut all = vec!["--data-dir", data.to_str().unwrap(), "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let (status, log) = run_binary(&all, env, tmp.path());
    assert_eq!(status.code(), Some(2), "{args:?} {env:?} should be refused: {log}");
    for needle in needles {
        assert!(log.contains(needle), "{args:?} {env:?}: the message should say {needle:?}: {log}");
    }
    assert!(!log.contains("panicked"), "{log}");
    assert!(!data.exists(), "a refused configuration must not touch the data directory");
}

#[test]
fn help_lists_every_key_with_its_variable_and_default() {
    let help = help();
    let defaults = Config::default();
    for key in KEYS {
        let line = help.lines().find(|l| l.contains(&format!("{} <", flag(key)))).unwrap_or_else(|| {
            panic!("no line for {} in --help:\n{help}", flag(key));
        });
        assert!(line.contains(&format!("[env: {}", env_var(key))), "{key}: {line}");
        if let Some(d) = defaults.get(key) {
            assert!(
                line.contains(&format!("[default: {d}]")) || line.contains(&format!("[default: {d:?}]")),
                "{line}"
            );
        }
    }
    assert!(help.contains("--config <FILE>"), "{help}");
}

#[test]
fn a_misspelt_environment_variable_is_refused_with_a_hint() {
    refused(
        &[],
        &[("DELAYD_FLUSHH", "async")],
        &["unknown environment variable DELAYD_FLUSHH", "did you mean DELAYD_FLUSH?"],
    );
    refused(&[], &[("DELAYD_MAX_BACH", "5")], &["DELAYD_MAX_BACH", "did you mean DELAYD_MAX_BATCH?"]);
}

#[test]
fn other_programs_variables_are_ignored_and_delayd_config_names_the_file() {
    // A script's DELAYD_BIN, delayd-cli's DELAYD_URL and a tool's DELAYD_BENCH_FONT must not stop
    // the server; DELAYD_CONFIG is the config file's path.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(&file, "max_delay = \"3h\"\n").unwrap();
    let s = Server::start(&[
        ("DELAYD_BIN", "/usr/local/bin/delayd"),
        ("DELAYD_URL", "http://127.0.0.1:9277"),
        ("DELAYD_BENCH_FONT", "none"),
        ("DELAYD_CONFIG", file.to_str().unwrap()),
    ]);
    let p = "/v1/topics/u/messages";
    assert_eq!(s.post(p, &json!({ "body": "b", "delay_ms": 10_800_000 })).0, 201);
    assert_eq!(
        s.post(p, &json!({ "body": "b", "delay_ms": 10_800_001 })).0,
        400,
        "the file's max_delay holds"
    );
    let log = s.log();
    for name in ["DELAYD_BIN", "DELAYD_BENCH_FONT"] {
        let line =
            log.lines().find(|l| l.contains(name)).unwrap_or_else(|| panic!("no warning for {name}: {log}"));
        assert!(line.contains("WARN") && line.contains("ignoring environment variable"), "{line}");
    }
    assert!(!log.contains("DELAYD_URL"), "delayd-cli's own variable is not worth a warning: {log}");
}

#[test]
fn an_empty_auth_token_is_refused_from_env_file_and_flag() {
    refused(&[], &[("DELAYD_AUTH_TOKEN", "")], &["DELAYD_AUTH_TOKEN", "must not be empty"]);
    refused(&["--auth-token", ""], &[], &["--auth-token", "must not be empty"]);
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(&file, "auth_token = \"\"\n").unwrap();
    refused(&["--config", file.to_str().unwrap()], &[], &["auth_token", "must not be empty"]);
}

#[test]
fn bad_durations_and_sizes_are_refused_naming_the_key_and_the_value() {
    refused(
        &[],
        &[("DELAYD_MAX_DELAY", "1fortnight")],
        &["DELAYD_MAX_DELAY", "\"1fortnight\" is not a duration"],
    );
    refused(&["--shutdown-grace", "soon"], &[], &["--shutdown-grace", "\"soon\" is not a duration"]);
    refused(&[], &[("DELAYD_LEVELS", "1s 5x")], &["DELAYD_LEVELS", "\"5x\" is not a duration"]);
    refused(
        &[],
        &[("DELAYD_SEGMENT_BYTES", "4 parsecs")],
        &["DELAYD_SEGMENT_BYTES", "\"4 parsecs\" is not a size"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(&file, "max_delay = \"2d\"\ndefault_ttr = \"-5s\"\n").unwrap();
    refused(&["--config", file.to_str().unwrap()], &[], &["line 2", "default_ttr", "\"-5s\""]);
}

#[test]
fn connection_limits_are_refused_when_zero_or_malformed() {
    refused(&[], &[("DELAYD_MAX_CONNECTIONS", "0")], &["max_connections", "outside 1..=1000000"]);
    refused(&["--max-connections", "many"], &[], &["--max-connections", "\"many\""]);
    refused(&["--http-header-timeout", "0"], &[], &["http_header_timeout", "outside 1ms..=1d"]);
    refused(
        &[],
        &[("DELAYD_HTTP_IDLE_TIMEOUT", "soon")],
        &["DELAYD_HTTP_IDLE_TIMEOUT", "\"soon\" is not a duration"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(&file, "http_body_timeout = \"2d\"\n").unwrap();
    refused(&["--config", file.to_str().unwrap()], &[], &["http_body_timeout", "outside 1ms..=1d"]);
    refused(&[], &[("DELAYD_HTTP_HEADER_TIMEOUTT", "1s")], &["did you mean DELAYD_HTTP_HEADER_TIMEOUT?"]);
}

#[test]
fn decimal_and_binary_units_mean_what_they_say() {
    // 10KB is 10,000 bytes; 2h30m is 9,000,000 ms.
    let s = Server::start(&[("DELAYD_MAX_BODY_BYTES", "10KB"), ("DELAYD_MAX_DELAY", "2h30m")]);
    let p = "/v1/topics/u/messages";
    assert_eq!(s.post(p, &json!({ "body": "x".repeat(10_000) })).0, 201);
    let (st, v) = s.post(p, &json!({ "body": "x".repeat(10_001) }));
    Server::assert_error(st, &v, 413, "too_large");
    assert_eq!(s.post(p, &json!({ "body": "b", "delay_ms": 9_000_000 })).0, 201);
    assert_eq!(s.post(p, &json!({ "body": "b", "delay_ms": 9_000_001 })).0, 400);
    drop(s);
    // 10KiB is 10,240 bytes, and the flag beats the environment.
    let s = Server::start_with_args(&[("DELAYD_MAX_BODY_BYTES", "10KB")], &["--max-body-bytes", "10KiB"]);
    assert_eq!(s.post(p, &json!({ "body": "x".repeat(10_240) })).0, 201);
    let (st, v) = s.post(p, &json!({ "body": "x".repeat(10_241) }));
    Server::assert_error(st, &v, 413, "too_large");
}

#[test]
fn the_configuration_page_lists_every_key_with_its_variable() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md"))
        .expect("read docs/configuration.md");
    for key in KEYS {
        let row = format!("| `{key}` | `{}` |", env_var(key));
        assert!(page.contains(&row), "docs/configuration.md has no row {row}");
    }
}

#[test]
fn a_value_means_the_same_in_the_file_as_in_the_environment() {
    // Written as the environment writes them: a count as a string, a name in capitals, a boolean
    // as a word. Each is read by the key's one parser, whichever source gives it.
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("delayd.toml");
    std::fs::write(
        &file,
        "max_batch = \"2\"\nflush = \"ASYNC\"\nreclaim = \"on\"\nmax_delay = 10800000\ndelay_policy = \"Chain\"\n",
    )
    .unwrap();
    let s = Server::start(&[("DELAYD_CONFIG", file.to_str().unwrap())]);
    let batch = |n: usize| json!({ "messages": vec![json!({ "body": "b" }); n] });
    assert_eq!(s.post("/v1/topics/u/messages/batch", &batch(2)).0, 201);
    let (st, v) = s.post("/v1/topics/u/messages/batch", &batch(3));
    Server::assert_error(st, &v, 413, "too_large");
    let p = "/v1/topics/u/messages";
    assert_eq!(s.post(p, &json!({ "body": "b", "delay_ms": 10_800_000 })).0, 201);
    assert_eq!(s.post(p, &json!({ "body": "b", "delay_ms": 10_800_001 })).0, 400);
    drop(s);
    // A bad value is told the same way in all three places: the key (or where it was written),
    // the value, and what is wrong.
    let why = "\"many\" is not a non-negative integer";
    refused(&[], &[("DELAYD_MAX_BATCH", "many")], &["DELAYD_MAX_BATCH", why]);
    refused(&["--max-batch", "many"], &[], &["--max-batch", why]);
    std::fs::write(&file, "max_batch = \"many\"\n").unwrap();
    refused(&["--config", file.to_str().unwrap()], &[], &["line 1: max_batch", why]);
    std::fs::write(&file, "flush = \"sometimes\"\n").unwrap();
    let why = "\"sometimes\" is not one of sync, async";
    refused(&["--config", file.to_str().unwrap()], &[], &["line 1: flush", why]);
    refused(&[], &[("DELAYD_FLUSH", "sometimes")], &["DELAYD_FLUSH", why]);
}

#[test]
fn a_default_max_attempts_no_produce_could_carry_is_refused_at_start() {
    // 20,000 used to start, and then every produce without its own max_attempts was a 400.
    refused(&[], &[("DELAYD_MAX_ATTEMPTS", "20000")], &["max_attempts", "must be 1 to 10000"]);
    refused(&["--max-attempts", "0"], &[], &["max_attempts", "must be 1 to 10000"]);
    let s = Server::start(&[("DELAYD_MAX_ATTEMPTS", "10000")]);
    assert_eq!(s.post("/v1/topics/t/messages", &json!({ "body": "b" })).0, 201);
}
