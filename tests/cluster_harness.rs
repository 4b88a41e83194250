//! Tests of the cluster test harness itself: the link proxy's modes, the history checker, the
//! leader-following client against scripted nodes, the process controls, and one real
//! three-node cluster.

mod common;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::checker::History;
use common::cluster::{agreed_leader, short_client, Cluster, ClusterClient};
use common::proxy::{LinkProxy, Mode};
use serde_json::{json, Value};

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
    // A cancel with no answer may have been applied: never delivered is then no loss.
    h.cancelled_maybe("gone");
    h.check().assert_ok();
    // But it does not excuse a delivery after a cancel that did succeed.
    h.produced("both", 0, true);
    h.cancelled_maybe("both");
    h.cancelled("both", 10, true);
    h.delivered("both", 20);
    violations(&h, "resurrected");
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

// ---- leader agreement and the client, against scripted nodes ----

#[test]
fn a_leader_needs_a_majority_of_all_nodes_naming_it() {
    let view = |id: u64, role: &str, leader: Option<u64>| {
        Some(json!({"node_id": id, "role": role, "leader_id": leader}))
    };
    let agreed = [view(1, "follower", Some(2)), view(2, "leader", Some(2)), view(3, "follower", Some(2))];
    assert_eq!(agreed_leader(&agreed, 3), Some(2));
    // An old leader cut off from the others still says so; the majority names the new one.
    let stale = [view(1, "leader", Some(1)), view(2, "leader", Some(2)), view(3, "follower", Some(2))];
    assert_eq!(agreed_leader(&stale, 3), Some(2));
    // Two of three down: the survivor's word alone is no leader.
    let alone = [view(1, "leader", Some(1)), None, None];
    assert_eq!(agreed_leader(&alone, 3), None);
    let one_down = [None, view(2, "leader", Some(2)), view(3, "follower", Some(2))];
    assert_eq!(agreed_leader(&one_down, 3), Some(2));
    let no_leader = [view(1, "candidate", None), view(2, "follower", None), view(3, "follower", None)];
    assert_eq!(agreed_leader(&no_leader, 3), None);
    // Named by a majority but not (or no longer) leader by its own answer.
    let stepped_down =
        [view(1, "follower", Some(2)), view(2, "follower", Some(2)), view(3, "follower", Some(2))];
    assert_eq!(agreed_leader(&stepped_down, 3), None);
}

/// A request as a scripted node saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

type Script = Box<dyn Fn(usize) -> String + Send>;

/// A one-request-per-connection HTTP node whose answers come from a script given the number of
/// the request (0-based); it keeps every request it got.
struct FakeNode {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl FakeNode {
    fn start(script: Script) -> FakeNode {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake node");
        let addr = listener.local_addr().expect("address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        // The thread ends with the test process; each test's nodes are few.
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(conn) = conn else { continue };
                if let Some(req) = read_request(&conn) {
                    log.lock().expect("seen lock").push(req);
                    let _ = (&conn).write_all(script(n).as_bytes());
                }
            }
        });
        FakeNode { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen lock").clone()
    }
}

fn read_request(conn: &TcpStream) -> Option<Seen> {
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let Some((k, v)) = h.trim_end().split_once(':') else { break };
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let len =
        headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some(Seen { method, path, headers, body: String::from_utf8_lossy(&body).into() })
}

fn http_answer(status: &str, extra: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn the_client_follows_a_redirect_with_the_same_method_body_and_headers() {
    let leader =
        FakeNode::start(Box::new(|_| http_answer("201 Created", "", r#"{"id":"m1","deliver_at_ms":5}"#)));
    let location = format!("{}/v1/topics/t/messages?x=1", leader.url());
    let follower = FakeNode::start(Box::new(move |_| {
        http_answer("307 Temporary Redirect", &format!("location: {location}\r\n"), "")
    }));
    let c =
        ClusterClient::with_urls(vec![follower.url(), leader.url()]).with_header("authorization", "Bearer t");
    let body = json!({"id": "m1", "body": "hello", "delay_ms": 5});
    let r = c.request("POST", "/v1/topics/t/messages?x=1", Some(&body), 0).expect("answered");
    assert_eq!((r.status, r.redirects), (201, 1), "{r:?}");
    assert_eq!(r.node, leader.url());
    assert_eq!(r.body["id"], "m1");
    let (f, l) = (&follower.seen()[0], &leader.seen()[0]);
    assert_eq!((l.method.as_str(), l.path.as_str()), ("POST", "/v1/topics/t/messages?x=1"));
    assert_eq!(l.body, f.body);
    assert_eq!(serde_json::from_str::<Value>(&l.body).expect("json"), body);
    for h in ["authorization", "content-type"] {
        let value = |s: &Seen| s.headers.iter().find(|(k, _)| k == h).map(|(_, v)| v.clone());
        assert_eq!(value(l), value(f), "header {h}");
        assert!(value(l).is_some(), "header {h} missing");
    }
    // The next call starts at the node that answered.
    c.get("m1").expect("answered");
    assert_eq!(follower.seen().len(), 1);
    assert_eq!(leader.seen()[1].path, "/v1/messages/m1");
}

#[test]
fn the_client_retries_no_leader_after_retry_after_and_skips_dead_nodes() {
    let no_leader = r#"{"error":{"code":"no_leader","message":"no leader yet"}}"#;
    let node = FakeNode::start(Box::new(move |n| match n {
        0 => http_answer("503 Service Unavailable", "retry-after: 1\r\n", no_leader),
        _ => http_answer("200 OK", "", r#"{"messages":[]}"#),
    }));
    // A node whose port refuses connections comes first: the client moves on.
    let dead =
        format!("http://{}", TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr"));
    let c = ClusterClient::with_urls(vec![dead, node.url()]);
    let t0 = Instant::now();
    let r = c.pop("t", 1, 0, None).expect("answered");
    assert_eq!(r.status, 200, "{r:?}");
    assert!(t0.elapsed() >= Duration::from_secs(1), "retried before Retry-After: {:?}", t0.elapsed());
    assert_eq!(node.seen().len(), 2);
    // At the deadline the 503 itself is the answer.
    let always = FakeNode::start(Box::new(move |_| {
        http_answer("503 Service Unavailable", "retry-after: 1\r\n", no_leader)
    }));
    let c = ClusterClient::with_urls(vec![always.url()]).with_deadline(Duration::from_millis(1500));
    let t0 = Instant::now();
    let r = c.ack("receipt").expect("answered");
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (503, Some("no_leader")));
    // Tries at 0 s, after the one-second Retry-After, and once more at the deadline.
    assert_eq!(always.seen().len(), 3);
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_millis(2500), "{took:?}");
}

#[test]
fn the_client_gives_up_on_a_redirect_loop_but_not_on_redirects_to_a_dead_leader() {
    let looping =
        FakeNode::start(Box::new(|_| http_answer("307 Temporary Redirect", "location: /v1/ack\r\n", "")));
    let r = ClusterClient::with_urls(vec![looping.url()]).ack("receipt").expect("answered");
    assert_eq!((r.status, r.redirects), (307, 10), "{r:?}");
    assert_eq!(looping.seen().len(), 11);
    // A follower that still names a killed leader (an election under way): each round trip to
    // the dead address is one redirect, and a dozen of them are no loop.
    let dead =
        format!("http://{}", TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr"));
    let location = format!("location: {dead}/v1/ack\r\n");
    let follower = FakeNode::start(Box::new(move |n| match n {
        0..12 => http_answer("307 Temporary Redirect", &location, ""),
        _ => http_answer("200 OK", "", "{}"),
    }));
    let r = ClusterClient::with_urls(vec![follower.url()]).ack("receipt").expect("answered");
    assert_eq!((r.status, r.redirects), (200, 12), "{r:?}");
}

#[test]
fn the_client_reports_an_unknown_outcome_when_a_node_does_not_answer() {
    // Accepts and reads, never answers: the request may have been applied.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", silent.local_addr().expect("addr"));
    let c = ClusterClient::with_urls(vec![url]).with_timeout(Duration::from_millis(300));
    let err = c.produce("t", &json!({"body": "x"})).expect_err("no answer is no outcome");
    assert!(err.contains("POST"), "{err}");
}

// ---- the processes (today's binary, whether or not it is a cluster yet) ----

/// The environment node `pid` was started with.
fn environ(pid: u32) -> Vec<(String, String)> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("read environ");
    raw.split(|b| *b == 0)
        .filter_map(|kv| {
            String::from_utf8_lossy(kv).split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

fn env_of(pid: u32, key: &str) -> String {
    environ(pid).into_iter().find(|(k, _)| k == key).map(|(_, v)| v).unwrap_or_default()
}

#[test]
fn every_node_reaches_every_other_through_its_own_link() {
    let c = Cluster::start_with(3, &[("DELAYD_FLUSH", "async")], |i| {
        vec![("HARNESS_NODE_MARK".into(), format!("n{i}"))]
    });
    let secret = env_of(c.pid(1), "DELAYD_CLUSTER_SECRET");
    assert!(secret.len() >= 16, "secret {secret:?}");
    for i in 1..=3 {
        let pid = c.pid(i);
        assert_eq!(env_of(pid, "DELAYD_NODE_ID"), i.to_string());
        assert_eq!(env_of(pid, "DELAYD_CLUSTER_LISTEN"), c.cluster_addr(i).to_string());
        assert_eq!(env_of(pid, "DELAYD_CLUSTER_SECRET"), secret);
        assert_eq!(env_of(pid, "DELAYD_FLUSH"), "async");
        assert_eq!(env_of(pid, "HARNESS_NODE_MARK"), format!("n{i}"));
        let want: Vec<String> = (1..=3)
            .map(|j| {
                let addr = if j == i { c.cluster_addr(i) } else { c.link(i, j).addr() };
                format!("{j}={addr}")
            })
            .collect();
        assert_eq!(env_of(pid, "DELAYD_PEERS"), want.join(","));
        for j in (1..=3).filter(|&j| j != i) {
            assert_eq!(c.link(i, j).target(), c.cluster_addr(j), "link {i} -> {j}");
        }
    }
    let mut ports: Vec<u16> = (1..=3).map(|i| c.cluster_addr(i).port()).collect();
    ports.dedup();
    assert_eq!(ports.len(), 3, "cluster ports repeat");
    c.isolate(2);
    for (i, j) in [(1, 2), (2, 1), (3, 2), (2, 3)] {
        assert_eq!(c.link(i, j).mode(), Mode::Cut, "{i} -> {j}");
    }
    assert_eq!(c.link(1, 3).mode(), Mode::Pass);
    c.heal();
    assert_eq!(c.link(2, 3).mode(), Mode::Pass);
}

#[test]
fn kill_stop_continue_restart_and_terminate_drive_the_processes() {
    let mut c = Cluster::start(2, &[]);
    let client = c.client();
    let produced = client.produce("t", &json!({"id": "keep", "body": "x", "delay_ms": 0})).expect("answered");
    assert!(produced.ok(), "{produced:?}");
    let target = produced.node.clone();
    let i = (1..=2).find(|&i| c.url(i) == target).expect("answered by a node");
    let probe = short_client(Duration::from_millis(300));
    let healthz = |url: &str| probe.get(format!("{url}/healthz")).send().map(|r| r.status().as_u16());
    c.stop(i);
    assert!(healthz(&c.url(i)).is_err(), "a stopped node answered");
    let t0 = Instant::now();
    assert!(c.views()[i - 1].is_none(), "a stopped node gave its view");
    assert!(t0.elapsed() < Duration::from_secs(2), "asking a stopped node took {:?}", t0.elapsed());
    c.cont(i);
    assert_eq!(healthz(&c.url(i)).ok(), Some(200), "a continued node does not answer");
    let old = c.url(i);
    c.kill9(i);
    assert!(!c.is_running(i));
    assert!(healthz(&old).is_err(), "a killed node answered");
    c.restart(i);
    assert!(c.is_running(i));
    let got = client.get("keep").expect("answered");
    assert_eq!((got.status, got.body["id"].as_str()), (200, Some("keep")), "{got:?}");
    c.terminate(i);
    assert!(!c.is_running(i));
    let j = 3 - i;
    assert_eq!(healthz(&c.url(j)).ok(), Some(200), "the other node is untouched");
}

/// Seconds since midnight UTC in an HTTP `Date` header ("Thu, 26 Nov 2026 12:21:21 GMT").
fn date_header_seconds(date: &str) -> i64 {
    let hms = date.split_whitespace().nth(4).unwrap_or_else(|| panic!("odd Date header {date:?}"));
    hms.split(':').map(|p| p.parse::<i64>().expect("Date header time")).fold(0, |acc, p| acc * 60 + p)
}

#[test]
fn add_node_links_a_new_node_both_ways_and_no_leader_is_found_among_the_dead() {
    let mut c = Cluster::start(2, &[]);
    let n = c.add_node();
    assert_eq!((n, c.size()), (3, 3));
    let want: Vec<String> = vec![
        format!("1={}", c.link(3, 1).addr()),
        format!("2={}", c.link(3, 2).addr()),
        format!("3={}", c.cluster_addr(3)),
    ];
    assert_eq!(env_of(c.pid(3), "DELAYD_PEERS"), want.join(","));
    assert_eq!(env_of(c.pid(3), "DELAYD_NODE_ID"), "3");
    for j in 1..=2 {
        assert_eq!(c.link(j, 3).target(), c.cluster_addr(3), "link {j} -> 3");
        assert_eq!(c.link(3, j).target(), c.cluster_addr(j), "link 3 -> {j}");
    }
    for i in 1..=3 {
        c.kill9(i);
    }
    assert_eq!(c.leader(Duration::from_millis(200)), None);
    let told = c.describe();
    assert_eq!(told.matches("(not running) /v1/cluster: no answer").count(), 3, "{told}");
    assert!(told.contains("delayd"), "the log tails are missing: {told}");
}

#[test]
#[ignore = "needs libfaketime (apt-get install libfaketime); run with --ignored"]
fn a_node_can_run_with_its_clock_ahead() {
    use common::cluster::clock_offset_env;
    // An hour, so the whole-second Date header shows it; any node, leader or not, sends one.
    let c = Cluster::start_with(2, &[], |i| if i == 2 { clock_offset_env(3_600_000) } else { Vec::new() });
    let probe = short_client(Duration::from_secs(5));
    for (i, ahead) in [(1, 0), (2, 3_600)] {
        let r = probe.get(format!("{}/healthz", c.url(i))).send().expect("healthz");
        let date = r.headers().get("date").and_then(|v| v.to_str().ok()).expect("Date header").to_string();
        let ours = (common::now_ms() / 1000 % 86_400) as i64;
        let offset = (date_header_seconds(&date) - ours).rem_euclid(86_400);
        let off_by = (offset - ahead).abs().min(86_400 - (offset - ahead).abs());
        assert!(off_by <= 5, "node {i}: Date {date} is {offset} s from our clock, wanted {ahead}");
    }
}

// ---- a real cluster ----

#[test]
fn three_nodes_elect_a_leader_and_redirect_writes() {
    let c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(10));
    let follower = (1..=3).find(|&i| i != leader).expect("a follower");
    let raw = short_client(Duration::from_secs(5));
    let path = "/v1/topics/redirected/messages";
    let r = raw
        .post(format!("{}{path}", c.url(follower)))
        .json(&json!({"body": "x", "delay_ms": 0}))
        .send()
        .expect("follower answers");
    assert_eq!(r.status().as_u16(), 307, "a follower's answer to a write");
    let location = r.headers().get("location").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(location.starts_with(&c.url(leader)), "Location {location:?}, leader {}", c.url(leader));
    assert!(location.ends_with(path), "Location {location:?} lost the path");
    let produced = c.client().produce("redirected", &json!({"body": "x", "delay_ms": 0})).expect("answered");
    assert_eq!(produced.status, 201, "{produced:?}\n{}", c.describe());
    for i in 1..=3 {
        let (status, v) = c.node(i).get("/v1/cluster");
        assert_eq!(status, 200, "node {i}: {v}");
        assert_eq!(v["nodes"].as_array().map(Vec::len), Some(3), "node {i}: {v}");
        assert_eq!(v["leader_id"].as_u64(), Some(leader as u64), "node {i}: {v}");
    }
}
