//! Times one engine step on the wall and CPU clocks, and logs a slow one with its parts.

use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// Times one engine step: wall clock and the engine thread's own CPU time, and when each of its
/// parts ended, to say which one ran long.
pub(super) struct StepTimer {
    pub(super) started: Instant,
    /// The thread's CPU clock at the start; `None` for a step not timed on the CPU clock.
    cpu_ns: Option<u64>,
    /// Whether the CPU time goes into `delayd_engine_step_cpu_seconds` (engine-thread steps).
    count_cpu: bool,
    switches: [u64; 4],
    marks: [(&'static str, Instant); 6],
    marked: usize,
}

/// A step over this much wall or CPU time is logged with its parts, faults and context switches
/// (at debug level: the histograms count them, and on a loaded machine they are not news).
const SLOW_STEP: Duration = Duration::from_millis(10);

impl StepTimer {
    /// Starts timing a step; `on_cpu` also reads the thread's CPU clock, a system call at each
    /// end (not served by the vDSO like the wall clock). Steps on the engine thread read it, since
    /// a long one is either work or waiting and only that clock tells which; a request applied
    /// inline reads it only for the slow-step log, when that is on, since two system calls per
    /// request were 2-3% of the server's CPU under load, and such a step is one request's work.
    pub(super) fn start(on_cpu: bool) -> StepTimer {
        let started = Instant::now();
        let slow_step_log = tracing::enabled!(tracing::Level::DEBUG);
        StepTimer {
            started,
            cpu_ns: (on_cpu || slow_step_log).then(crate::storage::mmap::thread_cpu_ns),
            count_cpu: on_cpu,
            // Only the slow-step log reads them: no system call per step otherwise.
            switches: if slow_step_log { crate::storage::mmap::thread_switches() } else { [0; 4] },
            marks: [("", started); 6],
            marked: 0,
        }
    }

    /// Notes that the part `name` ended now.
    pub(super) fn mark(&mut self, name: &'static str) {
        if let Some(m) = self.marks.get_mut(self.marked) {
            *m = (name, Instant::now());
            self.marked += 1;
        }
    }

    /// Records the step, of which `resize` went to the id index's resize.
    pub(super) fn record(&self, metrics: &Metrics, resize: Duration) {
        let wall = self.started.elapsed();
        let cpu = self.cpu_ns.map_or(0, |at| crate::storage::mmap::thread_cpu_ns().saturating_sub(at));
        metrics.engine_step_us.observe(wall.as_micros() as u64);
        if self.count_cpu {
            metrics.engine_step_cpu_us.observe(cpu / 1000);
        }
        if !resize.is_zero() {
            metrics.index_resize_step_us.observe(resize.as_micros() as u64);
        }
        if (wall >= SLOW_STEP || Duration::from_nanos(cpu) >= SLOW_STEP)
            && tracing::enabled!(tracing::Level::DEBUG)
        {
            let now = crate::storage::mmap::thread_switches();
            let [minflt, majflt, blocked, preempted] =
                [0, 1, 2, 3].map(|k| now[k].saturating_sub(self.switches[k]));
            let mut parts = String::new();
            let mut from = self.started;
            for (name, at) in &self.marks[..self.marked] {
                parts.push_str(&format!("{name} {:.1?} ", at.duration_since(from)));
                from = *at;
            }
            tracing::debug!(
                ?wall,
                cpu = ?Duration::from_nanos(cpu),
                parts = parts.trim_end(),
                ?resize,
                minflt,
                majflt,
                blocked,
                preempted,
                "slow engine step"
            );
        }
    }
}
