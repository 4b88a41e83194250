//! The end-to-end stream of `delayd-bench --workloads e2e --rates 1000` reduced to its syncs, with
//! no HTTP and no engine: a producer at 1,000 a second (each produce synced), timers due 1 to 2 s
//! later, and 16 consumers that pop up to 16 (one synced reservation record) and ack each (one
//! synced record each) before popping again, all against one group-committing flusher on a real
//! file. It shows what the disk alone makes of the stream's lateness on a machine.
//!
//! `cargo bench --bench stream_syncs -- DIR SECS [fire-sync]`: `fire-sync` also syncs each fired
//! timer's own record before its message may be popped (what delayd did before 2026-11-28).
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Ends the run on an I/O failure: a model with a broken disk measures nothing.
fn fail(what: &str, e: std::io::Error) -> ! {
    eprintln!("stream_syncs: {what}: {e}");
    std::process::exit(1)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The log: appends under a lock, a flusher thread that syncs everything appended so far.
struct Log {
    st: Mutex<LogState>,
    cv: Condvar,
}

struct LogState {
    end: u64,
    synced: u64,
    syncs: u64,
    stop: bool,
}

impl Log {
    /// Appends `n` bytes; returns the end to wait for.
    fn append(&self, file: &File, n: usize) -> u64 {
        let mut s = lock(&self.st);
        if let Err(e) = file.write_at(&vec![7u8; n], s.end) {
            fail("write", e);
        }
        s.end += n as u64;
        self.cv.notify_all();
        s.end
    }

    /// Blocks until the log is synced to `end`.
    fn wait(&self, end: u64) {
        let mut s = lock(&self.st);
        while s.synced < end {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The group commit: one fdatasync for everything appended while the last one ran.
    fn flusher(&self, file: &File) {
        loop {
            let end = {
                let mut s = lock(&self.st);
                while s.synced >= s.end && !s.stop {
                    s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
                }
                if s.stop {
                    return;
                }
                s.end
            };
            if let Err(e) = file.sync_data() {
                fail("fdatasync", e);
            }
            let mut s = lock(&self.st);
            s.synced = s.synced.max(end);
            s.syncs += 1;
            self.cv.notify_all();
        }
    }
}

/// xorshift64: delays without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

const RATE: u64 = 1000;
const CONSUMERS: usize = 16;
const POP_MAX: usize = 16;

fn main() {
    // `cargo bench` passes `--bench` first.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let dir = args.first().cloned().unwrap_or_else(|| "/tmp".into());
    let secs: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let fire_sync = args.get(2).is_some_and(|s| s == "fire-sync");
    let path = std::path::Path::new(&dir).join("stream-syncs.log");
    let file = OpenOptions::new()
        .create(true)
        .read(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap_or_else(|e| fail("open", e));
    // Zeroes written ahead, as delayd's warmer leaves the log: appends overwrite written blocks.
    let room = (secs * RATE * 600 + (64 << 20)) as usize;
    if let Err(e) = file.write_at(&vec![0u8; room], 0).and_then(|_| file.sync_all()) {
        fail("preallocate", e);
    }
    let file = Arc::new(file);
    let log = Arc::new(Log {
        st: Mutex::new(LogState { end: 0, synced: 0, syncs: 0, stop: false }),
        cv: Condvar::new(),
    });
    let flusher = {
        let (log, file) = (log.clone(), file.clone());
        std::thread::spawn(move || log.flusher(&file))
    };
    let t0 = Instant::now();
    let now_ms = move || t0.elapsed().as_secs_f64() * 1000.0;
    let timers: Arc<(Mutex<BinaryHeap<Reverse<u64>>>, Condvar)> = Arc::default();
    let ready: Arc<(Mutex<VecDeque<u64>>, Condvar)> = Arc::default();
    let lateness: Arc<Mutex<Vec<f64>>> = Arc::default();

    // Producers: one a millisecond, spread over 8 threads that each wait for their produce's sync.
    let producer = {
        let (log, file, timers) = (log.clone(), file.clone(), timers.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(42);
            let senders: Vec<_> = (0..8)
                .map(|_| {
                    let (log, file, timers) = (log.clone(), file.clone(), timers.clone());
                    let (tx, rx) = std::sync::mpsc::channel::<u64>();
                    std::thread::spawn(move || {
                        for delay in rx {
                            log.wait(log.append(&file, 200));
                            lock(&timers.0).push(Reverse(now_ms() as u64 + delay));
                            timers.1.notify_one();
                        }
                    });
                    tx
                })
                .collect();
            for i in 0..secs * RATE {
                if let Some(d) = Duration::from_millis(i).checked_sub(t0.elapsed()) {
                    std::thread::sleep(d);
                }
                let _ = senders[(i % 8) as usize].send(1000 + rng.next() % 1000);
            }
        })
    };

    // The scheduler: makes each due message ready (one record; synced first only with fire-sync).
    {
        let (log, file, timers, ready) = (log.clone(), file.clone(), timers.clone(), ready.clone());
        std::thread::spawn(move || loop {
            let mut heap = lock(&timers.0);
            let now = now_ms() as u64;
            let mut fired = Vec::new();
            while let Some(&Reverse(due)) = heap.peek() {
                if due > now {
                    break;
                }
                fired.push(due);
                heap.pop();
            }
            if fired.is_empty() {
                let wait = heap.peek().map_or(10, |Reverse(due)| due - now);
                drop(timers.1.wait_timeout(heap, Duration::from_millis(wait)));
                continue;
            }
            drop(heap);
            let end = log.append(&file, 60 * fired.len());
            if fire_sync {
                log.wait(end);
            }
            lock(&ready.0).extend(fired.iter().copied());
            ready.1.notify_all();
        });
    }

    // Consumers: pop (a synced reservation), then ack each concurrently and wait for all.
    for _ in 0..CONSUMERS {
        let (log, file, ready, lateness) = (log.clone(), file.clone(), ready.clone(), lateness.clone());
        std::thread::spawn(move || loop {
            let got: Vec<u64> = {
                let mut r = lock(&ready.0);
                while r.is_empty() {
                    r = ready.1.wait(r).unwrap_or_else(|p| p.into_inner());
                }
                let n = r.len().min(POP_MAX);
                r.drain(..n).collect()
            };
            log.wait(log.append(&file, 80 * got.len()));
            let at = now_ms();
            lock(&lateness).extend(got.iter().map(|&due| at - due as f64));
            let acks: Vec<_> = got
                .iter()
                .map(|_| {
                    let (log, file) = (log.clone(), file.clone());
                    std::thread::spawn(move || log.wait(log.append(&file, 60)))
                })
                .collect();
            for a in acks {
                let _ = a.join();
            }
        });
    }

    let _ = producer.join();
    std::thread::sleep(Duration::from_millis(2500));
    let syncs = {
        let mut s = lock(&log.st);
        s.stop = true;
        log.cv.notify_all();
        s.syncs
    };
    let _ = flusher.join();
    let _ = std::fs::remove_file(&path);
    let mut l = lock(&lateness).clone();
    if l.is_empty() {
        eprintln!("stream_syncs: nothing was delivered");
        std::process::exit(1);
    }
    l.sort_by(f64::total_cmp);
    let q = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)];
    let over3 = l.iter().filter(|&&x| x >= 3.0).count() as f64 * 100.0 / l.len() as f64;
    println!(
        "delivered {} (fire-sync {fire_sync}): lateness p50 {:.1} p99 {:.1} p99.9 {:.1} max {:.1} ms, \
         {over3:.2} % at 3 ms or more; {syncs} syncs ({:.0} a second)",
        l.len(),
        q(0.5),
        q(0.99),
        q(0.999),
        l[l.len() - 1],
        syncs as f64 / secs as f64
    );
}
