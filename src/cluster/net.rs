//! Node-to-node links: each node opens its own TCP connection to every other node's cluster
//! address and sends its messages there, one way; answers come back on the other node's own
//! connection. A link proves the cluster's secret before a byte of it is read as a message, and
//! reconnects by itself.
//!
//! Wire format, all integers little-endian:
//! - the accepting side first sends a 16-byte random challenge;
//! - the connecting side answers with a hello: `from u64, to u64, url_len u16, url (its client
//!   API URL), mac [32]` where `mac` is HMAC-SHA256 under the cluster secret of
//!   `"delayd-cluster-v1" || challenge || from || to || url`;
//! - then frames: `len u32` (of what follows), `kind u8`, payload. Kind 1 is a Raft message
//!   (raft-rs's protobuf encoding); kinds 2 and 3 were clock probes stamped in milliseconds and
//!   are ignored now; kind 8 a clock probe (`t0 i64` the sender's wall clock, unix µs, `mono u64`
//!   its monotonic µs); kind 9 the answer to one, on the answering node's own link (`t0`, `mono`
//!   echoed, `t1 i64` and `t2 i64` its wall clock, unix µs, when the probe arrived and when the
//!   answer left); kind 4 asks the accepting node for a commit-log segment's bytes (`base
//!   u64, len u64`: a snapshot being installed, see `recover`), which it answers on the same
//!   connection with `n u64` and `n` bytes (`n` = u64::MAX: no such segment); kind 5 (`index u64`)
//!   says a snapshot's segments were all received; kind 6 (empty) tells a node the leader has
//!   removed it from the cluster; kind 7, from the leader after each durable checkpoint, says how
//!   far its readers had passed its queues (`index u64, term u64, dispatched u64`, `n u32` level
//!   queues each `level_ms u64, offset u64`, `m u32` topic queues each `name_len u16, name,
//!   offset u64`: see `storage::replica::Passed`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use protobuf::Message as _;
use raft::prelude::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::clock::Sample;
use super::shared::Event;
use super::{ClusterConfig, ClusterState, Stamps};
use crate::error::{Error, Result};
use crate::storage::replica::Passed;

/// Largest frame accepted (a Raft message carries at most about 1 MiB of entries, plus one
/// entry that may be as large as a record).
const MAX_FRAME: usize = 80 << 20;
/// Frames queued for one peer before new ones are dropped (Raft resends what is lost).
const QUEUE: usize = 4096;
/// Kind byte of a Raft message frame.
const KIND_RAFT: u8 = 1;
/// Kind byte of a clock probe (stamps in µs: millisecond stamps, kinds 2 and 3, made every
/// estimate's error bound 3 ms wider, and a leader fires later by that much).
const KIND_PROBE: u8 = 8;
/// Kind byte of a clock probe's answer.
const KIND_PROBE_ANSWER: u8 = 9;
/// Kind byte of a request for a segment's bytes.
const KIND_FETCH: u8 = 4;
/// Kind byte of "all of a snapshot's segments arrived".
const KIND_FETCHED: u8 = 5;
/// Kind byte of "you are no longer a member" (sent by the leader to a node it removed).
const KIND_REMOVED: u8 = 6;
/// Bytes sent or received at a time while a segment is copied.
/// Frame kind: how far the leader's readers had passed its queues.
const KIND_PASSED: u8 = 7;
const CHUNK: usize = 1 << 20;
/// A link reader's buffer.
const READ_BUFFER: usize = 64 << 10;
/// Label of the hello's MAC.
const LABEL: &[u8] = b"delayd-cluster-v1";

/// Where a link's reader hands what arrives: the driver steps it on the reader's thread when the
/// flag is set, and only queues the event when it is not (more frames are already here: they are
/// stepped together, so their entries are appended and synced as one batch).
pub type Inbound = Arc<dyn Fn(Event, bool) + Send + Sync>;

/// The links to the other nodes, by node id.
type Peers = Arc<std::sync::RwLock<HashMap<u64, PeerLink>>>;

/// One outgoing link as its senders see it. A frame is written straight to the connection by
/// the thread that sends it when nothing is queued before it (the common case: a hand-off to the
/// link's task and its wake-up cost more than the write), and queued for the task otherwise
/// (the connection is down, or its send buffer is full).
struct PeerLink {
    tx: mpsc::Sender<Vec<u8>>,
    out: Arc<Mutex<Outbox>>,
}

/// What decides, under one lock, whether a frame may be written directly.
#[derive(Default)]
struct Outbox {
    /// The connection's write half while the link is up.
    writer: Option<Arc<OwnedWriteHalf>>,
    /// Frames (or the rest of one) in the queue or being written by the link's task: a frame
    /// is written directly only when this is zero, so frames never interleave or reorder.
    queued: usize,
}

fn lock_out(out: &Mutex<Outbox>) -> std::sync::MutexGuard<'_, Outbox> {
    out.lock().unwrap_or_else(|p| p.into_inner())
}

impl PeerLink {
    /// Writes `frame` now if nothing waits before it and the connection takes it whole; queues
    /// what is left otherwise (dropped when the queue is full: Raft resends).
    fn send(&self, frame: Vec<u8>) {
        let mut out = lock_out(&self.out);
        let mut rest = frame.as_slice();
        if out.queued == 0 {
            if let Some(w) = out.writer.as_ref() {
                match w.try_write(rest) {
                    Ok(n) if n == rest.len() => return,
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    // The link's task notices the broken connection on its read side.
                    Err(_) => return,
                }
            }
        }
        let queued = if rest.len() == frame.len() { frame } else { rest.to_vec() };
        if self.tx.try_send(queued).is_ok() {
            out.queued += 1;
        }
    }
}

/// The sending half: a queue per peer, drained by its connection task. Peers come and go with
/// membership changes.
pub struct Net {
    peers: Peers,
    rt: tokio::runtime::Handle,
    me: u64,
    url: String,
    secret: Arc<[u8]>,
}

impl Net {
    /// Binds the cluster listener and starts one connection task per peer on `rt`.
    pub fn start(
        rt: &tokio::runtime::Handle,
        cfg: &ClusterConfig,
        state: Arc<ClusterState>,
        inbound: Inbound,
        stamps: Arc<Stamps>,
    ) -> Result<Net> {
        let data_dir = cfg.data_dir.clone();
        let std_listener = std::net::TcpListener::bind(&cfg.listen)
            .map_err(|e| Error::Config(format!("cluster_listen: cannot listen on {}: {e}", cfg.listen)))?;
        std_listener.set_nonblocking(true).map_err(|e| Error::io("cluster listener", e))?;
        let secret: Arc<[u8]> = cfg.secret.as_bytes().into();
        let me = cfg.node_id;
        let peers: Peers = Arc::default();
        {
            let ctx = Arc::new(Serve {
                me,
                secret: secret.clone(),
                state,
                inbound,
                stamps,
                peers: peers.clone(),
                data_dir,
            });
            let _guard = rt.enter();
            let listener =
                TcpListener::from_std(std_listener).map_err(|e| Error::io("cluster listener", e))?;
            rt.spawn(accept_loop(listener, ctx));
        }
        let net = Net { peers, rt: rt.clone(), me, url: cfg.advertise_url.clone(), secret };
        for (id, addr) in cfg.others() {
            net.add_peer(*id, addr);
        }
        info!(listen = %cfg.listen, peers = cfg.others().count(), "cluster links started");
        Ok(net)
    }

    /// Starts the link to node `id` at `addr` (a member added), unless there is one.
    pub fn add_peer(&self, id: u64, addr: &str) {
        if id == self.me {
            return;
        }
        let mut peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
        if peers.contains_key(&id) {
            return;
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let out = Arc::new(Mutex::new(Outbox::default()));
        peers.insert(id, PeerLink { tx, out: out.clone() });
        let link = Link {
            out,
            me: self.me,
            to: id,
            addr: addr.to_string(),
            url: self.url.clone(),
            secret: self.secret.clone(),
        };
        self.rt.spawn(link.run(rx));
    }

    /// Stops the link to node `id` (a member removed): its task ends with its queue.
    pub fn remove_peer(&self, id: u64) {
        self.peers.write().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// Tells node `id` it was removed (it stops), then stops its link a moment later.
    pub fn farewell(&self, id: u64) {
        self.queue(id, frame(KIND_REMOVED, &[]));
        let peers = self.peers.clone();
        self.rt.spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            peers.write().unwrap_or_else(|p| p.into_inner()).remove(&id);
        });
    }

    /// Queues `m` for its destination; dropped when the link is backed up (Raft resends).
    pub fn send(&self, m: Message) {
        let to = m.to;
        match m.write_to_bytes() {
            Ok(body) => self.queue(to, frame(KIND_RAFT, &body)),
            Err(e) => warn!(error = %e, "cannot encode a raft message"),
        }
    }

    /// Sends a clock probe to `to`, stamped `t0` (wall) and `mono`.
    pub fn probe(&self, to: u64, t0: i64, mono: u64) {
        let mut p = Vec::with_capacity(16);
        p.extend_from_slice(&t0.to_le_bytes());
        p.extend_from_slice(&mono.to_le_bytes());
        self.queue(to, frame(KIND_PROBE, &p));
    }

    /// Sends the leader's queue positions to `to`.
    pub fn passed(&self, to: u64, p: &Passed) {
        self.queue(to, frame(KIND_PASSED, &encode_passed(p)));
    }

    fn queue(&self, to: u64, frame: Vec<u8>) {
        if let Some(link) = self.peers.read().unwrap_or_else(|p| p.into_inner()).get(&to) {
            link.send(frame);
        }
    }
}

/// A kind 7 frame's payload (see the module documentation).
fn encode_passed(p: &Passed) -> Vec<u8> {
    let mut b = Vec::with_capacity(36 + p.levels.len() * 16 + p.topics.len() * 40);
    for w in [p.index, p.term, p.dispatched] {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b.extend_from_slice(&(p.levels.len() as u32).to_le_bytes());
    for (ms, offset) in &p.levels {
        b.extend_from_slice(&ms.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
    }
    // Topic names are far shorter than u16::MAX bytes (`max_topic_len`); a longer one is left
    // out, and counts as passing nothing rather than read to its end.
    let topics: Vec<&(String, u64)> = p.topics.iter().filter(|(n, _)| n.len() <= u16::MAX as usize).collect();
    b.extend_from_slice(&(topics.len() as u32).to_le_bytes());
    for (name, offset) in topics {
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
    }
    b
}

/// Reads a kind 7 frame's payload; `None` when it is malformed.
fn decode_passed(mut b: &[u8]) -> Option<Passed> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = b.split_at_checked(n)?;
        *b = rest;
        Some(head)
    }
    fn word(b: &mut &[u8]) -> Option<u64> {
        take(b, 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes)
    }
    fn count(b: &mut &[u8]) -> Option<usize> {
        take(b, 4).and_then(|w| w.try_into().ok()).map(u32::from_le_bytes).map(|n| n as usize)
    }
    let mut p =
        Passed { index: word(&mut b)?, term: word(&mut b)?, dispatched: word(&mut b)?, ..Passed::default() };
    let n = count(&mut b)?;
    // Each level takes 16 bytes: a count larger than the frame can hold is malformed, not a
    // reason to reserve memory for it.
    if n > b.len() / 16 {
        return None;
    }
    for _ in 0..n {
        p.levels.push((word(&mut b)?, word(&mut b)?));
    }
    let m = count(&mut b)?;
    if m > b.len() / 10 {
        return None;
    }
    for _ in 0..m {
        let len = take(&mut b, 2).map(|l| u16::from_le_bytes([l[0], l[1]]) as usize)?;
        let name = String::from_utf8(take(&mut b, len)?.to_vec()).ok()?;
        p.topics.push((name, word(&mut b)?));
    }
    b.is_empty().then_some(p)
}

fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + body.len());
    f.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(body);
    f
}

/// What the accepting side needs for every link it serves.
struct Serve {
    me: u64,
    secret: Arc<[u8]>,
    state: Arc<ClusterState>,
    inbound: Inbound,
    stamps: Arc<Stamps>,
    peers: Peers,
    /// The data directory, whose segments a node installing a snapshot fetches.
    data_dir: std::path::PathBuf,
}

fn mac(secret: &[u8], challenge: &[u8; 16], from: u64, to: u64, url: &[u8]) -> [u8; 32] {
    let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    m.update(LABEL);
    m.update(challenge);
    m.update(&from.to_le_bytes());
    m.update(&to.to_le_bytes());
    m.update(url);
    m.finalize().into_bytes().into()
}

fn challenge() -> [u8; 16] {
    let mut c = [0u8; 16];
    // The kernel's CSPRNG; a failure leaves a time-derived challenge, still unique per link.
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut c))
        .is_err()
    {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        c.copy_from_slice(&t.as_nanos().to_le_bytes());
    }
    c
}

/// One outgoing link: connects, proves the secret, then writes the queued frames.
struct Link {
    out: Arc<Mutex<Outbox>>,
    me: u64,
    to: u64,
    addr: String,
    url: String,
    secret: Arc<[u8]>,
}

impl Link {
    async fn run(self, mut rx: mpsc::Receiver<Vec<u8>>) {
        let mut backoff = Duration::from_millis(50);
        let mut warned = false;
        loop {
            match self.connect().await {
                Ok(stream) => {
                    backoff = Duration::from_millis(50);
                    if warned {
                        info!(peer = self.to, addr = %self.addr, "cluster link up");
                        warned = false;
                    }
                    if !self.pump(stream, &mut rx).await {
                        return;
                    }
                    lock_out(&self.out).writer = None;
                    debug!(peer = self.to, "cluster link closed; reconnecting");
                }
                Err(e) => {
                    if !warned {
                        warn!(peer = self.to, addr = %self.addr, error = %e, "cannot reach a cluster node; retrying");
                        warned = true;
                    }
                    debug!(peer = self.to, error = %e, "cluster connect failed");
                }
            }
            // Drop what queued meanwhile, so the queue never holds old messages.
            while rx.try_recv().is_ok() {}
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// Writes queued frames until the connection ends; false when the queue is closed (the
    /// node is stopping). The peer never writes on this link after its challenge, so the read
    /// side ending means the peer closed it (it died or restarted): noticed at once, instead of
    /// after the writes that a dead connection still accepts, whose messages (votes) are lost.
    async fn pump(&self, stream: TcpStream, rx: &mut mpsc::Receiver<Vec<u8>>) -> bool {
        let (mut reader, writer) = stream.into_split();
        let writer = Arc::new(writer);
        {
            // Frames queued while down are stale heartbeats and appends: Raft resends.
            let mut out = lock_out(&self.out);
            while rx.try_recv().is_ok() {}
            out.queued = 0;
            out.writer = Some(writer.clone());
        }
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                frame = rx.recv() => {
                    let Some(frame) = frame else { return false };
                    let written = write_whole(&writer, &frame).await;
                    lock_out(&self.out).queued -= 1;
                    if written.is_err() {
                        return true;
                    }
                }
                read = reader.read(&mut buf) => {
                    if matches!(read, Ok(0) | Err(_)) {
                        return true;
                    }
                }
            }
        }
    }

    async fn connect(&self) -> std::io::Result<TcpStream> {
        let mut s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&self.addr))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
        s.set_nodelay(true)?;
        let mut c = [0u8; 16];
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut c))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no challenge"))??;
        s.write_all(&hello(&self.secret, &c, self.me, self.to, &self.url)).await?;
        Ok(s)
    }
}

/// Writes all of `frame` to a write half that senders may also write to directly (see
/// [`PeerLink`]: they do not while this frame is counted as queued).
async fn write_whole(w: &OwnedWriteHalf, mut frame: &[u8]) -> std::io::Result<()> {
    while !frame.is_empty() {
        w.writable().await?;
        match w.try_write(frame) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => frame = &frame[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The connecting side's hello, proving the secret against the accepting side's challenge.
fn hello(secret: &[u8], challenge: &[u8; 16], from: u64, to: u64, url: &str) -> Vec<u8> {
    let url = url.as_bytes();
    let mut h = Vec::with_capacity(8 + 8 + 2 + url.len() + 32);
    h.extend_from_slice(&from.to_le_bytes());
    h.extend_from_slice(&to.to_le_bytes());
    h.extend_from_slice(&(url.len() as u16).to_le_bytes());
    h.extend_from_slice(url);
    h.extend_from_slice(&mac(secret, challenge, from, to, url));
    h
}

/// A blocking connection to another node's cluster address for copying its segments (a
/// snapshot being installed before the store opens): `fetch` one segment at a time, then
/// `done`.
pub struct Fetcher {
    s: std::net::TcpStream,
}

impl Fetcher {
    /// Connects to node `to` at `addr` as node `me`, proving `secret`.
    pub fn connect(addr: &str, secret: &str, me: u64, to: u64, url: &str) -> std::io::Result<Fetcher> {
        use std::io::{Read, Write};
        use std::net::ToSocketAddrs;
        let target = addr.to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr} resolves to nothing"))
        })?;
        let mut s = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.set_write_timeout(Some(Duration::from_secs(30)))?;
        let mut c = [0u8; 16];
        s.read_exact(&mut c)?;
        s.write_all(&hello(secret.as_bytes(), &c, me, to, url))?;
        Ok(Fetcher { s })
    }

    /// Copies up to `len` bytes of the segment starting at `base` into `out`; the bytes copied,
    /// or `None` when the other node no longer has that segment.
    pub fn fetch(
        &mut self,
        base: u64,
        len: u64,
        out: &mut impl std::io::Write,
    ) -> std::io::Result<Option<u64>> {
        use std::io::{Read, Write};
        let mut req = Vec::with_capacity(16);
        req.extend_from_slice(&base.to_le_bytes());
        req.extend_from_slice(&len.to_le_bytes());
        self.s.write_all(&frame(KIND_FETCH, &req))?;
        let mut n = [0u8; 8];
        self.s.read_exact(&mut n)?;
        let n = u64::from_le_bytes(n);
        if n == u64::MAX {
            return Ok(None);
        }
        let mut buf = vec![0u8; CHUNK];
        let mut left = n;
        while left > 0 {
            let k = left.min(CHUNK as u64) as usize;
            self.s.read_exact(&mut buf[..k])?;
            out.write_all(&buf[..k])?;
            left -= k as u64;
        }
        Ok(Some(n))
    }

    /// Tells the other node every segment of the snapshot at `index` arrived.
    pub fn done(mut self, index: u64) -> std::io::Result<()> {
        use std::io::Write;
        self.s.write_all(&frame(KIND_FETCHED, &index.to_le_bytes()))
    }
}

/// Sends `len` bytes (fewer if the file is shorter) of the segment at `base`, or u64::MAX when
/// there is none (reclaim deleted it: the follower asks for a newer snapshot).
async fn send_segment(s: &mut TcpStream, dir: &std::path::Path, base: u64, len: u64) -> std::io::Result<()> {
    let path = dir.join("commitlog").join(crate::storage::commitlog::segment_name(base));
    let mut f = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(_) => return s.write_all(&u64::MAX.to_le_bytes()).await,
    };
    let n = f.metadata().await?.len().min(len);
    s.write_all(&n.to_le_bytes()).await?;
    let mut buf = vec![0u8; CHUNK];
    let mut left = n;
    while left > 0 {
        let k = left.min(CHUNK as u64) as usize;
        f.read_exact(&mut buf[..k]).await?;
        s.write_all(&buf[..k]).await?;
        left -= k as u64;
    }
    Ok(())
}

async fn accept_loop(listener: TcpListener, ctx: Arc<Serve>) {
    loop {
        let (stream, from_addr) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cluster accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(stream, &ctx).await {
                debug!(from = %from_addr, error = %e, "cluster link closed");
            }
        });
    }
}

/// Reads one peer's link: its hello, then its frames, until it closes.
async fn serve(mut s: TcpStream, ctx: &Serve) -> std::io::Result<()> {
    let (me, secret, state, inbound) = (ctx.me, &*ctx.secret, &ctx.state, &ctx.inbound);
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    s.set_nodelay(true)?;
    let c = challenge();
    s.write_all(&c).await?;
    let mut head = [0u8; 18];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut head))
        .await
        .map_err(|_| bad("no hello"))??;
    let from = u64::from_le_bytes(head[0..8].try_into().unwrap_or([0; 8]));
    let to = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
    let url_len = u16::from_le_bytes([head[16], head[17]]) as usize;
    let mut rest = vec![0u8; url_len + 32];
    s.read_exact(&mut rest).await?;
    let (url, got) = rest.split_at(url_len);
    if to != me || mac(secret, &c, from, to, url).as_slice() != got {
        warn!(
            claimed = from,
            "a cluster link failed its proof of the cluster secret (or was meant for another node); closed"
        );
        return Err(bad("bad hello"));
    }
    let url = String::from_utf8_lossy(url).into_owned();
    state.update_node(from, |n| n.api_url = Some(url));
    // Read through a buffer, so the frames that arrived together can be seen before any is stepped.
    let mut s = tokio::io::BufReader::with_capacity(READ_BUFFER, s);
    loop {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(bad("frame length"));
        }
        let mut frame = vec![0u8; len];
        s.read_exact(&mut frame).await?;
        let event = match frame[0] {
            KIND_RAFT => match Message::parse_from_bytes(&frame[1..]) {
                Ok(m) if m.from == from && m.to == me => Event::Msg(m),
                _ => return Err(bad("bad raft message")),
            },
            KIND_FETCH if frame.len() == 17 => {
                let word =
                    |i: usize| u64::from_le_bytes(frame[1 + i * 8..9 + i * 8].try_into().unwrap_or([0; 8]));
                send_segment(s.get_mut(), &ctx.data_dir, word(0), word(1)).await?;
                continue;
            }
            KIND_FETCHED if frame.len() == 9 => Event::SnapshotFetched { from },
            KIND_REMOVED => Event::Removed { by: from },
            KIND_PASSED => match decode_passed(&frame[1..]) {
                Some(p) => Event::Passed { from, p },
                None => return Err(bad("bad queue positions")),
            },
            KIND_PROBE if frame.len() == 17 => {
                answer_probe(ctx, from, &frame[1..]);
                continue;
            }
            KIND_PROBE_ANSWER if frame.len() == 33 => {
                let word =
                    |i: usize| i64::from_le_bytes(frame[1 + i * 8..9 + i * 8].try_into().unwrap_or([0; 8]));
                let (t3, now_mono) = (ctx.stamps.wall_us(), ctx.stamps.mono_us());
                let rtt_us = now_mono.saturating_sub(word(1) as u64);
                let sample = Sample { t0: word(0), t1: word(2), t2: word(3), t3, rtt_us };
                Event::Clock { from, sample, at_mono_us: now_mono }
            }
            _ => continue,
        };
        // Under load the leader's appends arrive faster than one sync each: stepping only the
        // last of the raft frames already buffered makes them one append and one sync here.
        let step = !matches!(event, Event::Msg(_)) || !raft_frame_buffered(s.buffer());
        inbound(event, step);
    }
}

/// Whether `buf` starts with a whole raft frame (length prefix, kind and body), which the reader
/// will take next without waiting (any other kind may not step the driver, so it cannot be left
/// to step the ones queued before it).
fn raft_frame_buffered(buf: &[u8]) -> bool {
    let Some(len) = buf.get(..4).and_then(|l| <[u8; 4]>::try_from(l).ok()) else { return false };
    buf.get(4) == Some(&KIND_RAFT) && buf.len() - 4 >= u32::from_le_bytes(len) as usize
}

/// Answers a clock probe on this node's own link to its sender, with this node's wall clock when
/// it arrived and when the answer leaves.
fn answer_probe(ctx: &Serve, to: u64, probe: &[u8]) {
    let t1 = ctx.stamps.wall_us();
    let mut a = Vec::with_capacity(32);
    a.extend_from_slice(probe);
    a.extend_from_slice(&t1.to_le_bytes());
    a.extend_from_slice(&ctx.stamps.wall_us().to_le_bytes());
    if let Some(link) = ctx.peers.read().unwrap_or_else(|p| p.into_inner()).get(&to) {
        link.send(frame(KIND_PROBE_ANSWER, &a));
    }
}

/// raft-rs's logger, forwarding to tracing (elections and role changes at INFO).
pub fn raft_logger() -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!())
}

struct TracingDrain;

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;
    fn log(
        &self,
        record: &slog::Record<'_>,
        _values: &slog::OwnedKVList,
    ) -> std::result::Result<(), slog::Never> {
        let msg = record.msg().to_string();
        match record.level() {
            slog::Level::Critical | slog::Level::Error => tracing::error!(target: "delayd::raft", "{msg}"),
            slog::Level::Warning => tracing::warn!(target: "delayd::raft", "{msg}"),
            slog::Level::Info => tracing::info!(target: "delayd::raft", "{msg}"),
            _ => tracing::debug!(target: "delayd::raft", "{msg}"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_raft_frame_already_buffered_defers_the_step() {
        let raft = frame(KIND_RAFT, &[7u8; 10]);
        assert!(raft_frame_buffered(&raft));
        assert!(raft_frame_buffered(&[raft.clone(), vec![1, 2]].concat()), "a whole frame then more");
        assert!(!raft_frame_buffered(&raft[..raft.len() - 1]), "a frame not all here yet");
        assert!(!raft_frame_buffered(&raft[..3]), "not even its length");
        assert!(!raft_frame_buffered(&[]));
        assert!(!raft_frame_buffered(&frame(KIND_PROBE, &[0u8; 16])), "another kind steps nothing");
    }

    #[test]
    fn queue_positions_survive_the_wire_and_bad_frames_are_refused() {
        let p = Passed {
            index: 42,
            term: 3,
            dispatched: 1 << 40,
            levels: vec![(1_000, 77), (7_200_000, 0)],
            topics: vec![("orders".into(), 5), ("订单".into(), u64::MAX)],
        };
        let b = encode_passed(&p);
        assert_eq!(decode_passed(&b), Some(p.clone()));
        for cut in 0..b.len() {
            assert_eq!(decode_passed(&b[..cut]), None, "a frame cut at {cut} bytes is refused");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(decode_passed(&longer), None, "trailing bytes are refused");
        let mut huge = b[..24].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_passed(&huge), None, "a count larger than the frame is refused");
        let mut bad_name = encode_passed(&Passed { topics: vec![("ab".into(), 1)], ..Passed::default() });
        let at = bad_name.len() - 10;
        bad_name[at] = 0xff;
        assert_eq!(decode_passed(&bad_name), None, "a name that is not UTF-8 is refused");
    }
}

#[cfg(test)]
mod link_tests {
    use super::*;
    use std::io::Read;

    /// Frames sent from a plain thread, straight to the connection or through the link's queue
    /// as the receiver's pace decides, arrive whole and in order.
    #[test]
    fn direct_and_queued_frames_arrive_whole_and_in_order() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = mpsc::channel(QUEUE);
        let out = Arc::new(Mutex::new(Outbox::default()));
        let link = PeerLink { tx, out: out.clone() };
        let task = Link { out, me: 1, to: 2, addr, url: "http://x".into(), secret: Arc::from(&b"s"[..]) };
        rt.spawn(task.run(rx));
        let (mut s, _) = listener.accept().unwrap();
        std::io::Write::write_all(&mut s, &[0u8; 16]).unwrap();
        let mut hello = [0u8; 8 + 8 + 2 + 8 + 32];
        s.read_exact(&mut hello).unwrap();
        while lock_out(&link.out).writer.is_none() {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Frames of up to 64 KiB each carry their sequence number: enough to fill the socket's
        // buffers while the reader sleeps, so later frames queue behind a partly written one.
        let sender = std::thread::spawn(move || {
            for n in 0u32..3_000 {
                let mut body = n.to_le_bytes().to_vec();
                body.resize(4 + (n as usize * 7919) % (64 << 10), (n % 251) as u8);
                link.send(frame(KIND_RAFT, &body));
            }
            link
        });
        let mut last = None;
        let mut got = 0;
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        loop {
            if got == 100 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let mut len = [0u8; 4];
            if s.read_exact(&mut len).is_err() {
                break;
            }
            let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
            s.read_exact(&mut f).unwrap();
            assert_eq!(f[0], KIND_RAFT);
            let n = u32::from_le_bytes(f[1..5].try_into().unwrap());
            assert_eq!(f.len(), 1 + 4 + (n as usize * 7919) % (64 << 10), "frame {n} arrived whole");
            assert!(f[5..].iter().all(|b| *b == (n % 251) as u8), "frame {n} is not mixed with another");
            assert!(last.is_none_or(|l| n > l), "frame {n} after {last:?}");
            last = Some(n);
            got += 1;
        }
        let link = sender.join().unwrap();
        // The queue holds more frames than were sent: none was dropped.
        assert_eq!(got, 3_000, "every frame arrives");
        drop(link);
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}
