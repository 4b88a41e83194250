//! `/metrics` of the real binary: what a scrape says after real requests, checked by the same
//! linter Prometheus ships (`promtool check metrics`, in an ignored test that .ci/run runs).

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, NEVER_HANG};
use serde_json::json;

/// Samples of one scrape: `name{labels}` as written, and the value.
struct Scrape {
    text: String,
    samples: BTreeMap<String, f64>,
}

impl Scrape {
    fn of(s: &Server) -> Scrape {
        let r = s.http().get(s.url("/metrics")).send().expect("scrape");
        assert_eq!(r.status(), 200);
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/plain; version=0.0.4"), "content type {ct}");
        let text = r.text().expect("body");
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (series, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {l:?}"));
                (series.to_string(), value.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")))
            })
            .collect();
        Scrape { text, samples }
    }

    /// A sample's value; 0 when absent (a counter not yet incremented has no series).
    fn value(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    fn has(&self, series: &str) -> bool {
        self.samples.contains_key(series)
    }

    /// Names given a `# TYPE` line, with their type.
    fn families(&self) -> Vec<(String, String)> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("TYPE line");
                (name.to_string(), kind.to_string())
            })
            .collect()
    }
}

fn http_series(method: &str, route: &str, status: u16) -> String {
    format!("delayd_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}}")
}

/// Polls the scrape until `ok` holds (the server acts on its own schedule; no fixed sleeps).
fn scrape_until(s: &Server, what: &str, ok: impl Fn(&Scrape) -> bool) -> Scrape {
    let deadline = Instant::now() + NEVER_HANG;
    loop {
        let m = Scrape::of(s);
        if ok(&m) {
            return m;
        }
        assert!(Instant::now() < deadline, "{what} never held; last scrape:\n{}", m.text);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `promtool check metrics` on `text`; a missing promtool is a failure (the test that calls
/// this is ignored unless asked for).
fn promtool_check(text: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("promtool is not installed (apt-get install prometheus)")
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool check metrics failed ({}):\n{said}\non:\n{text}", out.status);
    println!("promtool check metrics: passed ({} bytes of exposition){said}", text.len());
}

#[test]
#[ignore = "needs promtool (apt-get install prometheus); .ci/run installs it and runs this"]
fn a_live_scrape_passes_promtool() {
    let s = Server::start(&[]);
    s.produce("orders", &json!({"id": "o-1", "body": "x", "delay_ms": 60_000}));
    s.produce("orders", &json!({"id": "o-2", "body": "y"}));
    assert_eq!(s.get("/v1/messages/o-1").0, 200);
    assert_eq!(s.get("/v1/messages/no-such-id").0, 404);
    let (msgs, _) = s.pop("orders", 1, 0, Some(30_000));
    assert_eq!(s.ack(msgs[0]["receipt"].as_str().unwrap()), 200);
    // A long poll parked while scraping: the gauge of waiting polls is in the exposition too.
    let url = s.url("/v1/topics/idle/pop?wait_ms=20000");
    let waiter = std::thread::spawn(move || common::client().post(url).send().expect("long-poll").status());
    let parked = scrape_until(&s, "one long-poll waiting", |m| m.value("delayd_long_polls_waiting") == 1.0);
    promtool_check(&parked.text);
    s.produce("idle", &json!({"body": "wake"}));
    assert_eq!(waiter.join().expect("waiter"), 200);
    promtool_check(&Scrape::of(&s).text);
    // A topic held back by its flow control: the throttled-time counter passes too.
    let flow = json!({"max_per_second": 1});
    let (st, v) = common::answer(s.http().put(s.url("/v1/topics/slow/flow")).json(&flow).send());
    assert_eq!(st, 200, "{v}");
    s.produce("slow", &json!({"body": "1"}));
    s.produce("slow", &json!({"body": "2"}));
    assert_eq!(s.pop("slow", 2, 0, None).0.len(), 1, "one token");
    let throttled = "delayd_topic_throttled_seconds_total{limit=\"max_per_second\",topic=\"slow\"}";
    let m = scrape_until(&s, "throttled time counted", |m| m.value(throttled) > 0.0);
    promtool_check(&m.text);
}

#[test]
fn a_live_scrape_counts_requests_by_route_template() {
    let s = Server::start(&[]);
    let before = Scrape::of(&s);

    let created = s.produce("orders", &json!({"id": "o-1", "body": "x", "delay_ms": 60_000}));
    assert_eq!(created["id"], "o-1");
    s.produce("orders", &json!({"id": "o-2", "body": "y"}));
    for _ in 0..2 {
        assert_eq!(s.get("/v1/messages/o-1").0, 200);
    }
    assert_eq!(s.get("/v1/messages/no-such-id").0, 404);
    assert_eq!(s.get("/scanner/probe/123?x=1").0, 404);
    let frob = reqwest::Method::from_bytes(b"FROB").unwrap();
    let r = s.http().request(frob, s.url("/v1/stats")).send().expect("FROB");
    assert_eq!(r.status(), 405);
    let (msgs, _) = s.pop("orders", 1, 0, Some(30_000));
    assert_eq!(s.ack(msgs[0]["receipt"].as_str().unwrap()), 200);

    let after = Scrape::of(&s);
    let went_up = |series: &str| after.value(series) - before.value(series);
    assert_eq!(went_up(&http_series("POST", "/v1/topics/{topic}/messages", 201)), 2.0, "{}", after.text);
    assert_eq!(went_up(&http_series("GET", "/v1/messages/{id}", 200)), 2.0);
    assert_eq!(went_up(&http_series("GET", "/v1/messages/{id}", 404)), 1.0);
    assert_eq!(went_up(&http_series("GET", "unmatched", 404)), 1.0);
    assert_eq!(went_up(&http_series("other", "/v1/stats", 405)), 1.0);
    assert_eq!(went_up(&http_series("POST", "/v1/topics/{topic}/pop", 200)), 1.0);
    assert_eq!(went_up(&http_series("POST", "/v1/ack", 200)), 1.0);
    assert!(after.value(&http_series("GET", "/metrics", 200)) >= 1.0, "the first scrape is counted");
    assert_eq!(
        after.value(
            "delayd_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/messages/{id}\",status=\"200\"}"
        ),
        after.value(&http_series("GET", "/v1/messages/{id}", 200)),
        "the latency histogram sees every counted request"
    );
    for raw in ["o-1", "no-such-id", "scanner", "probe", "FROB"] {
        assert!(!after.text.contains(raw), "{raw:?} leaked into a label:\n{}", after.text);
    }

    // Base units, and the names the issue asked for.
    for series in [
        "delayd_produced_total",
        "delayd_acked_total",
        "delayd_lateness_seconds_count",
        "delayd_delivery_lateness_seconds_count",
        "delayd_flush_duration_seconds_count",
        "delayd_engine_step_seconds_count",
        "delayd_engine_step_seconds_max",
        "delayd_store_writable",
        "delayd_long_polls_waiting",
        "delayd_requests_inline_total",
        "delayd_requests_queued_total",
        "delayd_engine_wakeups_total",
        "delayd_index_entries",
        "delayd_index_slots",
        "delayd_index_load_ratio",
        "delayd_live_bytes",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        &format!("delayd_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION")),
    ] {
        assert!(after.has(series), "{series} missing:\n{}", after.text);
    }
    assert_eq!(after.value("delayd_produced_total"), 2.0);
    assert_eq!(after.value("delayd_store_writable"), 1.0);
    assert_eq!(after.value(&format!("delayd_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"))), 1.0);
    assert!(after.value("delayd_index_entries") >= 2.0);
    assert!(after.value("delayd_flush_duration_seconds_count") >= 1.0, "produces were flushed");
    let started = after.value("process_start_time_seconds");
    assert!(started > 1e9 && started <= common::now_ms() as f64 / 1000.0 + 1.0, "start time {started}");
    assert!(after.has("delayd_level_next_due_timestamp_seconds{level=\"1m\"}"), "{}", after.text);
    let due = after.value("delayd_level_next_due_timestamp_seconds{level=\"1m\"}");
    assert!(due > started && due < started + 3600.0, "o-1's due time in seconds: {due}");
    for (name, _) in after.families() {
        for part in name.split('_') {
            assert!(!["ms", "us", "ns", "sec", "kb", "mb"].contains(&part), "abbreviated unit in {name}");
        }
    }

    // Every histogram series is consistent: cumulative buckets ending in +Inf == _count.
    let mut histograms = 0;
    for (name, kind) in after.families().into_iter().filter(|(_, k)| k == "histogram") {
        assert_eq!(kind, "histogram");
        let mut series: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
        let prefix = format!("{name}_bucket{{");
        for (k, v) in &after.samples {
            if let Some(labels) = k.strip_prefix(&prefix) {
                let (rest, le) = labels.rsplit_once("le=\"").expect("le label");
                series
                    .entry(rest.to_string())
                    .or_default()
                    .push((le.trim_end_matches("\"}").to_string(), *v));
            }
        }
        for (labels, mut buckets) in series {
            histograms += 1;
            let le = |b: &(String, f64)| if b.0 == "+Inf" { f64::INFINITY } else { b.0.parse().unwrap() };
            buckets.sort_by(|a, b| le(a).total_cmp(&le(b)));
            assert!(
                buckets.windows(2).all(|w| w[0].1 <= w[1].1),
                "{name}{{{labels} not cumulative: {buckets:?}"
            );
            let inf = buckets.last().filter(|b| b.0 == "+Inf").expect("+Inf bucket").1;
            let labels = labels.trim_end_matches(',');
            let count =
                if labels.is_empty() { format!("{name}_count") } else { format!("{name}_count{{{labels}}}") };
            assert_eq!(after.value(&count), inf, "{count} vs its +Inf bucket");
            assert!(after.has(&count), "{count} missing");
        }
    }
    assert!(histograms >= 6, "only {histograms} histogram series");
}

#[test]
fn long_polls_waiting_are_counted_while_parked() {
    let s = Server::start(&[]);
    let url = s.url("/v1/topics/idle/pop?wait_ms=20000");
    let waiter = std::thread::spawn(move || {
        let r = common::client().post(url).send().expect("long-poll");
        (r.status().as_u16(), r.json::<serde_json::Value>().expect("json"))
    });
    scrape_until(&s, "one long-poll waiting", |m| m.value("delayd_long_polls_waiting") == 1.0);
    s.produce("idle", &json!({"body": "wake"}));
    let (status, v) = waiter.join().expect("waiter");
    assert_eq!(status, 200);
    assert_eq!(v["messages"][0]["body"], "wake");
    scrape_until(&s, "no long-poll waiting", |m| m.value("delayd_long_polls_waiting") == 0.0);
}

#[test]
fn stats_and_metrics_leave_out_finished_messages() {
    let s = Server::start(&[]);
    let level = |stats: &serde_json::Value, ms: u64| -> u64 {
        let levels = stats["levels"].as_array().expect("levels");
        levels.iter().find(|l| l["level_ms"] == ms).map_or(0, |l| l["backlog"].as_u64().unwrap())
    };
    let ready = |stats: &serde_json::Value, topic: &str| -> u64 {
        let topics = stats["topics"].as_array().expect("topics");
        topics.iter().find(|t| t["topic"] == topic).map_or(0, |t| t["ready"].as_u64().unwrap())
    };

    // Two one-minute delays, one cancelled: the cancelled timer is not counted.
    s.produce("shop", &json!({"id": "pay-1", "body": "a", "delay_ms": 60_000}));
    s.produce("shop", &json!({"id": "pay-2", "body": "b", "delay_ms": 60_000}));
    assert_eq!(s.delete("/v1/messages/pay-1").0, 200);
    // A ready message cancelled, one popped and acked within its time-to-run, one left ready.
    for id in ["now-1", "now-2", "now-3"] {
        s.produce("shop", &json!({"id": id, "body": id}));
    }
    assert_eq!(s.delete("/v1/messages/now-1").0, 200);
    let (msgs, _) = s.pop("shop", 1, 0, Some(30_000));
    assert_eq!(msgs[0]["id"], "now-2");
    assert_eq!(s.ack(msgs[0]["receipt"].as_str().unwrap()), 200);

    let (st, stats) = s.get("/v1/stats");
    assert_eq!(st, 200);
    assert_eq!(level(&stats, 60_000), 1, "only pay-2 waits on the 1m level: {stats}");
    assert_eq!(level(&stats, 30_000), 0, "now-2 was acked: its time-to-run timer is not live: {stats}");
    assert_eq!(ready(&stats, "shop"), 1, "only now-3 is ready: {stats}");

    let m = Scrape::of(&s);
    assert_eq!(m.value("delayd_level_backlog{level=\"1m\"}"), 1.0, "{}", m.text);
    assert_eq!(m.value("delayd_level_backlog{level=\"30s\"}"), 0.0);
    assert_eq!(m.value("delayd_topic_ready{topic=\"shop\"}"), 1.0);
    assert_eq!(m.value("delayd_cancelled_total"), 2.0);
}

#[test]
fn per_topic_counters_oldest_ready_age_free_disk_and_checkpoint_time_follow_real_work() {
    let s = Server::start(&[]);
    let topic = |name: &str, t: &str| format!("{name}{{topic=\"{t}\"}}");
    let t0 = common::now_ms() as f64 / 1000.0;
    assert!(Scrape::of(&s).value("delayd_data_disk_free_bytes") > 0.0, "free bytes of the data disk");
    // Three messages due now on "orders" (the first may be tried once only), one on "other".
    s.produce("orders", &json!({"id": "o1", "body": "x", "max_attempts": 1}));
    s.produce("orders", &json!({"id": "o2", "body": "x"}));
    s.produce("orders", &json!({"id": "o3", "body": "x"}));
    s.produce("other", &json!({"id": "x1", "body": "x", "delay_ms": 60_000}));
    let m = Scrape::of(&s);
    assert_eq!(m.value(&topic("delayd_topic_produced_total", "orders")), 3.0, "{}", m.text);
    assert_eq!(m.value(&topic("delayd_topic_produced_total", "other")), 1.0);
    // The ready messages wait: the age of the oldest grows; a topic with none ready shows 0.
    let m = scrape_until(&s, "an oldest ready message a second old", |m| {
        m.value(&topic("delayd_topic_oldest_ready_age_seconds", "orders")) >= 1.0
    });
    assert!(m.value(&topic("delayd_topic_oldest_ready_age_seconds", "orders")) < 30.0, "{}", m.text);
    assert_eq!(m.value(&topic("delayd_topic_oldest_ready_age_seconds", "other")), 0.0, "{}", m.text);
    assert!(m.has(&topic("delayd_topic_oldest_ready_age_seconds", "other")));

    // o1 is nacked on its only attempt (dead-lettered), o2 nacked for a retry, o3 acked.
    let (msgs, _) = s.pop("orders", 3, 0, Some(30_000));
    assert_eq!(msgs.len(), 3);
    let receipt = |id: &str| {
        let m = msgs.iter().find(|m| m["id"] == id).unwrap_or_else(|| panic!("{id} popped"));
        m["receipt"].as_str().unwrap().to_string()
    };
    assert_eq!(s.post("/v1/nack", &json!({"receipt": receipt("o1")})).0, 200);
    assert_eq!(s.post("/v1/nack", &json!({"receipt": receipt("o2"), "delay_ms": 60_000})).0, 200);
    assert_eq!(s.ack(&receipt("o3")), 200);
    let m = Scrape::of(&s);
    for (name, want) in [
        ("delayd_topic_acked_total", 1.0),
        ("delayd_topic_nacked_total", 2.0),
        ("delayd_topic_dead_letters_total", 1.0),
        ("delayd_topic_produced_total", 3.0),
        // Nothing of "orders" is ready now.
        ("delayd_topic_oldest_ready_age_seconds", 0.0),
    ] {
        assert_eq!(m.value(&topic(name, "orders")), want, "{name} in\n{}", m.text);
    }
    assert_eq!(m.value(&topic("delayd_topic_acked_total", "other")), 0.0);
    // The per-topic counts add up to the process-wide ones.
    assert_eq!(m.value("delayd_nacked_total"), 2.0);
    assert_eq!(m.value("delayd_dead_lettered_total"), 1.0);
    // The dead letter waits in orders.dlq, ready for an operator.
    assert!(m.has(&topic("delayd_topic_oldest_ready_age_seconds", "orders.dlq")), "{}", m.text);
    // The work above is made durable by a checkpoint within its period.
    let m = scrape_until(&s, "a checkpoint after the work", |m| {
        m.value("delayd_last_checkpoint_timestamp_seconds") >= t0
    });
    assert!(m.value("delayd_last_checkpoint_timestamp_seconds") <= common::now_ms() as f64 / 1000.0 + 1.0);
}
