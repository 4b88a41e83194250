//! Time for the schedulers, behind a trait so tests can run a two-hour chain in milliseconds.
//!
//! The server's "now" decides every delivery, TTR expiry and retention, so it must not follow the
//! wall clock's steps (NTP, an operator's `date -s`, a VM restored from a snapshot): a message
//! produced with `delay_ms` must never be delivered before `delay_ms` of real time has passed.
//! [`SystemClock`] is the wall clock held to that rule by the time since boot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in unix microseconds.
pub trait Clock: Send + Sync + 'static {
    /// Now, unix microseconds.
    fn now_us(&self) -> u64;

    /// Now, unix milliseconds (rounded down, so "due <= now_ms" never fires early).
    fn now_ms(&self) -> u64 {
        self.now_us() / 1000
    }
}

/// The system's clock, safe against steps: it reads the wall clock but never advances faster
/// than real elapsed time (CLOCK_BOOTTIME, which also counts a suspend) and goes backward only to
/// follow a wall clock that fell more than [`MAX_HOLD_US`] behind.
///
/// Each reading is `min(prev + elapsed, max(prev, wall))`. While the wall clock behaves that is
/// the wall clock. After a backward step it holds still until the wall clock catches up (so
/// everything is late by up to the step, never early), for ten minutes at most; a forward step is not followed for the
/// rest of the run (relative delays and TTRs stay exact, absolute `deliver_at_ms` times fire late
/// by the step until a restart, which starts again from the wall clock). Slewing toward a wall
/// clock that jumped ahead would shorten real delays, so it does not. Every `SystemClock` shares
/// one process-wide reading, so the engine and the HTTP layer see one timeline.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        static SYSTEM: OnceLock<Stepped<RealSources>> = OnceLock::new();
        SYSTEM.get_or_init(|| Stepped::new(RealSources::new())).now_us()
    }
}

/// What [`Stepped`] reads: the wall clock and a clock that only counts real time.
trait Sources: Send + Sync + 'static {
    /// The wall clock, unix microseconds.
    fn wall_us(&self) -> u64;
    /// Real time since some fixed point, microseconds; never steps.
    fn elapsed_us(&self) -> u64;
}

/// The real wall clock and CLOCK_BOOTTIME (CLOCK_MONOTONIC stops while the machine is
/// suspended, which would make messages due during a suspend late by its length).
struct RealSources {
    /// Where [`Instant`] time is measured from when CLOCK_BOOTTIME cannot be read.
    start: Instant,
    boottime: bool,
}

impl RealSources {
    fn new() -> RealSources {
        RealSources { start: Instant::now(), boottime: boottime_us().is_some() }
    }
}

impl Sources for RealSources {
    fn wall_us(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
    }

    fn elapsed_us(&self) -> u64 {
        // Chosen once at start: switching between the two mid-run would be a step of its own.
        if self.boottime {
            if let Some(us) = boottime_us() {
                return us;
            }
        }
        self.start.elapsed().as_micros() as u64
    }
}

/// CLOCK_BOOTTIME in microseconds, where the system has it.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn boottime_us() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    (rc == 0).then(|| (ts.tv_sec as u64).saturating_mul(1_000_000).saturating_add(ts.tv_nsec as u64 / 1000))
}

/// CLOCK_BOOTTIME in microseconds, where the system has it.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn boottime_us() -> Option<u64> {
    None
}

/// The most "now" is held ahead of a wall clock that stepped back. Holding keeps absolute times
/// from firing early by a corrected clock, but it also holds every new delay: a clock that booted
/// hours fast and was then put right by NTP would stop all delivery for hours. Past this, "now"
/// follows the wall clock back: what is pending runs late by the step, new messages are on time,
/// and nothing is early either way.
const MAX_HOLD_US: u64 = 10 * 60 * 1_000_000;

/// A step smaller than this is not worth a warning (the two clocks are read a moment apart).
const STEP_WARN_US: u64 = 1_000_000;

/// The wall clock, held back from its steps by a real-time clock.
struct Stepped<S> {
    src: S,
    state: Mutex<State>,
}

/// The last reading. A small mutex: uncontended it costs about as much as the clock reads.
struct State {
    /// The last "now" handed out, unix microseconds.
    now_us: u64,
    /// The real-time clock at that reading.
    elapsed_us: u64,
    /// Wall clock minus real-time clock at that reading: it changes only when the wall clock steps
    /// (or slews, by parts per million).
    offset_us: i64,
    /// "Now" is held ahead of a wall clock that stepped back; logged once when it catches up.
    holding: bool,
}

/// What one reading has to log, written after the lock is released.
#[derive(Debug, PartialEq, Eq)]
enum Event {
    Step {
        step_us: i64,
        now_behind_wall_us: i64,
    },
    CaughtUp,
    /// The wall clock fell more than [`MAX_HOLD_US`] behind: followed back.
    FollowedBack {
        behind_us: u64,
    },
}

impl<S: Sources> Stepped<S> {
    /// Starts at the wall clock.
    fn new(src: S) -> Stepped<S> {
        let elapsed_us = src.elapsed_us();
        let wall_us = src.wall_us();
        let state = State {
            now_us: wall_us,
            elapsed_us,
            offset_us: signed_diff(wall_us, elapsed_us),
            holding: false,
        };
        Stepped { src, state: Mutex::new(state) }
    }

    fn now_us(&self) -> u64 {
        let (now, event) = self.read();
        match event {
            Some(Event::Step { step_us, now_behind_wall_us }) => log_step(step_us, now_behind_wall_us),
            Some(Event::CaughtUp) => {
                tracing::info!("the wall clock caught up with delayd's clock; they agree again")
            }
            Some(Event::FollowedBack { behind_us }) => tracing::warn!(
                behind_ms = behind_us / 1000,
                "the wall clock is {} ms behind delayd's clock, more than it holds for; delayd's clock \
                 follows it back: messages already pending run late by that much, none early",
                behind_us / 1000
            ),
            None => {}
        }
        now
    }

    /// Now, and what happened to the wall clock since the last reading (logged by the caller,
    /// outside the lock).
    fn read(&self) -> (u64, Option<Event>) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        // Read under the lock so readings are ordered as the clocks were read; the real-time
        // clock first, so the time between the two reads can only make "now" lag, not lead.
        let elapsed_us = self.src.elapsed_us();
        let wall_us = self.src.wall_us();
        let real = elapsed_us.saturating_sub(st.elapsed_us);
        let mut now = st.now_us.saturating_add(real).min(wall_us.max(st.now_us));
        let offset_us = signed_diff(wall_us, elapsed_us);
        let step_us = offset_us.saturating_sub(st.offset_us);
        // A slew moves the offset by at most ~500 ppm of the time between readings.
        let event = if now > wall_us.saturating_add(MAX_HOLD_US) {
            let behind_us = now - wall_us;
            now = wall_us;
            st.holding = false;
            Some(Event::FollowedBack { behind_us })
        } else if step_us.unsigned_abs() > STEP_WARN_US + real / 1000 {
            st.holding = now > wall_us;
            Some(Event::Step { step_us, now_behind_wall_us: signed_diff(wall_us, now) })
        } else if st.holding && now <= wall_us {
            st.holding = false;
            Some(Event::CaughtUp)
        } else {
            None
        };
        st.now_us = now;
        st.elapsed_us = elapsed_us;
        st.offset_us = offset_us;
        (now, event)
    }
}

fn log_step(step_us: i64, now_behind_wall_us: i64) {
    let step_ms = step_us / 1000;
    let gap_ms = now_behind_wall_us / 1000;
    let direction = if step_us < 0 { "backward" } else { "forward" };
    if gap_ms < 0 {
        tracing::warn!(
            step_ms,
            ahead_of_wall_ms = -gap_ms,
            "the wall clock stepped {direction} by {} ms; delayd's clock holds still until the wall \
             clock catches up, so deliveries, TTRs and retention run late by up to that, never early",
            step_ms.unsigned_abs()
        );
    } else if gap_ms > 0 {
        tracing::warn!(
            step_ms,
            behind_wall_ms = gap_ms,
            "the wall clock stepped {direction} by {} ms; delayd's clock does not follow, so delays \
             and TTRs stay exact but absolute deliver_at_ms times fire late by {gap_ms} ms until a restart",
            step_ms.unsigned_abs()
        );
    } else {
        tracing::warn!(
            step_ms,
            "the wall clock stepped {direction} by {} ms, back to delayd's clock; they agree again",
            step_ms.unsigned_abs()
        );
    }
}

/// `a - b` as a signed number of microseconds.
fn signed_diff(a: u64, b: u64) -> i64 {
    (i128::from(a) - i128::from(b)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const S: u64 = 1_000_000;
    const T0: u64 = 1_700_000_000 * S;

    /// A wall clock and a real-time clock the test moves by hand.
    #[derive(Default)]
    struct Fake {
        wall: AtomicU64,
        real: AtomicU64,
    }

    impl Fake {
        /// Real time passes: both clocks move.
        fn pass(&self, us: u64) {
            self.wall.fetch_add(us, Ordering::SeqCst);
            self.real.fetch_add(us, Ordering::SeqCst);
        }

        /// The wall clock steps by `us` (signed); real time does not move.
        fn step(&self, us: i64) {
            let w = self.wall.load(Ordering::SeqCst);
            self.wall.store(w.checked_add_signed(us).unwrap(), Ordering::SeqCst);
        }
    }

    impl Sources for Arc<Fake> {
        fn wall_us(&self) -> u64 {
            self.wall.load(Ordering::SeqCst)
        }
        fn elapsed_us(&self) -> u64 {
            self.real.load(Ordering::SeqCst)
        }
    }

    fn clock() -> (Arc<Fake>, Stepped<Arc<Fake>>) {
        let fake = Arc::new(Fake { wall: AtomicU64::new(T0), real: AtomicU64::new(5 * S) });
        let c = Stepped::new(fake.clone());
        (fake, c)
    }

    #[test]
    fn follows_a_wall_clock_that_behaves() {
        let (f, c) = clock();
        assert_eq!(c.now_us(), T0);
        for i in 1..=1000 {
            f.pass(1234);
            assert_eq!(c.now_us(), T0 + i * 1234);
        }
        // A long quiet spell (or a suspend, which CLOCK_BOOTTIME counts) is followed too.
        f.pass(3600 * S);
        assert_eq!(c.now_us(), f.wall_us());
    }

    #[test]
    fn a_backward_step_holds_until_the_wall_clock_catches_up() {
        let (f, c) = clock();
        f.pass(10 * S);
        let before = c.now_us();
        f.step(-120 * (S as i64));
        for _ in 0..119 {
            f.pass(S);
            assert_eq!(c.now_us(), before, "held");
        }
        f.pass(S);
        assert_eq!(c.now_us(), before, "caught up exactly");
        f.pass(S / 2);
        assert_eq!(c.now_us(), before + S / 2, "runs with the wall clock again");
        assert_eq!(c.now_us(), f.wall_us());
    }

    #[test]
    fn a_forward_step_is_not_followed() {
        let (f, c) = clock();
        f.pass(S);
        let before = c.now_us();
        f.step(900 * (S as i64));
        assert_eq!(c.now_us(), before, "no real time passed");
        f.pass(6 * S);
        assert_eq!(c.now_us(), before + 6 * S, "advances by real time only");
        // Stepping back by as much brings the two together again.
        f.step(-900 * (S as i64));
        f.pass(S);
        assert_eq!(c.now_us(), f.wall_us());
        assert_eq!(c.now_us(), before + 7 * S);
    }

    #[test]
    fn back_then_forward_delivers_nothing_early() {
        // The case: a delay of 6 s measured from a reading taken while the wall clock was
        // stepped back must not elapse when it steps forward again.
        let (f, c) = clock();
        f.pass(S);
        f.step(-120 * (S as i64));
        f.pass(S);
        let produced = c.now_us();
        f.step(120 * (S as i64));
        f.pass(S);
        let later = c.now_us();
        assert!(later - produced <= S, "{} us passed on the clock in 1 s of real time", later - produced);
    }

    #[test]
    fn each_step_is_reported_once_and_so_is_the_catch_up() {
        let (f, c) = clock();
        f.pass(S);
        assert_eq!(c.read().1, None);
        f.step(-30 * (S as i64));
        assert_eq!(
            c.read().1,
            Some(Event::Step { step_us: -30 * (S as i64), now_behind_wall_us: -30 * (S as i64) })
        );
        for _ in 0..29 {
            f.pass(S);
            assert_eq!(c.read().1, None, "held, nothing new to say");
        }
        f.pass(S);
        assert_eq!(c.read().1, Some(Event::CaughtUp));
        f.pass(S);
        assert_eq!(c.read().1, None);
        // Forward: said once, and the lag it leaves is no news at later readings.
        f.step(900 * (S as i64));
        assert_eq!(
            c.read().1,
            Some(Event::Step { step_us: 900 * (S as i64), now_behind_wall_us: 900 * (S as i64) })
        );
        f.pass(S);
        assert_eq!(c.read().1, None);
        // A slew (here 400 ppm over an hour between readings) is not a step.
        f.pass(3600 * S);
        f.step(1_440_000);
        assert_eq!(c.read().1, None);
    }

    #[test]
    fn a_backward_step_past_the_hold_limit_is_followed() {
        let (f, c) = clock();
        f.pass(10 * S);
        let before = c.now_us();
        // A clock that booted three hours fast, put right: holding would stop delivery for hours.
        f.step(-3 * 3600 * (S as i64));
        let (now, event) = c.read();
        assert_eq!(now, f.wall_us(), "follows the wall clock back");
        assert_eq!(event, Some(Event::FollowedBack { behind_us: before - f.wall_us() }));
        f.pass(S);
        assert_eq!(c.now_us(), f.wall_us(), "and runs with it");
        // A step back within the limit is still held.
        let held = c.now_us();
        f.step(-(MAX_HOLD_US as i64) + S as i64);
        f.pass(S);
        assert_eq!(c.now_us(), held);
    }

    #[test]
    fn no_reading_goes_backward_or_outruns_real_time() {
        let (f, c) = clock();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut rand = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut prev, mut prev_real) = (c.now_us(), f.elapsed_us());
        for _ in 0..100_000 {
            match rand() % 10 {
                0 => f.step((rand() % (600 * S)) as i64 - 300 * (S as i64)),
                _ => f.pass(rand() % (2 * S)),
            }
            let now = c.now_us();
            let real = f.elapsed_us();
            let followed_back = now == f.wall_us() && prev - now.min(prev) > MAX_HOLD_US;
            assert!(now >= prev || followed_back, "went backward: {prev} -> {now}");
            assert!(now.saturating_sub(prev) <= real - prev_real, "ran ahead of real time");
            assert!(now <= f.wall_us().max(prev), "ran ahead of the wall clock");
            (prev, prev_real) = (now, real);
        }
    }

    #[test]
    fn the_system_clock_is_near_the_wall_clock_and_never_goes_back() {
        let wall = RealSources::new().wall_us();
        let mut prev = SystemClock.now_us();
        assert!(prev.abs_diff(wall) < 5 * S, "{prev} vs wall {wall}");
        for _ in 0..10_000 {
            let now = SystemClock.now_us();
            assert!(now >= prev);
            prev = now;
        }
    }
}
