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
use http_body_util::Full;
use hyper::header::{HeaderValue, ACCEPT, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, Request, Uri};
use hyper_rustls::{ConfigBuilderExt, HttpsConnector};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
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

/// Consumes `cfg.topic`, keeping at most `max_in_flight` deliveries under way.
async fn worker(broker: Broker, client: WebhookClient, cfg: PushConfig) {
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
async fn post(client: &WebhookClient, cfg: &PushConfig, d: &Delivery, timeout: Duration) -> Outcome {
    let req = webhook_request(cfg, d).map_err(|why| ("failed", why))?;
    // The timeout covers everything up to the status line: resolving, connecting, the TLS
    // handshake, sending, and the endpoint's time to answer. The answer's body is not read.
    match tokio::time::timeout(timeout, client.request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => Ok(()),
        Ok(Ok(r)) => Err(("refused", format!("answered {}", r.status()))),
        Ok(Err(e)) => Err(("failed", error_chain(&e))),
        Err(_) => Err(("failed", format!("no answer within {timeout:?}"))),
    }
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
        assert_eq!(got.unwrap_err().0, "refused");

        let slow = hook(StatusCode::OK, Duration::from_secs(30)).await;
        let started = std::time::Instant::now();
        let got =
            post(&client, &cfg(&slow.url, None), &delivery("m", b"x"), Duration::from_millis(200)).await;
        assert_eq!(got.unwrap_err().0, "failed");
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
