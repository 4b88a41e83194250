//! The soak workload: a steady produce/pop/ack load held for a long time, sampled every few seconds
//! for disk use, commit-log size, anonymous memory and lateness, to show whether disk use reaches a
//! steady state. Each delayd system runs twice at once on fresh data dirs, as configured (reclaim
//! on) and with `DELAYD_RECLAIM=false`, side by side so both see the same machine noise and the
//! cost of reclaim shows up as a lateness difference.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use plotters::prelude::*;

use crate::chart;
use crate::report::percentile;
use crate::servers::Programs;
use crate::systems::System;
use crate::workloads::{paced_produce, spawn_consumers, topic, Params, ProduceLog, Rng, Running, Shared};

/// Record overhead per live message in the soak issue's estimate of live bytes (body + ~100 B).
/// It is a round figure, not a measurement: by storage-format.md a Put alone adds 76 bytes plus id
/// and topic (about 120 here), and each pop/ack Transition 73 and each Hop 57 more.
pub const RECORD_OVERHEAD_BYTES: u64 = 100;
/// The soak target: disk at the end within this many segments of disk at the reference time.
pub const STEADY_SEGMENTS: f64 = 2.0;
/// The disk reference point is this far into the run (or a quarter of a shorter run).
pub const REFERENCE_SECS: f64 = 300.0;
/// A table with more samples than this shows one row per minute instead of one per sample.
const MAX_TABLE_SAMPLES: usize = 60;

/// Knobs of the soak workload.
#[derive(Debug, Clone)]
pub struct SoakParams {
    /// Produce rate, msgs/s.
    pub rate: u64,
    /// Bytes per message body.
    pub body_bytes: usize,
    /// Random delay range, ms (inclusive).
    pub delay_ms: (u64, u64),
    /// How long the producer runs.
    pub secs: f64,
    /// Sample period.
    pub sample_secs: f64,
    /// `DELAYD_DONE_RETENTION` given to every soak server.
    pub done_retention: String,
    /// Commit-log segment size in effect (from `DELAYD_SEGMENT_BYTES`, else delayd's default).
    pub segment_bytes: u64,
    /// Time allowed after the load for the last messages to be delivered and acked.
    pub grace_ms: u64,
}

/// One sample of a soak run.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Seconds since the producer started.
    pub t_s: f64,
    /// Allocated bytes of the whole data dir.
    pub disk_alloc: u64,
    /// Allocated bytes under `<data>/commitlog/`.
    pub commitlog_alloc: u64,
    /// RssAnon of the server, when readable.
    pub rss_anon: Option<u64>,
    /// The server's own accounting from `/v1/stats`, when it has one (delayd).
    pub server: Option<ServerStats>,
    /// Produces acknowledged so far.
    pub produced: u64,
    /// Messages whose ack succeeded so far.
    pub acked: u64,
    /// Lateness (ms) of first deliveries recorded since the previous sample, sorted.
    pub lateness: Vec<i64>,
}

impl Sample {
    /// Messages produced and not yet acked: pending, or popped with the ack still on its way.
    pub fn alive(&self) -> u64 {
        self.produced.saturating_sub(self.acked)
    }
}

/// What delayd itself reports about its storage (`GET /v1/stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Bytes of the records of every message still indexed: pending, or final within `done_retention`.
    pub live_bytes: u64,
    /// Bytes ever appended to the commit log, carries included.
    pub log_written_bytes: u64,
    /// Bytes of records reclaim carried forward.
    pub carried_bytes: u64,
}

impl ServerStats {
    /// Write amplification of reclaim: bytes carried per byte otherwise written.
    pub fn write_amplification(&self) -> f64 {
        self.carried_bytes as f64 / self.log_written_bytes.saturating_sub(self.carried_bytes).max(1) as f64
    }
}

/// Reads `ServerStats` from a delayd's `/v1/stats`; `None` if it does not answer as expected.
async fn server_stats(http: &reqwest::Client, port: u16) -> Option<ServerStats> {
    let v: serde_json::Value =
        http.get(format!("http://127.0.0.1:{port}/v1/stats")).send().await.ok()?.json().await.ok()?;
    Some(ServerStats {
        live_bytes: v.get("live_bytes")?.as_u64()?,
        log_written_bytes: v.get("log_written_bytes")?.as_u64()?,
        carried_bytes: v.get("reclaim")?.get("carried_bytes")?.as_u64()?,
    })
}

/// One soak run of one system with reclaim on or off.
#[derive(Debug, Clone, Default)]
pub struct SoakRun {
    /// Whether `DELAYD_RECLAIM=false` was left out.
    pub reclaim: bool,
    /// Samples in time order.
    pub samples: Vec<Sample>,
    /// Lateness of every first delivery of the run, the drain included, sorted.
    pub lateness: Vec<i64>,
    /// Produces acknowledged.
    pub produced: u64,
    /// Produces refused or lost to errors.
    pub produce_failed: u64,
    /// Rate the producer achieved.
    pub achieved_rate: f64,
    /// Produced messages still not acked when the drain ended.
    pub unacked_after_drain: u64,
    /// How long the drain after the load took.
    pub drain_secs: f64,
}

/// The label of a soak run.
pub fn label(system: System, reclaim: bool) -> String {
    if reclaim {
        system.name()
    } else {
        format!("{}-noreclaim", system.name())
    }
}

/// Starts a fresh `system` with the soak settings (and reclaim switched off unless `reclaim`), runs
/// the load, and stops the server.
pub async fn run(
    system: System,
    reclaim: bool,
    progs: &Programs,
    p: &Params,
    sp: &SoakParams,
) -> Result<SoakRun, String> {
    let mut progs = progs.clone();
    progs.delayd_env.retain(|(k, _)| k != "DELAYD_DONE_RETENTION" && (reclaim || k != "DELAYD_RECLAIM"));
    progs.delayd_env.push(("DELAYD_DONE_RETENTION".to_string(), sp.done_retention.clone()));
    if !reclaim {
        progs.delayd_env.push(("DELAYD_RECLAIM".to_string(), "false".to_string()));
    }
    let p = Params { body_bytes: sp.body_bytes, ..p.clone() };
    let running = Running::start(system, &progs, &p).await?;
    let out = load(&running, &p, sp, reclaim).await;
    let stopped = running.shutdown().await;
    out.and_then(|o| stopped.map(|_| o))
}

/// Sample times: every period up to the end of the load, and at least one at its end.
fn sample_times(secs: f64, period: f64) -> Vec<f64> {
    let n = (secs / period + 1e-9).floor() as usize;
    let v: Vec<f64> = (1..=n).map(|k| k as f64 * period).collect();
    if v.is_empty() {
        vec![secs]
    } else {
        v
    }
}

async fn load(running: &Running, p: &Params, sp: &SoakParams, reclaim: bool) -> Result<SoakRun, String> {
    let topic = topic("soak");
    let shared = Shared::default();
    let consumers = spawn_consumers(running, p, &topic, 30_000, &shared)?;
    let log = ProduceLog::default();
    let total = (sp.rate as f64 * sp.secs).round() as u64;
    // The same stream in every run, so reclaim on and off see the same delays.
    let rng = Rng::new(p.seed, 9_000);
    let t0 = Instant::now();
    let producer = tokio::spawn(paced_produce(
        running.queue(p)?,
        topic.clone(),
        0,
        sp.rate,
        total,
        sp.delay_ms,
        rng,
        log.clone(),
    ));
    // As long as any other call may take: a sample that waits out a stalled sync still counts.
    let http = reqwest::Client::builder().timeout(crate::http::CALL_TIMEOUT).build().map_err(err)?;
    let mut samples = Vec::new();
    let mut cursor = 0usize;
    for t in sample_times(sp.secs, sp.sample_secs) {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(t)).into()).await;
        let (acked, lateness) = {
            let s = shared.seen.lock().unwrap_or_else(|e| e.into_inner());
            let mut l = s.lateness[cursor.min(s.lateness.len())..].to_vec();
            cursor = s.lateness.len();
            l.sort_unstable();
            (s.acked() as u64, l)
        };
        let sample = Sample {
            t_s: t0.elapsed().as_secs_f64(),
            disk_alloc: running.server.disk_bytes().0,
            commitlog_alloc: running.server.delayd_subdir_bytes("commitlog").0,
            rss_anon: running.server.rss_anon_bytes(),
            server: server_stats(&http, running.server.port).await,
            produced: log.produced() as u64,
            acked,
            lateness,
        };
        eprintln!(
            "  {}{:>6.0} s: disk {:.1} MiB (commit log {:.1}), RssAnon {}, produced {}, alive {}, p99 {:?} ms",
            if reclaim { "" } else { "(reclaim off) " },
            sample.t_s,
            mib(sample.disk_alloc),
            mib(sample.commitlog_alloc),
            sample.rss_anon.map(|b| format!("{:.1} MiB", mib(b))).unwrap_or_else(|| "?".into()),
            sample.produced,
            sample.alive(),
            percentile(&sample.lateness, 99.0)
        );
        samples.push(sample);
    }
    if producer.await.is_err() {
        shared.stop.store(true, Ordering::Relaxed);
        return Err("the producer task panicked".to_string());
    }
    let produce_secs = t0.elapsed().as_secs_f64();
    let produced = log.produced() as u64;
    // The last messages are still due: let them be delivered and acked, but only so long.
    let drain_started = Instant::now();
    let deadline = drain_started + Duration::from_millis(sp.delay_ms.1 + sp.grace_ms);
    let mut acked = 0;
    while Instant::now() < deadline {
        acked = shared.seen.lock().unwrap_or_else(|e| e.into_inner()).acked() as u64;
        if acked >= produced {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drain_secs = drain_started.elapsed().as_secs_f64();
    shared.stop.store(true, Ordering::Relaxed);
    for c in consumers {
        let _ = c.await;
    }
    let mut lateness = std::mem::take(&mut shared.seen.lock().unwrap_or_else(|e| e.into_inner()).lateness);
    lateness.sort_unstable();
    Ok(SoakRun {
        reclaim,
        samples,
        lateness,
        produced,
        produce_failed: log.failed.load(Ordering::Relaxed),
        achieved_rate: produced as f64 / produce_secs.max(1e-9),
        unacked_after_drain: produced.saturating_sub(acked),
        drain_secs,
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / 1_048_576.0
}

/// A byte count in the largest binary unit that keeps it whole, as delayd's settings write it.
pub fn size(b: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{:.1} MiB", mib(b))
}

fn ms(v: Option<i64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".to_string())
}

/// The sample closest after the reference time, and the last sample.
fn reference_and_end(run: &SoakRun, secs: f64) -> Option<(&Sample, &Sample)> {
    let at = REFERENCE_SECS.min(secs / 4.0);
    let end = run.samples.last()?;
    // Samples land a little after their nominal time, never much before it.
    let reference = run.samples.iter().find(|s| s.t_s >= at * 0.99).unwrap_or(end);
    Some((reference, end))
}

/// Disk growth from the reference sample to the end, in segments.
pub fn growth_segments(run: &SoakRun, sp: &SoakParams) -> Option<f64> {
    let (r, e) = reference_and_end(run, sp.secs)?;
    Some((e.disk_alloc as f64 - r.disk_alloc as f64) / sp.segment_bytes.max(1) as f64)
}

/// The commit-log bound: 2 × live bytes + 2 segments, with live bytes estimated from the most
/// messages alive at any sample.
pub fn commitlog_bound(run: &SoakRun, sp: &SoakParams) -> (u64, u64) {
    let max_alive = run.samples.iter().map(Sample::alive).max().unwrap_or(0);
    let live = max_alive * (sp.body_bytes as u64 + RECORD_OVERHEAD_BYTES);
    (live, 2 * live + 2 * sp.segment_bytes)
}

/// The sample where the commit log came closest to (or furthest past) 2 × the server's own live
/// bytes + 2 segments, as (sample, bound); `None` without server stats.
pub fn worst_server_bound<'a>(run: &'a SoakRun, sp: &SoakParams) -> Option<(&'a Sample, u64)> {
    run.samples
        .iter()
        .filter_map(|s| Some((s, 2 * s.server?.live_bytes + 2 * sp.segment_bytes)))
        .max_by_key(|(s, bound)| s.commitlog_alloc as i128 - *bound as i128)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

/// The summary lines of the soak workload: steady disk, commit-log bound, lateness side by side.
/// Runs without reclaim are reported for comparison, without a verdict.
pub fn targets(runs: &[(String, Result<SoakRun, String>)], sp: &SoakParams) -> Vec<String> {
    let mut out = Vec::new();
    let seg = size(sp.segment_bytes);
    for (name, o) in runs {
        let run = match o {
            Ok(run) => run,
            Err(e) => {
                out.push(format!("not measured: soak on {name}: {}", e.lines().next().unwrap_or("")));
                continue;
            }
        };
        let tag = |ok: bool| if run.reclaim { verdict(ok) } else { "for comparison (reclaim off)" };
        if let (Some((r, e)), Some(g)) = (reference_and_end(run, sp.secs), growth_segments(run, sp)) {
            out.push(format!(
                "{}: {name} disk {:.1} MiB at {:.0} s → {:.1} MiB at {:.0} s: {:+.1} MiB = {g:+.2} segments of {seg} \
                 (target ≤ {STEADY_SEGMENTS} segments)",
                tag(g <= STEADY_SEGMENTS),
                mib(r.disk_alloc),
                r.t_s,
                mib(e.disk_alloc),
                e.t_s,
                mib(e.disk_alloc) - mib(r.disk_alloc),
            ));
        }
        let server_bound = worst_server_bound(run, sp);
        if server_bound.is_none() {
            // Without the server's own count, only pending messages can be estimated.
            let max_cl = run.samples.iter().map(|s| s.commitlog_alloc).max().unwrap_or(0);
            let (live, bound) = commitlog_bound(run, sp);
            out.push(format!(
                "{}: {name} commit log at most {:.1} MiB vs 2 × estimated pending bytes {:.2} MiB + 2 segments of \
                 {seg} = {:.1} MiB",
                tag(max_cl <= bound),
                mib(max_cl),
                mib(live),
                mib(bound),
            ));
        }
        if let Some((s, bound)) = server_bound {
            let live = s.server.map_or(0, |x| x.live_bytes);
            out.push(format!(
                "{}: {name} commit log vs delayd's own live bytes (pending and final within done_retention), \
                 closest sample at {:.0} s: {:.1} MiB vs 2 × {:.1} MiB + 2 segments = {:.1} MiB",
                tag(s.commitlog_alloc <= bound),
                s.t_s,
                mib(s.commitlog_alloc),
                mib(live),
                mib(bound),
            ));
        }
        if let Some(x) = run.samples.last().and_then(|s| s.server) {
            out.push(format!(
                "{name}: write amplification of reclaim {:.3} ({:.1} MiB carried forward, {:.1} MiB written in all)",
                x.write_amplification(),
                mib(x.carried_bytes),
                mib(x.log_written_bytes),
            ));
        }
        out.push(format!(
            "{name}: {} produced at {:.0} msgs/s (target {}), {} refused; {} not acked {:.1} s after the load stopped",
            run.produced, run.achieved_rate, sp.rate, run.produce_failed, run.unacked_after_drain, run.drain_secs
        ));
    }
    let lat: Vec<String> = runs
        .iter()
        .filter_map(|(name, o)| {
            let l = &o.as_ref().ok()?.lateness;
            Some(format!(
                "{name} p50 {} / p99 {} / max {} ms ({} deliveries)",
                ms(percentile(l, 50.0)),
                ms(percentile(l, 99.0)),
                ms(percentile(l, 100.0)),
                l.len()
            ))
        })
        .collect();
    if !lat.is_empty() {
        out.push(format!("lateness over the whole run, reclaim on vs off: {}", lat.join("; ")));
    }
    out
}

/// Samples per table row: every sample for a short run, one row a minute for a long one.
fn samples_per_row(n: usize, sample_secs: f64) -> usize {
    if n <= MAX_TABLE_SAMPLES {
        1
    } else {
        ((60.0 / sample_secs).round() as usize).max(1)
    }
}

/// The soak section of results.md.
pub fn markdown(runs: &[(String, Result<SoakRun, String>)], sp: &SoakParams) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Soak (disk over time under a steady load)\n");
    let _ = writeln!(
        s,
        "A paced producer sends {} msgs/s of {} B bodies with delays {}–{} ms for {:.0} s; consumers pop and ack \
         every message. `DELAYD_DONE_RETENTION={}`, segment size {}. Each system runs twice at once, side by side on \
         fresh data dirs: as configured, and with `DELAYD_RECLAIM=false` (`-noreclaim`). Disk is the allocated blocks \
         (st_blocks × 512) of every file in the data dir; commit log is the part under `commitlog/`; live is delayd's own \
         `live_bytes` from `/v1/stats` (records of messages pending or final within `done_retention`); `alive` is \
         produced − acked (pending, or popped with the ack on its way); lateness is pop time − due time of the \
         first deliveries seen in that row's period. A sample every {} s{}.\n",
        sp.rate,
        sp.body_bytes,
        sp.delay_ms.0,
        sp.delay_ms.1,
        sp.secs,
        sp.done_retention,
        size(sp.segment_bytes),
        sp.sample_secs,
        if runs.iter().any(|(_, o)| {
            o.as_ref().is_ok_and(|r| samples_per_row(r.samples.len(), sp.sample_secs) > 1)
        }) {
            "; the table shows one row per minute (gauges at the minute's end, lateness over the minute)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "| system | t (s) | disk MiB | commit log MiB | live MiB | RssAnon MiB | produced | acked | alive | delivered \
         | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (name, o) in runs {
        let run = match o {
            Ok(run) => run,
            Err(e) => {
                let first = e.lines().next().unwrap_or("").replace('|', "/");
                let _ = writeln!(s, "| {name} | failed: {first} ||||||||||||");
                continue;
            }
        };
        for group in run.samples.chunks(samples_per_row(run.samples.len(), sp.sample_secs)) {
            let Some(last) = group.last() else { continue };
            let mut l: Vec<i64> = group.iter().flat_map(|x| x.lateness.iter().copied()).collect();
            l.sort_unstable();
            let _ = writeln!(
                s,
                "| {name} | {:.0} | {:.1} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                last.t_s,
                mib(last.disk_alloc),
                mib(last.commitlog_alloc),
                last.server.map(|x| format!("{:.1}", mib(x.live_bytes))).unwrap_or_else(|| "–".into()),
                last.rss_anon.map(|b| format!("{:.1}", mib(b))).unwrap_or_else(|| "–".into()),
                last.produced,
                last.acked,
                last.alive(),
                l.len(),
                ms(percentile(&l, 50.0)),
                ms(percentile(&l, 99.0)),
                ms(percentile(&l, 100.0)),
            );
        }
    }
    let _ = writeln!(
        s,
        "\nTargets: disk at the end within {STEADY_SEGMENTS} segments of disk at {REFERENCE_SECS:.0} s (or at a \
         quarter of a shorter run); commit log never above 2 × live bytes + 2 segments at any sample, live bytes \
         as delayd counts them (`live_bytes`: records of messages pending or final within `done_retention`; \
         without it, the most messages alive × (body + {RECORD_OVERHEAD_BYTES} B), which leaves out final \
         messages). Chart colours: {}.\n",
        runs.iter()
            .enumerate()
            .map(|(i, (n, _))| format!("{n} {}", palette(i).1))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for line in targets(runs, sp) {
        let _ = writeln!(s, "- {line}");
    }
    s
}

/// Colour per soak run, in run order; named in results.md so an unlabeled chart can be read.
fn palette(i: usize) -> (RGBColor, &'static str) {
    const P: [(RGBColor, &str); 4] = [
        (RGBColor(0x1f, 0x3a, 0x93), "dark blue"),
        (RGBColor(0xb0, 0x1c, 0x1c), "dark red"),
        (RGBColor(0x4f, 0xa3, 0xf7), "light blue"),
        (RGBColor(0xf5, 0x8c, 0x2a), "orange"),
    ];
    P[i % P.len()]
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("soak chart: {e}")
}

/// Draws soak.png: disk (and commit log, dashed) and RssAnon over time, and lateness p99 per sample;
/// returns whether it has text labels.
pub fn draw(path: &Path, runs: &[(String, Result<SoakRun, String>)]) -> Result<bool, String> {
    let labels = chart::load_font();
    render(path, runs, labels)?;
    Ok(labels)
}

type Series = Vec<(usize, String, Vec<(f64, f64)>)>;

fn series(runs: &[(String, Result<SoakRun, String>)], f: impl Fn(&Sample) -> Option<f64>) -> Series {
    runs.iter()
        .enumerate()
        .filter_map(|(i, (n, o))| {
            let run = o.as_ref().ok()?;
            Some((i, n.clone(), run.samples.iter().filter_map(|s| Some((s.t_s, f(s)?))).collect()))
        })
        .collect()
}

fn render(path: &Path, runs: &[(String, Result<SoakRun, String>)], labels: bool) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1200, 1200)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((3, 1));
    let disk = series(runs, |s| Some(mib(s.disk_alloc)));
    let commitlog = series(runs, |s| Some(mib(s.commitlog_alloc)));
    panel(
        &areas[0],
        "Data dir allocated MiB (solid) and commit log MiB (dashed)",
        &disk,
        &commitlog,
        labels,
    )?;
    let rss = series(runs, |s| s.rss_anon.map(mib));
    panel(&areas[1], "Server RssAnon MiB", &rss, &Vec::new(), labels)?;
    let p99 = series(runs, |s| percentile(&s.lateness, 99.0).map(|v| v as f64));
    panel(&areas[2], "Lateness p99 per sample period, ms", &p99, &Vec::new(), labels)?;
    root.present().map_err(err)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    solid: &Series,
    dashed: &Series,
    labels: bool,
) -> Result<(), String> {
    let pts = || solid.iter().chain(dashed).flat_map(|(_, _, v)| v.iter());
    let xmax = pts().map(|p| p.0).fold(1.0f64, f64::max);
    let ymax = pts().map(|p| p.1).fold(1.0f64, f64::max);
    let ymin = pts().map(|p| p.1).fold(0.0f64, f64::min);
    let mut b = ChartBuilder::on(area);
    b.margin(12);
    if labels {
        b.caption(title, ("sans-serif", 20)).x_label_area_size(35).y_label_area_size(60);
    }
    let mut c = b.build_cartesian_2d(0f64..xmax * 1.02, ymin..ymax * 1.1).map_err(err)?;
    let mut mesh = c.configure_mesh();
    if labels {
        mesh.x_desc("seconds");
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(err)?;
    for (i, name, v) in solid {
        let col = palette(*i).0;
        // The reclaim-off run is drawn thinner over its pair, so identical curves stay visible.
        let width = if i % 2 == 0 { 5 } else { 2 };
        let s = c.draw_series(LineSeries::new(v.clone(), col.stroke_width(width))).map_err(err)?;
        if labels {
            s.label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(width)));
        }
    }
    for (i, _, v) in dashed {
        let col = palette(*i).0;
        c.draw_series(DashedLineSeries::new(v.clone(), 8, 6, col.stroke_width(2))).map_err(err)?;
    }
    if labels && !solid.is_empty() {
        chart::legend(&mut c, SeriesLabelPosition::UpperLeft)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SoakParams {
        SoakParams {
            rate: 100,
            body_bytes: 2048,
            delay_ms: (100, 300),
            secs: 1800.0,
            sample_secs: 10.0,
            done_retention: "60s".into(),
            segment_bytes: 4 << 20,
            grace_ms: 1000,
        }
    }

    fn run_with(disk: impl Fn(f64) -> u64) -> SoakRun {
        let samples = sample_times(1800.0, 10.0)
            .into_iter()
            .map(|t| Sample {
                t_s: t,
                disk_alloc: disk(t),
                commitlog_alloc: disk(t) / 2,
                rss_anon: Some(30 << 20),
                server: Some(ServerStats {
                    live_bytes: 1 << 20,
                    log_written_bytes: (t as u64) << 20,
                    carried_bytes: (t as u64) << 16,
                }),
                produced: (t * 100.0) as u64,
                acked: (t * 100.0) as u64 - 150,
                lateness: vec![1, 2, 3],
            })
            .collect();
        SoakRun { reclaim: true, samples, ..SoakRun::default() }
    }

    #[test]
    fn sample_times_cover_the_run_and_never_come_up_empty() {
        assert_eq!(sample_times(6.0, 1.0), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(sample_times(0.5, 1.0), vec![0.5]);
        assert_eq!(sample_times(1800.0, 10.0).len(), 180);
    }

    #[test]
    fn growth_is_measured_from_five_minutes_in_segments() {
        let sp = params();
        let flat = run_with(|t| if t < 300.0 { (t as u64) << 20 } else { 300 << 20 });
        assert_eq!(growth_segments(&flat, &sp), Some(0.0));
        let growing = run_with(|t| (t as u64) << 20);
        assert_eq!(growth_segments(&growing, &sp), Some(1500.0 / 4.0));
        let (live, bound) = commitlog_bound(&flat, &sp);
        assert_eq!(live, 150 * 2148);
        assert_eq!(bound, 2 * live + (8 << 20));
    }

    #[test]
    fn long_runs_get_a_row_per_minute_and_the_chart_renders_without_fonts() {
        let sp = params();
        let runs = vec![
            // 4 KiB/s: 1.46 segments of 4 MiB from 300 s to 1800 s, within the target.
            ("delayd-sync".to_string(), Ok(run_with(|t| (t as u64) << 12))),
            ("delayd-sync-noreclaim".to_string(), Err("boom".to_string())),
        ];
        let md = markdown(&runs, &sp);
        assert_eq!(md.lines().filter(|l| l.starts_with("| delayd-sync |")).count(), 30, "{md}");
        assert!(md.contains("| delayd-sync-noreclaim | failed: boom"), "{md}");
        assert!(md.contains("PASS: delayd-sync disk"), "{md}");
        // The log peaks at 3.5 MiB (1800 s × 4 KiB / 2), within 2 × 1 MiB + 2 × 4 MiB.
        assert!(md.contains("PASS: delayd-sync commit log vs delayd's own live bytes"), "{md}");
        assert!(md.contains("write amplification of reclaim 0.067"), "{md}");
        let dir = std::env::temp_dir().join(format!("delayd-bench-soak-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("soak.png");
        render(&path, &runs, false).expect("render");
        assert!(std::fs::read(&path).expect("png").starts_with(b"\x89PNG"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
