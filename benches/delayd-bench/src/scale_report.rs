//! The scale workload's report: `scale.md` (two tables per system, a row per size) and `scale.png`
//! (cost per operation against the backlog, one line per system).

use std::path::Path;

use plotters::prelude::*;

use crate::chart::{color, legend, load_font};
use crate::report::percentile;
use crate::scale::{Point, ScaleParams, SystemRun};
use crate::workloads::{Params, Throughput};

fn rate(t: &Result<Throughput, String>) -> String {
    t.as_ref().map_or_else(|e| format!("– ({})", short(e)), |t| format!("{:.0}", t.rate()))
}

fn short(e: &str) -> String {
    let line = e.lines().next().unwrap_or("");
    line.chars().take(60).collect()
}

fn per(bytes: Option<u64>, pending: usize) -> String {
    bytes.map_or("–".to_string(), |b| format!("{:.1}", b as f64 / pending.max(1) as f64))
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("–".to_string(), |b| format!("{:.0}", b as f64 / 1048576.0))
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |x| format!("{x:.0}"))
}

fn lateness(pt: &Point) -> String {
    match &pt.stream {
        Ok(e) => {
            let l = &e.lateness;
            let q = |x: f64| percentile(l, x).map_or("–".to_string(), |v| v.to_string());
            format!("{} / {} / {} ({} early, {} missing)", q(50.0), q(99.0), q(100.0), e.early, e.missing)
        }
        Err(e) => format!("– ({})", short(e)),
    }
}

fn lookups(pt: &Point) -> String {
    match &pt.lookup_us {
        Ok(v) => {
            format!("{} / {}", percentile(v, 50.0).map_or(0, |x| x), percentile(v, 99.0).map_or(0, |x| x))
        }
        Err(e) => format!("– ({})", short(e)),
    }
}

fn steps(pt: &Point) -> String {
    match &pt.steps {
        Ok(s) => format!(
            "{} / {} / {} ; {} / {} ; {} / {} ; {}",
            opt_ms(s.max_s.map(|x| x * 1000.0)),
            opt_ms(s.cpu_max_s.map(|x| x * 1000.0)),
            s.cpu_over_10ms.map_or("–".to_string(), |x| x.to_string()),
            opt_ms(s.resize_max_s.map(|x| x * 1000.0)),
            s.resize_over_10ms.map_or("–".to_string(), |x| x.to_string()),
            s.index_entries.map_or("–".to_string(), |x| x.to_string()),
            s.index_slots.map_or("–".to_string(), |x| x.to_string()),
            s.hops.map_or("–".to_string(), |x| x.to_string()),
        ),
        Err(e) => format!("– ({})", short(e)),
    }
}

fn restarts(pt: &Point) -> String {
    let one = |r: &Result<crate::scale::Restart, String>| match r {
        Ok(r) => format!("{:.0}", r.first_pop_ms),
        Err(e) => format!("– ({})", short(e)),
    };
    let exit = pt.term.as_ref().ok().and_then(|r| r.exit_ms);
    format!("{} / {} / {}", opt_ms(exit), one(&pt.term), one(&pt.kill))
}

fn catchup(pt: &Point) -> String {
    match &pt.catchup {
        Ok(c) => {
            let r = |s: Option<f64>| {
                s.map_or("not within the limit".to_string(), |s| {
                    format!("{:.0}/s", c.produced as f64 / s.max(1e-3))
                })
            };
            format!(
                "{} due at once ({} sent late): ready {}, acked {} ({} acked)",
                c.produced,
                c.late_produced,
                r(c.ready_secs),
                r(c.acked_secs),
                c.acked
            )
        }
        Err(e) => format!("– ({})", short(e)),
    }
}

/// The whole `scale.md`.
pub fn markdown(header: &[String], runs: &[SystemRun], sp: &ScaleParams, p: &Params) -> String {
    let mut s = String::from("# Scale: the cost of every operation as the backlog grows (issue 29)\n\n");
    for h in header {
        s.push_str(&format!("- {h}\n"));
    }
    s.push_str(&method(sp, p));
    for r in runs {
        s.push_str(&format!("\n## {}\n\n", r.system.name()));
        if let Some(e) = &r.error {
            s.push_str(&format!("Run ended early: {}\n\n", e.lines().next().unwrap_or("")));
        }
        s.push_str(
            "| pending | fill msgs/s | produce 1×1 msgs/s | produce batches msgs/s | pop + ack msgs/s | \
             stream lateness p50 / p99 / max ms | GET old id p50 / p99 µs | idle CPU % of a core |\n\
             |---|---|---|---|---|---|---|---|\n",
        );
        for pt in &r.points {
            s.push_str(&format!(
                "| {}{} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
                pt.pending,
                pt.stopped.as_ref().map_or(String::new(), |x| format!(" ({x})")),
                pt.fill_rate,
                rate(&pt.single),
                rate(&pt.batch),
                rate(&pt.pop_ack),
                lateness(pt),
                lookups(pt),
                pt.idle_cpu_pct.as_ref().map_or_else(|e| format!("– ({})", short(e)), |c| format!("{c:.2}"))
            ));
        }
        s.push_str(
            "\n| pending | held | RssAnon MiB | RssAnon B/held (above the fresh server's) | RSS MiB | RSS B/held | disk MiB | disk B/held | \
             longest step wall / CPU ms / CPU steps > 10 ms ; longest resize part of a step ms / such parts > 10 ms ; \
             index entries / slots ; hops | SIGTERM exit / first pop \
             ms, SIGKILL first pop ms | catch-up |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for pt in &r.points {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                pt.pending,
                pt.held,
                mib(pt.rss_anon),
                per(pt.rss_anon.map(|r| r.saturating_sub(pt.rss_anon_base.unwrap_or(0))), pt.held),
                mib(pt.rss),
                per(pt.rss, pt.held),
                mib(Some(pt.disk_alloc)),
                per(Some(pt.disk_alloc), pt.held),
                steps(pt),
                restarts(pt),
                catchup(pt)
            ));
        }
    }
    s
}

fn method(sp: &ScaleParams, p: &Params) -> String {
    format!(
        "- Sizes {:?}; one server per system, filled cumulatively to each size in turn ({} clients, batches \
         of up to 1,000, {} B bodies, delays uniform in {}-{} days). Redis: maxmemory {} with noeviction and \
         no automatic AOF rewrite (its fork could take the machine past its memory), a write refused for \
         memory ends its fill (\"refused at N\"). beanstalkd (binlog, `-f 0`): its fill \
         ends once its RSS passes {:.1} GiB (\"RSS cap at N\"); its delays are whole seconds, rounded up, and its \
         lateness is measured from the rounded-up due time.\n\
         - At each size, after the fill: 5 s to settle (and, after an earlier size, until its catch-up's \
         reservations have all come due, 60 s after its last pop: each acked one leaves a timer that \
         fires and is skipped), then server CPU over {:.0} s of idle (utime + stime from /proc/PID/stat); produce one at a time (1 client) and in batches ({} clients × {}), each {} s after \
         0.5 s of warm-up; pop ≤ {} + ack each (16 consumers) of {} messages made ready on their own topic \
         first (the warm-up's a tenth of them), until all are acked or the {} s are up. Those produces stay pending (due in an hour), on top of the backlog. Stream: 1,000 msgs/s \
         for {} s with delays 1-10 s, popped and acked by {} consumers; lateness = pop return − due time. \
         Then 1,000 `GET /v1/messages/{{id}}` of random ids among the first 100,000 produced (delayd), \
         `/metrics` (delayd: longest engine step since the server's last start, i.e. the previous size's \
         SIGKILL restart; the id index; level hops since then), RssAnon and VmRSS \
         from /proc/PID/status, allocated bytes (st_blocks × 512) of the data directory; then the catch-up \
         ({} messages sharing one due time, 16 consumers popping ≤ 1,000 and acking each pop's messages \
         concurrently; rates are messages / seconds from the due time until all were ready (ready + \
         popped counted every 50 ms) and all acked); then a SIGTERM and a SIGKILL restart on the same \
         data, each timed from spawn until a pop returns a message made ready (on its own topic) before \
         the fill.\n\
         - \"held\" is the backlog plus what the measurements left on the server (the throughput \
         cases' produces, due in an hour, and the preloaded messages they did not pop, warm-ups included; \
         a catch-up's unacked messages), counted by the bench; bytes per message divide by it. Page cache is shared and not per process: the \
         data directory's allocated bytes stand for it.\n",
        sp.sizes,
        p.clients,
        sp.body_bytes,
        sp.delay_days.0,
        sp.delay_days.1,
        sp.redis_maxmemory,
        sp.rss_cap as f64 / (1u64 << 30) as f64,
        sp.idle.as_secs_f64(),
        p.clients,
        p.batch_size,
        sp.measure.as_secs_f64(),
        p.pop_batch,
        sp.pop_preload,
        sp.measure.as_secs_f64(),
        sp.stream_secs,
        p.consumers,
        sp.catchup,
    )
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("scale chart: {e}")
}

/// One panel's data: title and, per system, (pending, value) points.
type Panel = (&'static str, fn(&Point) -> Option<f64>);

const PANELS: [Panel; 6] = [
    ("produce one at a time, µs per message", |pt| us_per(&pt.single)),
    ("produce in batches, µs per message", |pt| us_per(&pt.batch)),
    ("pop + ack, µs per message", |pt| us_per(&pt.pop_ack)),
    ("stream lateness p99, ms", |pt| {
        pt.stream.as_ref().ok().and_then(|e| percentile(&e.lateness, 99.0)).map(|v| v as f64)
    }),
    ("RssAnon above a fresh server's, bytes per message held", |pt| {
        let grown = pt.rss_anon?.saturating_sub(pt.rss_anon_base.unwrap_or(0));
        Some(grown as f64 / pt.held.max(1) as f64)
    }),
    ("restart to first pop after SIGKILL, s", |pt| pt.kill.as_ref().ok().map(|r| r.first_pop_ms / 1000.0)),
];

fn us_per(t: &Result<Throughput, String>) -> Option<f64> {
    t.as_ref().ok().map(|t| 1e6 / t.rate().max(1e-9))
}

/// Draws `scale.png`: six panels of cost against the backlog (log scale), a line per system.
pub fn draw(path: &Path, runs: &[SystemRun]) -> Result<(), String> {
    let labels = load_font();
    let root = BitMapBackend::new(path, (1800, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let areas = root.split_evenly((2, 3));
    for (area, (title, f)) in areas.iter().zip(PANELS) {
        panel(area, runs, title, f, labels)?;
    }
    root.present().map_err(err)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    runs: &[SystemRun],
    title: &str,
    f: fn(&Point) -> Option<f64>,
    labels: bool,
) -> Result<(), String> {
    let series: Vec<_> = runs
        .iter()
        .map(|r| {
            let pts: Vec<(f64, f64)> =
                r.points.iter().filter_map(|pt| Some(((pt.pending.max(1) as f64).log10(), f(pt)?))).collect();
            (r.system, pts)
        })
        .collect();
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (x0, x1, y1) =
        all.fold((f64::MAX, f64::MIN, 0f64), |(a, b, c), (x, y)| (a.min(*x), b.max(*x), c.max(*y)));
    let (x0, x1) = if x0 > x1 { (3.0, 8.0) } else { (x0 - 0.1, x1 + 0.1) };
    let mut b = ChartBuilder::on(area);
    b.margin(12);
    if labels {
        b.caption(title, ("sans-serif", 20)).x_label_area_size(36).y_label_area_size(64);
    }
    let mut chart = b.build_cartesian_2d(x0..x1, 0f64..(y1 * 1.15).max(1e-6)).map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_desc("pending messages (log)").x_labels(6).x_label_formatter(&|x| count_label(10f64.powf(*x)));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(err)?;
    for (sys, pts) in series {
        let (c, _) = color(sys);
        let line = chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(3))).map_err(err)?;
        if labels {
            line.label(sys.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        }
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled()))).map_err(err)?;
    }
    if labels {
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    Ok(())
}

/// `1.5M`, `20k`, `300`.
pub fn count_label(n: f64) -> String {
    let trim = |v: f64| {
        let s = format!("{v:.1}");
        s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
    };
    if n >= 1e6 {
        format!("{}M", trim(n / 1e6))
    } else if n >= 1e3 {
        format!("{}k", trim(n / 1e3))
    } else {
        format!("{n:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_labelled_short() {
        assert_eq!(count_label(1_000_000.0), "1M");
        assert_eq!(count_label(1_500_000.0), "1.5M");
        assert_eq!(count_label(20_000.0), "20k");
        assert_eq!(count_label(300.0), "300");
    }
}
