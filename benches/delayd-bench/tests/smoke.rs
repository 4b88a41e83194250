//! Smoke test of `delayd-bench --quick`: the tool starts the real servers, runs every workload and
//! writes its tables and chart. It checks that the tool works, never how fast anything is.

use std::path::{Path, PathBuf};
use std::process::Command;

const DELAYD: [&str; 2] = ["delayd-sync", "delayd-async"];
const REDIS: [&str; 4] =
    ["redis-lua-always", "redis-lua-everysec", "redis-plain-always", "redis-plain-everysec"];

fn installed(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

fn redis_installed() -> bool {
    installed("redis-server")
}

/// The table rows of one `## ` section.
fn section<'a>(md: &'a str, heading: &str) -> Vec<&'a str> {
    let start = md.find(heading).unwrap_or_else(|| panic!("no section {heading:?} in:\n{md}"));
    let rest = &md[start + heading.len()..];
    let end = rest.find("\n## ").unwrap_or(rest.len());
    rest[..end].lines().filter(|l| l.starts_with("| ") && !l.starts_with("| system")).collect()
}

fn cells(row: &str) -> Vec<String> {
    row.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect()
}

/// Parses a table number such as `1,234` or `12 (10–14)` (the median).
fn number(cell: &str) -> f64 {
    let first = cell.split_whitespace().next().unwrap_or("");
    first.replace(',', "").parse().unwrap_or_else(|_| panic!("not a number: {cell:?}"))
}

fn rows_for<'a>(rows: &[&'a str], system: &str) -> Vec<&'a str> {
    rows.iter().copied().filter(|r| cells(r)[0] == system).collect()
}

/// The delayd server built next to delayd-bench: `cargo test` at the workspace root builds both into
/// the same target directory, but this crate cannot ask Cargo for another package's binary.
fn delayd_bin() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_delayd-bench")).with_file_name("delayd");
    assert!(
        bin.is_file(),
        "no delayd server binary at {}: run `cargo test` at the workspace root (it builds both), or \
         `cargo build -p delayd` in the same profile before `cargo test -p delayd-bench`",
        bin.display()
    );
    bin
}

/// Runs `delayd-bench --quick` with `args` into a fresh output dir; panics unless it succeeds.
fn run_quick(args: &[&str]) -> (tempfile::TempDir, String) {
    let out = tempfile::tempdir().expect("temp dir");
    let scratch = tempfile::tempdir().expect("temp dir");
    let output = Command::new(env!("CARGO_BIN_EXE_delayd-bench"))
        .arg("--quick")
        .args(args)
        .arg("--out")
        .arg(out.path())
        .arg("--delayd-bin")
        .arg(delayd_bin())
        .arg("--tmp-dir")
        .arg(scratch.path())
        .output()
        .expect("run delayd-bench");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "delayd-bench failed ({}):\n{stderr}\n{stdout}", output.status);
    (out, stdout)
}

#[test]
fn quick_run_writes_every_table_and_a_png() {
    let (out, stdout) = run_quick(&[]);

    let results = out.path().join("results.md");
    let chart = out.path().join("bench.png");
    assert!(stdout.contains(&format!("results: {}", results.display())), "{stdout}");
    assert!(stdout.contains(&format!("chart:   {}", chart.display())), "{stdout}");
    let md = std::fs::read_to_string(&results).expect("results.md");

    let redis = redis_installed();
    let mut present: Vec<&str> = DELAYD.to_vec();
    if redis {
        present.extend(REDIS);
    } else {
        assert!(md.contains("apt-get install redis-server"), "missing redis not reported:\n{md}");
        for s in REDIS {
            assert!(!md.contains(&format!("| {s} |")), "{s} reported without redis-server:\n{md}");
        }
    }
    if installed("beanstalkd") {
        present.push("beanstalkd-fsync");
    } else {
        assert!(md.contains("apt-get install beanstalkd"), "missing beanstalkd not reported:\n{md}");
    }

    let produce = section(&md, "## Produce throughput");
    let pop_ack = section(&md, "## Pop + ack throughput");
    let cpu_per_msg = section(&md, "## Server CPU per message");
    let e2e = section(&md, "## End-to-end lateness");
    let capacity = section(&md, "## Pending capacity");
    let crash = section(&md, "## Crash");
    for s in &present {
        // Five produce cases (1, 16, 64 clients one at a time; 1 and N clients in batches) and three
        // pop + ack cases, each with a positive rate in every repeat's median.
        for (table, cases) in [(&produce, 5), (&pop_ack, 3)] {
            let p = rows_for(table, s);
            assert_eq!(p.len(), 1, "{s} throughput row:\n{md}");
            let c = cells(p[0]);
            assert_eq!(c.len(), cases + 2, "{s}: columns of {}", p[0]);
            for v in &c[1..=cases] {
                assert!(number(v) > 0.0, "{s}: rate {v:?} in {}", p[0]);
            }
        }

        // The server's CPU per message in all eight cases. /proc counts in 10 ms ticks, which a
        // quick case may not fill, so a cell may read 0; the row as a whole may not.
        let cpu = rows_for(&cpu_per_msg, s);
        assert_eq!(cpu.len(), 1, "{s} CPU row:\n{md}");
        let c = cells(cpu[0]);
        assert_eq!(c.len(), 9, "{s}: columns of {}", cpu[0]);
        let total: f64 = c[1..].iter().map(|v| number(v)).sum();
        assert!(total > 0.0, "{s}: no server CPU measured in {}", cpu[0]);

        let e = rows_for(&e2e, s);
        let rates: Vec<f64> = e.iter().map(|r| number(&cells(r)[1])).collect();
        assert_eq!(rates, vec![100.0, 500.0], "{s} end-to-end rows:\n{md}");
        for r in &e {
            let c = cells(r);
            assert!(number(&c[3]) > 0.0 && number(&c[5]) > 0.0, "{s}: nothing produced or delivered: {r}");
            // p50, p99, p99.9, max, min are all filled in.
            for v in &c[9..14] {
                number(v);
            }
        }

        let cap = rows_for(&capacity, s);
        assert_eq!(cap.len(), 1, "{s} capacity row:\n{md}");
        assert_eq!(number(&cells(cap[0])[1]), 2000.0, "{s}: pending count");
        assert!(number(&cells(cap[0])[5]) > 0.0, "{s}: no disk use measured");

        let cr = rows_for(&crash, s);
        assert_eq!(cr.len(), 1, "{s} crash row:\n{md}");
        let c = cells(cr[0]);
        assert!(number(&c[1]) > 0.0, "{s}: nothing acknowledged before the kill");
        for v in &c[2..6] {
            number(v);
        }
    }
    // Push to a local webhook, on each delayd system: a burst and two paced rates, every message
    // delivered, none early.
    let push = section(&md, "## Push delivery to a local webhook");
    for s in DELAYD {
        let rows = rows_for(&push, s);
        assert_eq!(rows.len(), 3, "{s} push rows:\n{md}");
        for r in rows {
            let c = cells(r);
            assert!(number(&c[2]) > 0.0, "{s}: nothing pushed: {r}");
            assert_eq!(c[7], "0", "{s}: pushed early: {r}");
        }
    }
    assert!(md.contains("## Targets of issue 13"), "{md}");
    // One verdict per target: 7 throughput cases in 2 pairings against the Lua queue (only with
    // redis-server), and 2 delayd modes at 2 rates.
    let verdicts = stdout.lines().filter(|l| l.starts_with("PASS: ") || l.starts_with("FAIL: ")).count();
    assert_eq!(verdicts, if redis { 7 * 2 } else { 0 } + 2 * 2, "PASS/FAIL lines:\n{stdout}");
    assert!(md.contains("CPU pinning: "), "{md}");

    let png = std::fs::read(&chart).expect("bench.png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 10_000, "suspiciously small PNG: {} bytes", png.len());
    assert!(Path::new(&chart).metadata().map(|m| m.is_file()).unwrap_or(false));
}

#[test]
fn quick_soak_writes_samples_summary_and_a_png() {
    let (out, stdout) = run_quick(&["--workloads", "soak"]);

    let chart = out.path().join("soak.png");
    assert!(stdout.contains(&format!("soak chart: {}", chart.display())), "{stdout}");
    let md = std::fs::read_to_string(out.path().join("results.md")).expect("results.md");
    let rows = section(&md, "## Soak");
    for s in ["delayd-sync", "delayd-sync-noreclaim"] {
        let r = rows_for(&rows, s);
        // --quick: 6 s sampled every second.
        assert!((5..=7).contains(&r.len()), "{s}: {} sample rows:\n{md}", r.len());
        let mut last_produced = 0.0;
        for row in &r {
            let c = cells(row);
            assert!(number(&c[2]) > 0.0, "{s}: no disk use: {row}");
            assert!(number(&c[3]) > 0.0, "{s}: no commit log: {row}");
            assert!(number(&c[3]) <= number(&c[2]), "{s}: commit log larger than the data dir: {row}");
            // Every sample read delayd's own count (a number, not "–"), and counts only grow. The
            // first sample comes 1 s in: when the disk's syncs stall (a large file just deleted)
            // no produce may be acknowledged yet, so only the last sample must have some.
            number(&c[4]);
            let produced = number(&c[6]);
            assert!(produced >= last_produced, "{s}: produced count went down: {row}");
            assert!(number(&c[7]) <= produced, "{s}: more acked than produced: {row}");
            last_produced = produced;
        }
        let last = cells(r.last().expect("a sample"));
        assert!(number(&last[6]) > 0.0, "{s}: nothing produced in the whole soak:\n{md}");
        // delayd's own live bytes: pending and acked messages within done_retention.
        assert!(number(&last[4]) > 0.0, "{s}: no live bytes at the end:\n{md}");
        // Deliveries and their lateness show up once the shortest delay has passed.
        assert!(
            r.iter().any(|row| number(&cells(row)[9]) > 0.0 && number(&cells(row)[11]) >= 0.0),
            "{s}: no lateness measured:\n{md}"
        );
        assert!(
            md.contains(&format!("{s} commit log vs delayd's own live bytes")),
            "{s}: no commit-log line:\n{md}"
        );
        assert!(
            md.contains(&format!("{s}: write amplification of reclaim")),
            "{s}: no write amplification:\n{md}"
        );
    }
    assert!(md.contains("segments of 16 MiB"), "no disk-growth line in segments:\n{md}");
    assert!(md.contains("lateness over the whole run, reclaim on vs off: delayd-sync p50"), "{md}");

    let png = std::fs::read(&chart).expect("soak.png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 10_000, "suspiciously small PNG: {} bytes", png.len());
}

#[test]
fn quick_backlog_compares_binaries_and_writes_its_table() {
    let bin = delayd_bin();
    let bins = format!("a={},b={}", bin.display(), bin.display());
    let (out, stdout) = run_quick(&[
        "--workloads",
        "backlog",
        "--backlog-bins",
        &bins,
        "--backlog-pending",
        "500",
        "--backlog-rounds",
        "1",
        "--backlog-idle-secs",
        "0.5",
        "--backlog-stream-secs",
        "0.5",
    ]);
    let path = out.path().join("backlog.md");
    assert!(stdout.contains(&format!("results: {}", path.display())), "{stdout}");
    let md = std::fs::read_to_string(&path).expect("backlog.md");
    // One row per binary in the runs table, one in the medians: the stream delivered everything.
    for label in ["a", "b"] {
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with(&format!("| 500 | {label} |"))).collect();
        assert_eq!(rows.len(), 2, "{label}:\n{md}");
        let cells: Vec<&str> = rows[0].split('|').map(str::trim).collect();
        assert_eq!(cells[6], "500", "delivered: {}", rows[0]);
        assert_eq!((cells[7], cells[8]), ("0", "0"), "missing, early: {}", rows[0]);
    }
}

#[test]
fn quick_scale_fills_each_system_and_writes_its_tables_and_chart() {
    let mut systems = vec!["delayd-sync"];
    if redis_installed() {
        systems.push("redis-lua-always");
    }
    if installed("beanstalkd") {
        systems.push("beanstalkd-fsync");
    }
    let list = systems.join(",");
    let (out, stdout) = run_quick(&[
        "--workloads",
        "scale",
        "--systems",
        &list,
        "--pending",
        "2k",
        "--scale-catchup",
        "1k",
        "--scale-measure-secs",
        "0.3",
        "--scale-stream-secs",
        "0.5",
        "--scale-redis-maxmemory",
        "256mb",
        "--scale-idle-secs",
        "0.5",
    ]);
    let path = out.path().join("scale.md");
    assert!(stdout.contains(&format!("results: {}", path.display())), "{stdout}");
    let md = std::fs::read_to_string(&path).expect("scale.md");
    for s in &systems {
        // Two tables, one row each for the one size.
        let rows: Vec<Vec<String>> =
            section(&md, &format!("## {s}\n")).iter().map(|r| cells(r)).filter(|c| c[0] == "2000").collect();
        assert_eq!(rows.len(), 2, "{s}:\n{md}");
        let (speed, cost) = (&rows[0], &rows[1]);
        for v in &speed[1..=4] {
            assert!(number(v) > 0.0, "{s}: fill, produce or pop + ack rate {v:?}:\n{md}");
        }
        assert!(speed[5].contains("(0 early, 0 missing)"), "{s}: stream {}", speed[5]);
        number(&speed[5]);
        // Held: the backlog and at least the produces the throughput cases left behind.
        assert!(number(&cost[1]) > 2000.0, "{s}: held {}", cost[1]);
        assert!(number(&cost[2]) > 0.0 && number(&cost[6]) > 0.0, "{s}: RssAnon or disk missing:\n{md}");
        assert!(cost[10].starts_with("1000 due at once"), "{s}: catch-up {}", cost[10]);
        assert!(cost[10].contains("(1000 acked)"), "{s}: catch-up {}", cost[10]);
        // SIGTERM exit, then first pop after SIGTERM and after SIGKILL, all measured.
        let restarts: Vec<&str> = cost[9].split(" / ").collect();
        assert_eq!(restarts.len(), 3, "{s}: restarts {}", cost[9]);
        for v in restarts {
            number(v);
        }
        number(&speed[7]);
        if *s == "delayd-sync" {
            number(&speed[6]);
            assert!(!cost[8].starts_with('–'), "{s}: engine steps {}", cost[8]);
        }
    }
    let png = std::fs::read(out.path().join("scale.png")).expect("scale.png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
}
