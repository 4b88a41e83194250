//! Clock skew between real cluster nodes (`DELAYD_TEST_CLOCK_OFFSET_MS` shifts one node's
//! clock): a node 2 s ahead never leads, and with a node 200 ms ahead (within max_clock_skew)
//! leading, nothing is delivered before its due time by the client's clock.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::now_ms;
use serde_json::{json, Value};

const OFFSET: &str = "DELAYD_TEST_CLOCK_OFFSET_MS";

fn shifted(node: usize, ms: i64) -> impl Fn(usize) -> Vec<(String, String)> + 'static {
    move |i| if i == node { vec![(OFFSET.to_string(), ms.to_string())] } else { Vec::new() }
}

/// Node `i`'s own answer of `/v1/cluster`.
fn view(c: &Cluster, i: usize) -> Value {
    c.views().get(i - 1).cloned().flatten().unwrap_or(Value::Null)
}

/// Waits until node `i` says whether it may lead, as `want`.
fn wait_may_lead(c: &Cluster, i: usize, want: bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let v = view(c, i);
        if v["may_lead"] == json!(want) {
            return v;
        }
        assert!(Instant::now() < deadline, "node {i} never said may_lead = {want}: {v}\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for a leader other than node 3, checking at every look that node 3 never acts as one:
/// it may win an election it alone can win (its log the longest, e.g. right after another node
/// restarted) but then takes no write, fires nothing and hands the lead over at once.
fn wait_leader_not_3(c: &Cluster) -> usize {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let views = c.views();
        if let Some(v3) = views.get(2).cloned().flatten() {
            assert_eq!(v3["leading"], json!(false), "node 3 acts as leader: {v3}\n{}", c.describe());
        }
        if let Some(l) = common::cluster::agreed_leader(&views, c.size()).filter(|l| *l != 3) {
            return l;
        }
        assert!(Instant::now() < deadline, "no leader but node 3 within 15 s:\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_node_two_seconds_ahead_never_leads_through_failovers() {
    let mut c = Cluster::start_with(3, &[], shifted(3, 2_000));
    let v = wait_may_lead(&c, 3, false);
    let why = v["not_leading_because"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("ahead") && why.contains("max_clock_skew"), "{why}");
    for round in 0..5 {
        let leader = wait_leader_not_3(&c);
        // A write goes through the leader, and node 3 refuses to take one itself.
        let r = c.client().produce("skew", &json!({"body": format!("round {round}")})).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
        c.kill9(leader);
        let next = wait_leader_not_3(&c);
        assert_ne!(next, leader);
        c.restart(leader);
        wait_may_lead(&c, 3, false);
    }
}

#[test]
fn with_a_node_200ms_ahead_leading_nothing_is_delivered_early() {
    let mut c = Cluster::start_with(3, &[], shifted(3, 200));
    wait_may_lead(&c, 3, true);
    // Make node 3 the leader: kill whoever else leads until it wins an election.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let l = c.wait_leader(Duration::from_secs(15));
        if l == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "node 3 never won an election:\n{}", c.describe());
        c.kill9(l);
        std::thread::sleep(Duration::from_millis(300));
        c.restart(l);
    }
    // The leader's engine runs on the majority's clock: it stamps and fires by it.
    let client = c.client();
    let mut due: Vec<(String, u64)> = Vec::new();
    for k in 0..20u64 {
        let delay = 200 + k * 50;
        let sent = now_ms();
        let body = if k % 2 == 0 {
            json!({"body": format!("m{k}"), "delay_ms": delay})
        } else {
            json!({"body": format!("m{k}"), "deliver_at_ms": sent + delay})
        };
        let r = client.produce("skew", &body).expect("produce");
        assert_eq!(r.status, 201, "{:?}", r.body);
        due.push((r.body["id"].as_str().expect("id").to_string(), sent + delay));
    }
    let mut delivered = std::collections::HashMap::new();
    let until = Instant::now() + Duration::from_secs(20);
    while delivered.len() < due.len() && Instant::now() < until {
        let r = client.pop("skew", 32, 1_000, None).expect("pop");
        let at = now_ms();
        for m in r.messages() {
            let id = m["id"].as_str().unwrap_or_default().to_string();
            delivered.entry(id).or_insert(at);
            let _ = client.ack(m["receipt"].as_str().unwrap_or_default());
        }
    }
    for (id, due_ms) in &due {
        let at = delivered.get(id).unwrap_or_else(|| panic!("{id} never delivered:\n{}", c.describe()));
        assert!(*at >= *due_ms, "{id} delivered {} ms early by the client's clock", due_ms - at);
    }
    assert_eq!(c.wait_leader(Duration::from_secs(5)), 3, "node 3 stopped leading meanwhile");
}
