//! The PNG chart: lateness distributions per rate, produce throughput, and memory per pending message.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::report::{percentile, spread, Results};
use crate::systems::{Engine, System};
use crate::workloads::{Case, Throughput};

/// Percentiles drawn on the lateness curves; the x axis is evenly spaced in this list so the tail
/// gets as much room as the body.
const QS: [f64; 14] = [0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.99, 100.0];

/// Fixed colour per system, named in the results file so an unlabeled chart can still be read.
pub fn color(s: System) -> (RGBColor, &'static str) {
    if s.replicated {
        return match s.engine {
            Engine::Delayd => (RGBColor(0x6a, 0x1b, 0x9a), "purple"),
            Engine::RedisLua => (RGBColor(0x79, 0x55, 0x48), "brown"),
            Engine::RedisPlain => (RGBColor(0x75, 0x75, 0x75), "grey"),
            Engine::Beanstalkd => (RGBColor(0x00, 0x83, 0x8f), "teal"),
        };
    }
    match (s.engine, s.strict) {
        (Engine::Delayd, true) => (RGBColor(0x1f, 0x3a, 0x93), "dark blue"),
        (Engine::Delayd, false) => (RGBColor(0x4f, 0xa3, 0xf7), "light blue"),
        (Engine::RedisLua, true) => (RGBColor(0xb0, 0x1c, 0x1c), "dark red"),
        (Engine::RedisLua, false) => (RGBColor(0xf5, 0x8c, 0x2a), "orange"),
        (Engine::RedisPlain, true) => (RGBColor(0x1b, 0x6e, 0x20), "dark green"),
        (Engine::RedisPlain, false) => (RGBColor(0x8b, 0xc3, 0x4a), "light green"),
        (Engine::Beanstalkd, _) => (RGBColor(0x00, 0x83, 0x8f), "teal"),
    }
}

/// Registers a TTF font for labels; without one the chart is drawn without any text rather than
/// failing. `DELAYD_BENCH_FONT` names a font file, or `none` to skip fonts.
pub fn load_font() -> bool {
    let candidates: Vec<PathBuf> = match std::env::var("DELAYD_BENCH_FONT") {
        Ok(v) if v == "none" => Vec::new(),
        Ok(v) => vec![PathBuf::from(v)],
        Err(_) => [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
        ]
        .iter()
        .map(PathBuf::from)
        .collect(),
    };
    for c in candidates {
        if let Ok(bytes) = std::fs::read(&c) {
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

fn symlog(x: f64) -> f64 {
    x.signum() * (1.0 + x.abs()).log10()
}

/// Labels only whole decades of the symlog axis, as 0, ±10, ±100, ... (the tick at "100" sits at
/// 99 ms; on a log axis that 1 % is invisible).
fn decade_label(y: &f64) -> String {
    let k = y.round();
    if (y - k).abs() > 0.01 {
        return String::new();
    }
    if k == 0.0 {
        "0".to_string()
    } else {
        format!("{:.0}", k.signum() * 10f64.powf(k.abs()))
    }
}

fn compact(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1000.0 {
        format!("{:.1}k", v / 1000.0)
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("chart: {e}")
}

/// Draws the series' legend at `at`, on a translucent white box (every chart of the bench).
pub fn legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    at: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(at)
        .draw()
        .map_err(err)
}

/// Draws the chart to `path`; returns whether it has text labels (false when no font was found).
pub fn draw(path: &Path, r: &Results, rates: &[u64], systems: &[System]) -> Result<bool, String> {
    let labels = load_font();
    render(path, r, rates, systems, labels)?;
    Ok(labels)
}

fn render(path: &Path, r: &Results, rates: &[u64], systems: &[System], labels: bool) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1600, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (top, bottom) = root.split_vertically(560);
    let lat_areas = top.split_evenly((1, rates.len().max(1)));
    for (area, rate) in lat_areas.iter().zip(rates) {
        lateness_panel(area, r, *rate, labels)?;
    }
    let bottom_areas = bottom.split_evenly((1, 2));
    throughput_panel(&bottom_areas[0], r, systems, labels)?;
    memory_panel(&bottom_areas[1], r, systems, labels)?;
    root.present().map_err(err)
}

fn lateness_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    r: &Results,
    rate: u64,
    labels: bool,
) -> Result<(), String> {
    let mut series = Vec::new();
    let (mut lo, mut hi) = (symlog(-1.0), symlog(10.0));
    for (sys, o) in &r.e2e {
        let Ok(v) = o else { continue };
        // Repeats are pooled: the curve shows every first delivery at this rate.
        let mut all: Vec<i64> =
            v.iter().filter(|x| x.rate == rate).flat_map(|x| x.lateness.clone()).collect();
        if all.is_empty() {
            continue;
        }
        all.sort_unstable();
        let pts: Vec<(f64, f64)> = QS
            .iter()
            .enumerate()
            .filter_map(|(i, q)| percentile(&all, *q).map(|l| (i as f64, symlog(l as f64))))
            .collect();
        for (_, y) in &pts {
            lo = lo.min(*y);
            hi = hi.max(*y);
        }
        series.push((*sys, pts));
    }
    let mut b = ChartBuilder::on(area);
    b.margin(12);
    if labels {
        b.caption(format!("Lateness at {rate} msgs/s (ms, symlog; <0 = early)"), ("sans-serif", 22))
            .x_label_area_size(40)
            .y_label_area_size(60);
    }
    let mut chart = b.build_cartesian_2d(0f64..(QS.len() - 1) as f64, (lo - 0.1)..(hi + 0.1)).map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if labels {
        mesh.x_labels(QS.len())
            .x_label_formatter(&|x| {
                let i = x.round() as usize;
                if (x - x.round()).abs() < 0.01 && i < QS.len() {
                    format!("p{}", QS[i])
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&decade_label)
            .y_labels(60)
            .light_line_style(WHITE)
            .x_desc("percentile")
            .y_desc("lateness ms");
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(err)?;
    // A zero line makes "early" visible at a glance.
    chart
        .draw_series(LineSeries::new(vec![(0.0, 0.0), ((QS.len() - 1) as f64, 0.0)], BLACK.mix(0.4)))
        .map_err(err)?;
    for (sys, pts) in series {
        let (c, _) = color(sys);
        let s = chart.draw_series(LineSeries::new(pts, c.stroke_width(3))).map_err(err)?;
        if labels {
            s.label(sys.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        }
    }
    if labels {
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    Ok(())
}

fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    legend_at: SeriesLabelPosition,
    groups: &[String],
    values: &[(System, Vec<Option<f64>>)],
    labels: bool,
) -> Result<(), String> {
    let nsys = values.len().max(1) as i32;
    let width = groups.len() as i32 * (nsys + 1);
    let max = values.iter().flat_map(|(_, v)| v.iter().flatten()).fold(10.0f64, |a, b| a.max(*b));
    let min = values.iter().flat_map(|(_, v)| v.iter().flatten()).fold(max, |a, b| a.min(*b)).max(0.1);
    let mut b = ChartBuilder::on(area);
    b.margin(12);
    if labels {
        b.caption(title, ("sans-serif", 22)).x_label_area_size(40).y_label_area_size(70);
    }
    let mut chart = b.build_cartesian_2d(0i32..width, ((min / 2.0)..(max * 8.0)).log_scale()).map_err(err)?;
    let group_label = |x: &i32| {
        if *x % (nsys + 1) == nsys / 2 {
            groups.get((*x / (nsys + 1)) as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh();
    if labels {
        mesh.x_labels(width as usize + 1).x_label_formatter(&group_label).y_label_formatter(&|y| {
            if *y >= 1000.0 {
                format!("{:.0}k", y / 1000.0)
            } else {
                format!("{y:.1}")
            }
        });
        mesh.draw().map_err(err)?;
    } else {
        mesh.draw().map_err(err)?;
    }
    for (k, (sys, vals)) in values.iter().enumerate() {
        let (c, _) = color(*sys);
        let rects: Vec<Rectangle<(i32, f64)>> = vals
            .iter()
            .enumerate()
            .filter_map(|(g, v)| {
                let x = g as i32 * (nsys + 1) + k as i32;
                v.map(|v| Rectangle::new([(x, min / 2.0), (x + 1, v)], c.filled()))
            })
            .collect();
        let s = chart.draw_series(rects).map_err(err)?;
        if labels {
            s.label(sys.name())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
            // The value over each bar: a log axis alone is hard to read off.
            let texts: Vec<Text<(i32, f64), String>> = vals
                .iter()
                .enumerate()
                .filter_map(|(g, v)| {
                    let x = g as i32 * (nsys + 1) + k as i32;
                    v.map(|v| Text::new(compact(v), (x, v * 1.15), ("sans-serif", 13)))
                })
                .collect();
            chart.draw_series(texts).map_err(err)?;
        }
    }
    if labels {
        legend(&mut chart, legend_at)?;
    }
    Ok(())
}

fn throughput_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    r: &Results,
    systems: &[System],
    labels: bool,
) -> Result<(), String> {
    let modes = Case::ALL;
    let groups: Vec<String> = [
        "1 client",
        "16 clients",
        "64 clients",
        "1 client, batched",
        "N clients, batched",
        "pop+ack, 1",
        "pop+ack, 16",
        "pop+ack, batched",
    ]
    .map(String::from)
    .to_vec();
    let values: Vec<(System, Vec<Option<f64>>)> = systems
        .iter()
        .map(|s| {
            let vals = modes
                .iter()
                .map(|m| {
                    let (_, o) = r.throughput.iter().find(|(x, _)| x == s)?;
                    let v = o.as_ref().ok()?;
                    spread(v.iter().filter(|t| t.case == *m).map(Throughput::rate).collect()).map(|x| x.0)
                })
                .collect();
            (*s, vals)
        })
        .collect();
    bars(
        area,
        "Throughput (produced or acked msgs/s, log)",
        SeriesLabelPosition::UpperLeft,
        &groups,
        &values,
        labels,
    )
}

fn memory_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    r: &Results,
    systems: &[System],
    labels: bool,
) -> Result<(), String> {
    let groups = vec!["RssAnon bytes per pending msg".to_string(), "disk bytes per pending msg".to_string()];
    let values: Vec<(System, Vec<Option<f64>>)> = systems
        .iter()
        .map(|s| {
            let get = |f: &dyn Fn(&crate::workloads::Capacity) -> f64| {
                let (_, o) = r.capacity.iter().find(|(x, _)| x == s)?;
                spread(o.as_ref().ok()?.iter().map(f).collect()).map(|x| x.0)
            };
            let rss = get(&|c| c.rss_after.saturating_sub(c.rss_before) as f64 / c.pending.max(1) as f64);
            let disk = get(&|c| c.disk_alloc as f64 / c.pending.max(1) as f64);
            (*s, vec![rss, disk])
        })
        .collect();
    bars(
        area,
        "Pending capacity (bytes per message, log)",
        SeriesLabelPosition::UpperMiddle,
        &groups,
        &values,
        labels,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::{Capacity, E2e};

    fn sample() -> (Results, Vec<System>) {
        let systems = System::all();
        let mut r = Results::default();
        for (i, s) in systems.iter().enumerate() {
            let k = i as f64 + 1.0;
            r.throughput.push((
                *s,
                Ok(Case::ALL
                    .iter()
                    .map(|m| Throughput {
                        case: *m,
                        ok: 1000 * (i + 1),
                        failed: 0,
                        secs: 1.0,
                        error: None,
                        server_cpu_secs: None,
                    })
                    .collect()),
            ));
            let lateness: Vec<i64> = (-5..200).map(|x| x * (i as i64 + 1)).collect();
            r.e2e.push((*s, Ok(vec![E2e { rate: 100, lateness, ..E2e::default() }])));
            r.capacity.push((
                *s,
                Ok(vec![Capacity {
                    pending: 1000,
                    rss_before: 0,
                    rss_after: (k * 50_000.0) as u64,
                    disk_alloc: 400_000,
                    disk_apparent: 300_000,
                    fill_rate: 1.0,
                }]),
            ));
        }
        (r, systems)
    }

    #[test]
    fn chart_renders_without_any_font() {
        let dir = std::env::temp_dir().join(format!("delayd-bench-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (r, systems) = sample();
        let path = dir.join("nofont.png");
        render(&path, &r, &[100, 500], &systems, false).expect("render without font");
        let png = std::fs::read(&path).expect("png written");
        assert!(png.starts_with(b"\x89PNG"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn decade_labels_only_on_whole_decades() {
        assert_eq!(decade_label(&0.0), "0");
        assert_eq!(decade_label(&2.0), "100");
        assert_eq!(decade_label(&-3.0), "-1000");
        assert_eq!(decade_label(&1.5), "");
        assert!((symlog(99.0) - 2.0).abs() < 1e-9);
    }
}
