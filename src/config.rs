//! Program configuration: embedded defaults < TOML file < `DELAYD_*` environment < command-line flags.
//!
//! Durations and sizes are parsed by [`units`] (`500ms`, `1h30m`, a plain number of milliseconds;
//! `4MB` = 4,000,000 bytes, `4MiB` = 4,194,304, a plain number of bytes); lists of durations are a
//! TOML array or one string separated by commas and/or spaces (`"1s 5s 1m 2h"`).
//!
//! Every key is written once, in the `config_keys!` table below: the struct field, its default,
//! its flag, variable and `--help` line, its parser (one per key, used for the file, the
//! environment and flags alike, from `config/value.rs`) and its own rule all come from its row.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::error::{Error, Result};
use crate::limits::{ENVELOPE_BYTES, MAX_ATTEMPTS_LIMIT, MAX_BATCH_LIMIT};
use crate::schedule::levels::validate_levels;
pub use crate::schedule::levels::DEFAULT_LEVELS_MS;
pub use crate::storage::commitlog::RecoveryMode;
pub use crate::storage::store::StartCheck;
pub use crate::storage::writer::FlushMode;
use crate::units::{fmt_ms, fmt_size, DAY_MS, HOUR_MS, MINUTE_MS, SECOND_MS};
use value::{
    AttemptsLimit, AutoCount, Choice, Choices, Count, Duration, Durations, Hosts, Kind, OptionalCount,
    OptionalText, Peers, Size, Text, Token, EMPTY_TOKEN,
};

pub mod cli;
mod value;
/// Durations and sizes as people write them; kept under this path for the programs that name it.
pub use crate::units;

use cli::Cli;

const S: u64 = SECOND_MS;
const M: u64 = MINUTE_MS;
const H: u64 = HOUR_MS;
/// Default nack backoff schedule: the default levels from 10s on.
#[rustfmt::skip]
pub const DEFAULT_BACKOFF_MS: [u64; 16] =
    [10 * S, 30 * S, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M, 8 * M, 9 * M, 10 * M, 20 * M, 30 * M, H, 2 * H];
/// Prefix of every environment variable that sets a key.
pub const ENV_PREFIX: &str = "DELAYD_";

/// One key: its name in the file, what its value looks like, and one line of help. The environment
/// variable is [`ENV_PREFIX`] and the name in upper case ([`env_var`]), the flag `--` and the name
/// with dashes ([`flag`]).
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// The key as the file writes it.
    pub name: &'static str,
    /// What its value looks like, for `--help`.
    pub value_name: &'static str,
    /// One line for `--help`.
    pub help: &'static str,
    /// A secret: `--help` does not show the value its variable has.
    pub secret: bool,
}

const fn key(name: &'static str, value_name: &'static str, help: &'static str, secret: bool) -> Key {
    Key { name, value_name, help, secret }
}

/// Defines every key once. From each row come: the [`Config`] field (its type, and the help as its
/// doc), its default, its [`KEY_TABLE`] entry (name, value name and help, from which the flag, the
/// environment variable and `--help` come), its arms of [`Config::set`], [`Config::get`] and the
/// TOML reader, all through the row's [`value::Kind`], the one parser of the key, and the key's own
/// rule, if it has one (`|v| ...` on the value; rules between keys are in [`Config::validate`]).
macro_rules! config_keys {
    ($(
        $(#[$doc:meta])*
        $name:ident : $ty:ty [$kind:ty] = $default:expr, $value_name:literal, $help:literal
        $(, |$v:ident| $rule:expr)?;
    )*) => {
        /// The full program configuration; every field has an embedded default.
        #[derive(Debug, Clone, PartialEq)]
        pub struct Config {
            $(
                #[doc = $help]
                $(#[$doc])*
                pub $name: $ty,
            )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config { $( $name: $default, )* }
            }
        }

        /// Every key of the program with its help, in the order `config/delayd.toml` documents them.
        pub const KEY_TABLE: [Key; KEY_COUNT] = [ $( key(stringify!($name), $value_name, $help, <$kind as Kind>::SECRET), )* ];

        /// How many keys there are.
        pub const KEY_COUNT: usize = <[&str]>::len(&[ $( stringify!($name), )* ]);

        impl Config {
            /// Sets one key from its string form, as the environment or a flag gives it. The error
            /// names the value; the caller adds where it came from.
            pub fn set(&mut self, key: &str, value: &str) -> std::result::Result<(), String> {
                match key {
                    $( stringify!($name) => self.$name = <$kind as Kind>::parse(value)?, )*
                    other => return Err(format!("unknown key {other}")),
                }
                Ok(())
            }

            /// The value of `key` in the form [`Config::set`] reads back (what `--help` shows as the
            /// default); `None` for a key left unset (`auth_token`, ...) or an unknown key.
            pub fn get(&self, key: &str) -> Option<String> {
                match key {
                    $( stringify!($name) => <$kind as Kind>::show(&self.$name), )*
                    _ => None,
                }
            }

            /// Checks each key's own rule, in table order; the message names the key.
            fn check_each(&self) -> Result<()> {
                $($(
                    let $v = &self.$name;
                    let rule: std::result::Result<(), String> = $rule;
                    rule.map_err(|m| Error::Config(format!("{}: {m}", stringify!($name))))?;
                )?)*
                Ok(())
            }

            /// Sets one key from a TOML value: a string is read as [`Config::set`] reads text.
            fn set_toml(&mut self, key: &str, value: &toml::Value) -> std::result::Result<(), String> {
                match key {
                    $( stringify!($name) => self.$name = <$kind as Kind>::from_toml(value)?, )*
                    other => return Err(format!("unknown key {other}")),
                }
                Ok(())
            }
        }
    };
}

// Adding a key: one row here (at the end), then its line in config/delayd.toml and its row in
// docs/configuration.md (tests check both). A rule that involves other keys goes in `Config::validate`.
config_keys! {
    listen: String [Text] = "127.0.0.1:9277".to_string(), "ADDR",
        "Address of the HTTP server; port 0 picks a free one (printed on stdout)",
        |v| rule(v.parse::<SocketAddr>().is_ok(), || format!("{v:?} is not an address like 127.0.0.1:9277"));
    data_dir: PathBuf [value::Path] = PathBuf::from("./data"), "DIR",
        "Data directory; one delayd per directory",
        |v| rule(!v.as_os_str().is_empty(), || "must not be empty".into());
    flush: FlushMode [Choice<FlushMode>] = FlushMode::Sync, "sync|async",
        "sync: answer after the write is on disk; async: flush every flush_interval_ms";
    /// In milliseconds.
    flush_interval_ms: u64 [Duration] = 100, "DURATION",
        "Async mode: how often writes are made durable; sync mode: the longest records that owe no answer (timers firing) wait for a sync",
        |v| rule(*v >= 1, || "must be at least 1ms".into());
    /// In bytes.
    segment_bytes: u64 [Size] = 64 << 20, "SIZE",
        "Commit-log segment file size, preallocated; the grain of disk reclaim",
        |v| rule((4096..=1 << 40).contains(v), || format!("{v} is outside 4KiB..=1TiB"));
    cq_entries_per_file: u64 [Count<u64>] = 300_000, "N",
        "Entries per consume-queue file",
        |v| rule(*v >= 1, || "must be at least 1".into());
    index_initial_slots: u64 [Count<u64>] = 1 << 16, "N",
        "Initial slot count of the on-disk id index",
        |v| rule(*v >= 1, || "must be at least 1".into());
    /// In milliseconds.
    levels: Vec<u64> [Durations] = DEFAULT_LEVELS_MS.to_vec(), "DURATIONS",
        "Delay levels, ascending";
    delay_policy: DelayPolicy [Choice<DelayPolicy>] = DelayPolicy::Chain, "chain|round",
        "chain: exact delays by hopping levels; round: nearest level";
    /// In milliseconds.
    max_delay: u64 [Duration] = 30 * DAY_MS, "DURATION",
        "Longest accepted delay",
        |v| rule(*v > 0, || "must be longer than 0ms".into())
            .and_then(|()| rule(*v <= 3650 * DAY_MS, || "must be at most 3650d".into()));
    /// In milliseconds.
    default_ttr: u64 [Duration] = 30_000, "DURATION",
        "Time-to-run of a popped message when neither pop nor message sets one",
        |v| rule(*v > 0, || "must be longer than 0ms".into());
    max_attempts: u32 [Count<u32>] = 16, "N",
        "Deliveries before a message moves to {topic}.dlq",
        // The same bound a produce's own max_attempts has: past it every produce that leans on
        // the default would be refused.
        |v| rule((1..=MAX_ATTEMPTS_LIMIT).contains(v), || format!("must be 1 to {MAX_ATTEMPTS_LIMIT}"));
    /// In milliseconds.
    backoff: Vec<u64> [Durations] = DEFAULT_BACKOFF_MS.to_vec(), "DURATIONS",
        "Nack retry schedule when the message carries none",
        |v| rule(!v.is_empty(), || "needs at least one step".into());
    /// In bytes.
    max_body_bytes: u64 [Size] = 4 << 20, "SIZE",
        "Largest message body",
        |v| rule((1..=1 << 30).contains(v), || format!("{v} is outside 1..=1GiB"));
    max_batch: usize [Count<usize>] = 1000, "N",
        "Most messages in one batch produce or pop",
        |v| rule((1..=MAX_BATCH_LIMIT).contains(v), || format!("{v} is outside 1..={MAX_BATCH_LIMIT}"));
    /// In milliseconds.
    max_wait: u64 [Duration] = 180_000, "DURATION",
        "Cap on a native pop's wait_ms",
        |v| rule(*v <= DAY_MS, || "must be at most 1d".into());
    /// In milliseconds.
    compat_max_wait: u64 [Duration] = 178_000, "DURATION",
        "How long a compat /pop long-polls",
        |v| rule(*v <= DAY_MS, || "must be at most 1d".into());
    /// `None`, the default: never, as the original redelivers an unfinished job forever.
    compat_max_attempts: Option<u32> [AttemptsLimit] = None, "N",
        "Deliveries before a compat job moves to {topic}.dlq, or unlimited (never)",
        |v| rule(v.is_none_or(|n| (1..=MAX_ATTEMPTS_LIMIT).contains(&n)), || {
            format!("must be 1 to {MAX_ATTEMPTS_LIMIT} or unlimited")
        });
    auth_token: Option<String> [Token] = None, "TOKEN",
        "Bearer token required on /v1, /metrics and the compat API; unset (the default): no auth",
        |v| match v.as_deref() {
            Some("") => Err(EMPTY_TOKEN.into()),
            Some(t) => rule(!t.chars().any(|c| c.is_whitespace() || c.is_control()), || {
                "must contain no whitespace or control characters".into()
            }),
            None => Ok(()),
        };
    read_token: Option<String> [Token] = None, "TOKEN",
        "Bearer token that may read (stats, metrics, messages, the dashboard) but change nothing; needs auth_token",
        |v| match v.as_deref() {
            Some("") => Err(EMPTY_TOKEN.into()),
            Some(t) => rule(!t.chars().any(|c| c.is_whitespace() || c.is_control()), || {
                "must contain no whitespace or control characters".into()
            }),
            None => Ok(()),
        };
    max_connections: usize [Count<usize>] = 10_000, "N",
        "Most HTTP connections open at once, lowered to fit the file-handle limit; idle ones make room",
        |v| rule((1..=1_000_000).contains(v), || format!("{v} is outside 1..=1000000"));
    /// In milliseconds.
    http_header_timeout: u64 [Duration] = 10_000, "DURATION",
        "A request head must arrive within this (from connect or its first byte)",
        |v| timeout(*v);
    /// In milliseconds.
    http_idle_timeout: u64 [Duration] = 60_000, "DURATION",
        "How long a kept-alive connection may wait for its next request",
        |v| timeout(*v);
    /// In milliseconds.
    http_body_timeout: u64 [Duration] = 30_000, "DURATION",
        "A request body must arrive within this, from the end of its head",
        |v| timeout(*v);
    log_format: LogFormat [Choice<LogFormat>] = LogFormat::Text, "text|json",
        "Log line format, on stderr";
    log_level: String [Text] = "info".to_string(), "FILTER",
        "A tracing filter such as info or delayd=debug,warn",
        |v| tracing_subscriber::EnvFilter::try_new(v)
            .map(drop)
            .map_err(|e| format!("{v:?} is not a filter like info or delayd=debug: {e}"));
    /// In milliseconds.
    shutdown_grace: u64 [Duration] = 10_000, "DURATION",
        "On SIGTERM, how long in-flight requests may take";
    recovery: RecoveryMode [Choice<RecoveryMode>] = RecoveryMode::Strict, "strict|truncate",
        "On a bad record inside acknowledged data: refuse to start, or drop from it on";
    // A value name listing both choices would widen --help past its one-line layout.
    check_on_start: StartCheck [Choice<StartCheck>] = StartCheck::AfterCrash, "WHEN",
        "When a start checks the queues and the id index against the log: after_crash or always";
    /// In milliseconds.
    done_retention: u64 [Duration] = DAY_MS, "DURATION",
        "How long a done or cancelled message stays visible to look-ups and retries";
    reclaim: bool [Choice<bool>] = true, "true|false",
        "Delete expired messages, old segments and read queue files";
    max_topics: usize [Count<usize>] = 10_000, "N",
        "Most topics (dead-letter topics included)",
        |v| rule(*v >= 1, || "must be at least 1".into());
    open_queues: usize [Count<usize>] = 1024, "N",
        "Most topic queues with open files at once",
        |v| rule(*v >= 1, || "must be at least 1".into());
    push_allowed_hosts: Option<Vec<String>> [Hosts] = None, "HOSTS",
        "Hosts push subscriptions may deliver to (space-separated); unset (the default): any";
    /// `None` (`auto`): sized from the open-file limit, as each delivery may hold a socket.
    push_max_in_flight: Option<usize> [AutoCount] = None, "N|auto",
        "Most push deliveries under way at once over all subscriptions; auto: from the open-file limit",
        |v| rule(v.is_none_or(|n| (1..=1_000_000).contains(&n)), || {
            format!("{} is outside 1..=1000000 (or auto)", v.unwrap_or_default())
        });
    max_push_subscriptions: usize [Count<usize>] = 1000, "N",
        "Most push subscriptions; a PUT of a new one past it answers 429",
        |v| rule((1..=1_000_000).contains(v), || format!("{v} is outside 1..=1000000"));
    max_connections_per_ip: Option<usize> [OptionalCount] = None, "N",
        "Most connections one client address may hold; unset (the default): half of max_connections",
        |v| rule(v.is_none_or(|n| (1..=1_000_000).contains(&n)), || {
            format!("{} is outside 1..=1000000", v.unwrap_or_default())
        });
    /// In bytes.
    max_body_memory: u64 [Size] = 256 << 20, "SIZE",
        "Most request-body bytes in memory at once; past it, 503 with Retry-After";
    node_id: Option<usize> [OptionalCount] = None, "ID",
        "This node's id in a cluster (1 or more); unset with peers unset: a single node",
        |v| rule(v.is_none_or(|n| (1..=u32::MAX as usize).contains(&n)), || {
            format!("{} is outside 1..=4294967295", v.unwrap_or_default())
        });
    peers: Option<Vec<String>> [Peers] = None, "PEERS",
        "Every node of the cluster, this one included, as ID=HOST:PORT of its cluster address";
    cluster_listen: Option<String> [OptionalText] = None, "ADDR",
        "Address for node-to-node traffic (needed with peers), apart from the client API",
        |v| rule(v.as_ref().is_none_or(|a| a.parse::<SocketAddr>().is_ok()), || {
            format!("{:?} is not an address like 0.0.0.0:9278", v.as_deref().unwrap_or_default())
        });
    cluster_secret: Option<String> [Token] = None, "SECRET",
        "Shared secret every node of the cluster proves it holds (needed with peers)",
        |v| rule(v.as_ref().is_none_or(|s| s.len() >= 16), || "must be at least 16 characters".into());
    advertise_url: Option<String> [OptionalText] = None, "URL",
        "This node's client API URL as other nodes give it to clients; unset: from the bound listen address",
        |v| rule(v.as_ref().is_none_or(|u| u.starts_with("http://") || u.starts_with("https://")), || {
            format!("{:?} is not a URL like http://10.0.0.1:9277", v.as_deref().unwrap_or_default())
        });
    cluster_join: bool [Choice<bool>] = false, "true|false",
        "Start as a new member of a running cluster: wait to be added (delayd-cli cluster add) instead of forming one with peers";
    /// In milliseconds.
    max_clock_skew: u64 [Duration] = 250, "DURATION",
        "A node whose clock runs ahead of the others by more than this does not lead";
}

/// Every key's name, in the order of [`KEY_TABLE`].
pub const KEYS: [&str; KEY_COUNT] = {
    let mut names = [""; KEY_COUNT];
    let mut i = 0;
    while i < names.len() {
        names[i] = KEY_TABLE[i].name;
        i += 1;
    }
    names
};

/// The environment variable that sets `key`: `DELAYD_` and the key in upper case.
pub fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.to_ascii_uppercase())
}

/// The key an environment variable sets, if it names one.
pub fn key_of_env_var(name: &str) -> Option<&'static str> {
    KEYS.iter().copied().find(|k| env_var(k) == name)
}

/// The command-line flag that sets `key`: `--` and the key with dashes.
pub fn flag(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
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
    /// Most messages one pop may take.
    pub max_batch: usize,
    /// Initial slot count of the id index file.
    pub index_initial_slots: u64,
    /// What to do when recovery finds a bad record with valid records after it.
    pub recovery: RecoveryMode,
    /// When the start checks the derived files against the log.
    pub check_on_start: StartCheck,
    /// How long a done or cancelled message stays visible to look-ups and the idempotent produce.
    pub done_retention_ms: u64,
    /// Whether expired messages, old segments and read queue files are deleted at all.
    pub reclaim: bool,
    /// Most topics the broker creates.
    pub max_topics: usize,
    /// Most topic queues whose files are open at once.
    pub open_queues: usize,
    /// Most push deliveries under way at once over every subscription; `None`: sized from the
    /// process's open-file limit when push delivery starts.
    pub push_max_in_flight: Option<usize>,
    /// Most push subscriptions.
    pub max_push_subscriptions: usize,
    /// Apply a request on the thread that parsed it when the engine is free and idle (always on
    /// in the program; off only to measure the hand-off it saves, in `benches/request.rs`).
    #[doc(hidden)]
    pub inline_requests: bool,
    /// In a cluster, the cluster's secret: every node derives the same receipt key from it, so a
    /// receipt handed out by one leader is accepted by the next. `None`: the data directory's own
    /// random key.
    pub receipt_secret: Option<String>,
}

impl BrokerConfig {
    /// The embedded defaults, with data in `data_dir`.
    pub fn with_defaults(data_dir: impl Into<PathBuf>) -> BrokerConfig {
        // One source of defaults: the program's embedded configuration.
        BrokerConfig { data_dir: data_dir.into(), ..Config::default().broker_config() }
    }
}

impl Config {
    /// Builds the configuration from all layers and validates it: the defaults, the file `cli`
    /// names (or `DELAYD_CONFIG` names), every `DELAYD_*` variable of `env`, then the flags of
    /// `cli`. Warnings about ignored variables are dropped; the program uses [`Config::load_noting`].
    pub fn load(cli: &Cli, env: impl IntoIterator<Item = (OsString, OsString)>) -> Result<Config> {
        Config::load_noting(cli, env).map(|(cfg, _)| cfg)
    }

    /// [`Config::load`], also returning one warning per `DELAYD_*` variable that was ignored, for
    /// the caller to log once logging is set up (it is configured by the result).
    pub fn load_noting(
        cli: &Cli,
        env: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Result<(Config, Vec<String>)> {
        // The environment is checked first, so a misspelt variable is reported even when the file
        // has a problem of its own.
        let from_env = env_settings(env)?;
        let file = cli.config.clone().or_else(|| from_env.config_file.clone());
        let mut cfg = match &file {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        for (key, var, value) in &from_env.settings {
            cfg.set(key, value).map_err(|m| Error::Config(format!("{var}: {m}")))?;
        }
        for (key, value) in &cli.flags {
            cfg.set(key, value).map_err(|m| Error::Config(format!("{}: {m}", flag(key))))?;
        }
        cfg.validate()?;
        Ok((cfg, from_env.ignored))
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

    /// Parses TOML text over the defaults. Each key's value goes through the key's one parser (as
    /// the environment's and the flags' do); an error names the line and the key.
    pub fn from_toml(text: &str) -> Result<Config> {
        let line_of = |at: usize| text.get(..at).unwrap_or(text).matches('\n').count() + 1;
        let doc: Vec<(Spanned<String>, toml::Value)> =
            toml::from_str::<BTreeMap<Spanned<String>, toml::Value>>(text)
                .map_err(|e| {
                    let message = e.message().trim();
                    match e.span() {
                        Some(span) => Error::Config(format!("line {}: {message}", line_of(span.start))),
                        None => Error::Config(message.to_string()),
                    }
                })?
                .into_iter()
                .collect();
        let mut cfg = Config::default();
        let mut keys = doc;
        // Report the first bad key in the order the file has them.
        keys.sort_by_key(|(k, _)| k.span().start);
        for (key, value) in &keys {
            let line = line_of(key.span().start);
            let name = key.get_ref().as_str();
            if !KEYS.contains(&name) {
                let hint = closest_key(name).map(|k| format!(" (did you mean {k}?)")).unwrap_or_default();
                return Err(Error::Config(format!("line {line}: unknown key {name}{hint}")));
            }
            cfg.set_toml(name, value).map_err(|m| Error::Config(format!("line {line}: {name}: {m}")))?;
        }
        Ok(cfg)
    }

    /// Applies every `DELAYD_<KEY>` variable of `env`; a `DELAYD_*` variable that looks like a
    /// misspelt key is an error, others are ignored.
    pub fn apply_env(&mut self, env: impl IntoIterator<Item = (OsString, OsString)>) -> Result<()> {
        for (key, var, value) in env_settings(env)?.settings {
            self.set(key, &value).map_err(|m| Error::Config(format!("{var}: {m}")))?;
        }
        Ok(())
    }

    /// Checks every key; the message names the key and the rule it breaks. Each key's own rule is
    /// in its row of the table; the rules here involve several keys.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, msg: String| Err(Error::Config(format!("{key}: {msg}")));
        self.check_each()?;
        validate_levels(&self.levels)?;
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
        if self.max_body_bytes + 4096 > self.segment_bytes {
            return bad(
                "max_body_bytes",
                format!(
                    "{} does not fit in a segment of segment_bytes {}",
                    self.max_body_bytes, self.segment_bytes
                ),
            );
        }
        // One request of the largest size must fit, or such a request could never be served.
        let request_limit = self.max_body_bytes.saturating_add(ENVELOPE_BYTES as u64);
        if self.max_body_memory < request_limit || self.max_body_memory > 1 << 40 {
            return bad(
                "max_body_memory",
                format!(
                    "{} must hold at least one request of max_body_bytes plus 64KiB ({}) and be at most 1TiB",
                    fmt_size(self.max_body_memory),
                    fmt_size(request_limit)
                ),
            );
        }
        self.validate_tokens()?;
        self.validate_cluster()
    }

    /// A read-only token only narrows a full one: alone it would guard nothing, and equal to
    /// `auth_token` it could not be told apart.
    fn validate_tokens(&self) -> Result<()> {
        match (&self.auth_token, &self.read_token) {
            (None, Some(_)) => Err(Error::Config(
                "read_token: needs auth_token; without it every client may change everything".into(),
            )),
            (Some(a), Some(r)) if a == r => {
                Err(Error::Config("read_token: must differ from auth_token".into()))
            }
            _ => Ok(()),
        }
    }

    /// The rules between the cluster keys: all of `node_id`, `cluster_listen` and
    /// `cluster_secret` come with `peers`, and `peers` names this node.
    fn validate_cluster(&self) -> Result<()> {
        let bad = |key: &str, msg: String| Err(Error::Config(format!("{key}: {msg}")));
        let Some(_) = &self.peers else {
            if self.node_id.is_some() {
                return bad(
                    "node_id",
                    "is set but peers is not; set both for a cluster, neither for a single node".into(),
                );
            }
            return Ok(());
        };
        let peers = self.cluster_peers()?;
        let Some(id) = self.node_id else {
            return bad("node_id", "must be set when peers is (this node's id among them)".into());
        };
        if !peers.iter().any(|(p, _)| *p == id as u64) {
            return bad(
                "peers",
                format!("does not name this node's id {id}; list every node, this one included"),
            );
        }
        let Some(listen) = &self.cluster_listen else {
            return bad(
                "cluster_listen",
                "must be set when peers is (the address other nodes reach this one at)".into(),
            );
        };
        // The other nodes reach this one at its peers entry; a different port there is a typo
        // that would leave the node unreachable. (The host may differ: 0.0.0.0 against its IP.)
        let own = peers.iter().find(|(p, _)| *p == id as u64).map(|(_, a)| a.as_str()).unwrap_or_default();
        let port = |a: &str| a.rsplit_once(':').map(|(_, p)| p.to_string());
        if port(own) != port(listen) {
            return bad(
                "cluster_listen",
                format!("{listen} listens on another port than this node's entry in peers ({id}={own})"),
            );
        }
        if self.cluster_secret.is_none() {
            return bad("cluster_secret", "must be set when peers is (every node needs the same one)".into());
        }
        Ok(())
    }

    /// The `peers` list as (id, cluster address) pairs, ids unique; empty for a single node.
    pub fn cluster_peers(&self) -> Result<Vec<(u64, String)>> {
        let mut out: Vec<(u64, String)> = Vec::new();
        for item in self.peers.iter().flatten() {
            let bad = |why: &str| {
                Error::Config(format!("peers: {item:?} {why}; write ID=HOST:PORT, e.g. 1=10.0.0.1:9278"))
            };
            let (id, addr) = item.split_once('=').ok_or_else(|| bad("has no '='"))?;
            let id: u64 = id.trim().parse().map_err(|_| bad("has an id that is not a number"))?;
            if id == 0 || id > u32::MAX as u64 {
                return Err(bad("has an id outside 1..=4294967295"));
            }
            let addr = addr.trim();
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
                _ => return Err(bad("has no HOST:PORT")),
            }
            if out.iter().any(|(p, _)| *p == id) {
                return Err(bad("repeats an id"));
            }
            out.push((id, addr.to_string()));
        }
        out.sort();
        Ok(out)
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
            max_batch: self.max_batch,
            index_initial_slots: self.index_initial_slots,
            recovery: self.recovery,
            check_on_start: self.check_on_start,
            done_retention_ms: self.done_retention,
            reclaim: self.reclaim,
            max_topics: self.max_topics,
            open_queues: self.open_queues,
            push_max_in_flight: self.push_max_in_flight,
            max_push_subscriptions: self.max_push_subscriptions,
            inline_requests: true,
            receipt_secret: self.peers.as_ref().and(self.cluster_secret.clone()),
        }
    }
}

impl Choices for FlushMode {
    const OPTIONS: &'static [(&'static str, FlushMode)] =
        &[("sync", FlushMode::Sync), ("async", FlushMode::Async)];
}

impl Choices for DelayPolicy {
    const OPTIONS: &'static [(&'static str, DelayPolicy)] =
        &[("chain", DelayPolicy::Chain), ("round", DelayPolicy::Round)];
}

impl Choices for LogFormat {
    const OPTIONS: &'static [(&'static str, LogFormat)] =
        &[("text", LogFormat::Text), ("json", LogFormat::Json)];
}

impl Choices for StartCheck {
    const OPTIONS: &'static [(&'static str, StartCheck)] =
        &[("after_crash", StartCheck::AfterCrash), ("always", StartCheck::Always)];
}

impl Choices for RecoveryMode {
    const OPTIONS: &'static [(&'static str, RecoveryMode)] =
        &[("strict", RecoveryMode::Strict), ("truncate", RecoveryMode::Truncate)];
}

/// A key's rule: `Ok` when `ok`, else the message `why` gives.
fn rule(ok: bool, why: impl FnOnce() -> String) -> std::result::Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(why())
    }
}

/// The rule of the HTTP timeouts: 1ms to 1d.
fn timeout(ms: u64) -> std::result::Result<(), String> {
    rule((1..=DAY_MS).contains(&ms), || format!("{} is outside 1ms..=1d", fmt_ms(ms)))
}

/// The variable that names the config file when `--config` is not given.
pub const CONFIG_ENV_VAR: &str = "DELAYD_CONFIG";

/// `DELAYD_*` variables of delayd's own other programs, ignored without a word: delayd-cli's
/// server address (its token variable is the server's own `DELAYD_AUTH_TOKEN`).
const OTHER_PROGRAMS_VARS: [&str; 1] = ["DELAYD_URL"];

/// What the `DELAYD_*` variables of an environment say.
#[derive(Debug, Default)]
struct EnvSettings {
    /// `(key, variable, value)` of every key variable, in the order of [`KEYS`].
    settings: Vec<(&'static str, String, String)>,
    /// The config file `DELAYD_CONFIG` names.
    config_file: Option<PathBuf>,
    /// One warning per variable that is no setting and not near one.
    ignored: Vec<String>,
}

/// Reads the `DELAYD_*` variables of `env`. A variable that names no key but is close to one is
/// an error, as an unknown key in the file is: a typo must not quietly leave the default in
/// force. One that is close to none belongs to something else (a script's `DELAYD_BIN`, a
/// wrapper's settings): it is ignored with a warning, since refusing it would stop delayd over
/// variables it has no say in.
fn env_settings(env: impl IntoIterator<Item = (OsString, OsString)>) -> Result<EnvSettings> {
    let mut out = EnvSettings::default();
    let mut misspelt = Vec::new();
    for (name, value) in env {
        if !name.as_encoded_bytes().starts_with(ENV_PREFIX.as_bytes()) {
            continue;
        }
        let name = name.to_string_lossy().into_owned();
        if name == CONFIG_ENV_VAR {
            out.config_file = Some(PathBuf::from(value));
            continue;
        }
        let Some(key) = key_of_env_var(&name) else {
            if OTHER_PROGRAMS_VARS.contains(&name.as_str()) {
                continue;
            }
            match closest_env_var(&name) {
                Some(near) => misspelt.push(format!("{name} (did you mean {near}?)")),
                None => out.ignored.push(format!(
                    "ignoring environment variable {name}: no such setting (`delayd --help` lists every DELAYD_ variable)"
                )),
            }
            continue;
        };
        let value =
            value.into_string().map_err(|_| Error::Config(format!("{name}: the value is not UTF-8")))?;
        out.settings.push((key, name, value));
    }
    if !misspelt.is_empty() {
        // The environment comes in no particular order; sort so the message is stable.
        misspelt.sort();
        let s = if misspelt.len() == 1 { "" } else { "s" };
        return Err(Error::Config(format!(
            "unknown environment variable{s} {}: no such setting (`delayd --help` lists every DELAYD_ variable)",
            misspelt.join(", ")
        )));
    }
    out.ignored.sort();
    out.settings.sort_by_key(|(key, ..)| KEYS.iter().position(|k| k == key));
    Ok(out)
}

/// The key variable most like `name`, if one is close enough to be the likely meaning.
fn closest_env_var(name: &str) -> Option<String> {
    closest_key(&name.get(ENV_PREFIX.len()..)?.to_ascii_lowercase()).map(env_var)
}

/// The key most like `typed`, if one is close enough to be the likely meaning.
fn closest_key(typed: &str) -> Option<&'static str> {
    KEYS.iter()
        .map(|k| (strsim::jaro_winkler(typed, k), *k))
        .filter(|(score, _)| *score > 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs.iter().map(|(k, v)| (k.into(), v.into())).collect()
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
        assert_eq!(c.push_max_in_flight, None);
        assert_eq!(c.max_push_subscriptions, 1000);
        assert_eq!(c.levels.len(), 21);
        assert_eq!(c.levels[0], 1000);
        assert_eq!(*c.levels.last().unwrap(), 86_400_000);
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
        assert_eq!(c.max_connections, 10_000);
        assert_eq!(c.max_connections_per_ip, None);
        assert_eq!(c.max_body_memory, 256 << 20);
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
        assert!(e.contains("line 1: max_delay: \"1 fortnight\" is not a duration"), "{e}");
        let e = Config::from_toml("\nsegment_bytes = \"4 parsecs\"\n").unwrap_err().to_string();
        assert!(e.contains("line 2: segment_bytes: \"4 parsecs\" is not a size"), "{e}");
        let e = Config::from_toml("max_delay = -5\n").unwrap_err().to_string();
        assert!(e.contains("negative"), "{e}");
        // A misspelt key gets the near one; a value of a type the key does not take says both.
        let e = Config::from_toml("max_dealy = \"1d\"\n").unwrap_err().to_string();
        assert!(e.contains("line 1: unknown key max_dealy (did you mean max_delay?)"), "{e}");
        let e = Config::from_toml("max_batch = true\n").unwrap_err().to_string();
        assert!(e.contains("line 1: max_batch: expected a number, found the boolean true"), "{e}");
        let e = Config::from_toml("levels = [\"1s\", true]\n").unwrap_err().to_string();
        assert!(e.contains("levels: expected a list of durations"), "{e}");
        let e = Config::from_toml("flush = 1\n").unwrap_err().to_string();
        assert!(e.contains("flush: expected one of sync, async, found the integer 1"), "{e}");
        let e = Config::from_toml("[server]\nlisten = \"127.0.0.1:1\"\n").unwrap_err().to_string();
        assert!(e.contains("line 1: unknown key server"), "{e}");
    }

    /// One parser per key: a value written as a TOML string reads as the same value, or fails with
    /// the same message, as when the environment or a flag gives it.
    #[test]
    fn every_key_reads_text_the_same_from_the_file_and_the_environment() {
        let samples = [
            "",
            "  ",
            "0",
            "1",
            "7",
            "-5",
            "1_000",
            "9999999999",
            "99999999999999999999",
            "1.5",
            "2s",
            "1h30m",
            "1s 5s",
            "1s,5s",
            "4MiB",
            "4MB",
            "4 parsecs",
            "auto",
            "unlimited",
            "AUTO",
            "on",
            "off",
            "TRUE",
            "ASYNC",
            "sync",
            "Round",
            "truncate",
            "json",
            "a.example b.example",
            "127.0.0.1:1",
            "debug",
            "soon",
        ];
        for key in KEYS {
            for text in samples {
                let mut from_env = Config::default();
                let env = from_env.set(key, text).map(|()| from_env);
                let file = Config::from_toml(&format!("{key} = {text:?}\n"));
                match (env, file) {
                    (Ok(a), Ok(b)) => assert_eq!(a, b, "{key} = {text:?}"),
                    (Err(a), Err(b)) => assert_eq!(b.to_string(), format!("config: line 1: {key}: {a}")),
                    (a, b) => panic!("{key} = {text:?}: environment {a:?}, file {b:?}"),
                }
            }
        }
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
        let cli = Cli { config: Some(file), flags: vec![("listen", "127.0.0.1:3000".into())] };
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
    fn delayd_config_names_the_file_and_the_flag_beats_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.toml"), dir.path().join("b.toml"));
        std::fs::write(&a, "max_batch = 7\n").unwrap();
        std::fs::write(&b, "max_batch = 9\n").unwrap();
        let from_env = env(&[("DELAYD_CONFIG", a.to_str().unwrap())]);
        assert_eq!(Config::load(&Cli::default(), from_env.clone()).unwrap().max_batch, 7);
        let cli = Cli { config: Some(b), flags: vec![] };
        assert_eq!(Config::load(&cli, from_env).unwrap().max_batch, 9);
        let missing = env(&[("DELAYD_CONFIG", "/nonexistent/delayd.toml")]);
        let e = Config::load(&Cli::default(), missing).unwrap_err().to_string();
        assert!(e.contains("cannot read config file /nonexistent/delayd.toml"), "{e}");
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
            ("compat_max_attempts", "5"),
            ("auth_token", "t"),
            ("read_token", "r"),
            ("max_connections", "5"),
            ("http_header_timeout", "2s"),
            ("http_idle_timeout", "1m"),
            ("http_body_timeout", "1500ms"),
            ("log_format", "json"),
            ("log_level", "debug"),
            ("shutdown_grace", "1s"),
            ("recovery", "Truncate"),
            ("check_on_start", "always"),
            ("done_retention", "3s"),
            ("reclaim", "off"),
            ("max_topics", "7"),
            ("open_queues", "3"),
            ("push_allowed_hosts", "Hooks.Example,127.0.0.1"),
            ("push_max_in_flight", "64"),
            ("max_push_subscriptions", "9"),
            ("max_connections_per_ip", "4"),
            ("max_body_memory", "1MiB"),
            ("node_id", "2"),
            ("peers", "1=127.0.0.1:9001, 2=127.0.0.1:9002"),
            ("cluster_listen", "127.0.0.1:9002"),
            ("cluster_secret", "0123456789abcdef"),
            ("advertise_url", "http://127.0.0.1:1"),
            ("cluster_join", "true"),
            ("max_clock_skew", "100ms"),
        ];
        assert_eq!(values.len(), KEYS.len());
        let vars: Vec<(String, String)> = values
            .iter()
            .map(|(k, v)| (format!("DELAYD_{}", k.to_ascii_uppercase()), v.to_string()))
            .collect();
        c.apply_env(vars.iter().map(|(k, v)| (k.into(), v.into()))).unwrap();
        let expected = Config {
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
            compat_max_attempts: Some(5),
            auth_token: Some("t".into()),
            read_token: Some("r".into()),
            max_connections: 5,
            http_header_timeout: 2000,
            http_idle_timeout: 60_000,
            http_body_timeout: 1500,
            log_format: LogFormat::Json,
            log_level: "debug".into(),
            shutdown_grace: 1000,
            recovery: RecoveryMode::Truncate,
            check_on_start: StartCheck::Always,
            done_retention: 3000,
            reclaim: false,
            max_topics: 7,
            open_queues: 3,
            push_allowed_hosts: Some(vec!["hooks.example".into(), "127.0.0.1".into()]),
            push_max_in_flight: Some(64),
            max_push_subscriptions: 9,
            max_connections_per_ip: Some(4),
            max_body_memory: 1 << 20,
            node_id: Some(2),
            peers: Some(vec!["1=127.0.0.1:9001".into(), "2=127.0.0.1:9002".into()]),
            cluster_listen: Some("127.0.0.1:9002".into()),
            cluster_secret: Some("0123456789abcdef".into()),
            advertise_url: Some("http://127.0.0.1:1".into()),
            cluster_join: true,
            max_clock_skew: 100,
        };
        assert_eq!(c, expected);
        c.validate().unwrap();
    }

    #[test]
    fn every_key_reads_back_what_get_shows() {
        let mut changed = Config::default();
        for (key, value) in [
            ("levels", "1s 1h30m"),
            ("segment_bytes", "4MB"),
            ("auth_token", "t"),
            ("read_token", "r"),
            ("reclaim", "off"),
            ("push_allowed_hosts", "a.example b.example"),
            ("push_max_in_flight", "12"),
            ("max_push_subscriptions", "5"),
            ("max_connections_per_ip", "7"),
            ("max_body_memory", "64MiB"),
            ("node_id", "3"),
            ("peers", "1=a:1 3=b:2"),
            ("cluster_listen", "127.0.0.1:2"),
            ("cluster_secret", "0123456789abcdef"),
            ("advertise_url", "http://b:9277"),
            ("max_clock_skew", "1s"),
        ] {
            changed.set(key, value).unwrap();
        }
        for original in [Config::default(), changed] {
            let mut c = Config {
                auth_token: Some("other".into()),
                read_token: Some("other-read".into()),
                push_allowed_hosts: Some(vec!["other".into()]),
                max_connections_per_ip: Some(99),
                node_id: Some(9),
                peers: Some(vec!["9=other:1".into()]),
                cluster_listen: Some("127.0.0.1:9".into()),
                cluster_secret: Some("another-secret-16".into()),
                advertise_url: Some("http://other".into()),
                ..Config::default()
            };
            // The keys that may be unset show nothing then.
            for key in KEYS {
                match (original.get(key), key) {
                    (Some(v), _) => c.set(key, &v).unwrap_or_else(|e| panic!("{key}={v:?}: {e}")),
                    (None, "auth_token") => c.auth_token = None,
                    (None, "read_token") => c.read_token = None,
                    (None, "max_connections_per_ip") => c.max_connections_per_ip = None,
                    (None, "push_allowed_hosts") => c.push_allowed_hosts = None,
                    (None, "node_id") => c.node_id = None,
                    (None, "peers") => c.peers = None,
                    (None, "cluster_listen") => c.cluster_listen = None,
                    (None, "cluster_secret") => c.cluster_secret = None,
                    (None, "advertise_url") => c.advertise_url = None,
                    (None, other) => panic!("{other} shows nothing but is not known to be optional"),
                }
            }
            assert_eq!(c, original);
        }
        assert_eq!(Config::default().get("segment_bytes").as_deref(), Some("64MiB"));
        assert_eq!(Config::default().get("auth_token"), None);
        assert_eq!(Config::default().get("no_such_key"), None);
    }

    #[test]
    fn a_read_token_needs_a_different_auth_token() {
        let only_read = Config { read_token: Some("r".into()), ..Config::default() };
        let e = only_read.validate().unwrap_err().to_string();
        assert!(e.contains("read_token") && e.contains("needs auth_token"), "{e}");
        let same = Config { auth_token: Some("t".into()), read_token: Some("t".into()), ..Config::default() };
        let e = same.validate().unwrap_err().to_string();
        assert!(e.contains("read_token") && e.contains("differ"), "{e}");
        let both = Config { auth_token: Some("t".into()), read_token: Some("r".into()), ..Config::default() };
        both.validate().unwrap();
        let e = Config::from_toml("read_token = \"\"\n").unwrap_err().to_string();
        assert!(e.contains("read_token") && e.contains("must not be empty"), "{e}");
    }

    #[test]
    fn an_empty_auth_token_is_an_error_everywhere() {
        let e = Config::load(&Cli::default(), env(&[("DELAYD_AUTH_TOKEN", "")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_AUTH_TOKEN") && e.contains("must not be empty"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_AUTH_TOKEN", "  ")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_AUTH_TOKEN") && e.contains("must not be empty"), "{e}");
        let cli = Cli { config: None, flags: vec![("auth_token", String::new())] };
        let e = Config::load(&cli, env(&[])).unwrap_err().to_string();
        assert!(e.contains("--auth-token") && e.contains("must not be empty"), "{e}");
        // The file's value goes through the same parser as the environment's: refused as it is read.
        let e = Config::from_toml("auth_token = \"\"\n").unwrap_err().to_string();
        assert!(e.contains("auth_token") && e.contains("must not be empty"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.toml");
        std::fs::write(&file, "auth_token = \"\"\n").unwrap();
        let e = Config::load(&Cli { config: Some(file), flags: vec![] }, env(&[])).unwrap_err().to_string();
        assert!(e.contains("auth_token") && e.contains("must not be empty"), "{e}");
    }

    #[test]
    fn misspelt_environment_variables_stop_the_start_others_are_ignored() {
        let e = Config::load(&Cli::default(), env(&[("DELAYD_FLUSHH", "async")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_FLUSHH") && e.contains("did you mean DELAYD_FLUSH?"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_flush", "async")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_flush (did you mean DELAYD_FLUSH?)"), "{e}");
        // Several misspellings: all named, in a stable order.
        let e = Config::load(&Cli::default(), env(&[("DELAYD_FLUSHH", "1"), ("DELAYD_LEVLES", "1s")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("variables DELAYD_FLUSHH (did you mean DELAYD_FLUSH?), DELAYD_LEVLES"), "{e}");
        // Nothing near: another program's variable, ignored with a warning that names it.
        let (c, warnings) = Config::load_noting(
            &Cli::default(),
            env(&[
                ("DELAYD_ZZZ", "1"),
                ("DELAYD_BIN", "/x"),
                ("DELAYD_URL", "http://h"),
                ("DELAYD_FLUSH", "async"),
            ]),
        )
        .unwrap();
        assert_eq!(c.flush, FlushMode::Async);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("DELAYD_BIN") && warnings[1].contains("DELAYD_ZZZ"), "{warnings:?}");
        assert!(!warnings.iter().any(|w| w.contains("did you mean")), "{warnings:?}");
        // Other programs' variables are none of delayd's business.
        let c = Config::load(
            &Cli::default(),
            env(&[("PATH", "/bin"), ("DELAYDX", "1"), ("DELAYD_FLUSH", "async")]),
        )
        .unwrap();
        assert_eq!(c.flush, FlushMode::Async);
    }

    #[test]
    fn non_utf8_environment_is_an_error_not_a_panic() {
        use std::os::unix::ffi::OsStringExt;
        let bad = OsString::from_vec(vec![0xff, 0xfe]);
        let e = Config::load(&Cli::default(), vec![("DELAYD_LISTEN".into(), bad.clone())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DELAYD_LISTEN") && e.contains("not UTF-8"), "{e}");
        let mut name = b"DELAYD_".to_vec();
        name.push(0xff);
        let (_, warnings) =
            Config::load_noting(&Cli::default(), vec![(OsString::from_vec(name), "1".into())])
                .expect("a name that is near no key is another program's: ignored");
        assert!(
            warnings.len() == 1 && warnings[0].contains("ignoring environment variable DELAYD_"),
            "{warnings:?}"
        );
        // Not ours: ignored, whatever its bytes.
        assert!(Config::load(&Cli::default(), vec![(bad.clone(), bad)]).is_ok());
    }

    #[test]
    fn env_errors_name_the_variable() {
        let e = Config::load(&Cli::default(), env(&[("DELAYD_MAX_DELAY", "soon")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_MAX_DELAY"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_FLUSH", "maybe")])).unwrap_err().to_string();
        assert!(e.contains("DELAYD_FLUSH: \"maybe\" is not one of sync, async"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_SEGMENT_BYTES", "4 parsecs")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("DELAYD_SEGMENT_BYTES: \"4 parsecs\" is not a size"), "{e}");
        let e = Config::load(&Cli::default(), env(&[("DELAYD_MAX_ATTEMPTS", "9999999999")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("DELAYD_MAX_ATTEMPTS: \"9999999999\" is too large"), "{e}");
        let cli = Cli { config: None, flags: vec![("max_delay", "1 fortnight".into())] };
        let e = Config::load(&cli, env(&[])).unwrap_err().to_string();
        assert!(e.contains("--max-delay: \"1 fortnight\" is not a duration"), "{e}");
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
            ("max_connections", Box::new(|c| c.max_connections = 0)),
            ("max_connections_per_ip", Box::new(|c| c.max_connections_per_ip = Some(0))),
            ("max_body_memory", Box::new(|c| c.max_body_memory = c.max_body_bytes)),
            ("http_header_timeout", Box::new(|c| c.http_header_timeout = 0)),
            ("http_idle_timeout", Box::new(|c| c.http_idle_timeout = 0)),
            ("http_body_timeout", Box::new(|c| c.http_body_timeout = DAY_MS + 1)),
            ("auth_token", Box::new(|c| c.auth_token = Some("a b".into()))),
            ("log_level", Box::new(|c| c.log_level = "[[[".into())),
            ("push_max_in_flight", Box::new(|c| c.push_max_in_flight = Some(0))),
            ("max_push_subscriptions", Box::new(|c| c.max_push_subscriptions = 0)),
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
    fn cluster_keys_come_together_and_name_this_node() {
        let with = |pairs: &[(&str, &str)]| {
            let mut c = Config::default();
            for (k, v) in pairs {
                c.set(k, v).unwrap();
            }
            c.validate().err().map(|e| e.to_string())
        };
        let full: Vec<(&str, &str)> = vec![
            ("node_id", "1"),
            ("peers", "1=10.0.0.1:9278 2=10.0.0.2:9278,3=node-c:9278"),
            ("cluster_listen", "0.0.0.0:9278"),
            ("cluster_secret", "a-secret-of-16-chars"),
        ];
        assert_eq!(with(&full), None);
        let c = {
            let mut c = Config::default();
            for (k, v) in &full {
                c.set(k, v).unwrap();
            }
            c
        };
        assert_eq!(
            c.cluster_peers().unwrap(),
            vec![(1, "10.0.0.1:9278".into()), (2, "10.0.0.2:9278".into()), (3, "node-c:9278".into())]
        );
        assert_eq!(c.broker_config().receipt_secret.as_deref(), Some("a-secret-of-16-chars"));
        let err =
            |drop_key: &str| with(&full.iter().copied().filter(|(k, _)| *k != drop_key).collect::<Vec<_>>());
        assert!(err("node_id").unwrap().contains("node_id: must be set"), "{:?}", err("node_id"));
        assert!(
            err("cluster_listen").unwrap().starts_with("config: cluster_listen"),
            "{:?}",
            err("cluster_listen")
        );
        assert!(err("cluster_secret").unwrap().contains("cluster_secret"));
        assert!(with(&[("node_id", "1")]).unwrap().contains("peers is not"));
        let mut other = full.clone();
        other[0] = ("node_id", "4");
        assert!(with(&other).unwrap().contains("does not name this node's id 4"));
        for bad in ["1=", "x=a:1", "0=a:1", "1=a:1 1=b:2", "1=a", "1=a:0"] {
            let mut p = full.clone();
            p[1] = ("peers", bad);
            assert!(with(&p).unwrap().contains("peers:"), "{bad}: {:?}", with(&p));
        }
        let mut other_port = full.clone();
        other_port[2] = ("cluster_listen", "0.0.0.0:9279");
        assert!(with(&other_port).unwrap().contains("another port than this node's entry in peers"));
        let mut c = Config::default();
        assert!(c.set("cluster_secret", "short").is_ok());
        assert!(c.validate().unwrap_err().to_string().contains("at least 16"));
    }

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
            max_batch,
            index_initial_slots,
            recovery,
            check_on_start,
            done_retention_ms,
            reclaim,
            max_topics,
            open_queues,
            push_max_in_flight,
            max_push_subscriptions,
            inline_requests,
            receipt_secret,
        } = b;
        assert!(inline_requests);
        assert_eq!(receipt_secret, None);
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
        assert_eq!(max_batch, c.max_batch);
        assert_eq!(index_initial_slots, c.index_initial_slots);
        assert_eq!(recovery, c.recovery);
        assert_eq!(check_on_start, c.check_on_start);
        assert_eq!(done_retention_ms, c.done_retention);
        assert_eq!(reclaim, c.reclaim);
        assert_eq!(max_topics, c.max_topics);
        assert_eq!(open_queues, c.open_queues);
        assert_eq!(push_max_in_flight, c.push_max_in_flight);
        assert_eq!(max_push_subscriptions, c.max_push_subscriptions);
    }
}
