//! Tests of the cluster test harness itself: the link proxy's modes and the history checker.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::checker::History;
use common::proxy::{LinkProxy, Mode};

// ---- the link proxy ----

/// A proxy in front of a listener the test holds, and one connection through it: the client
/// end and the end the target accepted.
struct Link {
    proxy: LinkProxy,
    target: TcpListener,
}

impl Link {
    fn new() -> Link {
        let target = TcpListener::bind("127.0.0.1:0").expect("bind target");
        let proxy = LinkProxy::start(target.local_addr().expect("target address"));
        Link { proxy, target }
    }

    /// Connects through the proxy; returns (client end, target end).
    fn connect(&self) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(self.proxy.addr()).expect("connect to proxy");
        let (server, _) = self.target.accept().expect("proxy connects to the target");
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
        }
        (client, server)
    }
}

/// Reads exactly `n` bytes or panics after the stream's read timeout.
fn read_n(s: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).expect("read through the proxy");
    buf
}

/// Whether nothing arrives within `wait` while the connection stays open.
fn silent_but_open(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 64];
    let silent =
        matches!(s.read(&mut buf), Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut));
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
    silent
}

/// Whether the stream is closed: a read ends (EOF or reset) within `wait`.
fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
    }
}

/// Bytes flow both ways through a connection.
fn assert_flows(client: &mut TcpStream, server: &mut TcpStream, tag: &[u8]) {
    client.write_all(tag).expect("client writes");
    assert_eq!(read_n(server, tag.len()), tag, "client -> target");
    server.write_all(tag).expect("target writes");
    assert_eq!(read_n(client, tag.len()), tag, "target -> client");
}

#[test]
fn pass_forwards_both_ways_in_order() {
    let link = Link::new();
    let (mut c, mut s) = link.connect();
    assert_eq!(link.proxy.mode(), Mode::Pass);
    for i in 0..20u8 {
        assert_flows(&mut c, &mut s, &[i; 100]);
    }
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    c.write_all(&big).expect("write 1 MB");
    assert_eq!(read_n(&mut s, big.len()), big, "a large write arrives whole and in order");
}

#[test]
fn cut_closes_open_connections_and_new_ones_and_pass_after_cut_works() {
    let link = Link::new();
    let (mut c, mut s) = link.connect();
    assert_flows(&mut c, &mut s, b"before");
    link.proxy.set(Mode::Cut);
    assert!(closed_within(&mut c, Duration::from_secs(2)), "the client end was not closed by the cut");
    assert!(closed_within(&mut s, Duration::from_secs(2)), "the target end was not closed by the cut");
    // A new connection is accepted by the proxy and closed at once, never reaching the target.
    let mut late = TcpStream::connect(link.proxy.addr()).expect("the proxy still listens");
    assert!(closed_within(&mut late, Duration::from_secs(2)), "a connection made while cut stayed open");
    link.target.set_nonblocking(true).expect("non-blocking");
    std::thread::sleep(Duration::from_millis(200));
    assert!(link.target.accept().is_err(), "a connection made while cut reached the target");
    link.target.set_nonblocking(false).expect("blocking");
    link.proxy.set(Mode::Pass);
    let (mut c2, mut s2) = link.connect();
    assert_flows(&mut c2, &mut s2, b"after the cut");
}

#[test]
fn blackhole_drops_every_byte_both_ways_and_pass_restores_the_same_connection() {
    let link = Link::new();
    let (mut c, mut s) = link.connect();
    assert_flows(&mut c, &mut s, b"before");
    link.proxy.set(Mode::Blackhole);
    c.write_all(b"lost upstream").expect("write while blackholed");
    s.write_all(b"lost downstream").expect("write while blackholed");
    assert!(
        silent_but_open(&mut s, Duration::from_millis(400)),
        "bytes reached the target through a blackhole"
    );
    assert!(
        silent_but_open(&mut c, Duration::from_millis(400)),
        "bytes reached the client through a blackhole"
    );
    assert_eq!(link.proxy.open_connections(), 1, "a blackhole keeps the connection open");
    link.proxy.set(Mode::Pass);
    // Only what is sent after the switch arrives: the blackholed bytes are gone for good.
    assert_flows(&mut c, &mut s, b"restored");
}

#[test]
fn delay_forwards_each_chunk_after_the_delay_in_order() {
    let link = Link::new();
    let (mut c, mut s) = link.connect();
    let delay = Duration::from_millis(300);
    link.proxy.set(Mode::Delay(delay));
    let t0 = Instant::now();
    for chunk in [b"one ", b"two ", b"six "] {
        c.write_all(chunk).expect("write");
        std::thread::sleep(Duration::from_millis(50));
    }
    let first = read_n(&mut s, 4);
    assert!(t0.elapsed() >= delay, "the first chunk came after {:?}, before the delay", t0.elapsed());
    assert_eq!(first, b"one ");
    assert_eq!(read_n(&mut s, 8), b"two six ", "chunks arrive in order");
    let t1 = Instant::now();
    s.write_all(b"back").expect("write back");
    assert_eq!(read_n(&mut c, 4), b"back");
    assert!(t1.elapsed() >= delay, "the way back took {:?}, less than the delay", t1.elapsed());
    link.proxy.set(Mode::Pass);
    let t2 = Instant::now();
    assert_flows(&mut c, &mut s, b"fast again");
    assert!(t2.elapsed() < delay, "pass after delay still delays ({:?})", t2.elapsed());
}

#[test]
fn dropping_the_proxy_closes_its_connections_and_its_port() {
    let link = Link::new();
    let (mut c, mut s) = link.connect();
    let addr = link.proxy.addr();
    let Link { proxy, target: _target } = link;
    drop(proxy);
    assert!(closed_within(&mut c, Duration::from_secs(2)), "client end open after the drop");
    assert!(closed_within(&mut s, Duration::from_secs(2)), "target end open after the drop");
    assert!(TcpStream::connect(addr).is_err(), "the proxy's port still accepts after the drop");
}

// ---- the history checker ----

#[test]
fn a_clean_history_passes_and_counts_duplicates() {
    let h = History::new();
    h.produced("a", 1_000, true);
    h.delivered("a", 1_000);
    h.delivered("a", 1_500); // redelivered after an expired reservation
    h.acked("a", 1_600, true);
    h.produced("b", 2_000, true);
    h.cancelled("b", 1_200, true); // cancelled before due, never delivered
    h.produced("c", 3_000, true);
    h.delivered("c", 3_100);
    h.acked("c", 3_100, true); // acked in the same millisecond it arrived
    h.produced_maybe("d", 500); // unknown outcome, never delivered: fine
    h.produced_maybe("e", 500); // unknown outcome, delivered: fine
    h.delivered("e", 600);
    h.produced("f", 700, false); // refused, then retried with success
    h.produced("f", 800, true);
    h.delivered("f", 800);
    h.acked("f", 900, false); // a failed ack ends nothing
    h.delivered("f", 950);
    let r = h.check();
    r.assert_ok();
    assert_eq!(r.acked_produces, 4);
    assert_eq!(r.maybe_produces, 2);
    assert_eq!(r.deliveries, 6);
    assert_eq!(r.duplicates, 2, "{}", r.counts());
    assert_eq!((r.acked, r.cancelled), (2, 1));
}

/// The violations of a history, which must all mention `want`.
fn violations(h: &History, want: &str) -> Vec<String> {
    let v = h.check().violations;
    assert!(!v.is_empty(), "no violation found, wanted {want}");
    assert!(v.iter().all(|s| s.contains(want)), "{v:?} is not all {want}");
    v
}

#[test]
fn a_lost_acknowledged_produce_is_caught() {
    let h = History::new();
    h.produced("kept", 100, true);
    h.delivered("kept", 100);
    h.produced("gone", 100, true);
    h.cancelled("gone", 50, false); // a failed cancel does not excuse it
    assert_eq!(violations(&h, "lost").len(), 1);
}

#[test]
fn an_early_delivery_is_caught_by_the_earliest_possible_due_time() {
    let h = History::new();
    h.produced("x", 1_000, true);
    h.delivered("x", 999);
    assert!(violations(&h, "early")[0].contains("1 ms before"));
    // A retry answered as an identical repeat: the first (unknown) attempt's due time counts.
    let h = History::new();
    h.produced_maybe("y", 1_000);
    h.produced("y", 1_200, true);
    h.delivered("y", 1_100);
    h.check().assert_ok();
    // A refused attempt stored nothing, so its due time does not count.
    let h = History::new();
    h.produced("z", 1_000, false);
    h.produced("z", 1_200, true);
    h.delivered("z", 1_100);
    violations(&h, "early");
}

#[test]
fn a_delivery_after_an_ack_or_a_cancel_is_caught_but_one_in_flight_is_not() {
    let h = History::new();
    h.produced("a", 0, true);
    h.delivered("a", 10);
    h.acked("a", 20, true);
    h.delivered("a", 19); // received before the ack was sent: in flight
    h.delivered("a", 21);
    let v = violations(&h, "resurrected");
    assert!(v[0].contains("at 21 after it was acked"), "{v:?}");
    let h = History::new();
    h.produced("c", 0, true);
    h.cancelled("c", 5, true);
    h.delivered("c", 6);
    assert!(violations(&h, "resurrected")[0].contains("cancelled"));
}

#[test]
fn a_delivery_of_a_message_never_stored_is_caught() {
    let h = History::new();
    h.delivered("never", 5);
    assert!(violations(&h, "phantom")[0].contains("never produced"));
    let h = History::new();
    h.produced("refused", 0, false);
    h.delivered("refused", 5);
    assert!(violations(&h, "phantom")[0].contains("refused"));
}

#[test]
#[should_panic(expected = "lost: m was produced with a 2xx")]
fn assert_ok_panics_listing_the_violations() {
    let h = History::new();
    h.produced("m", 0, true);
    h.check().assert_ok();
}

#[test]
fn the_history_takes_events_from_many_threads() {
    let h = Arc::new(History::new());
    std::thread::scope(|s| {
        for t in 0..4 {
            let h = Arc::clone(&h);
            s.spawn(move || {
                for i in 0..100 {
                    let id = format!("{t}-{i}");
                    h.produced(&id, 10, true);
                    h.delivered(&id, 11);
                }
            });
        }
    });
    let r = h.check();
    r.assert_ok();
    assert_eq!((r.acked_produces, r.deliveries, r.duplicates), (400, 400, 0));
}
