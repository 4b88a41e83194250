//! `delayd-cli`: a command-line client for delayd's native HTTP API (`/v1`).
//!
//! Every command is one HTTP request. With `--json` the API's JSON answer is printed as is on
//! stdout, for scripts; otherwise a small aligned table or a sentence. Exit codes: 0 success,
//! 1 the API answered with an error (its code and message go to stderr), 2 usage or input error,
//! 3 the server could not be reached or did not answer.
//!
//! In a cluster any node may be given: a follower's `307`/`308` redirect to the leader is followed
//! (the same method, body and token), and a `503 no_leader` during an election is waited out.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use delayd::config::units::{parse_duration, parse_duration_list, parse_u64};
use hyper::Method;
use serde_json::{json, Value};
use url::Url;

mod api;
mod show;

use api::*;
use show::*;

/// Command-line client for the delayd delay-message broker.
#[derive(Debug, Parser)]
#[command(name = "delayd-cli", version, after_help = EXIT_CODES)]
struct Cli {
    /// Base URL of the delayd server.
    #[arg(
        long,
        env = "DELAYD_URL",
        default_value = "http://127.0.0.1:9277",
        value_parser = parse_base_url,
        global = true,
        help_heading = "Global options"
    )]
    url: Url,

    /// Bearer token, when the server has auth_token set.
    // The value is a secret: keep it out of `--help`, which would otherwise show the variable's value.
    #[arg(
        long,
        env = "DELAYD_AUTH_TOKEN",
        hide_env_values = true,
        global = true,
        help_heading = "Global options"
    )]
    token: Option<String>,

    /// Print the API's JSON answer on stdout instead of a table.
    #[arg(long, global = true, help_heading = "Global options")]
    json: bool,

    /// Say on stderr where requests went: redirects to the leader, waits for an election.
    #[arg(short, long, global = true, help_heading = "Global options")]
    verbose: bool,

    #[command(subcommand)]
    command: Command,
}

const EXIT_CODES: &str = "Exit codes: 0 success; 1 the API answered with an error (code and message on \
stderr); 2 usage or input error; 3 the server could not be reached or did not answer.\n\
Durations: 500ms, 30s, 1h30m, 2d, or a plain number of milliseconds; --delay needs a unit (0 alone \
means now).";

#[derive(Debug, Subcommand)]
enum Command {
    /// Produce a message (BODY `-` reads it from stdin, byte for byte).
    Produce(Produce),
    /// Pop ready messages, reserving each for its time-to-run.
    Pop {
        /// Topic to pop from.
        topic: String,
        /// Most messages to return (the server's default is 1).
        #[arg(long)]
        max: Option<u64>,
        /// Wait this long for a message when none is ready (capped by the server's max_wait).
        #[arg(long, value_parser = parse_duration)]
        wait: Option<u64>,
        /// Reserve the popped messages for this long instead of their own time-to-run.
        #[arg(long, value_parser = parse_duration)]
        ttr: Option<u64>,
    },
    /// Acknowledge a delivery: the message is done.
    Ack {
        /// Receipt from the pop.
        receipt: String,
    },
    /// Extend a reservation for a long job; the receipt stays valid.
    Touch {
        /// Receipt from the pop.
        receipt: String,
        /// The reservation now ends this long from now (30s, 10m).
        #[arg(long, value_parser = parse_duration)]
        ttr: u64,
    },
    /// Give a delivery back for a retry (or dead-lettering once its attempts are used up).
    Nack {
        /// Receipt from the pop.
        receipt: String,
        /// Retry after this long, with a unit (30s, 500ms), instead of the next backoff step.
        #[arg(long, value_parser = parse_delay)]
        delay: Option<u64>,
        /// Why the work failed, kept as the message's last error (`get` shows it).
        #[arg(long)]
        error: Option<String>,
    },
    /// Show one message.
    Get {
        /// Message id.
        id: String,
    },
    /// Move a pending message to a new due time, keeping its id (--delay 0 delivers it now).
    Reschedule(Reschedule),
    /// Cancel a message that has not been acked.
    Cancel {
        /// Message id.
        id: String,
    },
    /// Show the broker's levels, topics and storage counters.
    Stats,
    /// List every topic with its counts and whether it is paused.
    Topics,
    /// List a topic's messages.
    Browse {
        /// Topic to list.
        topic: String,
        /// Only messages in this state.
        #[arg(long)]
        state: Option<String>,
        /// Most messages to list.
        #[arg(long)]
        limit: Option<u64>,
        /// Continue from the `next_cursor` of an earlier page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Move dead-lettered messages of TOPIC back to it.
    Redrive {
        /// Topic whose dead letters to move back (`orders.dlq` is taken as `orders`).
        topic: String,
        /// Only these message ids (repeatable); all of them when not given.
        #[arg(long = "id")]
        ids: Vec<String>,
    },
    /// Cancel every delayed, ready and reserved message of a topic (asks for --yes).
    Purge {
        /// Topic to purge.
        topic: String,
        /// Do it: without this flag nothing is purged.
        #[arg(long)]
        yes: bool,
    },
    /// Stop pops from a topic (messages keep coming due).
    Pause {
        /// Topic to pause.
        topic: String,
    },
    /// Let pops from a paused topic go on.
    Resume {
        /// Topic to resume.
        topic: String,
    },
    /// Copy the server's data directory while it runs (single node only); restore by starting a
    /// broker with --data-dir DIR (docs/backup.md).
    Backup {
        /// Directory to copy into, on the server's machine, not this one: an absolute path, absent
        /// or empty, outside the data directory.
        #[arg(long, value_name = "DIR", value_parser = parse_backup_dir)]
        to: String,
    },
    /// Show a topic's flow control, or set it (any limit given) or remove it (--clear). It limits
    /// pops and push deliveries of the topic alike.
    Flow(Flow),
    /// Inspect or change the cluster this node belongs to.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
}

/// Subcommands of `cluster`.
#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Show the leader, the term and every node with its role (`*` marks the node that answered).
    Status,
    /// Add a node (started with cluster_join = true): it joins as a learner and becomes a voter
    /// once it has caught up.
    Add {
        /// The new node's id.
        node_id: u64,
        /// Its cluster address, HOST:PORT of its cluster_listen.
        cluster_addr: String,
    },
    /// Remove a node; it stops. Removing the leader hands its lead over first.
    Remove {
        /// The node to remove.
        node_id: u64,
    },
}

/// Arguments of `produce`.
#[derive(Debug, Args)]
struct Produce {
    /// Topic to produce to.
    topic: String,
    /// Message body; `-` reads it from stdin.
    body: String,
    /// Message id (the broker makes one when not given).
    #[arg(long)]
    id: Option<String>,
    /// Deliver after this long, with a unit: 500ms, 5s, 1h30m (0 alone means now).
    #[arg(long, value_parser = parse_delay, group = "when")]
    delay: Option<u64>,
    /// Deliver at this time: unix milliseconds or an RFC 3339 time (2026-12-01T09:00:00Z,
    /// 2026-12-01T09:00:00.250+02:00).
    #[arg(long, value_parser = unix_ms, group = "when")]
    at: Option<u64>,
    /// Deliver after this configured delay level: a 1-based index or its duration (1m).
    #[arg(long, group = "when")]
    level: Option<String>,
    /// Time-to-run: how long a pop reserves the message before it comes back.
    #[arg(long, value_parser = parse_duration)]
    ttr: Option<u64>,
    /// Deliveries before the message is dead-lettered.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Retry delays after each nack, e.g. "1m 5m 30m".
    #[arg(long, value_parser = backoff_ms)]
    backoff: Option<Backoff>,
}

/// Arguments of `flow`.
#[derive(Debug, Args)]
struct Flow {
    /// The topic.
    topic: String,
    /// Deliveries per second at most (a token bucket's rate).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_per_second: Option<u32>,
    /// Deliveries at once after a quiet spell (default: --max-per-second).
    #[arg(long, requires = "max_per_second", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    burst: Option<u32>,
    /// Messages of the topic reserved (popped, not acked) at once at most.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_reserved: Option<u32>,
    /// Remove the topic's flow control.
    #[arg(long, conflicts_with_all = ["max_per_second", "burst", "max_reserved"])]
    clear: bool,
}

/// Arguments of `reschedule`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("when").required(true)))]
struct Reschedule {
    /// Message id.
    id: String,
    /// Deliver after this long from now, with a unit: 500ms, 5s, 1h30m (0 alone means now).
    #[arg(long, value_parser = parse_delay, group = "when")]
    delay: Option<u64>,
    /// Deliver at this time: unix milliseconds or an RFC 3339 time (2026-12-01T09:00:00Z,
    /// 2026-12-01T09:00:00.250+02:00).
    #[arg(long, value_parser = unix_ms, group = "when")]
    at: Option<u64>,
    /// A new time-to-run for its later deliveries.
    #[arg(long, value_parser = parse_duration)]
    ttr: Option<u64>,
    /// A new limit of deliveries before it is dead-lettered.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Also move a message a consumer holds reserved (its receipt stops working).
    #[arg(long)]
    force: bool,
}

/// `PATCH /v1/messages/{id}` with the fields `r` gives.
fn reschedule(api: &Api, r: Reschedule) -> Result<Answer, Failure> {
    let mut body = json!({});
    if let Some(d) = r.delay {
        body["delay_ms"] = json!(d);
    }
    if let Some(at) = r.at {
        body["deliver_at_ms"] = json!(at);
    }
    if let Some(t) = r.ttr {
        body["ttr_ms"] = json!(t);
    }
    if let Some(m) = r.max_attempts {
        body["max_attempts"] = json!(m);
    }
    if r.force {
        body["force"] = json!(true);
    }
    api.call(Method::PATCH, &["v1", "messages", &r.id], &[], Some(&body), Duration::ZERO)
}

/// `--backoff` as milliseconds; a newtype, as clap would take a bare `Vec` for a repeatable flag.
#[derive(Debug, Clone)]
struct Backoff(Vec<u64>);

fn backoff_ms(s: &str) -> Result<Backoff, String> {
    let steps = parse_duration_list(s)?;
    if steps.is_empty() {
        return Err("give at least one duration, e.g. \"1m 5m\"".into());
    }
    Ok(Backoff(steps))
}

/// A delay with a unit. A bare number is refused (except 0, which is now in any unit): ouqiang's
/// `delay` is seconds and delayd's is milliseconds, so `--delay 5` would silently mean either.
fn parse_delay(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
        return match parse_u64(t)? {
            0 => Ok(0),
            n => Err(format!("{t:?} has no unit: add one, e.g. {n}s for seconds or {n}ms for milliseconds")),
        };
    }
    parse_duration(s)
}

/// A plain number is unix ms; anything else must be an RFC 3339 time, with `Z`, a `±HH:MM` offset
/// or none (UTC).
fn unix_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
        return parse_u64(s);
    }
    // humantime reads UTC only: the offset is taken off here and applied after.
    let (local, offset_s) = split_offset(t).map_err(|e| format!("{s:?}: {e}"))?;
    let at = humantime::parse_rfc3339_weak(&local.to_ascii_uppercase())
        .map_err(|e| format!("{s:?} is neither unix milliseconds nor an RFC 3339 time ({e})"))?;
    let utc = if offset_s >= 0 {
        at.checked_sub(Duration::from_secs(offset_s.unsigned_abs()))
    } else {
        at.checked_add(Duration::from_secs(offset_s.unsigned_abs()))
    };
    let d =
        utc.and_then(|u| u.duration_since(UNIX_EPOCH).ok()).ok_or_else(|| format!("{s:?} is before 1970"))?;
    u64::try_from(d.as_millis()).map_err(|_| format!("{s:?} is too far ahead"))
}

/// Splits a trailing RFC 3339 `±HH:MM` offset off a date-time: (the rest, the offset in seconds
/// east of UTC); a time without one is returned whole with 0.
fn split_offset(t: &str) -> Result<(&str, i64), String> {
    // The offset follows `YYYY-MM-DDTHH:MM:SS` (19 bytes), so the date's own `-` never matches.
    let Some(cut) = t.len().checked_sub(6).filter(|c| *c >= 19 && t.is_char_boundary(*c)) else {
        return Ok((t, 0));
    };
    let (rest, off) = t.split_at(cut);
    let b = off.as_bytes();
    let sign = match b[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return Ok((t, 0)),
    };
    let digits =
        |x: &[u8]| x.iter().all(u8::is_ascii_digit).then(|| i64::from((x[0] - b'0') * 10 + (x[1] - b'0')));
    match (digits(&b[1..3]), b[3], digits(&b[4..6])) {
        (Some(h), b':', Some(m)) if h <= 23 && m <= 59 => Ok((rest, sign * (h * 3600 + m * 60))),
        _ => Err(format!("{off:?} is not a UTC offset of the form +HH:MM")),
    }
}

fn parse_base_url(s: &str) -> Result<Url, String> {
    let url = Url::parse(s).map_err(|e| format!("{s:?} is not a URL ({e})"))?;
    // The client here speaks plain HTTP only, as delayd itself does.
    if url.scheme() != "http" {
        return Err(format!("{s:?}: only http:// URLs are supported"));
    }
    if url.cannot_be_a_base() || url.host().is_none() {
        return Err(format!("{s:?} has no host"));
    }
    Ok(url)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let result = Api::new(cli.url, cli.token, cli.verbose).and_then(|api| run(&api, cli.command));
    match result {
        Ok(output) => {
            let out = if json {
                // The API's document as sent; an empty body (pause, resume) prints as `{}`.
                let text = output.text.trim();
                format!("{}\n", if text.is_empty() { "{}" } else { text })
            } else {
                output.human
            };
            write_stdout(&out)
        }
        Err(f) => {
            eprintln!("{}", f.message());
            f.exit_code()
        }
    }
}

/// Writes without panicking when stdout is closed early (`delayd-cli stats | head -1`).
fn write_stdout(out: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What `main` prints: the raw answer for `--json`, the readable form otherwise.
struct Output {
    text: String,
    human: String,
}

fn run(api: &Api, command: Command) -> Result<Output, Failure> {
    let (answer, human): (Answer, fn(&Answer) -> String) = match command {
        Command::Produce(p) => (produce(api, p)?, show_produced),
        Command::Pop { topic, max, wait, ttr } => (pop(api, &topic, max, wait, ttr)?, show_popped),
        Command::Ack { receipt } => {
            (api.post(&["v1", "ack"], &json!({ "receipt": receipt }))?, |_| "acked\n".into())
        }
        Command::Touch { receipt, ttr } => {
            (api.post(&["v1", "touch"], &json!({ "receipt": receipt, "ttr_ms": ttr }))?, |a| {
                format!("reserved until {}\n", time(&a.value["expires_at_ms"]))
            })
        }
        Command::Nack { receipt, delay, error } => {
            let mut body = json!({ "receipt": receipt });
            if let Some(d) = delay {
                body["delay_ms"] = json!(d);
            }
            if let Some(e) = error {
                body["error"] = json!(e);
            }
            (api.post(&["v1", "nack"], &body)?, show_nacked)
        }
        Command::Get { id } => (api.get(&["v1", "messages", &id], &[])?, show_message),
        Command::Reschedule(r) => (reschedule(api, r)?, show_rescheduled),
        Command::Cancel { id } => {
            (api.call(Method::DELETE, &["v1", "messages", &id], &[], None, Duration::ZERO)?, |a| {
                format!("cancelled {}\n", text(&a.value["id"]))
            })
        }
        Command::Stats => (api.get(&["v1", "stats"], &[])?, show_stats),
        Command::Topics => (api.get(&["v1", "topics"], &[])?, show_topics),
        Command::Browse { topic, state, limit, cursor } => {
            let query: Vec<(&str, String)> =
                [("state", state), ("limit", limit.map(|n| n.to_string())), ("cursor", cursor)]
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k, v)))
                    .collect();
            (api.get(&["v1", "topics", &topic, "messages"], &query)?, show_browse)
        }
        Command::Redrive { topic, ids } => {
            (redrive(api, &topic, ids)?, |a| format!("moved {}\n", text(&a.value["moved"])))
        }
        Command::Purge { topic, yes } => {
            (purge(api, &topic, yes)?, |a| format!("cancelled {}\n", text(&a.value["cancelled"])))
        }
        Command::Backup { to } => (backup(api, &to)?, show_backup),
        // These take no fields; `{}` is sent so a handler that reads a JSON body accepts it too.
        Command::Pause { topic } => {
            (api.post(&["v1", "topics", &topic, "pause"], &json!({}))?, |_| "paused\n".into())
        }
        Command::Resume { topic } => {
            (api.post(&["v1", "topics", &topic, "resume"], &json!({}))?, |_| "resumed\n".into())
        }
        Command::Flow(f) => (flow(api, f)?, show_flow),
        Command::Cluster { command: ClusterCommand::Status } => {
            (api.get(&["v1", "cluster"], &[])?, show_cluster)
        }
        Command::Cluster { command: ClusterCommand::Add { node_id, cluster_addr } } => {
            let body = json!({ "node_id": node_id, "cluster_addr": cluster_addr });
            (api.post(&["v1", "cluster", "nodes"], &body)?, |a| {
                format!("node {}: {}\n", text(&a.value["node_id"]), text(&a.value["status"]))
            })
        }
        Command::Cluster { command: ClusterCommand::Remove { node_id } } => {
            let id = node_id.to_string();
            (api.call(Method::DELETE, &["v1", "cluster", "nodes", &id], &[], None, Duration::ZERO)?, |a| {
                format!("node {}: {}\n", text(&a.value["node_id"]), text(&a.value["status"]))
            })
        }
    };
    Ok(Output { human: human(&answer), text: answer.text })
}

/// `--to` of `backup`: the server resolves it on its own machine, so it must not depend on this
/// shell's directory.
fn parse_backup_dir(s: &str) -> Result<String, String> {
    if s.starts_with('/') {
        Ok(s.to_string())
    } else {
        Err(format!("{s:?} is not an absolute path (it names a directory on the server's machine)"))
    }
}

/// Longest a backup may take: it copies the whole commit log before the server answers.
const BACKUP_WAIT: Duration = Duration::from_secs(6 * 3600);

fn backup(api: &Api, to: &str) -> Result<Answer, Failure> {
    api.call(Method::POST, &["v1", "admin", "backup"], &[], Some(&json!({ "to": to })), BACKUP_WAIT)
}

/// Tells the user something beside the answer, on stderr so `--json` output stays one document.
fn note(what: &str) {
    eprintln!("note: {what}");
}

/// The topic as `GET /v1/topics` lists it (counts and `paused`), or None when it has none.
fn topic_info(api: &Api, topic: &str) -> Result<Option<Value>, Failure> {
    let all = api.get(&["v1", "topics"], &[])?;
    Ok(items(&all.value, "topics").iter().find(|t| t["topic"] == topic).cloned())
}

fn pop(
    api: &Api,
    topic: &str,
    max: Option<u64>,
    wait: Option<u64>,
    ttr: Option<u64>,
) -> Result<Answer, Failure> {
    let query: Vec<(&str, String)> = [("max", max), ("wait_ms", wait), ("ttr_ms", ttr)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v.to_string())))
        .collect();
    // No body: the API takes none for a pop. The server holds the request up to `wait`.
    let long_poll = Duration::from_millis(wait.unwrap_or(0));
    let answer = api.call(Method::POST, &["v1", "topics", topic, "pop"], &query, None, long_poll)?;
    // A paused topic answers like an empty one; one more request tells the two apart. The hint is
    // best effort: the pop itself succeeded, so a failure here is not reported.
    if items(&answer.value, "messages").is_empty() {
        if let Ok(Some(info)) = topic_info(api, topic) {
            if info["paused"] == true {
                note(&format!(
                    "topic {topic} is paused: pops find nothing until `delayd-cli resume {topic}`"
                ));
            }
        }
    }
    Ok(answer)
}

/// `redrive X.dlq` is taken as `redrive X`: `topics` and the dashboard show the dead letters under
/// `X.dlq`, while the API names the topic they go back to.
fn redrive(api: &Api, topic: &str, ids: Vec<String>) -> Result<Answer, Failure> {
    let topic = match topic.strip_suffix(".dlq").filter(|t| !t.is_empty()) {
        Some(origin) => {
            note(&format!("{topic} holds the dead letters of {origin}: moving them back to {origin}"));
            origin
        }
        None => topic,
    };
    let body = if ids.is_empty() { json!({}) } else { json!({ "ids": ids }) };
    api.post(&["v1", "topics", topic, "redrive"], &body)
}

/// Purges only with `--yes`, and only a topic that exists: the API answers a purge of a mistyped
/// name with `cancelled 0`, which reads like success.
/// `flow`: a PUT when a limit is given, a DELETE for --clear, else a GET.
fn flow(api: &Api, f: Flow) -> Result<Answer, Failure> {
    let path = ["v1", "topics", f.topic.as_str(), "flow"];
    if f.clear {
        return api.call(Method::DELETE, &path, &[], None, Duration::ZERO);
    }
    let mut body = json!({});
    for (key, v) in
        [("max_per_second", f.max_per_second), ("burst", f.burst), ("max_reserved", f.max_reserved)]
    {
        if let Some(v) = v {
            body[key] = json!(v);
        }
    }
    if body.as_object().is_some_and(|o| o.is_empty()) {
        return api.get(&path, &[]);
    }
    api.call(Method::PUT, &path, &[], Some(&body), Duration::ZERO)
}

fn purge(api: &Api, topic: &str, yes: bool) -> Result<Answer, Failure> {
    if !yes {
        return Err(Failure::Input(format!(
            "purge cancels every delayed, ready and reserved message of {topic}; add --yes to do it"
        )));
    }
    if topic_info(api, topic)?.is_none() {
        return Err(Failure::Other(format!(
            "no topic {topic:?} (`delayd-cli topics` lists them); nothing purged"
        )));
    }
    // The API takes no fields; `{}` is sent so a handler that reads a JSON body accepts it too.
    api.post(&["v1", "topics", topic, "purge"], &json!({}))
}

fn produce(api: &Api, p: Produce) -> Result<Answer, Failure> {
    let body = if p.body == "-" { read_stdin()? } else { p.body };
    let mut req = json!({ "body": body });
    if let Some(id) = p.id {
        req["id"] = json!(id);
    }
    if let Some(d) = p.delay {
        req["delay_ms"] = json!(d);
    }
    if let Some(at) = p.at {
        req["deliver_at_ms"] = json!(at);
    }
    if let Some(level) = p.level {
        // The API takes the level as a 1-based index (a number) or a duration string.
        req["level"] = match parse_u64(&level) {
            Ok(n) => json!(n),
            Err(_) => json!(level),
        };
    }
    if let Some(t) = p.ttr {
        req["ttr_ms"] = json!(t);
    }
    if let Some(n) = p.max_attempts {
        req["max_attempts"] = json!(n);
    }
    if let Some(Backoff(steps)) = p.backoff {
        req["backoff"] = json!(steps);
    }
    api.post(&["v1", "topics", &p.topic, "messages"], &req)
}

/// The whole of stdin, unchanged: a trailing newline is part of the body.
fn read_stdin() -> Result<String, Failure> {
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .map_err(|e| Failure::Input(format!("cannot read stdin: {e}")))?;
    // The API carries bodies as JSON strings, so they must be UTF-8.
    String::from_utf8(bytes).map_err(|_| Failure::Input("the body on stdin is not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::StatusCode;

    fn answer(v: Value) -> Answer {
        Answer { status: StatusCode::OK, text: v.to_string(), value: v }
    }

    #[test]
    fn tables_align_on_the_widest_cell() {
        let t = table(&["A", "BEE"], &[vec!["long".into(), "x".into()], vec!["é".into(), "".into()]]);
        assert_eq!(t, "A     BEE\nlong  x\né\n");
    }

    #[test]
    fn at_takes_unix_ms_or_rfc3339() {
        assert_eq!(unix_ms("1795407831175"), Ok(1_795_407_831_175));
        assert_eq!(unix_ms("2026-12-01T09:00:00Z"), Ok(1_796_115_600_000));
        assert_eq!(unix_ms("2026-12-01 09:00:00"), Ok(1_796_115_600_000));
        assert!(unix_ms("1969-12-31T23:59:59Z").is_err());
        assert!(unix_ms("tomorrow").is_err());
        assert!(unix_ms("").is_err());
    }

    #[test]
    fn at_takes_rfc3339_offsets_and_fractions() {
        let nine_utc = 1_796_115_600_000;
        assert_eq!(unix_ms("2026-12-01T11:00:00+02:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T04:30:00-04:30"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T09:00:00+00:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T09:00:00-00:00"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01t09:00:00z"), Ok(nine_utc));
        assert_eq!(unix_ms("2026-12-01T11:00:00.250+02:00"), Ok(nine_utc + 250));
        assert_eq!(unix_ms("2026-12-01T09:00:00.5Z"), Ok(nine_utc + 500));
        assert_eq!(unix_ms("1970-01-01T01:00:00+01:00"), Ok(0));
        assert!(unix_ms("1970-01-01T00:59:59+01:00").is_err());
        for bad in ["2026-12-01T09:00:00+24:00", "2026-12-01T09:00:00+02:60", "2026-12-01T09:00:00+2:000"] {
            assert!(unix_ms(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_delay_needs_a_unit() {
        assert_eq!(parse_delay("5s"), Ok(5000));
        assert_eq!(parse_delay("500ms"), Ok(500));
        assert_eq!(parse_delay("1h30m"), Ok(5_400_000));
        assert_eq!(parse_delay("0"), Ok(0));
        for bare in ["5", "1_000", " 30 "] {
            let e = parse_delay(bare).unwrap_err();
            assert!(e.contains("no unit") && e.contains("s for seconds"), "{bare}: {e}");
        }
        assert!(parse_delay("soon").is_err());
    }

    // The table shapes of the API answers.
    #[test]
    fn topics_and_browse_tables() {
        let v = json!({"topics": [
            {"topic": "orders", "ready": 3, "reserved": 1, "delayed": 10, "dead_lettered": 2, "paused": false},
            {"topic": "mail", "ready": 0, "reserved": 0, "delayed": 0, "dead_lettered": 5, "paused": true},
        ]});
        assert_eq!(
            show_topics(&answer(v)),
            "TOPIC   READY  RESERVED  DELAYED  DEAD_LETTERED  PAUSED\n\
             orders  3      1         10       2              false\n\
             mail    0      0         0        5              true\n"
        );
        let v = json!({"messages": [
            {"id": "a", "state": "dead", "deliver_at_ms": 0, "attempt": 3, "body": "x\ny"},
        ], "next_cursor": "c1"});
        assert_eq!(
            show_browse(&answer(v)),
            "ID  STATE  DELIVER_AT                ATTEMPT  BODY\n\
             a   dead   1970-01-01T00:00:00.000Z  3        x\\ny\n\
             more: --cursor c1\n"
        );
        assert_eq!(show_browse(&answer(json!({"messages": [], "next_cursor": null}))), "no messages\n");
    }
}
