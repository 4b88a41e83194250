//! Who holds the server's connections: each client address's share of them, and which idle ones
//! give way when new clients need room.
//!
//! A connection costs a file handle and a parked task whatever it does, a long poll included; the
//! cap on them (`max_connections`) guards the handle limit. What must not happen is that
//! connections doing nothing keep new requests out, so:
//! - one address holds at most `max_connections_per_ip` of them; past that its new connections
//!   are refused (503, closed) rather than queued behind it;
//! - under pressure (from three quarters of the cap in use until it drops to half), a connection
//!   waiting for its next request, or for its first, is closed after a brief idle time: 1 s if it
//!   has not yet sent a request with the bearer token (when one is set), 5 s if it has;
//! - at the cap, an idle connection is closed at once to make room for a new one, those without an
//!   authenticated request first, then the longest idle (as nginx reuses its idle keep-alive
//!   connections); with none idle, the longest-waiting long poll is answered at once, empty, as
//!   its wait running out would, and its connection closed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Notify};

use super::io::PhaseCell;

/// Under pressure, how long a connection that has not yet sent an authenticated request may wait
/// for one: long enough for a client that connected to send it, too short to hoard a slot.
pub(crate) const BRIEF_IDLE_UNAUTHENTICATED: Duration = Duration::from_secs(1);
/// Under pressure, how long a connection that has sent an authenticated request may stay idle:
/// its client's pool reconnects when it needs the connection again.
pub(crate) const BRIEF_IDLE_AUTHENTICATED: Duration = Duration::from_secs(5);

/// The connections of the server, by address.
pub(crate) struct Admission {
    per_ip: usize,
    /// Connections open at which pressure begins, and at which it ends.
    pressure_at: usize,
    calm_at: usize,
    state: Mutex<State>,
    pressure: watch::Sender<bool>,
    refused: AtomicU64,
    closed_idle: AtomicU64,
    cut_polls: AtomicU64,
}

#[derive(Default)]
struct State {
    by_ip: HashMap<IpAddr, usize>,
    conns: HashMap<u64, Tracked>,
    next_id: u64,
}

/// What the admission knows of one open connection.
struct Tracked {
    /// Set when the connection is served: until then (while it waits for a slot) it cannot close
    /// to make room, and must not be taken for an idle one.
    started: Arc<AtomicBool>,
    phase: Arc<PhaseCell>,
    authenticated: Arc<AtomicBool>,
    close: Arc<Notify>,
    poll: Arc<LongPoll>,
}

/// The long poll a connection may be waiting in, which can be cut short to make room.
#[derive(Default)]
pub(crate) struct LongPoll {
    since: Mutex<Option<tokio::time::Instant>>,
    cut: Notify,
}

impl LongPoll {
    /// Runs `poll` as a long poll: `None` when it was cut short to make room for a new connection.
    pub(crate) async fn run<F: std::future::Future>(&self, poll: F) -> Option<F::Output> {
        let cut = self.cut.notified();
        tokio::pin!(cut);
        // Listening before the poll is visible, so no cut can fall between the two.
        cut.as_mut().enable();
        *self.since.lock().unwrap_or_else(PoisonError::into_inner) = Some(tokio::time::Instant::now());
        let out = tokio::select! {
            out = poll => Some(out),
            () = cut => None,
        };
        *self.since.lock().unwrap_or_else(PoisonError::into_inner) = None;
        out
    }

    fn since(&self) -> Option<tokio::time::Instant> {
        *self.since.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One admitted connection; dropping it gives its place back.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    id: u64,
    ip: IpAddr,
    /// Notified when the connection should close if it is still idle.
    pub(crate) close: Arc<Notify>,
    /// Set once the connection has sent a request with the bearer token (or when none is set).
    pub(crate) authenticated: Arc<AtomicBool>,
    /// The long poll the connection may be serving.
    pub(crate) poll: Arc<LongPoll>,
    started: Arc<AtomicBool>,
}

impl Admission {
    /// Admission for a cap of `cap` connections, `per_ip` of them from one address.
    pub(crate) fn new(cap: usize, per_ip: usize) -> Admission {
        Admission {
            per_ip,
            pressure_at: (cap - cap / 4).max(1),
            calm_at: cap / 2,
            state: Mutex::new(State::default()),
            pressure: watch::channel(false).0,
            refused: AtomicU64::new(0),
            closed_idle: AtomicU64::new(0),
            cut_polls: AtomicU64::new(0),
        }
    }

    /// Admits a connection from `ip`, or `None` when that address holds its share already.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr, phase: Arc<PhaseCell>) -> Option<Ticket> {
        let mut state = self.lock();
        let held = state.by_ip.entry(ip).or_insert(0);
        if *held >= self.per_ip {
            drop(state);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *held += 1;
        let id = state.next_id;
        state.next_id += 1;
        let (close, authenticated) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
        let (poll, started) = (Arc::new(LongPoll::default()), Arc::new(AtomicBool::new(false)));
        let tracked = Tracked {
            started: started.clone(),
            phase,
            authenticated: authenticated.clone(),
            close: close.clone(),
            poll: poll.clone(),
        };
        state.conns.insert(id, tracked);
        self.update_pressure(state.conns.len());
        Some(Ticket { admission: self.clone(), id, ip, close, authenticated, poll, started })
    }

    /// Asks up to `n` idle connections to close, those without an authenticated request first,
    /// then the longest idle; returns how many were asked.
    pub(crate) fn close_idle(&self, n: usize) -> usize {
        let state = self.lock();
        let mut idle: Vec<_> = state
            .conns
            .values()
            .filter(|t| t.started.load(Ordering::Relaxed))
            .filter_map(|t| {
                let since = t.phase.get().idle_since()?;
                Some((t.authenticated.load(Ordering::Relaxed), since, &t.close))
            })
            .collect();
        idle.sort_unstable_by_key(|(authenticated, since, _)| (*authenticated, *since));
        let asked = idle.len().min(n);
        for (_, _, close) in &idle[..asked] {
            close.notify_one();
        }
        asked
    }

    /// Cuts short the long poll that has waited longest; false when no connection is in one.
    pub(crate) fn cut_long_poll(&self) -> bool {
        let state = self.lock();
        let oldest = state
            .conns
            .values()
            .filter_map(|t| Some((t.poll.since()?, &t.poll)))
            .min_by_key(|(since, _)| *since);
        let Some((_, poll)) = oldest else { return false };
        // Only a poll waiting now hears it: one that just ended is not cut in its next.
        poll.cut.notify_waiters();
        self.cut_polls.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Long polls cut short since start to make room.
    pub(crate) fn cut_polls(&self) -> u64 {
        self.cut_polls.load(Ordering::Relaxed)
    }

    /// Counts a connection closed because it idled while others needed room.
    pub(crate) fn closed_one_idle(&self) {
        self.closed_idle.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the server is short of connection slots, and news when that changes.
    pub(crate) fn pressure(&self) -> watch::Receiver<bool> {
        self.pressure.subscribe()
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.lock().conns.len()
    }

    /// The share of one address.
    pub(crate) fn per_ip(&self) -> usize {
        self.per_ip
    }

    /// Connections refused since start because their address held its share.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Idle connections closed since start to make room.
    pub(crate) fn closed_idle(&self) -> u64 {
        self.closed_idle.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Pressure begins at `pressure_at` connections and ends at `calm_at`, so a server hovering
    /// around one mark does not wake every connection at each accept and close.
    fn update_pressure(&self, open: usize) {
        self.pressure.send_if_modified(|on| {
            let now = if open >= self.pressure_at {
                true
            } else if open <= self.calm_at {
                false
            } else {
                *on
            };
            std::mem::replace(on, now) != now
        });
    }
}

impl Ticket {
    /// Marks the connection served: from now on it can close to make room.
    pub(crate) fn start(&self) {
        self.started.store(true, Ordering::Relaxed);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.admission.lock();
        state.conns.remove(&self.id);
        if let Some(held) = state.by_ip.get_mut(&self.ip) {
            *held -= 1;
            if *held == 0 {
                state.by_ip.remove(&self.ip);
            }
        }
        self.admission.update_pressure(state.conns.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::server::io::Phase;
    use tokio::time::Instant;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn waiting(ago: Duration) -> Arc<PhaseCell> {
        Arc::new(PhaseCell::new(Phase::Waiting { since: Instant::now() - ago, kept_alive: true }))
    }

    #[test]
    fn one_address_holds_at_most_its_share() {
        let a = Arc::new(Admission::new(100, 2));
        let t1 = a.admit(ip(1), waiting(Duration::ZERO)).unwrap();
        let _t2 = a.admit(ip(1), waiting(Duration::ZERO)).unwrap();
        assert!(a.admit(ip(1), waiting(Duration::ZERO)).is_none());
        assert_eq!(a.refused(), 1);
        let _other = a.admit(ip(2), waiting(Duration::ZERO)).expect("another address has its own share");
        drop(t1);
        let again =
            a.admit(ip(1), waiting(Duration::ZERO)).expect("a closed connection gives its place back");
        assert_eq!(a.open(), 3);
        drop(again);
        assert_eq!(a.open(), 2);
    }

    #[test]
    fn pressure_begins_at_three_quarters_and_ends_at_half() {
        let a = Arc::new(Admission::new(8, 8));
        let rx = a.pressure();
        let mut held: Vec<_> = (0..5).map(|_| a.admit(ip(1), waiting(Duration::ZERO)).unwrap()).collect();
        assert!(!*rx.borrow());
        held.push(a.admit(ip(1), waiting(Duration::ZERO)).unwrap());
        assert!(*rx.borrow(), "6 of 8");
        held.truncate(5);
        assert!(*rx.borrow(), "still on between the marks");
        held.truncate(4);
        assert!(!*rx.borrow(), "off at half");
    }

    #[test]
    fn idle_connections_without_a_token_give_way_first_then_the_longest_idle() {
        let a = Arc::new(Admission::new(100, 100));
        let busy = Arc::new(PhaseCell::new(Phase::Serving { answered: None, body_done: false }));
        let t_busy = a.admit(ip(1), busy).unwrap();
        let t_old_authed = a.admit(ip(1), waiting(Duration::from_secs(50))).unwrap();
        t_old_authed.authenticated.store(true, Ordering::Relaxed);
        let t_new = a.admit(ip(1), waiting(Duration::from_secs(1))).unwrap();
        let t_old = a.admit(ip(1), waiting(Duration::from_secs(9))).unwrap();
        // Waiting for a slot: it cannot close, so it is never asked.
        let t_unstarted = a.admit(ip(1), waiting(Duration::from_secs(99))).unwrap();
        for t in [&t_busy, &t_old_authed, &t_new, &t_old] {
            t.start();
        }
        assert_eq!(a.close_idle(2), 2);
        let asked = |t: &Ticket| {
            let n = t.close.notified();
            tokio::pin!(n);
            n.as_mut().enable()
        };
        assert!(asked(&t_old) && asked(&t_new), "both idle without a token");
        assert!(!asked(&t_old_authed) && !asked(&t_busy));
        assert_eq!(a.close_idle(10), 3, "a busy connection is never asked");
        assert!(asked(&t_old_authed));
        assert!(!asked(&t_busy) && !asked(&t_unstarted));
    }

    #[tokio::test]
    async fn the_longest_waiting_poll_is_cut_and_only_while_it_waits() {
        let a = Arc::new(Admission::new(100, 100));
        let (t1, t2) = (
            a.admit(ip(1), waiting(Duration::ZERO)).unwrap(),
            a.admit(ip(1), waiting(Duration::ZERO)).unwrap(),
        );
        assert!(!a.cut_long_poll(), "no poll to cut");
        let (p1, p2) = (t1.poll.clone(), t2.poll.clone());
        let first = tokio::spawn(async move { p1.run(std::future::pending::<()>()).await });
        tokio::task::yield_now().await;
        let second = tokio::spawn(async move { p2.run(std::future::pending::<()>()).await });
        tokio::task::yield_now().await;
        assert!(a.cut_long_poll());
        assert_eq!(first.await.unwrap(), None, "the older poll was cut");
        assert!(!second.is_finished());
        // A poll that finishes on its own is not cut in the next one on its connection.
        assert_eq!(t1.poll.run(async { 7 }).await, Some(7));
        assert!(a.cut_long_poll());
        assert_eq!(second.await.unwrap(), None);
        assert_eq!(a.cut_polls(), 2);
    }
}
