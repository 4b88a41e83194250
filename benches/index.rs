//! Id index at scale: inserts 10,000,000 ids (growing the table from the default 1,048,576 slots
//! through incremental migrations), then removes them all (shrinking it back), timing every call.
//!
//! Run: `cargo bench --bench index` (`IDS=1000000` for a shorter run, `TMPDIR` for the disk).
//! Reports the longest single call, p50/p99/p99.9 per operation, the files over time and the
//! anonymous memory per live id (RssAnon from /proc/self/status). A plain binary, not criterion:
//! the point is the tail of one long run, not a mean over repeated short ones.

use std::path::Path;
use std::time::{Duration, Instant};

use delayd::storage::durability::Durability;
use delayd::storage::format::{Home, State};
use delayd::storage::index::{IdIndex, Slot};
use delayd::storage::{IdHash, LogOffset};

/// Log-linear histogram of nanoseconds: 16 sub-buckets per power of two, no allocation per sample.
struct Histogram {
    counts: Vec<u64>,
    n: u64,
    max: Duration,
    max_at: u64,
}

impl Histogram {
    fn new() -> Histogram {
        Histogram { counts: vec![0; 64 * 16], n: 0, max: Duration::ZERO, max_at: 0 }
    }

    fn bucket(ns: u64) -> usize {
        if ns < 16 {
            return ns as usize;
        }
        let exp = 63 - ns.leading_zeros() as usize;
        let sub = ((ns >> (exp - 4)) & 15) as usize;
        (exp - 3) * 16 + sub
    }

    fn lower(bucket: usize) -> u64 {
        if bucket < 16 {
            return bucket as u64;
        }
        let (exp, sub) = (bucket / 16 + 3, bucket % 16);
        (1u64 << exp) | ((sub as u64) << (exp - 4))
    }

    fn record(&mut self, d: Duration, at: u64) {
        self.counts[Self::bucket(d.as_nanos() as u64)] += 1;
        self.n += 1;
        if d > self.max {
            self.max = d;
            self.max_at = at;
        }
    }

    fn quantile(&self, q: f64) -> Duration {
        let want = (self.n as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (b, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Duration::from_nanos(Self::lower(b + 1));
            }
        }
        self.max
    }

    fn report(&self, what: &str) {
        println!(
            "{what:<16} n={:>9}  p50 <{:>8.2?}  p99 <{:>8.2?}  p99.9 <{:>8.2?}  max {:>8.2?} (op #{})",
            self.n,
            self.quantile(0.50),
            self.quantile(0.99),
            self.quantile(0.999),
            self.max,
            self.max_at
        );
    }
}

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// "name size(MiB) allocated(MiB)" for every file of the index directory.
fn files(dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let m = e.metadata().ok()?;
                    Some(format!(
                        "{} {}MiB/{}MiB",
                        e.file_name().to_string_lossy(),
                        m.len() >> 20,
                        (m.blocks() * 512) >> 20
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.join(", ")
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn slot(i: u64) -> Slot {
    Slot {
        hash: IdHash::new(splitmix(i)),
        msg_offset: LogOffset::new(i * 128),
        last_offset: LogOffset::new(i * 128),
        seq: 0,
        attempt: 0,
        state: State::Delayed,
        home: Home::Main,
        len: 128,
    }
}

fn progress(phase: &str, t0: Instant, idx: &IdIndex, dir: &Path) {
    println!(
        "{phase:<7} t={:>6.1}s live={:>9} slots={:>9} migrating={:<5} RssAnon={:>7}KiB RssFile={:>8}KiB  [{}]",
        t0.elapsed().as_secs_f64(),
        idx.len(),
        idx.capacity(),
        idx.is_migrating(),
        status_kib("RssAnon:"),
        status_kib("RssFile:"),
        files(dir)
    );
}

fn main() -> delayd::error::Result<()> {
    let n: u64 = std::env::var("IDS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000_000);
    let initial = 1u64 << 20;
    let tmp = tempfile::tempdir().map_err(|e| delayd::error::Error::io("tempdir", e))?;
    let dir = tmp.path().join("index");
    std::fs::create_dir_all(&dir).map_err(|e| delayd::error::Error::io("mkdir", e))?;
    let path = dir.join("ids");
    let mut insert = Histogram::new();
    let mut remove = Histogram::new();
    let mut find_remove = Histogram::new();
    let anon_before = status_kib("RssAnon:");
    println!("{n} ids, initial {initial} slots, in {}", dir.display());

    // What a resize's background thread pays to create the largest table of this run (the engine
    // thread never waits for it).
    let big = (2 * n + 2).next_power_of_two();
    let t = Instant::now();
    drop(IdIndex::open(&tmp.path().join("probe"), big, &Durability::new(tmp.path()))?);
    println!("create + fallocate + fsync a {big}-slot table: {:.1?}", t.elapsed());
    let t = Instant::now();
    std::fs::remove_file(tmp.path().join("probe")).map_err(|e| delayd::error::Error::io("rm", e))?;
    println!("unlink it: {:.1?}", t.elapsed());

    let t0 = Instant::now();
    let mut idx = IdIndex::open(&path, initial, &Durability::new(&path))?;
    let every = (n / 10).max(1);
    for i in 0..n {
        let s = slot(i);
        let t = Instant::now();
        idx.insert(s)?;
        insert.record(t.elapsed(), i);
        if (i + 1) % every == 0 {
            progress("insert", t0, &idx, &dir);
        }
    }
    let inserted = t0.elapsed();
    let anon_peak = status_kib("RssAnon:");
    println!(
        "inserted {n} in {:.1?}; RssAnon {} KiB before, {} KiB at {} live: {:.3} bytes/id",
        inserted,
        anon_before,
        anon_peak,
        idx.len(),
        (anon_peak.saturating_sub(anon_before) * 1024) as f64 / idx.len() as f64
    );
    while idx.is_migrating() {
        idx.step(1 << 20);
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(idx);
    let t = Instant::now();
    let mut idx = IdIndex::open(&path, initial, &Durability::new(&path))?;
    println!("reopen (validate + recount {} slots): {:.1?}", idx.capacity(), t.elapsed());

    let t1 = Instant::now();
    for i in 0..n {
        let s = slot(i);
        let t = Instant::now();
        let Some((at, _)) = idx.find(s.hash, |o| o == s.msg_offset) else {
            panic!("id {i} missing from the index");
        };
        let tr = Instant::now();
        idx.remove(at);
        let done = Instant::now();
        remove.record(done - tr, i);
        find_remove.record(done - t, i);
        if (i + 1) % every == 0 {
            progress("remove", t0, &idx, &dir);
        }
    }
    println!("removed {n} in {:.1?}", t1.elapsed());
    while idx.is_migrating() {
        idx.step(1 << 20);
        std::thread::sleep(Duration::from_millis(1));
    }
    progress("settled", t0, &idx, &dir);
    insert.report("insert");
    remove.report("remove");
    find_remove.report("find+remove");
    Ok(())
}
