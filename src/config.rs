//! Program configuration: embedded defaults < TOML file < `DELAYD_*` environment < command-line flags.
//!
//! Durations and sizes are parsed by [`units`] (`500ms`, `1h30m`, a plain number of milliseconds;
//! `4MB` = 4,000,000 bytes, `4MiB` = 4,194,304, a plain number of bytes); lists of durations are a
//! TOML array or one string separated by commas and/or spaces (`"1s 5s 1m 2h"`).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, Result};
use crate::schedule::levels::validate_levels;
pub use crate::storage::commitlog::RecoveryMode;
use units::{
    fmt_ms, parse_duration, parse_duration_list, parse_size, parse_u64, DAY_MS, HOUR_MS, MINUTE_MS, SECOND_MS,
};

pub mod units;

const S: u64 = SECOND_MS;
const M: u64 = MINUTE_MS;
const H: u64 = HOUR_MS;
/// Default delay levels, RocketMQ's list: 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h.
#[rustfmt::skip]
pub const DEFAULT_LEVELS_MS: [u64; 18] =
    [S, 5 * S, 10 * S, 30 * S, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M, 8 * M, 9 * M, 10 * M, 20 * M, 30 * M, H, 2 * H];
/// Default nack backoff schedule: the default levels from 10s on.
#[rustfmt::skip]
pub const DEFAULT_BACKOFF_MS: [u64; 16] =
    [10 * S, 30 * S, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M, 8 * M, 9 * M, 10 * M, 20 * M, 30 * M, H, 2 * H];
/// Prefix of every environment variable that sets a key.
pub const ENV_PREFIX: &str = "DELAYD_";

/// Every key of the program, in the order `config/delayd.toml` documents them.
pub const KEYS: [&str; 26] = [
    "listen",
    "data_dir",
    "flush",
    "flush_interval_ms",
    "segment_bytes",
    "cq_entries_per_file",
    "index_initial_slots",
    "levels",
    "delay_policy",
    "max_delay",
    "default_ttr",
    "max_attempts",
    "backoff",
    "max_body_bytes",
    "max_batch",
    "max_wait",
    "compat_max_wait",
    "auth_token",
    "log_format",
    "log_level",
    "shutdown_grace",
    "recovery",
    "done_retention",
    "reclaim",
    "max_topics",
    "open_queues",
];

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// How appends become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlushMode {
    /// A write is acknowledged only after its bytes are on disk (group commit).
    Sync,
    /// A background flush every `flush_interval_ms`; a crash of the machine may lose that window.
    Async,
}

/// How an arbitrary delay maps onto delay levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DelayPolicy {
    /// Hop greedily across levels so the message fires at its exact due time.
    Chain,
    /// Put the message on the nearest level (RocketMQ's behaviour).
    Round,
}

/// Everything the broker core needs; built by [`Config::broker_config`].
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerConfig {
    /// Root of the data directory.
    pub data_dir: PathBuf,
    /// Sync or async durability.
    pub flush: FlushMode,
    /// Async mode: how often the flusher runs.
    pub flush_interval_ms: u64,
    /// Commit-log segment size in bytes.
    pub segment_bytes: u64,
    /// Entries per consume-queue file.
    pub cq_entries_per_file: u64,
    /// Delay levels in milliseconds, ascending.
    pub levels_ms: Vec<u64>,
    /// Chain or round.
    pub delay_policy: DelayPolicy,
    /// Longest accepted delay.
    pub max_delay_ms: u64,
    /// Time-to-run when neither the pop nor the message names one.
    pub default_ttr_ms: u64,
    /// Deliveries before a message is dead-lettered.
    pub default_max_attempts: u32,
    /// Retry schedule used by nack when the message carries none.
    pub default_backoff_ms: Vec<u64>,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Longest long-poll wait a pop may ask for.
    pub max_wait_ms: u64,
    /// Initial slot count of the id index file.
    pub index_initial_slots: u64,
    /// What to do when recovery finds a bad record with valid records after it.
    pub recovery: RecoveryMode,
    /// How long a done or cancelled message stays visible to look-ups and the idempotent produce.
    pub done_retention_ms: u64,
    /// Whether expired messages, old segments and read queue files are deleted at all.
    pub reclaim: bool,
    /// Most topics the broker creates.
    pub max_topics: usize,
    /// Most topic queues whose files are open at once.
    pub open_queues: usize,
}

impl BrokerConfig {
    /// The embedded defaults, with data in `data_dir`.
    pub fn with_defaults(data_dir: impl Into<PathBuf>) -> BrokerConfig {
        // One source of defaults: the program's embedded configuration.
        BrokerConfig { data_dir: data_dir.into(), ..Config::default().broker_config() }
    }
}

/// Command-line flags; they override every other source.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(name = "delayd", version, about = "A durable delay-message broker over HTTP")]
pub struct Cli {
    /// TOML config file (see config/delayd.toml for every key).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:9277 (port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Data directory.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// The full program configuration; every field has an embedded default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP server binds.
    pub listen: String,
    /// Root of the data directory.
    pub data_dir: PathBuf,
    /// `sync` or `async` durability.
    pub flush: FlushMode,
    /// Async mode: flush period in ms.
    #[serde(deserialize_with = "de_duration")]
    pub flush_interval_ms: u64,
    /// Commit-log segment size in bytes.
    #[serde(deserialize_with = "de_size")]
    pub segment_bytes: u64,
    /// Entries per consume-queue file.
    pub cq_entries_per_file: u64,
    /// Initial slot count of the id index.
    pub index_initial_slots: u64,
    /// Delay levels in ms, ascending.
    #[serde(deserialize_with = "de_duration_list")]
    pub levels: Vec<u64>,
    /// `chain` or `round`.
    pub delay_policy: DelayPolicy,
    /// Longest accepted delay in ms.
    #[serde(deserialize_with = "de_duration")]
    pub max_delay: u64,
    /// Default time-to-run in ms.
    #[serde(deserialize_with = "de_duration")]
    pub default_ttr: u64,
    /// Deliveries before dead-lettering.
    pub max_attempts: u32,
    /// Default nack backoff in ms.
    #[serde(deserialize_with = "de_duration_list")]
    pub backoff: Vec<u64>,
    /// Largest accepted message body in bytes.
    #[serde(deserialize_with = "de_size")]
    pub max_body_bytes: u64,
    /// Most messages in one batch produce.
    pub max_batch: usize,
    /// Cap on a native pop's `wait_ms`, in ms.
    #[serde(deserialize_with = "de_duration")]
    pub max_wait: u64,
    /// How long a compat `/pop` long-polls, in ms.
    #[serde(deserialize_with = "de_duration")]
    pub compat_max_wait: u64,
    /// Bearer token required on `/v1`, `/metrics` and the compat API when set.
    pub auth_token: Option<String>,
    /// `text` or `json`.
    pub log_format: LogFormat,
    /// A tracing filter such as `info` or `delayd=debug,warn`.
    pub log_level: String,
    /// On SIGTERM, how long in-flight requests get before the server stops waiting, in ms.
    #[serde(deserialize_with = "de_duration")]
    pub shutdown_grace: u64,
    /// On a bad record followed by valid ones: `strict` refuses to start, `truncate` drops the rest.
    pub recovery: RecoveryMode,
    /// How long a done or cancelled message stays visible to look-ups and idempotent produces, in ms.
    #[serde(deserialize_with = "de_duration")]
    pub done_retention: u64,
    /// Delete expired messages, old segments and read queue files (off only for comparisons).
    pub reclaim: bool,
    /// Most topics (dead-letter topics included) the broker creates; produces to a new one past it
    /// are refused.
    pub max_topics: usize,
    /// Most topic queues whose files are open at once; the least recently used are closed.
    pub open_queues: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:9277".to_string(),
            data_dir: PathBuf::from("./data"),
            flush: FlushMode::Sync,
            flush_interval_ms: 100,
            segment_bytes: 64 << 20,
            cq_entries_per_file: 300_000,
            index_initial_slots: 1 << 16,
            levels: DEFAULT_LEVELS_MS.to_vec(),
            delay_policy: DelayPolicy::Chain,
            max_delay: 30 * DAY_MS,
            default_ttr: 30_000,
            max_attempts: 16,
            backoff: DEFAULT_BACKOFF_MS.to_vec(),
            max_body_bytes: 4 << 20,
            max_batch: 1000,
            max_wait: 180_000,
            compat_max_wait: 178_000,
            auth_token: None,
            log_format: LogFormat::Text,
            log_level: "info".to_string(),
            shutdown_grace: 10_000,
            recovery: RecoveryMode::Strict,
            done_retention: DAY_MS,
            reclaim: true,
            max_topics: 10_000,
            open_queues: 1024,
        }
    }
}

impl Config {
    /// Builds the configuration from all layers and validates it.
    pub fn load(cli: &Cli, env: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut cfg = match &cli.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        cfg.apply_env(env)?;
        if let Some(listen) = &cli.listen {
            cfg.listen = listen.clone();
        }
        if let Some(dir) = &cli.data_dir {
            cfg.data_dir = dir.clone();
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML file over the defaults; unknown keys are an error that names the key.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read config file {}: {e}", path.display())))?;
        Config::from_toml(&text).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses TOML text over the defaults.
    pub fn from_toml(text: &str) -> Result<Config> {
        toml::from_str(text).map_err(|e| {
            let message = e.message().trim();
            match e.span() {
                Some(span) => {
                    let line = text.get(..span.start).unwrap_or(text).matches('\n').count() + 1;
                    Error::Config(format!("line {line}: {message}"))
                }
                None => Error::Config(message.to_string()),
            }
        })
    }

    /// Applies every `DELAYD_<KEY>` variable that is set.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<()> {
        for key in KEYS {
            let var = format!("{ENV_PREFIX}{}", key.to_ascii_uppercase());
            if let Some(value) = env(&var) {
                self.set(key, &value).map_err(|m| Error::Config(format!("{var}={value:?}: {m}")))?;
            }
        }
        Ok(())
    }

    /// Sets one key from its string form, as the environment gives it.
    pub fn set(&mut self, key: &str, value: &str) -> std::result::Result<(), String> {
        let v = value.trim();
        match key {
            "listen" => self.listen = v.to_string(),
            "data_dir" => self.data_dir = PathBuf::from(v),
            "flush" => {
                self.flush = match v.to_ascii_lowercase().as_str() {
                    "sync" => FlushMode::Sync,
                    "async" => FlushMode::Async,
                    _ => return Err("expected sync or async".into()),
                }
            }
            "flush_interval_ms" => self.flush_interval_ms = parse_duration(v)?,
            "segment_bytes" => self.segment_bytes = parse_size(v)?,
            "cq_entries_per_file" => self.cq_entries_per_file = parse_u64(v)?,
            "index_initial_slots" => self.index_initial_slots = parse_u64(v)?,
            "levels" => self.levels = parse_duration_list(v)?,
            "delay_policy" => {
                self.delay_policy = match v.to_ascii_lowercase().as_str() {
                    "chain" => DelayPolicy::Chain,
                    "round" => DelayPolicy::Round,
                    _ => return Err("expected chain or round".into()),
                }
            }
            "max_delay" => self.max_delay = parse_duration(v)?,
            "default_ttr" => self.default_ttr = parse_duration(v)?,
            "max_attempts" => {
                self.max_attempts = u32::try_from(parse_u64(v)?).map_err(|_| "too large".to_string())?
            }
            "backoff" => self.backoff = parse_duration_list(v)?,
            "max_body_bytes" => self.max_body_bytes = parse_size(v)?,
            "max_batch" => {
                self.max_batch = usize::try_from(parse_u64(v)?).map_err(|_| "too large".to_string())?
            }
            "max_wait" => self.max_wait = parse_duration(v)?,
            "compat_max_wait" => self.compat_max_wait = parse_duration(v)?,
            "auth_token" => self.auth_token = if v.is_empty() { None } else { Some(v.to_string()) },
            "log_format" => {
                self.log_format = match v.to_ascii_lowercase().as_str() {
                    "text" => LogFormat::Text,
                    "json" => LogFormat::Json,
                    _ => return Err("expected text or json".into()),
                }
            }
            "log_level" => self.log_level = v.to_string(),
            "shutdown_grace" => self.shutdown_grace = parse_duration(v)?,
            "recovery" => {
                self.recovery = match v.to_ascii_lowercase().as_str() {
                    "strict" => RecoveryMode::Strict,
                    "truncate" => RecoveryMode::Truncate,
                    _ => return Err("expected strict or truncate".into()),
                }
            }
            "done_retention" => self.done_retention = parse_duration(v)?,
            "reclaim" => {
                self.reclaim = match v.to_ascii_lowercase().as_str() {
                    "true" | "on" | "1" => true,
                    "false" | "off" | "0" => false,
                    _ => return Err("expected true or false".into()),
                }
            }
            "max_topics" => {
                self.max_topics = usize::try_from(parse_u64(v)?).map_err(|_| "too large".to_string())?
            }
            "open_queues" => {
                self.open_queues = usize::try_from(parse_u64(v)?).map_err(|_| "too large".to_string())?
            }
            other => return Err(format!("unknown key {other}")),
        }
        Ok(())
    }

    /// Checks every key; the message names the key and the rule it breaks.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, msg: String| Err(Error::Config(format!("{key}: {msg}")));
        if self.listen.parse::<SocketAddr>().is_err() {
            return bad("listen", format!("{:?} is not an address like 127.0.0.1:9277", self.listen));
        }
        if self.data_dir.as_os_str().is_empty() {
            return bad("data_dir", "must not be empty".into());
        }
        if self.flush_interval_ms == 0 {
            return bad("flush_interval_ms", "must be at least 1ms".into());
        }
        if self.segment_bytes < 4096 || self.segment_bytes > 1 << 40 {
            return bad("segment_bytes", format!("{} is outside 4KiB..=1TiB", self.segment_bytes));
        }
        if self.cq_entries_per_file == 0 {
            return bad("cq_entries_per_file", "must be at least 1".into());
        }
        if self.index_initial_slots == 0 {
            return bad("index_initial_slots", "must be at least 1".into());
        }
        if self.max_topics == 0 {
            return bad("max_topics", "must be at least 1".into());
        }
        if self.open_queues == 0 {
            return bad("open_queues", "must be at least 1".into());
        }
        validate_levels(&self.levels)?;
        if self.max_delay == 0 {
            return bad("max_delay", "must be longer than 0ms".into());
        }
        if self.max_delay > 3650 * DAY_MS {
            return bad("max_delay", "must be at most 3650d".into());
        }
        if self.default_ttr == 0 {
            return bad("default_ttr", "must be longer than 0ms".into());
        }
        if self.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1".into());
        }
        if self.backoff.is_empty() {
            return bad("backoff", "needs at least one step".into());
        }
        if let Some(step) = self.backoff.iter().find(|s| **s > self.max_delay) {
            return bad(
                "backoff",
                format!(
                    "step {} exceeds max_delay {}; shorten backoff (DELAYD_BACKOFF) or raise max_delay",
                    fmt_ms(*step),
                    fmt_ms(self.max_delay)
                ),
            );
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > 1 << 30 {
            return bad("max_body_bytes", format!("{} is outside 1..=1GiB", self.max_body_bytes));
        }
        if self.max_body_bytes + 4096 > self.segment_bytes {
            return bad(
                "max_body_bytes",
                format!(
                    "{} does not fit in a segment of segment_bytes {}",
                    self.max_body_bytes, self.segment_bytes
                ),
            );
        }
        if self.max_batch == 0 || self.max_batch > 100_000 {
            return bad("max_batch", format!("{} is outside 1..=100000", self.max_batch));
        }
        if self.max_wait > DAY_MS {
            return bad("max_wait", "must be at most 1d".into());
        }
        if self.compat_max_wait > DAY_MS {
            return bad("compat_max_wait", "must be at most 1d".into());
        }
        if let Some(token) = &self.auth_token {
            if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return bad("auth_token", "must be non-empty and contain no whitespace".into());
            }
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log_level) {
            return bad(
                "log_level",
                format!("{:?} is not a filter like info or delayd=debug: {e}", self.log_level),
            );
        }
        Ok(())
    }

    /// The parsed listen address (valid after `validate`).
    pub fn listen_addr(&self) -> Result<SocketAddr> {
        self.listen.parse().map_err(|_| Error::Config(format!("listen: {:?} is not an address", self.listen)))
    }

    /// What the broker core needs from this configuration.
    pub fn broker_config(&self) -> BrokerConfig {
        BrokerConfig {
            data_dir: self.data_dir.clone(),
            flush: self.flush,
            flush_interval_ms: self.flush_interval_ms,
            segment_bytes: self.segment_bytes,
            cq_entries_per_file: self.cq_entries_per_file,
            levels_ms: self.levels.clone(),
            delay_policy: self.delay_policy,
            max_delay_ms: self.max_delay,
            default_ttr_ms: self.default_ttr,
            default_max_attempts: self.max_attempts,
            default_backoff_ms: self.backoff.clone(),
            max_body_bytes: usize::try_from(self.max_body_bytes).unwrap_or(usize::MAX),
            // The compat API long-polls too; the broker must allow the longer of both caps.
            max_wait_ms: self.max_wait.max(self.compat_max_wait),
            index_initial_slots: self.index_initial_slots,
            recovery: self.recovery,
            done_retention_ms: self.done_retention,
            reclaim: self.reclaim,
            max_topics: self.max_topics,
            open_queues: self.open_queues,
        }
    }
}

/// A TOML value that is either a number or a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(i64),
    Str(String),
}

struct Expecting(&'static str);

impl fmt::Display for Expecting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

fn num_or_str<'de, D: Deserializer<'de>>(
    d: D,
    what: &'static str,
    parse: fn(&str) -> std::result::Result<u64, String>,
) -> std::result::Result<u64, D::Error> {
    use serde::de::Error as _;
    match NumOrStr::deserialize(d).map_err(|_| D::Error::custom(Expecting(what)))? {
        NumOrStr::Num(n) => u64::try_from(n).map_err(|_| D::Error::custom(format!("{n} is negative"))),
        NumOrStr::Str(s) => parse(&s).map_err(D::Error::custom),
    }
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    num_or_str(d, "a duration such as \"10s\" or a number of ms", parse_duration)
}

fn de_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    num_or_str(d, "a size such as \"4MiB\" or a number of bytes", parse_size)
}

fn de_duration_list<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<u64>, D::Error> {
    use serde::de::Error as _;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrStr {
        List(Vec<NumOrStr>),
        Str(String),
    }
    let expecting = "a list of durations such as [\"1s\", \"5s\"] or \"1s 5s\"";
    match ListOrStr::deserialize(d).map_err(|_| D::Error::custom(expecting))? {
        ListOrStr::Str(s) => parse_duration_list(&s).map_err(D::Error::custom),
        ListOrStr::List(items) => items
            .into_iter()
            .map(|item| match item {
                NumOrStr::Num(n) => {
                    u64::try_from(n).map_err(|_| D::Error::custom(format!("{n} is negative")))
                }
                NumOrStr::Str(s) => parse_duration(&s).map_err(D::Error::custom),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults_are_valid_and_match_the_documented_values() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(c.listen, "127.0.0.1:9277");
        assert_eq!(c.data_dir, PathBuf::from("./data"));
        assert_eq!(c.flush, FlushMode::Sync);
        assert_eq!(c.segment_bytes, 64 << 20);
        assert_eq!(c.cq_entries_per_file, 300_000);
        assert_eq!(c.index_initial_slots, 65_536);
        assert_eq!(c.done_retention, DAY_MS);
        assert!(c.reclaim);
        assert_eq!(c.max_topics, 10_000);
        assert_eq!(c.open_queues, 1024);
        assert_eq!(c.levels.len(), 18);
        assert_eq!(c.levels[0], 1000);
        assert_eq!(*c.levels.last().unwrap(), 7_200_000);
        assert_eq!(c.backoff.len(), 16);
        assert_eq!(c.backoff[0], 10_000);
        assert_eq!(c.max_delay, 30 * DAY_MS);
        assert_eq!(c.default_ttr, 30_000);
        assert_eq!(c.max_attempts, 16);
        assert_eq!(c.max_body_bytes, 4 << 20);
        assert_eq!(c.max_batch, 1000);
        assert_eq!(c.max_wait, 180_000);
        assert_eq!(c.compat_max_wait, 178_000);
        assert_eq!(c.auth_token, None);
        assert_eq!(c.log_format, LogFormat::Text);
    }

    #[test]
    fn shipped_config_file_parses_to_the_defaults() {
        let text = include_str!("../config/delayd.toml");
        let parsed = Config::from_toml(text).unwrap();
        assert_eq!(parsed, Config::default());
        for key in KEYS {
            assert!(
                text.contains(&format!("\n# {key} = ")) || text.contains(&format!("\n{key} = ")),
                "{key}"
            );
        }
    }

    #[test]
    fn toml_accepts_strings_numbers_and_lists() {
        let c = Config::from_toml(
            "flush = \"async\"\nmax_delay = \"2d\"\nlevels = [\"1s\", 5000, \"1m\"]\nbackoff = \"1s, 2s\"\n\
             max_body_bytes = \"1MiB\"\ndefault_ttr = 1500\nauth_token = \"s3cret\"\nlog_format = \"json\"\n",
        )
        .unwrap();
        assert_eq!(c.flush, FlushMode::Async);
        assert_eq!(c.max_delay, 2 * DAY_MS);
        assert_eq!(c.levels, vec![1000, 5000, 60_000]);
        assert_eq!(c.backoff, vec![1000, 2000]);
        assert_eq!(c.max_body_bytes, 1 << 20);
        assert_eq!(c.default_ttr, 1500);
        assert_eq!(c.auth_token.as_deref(), Some("s3cret"));
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn toml_errors_name_the_key() {
        let e = Config::from_toml("listen = \"127.0.0.1:1\"\nmax_dealy = \"1d\"\n").unwrap_err().to_string();
        assert!(e.contains("max_dealy"), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = Config::from_toml("flush = \"sometimes\"\n").unwrap_err().to_string();
        assert!(e.contains("sometimes"), "{e}");
        let e = Config::from_toml("max_delay = \"1 fortnight\"\n").unwrap_err().to_string();
        assert!(e.contains("fortnight"), "{e}");
        let e = Config::from_toml("max_delay = -5\n").unwrap_err().to_string();
        assert!(e.contains("negative"), "{e}");
    }

    #[test]
    fn precedence_is_flags_then_env_then_file_then_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:1000\"\ndata_dir = \"/from/file\"\nmax_batch = 7\nmax_attempts = 3\n",
        )
        .unwrap();
        let cli = Cli { config: Some(file), listen: Some("127.0.0.1:3000".into()), data_dir: None };
        let c = Config::load(
            &cli,
            env(&[
                ("DELAYD_LISTEN", "127.0.0.1:2000"),
                ("DELAYD_DATA_DIR", "/from/env"),
                ("DELAYD_MAX_ATTEMPTS", "5"),
                ("DELAYD_FLUSH", "async"),
                ("DELAYD_LEVELS", "1s 5s 1m 2h"),
                ("DELAYD_MAX_DELAY", "7d"),
                ("DELAYD_MAX_BODY_BYTES", "65536"),
                ("DELAYD_AUTH_TOKEN", "tok"),
                ("DELAYD_LOG_FORMAT", "json"),
            ]),
        )
        .unwrap();
        assert_eq!(c.listen, "127.0.0.1:3000", "flag beats env and file");
        assert_eq!(c.data_dir, PathBuf::from("/from/env"), "env beats file");
        assert_eq!(c.max_batch, 7, "file beats defaults");
        assert_eq!(c.max_attempts, 5);
        assert_eq!(c.flush, FlushMode::Async);
        assert_eq!(c.levels, vec![1000, 5000, 60_000, 7_200_000]);
        assert_eq!(c.max_delay, 7 * DAY_MS);
        assert_eq!(c.max_body_bytes, 65536);
        assert_eq!(c.auth_token.as_deref(), Some("tok"));
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.default_ttr, 30_000, "untouched keys keep their default");
    }

    #[test]
    fn every_key_has_an_env_var() {
        let mut c = Config::default();
        let values = [
            ("listen", "127.0.0.1:1"),
            ("data_dir", "/x"),
            ("flush", "ASYNC"),
            ("flush_interval_ms", "5"),
            ("segment_bytes", "8MiB"),
            ("cq_entries_per_file", "100"),
            ("index_initial_slots", "64"),
            ("levels", "1s"),
            ("delay_policy", "round"),
            ("max_delay", "1h"),
            ("default_ttr", "2s"),
            ("max_attempts", "2"),
            ("backoff", "1s"),
            ("max_body_bytes", "1KiB"),
            ("max_batch", "10"),
            ("max_wait", "1s"),
            ("compat_max_wait", "2s"),
            ("auth_token", "t"),
            ("log_format", "json"),
            ("log_level", "debug"),
            ("shutdown_grace", "1s"),
            ("recovery", "Truncate"),
            ("done_retention", "3s"),
            ("reclaim", "off"),
            ("max_topics", "7"),
            ("open_queues", "3"),
        ];
        assert_eq!(values.len(), KEYS.len());
        let vars: Vec<(String, String)> = values
            .iter()
            .map(|(k, v)| (format!("DELAYD_{}", k.to_ascii_uppercase()), v.to_string()))
            .collect();
        c.apply_env(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())).unwrap();
        let mut expected = Config {
            listen: "127.0.0.1:1".into(),
            data_dir: "/x".into(),
            flush: FlushMode::Async,
            flush_interval_ms: 5,
            segment_bytes: 8 << 20,
            cq_entries_per_file: 100,
            index_initial_slots: 64,
            levels: vec![1000],
            delay_policy: DelayPolicy::Round,
            max_delay: 3_600_000,
            default_ttr: 2000,
            max_attempts: 2,
            backoff: vec![1000],
            max_body_bytes: 1024,
            max_batch: 10,
            max_wait: 1000,
            compat_max_wait: 2000,
            auth_token: Some("t".into()),
            log_format: LogFormat::Json,
            log_level: "debug".into(),
            shutdown_grace: 1000,
            recovery: RecoveryMode::Truncate,
            done_retention: 3000,
            reclaim: false,
            max_topics: 7,
            open_queues: 3,
        };
        assert_eq!(c, expected);
        c.validate().unwrap();
        expected.auth_token = None;
        c.set("auth_token", "").unwrap();
        assert_eq!(c, expected, "an empty DELAYD_AUTH_TOKEN turns auth off");
    }

    #[test]
    fn env_errors_name_the_variable() {
        let e = Config::load(&Cli::default(), env(&[("DELAYD_MAX_DELAY", "soon")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_MAX_DELAY"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_FLUSH", "maybe")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_FLUSH") && e.contains("sync or async"), "{e}");
    }

    #[test]
    fn validate_rejects_bad_values_with_the_key_in_the_message() {
        type Mutation = Box<dyn Fn(&mut Config)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("listen", Box::new(|c| c.listen = "localhost".into())),
            ("flush_interval_ms", Box::new(|c| c.flush_interval_ms = 0)),
            ("segment_bytes", Box::new(|c| c.segment_bytes = 10)),
            ("levels", Box::new(|c| c.levels = vec![])),
            ("levels", Box::new(|c| c.levels = vec![5000, 1000])),
            ("levels", Box::new(|c| c.levels = vec![0, 1000])),
            ("max_delay", Box::new(|c| c.max_delay = 0)),
            ("default_ttr", Box::new(|c| c.default_ttr = 0)),
            ("max_attempts", Box::new(|c| c.max_attempts = 0)),
            ("backoff", Box::new(|c| c.backoff = vec![])),
            ("backoff", Box::new(|c| c.backoff = vec![c.max_delay + 1])),
            ("max_body_bytes", Box::new(|c| c.max_body_bytes = 0)),
            ("max_body_bytes", Box::new(|c| c.max_body_bytes = c.segment_bytes)),
            ("max_batch", Box::new(|c| c.max_batch = 0)),
            ("open_queues", Box::new(|c| c.open_queues = 0)),
            ("auth_token", Box::new(|c| c.auth_token = Some("a b".into()))),
            ("log_level", Box::new(|c| c.log_level = "[[[".into())),
        ];
        for (key, mutate) in cases {
            let mut c = Config::default();
            mutate(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn broker_config_carries_every_setting() {
        let c = Config { max_wait: 1000, compat_max_wait: 5000, ..Config::default() };
        let b = c.broker_config();
        assert_eq!(b.levels_ms, c.levels);
        assert_eq!(b.default_backoff_ms, c.backoff);
        assert_eq!(b.max_delay_ms, c.max_delay);
        assert_eq!(b.default_ttr_ms, c.default_ttr);
        assert_eq!(b.default_max_attempts, c.max_attempts);
        assert_eq!(b.max_body_bytes, 4 << 20);
        assert_eq!(b.max_wait_ms, 5000);
        assert_eq!(b.segment_bytes, c.segment_bytes);
        assert_eq!(b.data_dir, c.data_dir);
        assert_eq!(b.open_queues, c.open_queues);
    }

    /// `BrokerConfig::with_defaults` (what tests and embedders use) and the program's defaults are
    /// one source: every field, named here without `..` so a new field must be added to this test.
    #[test]
    fn broker_config_defaults_are_the_config_defaults() {
        let c = Config::default();
        let b = BrokerConfig::with_defaults("/some/dir");
        assert_eq!(b, Config { data_dir: "/some/dir".into(), ..Config::default() }.broker_config());
        let BrokerConfig {
            data_dir,
            flush,
            flush_interval_ms,
            segment_bytes,
            cq_entries_per_file,
            levels_ms,
            delay_policy,
            max_delay_ms,
            default_ttr_ms,
            default_max_attempts,
            default_backoff_ms,
            max_body_bytes,
            max_wait_ms,
            index_initial_slots,
            recovery,
            done_retention_ms,
            reclaim,
            max_topics,
            open_queues,
        } = b;
        assert_eq!(data_dir, PathBuf::from("/some/dir"));
        assert_eq!(flush, c.flush);
        assert_eq!(flush_interval_ms, c.flush_interval_ms);
        assert_eq!(segment_bytes, c.segment_bytes);
        assert_eq!(cq_entries_per_file, c.cq_entries_per_file);
        assert_eq!(levels_ms, c.levels);
        assert_eq!(levels_ms, DEFAULT_LEVELS_MS);
        assert_eq!(delay_policy, c.delay_policy);
        assert_eq!(max_delay_ms, c.max_delay);
        assert_eq!(default_ttr_ms, c.default_ttr);
        assert_eq!(default_max_attempts, c.max_attempts);
        assert_eq!(default_backoff_ms, c.backoff);
        assert_eq!(default_backoff_ms, DEFAULT_BACKOFF_MS);
        assert_eq!(max_body_bytes as u64, c.max_body_bytes);
        assert_eq!(max_wait_ms, c.max_wait.max(c.compat_max_wait));
        assert_eq!(index_initial_slots, c.index_initial_slots);
        assert_eq!(recovery, c.recovery);
        assert_eq!(done_retention_ms, c.done_retention);
        assert_eq!(reclaim, c.reclaim);
        assert_eq!(max_topics, c.max_topics);
        assert_eq!(open_queues, c.open_queues);
    }
}
