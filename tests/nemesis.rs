//! A randomized nemesis run on three real nodes: for `--nemesis-minutes N` (default 1; `cargo
//! test` runs it so), faults are drawn at random (the leader or a follower SIGKILLed and
//! restarted, one isolated from the others and healed, the leader SIGSTOPped and resumed, one
//! direction of a link cut) while clients produce (delays up to 5 s, and chained ones of 10 to
//! 30 s), pop, ack, nack and cancel, and a topic is pushed to a local webhook. Then everything
//! is healed and drained, and the checker verifies from what the clients were told: nothing
//! acknowledged lost, nothing delivered early (pulled or pushed) or after its ack or cancel.
//!
//! A longer run: `cargo test --release --test nemesis -- --nemesis-minutes 30`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::jepsen::*;
use common::now_ms;
use common::proxy::Mode;
use serde_json::json;

fn main() {
    let mut minutes = 1.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--nemesis-minutes" {
            minutes = args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("--nemesis-minutes takes a number of minutes");
                std::process::exit(2)
            });
        }
        // Other arguments (test filters, --nocapture) are cargo's: nothing to pick here.
    }
    let seed = Rng::seed("nemesis");
    run(Duration::from_secs_f64(minutes * 60.0), seed);
    println!("nemesis: ok");
}

/// Deliveries the webhook received, into the push topic's history.
fn webhook(history: Arc<Shared>) -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the webhook");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if stopped.load(Ordering::SeqCst) {
                return;
            }
            let Ok(conn) = conn else { continue };
            let s = history.clone();
            std::thread::spawn(move || serve_hook(conn, &s));
        }
    });
    (url, stop)
}

fn serve_hook(mut conn: std::net::TcpStream, s: &Shared) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    loop {
        let (mut id, mut len) = (String::new(), 0usize);
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let lower = l.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("delayd-message-id:") {
                id = l[l.len() - v.len()..].trim().to_string();
            } else if let Some(v) = lower.strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if !id.is_empty() {
            s.history.delivered(&id, now_ms());
        }
        if conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_err() {
            return;
        }
    }
}

/// A producer of chained long delays (10 to 30 s) into the workload's history.
fn long_delays(s: Arc<Shared>, c: &Cluster, mut rng: Rng) -> std::thread::JoinHandle<()> {
    let client = c.client();
    std::thread::spawn(move || {
        let mut n = 0;
        while !s.stopping() {
            n += 1;
            let id = format!("{}-long-{n}", s.topic);
            produce_one(&s, &client, &id, 10_000 + rng.below(20_001));
            std::thread::sleep(Duration::from_millis(200 + rng.below(300)));
        }
    })
}

/// A producer of messages for the push topic (delays up to 3 s).
fn pushed(s: Arc<Shared>, c: &Cluster, mut rng: Rng) -> std::thread::JoinHandle<()> {
    let client = c.client();
    std::thread::spawn(move || {
        let mut n = 0;
        while !s.stopping() {
            n += 1;
            let id = format!("{}-{n}", s.topic);
            produce_one(&s, &client, &id, rng.below(3_001));
            std::thread::sleep(Duration::from_millis(20 + rng.below(60)));
        }
    })
}

/// One fault, drawn at random, applied and undone.
fn nemesis(c: &mut Cluster, rng: &mut Rng, s: &Shared) -> String {
    let leader = c.wait_leader(ELECTION);
    let other = other_than(leader, rng);
    match rng.below(6) {
        0 => {
            c.kill9(leader);
            std::thread::sleep(rng.millis(0, 2_000));
            c.restart(leader);
            format!("SIGKILL leader {leader}, restarted")
        }
        1 => {
            c.kill9(other);
            std::thread::sleep(rng.millis(500, 3_000));
            c.restart(other);
            format!("SIGKILL follower {other}, restarted")
        }
        2 => {
            c.isolate(leader);
            // Clients that reach only the cut-off leader pile up entries of its own in its log,
            // none acknowledged: after the heal it must cut them all back and rejoin.
            let stop = AtomicBool::new(false);
            let sent = std::thread::scope(|sc| {
                let writers: Vec<_> = (0..16)
                    .map(|t| {
                        let (url, stop) = (c.url(leader), &stop);
                        sc.spawn(move || produce_to_one_node(s, url, t, stop))
                    })
                    .collect();
                std::thread::sleep(rng.millis(1_500, 4_000));
                stop.store(true, Ordering::SeqCst);
                writers.into_iter().map(|w| w.join().expect("direct writer")).sum::<usize>()
            });
            c.heal();
            format!("leader {leader} isolated ({sent} writes sent to it alone), healed")
        }
        3 => {
            c.isolate(other);
            std::thread::sleep(rng.millis(1_000, 4_000));
            c.heal();
            format!("follower {other} isolated, healed")
        }
        4 => {
            c.stop(leader);
            std::thread::sleep(rng.millis(500, 3_000));
            c.cont(leader);
            format!("leader {leader} SIGSTOPped, resumed")
        }
        _ => {
            let mode = if rng.below(2) == 0 { Mode::Blackhole } else { Mode::Cut };
            c.link(leader, other).set(mode);
            std::thread::sleep(rng.millis(1_000, 4_000));
            c.heal();
            format!("link {leader}->{other} {mode:?}, healed")
        }
    }
}

/// Produces to node `url` alone, each write given up after 300 ms (the node keeps it in its log
/// all the same), until `stop`; every answer goes into the history. Returns how many were sent.
fn produce_to_one_node(s: &Shared, url: String, who: usize, stop: &AtomicBool) -> usize {
    let direct = common::cluster::ClusterClient::with_urls(vec![url])
        .with_deadline(Duration::from_millis(300))
        .with_timeout(Duration::from_millis(300));
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let id = format!("{}-alone{who}-{n}-{}", s.topic, now_ms());
        let due = now_ms();
        s.last_due.fetch_max(due, Ordering::SeqCst);
        let r = direct.produce(&s.topic, &json!({"id": id, "body": "x", "delay_ms": 0}));
        record_produce(s, &id, due, &r);
    }
    n
}

fn run(length: Duration, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut c = Cluster::start(3, &[("DELAYD_LOG_LEVEL", "info")]);
    c.wait_leader(ELECTION);
    let push = Shared::new("nemesis-push");
    let (hook, hook_stop) = webhook(push.clone());
    let r = c
        .client()
        .request("PUT", "/v1/topics/nemesis-push/push", Some(&json!({"url": hook, "timeout_ms": 2000})), 0)
        .expect("set the push subscription");
    assert!(r.ok(), "push subscription: {} {}", r.status, r.body);
    let mut w = Workload::start(&c, "nemesis", rng.next());
    let long = long_delays(w.shared.clone(), &c, Rng::new(rng.next()));
    let push_producer = pushed(push.clone(), &c, Rng::new(rng.next()));
    let started = Instant::now();
    let mut faults = 0;
    while started.elapsed() < length {
        let what = nemesis(&mut c, &mut rng, &w.shared);
        faults += 1;
        eprintln!("nemesis: {:>6.1}s {what}", started.elapsed().as_secs_f64());
        std::thread::sleep(rng.millis(500, 3_000));
    }
    c.heal();
    push.stop.store(true, Ordering::SeqCst);
    w.shared.stop.store(true, Ordering::SeqCst);
    long.join().expect("long-delay producer");
    push_producer.join().expect("push producer");
    c.wait_leader(ELECTION);
    let report = finish(&c, &mut w, "nemesis");
    eprintln!("nemesis: {faults} faults in {:?}; pulled: {}", started.elapsed(), report.counts());
    wait_pushed(&c, &push);
    hook_stop.store(true, Ordering::SeqCst);
    let pushed = push.history.check();
    eprintln!("nemesis: pushed: {}", pushed.counts());
    pushed.assert_ok();
}

/// Waits until every acknowledged push message reached the webhook (or a minute past the last
/// due time).
fn wait_pushed(c: &Cluster, s: &Shared) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let report = s.history.check();
        let lost = report.violations.iter().any(|v| v.starts_with("lost"));
        if !lost && now_ms() > s.last_due.load(Ordering::SeqCst) + 1_000 {
            return;
        }
        if Instant::now() > deadline {
            eprintln!("{}", c.describe());
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
