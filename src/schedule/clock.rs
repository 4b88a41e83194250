//! Time for the schedulers, behind a trait so tests can run a two-hour chain in milliseconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in unix microseconds.
pub trait Clock: Send + Sync + 'static {
    /// Now, unix microseconds.
    fn now_us(&self) -> u64;

    /// Now, unix milliseconds (rounded down, so "due <= now_ms" never fires early).
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }
}

/// The system's real-time clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `ms`.
    pub fn at_ms(ms: u64) -> ManualClock {
        ManualClock(AtomicU64::new(ms * 1000))
    }

    /// Moves the clock forward.
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms * 1000, Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set_ms(&self, ms: u64) {
        self.0.store(ms * 1000, Ordering::SeqCst);
    }

    /// Sets the time in microseconds (to test rounding within a millisecond).
    pub fn set_us(&self, us: u64) {
        self.0.store(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
