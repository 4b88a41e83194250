//! Push delivery to NATS JetStream, against the real binary and a real `nats-server -js`.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{now_ms, Server};
use serde_json::{json, Value};

/// A `nats-server -js` on a fixed loopback port and store directory, so it can be restarted.
struct Nats {
    child: Option<Child>,
    port: u16,
    store: PathBuf,
}

impl Nats {
    fn binary() -> Option<PathBuf> {
        ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
    }

    fn start(store: &Path) -> Nats {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut n = Nats { child: None, port, store: store.to_path_buf() };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        let child = Command::new(Nats::binary().expect("nats-server"))
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The tests are ignored unless asked for; asked for, a missing nats-server is a failure.
fn nats_available() -> bool {
    assert!(Nats::binary().is_some(), "nats-server is not installed (apt-get install nats-server)");
    true
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Makes the stream `DUE` over `orders.due`, with JetStream's duplicate window.
fn create_stream(url: &str) {
    create_stream_as(url, "DUE", "orders.due", async_nats::jetstream::stream::StorageType::File);
}

/// Makes the stream `name` over `subject`, kept in `storage`, with one replica.
fn create_stream_as(
    url: &str,
    name: &str,
    subject: &str,
    storage: async_nats::jetstream::stream::StorageType,
) {
    runtime().block_on(async {
        // A nats-server that just began listening may still reset the first connections.
        let deadline = Instant::now() + Duration::from_secs(20);
        let client = loop {
            match async_nats::connect(url).await {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("connecting to nats-server, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot connect to nats-server at {url}: {e}"),
            }
        };
        let js = async_nats::jetstream::new(client);
        js.get_or_create_stream(async_nats::jetstream::stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            duplicate_window: Duration::from_secs(120),
            storage,
            ..Default::default()
        })
        .await
        .unwrap();
    });
}

/// One message of the stream: its Nats-Msg-Id, its headers as pairs, its payload.
type StreamMessage = (String, Vec<(String, String)>, Vec<u8>);

/// Every message in stream `DUE`.
fn stream_messages(url: &str) -> Vec<StreamMessage> {
    runtime().block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        let mut stream = js.get_stream("DUE").await.unwrap();
        let n = stream.info().await.unwrap().state.messages;
        let mut out = Vec::new();
        for seq in 1..=n {
            let Ok(m) = stream.get_raw_message(seq).await else { continue };
            let headers: Vec<(String, String)> = m
                .headers
                .iter()
                .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
                .collect();
            let id =
                headers.iter().find(|(k, _)| k == "Nats-Msg-Id").map(|(_, v)| v.clone()).unwrap_or_default();
            out.push((id, headers, m.payload.to_vec()));
        }
        out
    })
}

fn subscribe(s: &Server, nats: &Nats) {
    let r = s
        .http()
        .put(s.url("/v1/topics/due/push"))
        .json(&json!({"nats": {"url": nats.url(), "subject": "orders.due"}, "timeout_ms": 2000}))
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["nats"], json!({"url": nats.url(), "subject": "orders.due"}));
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs nats-server (apt-get install nats-server); .ci/run installs it and runs these"]
fn due_messages_land_in_jetstream_with_their_id_and_are_acked_after_the_publish_ack() {
    if !nats_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let nats = Nats::start(tmp.path());
    create_stream(&nats.url());
    let s = Server::start(&[]);
    subscribe(&s, &nats);
    let mut due = vec![];
    for i in 0..5 {
        let v = s.produce(
            "due",
            &json!({"id": format!("n{i}"), "body": format!("payload {i}"), "delay_ms": 200 * i}),
        );
        due.push(v["deliver_at_ms"].as_u64().unwrap());
    }
    eventually("five in the stream", || stream_messages(&nats.url()).len() >= 5);
    eventually("all done", || (0..5).all(|i| s.get(&format!("/v1/messages/n{i}")).1["state"] == "done"));
    let got = stream_messages(&nats.url());
    assert_eq!(got.len(), 5, "{got:?}");
    for (i, at) in due.iter().enumerate() {
        let (_, headers, body) = got.iter().find(|(id, _, _)| *id == format!("n{i}")).expect("published");
        assert_eq!(body, format!("payload {i}").as_bytes());
        let h = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!((h("Delayd-Topic"), h("Delayd-Attempt")), (Some("due"), Some("1")));
        assert_eq!(h("Delayd-Deliver-At"), Some(at.to_string().as_str()));
    }
    assert!(now_ms() >= *due.last().unwrap());
}

#[test]
#[ignore = "needs nats-server (apt-get install nats-server); .ci/run installs it and runs these"]
fn a_nats_restart_while_delivering_loses_nothing_and_duplicates_nothing() {
    if !nats_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut nats = Nats::start(tmp.path());
    create_stream(&nats.url());
    let s = Server::start(&[]);
    subscribe(&s, &nats);
    for i in 0..5 {
        s.produce("due", &json!({"id": format!("a{i}"), "body": "before", "backoff": [200]}));
    }
    eventually("the first five published", || stream_messages(&nats.url()).len() >= 5);
    nats.kill();
    for i in 0..5 {
        s.produce(
            "due",
            &json!({"id": format!("b{i}"), "body": "while down", "backoff": [200], "max_attempts": 1000}),
        );
    }
    // Deliveries fail while it is down (they time out and come back on the backoff).
    eventually("a failed attempt", || {
        s.get_text("/metrics")
            .1
            .lines()
            .any(|l| l.starts_with("delayd_push_attempts_total{outcome=\"failed\",topic=\"due\"}"))
    });
    // The subscription's health says so, with what went wrong.
    let health = s.get("/v1/topics/due/push").1;
    assert!(health["consecutive_failures"].as_u64() >= Some(1), "{health}");
    assert!(health["failed_1m"].as_u64() >= Some(1), "{health}");
    let why = health["last_error"]["message"].as_str().unwrap_or_default();
    assert!(why.starts_with("timeout") || why.starts_with("JetStream refused"), "{health}");
    nats.spawn();
    eventually("all ten done", || {
        (0..5).all(|i| {
            s.get(&format!("/v1/messages/a{i}")).1["state"] == "done"
                && s.get(&format!("/v1/messages/b{i}")).1["state"] == "done"
        })
    });
    let health = s.get("/v1/topics/due/push").1;
    assert_eq!(health["consecutive_failures"], 0, "{health}");
    assert!(health["last_success_ms"].as_u64() >= health["last_error"]["time_ms"].as_u64(), "{health}");
    let log = s.log();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    // Deliveries under way when the server came back may fail after the first success: a few
    // streaks at most, never a line per attempt.
    assert!((1..=3).contains(&lines("push deliveries started failing")), "{log}");
    assert!(lines("push deliveries recovered") >= 1, "{log}");
    let got = stream_messages(&nats.url());
    let mut ids: Vec<&str> = got.iter().map(|(id, _, _)| id.as_str()).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "b3", "b4"],
        "each exactly once in the stream"
    );
}

fn put_push(s: &Server, topic: &str, body: Value) -> (u16, Value) {
    let r = s.http().put(s.url(&format!("/v1/topics/{topic}/push"))).json(&body).send().unwrap();
    (r.status().as_u16(), r.json().unwrap())
}

#[test]
#[ignore = "needs nats-server (apt-get install nats-server); .ci/run installs it and runs these"]
fn a_memory_stream_is_refused_and_a_file_stream_with_one_replica_is_accepted_with_a_warning() {
    use async_nats::jetstream::stream::StorageType;
    if !nats_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let nats = Nats::start(tmp.path());
    create_stream_as(&nats.url(), "VOLATILE", "mem.due", StorageType::Memory);
    create_stream_as(&nats.url(), "DISK", "disk.due", StorageType::File);
    let s = Server::start(&[]);

    let (st, v) = put_push(&s, "m", json!({"nats": {"url": nats.url(), "subject": "mem.due"}}));
    Server::assert_error(st, &v, 400, "invalid_argument");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("VOLATILE") && msg.contains("memory"), "{v}");
    assert_eq!(s.get("/v1/topics/m/push").0, 404, "a refused subscription is not stored");

    let (st, v) = put_push(&s, "f", json!({"nats": {"url": nats.url(), "subject": "disk.due"}}));
    assert_eq!(st, 200, "{v}");
    let warnings = v["warnings"].as_array().expect("warnings").clone();
    assert_eq!(warnings.len(), 1, "{v}");
    let w = warnings[0].as_str().unwrap();
    assert!(w.contains("DISK") && w.contains("1 replica") && w.contains("sync_interval"), "{w}");
    let log = s.log();
    assert!(
        log.lines().any(|l| l.contains("WARN") && l.contains("1 replica") && l.contains("DISK")),
        "{log}"
    );
    // Nothing in the way of delivery to the file stream.
    s.produce("f", &json!({"id": "f1", "body": "x"}));
    eventually("f1 done", || s.get("/v1/messages/f1").1["state"] == "done");

    // A server that cannot be reached: accepted, with a warning that says so.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (st, v) = put_push(
        &s,
        "later",
        json!({"nats": {"url": format!("nats://127.0.0.1:{closed}"), "subject": "x.y"}}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(v["warnings"][0].as_str().unwrap().contains("cannot read the stream"), "{v}");
}

#[test]
#[ignore = "needs nats-server (apt-get install nats-server); .ci/run installs it and runs these"]
fn a_stream_turned_to_memory_after_the_subscription_gets_no_deliveries() {
    use async_nats::jetstream::stream::StorageType;
    if !nats_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let nats = Nats::start(tmp.path());
    let s = Server::start(&[]);
    // No stream yet: accepted with a warning; then the stream appears, in memory.
    let (st, v) = put_push(&s, "late", json!({"nats": {"url": nats.url(), "subject": "late.due"}}));
    assert_eq!(st, 200, "{v}");
    assert!(v["warnings"][0].as_str().unwrap().contains("no JetStream stream captures"), "{v}");
    create_stream_as(&nats.url(), "LATE", "late.due", StorageType::Memory);
    s.produce("late", &json!({"id": "l1", "body": "x"}));
    eventually("the refusal logged", || s.log().contains("not delivering") && s.log().contains("LATE"));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(s.get("/v1/messages/l1").1["state"], "ready", "delivered to a memory stream");
}

/// Two nats-servers clustered on loopback; the second advertises itself to clients as
/// `localhost`, a host push_allowed_hosts does not list.
#[test]
#[ignore = "needs nats-server (apt-get install nats-server); .ci/run installs it and runs these"]
fn servers_a_nats_cluster_advertises_are_never_connected_to() {
    if !nats_available() {
        return;
    }
    let free = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (a_port, a_route, b_port, b_route, b_http) = (free(), free(), free(), free(), free());
    let start = |args: Vec<String>| Stopped {
        child: Command::new(Nats::binary().unwrap())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server"),
    };
    let a = start(
        [
            "-a",
            "127.0.0.1",
            "-p",
            &a_port.to_string(),
            "--cluster_name",
            "c",
            "--cluster",
            &format!("nats://127.0.0.1:{a_route}"),
            "--routes",
            &format!("nats://127.0.0.1:{b_route}"),
        ]
        .map(String::from)
        .to_vec(),
    );
    let _b = start(
        [
            "-a",
            "127.0.0.1",
            "-p",
            &b_port.to_string(),
            "-m",
            &b_http.to_string(),
            "--cluster_name",
            "c",
            "--cluster",
            &format!("nats://127.0.0.1:{b_route}"),
            "--routes",
            &format!("nats://127.0.0.1:{a_route}"),
            "--client_advertise",
            &format!("localhost:{b_port}"),
        ]
        .map(String::from)
        .to_vec(),
    );
    let connz = || -> u64 {
        let v: Value = common::client()
            .get(format!("http://127.0.0.1:{b_http}/connz"))
            .send()
            .and_then(|r| r.json())
            .unwrap_or_default();
        v["total"].as_u64().unwrap_or(u64::MAX)
    };
    eventually("b's monitoring answers", || connz() != u64::MAX);
    // A client of a sees b among the servers a advertises once the route is up.
    let a_url = format!("nats://127.0.0.1:{a_port}");
    eventually("the cluster formed", || {
        runtime().block_on(async {
            match async_nats::connect(&a_url).await {
                Ok(nc) => nc.server_info().connect_urls.iter().any(|u| u.contains("localhost")),
                Err(_) => false,
            }
        })
    });
    let s = Server::start(&[("DELAYD_PUSH_ALLOWED_HOSTS", "127.0.0.1")]);
    let (st, v) = put_push(&s, "c", json!({"nats": {"url": a_url, "subject": "c.due"}}));
    assert_eq!(st, 200, "{v}");
    s.produce("c", &json!({"id": "c1", "body": "x"}));
    std::thread::sleep(Duration::from_secs(2));
    // a goes away: a client that took up the servers a advertised reconnects to b.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(6);
    while Instant::now() < deadline {
        assert_eq!(connz(), 0, "delayd connected to a server push_allowed_hosts does not list");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A child process killed when dropped, also when the test fails.
struct Stopped {
    child: Child,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
