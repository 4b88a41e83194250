//! Markdown tables of one run, and the check of the benchmark's targets (issue 13) against them.

use std::fmt::Write as _;

use crate::failover::{FailoverParams, FailoverRun};
use crate::soak::{SoakParams, SoakRun};
use crate::systems::{Engine, System};
use crate::workloads::{Capacity, Case, Crash, E2e, Params, Throughput};

/// What one workload produced for one system: its repeats, or why it failed.
pub type Outcome<T> = Result<Vec<T>, String>;

/// Everything measured in one run.
#[derive(Default)]
pub struct Results {
    /// Run description lines (date, machine, command, sizes).
    pub header: Vec<String>,
    /// Warnings the reader must see (missing redis-server, failures).
    pub notes: Vec<String>,
    /// Produce throughput per system; each inner vec holds every repeat of every mode.
    pub throughput: Vec<(System, Outcome<Throughput>)>,
    /// End-to-end runs per system.
    pub e2e: Vec<(System, Outcome<E2e>)>,
    /// Capacity runs per system.
    pub capacity: Vec<(System, Outcome<Capacity>)>,
    /// Crash runs per system.
    pub crash: Vec<(System, Outcome<Crash>)>,
    /// Soak runs by label (each delayd system with reclaim on, then off).
    pub soak: Vec<(String, Result<SoakRun, String>)>,
    /// The soak settings, when the soak workload was selected.
    pub soak_params: Option<SoakParams>,
    /// Push runs per delayd system: the burst, then each paced rate.
    pub push: Vec<(String, Result<Vec<crate::push::PushRun>, String>)>,
    /// Failover runs per delayd cluster: every leader kill.
    pub failover: Vec<(String, Result<Vec<FailoverRun>, String>)>,
    /// The failover settings, when the failover workload was selected.
    pub failover_params: Option<FailoverParams>,
}

/// What one repeat of a comparison workload measured on one system.
pub enum Rep {
    /// Every throughput case.
    Throughput(Vec<Throughput>),
    /// Every end-to-end rate.
    E2e(Vec<E2e>),
    /// One capacity fill.
    Capacity(Capacity),
    /// One crash.
    Crash(Crash),
}

/// Adds one repeat to a system's results; the first error of any repeat stands for the system.
fn add<T>(list: &mut Vec<(System, Outcome<T>)>, sys: System, o: Result<Vec<T>, String>) {
    let Some((_, have)) = list.iter_mut().find(|(s, _)| *s == sys) else {
        list.push((sys, o));
        return;
    };
    match (have, o) {
        (Ok(v), Ok(more)) => v.extend(more),
        (have @ Ok(_), Err(e)) => *have = Err(e),
        (Err(_), _) => {}
    }
}

impl Results {
    /// Records one repeat of workload `w` on `sys`.
    pub fn record(&mut self, w: &str, sys: System, o: Result<Rep, String>) {
        match (w, o) {
            ("produce", Ok(Rep::Throughput(v))) => add(&mut self.throughput, sys, Ok(v)),
            ("produce", Err(e)) => add(&mut self.throughput, sys, Err(e)),
            ("e2e", Ok(Rep::E2e(v))) => add(&mut self.e2e, sys, Ok(v)),
            ("e2e", Err(e)) => add(&mut self.e2e, sys, Err(e)),
            ("capacity", Ok(Rep::Capacity(c))) => add(&mut self.capacity, sys, Ok(vec![c])),
            ("capacity", Err(e)) => add(&mut self.capacity, sys, Err(e)),
            (_, Ok(Rep::Crash(c))) => add(&mut self.crash, sys, Ok(vec![c])),
            (_, Err(e)) => add(&mut self.crash, sys, Err(e)),
            (w, Ok(_)) => {
                self.notes.push(format!("internal: a {w} repeat returned another workload's results"))
            }
        }
    }
}

/// Median, min and max of a sample.
pub fn spread(mut v: Vec<f64>) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    let med = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    Some((med, v[0], v[n - 1]))
}

/// Nearest-rank percentile of a sorted sample.
pub fn percentile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn num(x: f64) -> String {
    if x.abs() >= 100.0 {
        let s = format!("{:.0}", x);
        // Thousands separators make msgs/s columns readable at a glance.
        let (sign, digits) = s.strip_prefix('-').map(|d| ("-", d)).unwrap_or(("", &s));
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        format!("{sign}{out}")
    } else if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

/// "median (min–max)", or just the value when all repeats agree.
fn cell(v: Vec<f64>) -> String {
    match spread(v) {
        None => "–".to_string(),
        Some((m, lo, hi)) if lo == hi => num(m),
        Some((m, lo, hi)) => format!("{} ({}–{})", num(m), num(lo), num(hi)),
    }
}

fn fail_cell(e: &str) -> String {
    let first = e.lines().next().unwrap_or("");
    format!("failed: {}", first.replace('|', "/").chars().take(120).collect::<String>())
}

/// Median of `figure` for `sys` in `case` over the repeats that have it.
fn median_of(r: &Results, sys: System, case: Case, figure: fn(&Throughput) -> Option<f64>) -> Option<f64> {
    let (_, o) = r.throughput.iter().find(|(s, _)| *s == sys)?;
    let v = o.as_ref().ok()?;
    spread(v.iter().filter(|t| t.case == case).filter_map(figure).collect()).map(|s| s.0)
}

/// Median rate of `sys` in `case` over the repeats.
pub fn median_rate(r: &Results, sys: System, case: Case) -> Option<f64> {
    median_of(r, sys, case, |t| Some(t.rate()))
}

/// Server CPU per message of `sys` in `case`, µs, median over the repeats.
pub fn median_cpu_us(r: &Results, sys: System, case: Case) -> Option<f64> {
    median_of(r, sys, case, Throughput::cpu_us_per_msg)
}

/// A table's head: the system column, one per case, then `last` columns named in `names`.
fn case_columns(s: &mut String, p: &Params, cases: &[Case], last: &[&str]) {
    let _ = write!(s, "| system |");
    for c in cases.iter().map(|c| c.label(p)).chain(last.iter().map(|n| n.to_string())) {
        let _ = write!(s, " {c} |");
    }
    let _ = writeln!(s, "\n|---|{}", "---|".repeat(cases.len() + last.len()));
}

/// The server's CPU time per message in every throughput case: a column per case.
fn cpu_table(s: &mut String, r: &Results, p: &Params, cases: &[Case]) {
    case_columns(s, p, cases, &[]);
    for (sys, o) in &r.throughput {
        let Ok(v) = o else { continue };
        let _ = write!(s, "| {} |", sys.name());
        for c in cases {
            let _ = write!(
                s,
                " {} |",
                cell(v.iter().filter(|t| t.case == *c).filter_map(Throughput::cpu_us_per_msg).collect())
            );
        }
        let _ = writeln!(s);
    }
}

/// One throughput table: a column per case, the errors of those cases last.
fn throughput_table(s: &mut String, r: &Results, p: &Params, cases: &[Case]) {
    case_columns(s, p, cases, &["errors"]);
    for (sys, o) in &r.throughput {
        match o {
            Err(e) => {
                let _ = writeln!(s, "| {} | {} |{}", sys.name(), fail_cell(e), " |".repeat(cases.len()));
            }
            Ok(v) => {
                let _ = write!(s, "| {} |", sys.name());
                for c in cases {
                    let _ = write!(
                        s,
                        " {} |",
                        cell(v.iter().filter(|t| t.case == *c).map(Throughput::rate).collect())
                    );
                }
                let mine = || v.iter().filter(|t| cases.contains(&t.case));
                let failed: usize = mine().map(|t| t.failed).sum();
                let err = mine().find_map(|t| t.error.clone()).map(|e| format!(" ({})", fail_cell(&e)));
                let _ = writeln!(s, " {failed}{} |", err.unwrap_or_default());
            }
        }
    }
}

/// Renders the whole results file.
pub fn markdown(r: &Results, p: &Params) -> String {
    let rates = &p.rates;
    let mut s = String::new();
    let _ = writeln!(s, "# delayd-bench results\n");
    for h in &r.header {
        let _ = writeln!(s, "- {h}");
    }
    if !r.notes.is_empty() {
        let _ = writeln!(s, "\n**Notes**\n");
        for n in &r.notes {
            let _ = writeln!(s, "- {n}");
        }
    }
    let _ = writeln!(
        s,
        "\nSystems: `delayd-sync`/`delayd-async` are delayd with `DELAYD_FLUSH=sync|async`; `redis-lua-*` is the \
         Youzan design (all state changes in Lua, mover loop); `redis-plain-*` is the ouqiang/delay-queue style \
         (separate commands, 1-second timer); `always`/`everysec` is Redis `appendfsync`. Cells are \
         median (min–max) over repeats."
    );
    let replicated =
        r.throughput.iter().map(|(s, _)| s).chain(r.e2e.iter().map(|(s, _)| s)).any(|s| s.replicated);
    if replicated || !r.failover.is_empty() {
        let _ = writeln!(
            s,
            "\n`delayd-cluster3-sync` is three delayd nodes on this machine (`DELAYD_FLUSH=sync`, each its own \
             data dir, node-to-node links on loopback), the load sent to the leader: a write is answered once \
             a majority of nodes has it fsynced. `redis-replica-wait` is the redis-lua design on a master \
             with one replica (`appendonly yes`, `appendfsync always` on both), every write followed by \
             `WAIT 1 0` in the same pipeline. Server CPU of a replicated system is the sum over its processes; \
             capacity (memory, disk) is the leader's or master's alone."
        );
    }

    let _ = writeln!(s, "\n## Produce throughput (msgs/s)\n");
    let _ = writeln!(
        s,
        "Messages acknowledged per second, all due in 1 h. Each client sends its next call when the last \
         is answered; one at a time is one message per request (delayd) or per command sequence (Redis).\n"
    );
    throughput_table(&mut s, r, p, &Case::PRODUCE);
    let _ = writeln!(s, "\n## Pop + ack throughput (acked msgs/s)\n");
    let _ = writeln!(
        s,
        "Acknowledged messages per second from a backlog of {} ready messages. Each consumer pops (the \
         same maximum on every system; a Lua script call reserves the whole batch on redis-lua), then acks \
         every message it got, one request or script call each, before its next pop.\n",
        num(p.preload as f64)
    );
    throughput_table(&mut s, r, p, &Case::POP_ACK);
    let _ = writeln!(s, "\n## Server CPU per message (µs)\n");
    let _ = writeln!(
        s,
        "CPU time the server process used (user + system, all threads, from `/proc/PID/stat`) during each \
         measured case, divided by the messages acknowledged in it; for pop + ack that covers a pop's share and \
         the ack. The server runs on one CPU when pinned, so one CPU-second over this figure bounds its rate. \
         The kernel's loopback work for a packet is charged to whichever side sends it.\n"
    );
    let all: Vec<Case> = Case::PRODUCE.iter().chain(Case::POP_ACK.iter()).copied().collect();
    cpu_table(&mut s, r, p, &all);

    let _ = writeln!(s, "\n## End-to-end lateness (delivery − due, ms)\n");
    let _ = writeln!(
        s,
        "Paced producer, random delays, {} consumers each reserving up to {} per pop (on every system) and \
         acking each. Negative lateness means delivered early. `missing` counts acknowledged produces not \
         delivered before the deadline.\n",
        p.consumers, p.pop_batch
    );
    let _ = writeln!(
        s,
        "| system | target msgs/s | achieved msgs/s | produced | produce errors | delivered | missing | early | \
         duplicates | p50 | p99 | p99.9 | max | min |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (sys, o) in &r.e2e {
        match o {
            Err(e) => {
                let _ = writeln!(s, "| {} | {} ||||||||||||", sys.name(), fail_cell(e));
            }
            Ok(v) => {
                for rate in rates {
                    let runs: Vec<&E2e> = v.iter().filter(|x| x.rate == *rate).collect();
                    if runs.is_empty() {
                        continue;
                    }
                    let f = |g: &dyn Fn(&E2e) -> f64| cell(runs.iter().map(|x| g(x)).collect());
                    let pct = |q: f64| {
                        cell(
                            runs.iter()
                                .filter_map(|x| percentile(&x.lateness, q))
                                .map(|l| l as f64)
                                .collect(),
                        )
                    };
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        sys.name(),
                        num(*rate as f64),
                        f(&|x| x.achieved_rate),
                        f(&|x| x.produced as f64),
                        f(&|x| x.produce_failed as f64),
                        f(&|x| x.delivered as f64),
                        f(&|x| x.missing as f64),
                        f(&|x| x.early as f64),
                        f(&|x| x.duplicates as f64),
                        pct(50.0),
                        pct(99.0),
                        pct(99.9),
                        pct(100.0),
                        cell(runs.iter().filter_map(|x| x.lateness.first()).map(|l| *l as f64).collect()),
                    );
                }
            }
        }
    }

    let _ = writeln!(s, "\n## Pending capacity (messages due in 1 h)\n");
    let _ = writeln!(
        s,
        "RssAnon from /proc/PID/status (anonymous memory; mapped file pages are page cache and do not count). \
         Disk is every data file of the server: allocated blocks, and apparent size in brackets.\n"
    );
    let _ = writeln!(
        s,
        "| system | pending | fill msgs/s | RssAnon growth (MiB) | RssAnon bytes/msg | disk MiB (apparent) | \
         disk bytes/msg (apparent) |\n|---|---|---|---|---|---|---|"
    );
    for (sys, o) in &r.capacity {
        match o {
            Err(e) => {
                let _ = writeln!(s, "| {} | {} ||||||", sys.name(), fail_cell(e));
            }
            Ok(v) => {
                let f = |g: &dyn Fn(&Capacity) -> f64| cell(v.iter().map(g).collect());
                let grow = |c: &Capacity| c.rss_after.saturating_sub(c.rss_before) as f64;
                let n = |c: &Capacity| c.pending.max(1) as f64;
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} ({}) | {} ({}) |",
                    sys.name(),
                    f(&|c| c.pending as f64),
                    f(&|c| c.fill_rate),
                    f(&|c| grow(c) / 1048576.0),
                    f(&|c| grow(c) / n(c)),
                    f(&|c| c.disk_alloc as f64 / 1048576.0),
                    f(&|c| c.disk_apparent as f64 / 1048576.0),
                    f(&|c| c.disk_alloc as f64 / n(c)),
                    f(&|c| c.disk_apparent as f64 / n(c)),
                );
            }
        }
    }

    let _ = writeln!(s, "\n## Crash (SIGKILL under produce/pop/ack load, restart, drain)\n");
    let _ = writeln!(
        s,
        "`lost` = acknowledged produces never delivered; `twice` = messages delivered two or more times \
         (at-least-once redelivery of messages reserved at the kill is expected); `after ack` = delivered again \
         after its ack had succeeded.\n"
    );
    let _ = writeln!(
        s,
        "| system | acked produces | lost | twice | after ack | restart → answers (ms) | restart → first pop (ms) |\n\
         |---|---|---|---|---|---|---|"
    );
    for (sys, o) in &r.crash {
        match o {
            Err(e) => {
                let _ = writeln!(s, "| {} | {} ||||||", sys.name(), fail_cell(e));
            }
            Ok(v) => {
                let f = |g: &dyn Fn(&Crash) -> f64| cell(v.iter().map(g).collect());
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    sys.name(),
                    f(&|c| c.acked as f64),
                    f(&|c| c.lost as f64),
                    f(&|c| c.twice as f64),
                    f(&|c| c.after_ack as f64),
                    f(&|c| c.ready_ms),
                    if v.iter().any(|c| c.first_pop_ms.is_none()) {
                        "never".to_string()
                    } else {
                        f(&|c| c.first_pop_ms.unwrap_or(0.0))
                    },
                );
            }
        }
    }

    if !r.push.is_empty() {
        let _ = writeln!(s, "\n## Push delivery to a local webhook\n");
        let _ = writeln!(
            s,
            "delayd POSTs each due message to a receiver in this process (max_in_flight 64). Burst: \
             every message due at the same moment, deliveries/s from the first arrival to the last. \
             Paced: batches every 10 ms due 1 s later; lateness = arrival − due time.\n"
        );
        let _ = writeln!(s, "| System | Run | Delivered | Deliveries/s | p50 ms | p99 ms | max ms | early |");
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|");
        for (name, o) in &r.push {
            match o {
                Ok(runs) => {
                    for x in runs {
                        let p = |q| percentile(&x.lateness, q).map_or("-".into(), |v: i64| v.to_string());
                        let _ = writeln!(
                            s,
                            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
                            if x.rate == 0 {
                                "burst".to_string()
                            } else {
                                format!("{} msgs/s", num(x.rate as f64))
                            },
                            x.delivered,
                            num(x.per_sec),
                            p(50.0),
                            p(99.0),
                            x.lateness.last().map_or("-".into(), |v| v.to_string()),
                            x.lateness.iter().filter(|l| **l < 0).count(),
                        );
                    }
                }
                Err(e) => {
                    let _ =
                        writeln!(s, "| {name} | failed: {} | | | | | | |", e.lines().next().unwrap_or(""));
                }
            }
        }
    }

    if let Some(sp) = &r.soak_params {
        s.push_str(&crate::soak::markdown(&r.soak, sp));
    }

    if let Some(fp) = &r.failover_params {
        failover_markdown(&mut s, &r.failover, fp);
    }
    let t27 = targets27(r, rates);
    if !t27.is_empty() {
        let _ = writeln!(s, "\n## Targets of issue 27, checked against this run\n");
        for line in t27 {
            let _ = writeln!(s, "- {line}");
        }
    }

    let _ = writeln!(s, "\n## Targets of issue 13, checked against this run\n");
    let _ = writeln!(
        s,
        "Ratios are the median of one system's repeats over the median of the other's, from the same \
         interleaved run.\n"
    );
    for line in targets(r, rates) {
        let _ = writeln!(s, "- {line}");
    }
    s
}

fn sys(engine: Engine, strict: bool) -> System {
    System::single(engine, strict)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

/// One line per target: PASS, FAIL (delayd loses or misses), or not measured.
pub fn targets(r: &Results, rates: &[u64]) -> Vec<String> {
    let mut out = Vec::new();
    let goals = [
        (Case::Single, 1.0),
        (Case::Conc16, 2.0),
        (Case::Conc64, 2.0),
        (Case::Batch1, 2.0),
        (Case::BatchN, 2.0),
        (Case::PopAck1, 1.0),
        (Case::PopAck16, 1.0),
    ];
    for (d, l) in [
        (sys(Engine::Delayd, false), sys(Engine::RedisLua, false)),
        (sys(Engine::Delayd, true), sys(Engine::RedisLua, true)),
    ] {
        for (case, goal) in goals {
            let what = format!("{} ≥ {goal:.1}× {}, {}", d.name(), l.name(), case_name(case));
            match (median_rate(r, d, case), median_rate(r, l, case)) {
                (Some(a), Some(b)) => {
                    let cpu = match (median_cpu_us(r, d, case), median_cpu_us(r, l, case)) {
                        (Some(x), Some(y)) => format!(" (server CPU {} vs {} µs/msg)", num(x), num(y)),
                        _ => String::new(),
                    };
                    out.push(format!(
                        "{}: {what}: {} vs {} msgs/s = {:.2}×{cpu}",
                        verdict(a >= goal * b),
                        num(a),
                        num(b),
                        a / b.max(1e-9)
                    ))
                }
                _ => out.push(format!("not measured: {what}")),
            }
        }
    }
    for rate in rates {
        let limit = if *rate <= 1_000 { 5 } else { 10 };
        for strict in [true, false] {
            let s = sys(Engine::Delayd, strict);
            let Some((_, Ok(v))) = r.e2e.iter().find(|(x, _)| *x == s) else {
                out.push(format!("not measured: {} lateness at {rate} msgs/s", s.name()));
                continue;
            };
            let runs: Vec<&E2e> = v.iter().filter(|x| x.rate == *rate).collect();
            let p99 =
                spread(runs.iter().filter_map(|x| percentile(&x.lateness, 99.0)).map(|l| l as f64).collect());
            let early: usize = runs.iter().map(|x| x.early).sum();
            let missing: usize = runs.iter().map(|x| x.missing).sum();
            match p99 {
                Some((p, _, _)) => out.push(format!(
                    "{}: {} at {rate} msgs/s: p99 {p} ms (target ≤ {limit}), {early} early (target 0), {missing} missing",
                    verdict(p <= limit as f64 && early == 0 && missing == 0),
                    s.name()
                )),
                None => out.push(format!("not measured: {} lateness at {rate} msgs/s", s.name())),
            }
        }
    }
    out
}

/// The failover tables: a summary per cluster, then every kill.
fn failover_markdown(
    s: &mut String,
    runs: &[(String, Result<Vec<FailoverRun>, String>)],
    fp: &FailoverParams,
) {
    let _ = writeln!(s, "\n## Failover (leader SIGKILL under load)\n");
    let _ = writeln!(
        s,
        "{} producers send one message per call, {} msgs/s in all, delays {}–{} ms; {} consumers follow the \
         leader, pop (TTR {} ms) and ack. After {} s of load the leader gets SIGKILL; the load goes on for {} s \
         after a new leader answers, then stops, every acknowledged message is waited for, and the killed node \
         is restarted on its data dir before the next kill. `first 2xx` = kill → the first produce a new \
         leader answered 2xx; `agreed` = kill → both survivors' `/v1/cluster` name one leader that takes \
         writes (polled every 20 ms); `due meanwhile` = messages whose due time fell between the kill and \
         the first 2xx, with their lateness (delivery − due); `slowest produce after` = the longest produce \
         call started after that first 2xx (a stall of the new leader). `early` counts deliveries before the due time \
         the cluster stamped / before the client's send time + delay; both must be 0. `lost` = acknowledged \
         produces never delivered (must be 0). Clients retry a refused connection or `503 no_leader` on the \
         next node after at most 10 ms, and follow `307`.\n",
        fp.producers,
        num(fp.rate as f64),
        fp.delay_ms.0,
        fp.delay_ms.1,
        fp.consumers,
        fp.ttr_ms,
        fp.load_secs,
        fp.after_secs
    );
    let _ = writeln!(
        s,
        "| system | kills | first 2xx ms, median (max) | agreed ms, median (max) | due meanwhile | their p50 | p99 | max \
         | early (server / client) | lost | twice | after ack | rejoin ms, median (max) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let med_max =
        |v: Vec<f64>| spread(v).map_or("–".into(), |(m, _, hi)| format!("{} ({})", num(m), num(hi)));
    for (name, o) in runs {
        let v = match o {
            Ok(v) => v,
            Err(e) => {
                let _ = writeln!(s, "| {name} | {} ||||||||||||", fail_cell(e));
                continue;
            }
        };
        let mut window: Vec<i64> = v.iter().flat_map(|r| r.window_lateness.iter().copied()).collect();
        window.sort_unstable();
        let pct = |q| percentile(&window, q).map_or("–".into(), |x| x.to_string());
        let sum = |f: fn(&FailoverRun) -> usize| v.iter().map(f).sum::<usize>();
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {} | {} |",
            v.len(),
            med_max(v.iter().map(|r| r.to_first_produce_ms).collect()),
            med_max(v.iter().map(|r| r.to_agreed_leader_ms).collect()),
            window.len(),
            pct(50.0),
            pct(99.0),
            pct(100.0),
            sum(|r| r.early),
            sum(|r| r.early_client),
            sum(|r| r.lost),
            sum(|r| r.duplicates),
            sum(|r| r.after_ack),
            med_max(v.iter().map(|r| r.rejoin_ms).collect()),
        );
    }
    kills_table(s, runs);
}

/// Every kill of the failover runs, one row each.
fn kills_table(s: &mut String, runs: &[(String, Result<Vec<FailoverRun>, String>)]) {
    let _ = writeln!(
        s,
        "\nEvery kill:\n\n| system | kill | node killed → new leader (its term) | first 2xx ms | agreed ms | acked produces \
         | failed calls | slowest produce after ms | due meanwhile | their max ms | all messages' p99 / max ms \
         | twice |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (name, o) in runs {
        for (i, r) in o.iter().flatten().enumerate() {
            let opt = |x: Option<&i64>| x.map_or("–".into(), |x| x.to_string());
            let _ = writeln!(
                s,
                "| {name} | {} | {} → {} ({}) | {:.0} | {:.0} | {} | {} | {:.0} | {} | {} | {} / {} | {} |",
                i + 1,
                r.killed,
                r.new_leader,
                r.new_term,
                r.to_first_produce_ms,
                r.to_agreed_leader_ms,
                r.acked,
                r.produce_failed,
                r.slowest_after_ms,
                r.window_lateness.len(),
                opt(r.window_lateness.last()),
                opt(percentile(&r.lateness, 99.0).as_ref()),
                opt(r.lateness.last()),
                r.duplicates,
            );
        }
    }
}

/// The targets of issue 27 this run measured: one line each, PASS or FAIL; none when the run had
/// no replicated system.
pub fn targets27(r: &Results, rates: &[u64]) -> Vec<String> {
    let mut out = Vec::new();
    let cluster = System::CLUSTER3_SYNC;
    let ran = |s: System| r.throughput.iter().any(|(x, o)| *x == s && o.is_ok());
    let ratio = |out: &mut Vec<String>, case: Case, other: System, goal: f64| {
        if let (Some(a), Some(b)) = (median_rate(r, cluster, case), median_rate(r, other, case)) {
            out.push(format!(
                "{}: {} ≥ {goal:.1}× {}, {}: {} vs {} msgs/s = {:.2}×",
                verdict(a >= goal * b),
                cluster.name(),
                other.name(),
                case_name(case),
                num(a),
                num(b),
                a / b.max(1e-9)
            ));
        }
    };
    if ran(cluster) {
        let single = sys(Engine::Delayd, true);
        for case in [Case::Single, Case::Conc16, Case::Conc64] {
            ratio(&mut out, case, single, 0.5);
            ratio(&mut out, case, System::REDIS_REPLICA_WAIT, 1.0);
        }
        for case in [Case::Batch1, Case::BatchN] {
            ratio(&mut out, case, System::REDIS_REPLICA_WAIT, 2.0);
        }
    }
    if let Some((_, Ok(v))) = r.e2e.iter().find(|(x, _)| *x == cluster) {
        for rate in rates.iter().filter(|r| **r == 1_000) {
            let runs: Vec<&E2e> = v.iter().filter(|x| x.rate == *rate).collect();
            let p99 =
                spread(runs.iter().filter_map(|x| percentile(&x.lateness, 99.0)).map(|l| l as f64).collect());
            let early: usize = runs.iter().map(|x| x.early).sum();
            if let Some((p, _, _)) = p99 {
                out.push(format!(
                    "{}: {} lateness at {rate} msgs/s: p99 {p} ms (target ≤ 10), {early} early (target 0)",
                    verdict(p <= 10.0 && early == 0),
                    cluster.name()
                ));
            }
        }
    }
    for (name, o) in &r.failover {
        let Ok(v) = o else { continue };
        let worst = v.iter().map(|x| x.to_first_produce_ms).fold(0.0, f64::max);
        let early: usize = v.iter().map(|x| x.early + x.early_client).sum();
        let lost: usize = v.iter().map(|x| x.lost).sum();
        let stall = v.iter().map(|x| x.slowest_after_ms).fold(0.0, f64::max);
        out.push(format!(
            "{}: {name} failover, kill → first 2xx produce on the new leader: max {} ms over {} kills \
             (target ≤ 2,000), {early} early (target 0), {lost} lost (target 0); the slowest produce \
             call after that first 2xx took {} ms (not part of the target, but a stall shows here)",
            verdict(worst <= 2_000.0 && early == 0 && lost == 0 && !v.is_empty()),
            num(worst),
            v.len(),
            num(stall)
        ));
    }
    out
}

/// Short case names for the target lines.
fn case_name(c: Case) -> &'static str {
    match c {
        Case::Single => "produce, 1 client one at a time",
        Case::Conc16 => "produce, 16 clients one at a time",
        Case::Conc64 => "produce, 64 clients one at a time",
        Case::Batch1 => "produce, 1 client in batches",
        Case::BatchN => "produce, N clients in batches",
        Case::PopAck1 => "pop + ack one at a time, 1 consumer",
        Case::PopAck16 => "pop + ack one at a time, 16 consumers",
        Case::PopAckBatch => "pop + ack in batches, 16 consumers",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn spread_gives_median_min_max() {
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(spread(vec![4.0, 1.0]), Some((2.5, 1.0, 4.0)));
        assert_eq!(cell(vec![1234.0, 1000.0, 2000.0]), "1,234 (1,000–2,000)");
        assert_eq!(cell(vec![7.0]), "7");
    }
}
