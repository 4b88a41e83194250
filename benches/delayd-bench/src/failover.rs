//! The failover workload (issue 27): a three-node delayd cluster under a steady produce load whose
//! messages fall due within seconds, popped and acked by consumers that follow the leader; the
//! leader is SIGKILLed, and the run measures the time from the kill to the first produce a new
//! leader answers 2xx, and the lateness of what fell due meanwhile. The killed node is restarted
//! (and rejoins) before the next repeat.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::group;
use crate::queue::{now_ms, Job, Queue};
use crate::workloads::{spawn_consumers, topic, Params, Rng, Running, Shared};

/// The failover workload's settings.
#[derive(Debug, Clone)]
pub struct FailoverParams {
    /// Leader kills, each on the cluster as the previous one left it (the killed node restarted).
    pub repeats: usize,
    /// Produce rate, msgs/s, one message per call.
    pub rate: u64,
    /// Concurrent producers sharing the rate.
    pub producers: usize,
    /// Random delay range of the produced messages, ms.
    pub delay_ms: (u64, u64),
    /// Seconds of load before the kill (longer than the longest delay, so messages fall due
    /// during the failover).
    pub load_secs: f64,
    /// Seconds the load goes on once a new leader answers.
    pub after_secs: f64,
    /// Time-to-run of the consumers' reservations, ms.
    pub ttr_ms: u64,
    /// Consumers (the run's `--consumers`), each popping up to `--pop-batch` at a time.
    pub consumers: usize,
}

/// One leader kill.
#[derive(Debug, Clone, Default)]
pub struct FailoverRun {
    /// Node id of the leader killed.
    pub killed: u64,
    /// Node id of the leader that followed.
    pub new_leader: u64,
    /// The new leader's term (the old one's plus the elections it took).
    pub new_term: u64,
    /// Kill until the first 2xx produce answered by another node, ms.
    pub to_first_produce_ms: f64,
    /// Kill until `/v1/cluster` of both survivors names the same leader, taking writes, ms.
    pub to_agreed_leader_ms: f64,
    /// Produces acknowledged in the whole repeat.
    pub acked: usize,
    /// Produce calls that failed (their outcome unknown: in flight at the kill, or timed out).
    pub produce_failed: usize,
    /// From the kill to the first 2xx produce on the new leader (unix ms).
    pub window_ms: (i64, i64),
    /// Lateness (ms, sorted) of the messages that fell due in `window_ms`.
    pub window_lateness: Vec<i64>,
    /// Lateness (ms, sorted) of every message of the repeat.
    pub lateness: Vec<i64>,
    /// Deliveries before the due time the cluster gave (server's stamp).
    pub early: usize,
    /// Deliveries before the client's send time plus the delay (client's clock).
    pub early_client: usize,
    /// Acknowledged produces never delivered.
    pub lost: usize,
    /// Messages delivered more than once (reservations lost with the leader come back after TTR).
    pub duplicates: usize,
    /// Messages delivered again after their ack had succeeded.
    pub after_ack: usize,
    /// Restart of the killed node until it follows the new leader, ms.
    pub rejoin_ms: f64,
    /// The longest produce call started after the first 2xx on the new leader, ms: a stall of the
    /// new leader shows here.
    pub slowest_after_ms: f64,
}

/// What the producers share with the workload.
#[derive(Default)]
struct Produced {
    /// Acknowledged sequence numbers.
    acked: Mutex<Vec<u64>>,
    /// Earliest due time by the client's clock (send time + delay), of every message sent.
    client_due: Mutex<HashMap<u64, i64>>,
    failed: AtomicU64,
    /// The killed node's port, once the leader is killed.
    kill: Mutex<Option<(u16, Instant)>>,
    /// First 2xx produce from another node after the kill.
    first_after: Mutex<Option<Instant>>,
    /// The longest call started after `first_after`, µs.
    slowest_after_us: AtomicU64,
}

impl Produced {
    fn note_ok(&self, seq: u64, port: u16) {
        self.acked.lock().unwrap_or_else(|e| e.into_inner()).push(seq);
        if let Some((dead, _)) = *self.kill.lock().unwrap_or_else(|e| e.into_inner()) {
            if port != dead {
                self.first_after.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Instant::now);
            }
        }
    }
}

/// Runs every repeat on `run` (a delayd cluster), restarting the killed node after each.
pub async fn run(run: &mut Running, p: &Params, fp: &FailoverParams) -> Result<Vec<FailoverRun>, String> {
    if run.peers.len() < 2 || !run.server.system.is_delayd() {
        return Err("the failover workload needs a delayd cluster (delayd-cluster3-sync)".to_string());
    }
    let mut out = Vec::new();
    for rep in 0..fp.repeats {
        let r = one(run, p, fp, rep).await?;
        eprintln!(
            "  kill {} of {}: node {} -> node {}, first 2xx produce after {:.0} ms (leader agreed after {:.0} ms), \
             {} due meanwhile, lateness p99 {:?} max {:?} ms, {} early, {} lost, {} twice, slowest produce after {:.0} ms, rejoined in {:.0} ms",
            rep + 1,
            fp.repeats,
            r.killed,
            r.new_leader,
            r.to_first_produce_ms,
            r.to_agreed_leader_ms,
            r.window_lateness.len(),
            crate::report::percentile(&r.window_lateness, 99.0),
            r.window_lateness.last(),
            r.early + r.early_client,
            r.lost,
            r.duplicates,
            r.slowest_after_ms,
            r.rejoin_ms
        );
        out.push(r);
    }
    Ok(out)
}

/// Producers at `fp.rate` msgs/s in all, one message per call, until `stop`.
fn spawn_producers(
    run: &Running,
    p: &Params,
    fp: &FailoverParams,
    topic: &str,
    rep: usize,
    produced: &Arc<Produced>,
    stop: &Arc<AtomicBool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, String> {
    let next_seq = Arc::new(AtomicU64::new(0));
    let period = Duration::from_secs_f64(fp.producers as f64 / fp.rate.max(1) as f64);
    let mut tasks = Vec::new();
    for w in 0..fp.producers {
        let Queue::Delayd(mut q) = run.queue(p)? else { return Err("not a delayd client".to_string()) };
        let (topic, produced, stop, next_seq) =
            (topic.to_string(), produced.clone(), stop.clone(), next_seq.clone());
        let mut rng = Rng::new(p.seed, 7000 + rep as u64 * 100 + w as u64);
        let (ttr_ms, (dmin, dmax)) = (fp.ttr_ms, fp.delay_ms);
        tasks.push(tokio::spawn(async move {
            let mut pace = tokio::time::interval(period);
            // A call held up by the failover is followed by the next one, not by a burst.
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(Ordering::Relaxed) {
                pace.tick().await;
                let job = Job {
                    seq: next_seq.fetch_add(1, Ordering::Relaxed),
                    delay_ms: rng.range(dmin, dmax),
                    ttr_ms,
                };
                let due = now_ms() + job.delay_ms as i64;
                produced.client_due.lock().unwrap_or_else(|e| e.into_inner()).insert(job.seq, due);
                let started = Instant::now();
                let after = produced.first_after.lock().unwrap_or_else(|e| e.into_inner()).is_some();
                let outcome = q.produce_on(&topic, &[job]).await;
                if after {
                    produced
                        .slowest_after_us
                        .fetch_max(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                match outcome {
                    Ok((v, port)) if v.first() == Some(&true) => produced.note_ok(job.seq, port),
                    _ => {
                        produced.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    Ok(tasks)
}

/// One repeat: load, kill, recovery, more load, drain, restart of the killed node.
async fn one(run: &mut Running, p: &Params, fp: &FailoverParams, rep: usize) -> Result<FailoverRun, String> {
    let topic = topic("failover");
    let shared = Shared::default();
    let consumers = spawn_consumers(run, p, &topic, fp.ttr_ms, &shared)?;
    let produced = Arc::new(Produced::default());
    let stop_produce = Arc::new(AtomicBool::new(false));
    let producers = spawn_producers(run, p, fp, &topic, rep, &produced, &stop_produce)?;
    let outcome = kill_and_recover(run, fp, &produced).await;
    stop_produce.store(true, Ordering::Relaxed);
    for t in producers {
        let _ = t.await;
    }
    if outcome.is_ok() {
        drain(fp, &produced, &shared).await;
    }
    shared.stop.store(true, Ordering::Relaxed);
    for c in consumers {
        let _ = c.await;
    }
    let (mut r, dead) = outcome?;
    r.rejoin_ms = rejoin(run, dead).await?;
    tally(&mut r, &produced, &shared);
    Ok(r)
}

/// Loads, kills the leader, waits for a new one (which takes `run.server`'s place) and its first
/// 2xx produce, loads on; returns the figures so far and where in `run.peers` the dead node is.
async fn kill_and_recover(
    run: &mut Running,
    fp: &FailoverParams,
    produced: &Produced,
) -> Result<(FailoverRun, usize), String> {
    tokio::time::sleep(Duration::from_secs_f64(fp.load_secs)).await;
    let killed = group::view(run.server.port).await.map(|v| v.node_id).unwrap_or(0);
    let (kill_at, kill_ms) = (Instant::now(), now_ms());
    *produced.kill.lock().unwrap_or_else(|e| e.into_inner()) = Some((run.server.port, kill_at));
    run.server.kill9();
    let (i, view) = group::find_leader(&run.peers, None, Duration::from_secs(60))
        .await
        .map_err(|e| format!("after killing node {killed}: {e}"))?;
    let to_agreed_leader_ms = kill_at.elapsed().as_secs_f64() * 1000.0;
    std::mem::swap(&mut run.server, &mut run.peers[i]);
    let give_up = kill_at + Duration::from_secs(60);
    let first = loop {
        if let Some(t) = *produced.first_after.lock().unwrap_or_else(|e| e.into_inner()) {
            break t;
        }
        if Instant::now() > give_up {
            return Err(format!("no produce was answered 2xx within 60 s of killing node {killed}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let to_first_produce_ms = first.duration_since(kill_at).as_secs_f64() * 1000.0;
    tokio::time::sleep(Duration::from_secs_f64(fp.after_secs)).await;
    let r = FailoverRun {
        killed,
        new_leader: view.node_id,
        new_term: view.term,
        to_first_produce_ms,
        to_agreed_leader_ms,
        window_ms: (kill_ms, kill_ms + to_first_produce_ms.ceil() as i64),
        ..FailoverRun::default()
    };
    Ok((r, i))
}

/// Waits until every acknowledged message was delivered, allowing for reservations lost with the
/// old leader, which come back after their TTR.
async fn drain(fp: &FailoverParams, produced: &Produced, shared: &Shared) {
    let acked: Vec<u64> = produced.acked.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let deadline = Instant::now() + Duration::from_millis(fp.delay_ms.1 + fp.ttr_ms + 10_000);
    loop {
        let done = {
            let s = shared.seen.lock().unwrap_or_else(|e| e.into_inner());
            acked.iter().all(|q| s.first.contains_key(q))
        };
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Redeliveries of messages whose ack died with the leader show up within a TTR.
    tokio::time::sleep(Duration::from_millis(fp.ttr_ms + 500)).await;
}

/// Restarts the killed node (`run.peers[dead]`) on its data dir; returns the ms until it follows
/// the leader.
async fn rejoin(run: &mut Running, dead: usize) -> Result<f64, String> {
    let leader = group::view(run.server.port).await.map(|v| v.node_id);
    let node = &mut run.peers[dead];
    let t0 = Instant::now();
    node.spawn_and_wait().await.map_err(|e| format!("restart of the killed node: {e}"))?;
    loop {
        let v = group::view(node.port).await;
        if v.is_some_and(|v| v.role == "follower" && v.leader_id == leader) {
            return Ok(t0.elapsed().as_secs_f64() * 1000.0);
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "the restarted node did not follow within 60 s; its log says:\n{}",
                node.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fills in what the consumers saw.
fn tally(r: &mut FailoverRun, produced: &Produced, shared: &Shared) {
    let (start, end) = r.window_ms;
    let s = shared.seen.lock().unwrap_or_else(|e| e.into_inner());
    let client_due = produced.client_due.lock().unwrap_or_else(|e| e.into_inner());
    let acked = produced.acked.lock().unwrap_or_else(|e| e.into_inner());
    r.acked = acked.len();
    r.produce_failed = produced.failed.load(Ordering::Relaxed) as usize;
    r.lost = acked.iter().filter(|q| !s.first.contains_key(q)).count();
    r.duplicates = s.count.values().filter(|c| **c >= 2).count();
    r.after_ack = s.after_ack.len();
    r.slowest_after_ms = produced.slowest_after_us.load(Ordering::Relaxed) as f64 / 1000.0;
    let (mut window, mut all) = (Vec::new(), Vec::new());
    for (seq, at) in &s.first {
        let due = s.due.get(seq).copied().unwrap_or(*at);
        all.push(at - due);
        if (start..=end).contains(&due) {
            window.push(at - due);
        }
        if client_due.get(seq).is_some_and(|d| at < d) {
            r.early_client += 1;
        }
    }
    r.early = all.iter().filter(|l| **l < 0).count();
    window.sort_unstable();
    all.sort_unstable();
    r.window_lateness = window;
    r.lateness = all;
}
