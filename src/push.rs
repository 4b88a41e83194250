//! Push delivery: for each topic with a push subscription, delayd is the consumer. It reserves
//! due messages (time-to-run = the delivery timeout plus a margin) and POSTs each to the webhook,
//! or publishes it to a NATS JetStream subject; a 2xx (or JetStream's publish ack) acks it,
//! anything else is a nack, so the message comes back after the next step of its backoff and is
//! dead-lettered after its last attempt, as with any consumer. A delivery cut
//! short (the process killed, the subscription changed) leaves the reservation to run out, and
//! the message comes back: at least once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hmac::{Hmac, Mac};
use http_body_util::Full;
use hyper::header::{HeaderValue, ACCEPT, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, Request, Uri};
use hyper_rustls::{ConfigBuilderExt, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use sha2::Sha256;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::broker::Broker;
use crate::message::{Delivery, PopRequest, PushConfig};
use crate::push_health::{self, LogLine};

/// How often the subscriptions are looked at again (one engine call; changes are rare).
const RECONCILE_EVERY: Duration = Duration::from_millis(500);
/// A reservation outlives the delivery's timeout by this much, so that the ack of a delivery
/// that just made it is not beaten by the reservation running out.
const TTR_MARGIN_MS: u64 = 5_000;
/// How long one pop waits for a message before the worker looks again.
const POP_WAIT_MS: u64 = 1_000;
/// Pause after the broker refused a call (it is shutting down or cannot write).
const BROKER_RETRY: Duration = Duration::from_secs(1);
/// A failure that repeats is logged again at most this often, with how many times it happened.
const REMIND_EVERY: Duration = Duration::from_secs(60);
/// With every delivery slot of the process taken, a subscription that found nothing waits this
/// long outside the queue for slots before it looks again, rather than hold a slot in a long poll
/// that another subscription's due messages could use.
const IDLE_WHEN_FULL: Duration = Duration::from_millis(250);
/// `push_max_in_flight = auto`: this share of the open-file limit (the rest is for the store's
/// files and the HTTP connections), within these bounds.
const AUTO_IN_FLIGHT_SHARE: usize = 4;
const AUTO_IN_FLIGHT_MIN: usize = 64;
const AUTO_IN_FLIGHT_MAX: usize = 4096;
/// How long a NATS subscription's stream may take to describe itself when the subscription is set.
pub const NATS_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a NATS worker asks again for a stream it could not read or must not deliver to.
const NATS_CHECK_AGAIN: Duration = Duration::from_secs(5);
/// A pooled connection unused this long is closed.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// TCP keepalive probes on webhook connections, so a pooled connection to a peer that vanished is
/// found dead rather than written to; reqwest's defaults, which push delivery had before.
const TCP_KEEPALIVE: Duration = Duration::from_secs(15);
const TCP_KEEPALIVE_RETRIES: u32 = 3;
/// Unacknowledged data older than this drops the connection (Linux), as reqwest had it.
#[cfg(target_os = "linux")]
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// The pooled HTTP(S) client every webhook delivery goes through.
type WebhookClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Runs the pushers until the task is dropped: one worker per subscription, replaced when the
/// subscription changes.
pub async fn run(broker: Broker) {
    let client = match client() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the HTTP client for push delivery; pushes are off");
            return;
        }
    };
    let limit = broker.config().push_max_in_flight.unwrap_or_else(auto_in_flight).max(1);
    broker.push_metrics().in_flight_limit.set(i64::try_from(limit).unwrap_or(i64::MAX));
    tracing::info!(push_max_in_flight = limit, "push deliveries under way at once over all topics");
    // Every worker takes a slot here for each delivery, besides its own max_in_flight: a dead
    // endpoint then holds at most this many sockets however many subscriptions point at it.
    let gate = Gate::new(limit);
    let mut workers: HashMap<String, (PushConfig, JoinHandle<()>)> = HashMap::new();
    let mut seen = None;
    let mut next_sub = 0u64;
    loop {
        // In a cluster only the leader delivers: a node that stops leading drops its workers (a
        // delivery cut short comes back after its reservation), and starts them when it leads.
        if !broker.leads() {
            if !workers.is_empty() {
                tracing::info!(
                    workers = workers.len(),
                    "not the cluster's leader: push deliveries stop here"
                );
                workers.drain().for_each(|(_, (_, task))| task.abort());
                broker.push_metrics().health.retain(|_| false);
                seen = None;
            }
            tokio::time::sleep(RECONCILE_EVERY).await;
            continue;
        }
        match broker.pushes().await {
            Ok((changes, subs)) if seen != Some(changes) => {
                seen = Some(changes);
                let wanted: HashMap<String, PushConfig> =
                    subs.into_iter().map(|c| (c.topic.clone(), c)).collect();
                workers.retain(|topic, (cfg, task)| {
                    let keep = wanted.get(topic) == Some(cfg);
                    if !keep {
                        task.abort();
                    }
                    keep
                });
                // A removed or replaced subscription's health goes with it.
                broker.push_metrics().health.retain(|t| workers.contains_key(t));
                for (topic, cfg) in wanted {
                    if let std::collections::hash_map::Entry::Vacant(slot) = workers.entry(topic) {
                        broker.push_metrics().health.start(&cfg.topic);
                        let task = tokio::spawn(worker(
                            broker.clone(),
                            client.clone(),
                            gate.clone(),
                            next_sub,
                            cfg.clone(),
                        ));
                        next_sub += 1;
                        slot.insert((cfg, task));
                    }
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "cannot read the push subscriptions"),
        }
        tokio::time::sleep(RECONCILE_EVERY).await;
    }
}

/// The process-wide bound on push deliveries under way, shared fairly: a freed slot goes to the
/// waiting subscription that holds the fewest now, and of those to the one that has held slots
/// for the least time (slots held now counted up to now), then the one that asked first. A
/// subscription whose endpoint answers at once keeps getting slots however many slow ones wait
/// (a slow delivery's cost shows only as it runs, so the count held comes first), and a slow one
/// still gets its turn once the others have used as much: none starves.
struct Gate {
    /// What the slot times count from.
    epoch: Instant,
    state: std::sync::Mutex<GateState>,
}

struct GateState {
    free: usize,
    /// By subscription (a worker's number), while it holds or waits for a slot.
    shares: HashMap<u64, Share>,
    /// Subscriptions waiting for a slot, in the order they asked.
    waiting: std::collections::VecDeque<(u64, tokio::sync::oneshot::Sender<u64>)>,
}

/// One subscription's use of the gate, in microseconds since the gate's epoch.
#[derive(Default)]
struct Share {
    held: u64,
    /// Slot time of the slots given back.
    used: u64,
    /// Sum of the times the slots held now were taken.
    taken_at_sum: u64,
}

impl Share {
    /// Slot time used until `now`, the slots held now included.
    fn load(&self, now: u64) -> u64 {
        self.used + (self.held * now).saturating_sub(self.taken_at_sum)
    }
}

/// One slot of the [`Gate`], given back when dropped.
struct GateSlot {
    gate: Arc<Gate>,
    sub: u64,
    taken_at: u64,
}

impl Drop for GateSlot {
    fn drop(&mut self) {
        self.gate.release(self.sub, self.taken_at);
    }
}

/// A wait for a slot; dropped after the slot was handed to it, it gives the slot back.
struct GateWait {
    gate: Arc<Gate>,
    sub: u64,
    rx: tokio::sync::oneshot::Receiver<u64>,
    done: bool,
}

impl Drop for GateWait {
    fn drop(&mut self) {
        if !self.done {
            self.rx.close();
            if let Ok(taken_at) = self.rx.try_recv() {
                self.gate.release(self.sub, taken_at);
            }
        }
    }
}

impl Gate {
    fn new(slots: usize) -> Arc<Gate> {
        Arc::new(Gate {
            epoch: Instant::now(),
            state: std::sync::Mutex::new(GateState {
                free: slots,
                shares: HashMap::new(),
                waiting: std::collections::VecDeque::new(),
            }),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // Nothing under the lock can panic half-way through a change.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for subscription `sub`, once one is free and it is `sub`'s turn.
    async fn acquire(self: &Arc<Gate>, sub: u64) -> GateSlot {
        let rx = {
            let mut st = self.lock();
            let now = self.now();
            if st.free > 0 && st.waiting.is_empty() {
                return self.take(&mut st, sub, now);
            }
            if !st.shares.contains_key(&sub) {
                // New, or back after a while idle: it starts level with the waiter that used
                // least, so it is served soon but cannot claim slot time it did not use (and
                // then starve the others while it catches up).
                let used = st.waiting.iter().filter_map(|(s, _)| st.shares.get(s)).map(|s| s.load(now)).min();
                st.shares.insert(sub, Share { used: used.unwrap_or(0), ..Share::default() });
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            st.waiting.push_back((sub, tx));
            rx
        };
        let mut wait = GateWait { gate: self.clone(), sub, rx, done: false };
        // The sender stays queued until a release hands it a slot, and the gate outlives every
        // worker, so the wait ends with a slot.
        let handed = (&mut wait.rx).await;
        wait.done = true;
        match handed {
            Ok(taken_at) => GateSlot { gate: self.clone(), sub, taken_at },
            // Cannot happen (see above); never take a slot that was not given.
            Err(_) => std::future::pending().await,
        }
    }

    /// A slot for `sub` now, if one is free and nobody waits for it.
    fn try_acquire(self: &Arc<Gate>, sub: u64) -> Option<GateSlot> {
        let mut st = self.lock();
        if st.free == 0 || !st.waiting.is_empty() {
            return None;
        }
        let now = self.now();
        Some(self.take(&mut st, sub, now))
    }

    /// Takes a free slot for `sub`.
    fn take(self: &Arc<Gate>, st: &mut GateState, sub: u64, now: u64) -> GateSlot {
        st.free -= 1;
        let share = st.shares.entry(sub).or_default();
        share.held += 1;
        share.taken_at_sum += now;
        GateSlot { gate: self.clone(), sub, taken_at: now }
    }

    /// Whether every slot is taken.
    fn full(&self) -> bool {
        self.lock().free == 0
    }

    /// Gives back `sub`'s slot taken at `taken_at`, to the waiting subscription that used least.
    fn release(&self, sub: u64, taken_at: u64) {
        let mut st = self.lock();
        let now = self.now();
        if let Some(share) = st.shares.get_mut(&sub) {
            share.held = share.held.saturating_sub(1);
            share.taken_at_sum = share.taken_at_sum.saturating_sub(taken_at);
            share.used += now.saturating_sub(taken_at);
        }
        loop {
            let next = {
                let load = |s: &u64| st.shares.get(s).map_or((0, 0), |share| (share.held, share.load(now)));
                // min_by_key keeps the first of equals: the one that asked earliest.
                st.waiting.iter().enumerate().min_by_key(|(_, (s, _))| load(s)).map(|(i, _)| i)
            };
            let Some((next, tx)) = next.and_then(|i| st.waiting.remove(i)) else {
                st.free += 1;
                break;
            };
            if tx.send(now).is_ok() {
                let share = st.shares.entry(next).or_default();
                share.held += 1;
                share.taken_at_sum += now;
                break;
            }
            // That wait was given up (its worker stopped); the slot goes to the next.
            st.forget_if_idle(next);
        }
        st.forget_if_idle(sub);
    }
}

impl GateState {
    /// Forgets a subscription that holds and waits for nothing: it may be gone for good.
    fn forget_if_idle(&mut self, sub: u64) {
        let idle = self.shares.get(&sub).is_some_and(|s| s.held == 0);
        if idle && !self.waiting.iter().any(|(s, _)| *s == sub) {
            self.shares.remove(&sub);
        }
    }
}

/// `push_max_in_flight = auto`: a share of the process's open-file limit, since each delivery
/// may hold a socket.
fn auto_in_flight() -> usize {
    let share = open_file_limit().map_or(AUTO_IN_FLIGHT_MIN, |n| n / AUTO_IN_FLIGHT_SHARE);
    share.clamp(AUTO_IN_FLIGHT_MIN, AUTO_IN_FLIGHT_MAX)
}

/// The soft limit on open files (Linux: read from /proc, no system call needed).
fn open_file_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files").split_whitespace().next()?.parse().ok()
}

/// Counts a failure that repeats and says when to log it: the first time, then at most once per
/// [`REMIND_EVERY`], with how many there were since the last line.
struct Reminder {
    last: Option<Instant>,
    since: u64,
}

impl Reminder {
    fn new() -> Reminder {
        Reminder { last: None, since: 0 }
    }

    /// `Some(n)` when this failure is to be logged: `n` happened since the last line, this one
    /// included.
    fn note(&mut self) -> Option<u64> {
        self.since += 1;
        match self.last {
            Some(t) if t.elapsed() < REMIND_EVERY => None,
            _ => {
                self.last = Some(Instant::now());
                Some(std::mem::take(&mut self.since))
            }
        }
    }
}

/// One pooled client for every webhook: keep-alive connections, rustls for https. It follows no
/// redirects (hyper's client never does): a webhook that redirects is answering with a non-2xx
/// status.
fn client() -> Result<WebhookClient, rustls::Error> {
    // The provider is named rather than taken from the process default, which rustls cannot pick
    // on its own once a second provider is compiled in.
    let mut tls =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_webpki_roots()
            .with_no_client_auth();
    // Offered as reqwest offered it: a server that insists on ALPN still takes the connection,
    // and none can pick h2, which this client does not speak.
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut http = HttpConnector::new();
    // The https connector wraps this one and handles both schemes itself.
    http.enforce_http(false);
    // A delivery is one small write each way: Nagle's delay would only add latency.
    http.set_nodelay(true);
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_keepalive_interval(Some(TCP_KEEPALIVE));
    http.set_keepalive_retries(Some(TCP_KEEPALIVE_RETRIES));
    #[cfg(target_os = "linux")]
    http.set_tcp_user_timeout(Some(TCP_USER_TIMEOUT));
    // Built from its parts: hyper-rustls' builder refuses a config with ALPN already set. This
    // way takes both schemes and verifies the URL's host name, as the builder's would.
    let https = HttpsConnector::from((http, tls));
    // The pool timer is what closes idle connections after POOL_IDLE; without it they linger.
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(https))
}

/// Where a worker's deliveries go.
#[derive(Clone)]
enum Sink {
    /// POST to the subscription's URL.
    Webhook(WebhookClient),
    /// Publish to the subscription's JetStream subject (boxed: the context is large, and cloned
    /// once per delivery).
    Nats(Arc<async_nats::jetstream::Context>),
}

/// What became of one delivery: acked (`Ok`), or why not (the outcome label, and a reason).
type Outcome = Result<(), (&'static str, String)>;

/// Options for every NATS connection push makes. Servers the one named advertises (its cluster's
/// `connect_urls`) are ignored: `push_allowed_hosts` was checked against the URL given, and a
/// server's gossip must not lead delayd to hosts nobody allowed.
pub fn nats_options() -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::new().ignore_discovered_servers()
}

/// What delayd needs to know of the JetStream stream that captures a subscription's subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFacts {
    /// The stream's name.
    pub name: String,
    /// Whether it keeps its messages in memory only.
    pub memory: bool,
    /// How many servers hold a copy.
    pub replicas: usize,
}

impl StreamFacts {
    /// Why delayd must not deliver to this stream, if it must not: a memory stream loses
    /// everything delayd handed it when its server restarts, after delayd has forgotten it.
    pub fn refusal(&self) -> Option<String> {
        self.memory.then(|| {
            format!(
                "stream {} keeps messages in memory only: a NATS restart loses every message delayd delivered to it; use file storage",
                self.name
            )
        })
    }

    /// What the subscriber should know about the guarantee this stream gives.
    pub fn warnings(&self) -> Vec<String> {
        if self.replicas > 1 {
            return Vec::new();
        }
        // The server's sync_interval is not visible to a client: only its operator knows whether
        // every write is synced.
        vec![format!(
            "stream {} has 1 replica: unless its server syncs every write (jetstream sync_interval: always), a power failure or OS crash can lose messages JetStream acknowledged within the last sync interval (2 minutes by default), after delayd has marked them done",
            self.name
        )]
    }
}

/// Reads the configuration of the stream that captures `subject` through `js`.
async fn stream_facts(js: &async_nats::jetstream::Context, subject: &str) -> Result<StreamFacts, String> {
    let name = js.stream_by_subject(subject).await.map_err(|e| match e.kind() {
        async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound => {
            format!("no JetStream stream captures subject {subject}")
        }
        _ => format!("cannot look up the stream of subject {subject}: {}", error_chain(&e)),
    })?;
    let mut stream = js.get_stream(&name).await.map_err(|e| format!("cannot read stream {name}: {e}"))?;
    let info = stream.info().await.map_err(|e| format!("cannot read stream {name}: {e}"))?;
    Ok(StreamFacts {
        name,
        memory: info.config.storage == async_nats::jetstream::stream::StorageType::Memory,
        replicas: info.config.num_replicas.max(1),
    })
}

/// Connects to `url` and reads the configuration of the stream that captures `subject`, within
/// `timeout` (the subscription's PUT waits for it).
pub async fn check_nats_stream(url: &str, subject: &str, timeout: Duration) -> Result<StreamFacts, String> {
    let work = async {
        let nc = nats_options()
            .connection_timeout(timeout)
            .connect(url)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        let facts = stream_facts(&async_nats::jetstream::new(nc.clone()), subject).await;
        let _ = nc.drain().await;
        facts
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(format!("{url} did not describe the stream within {timeout:?}")))
}

/// Holds a NATS worker back until the stream that captures its subject is known and may be
/// delivered to: none is readable, or it keeps messages in memory only, and the messages wait in
/// delayd (pending, not failed) while the worker asks again.
async fn await_usable_stream(js: &async_nats::jetstream::Context, cfg: &PushConfig) {
    let subject = cfg.nats_subject.clone().unwrap_or_default();
    let (mut unreadable, mut refused) = (Reminder::new(), Reminder::new());
    loop {
        match stream_facts(js, &subject).await {
            Ok(facts) => match facts.refusal() {
                None => {
                    for w in facts.warnings() {
                        tracing::warn!(topic = %cfg.topic, url = %cfg.url, "{w}");
                    }
                    return;
                }
                Some(why) => {
                    if let Some(n) = refused.note() {
                        tracing::error!(topic = %cfg.topic, url = %cfg.url, times = n, "not delivering: {why}");
                    }
                }
            },
            Err(why) => {
                if let Some(n) = unreadable.note() {
                    tracing::warn!(topic = %cfg.topic, url = %cfg.url, times = n, "not delivering until the stream can be read: {why}");
                }
            }
        }
        tokio::time::sleep(NATS_CHECK_AGAIN).await;
    }
}

/// Consumes `cfg.topic`, keeping at most `max_in_flight` deliveries under way, each also holding a
/// slot of `gate`, the process-wide bound, as subscription `sub`.
async fn worker(broker: Broker, client: WebhookClient, gate: Arc<Gate>, sub: u64, cfg: PushConfig) {
    let sink = match &cfg.nats_subject {
        None => Sink::Webhook(client),
        // With retry_on_initial_connect the client is made at once and (re)connects in the
        // background: a NATS server that is down holds up only this topic's deliveries.
        Some(_) => match nats_options().retry_on_initial_connect().connect(&cfg.url).await {
            Ok(nc) => {
                let js = async_nats::jetstream::new(nc);
                await_usable_stream(&js, &cfg).await;
                Sink::Nats(Arc::new(js))
            }
            Err(e) => {
                tracing::error!(topic = %cfg.topic, url = %cfg.url, error = %e, "cannot set up the NATS client; this topic is not pushed");
                return;
            }
        },
    };
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight.max(1) as usize));
    // A pop of more than max_batch is refused: a subscription may keep more deliveries under way
    // than that, but takes them max_batch at a time.
    let max_batch = broker.config().max_batch.max(1);
    let cfg = Arc::new(cfg);
    let mut refused = Reminder::new();
    loop {
        let Ok(first) = slots.clone().acquire_owned().await else { return };
        let first_global = gate.acquire(sub).await;
        let full = gate.full();
        let mut permits = vec![(first, first_global)];
        while permits.len() < max_batch {
            let Ok(local) = slots.clone().try_acquire_owned() else { break };
            let Some(global) = gate.try_acquire(sub) else { break };
            permits.push((local, global));
        }
        let req = PopRequest {
            topics: vec![cfg.topic.clone()],
            max: permits.len(),
            // While every slot is taken, a long poll would hold one that is needed elsewhere.
            wait_ms: if full { 0 } else { POP_WAIT_MS },
            ttr_ms: Some(u64::from(cfg.timeout_ms) + TTR_MARGIN_MS),
        };
        let got = match broker.pop(req).await {
            Ok(got) => got,
            Err(e) => {
                if let Some(n) = refused.note() {
                    tracing::warn!(topic = %cfg.topic, error = %e, times = n, "push cannot take due messages; retrying");
                }
                drop(permits);
                tokio::time::sleep(BROKER_RETRY).await;
                continue;
            }
        };
        let found = !got.is_empty();
        for d in got {
            // The pop took at most one message per permit pair.
            let Some(slot) = permits.pop() else { break };
            let (broker, sink, cfg) = (broker.clone(), sink.clone(), cfg.clone());
            tokio::spawn(async move {
                deliver(&broker, &sink, &cfg, d).await;
                drop(slot);
            });
        }
        drop(permits);
        if !found && full {
            tokio::time::sleep(IDLE_WHEN_FULL).await;
        }
    }
}

/// Delivers one message to the sink and acks or nacks it by the outcome.
async fn deliver(broker: &Broker, sink: &Sink, cfg: &PushConfig, d: Delivery) {
    let m = broker.push_metrics();
    let in_flight = m.in_flight.with_label_values(&[cfg.topic.as_str()]);
    in_flight.inc();
    let started = std::time::Instant::now();
    let timeout = Duration::from_millis(u64::from(cfg.timeout_ms));
    let result = match sink {
        Sink::Webhook(client) => post(client, cfg, &d, timeout).await,
        Sink::Nats(js) => publish(js, cfg, &d, timeout).await,
    };
    in_flight.dec();
    m.latency.with_label_values(&[cfg.topic.as_str()]).observe(started.elapsed().as_secs_f64());
    let outcome = match &result {
        Ok(()) => "ok",
        Err((outcome, why)) => {
            tracing::debug!(topic = %cfg.topic, id = %d.id, %why, "push delivery failed");
            *outcome
        }
    };
    m.attempts.with_label_values(&[cfg.topic.as_str(), outcome]).inc();
    let why = result.err().map(|(_, why)| why);
    let line = m.health.record(&cfg.topic, why.clone().map_or(Ok(()), Err), now_ms(), Instant::now());
    log_health(cfg, line, why.as_deref());
    // A failure's reason stays with the message (GET /v1/messages/{id}), as a consumer's nack error.
    let answered = match why {
        None => broker.ack(&d.receipt).await,
        Some(why) => broker.nack_with_error(&d.receipt, None, Some(why)).await.map(|_| ()),
    };
    if let Err(e) = answered {
        // The reservation runs out and the message comes back: at least once.
        tracing::warn!(topic = %cfg.topic, id = %d.id, error = %e, "cannot record a push delivery's outcome");
    }
}

/// Logs a subscription's change of health: one WARN when it starts failing, a reminder at most
/// once per [`push_health::REMIND_EVERY`] while it keeps failing, an INFO when it recovers; never a
/// line per attempt.
fn log_health(cfg: &PushConfig, line: LogLine, why: Option<&str>) {
    let target = log_url(&cfg.url);
    let why = why.unwrap_or_default();
    match line {
        LogLine::Quiet => {}
        LogLine::StartedFailing => tracing::warn!(
            topic = %cfg.topic, %target, error = %why,
            "push deliveries started failing; each message is retried after its backoff (GET /v1/topics/{{topic}}/push shows the subscription's health)"
        ),
        LogLine::StillFailing { failures, in_a_row } => tracing::warn!(
            topic = %cfg.topic, %target, failures_since_last_line = failures, consecutive_failures = in_a_row,
            last_error = %why, "push deliveries still failing"
        ),
        LogLine::Recovered { failures } => tracing::info!(
            topic = %cfg.topic, %target, after_failures = failures, "push deliveries recovered"
        ),
    }
}

/// A target URL as logs show it: without its query and fragment, which may carry a token.
fn log_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => "(not a URL)".to_string(),
    }
}

/// Most bytes of a refusing answer read for its failure message.
const ANSWER_BYTES: usize = 4 * push_health::MAX_ERROR_CHARS;
/// Longest wait for those bytes once the status line came.
const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// POSTs one message: a 2xx is delivered, any other status `refused`, no answer `failed`.
async fn post(client: &WebhookClient, cfg: &PushConfig, d: &Delivery, timeout: Duration) -> Outcome {
    let req = webhook_request(cfg, d).map_err(|why| ("failed", why))?;
    // The timeout covers everything up to the status line: resolving, connecting, the TLS
    // handshake, sending, and the endpoint's time to answer. Only a refusal's body is read, its
    // start, for the failure message.
    match tokio::time::timeout(timeout, client.request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => Ok(()),
        Ok(Ok(r)) => {
            let status = r.status();
            let answer = answer_start(r.into_body()).await;
            let sep = if answer.is_empty() { "" } else { ": " };
            Err(("refused", format!("HTTP {status}{sep}{answer}")))
        }
        Ok(Err(e)) => Err(("failed", format!("connection error: {}", error_chain(&e)))),
        Err(_) => Err(("failed", format!("timeout: no answer within {timeout:?}"))),
    }
}

/// The start of an answer's body as a failure message shows it (see [`push_health::sanitize`]).
async fn answer_start(mut body: hyper::body::Incoming) -> String {
    use http_body_util::BodyExt;
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + ANSWER_WAIT;
    while buf.len() < ANSWER_BYTES {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    buf.extend_from_slice(&data[..data.len().min(ANSWER_BYTES - buf.len())]);
                }
            }
            _ => break,
        }
    }
    push_health::sanitize(&String::from_utf8_lossy(&buf), push_health::MAX_ERROR_CHARS)
}

/// The POST for one delivery. The URL goes through the WHATWG parser the subscription was
/// checked with, so it is normalised (case, default port, percent-encoding) the way it was
/// validated; the fragment is not sent.
fn webhook_request(cfg: &PushConfig, d: &Delivery) -> Result<Request<Full<Bytes>>, String> {
    let url = url::Url::parse(&cfg.url).map_err(|e| format!("not a URL: {e}"))?;
    let uri: Uri = url.as_str().parse().map_err(|e| format!("{url} cannot be requested: {e}"))?;
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(ACCEPT, HeaderValue::from_static("*/*"))
        .header(USER_AGENT, HeaderValue::from_static(concat!("delayd/", env!("CARGO_PKG_VERSION"))))
        .header(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"))
        .header("Delayd-Message-Id", d.id.as_str())
        .header("Delayd-Topic", cfg.topic.as_str())
        .header("Delayd-Attempt", d.attempt.to_string())
        .header("Delayd-Deliver-At", d.deliver_at_ms.to_string());
    if let Some(secret) = &cfg.secret {
        req = req.header("Delayd-Signature", signature(secret.as_bytes(), now_ms(), &d.body));
    }
    req.body(Full::new(d.body.clone())).map_err(|e| format!("cannot build the request: {e}"))
}

/// An error and its causes, outermost first: the client's own sentence ("client error
/// (Connect)") says little without the cause under it.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Publishes one message to JetStream and waits for the stream's ack: only then is it delivered.
/// `Nats-Msg-Id` is the message id, so a redelivery within the stream's duplicate window (after a
/// crash between the publish and delayd's ack) is dropped by JetStream.
async fn publish(
    js: &async_nats::jetstream::Context,
    cfg: &PushConfig,
    d: &Delivery,
    timeout: Duration,
) -> Outcome {
    let subject = cfg.nats_subject.clone().unwrap_or_default();
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", d.id.as_str());
    headers.insert("Delayd-Topic", cfg.topic.as_str());
    headers.insert("Delayd-Attempt", d.attempt.to_string().as_str());
    headers.insert("Delayd-Deliver-At", d.deliver_at_ms.to_string().as_str());
    let acked = tokio::time::timeout(timeout, async {
        js.publish_with_headers(subject, headers, d.body.clone()).await?.await
    })
    .await;
    match acked {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(("refused", format!("JetStream refused: {e}"))),
        Err(_) => Err(("failed", format!("timeout: no JetStream ack within {timeout:?}"))),
    }
}

/// `t=<unix ms>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`: the receiver recomputes it and
/// rejects a stale `t`, so a captured request cannot be replayed later.
pub fn signature(secret: &[u8], t_ms: u64, body: &Bytes) -> String {
    // HMAC takes a key of any length; the error case cannot happen.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    mac.update(t_ms.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let hex: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    format!("t={t_ms},v1={hex}")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper::{Response, StatusCode};
    use hyper_util::rt::TokioIo;

    /// One request a test webhook got: its method, path, headers (lower-case names) and body.
    type Seen = (Method, String, HashMap<String, String>, Vec<u8>);

    /// A webhook on a free loopback port: answers every request with `status` (and a `Location`,
    /// for a redirect) after `delay`, records each request, and counts TCP connections.
    struct Hook {
        url: String,
        seen: Arc<Mutex<Vec<Seen>>>,
        connections: Arc<AtomicUsize>,
    }

    async fn hook(status: StatusCode, delay: Duration) -> Hook {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook?x=1", listener.local_addr().unwrap());
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let connections = Arc::new(AtomicUsize::new(0));
        let (seen2, conns2, location) = (seen.clone(), connections.clone(), url.replace("/hook", "/moved"));
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                conns2.fetch_add(1, Ordering::SeqCst);
                let (seen, location) = (seen2.clone(), location.clone());
                let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    let (seen, location) = (seen.clone(), location.clone());
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body.collect().await.unwrap().to_bytes().to_vec();
                        let headers = parts
                            .headers
                            .iter()
                            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
                            .collect();
                        let path = parts.uri.path_and_query().map(|p| p.to_string()).unwrap_or_default();
                        seen.lock().unwrap().push((parts.method, path, headers, body));
                        tokio::time::sleep(delay).await;
                        Response::builder()
                            .status(status)
                            .header("Location", location)
                            .body(Full::new(Bytes::from_static(b"answer body")))
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc),
                );
            }
        });
        Hook { url, seen, connections }
    }

    fn cfg(url: &str, secret: Option<&str>) -> PushConfig {
        PushConfig {
            topic: "orders".into(),
            url: url.into(),
            nats_subject: None,
            secret: secret.map(str::to_string),
            timeout_ms: 1_000,
            max_in_flight: 1,
            created_at_ms: 0,
        }
    }

    fn delivery(id: &str, body: &'static [u8]) -> Delivery {
        Delivery {
            id: id.into(),
            topic: "orders".into(),
            body: Bytes::from_static(body),
            receipt: "r".into(),
            attempt: 2,
            deliver_at_ms: 1_700_000_000_123,
            ttr_ms: 1_000,
        }
    }

    #[tokio::test]
    async fn a_post_carries_the_headers_and_body_exactly_and_reuses_its_connection() {
        let h = hook(StatusCode::NO_CONTENT, Duration::ZERO).await;
        let client = client().unwrap();
        let c = cfg(&h.url, Some("whsec_test"));
        // Not UTF-8, with a NUL and CR LF: the body must arrive as these bytes, nothing else.
        let body: &'static [u8] = b"\x00\xff\r\n{\"order\":42}";
        let sent_at = now_ms();
        assert_eq!(post(&client, &c, &delivery("m1", body), Duration::from_secs(5)).await, Ok(()));
        assert_eq!(post(&client, &c, &delivery("m2", b""), Duration::from_secs(5)).await, Ok(()));
        let seen = h.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        let (method, path, headers, got) = &seen[0];
        assert_eq!((method, path.as_str()), (&Method::POST, "/hook?x=1"));
        assert_eq!(got.as_slice(), body);
        assert_eq!(headers["content-type"], "application/octet-stream");
        assert_eq!(headers["content-length"], body.len().to_string());
        assert_eq!(headers["delayd-message-id"], "m1");
        assert_eq!(headers["delayd-topic"], "orders");
        assert_eq!(headers["delayd-attempt"], "2");
        assert_eq!(headers["delayd-deliver-at"], "1700000000123");
        assert_eq!(headers["user-agent"], concat!("delayd/", env!("CARGO_PKG_VERSION")));
        assert_eq!(headers["accept"], "*/*");
        assert_eq!(headers["host"], h.url.split('/').nth(2).unwrap());
        // The signature is the documented one over the time it names and the exact body.
        let sig = &headers["delayd-signature"];
        let t: u64 = sig.strip_prefix("t=").and_then(|r| r.split_once(',')).unwrap().0.parse().unwrap();
        assert!(t >= sent_at && t <= now_ms(), "signature time {t}");
        assert_eq!(sig, &signature(b"whsec_test", t, &Bytes::from_static(body)));
        let (_, _, headers, got) = &seen[1];
        assert!(got.is_empty());
        assert_eq!(headers["delayd-message-id"], "m2");
        // Pooled: the second delivery went over the first one's connection.
        assert_eq!(h.connections.load(Ordering::SeqCst), 1);
        // Without a secret there is no signature header at all.
        assert_eq!(
            post(&client, &cfg(&h.url, None), &delivery("m3", b"x"), Duration::from_secs(5)).await,
            Ok(())
        );
        assert!(!h.seen.lock().unwrap()[2].2.contains_key("delayd-signature"));
    }

    #[tokio::test]
    async fn a_redirect_is_refused_and_not_followed() {
        let h = hook(StatusCode::FOUND, Duration::ZERO).await;
        let got =
            post(&client().unwrap(), &cfg(&h.url, None), &delivery("m", b"x"), Duration::from_secs(5)).await;
        let (outcome, why) = got.unwrap_err();
        assert_eq!(outcome, "refused");
        assert!(why.contains("302"), "{why}");
        // Only the webhook itself was asked; the Location (/moved) never was.
        let paths: Vec<String> = h.seen.lock().unwrap().iter().map(|s| s.1.clone()).collect();
        assert_eq!(paths, ["/hook?x=1"]);
    }

    #[tokio::test]
    async fn a_non_2xx_is_refused_and_no_answer_in_time_or_no_connection_failed() {
        let h = hook(StatusCode::INTERNAL_SERVER_ERROR, Duration::ZERO).await;
        let client = client().unwrap();
        let got = post(&client, &cfg(&h.url, None), &delivery("m", b"x"), Duration::from_secs(5)).await;
        // The status and the start of the answer say why.
        assert_eq!(got, Err(("refused", "HTTP 500 Internal Server Error: answer body".to_string())));

        let slow = hook(StatusCode::OK, Duration::from_secs(30)).await;
        let started = std::time::Instant::now();
        let got =
            post(&client, &cfg(&slow.url, None), &delivery("m", b"x"), Duration::from_millis(200)).await;
        assert_eq!(got, Err(("failed", "timeout: no answer within 200ms".to_string())));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(5), "{took:?}");

        // A port nobody listens on: bind one, note it, close it.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let got = post(
            &client,
            &cfg(&format!("http://{free}/"), None),
            &delivery("m", b"x"),
            Duration::from_secs(5),
        )
        .await;
        let (outcome, why) = got.unwrap_err();
        assert_eq!(outcome, "failed");
        assert!(why.starts_with("connection error: "), "{why}");
        assert!(why.to_lowercase().contains("refused"), "the cause is kept: {why}");
    }

    #[tokio::test]
    async fn https_urls_get_a_tls_handshake_naming_the_host_and_offering_http_1_1() {
        // A server that reads the first flight and hangs up: nothing it is sent may be in the
        // clear, and the delivery fails.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let first_flight = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = stream.read(&mut buf).await.unwrap();
            buf.truncate(n);
            buf
        });
        let url = format!("https://localhost:{port}/hook");
        let got = post(
            &client().unwrap(),
            &cfg(&url, None),
            &delivery("m", b"secret body"),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(got.unwrap_err().0, "failed");
        let hello = first_flight.await.unwrap();
        // A TLS handshake record, with the host as SNI and HTTP/1.1 as the only ALPN protocol.
        assert_eq!(hello.first(), Some(&0x16), "{hello:?}");
        let has = |needle: &[u8]| hello.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"localhost"), "no SNI in {hello:?}");
        assert!(has(b"\x00\x09\x08http/1.1"), "no ALPN list of exactly http/1.1 in {hello:?}");
        assert!(!has(b"secret body") && !has(b"POST"), "sent in the clear: {hello:?}");
    }

    #[tokio::test]
    async fn a_freed_gate_slot_goes_to_the_waiting_subscription_that_used_least() {
        let gate = Gate::new(2);
        // Subscription 1 takes both slots; 1 and then 2 wait for one more.
        let a = gate.acquire(1).await;
        let b = gate.try_acquire(1).expect("a second slot");
        assert!(gate.full() && gate.try_acquire(3).is_none());
        let waits_1 = tokio::spawn({
            let gate = gate.clone();
            async move { gate.acquire(1).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let waits_2 = tokio::spawn({
            let gate = gate.clone();
            async move { gate.acquire(2).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Subscription 2 has used no slot time, 1 has held two all along: 2 is served first
        // though it asked later.
        drop(a);
        let two = tokio::time::timeout(Duration::from_secs(5), waits_2).await.unwrap().unwrap();
        assert_eq!(two.sub, 2);
        assert!(!waits_1.is_finished());
        drop(b);
        let one = tokio::time::timeout(Duration::from_secs(5), waits_1).await.unwrap().unwrap();
        assert_eq!(one.sub, 1);
        drop((one, two));
        assert_eq!(gate.lock().free, 2);
        assert!(gate.lock().shares.is_empty());
    }

    #[tokio::test]
    async fn a_gate_wait_given_up_leaks_no_slot() {
        let gate = Gate::new(1);
        let held = gate.acquire(1).await;
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.acquire(2).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting.abort();
        let _ = waiting.await;
        drop(held);
        assert_eq!(gate.lock().free, 1);
        assert!(gate.try_acquire(3).is_some());
    }

    #[test]
    fn a_repeated_failure_is_logged_once_then_with_a_count_at_most_once_a_period() {
        let mut r = Reminder::new();
        assert_eq!(r.note(), Some(1));
        assert_eq!(r.note(), None);
        assert_eq!(r.note(), None);
        // A period later the next line carries every failure since the last one.
        r.last = Some(Instant::now() - REMIND_EVERY);
        assert_eq!(r.note(), Some(3));
        assert_eq!(r.note(), None);
    }

    #[test]
    fn a_memory_stream_is_refused_and_one_replica_is_a_warning() {
        let facts = |memory, replicas| StreamFacts { name: "S".into(), memory, replicas };
        assert!(facts(true, 3).refusal().unwrap().contains("memory"));
        assert_eq!(facts(false, 1).refusal(), None);
        assert!(facts(false, 1).warnings()[0].contains("1 replica"));
        assert!(facts(false, 3).warnings().is_empty());
    }

    #[test]
    fn the_auto_bound_on_deliveries_follows_the_open_file_limit() {
        let n = auto_in_flight();
        assert!((AUTO_IN_FLIGHT_MIN..=AUTO_IN_FLIGHT_MAX).contains(&n), "{n}");
        if let Some(limit) = open_file_limit() {
            assert_eq!(n, (limit / AUTO_IN_FLIGHT_SHARE).clamp(AUTO_IN_FLIGHT_MIN, AUTO_IN_FLIGHT_MAX));
        }
    }

    #[test]
    fn logs_show_a_target_without_its_query_and_a_config_without_its_secret() {
        assert_eq!(log_url("https://h.example/hook?token=abc#frag"), "https://h.example/hook");
        assert_eq!(log_url("not a url"), "(not a URL)");
        let shown = format!("{:?}", cfg("http://h/", Some("whsec_do_not_show")));
        assert!(!shown.contains("whsec_do_not_show") && shown.contains("<redacted>"), "{shown}");
        let rec = crate::storage::format::Push {
            target: crate::storage::format::PushTarget::Webhook,
            time_ms: 1,
            timeout_ms: 2,
            max_in_flight: 3,
            topic: b"t",
            url: b"http://h/",
            subject: b"",
            secret: b"whsec_do_not_show",
        };
        let shown = format!("{:?}", crate::storage::format::Record::Push(rec));
        assert!(!shown.contains("whsec_do_not_show") && shown.contains("<redacted>"), "{shown}");
    }

    /// The documented example: anyone can check a receiver's implementation against it.
    #[test]
    fn signature_matches_the_documented_vector() {
        let s = signature(b"whsec_test", 1_700_000_000_000, &Bytes::from_static(b"{\"order\":42}"));
        // Computed independently: python3 -c "import hmac,hashlib; print(hmac.new(b'whsec_test',
        // b'1700000000000.{\"order\":42}', hashlib.sha256).hexdigest())"
        assert_eq!(s, "t=1700000000000,v1=42a269b999e8c6a494aabde5957d5b8e8aab784e5f6d35bc14f482047cf44c8e");
        // Any change to the secret, time or body changes it.
        assert_ne!(s, signature(b"whsec_tesT", 1_700_000_000_000, &Bytes::from_static(b"{\"order\":42}")));
        assert_ne!(s, signature(b"whsec_test", 1_700_000_000_001, &Bytes::from_static(b"{\"order\":42}")));
        assert_ne!(s, signature(b"whsec_test", 1_700_000_000_000, &Bytes::from_static(b"{\"order\":43}")));
    }
}
