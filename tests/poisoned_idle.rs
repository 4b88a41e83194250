//! A poisoned store with messages falling due idles: no busy loop, a small log.
//!
//! Alone in its test binary because it installs the process-wide log subscriber (to count the
//! bytes logged) and measures the whole process's CPU time from /proc/self/stat.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, ProduceRequest, When};
use delayd::storage::io::{Fault, Op};

/// Counts the bytes the log subscriber writes.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

impl Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// utime + stime of this process, in clock ticks (fields 14 and 15 of /proc/self/stat).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // The command name may contain spaces: fields are counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // `rest` starts at field 3 (state), so field n is f[n - 3].
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn a_poisoned_store_with_messages_falling_due_idles_and_logs_little() {
    let logged = Counter::default();
    let writer = logged.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::DEBUG)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = BrokerConfig::with_defaults(dir.path());
    cfg.segment_bytes = 1 << 20;
    let b = Broker::open(cfg).unwrap();
    rt.block_on(async {
        for i in 0..2000u64 {
            let req = ProduceRequest {
                id: Some(format!("m{i}")),
                body: Bytes::from_static(b"due soon"),
                // Due between 0.3 and 1.3 s from now: after the store is poisoned below.
                when: When::DelayMs(300 + i / 2),
                ttr_ms: None,
                max_attempts: None,
                backoff_ms: None,
            };
            b.produce("t", req).await.unwrap();
        }
        // Every sync under the data dir fails from now on: the next write poisons the store.
        let _fault = Fault::new(Op::Sync, dir.path(), libc::EIO).inject();
        let r = b.produce(
            "t",
            ProduceRequest {
                id: Some("poison".into()),
                body: Bytes::from_static(b"x"),
                when: When::Now,
                ttr_ms: None,
                max_attempts: None,
                backoff_ms: None,
            },
        );
        assert!(r.await.is_err(), "the failed flush must refuse the produce");
        assert!(!b.store_writable());
        // Let every message fall due, then measure a quiet stretch: CPU ticks and log bytes.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (cpu0, log0) = (cpu_ticks(), logged.0.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (cpu1, log1) = (cpu_ticks(), logged.0.load(Ordering::Relaxed));
        let stats = b.stats().await.expect("stats keep answering");
        assert!(!stats.store_writable);
        assert!(stats.levels.iter().any(|l| l.backlog > 0), "the due messages must still be waiting");
        // A busy engine burns ~300 ticks (100 per second per core) in 3 s; an idle one a handful.
        let ticks = cpu1 - cpu0;
        println!("poisoned for 3 s with 2000 messages due: {ticks} CPU ticks, {} bytes logged", log1 - log0);
        assert!(ticks <= 30, "the poisoned engine used {ticks} CPU ticks in 3 s: a busy loop");
        assert!(log1 - log0 <= 4096, "the poisoned engine logged {} bytes in 3 s", log1 - log0);
        b.shutdown().await.ok();
    });
}
