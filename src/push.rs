//! Push delivery: for each topic with a push subscription, delayd is the consumer. It reserves
//! due messages (time-to-run = the delivery timeout plus a margin) and POSTs each to the webhook,
//! or publishes it to a NATS JetStream subject; a 2xx (or JetStream's publish ack) acks it,
//! anything else is a nack, so the message comes back after the next step of its backoff and is
//! dead-lettered after its last attempt, as with any consumer. A delivery cut
//! short (the process killed, the subscription changed) leaves the reservation to run out, and
//! the message comes back: at least once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};
use sha2::Sha256;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::broker::Broker;
use crate::message::{Delivery, PopRequest, PushConfig};

/// How often the subscriptions are looked at again (one engine call; changes are rare).
const RECONCILE_EVERY: Duration = Duration::from_millis(500);
/// A reservation outlives the delivery's timeout by this much, so that the ack of a delivery
/// that just made it is not beaten by the reservation running out.
const TTR_MARGIN_MS: u64 = 5_000;
/// How long one pop waits for a message before the worker looks again.
const POP_WAIT_MS: u64 = 1_000;
/// Pause after the broker refused a call (it is shutting down or cannot write).
const BROKER_RETRY: Duration = Duration::from_secs(1);

/// Upper bounds of the delivery-latency histogram, seconds: a fast local endpoint answers in well
/// under a millisecond, a slow one may use its whole timeout.
const LATENCY_BUCKETS_SECONDS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Push delivery metrics, per topic.
pub struct PushMetrics {
    attempts: IntCounterVec,
    latency: HistogramVec,
    in_flight: IntGaugeVec,
}

impl PushMetrics {
    /// Empty push metrics.
    pub fn new() -> PushMetrics {
        // The `expect`s cannot fire: names, labels and buckets are constants Prometheus accepts,
        // and the unit tests build them.
        let attempts = IntCounterVec::new(
            Opts::new(
                "delayd_push_attempts_total",
                "Push deliveries tried, by topic and outcome (ok, refused: a non-2xx answer, failed: no answer in time or no connection).",
            ),
            &["topic", "outcome"],
        )
        .expect("valid counter");
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "delayd_push_duration_seconds",
                "Time from sending a push delivery until its answer (or its failure), by topic.",
            )
            .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
            &["topic"],
        )
        .expect("valid histogram");
        let in_flight = IntGaugeVec::new(
            Opts::new("delayd_push_in_flight", "Push deliveries under way now, by topic."),
            &["topic"],
        )
        .expect("valid gauge");
        PushMetrics { attempts, latency, in_flight }
    }

    /// Adds the families to `reg` for a scrape.
    pub fn register(&self, reg: &Registry) -> prometheus::Result<()> {
        reg.register(Box::new(self.attempts.clone()))?;
        reg.register(Box::new(self.latency.clone()))?;
        reg.register(Box::new(self.in_flight.clone()))
    }
}

impl Default for PushMetrics {
    fn default() -> Self {
        PushMetrics::new()
    }
}

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
    let mut workers: HashMap<String, (PushConfig, JoinHandle<()>)> = HashMap::new();
    let mut seen = None;
    loop {
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
                for (topic, cfg) in wanted {
                    if let std::collections::hash_map::Entry::Vacant(slot) = workers.entry(topic) {
                        let task = tokio::spawn(worker(broker.clone(), client.clone(), cfg.clone()));
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

/// One pooled client for every webhook: keep-alive connections, no redirects (a webhook that
/// redirects is answering with a non-2xx status), rustls for https.
fn client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("delayd/", env!("CARGO_PKG_VERSION")))
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
}

/// Consumes `cfg.topic`, keeping at most `max_in_flight` deliveries under way.
/// Where a worker's deliveries go.
#[derive(Clone)]
enum Sink {
    /// POST to the subscription's URL.
    Webhook(reqwest::Client),
    /// Publish to the subscription's JetStream subject (boxed: the context is large, and cloned
    /// once per delivery).
    Nats(Arc<async_nats::jetstream::Context>),
}

/// What became of one delivery: acked (`Ok`), or why not (the outcome label, and a reason).
type Outcome = Result<(), (&'static str, String)>;

async fn worker(broker: Broker, client: reqwest::Client, cfg: PushConfig) {
    let sink = match &cfg.nats_subject {
        None => Sink::Webhook(client),
        // With retry_on_initial_connect the client is made at once and (re)connects in the
        // background: a NATS server that is down holds up only this topic's deliveries, which
        // time out and come back on their backoff.
        Some(_) => match async_nats::ConnectOptions::new().retry_on_initial_connect().connect(&cfg.url).await
        {
            Ok(nc) => Sink::Nats(Arc::new(async_nats::jetstream::new(nc))),
            Err(e) => {
                tracing::error!(topic = %cfg.topic, url = %cfg.url, error = %e, "cannot set up the NATS client; this topic is not pushed");
                return;
            }
        },
    };
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight.max(1) as usize));
    let cfg = Arc::new(cfg);
    loop {
        let Ok(first) = slots.clone().acquire_owned().await else { return };
        let max = 1 + slots.available_permits();
        let req = PopRequest {
            topics: vec![cfg.topic.clone()],
            max,
            wait_ms: POP_WAIT_MS,
            ttr_ms: Some(u64::from(cfg.timeout_ms) + TTR_MARGIN_MS),
        };
        let got = match broker.pop(req).await {
            Ok(got) => got,
            Err(e) => {
                tracing::debug!(topic = %cfg.topic, error = %e, "push pop failed");
                drop(first);
                tokio::time::sleep(BROKER_RETRY).await;
                continue;
            }
        };
        let mut permit = Some(first);
        for d in got {
            // Only this loop takes permits, so the ones counted above are still free.
            let slot = match permit.take() {
                Some(p) => p,
                None => match slots.clone().try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let (broker, sink, cfg) = (broker.clone(), sink.clone(), cfg.clone());
            tokio::spawn(async move {
                deliver(&broker, &sink, &cfg, d).await;
                drop(slot);
            });
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
    let (ok, outcome) = match result {
        Ok(()) => (true, "ok"),
        Err((outcome, why)) => {
            tracing::debug!(topic = %cfg.topic, id = %d.id, %why, "push delivery failed");
            (false, outcome)
        }
    };
    m.attempts.with_label_values(&[cfg.topic.as_str(), outcome]).inc();
    let answered =
        if ok { broker.ack(&d.receipt).await } else { broker.nack(&d.receipt, None).await.map(|_| ()) };
    if let Err(e) = answered {
        // The reservation runs out and the message comes back: at least once.
        tracing::warn!(topic = %cfg.topic, id = %d.id, error = %e, "cannot record a push delivery's outcome");
    }
}

/// POSTs one message: a 2xx is delivered, any other status `refused`, no answer `failed`.
async fn post(client: &reqwest::Client, cfg: &PushConfig, d: &Delivery, timeout: Duration) -> Outcome {
    let mut req = client
        .post(&cfg.url)
        .timeout(timeout)
        .header("Content-Type", "application/octet-stream")
        .header("Delayd-Message-Id", &d.id)
        .header("Delayd-Topic", &cfg.topic)
        .header("Delayd-Attempt", d.attempt.to_string())
        .header("Delayd-Deliver-At", d.deliver_at_ms.to_string());
    if let Some(secret) = &cfg.secret {
        req = req.header("Delayd-Signature", signature(secret.as_bytes(), now_ms(), &d.body));
    }
    match req.body(d.body.clone()).send().await {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(("refused", format!("answered {}", r.status()))),
        Err(e) => Err(("failed", e.to_string())),
    }
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
        Ok(Err(e)) => Err(("refused", e.to_string())),
        Err(_) => Err(("failed", format!("no JetStream ack within {timeout:?}"))),
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
