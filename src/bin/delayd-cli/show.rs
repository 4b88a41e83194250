//! delayd-cli's readable output: the API's JSON answers as aligned tables and sentences.

use std::time::{Duration, UNIX_EPOCH};

use hyper::StatusCode;
use serde_json::Value;

use crate::api::Answer;

/// A JSON scalar as a table cell: strings without quotes, absent or null as `-`.
pub(crate) fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => printable(s),
        other => other.to_string(),
    }
}

/// Unix ms as an RFC 3339 UTC time, so a person need not convert; anything else as is.
pub(crate) fn time(v: &Value) -> String {
    match v.as_u64() {
        Some(ms) => humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string(),
        None => text(v),
    }
}

/// Control characters escaped, so a body with newlines or tabs keeps the table on its rows.
pub(crate) fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.to_string() }).collect()
}

/// Columns padded to their widest cell, two spaces apart; the last column is not padded.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i < last {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(cell.chars().count()) + 2;
                line.push_str(&" ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

pub(crate) fn items<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key).and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[])
}

pub(crate) fn show_produced(a: &Answer) -> String {
    let v = &a.value;
    let mut out = table(&["ID", "DELIVER_AT"], &[vec![text(&v["id"]), time(&v["deliver_at_ms"])]]);
    // 200 instead of 201: the same request was made before; the answer is the original one.
    if a.status == StatusCode::OK {
        out.push_str("(already produced by an identical earlier request)\n");
    }
    out
}

pub(crate) fn show_popped(a: &Answer) -> String {
    let msgs = items(&a.value, "messages");
    if msgs.is_empty() {
        return "no messages\n".into();
    }
    let rows: Vec<Vec<String>> = msgs
        .iter()
        .map(|m| vec![text(&m["id"]), text(&m["attempt"]), text(&m["receipt"]), text(&m["body"])])
        .collect();
    table(&["ID", "ATTEMPT", "RECEIPT", "BODY"], &rows)
}

pub(crate) fn show_nacked(a: &Answer) -> String {
    let v = &a.value;
    match v["state"].as_str() {
        Some("dead") => format!("dead-lettered to {}\n", text(&v["topic"])),
        _ => format!("retry at {}\n", time(&v["deliver_at_ms"])),
    }
}

pub(crate) fn show_message(a: &Answer) -> String {
    let v = &a.value;
    let mut rows = vec![
        vec!["id".into(), text(&v["id"])],
        vec!["topic".into(), text(&v["topic"])],
        vec!["state".into(), text(&v["state"])],
        vec!["deliver_at".into(), time(&v["deliver_at_ms"])],
        vec!["attempt".into(), text(&v["attempt"])],
    ];
    if let Some(dlq) = v.get("dead_letter_topic") {
        rows.push(vec!["dead_letter_topic".into(), text(dlq)]);
    }
    if let Some(e) = v.get("last_error") {
        rows.push(vec!["last_error".into(), text(&e["message"])]);
        rows.push(vec![
            "last_error_at".into(),
            format!("{} (attempt {})", time(&e["time_ms"]), text(&e["attempt"])),
        ]);
    }
    rows.push(vec!["body".into(), text(&v["body"])]);
    // A key/value listing: a header row would only say "FIELD VALUE".
    let t = table(&["", ""], &rows);
    t.split_once('\n').map(|(_, rest)| rest.to_string()).unwrap_or(t)
}

pub(crate) fn show_stats(a: &Answer) -> String {
    let v = &a.value;
    let levels: Vec<Vec<String>> = items(v, "levels")
        .iter()
        .map(|l| {
            let level = l["level_ms"]
                .as_u64()
                .map(delayd::config::units::fmt_ms)
                .unwrap_or_else(|| text(&l["level_ms"]));
            vec![level, text(&l["backlog"]), time(&l["next_due_ms"])]
        })
        .collect();
    let topics: Vec<Vec<String>> = items(v, "topics")
        .iter()
        .map(|t| {
            let cells = ["topic", "ready", "reserved", "delayed", "dead_lettered"];
            cells.iter().map(|k| text(&t[*k])).collect()
        })
        .collect();
    let mut out = table(&["LEVEL", "BACKLOG", "NEXT_DUE"], &levels);
    out.push('\n');
    if topics.is_empty() {
        out.push_str("no topics\n");
    } else {
        out.push_str(&table(&["TOPIC", "READY", "RESERVED", "DELAYED", "DEAD_LETTERED"], &topics));
    }
    out.push('\n');
    let store = match v["store_writable"].as_bool() {
        Some(false) => format!("NOT writable: {}", text(&v["store_error"])),
        Some(true) => "writable".into(),
        None => "-".into(),
    };
    let counters = [
        vec!["disk_bytes".into(), text(&v["disk_bytes"])],
        vec!["log_bytes".into(), text(&v["log_bytes"])],
        vec!["live_bytes".into(), text(&v["live_bytes"])],
        vec!["open_queues".into(), text(&v["open_queues"])],
        vec!["store".into(), store],
    ];
    let t = table(&["", ""], &counters);
    out.push_str(t.split_once('\n').map(|(_, rest)| rest).unwrap_or(&t));
    out
}

pub(crate) fn show_topics(a: &Answer) -> String {
    let topics = items(&a.value, "topics");
    if topics.is_empty() {
        return "no topics\n".into();
    }
    let rows: Vec<Vec<String>> = topics
        .iter()
        .map(|t| {
            vec![
                text(&t["topic"]),
                text(&t["ready"]),
                text(&t["reserved"]),
                text(&t["delayed"]),
                text(&t["dead_lettered"]),
                text(&t["paused"]),
            ]
        })
        .collect();
    table(&["TOPIC", "READY", "RESERVED", "DELAYED", "DEAD_LETTERED", "PAUSED"], &rows)
}

pub(crate) fn show_browse(a: &Answer) -> String {
    let msgs = items(&a.value, "messages");
    let mut out = if msgs.is_empty() {
        "no messages\n".to_string()
    } else {
        let rows: Vec<Vec<String>> = msgs
            .iter()
            .map(|m| {
                vec![
                    text(&m["id"]),
                    text(&m["state"]),
                    time(&m["deliver_at_ms"]),
                    text(&m["attempt"]),
                    text(&m["body"]),
                ]
            })
            .collect();
        table(&["ID", "STATE", "DELIVER_AT", "ATTEMPT", "BODY"], &rows)
    };
    if let Some(c) = a.value.get("next_cursor").and_then(Value::as_str) {
        out.push_str(&format!("more: --cursor {c}\n"));
    }
    out
}

/// Per-node fields `/v1/cluster` may carry (the leader's view of replication), with their column.
pub(crate) const CLUSTER_EXTRAS: [(&str, &str); 3] =
    [("match_index", "MATCH_INDEX"), ("lag_entries", "LAG_ENTRIES"), ("last_contact_ms", "LAST_CONTACT_MS")];

pub(crate) fn show_cluster(a: &Answer) -> String {
    let v = &a.value;
    let me = &v["node_id"];
    let leader = &v["leader_id"];
    // raft numbers nodes from 1: a leader id of 0 is raft's "none".
    let mut out = if leader.is_null() || leader.as_u64() == Some(0) {
        "leader: none".to_string()
    } else {
        format!("leader: {} {}", text(leader), text(&v["leader_url"]))
    };
    out.push_str(&format!("  term: {}\n", text(&v["term"])));
    let nodes = items(v, "nodes");
    // An extra column only when some node has the field: a single node has no replication view.
    let extras: Vec<(&str, &str)> = CLUSTER_EXTRAS
        .into_iter()
        .filter(|(k, _)| nodes.iter().any(|n| n.get(*k).is_some_and(|x| !x.is_null())))
        .collect();
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let id = &n["node_id"];
            // Each node's role as the answering node knows it: its own, the leader's, or what the
            // node object says; otherwise unknown rather than a guess (a learner is no follower).
            let mut role = match n.get("role").filter(|r| !r.is_null()) {
                Some(r) => text(r),
                None if id == me => text(&v["role"]),
                None if id == leader => "leader".into(),
                None => "-".into(),
            };
            if id == me {
                role.push('*');
            }
            let mut row = vec![text(id), role, text(&n["api_url"]), text(&n["cluster_addr"])];
            row.extend(extras.iter().map(|(k, _)| text(&n[*k])));
            row
        })
        .collect();
    let mut headers = vec!["NODE", "ROLE", "API_URL", "CLUSTER_ADDR"];
    headers.extend(extras.iter().map(|(_, h)| *h));
    out.push_str(&table(&headers, &rows));
    out
}

pub(crate) fn show_rescheduled(a: &Answer) -> String {
    let v = &a.value;
    table(
        &["ID", "STATE", "DELIVER_AT"],
        &[vec![text(&v["id"]), text(&v["state"]), time(&v["deliver_at_ms"])]],
    )
}

pub(crate) fn show_backup(a: &Answer) -> String {
    let v = &a.value;
    format!(
        "backed up {} files, {} bytes, log {} to {}, in {} ms, into {}\n",
        text(&v["files"]),
        text(&v["bytes"]),
        text(&v["log_start"]),
        text(&v["log_end"]),
        text(&v["took_ms"]),
        text(&v["to"])
    )
}

/// A topic's flow control, one limit a line; or that it was removed.
pub(crate) fn show_flow(a: &Answer) -> String {
    let v = &a.value;
    if v["removed"] == Value::Bool(true) {
        return format!("flow control of {} removed\n", text(&v["topic"]));
    }
    let mut out = format!("flow control of {}\n", text(&v["topic"]));
    for key in ["max_per_second", "burst", "max_reserved"] {
        let shown = if v[key].is_null() { "none".to_string() } else { text(&v[key]) };
        out.push_str(&format!("  {key:<15}{shown}\n"));
    }
    out.push_str(&format!("  {:<15}{}\n", "updated", time(&v["updated_at_ms"])));
    out
}
