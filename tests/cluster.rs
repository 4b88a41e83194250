//! Jepsen-style scenarios on three real `delayd` nodes: client threads run a mixed workload
//! (produce, pop with a short time-to-run, ack, nack, cancel) while nodes are killed, cut off and
//! restarted; then everything left is drained and the history checker verifies, from what the
//! clients were told, that nothing acknowledged was lost and nothing was delivered early or after
//! its ack or cancel.
//!
//! A randomized run of chosen length, drawing the same faults: `tests/nemesis.rs`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cluster::{agreed_leader, Cluster, ClusterClient};
use common::jepsen::*;
use common::now_ms;
use serde_json::json;

#[test]
fn leader_sigkill_under_load_repeatedly_loses_nothing_acknowledged() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("leader kills"));
    let mut c = start_cluster();
    let mut w = Workload::start(&c, "killed", rng.next());
    let t0 = Instant::now();
    for round in 0..LEADER_KILLS {
        let leader = c.wait_leader(ELECTION);
        sleep(rng.millis(200, 1_200));
        c.kill9(leader);
        // Sometimes back at once, sometimes after the others have moved on.
        sleep(rng.millis(0, 800));
        c.restart(leader);
        eprintln!("leader kills: round {round}: killed and restarted node {leader} at {:?}", t0.elapsed());
    }
    c.wait_leader(ELECTION);
    sleep(Duration::from_secs(1));
    finish(&c, &mut w, "leader kills");
}

#[test]
fn follower_sigkill_and_restart_under_load_loses_nothing_and_it_catches_up() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("follower kills"));
    let mut c = start_cluster();
    let mut w = Workload::start(&c, "follower", rng.next());
    for _ in 0..3 {
        let leader = c.wait_leader(ELECTION);
        let f = other_than(leader, &mut rng);
        sleep(rng.millis(300, 1_000));
        c.kill9(f);
        let before = view_u64(&c, leader, "commit_index").expect("leader's commit index");
        sleep(Duration::from_millis(1_500));
        // Two of three still make a majority: writes go on while the follower is down.
        let after = view_u64(&c, c.wait_leader(ELECTION), "commit_index").expect("commit index");
        assert!(after > before, "nothing was committed while a follower was down\n{}", c.describe());
        c.restart(f);
        wait_caught_up(&c, f, Duration::from_secs(15));
    }
    finish(&c, &mut w, "follower kills");
}

#[test]
fn with_a_follower_down_parallel_writes_keep_being_acknowledged_promptly() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("one follower down"));
    let mut c = start_cluster();
    let leader = c.wait_leader(ELECTION);
    c.kill9(other_than(leader, &mut rng));
    // The leader's own acknowledgement is now needed for every commit, and parallel writers
    // make its readies span several of the writer's batches.
    let until = Instant::now() + Duration::from_secs(6);
    let results: Vec<(usize, Duration, Vec<String>)> = std::thread::scope(|sc| {
        let writers: Vec<_> = (0..8)
            .map(|t| {
                let client = c.client().with_deadline(Duration::from_secs(2));
                sc.spawn(move || {
                    let (mut ok, mut worst, mut bad) = (0, Duration::ZERO, Vec::new());
                    for n in 0.. {
                        if Instant::now() >= until {
                            break;
                        }
                        let t0 = Instant::now();
                        let r = client.produce("down", &json!({"id": format!("w{t}-{n}"), "body": "x"}));
                        worst = worst.max(t0.elapsed());
                        match r {
                            Ok(r) if r.ok() => ok += 1,
                            other => bad.push(format!("{other:?}")),
                        }
                    }
                    (ok, worst, bad)
                })
            })
            .collect();
        writers.into_iter().map(|h| h.join().expect("writer")).collect()
    });
    let acked: usize = results.iter().map(|r| r.0).sum();
    let worst = results.iter().map(|r| r.1).max().unwrap_or_default();
    let bad: Vec<&String> = results.iter().flat_map(|r| &r.2).collect();
    eprintln!("one follower down: {acked} writes acknowledged, the slowest in {worst:?}");
    assert!(bad.is_empty(), "writes failed with a majority up: {bad:?}\n{}", c.describe());
    assert!(worst < Duration::from_secs(2), "a write took {worst:?}\n{}", c.describe());
    assert!(acked >= 50, "only {acked} writes in 6 s");
}

/// Sends produces straight to node `old`'s API while it is cut off, until `stop`; every answer
/// goes into the history. Returns the 2xx answers given by `old` itself.
fn produce_direct(s: &Shared, url: String, stop: &AtomicBool) -> Vec<String> {
    let direct = ClusterClient::with_urls(vec![url.clone()])
        .with_deadline(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(3));
    let mut acked_there = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let id = format!("{}-direct-{n}", s.topic);
        let sent = now_ms();
        s.last_due.fetch_max(sent, Ordering::SeqCst);
        let r = direct.produce(&s.topic, &json!({"id": id, "body": "x", "delay_ms": 0}));
        if record_produce(s, &id, sent, &r) && r.as_ref().is_ok_and(|r| r.node == url) {
            acked_there.push(id);
        }
        sleep(Duration::from_millis(50));
    }
    acked_there
}

/// Waits until the cluster agrees on a leader and node `i` follows it; returns the leader.
fn wait_follows(c: &Cluster, i: usize, timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        let views = c.views();
        if let Some(l) = agreed_leader(&views, c.size()) {
            let v = views[i - 1].as_ref();
            if l != i
                && v.is_some_and(|v| v["role"] == "follower" && v["leader_id"].as_u64() == Some(l as u64))
            {
                return l;
            }
        }
        assert!(Instant::now() < deadline, "node {i} did not rejoin as a follower\n{}", c.describe());
        sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_isolated_leader_acknowledges_nothing_and_rejoins_as_follower() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("isolated leader"));
    let c = start_cluster();
    let mut w = Workload::start(&c, "isolated", rng.next());
    let old = c.wait_leader(ELECTION);
    sleep(rng.millis(500, 1_500));
    c.isolate(old);
    let cut = Instant::now();
    let stop = AtomicBool::new(false);
    let acked_by_old = std::thread::scope(|sc| {
        let (shared, url, stop) = (&w.shared, c.url(old), &stop);
        let direct = sc.spawn(move || produce_direct(shared, url, stop));
        let new = wait_new_leader(&c, old, ELECTION);
        eprintln!("isolated leader: node {new} leads the majority {:?} after the cut", cut.elapsed());
        // check_quorum: a leader that hears from no majority steps down by itself.
        while c.views()[old - 1].as_ref().is_some_and(|v| v["role"] == "leader") {
            assert!(cut.elapsed() < ELECTION, "the cut-off leader still says it leads\n{}", c.describe());
            sleep(Duration::from_millis(100));
        }
        sleep(rng.millis(1_000, 2_500));
        stop.store(true, Ordering::SeqCst);
        direct.join().expect("direct producer")
    });
    assert!(acked_by_old.is_empty(), "the cut-off node acknowledged {acked_by_old:?}\n{}", c.describe());
    let pid = c.pid(old);
    c.heal();
    let leader = wait_follows(&c, old, Duration::from_secs(20));
    let rejoins = c.node(old).log().matches("restarting this node to rejoin").count();
    eprintln!(
        "isolated leader: node {old} follows node {leader} again (pid {pid} -> {}, restarted itself {rejoins} times)",
        c.pid(old)
    );
    wait_caught_up(&c, old, Duration::from_secs(30));
    sleep(Duration::from_secs(1));
    finish(&c, &mut w, "isolated leader");
}

#[test]
fn a_paused_leader_resumes_as_follower_and_nothing_acknowledged_is_lost() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("paused leader"));
    let c = start_cluster();
    let mut w = Workload::start(&c, "paused", rng.next());
    let old = c.wait_leader(ELECTION);
    sleep(rng.millis(500, 1_500));
    // Stopped with requests in flight: it wakes up believing it still leads.
    c.stop(old);
    let new = wait_new_leader(&c, old, ELECTION);
    sleep(rng.millis(500, 2_000));
    c.cont(old);
    let leader = wait_follows(&c, old, Duration::from_secs(20));
    eprintln!("paused leader: node {new} led while node {old} was stopped; node {leader} leads now");
    wait_caught_up(&c, old, Duration::from_secs(30));
    sleep(Duration::from_secs(1));
    finish(&c, &mut w, "paused leader");
}

/// Whether any node's log shows a panic (a thread of it died, e.g. in raft-rs).
fn panicked_nodes(c: &Cluster) -> Vec<usize> {
    (1..=c.size()).filter(|&i| c.node(i).log().contains("panicked at")).collect()
}

#[test]
fn a_deposed_leader_with_entries_of_its_own_acknowledges_none_and_rejoins() {
    let _one = serial();
    let c = start_cluster();
    let old = c.wait_leader(ELECTION);
    // Entries all three hold: the cut-off leader's log then agrees with the majority's up to
    // them, and is cut back to there rather than replaced by a snapshot.
    let client = c.client();
    for n in 0..10 {
        let produced = client.produce("deposed", &json!({"id": format!("before-{n}"), "body": "x"}));
        assert!(produced.as_ref().is_ok_and(|r| r.ok()), "{produced:?}");
    }
    for i in (1..=3).filter(|&i| i != old) {
        wait_caught_up(&c, i, Duration::from_secs(10));
    }
    c.isolate(old);
    // Parallel writers give the cut-off leader a suffix of entries of its own, longer than the
    // idle majority's log grows meanwhile: after the heal Raft replaces that suffix by shorter
    // entries of the new leader, at indexes this node's log still holds.
    std::thread::scope(|sc| {
        for t in 0..8 {
            let url = c.url(old);
            sc.spawn(move || {
                let direct = ClusterClient::with_urls(vec![url]).with_deadline(Duration::from_millis(300));
                for n in 0..5 {
                    let r = direct.produce("deposed", &json!({"id": format!("d{t}-{n}"), "body": "x"}));
                    assert!(!r.as_ref().is_ok_and(|r| r.ok()), "the cut-off leader acknowledged {r:?}");
                }
            });
        }
    });
    let new = wait_new_leader(&c, old, ELECTION);
    // One at a time, each its own entry: the majority's log grows past the cut-off leader's
    // suffix, so Raft replaces that suffix with committed entries of the new leader.
    for n in 0..40 {
        let produced = client.produce("deposed", &json!({"id": format!("after-{n}"), "body": "x"}));
        assert!(produced.as_ref().is_ok_and(|r| r.ok()), "{produced:?}");
    }
    c.heal();
    let leader = wait_follows(&c, old, Duration::from_secs(20));
    wait_caught_up(&c, old, Duration::from_secs(30));
    let log = c.node(old).log();
    let rejoins = log.matches("restarting this node to rejoin").count();
    let cuts = log.matches("restarting to cut it back").count();
    eprintln!(
        "deposed leader: node {old} follows node {leader} (elected {new}), restarted itself {rejoins} times, \
         {cuts} of them to cut its log back"
    );
    assert!(panicked_nodes(&c).is_empty(), "a node panicked\n{}", c.describe());
    // The whole suffix goes in one cut: cutting an entry per restart kept a node that had
    // piled up hundreds of them restarting for minutes.
    assert!(cuts <= 1, "node {old} cut its log back {cuts} times\n{}", c.describe());
}

#[test]
fn a_healed_partition_catches_up_and_survives_the_leaders_death() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("healed partition"));
    let mut c = start_cluster();
    let mut w = Workload::start(&c, "healed", rng.next());
    let leader = c.wait_leader(ELECTION);
    let f = other_than(leader, &mut rng);
    sleep(rng.millis(300, 1_000));
    c.isolate(f);
    let before = view_u64(&c, leader, "commit_index").expect("leader's commit index");
    sleep(rng.millis(2_000, 4_000));
    let leader = c.wait_leader(ELECTION);
    assert_ne!(leader, f, "the cut-off follower leads\n{}", c.describe());
    let after = view_u64(&c, leader, "commit_index").expect("commit index");
    assert!(after > before, "nothing was committed with one follower cut off\n{}", c.describe());
    c.heal();
    wait_caught_up(&c, f, Duration::from_secs(15));
    // The healed node now holds what was acknowledged while it was away: losing the leader that
    // acknowledged it must lose nothing.
    c.kill9(leader);
    let new = wait_new_leader(&c, leader, ELECTION);
    eprintln!("healed partition: node {leader} killed, node {new} leads");
    sleep(rng.millis(500, 1_500));
    c.restart(leader);
    sleep(Duration::from_secs(1));
    finish(&c, &mut w, "healed partition");
}

#[test]
fn a_full_cluster_restart_keeps_and_delivers_everything_acknowledged() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("full restart"));
    let mut c = start_cluster();
    let mut w = Workload::start(&c, "restarted", rng.next());
    sleep(rng.millis(2_000, 3_500));
    for (i, status) in c.terminate_all() {
        assert!(status.success(), "node {i} exited with {status} on SIGTERM\n{}", c.describe());
    }
    sleep(rng.millis(0, 1_000));
    c.start_stopped();
    let leader = c.wait_leader(ELECTION);
    eprintln!("full restart: node {leader} leads after the restart");
    sleep(Duration::from_secs(2));
    finish(&c, &mut w, "full restart");
}

/// Kills the leader and produces until a 2xx comes from another node: the time that took.
fn failover_once(c: &mut Cluster, w: &Workload, round: usize) -> Duration {
    let s = &w.shared;
    let old = c.wait_leader(ELECTION);
    let probe = c.client().with_deadline(Duration::from_millis(500)).with_timeout(Duration::from_secs(1));
    let t0 = Instant::now();
    c.kill9(old);
    let mut tried = Vec::new();
    let mut n = 0;
    loop {
        n += 1;
        let id = format!("{}-probe{round}-{n}", s.topic);
        let sent = now_ms();
        s.last_due.fetch_max(sent, Ordering::SeqCst);
        let r = probe.produce(&s.topic, &json!({"id": id, "body": "x", "delay_ms": 0}));
        tried.push(match &r {
            Ok(r) => format!("{:?}: {} from {}", t0.elapsed(), r.status, r.node),
            Err(e) => format!("{:?}: {e}", t0.elapsed()),
        });
        if record_produce(s, &id, sent, &r) {
            let r = r.expect("a 2xx answer");
            assert_ne!(r.node, c.url(old), "a killed node answered");
            let took = t0.elapsed();
            eprintln!(
                "failover {round}: {took:?} from SIGKILL of node {old} to the first 2xx (from {})",
                r.node
            );
            if took >= FAILOVER_LIMIT {
                eprintln!("failover {round} was slow; the probe's answers:\n{}", tried.join("\n"));
                save_logs(c, "failover time");
            }
            return took;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no 2xx produce after the kill\n{}", c.describe());
    }
}

#[test]
fn failover_from_leader_sigkill_to_the_first_acknowledged_produce_is_quick() {
    let _one = serial();
    let mut rng = Rng::new(Rng::seed("failover time"));
    let mut c = start_cluster();
    let mut w = Workload::start(&c, "failover", rng.next());
    let mut times = Vec::new();
    for round in 0..3 {
        sleep(rng.millis(500, 1_500));
        times.push(failover_once(&mut c, &w, round));
        let killed = (1..=3).find(|&i| !c.is_running(i)).expect("the killed node");
        c.restart(killed);
    }
    finish(&c, &mut w, "failover time");
    let worst = times.iter().max().copied().unwrap_or_default();
    assert!(worst < FAILOVER_LIMIT, "a failover took {worst:?} (all: {times:?})");
}
