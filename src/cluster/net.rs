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
//!   (raft-rs's protobuf encoding).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use protobuf::Message as _;
use raft::prelude::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::node::Event;
use super::{ClusterConfig, ClusterState};
use crate::error::{Error, Result};

/// Largest frame accepted (a Raft message carries at most about 1 MiB of entries, plus one
/// entry that may be as large as a record).
const MAX_FRAME: usize = 80 << 20;
/// Frames queued for one peer before new ones are dropped (Raft resends what is lost).
const QUEUE: usize = 4096;
/// Kind byte of a Raft message frame.
const KIND_RAFT: u8 = 1;
/// Label of the hello's MAC.
const LABEL: &[u8] = b"delayd-cluster-v1";

/// The sending half: a queue per peer, drained by its connection task.
pub struct Net {
    peers: HashMap<u64, mpsc::Sender<Vec<u8>>>,
}

impl Net {
    /// Binds the cluster listener and starts one connection task per peer on `rt`.
    pub fn start(
        rt: &tokio::runtime::Handle,
        cfg: &ClusterConfig,
        state: Arc<ClusterState>,
        inbound: flume::Sender<Event>,
    ) -> Result<Net> {
        let std_listener = std::net::TcpListener::bind(&cfg.listen)
            .map_err(|e| Error::Config(format!("cluster_listen: cannot listen on {}: {e}", cfg.listen)))?;
        std_listener.set_nonblocking(true).map_err(|e| Error::io("cluster listener", e))?;
        let secret: Arc<[u8]> = cfg.secret.as_bytes().into();
        let me = cfg.node_id;
        {
            let (secret, state, inbound) = (secret.clone(), state.clone(), inbound.clone());
            let _guard = rt.enter();
            let listener =
                TcpListener::from_std(std_listener).map_err(|e| Error::io("cluster listener", e))?;
            rt.spawn(accept_loop(listener, me, secret, state, inbound));
        }
        let mut peers = HashMap::new();
        for (id, addr) in cfg.others() {
            let (tx, rx) = mpsc::channel(QUEUE);
            peers.insert(*id, tx);
            let link = Link {
                me,
                to: *id,
                addr: addr.clone(),
                url: cfg.advertise_url.clone(),
                secret: secret.clone(),
            };
            rt.spawn(link.run(rx));
        }
        info!(listen = %cfg.listen, peers = peers.len(), "cluster links started");
        Ok(Net { peers })
    }

    /// Queues `m` for its destination; dropped when the link is backed up (Raft resends).
    pub fn send(&self, m: Message) {
        let Some(tx) = self.peers.get(&m.to) else { return };
        let body = match m.write_to_bytes() {
            Ok(b) => b,
            Err(e) => {
                warn!(error = %e, "cannot encode a raft message");
                return;
            }
        };
        let mut frame = Vec::with_capacity(5 + body.len());
        frame.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
        frame.push(KIND_RAFT);
        frame.extend_from_slice(&body);
        let _ = tx.try_send(frame);
    }
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
                    // Frames queued while down are stale heartbeats and appends: Raft resends.
                    while rx.try_recv().is_ok() {}
                    if !Self::pump(stream, &mut rx).await {
                        return;
                    }
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
    async fn pump(stream: TcpStream, rx: &mut mpsc::Receiver<Vec<u8>>) -> bool {
        let (mut reader, mut writer) = stream.into_split();
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                frame = rx.recv() => {
                    let Some(frame) = frame else { return false };
                    if writer.write_all(&frame).await.is_err() {
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
        let url = self.url.as_bytes();
        let mut hello = Vec::with_capacity(8 + 8 + 2 + url.len() + 32);
        hello.extend_from_slice(&self.me.to_le_bytes());
        hello.extend_from_slice(&self.to.to_le_bytes());
        hello.extend_from_slice(&(url.len() as u16).to_le_bytes());
        hello.extend_from_slice(url);
        hello.extend_from_slice(&mac(&self.secret, &c, self.me, self.to, url));
        s.write_all(&hello).await?;
        Ok(s)
    }
}

async fn accept_loop(
    listener: TcpListener,
    me: u64,
    secret: Arc<[u8]>,
    state: Arc<ClusterState>,
    inbound: flume::Sender<Event>,
) {
    loop {
        let (stream, from_addr) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cluster accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (secret, state, inbound) = (secret.clone(), state.clone(), inbound.clone());
        tokio::spawn(async move {
            if let Err(e) = serve(stream, me, &secret, &state, &inbound).await {
                debug!(from = %from_addr, error = %e, "cluster link closed");
            }
        });
    }
}

/// Reads one peer's link: its hello, then its frames, until it closes.
async fn serve(
    mut s: TcpStream,
    me: u64,
    secret: &[u8],
    state: &ClusterState,
    inbound: &flume::Sender<Event>,
) -> std::io::Result<()> {
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
    loop {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(bad("frame length"));
        }
        let mut frame = vec![0u8; len];
        s.read_exact(&mut frame).await?;
        if frame[0] == KIND_RAFT {
            match Message::parse_from_bytes(&frame[1..]) {
                Ok(m) if m.from == from && m.to == me => {
                    if inbound.send_async(Event::Msg(m)).await.is_err() {
                        return Ok(());
                    }
                }
                _ => return Err(bad("bad raft message")),
            }
        }
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
