//! The `push` workload: delayd delivers to a local webhook (a receiver in this process) instead of
//! consumers popping. Reports push deliveries per second when a burst falls due at once, and the
//! lateness (arrival at the webhook − due time) at paced producer rates.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};

use crate::queue::now_ms;
use crate::servers::Server;
use crate::workloads::topic;

/// One push measurement: a burst (`rate` 0) or a paced run.
#[derive(Debug, Clone, Default)]
pub struct PushRun {
    /// Producer rate in msgs/s; 0 for the burst.
    pub rate: u64,
    /// Messages the webhook received.
    pub delivered: usize,
    /// Deliveries per second: the burst's count over first-to-last arrival; a paced run's count
    /// over its length.
    pub per_sec: f64,
    /// Arrival − due time per delivery, ms, sorted (negative would be early).
    pub lateness: Vec<i64>,
}

#[derive(Default)]
struct Seen {
    arrivals: Vec<(i64, i64)>,
}

/// Starts the receiver on a free port; returns its URL and what it saw.
async fn receiver() -> Result<(String, Arc<Mutex<Seen>>), String> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let state = seen.clone();
    let app = axum::Router::new().fallback(move |headers: HeaderMap| {
        let state = state.clone();
        async move {
            let due = headers
                .get("delayd-deliver-at")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0);
            state.lock().unwrap_or_else(|p| p.into_inner()).arrivals.push((now_ms(), due));
            StatusCode::OK
        }
    });
    let listener =
        tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("receiver bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("receiver address: {e}"))?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("http://{addr}/hook"), seen))
}

async fn check(resp: reqwest::Response) -> Result<(), String> {
    if resp.status().is_success() {
        return Ok(());
    }
    let status = resp.status();
    Err(format!(
        "HTTP {status}: {}",
        resp.text().await.unwrap_or_default().chars().take(200).collect::<String>()
    ))
}

/// Produces `n` messages of `body_bytes` due at `at_ms` (or after `delay_ms`), in batches of 1,000.
async fn produce(
    http: &reqwest::Client,
    base: &str,
    topic: &str,
    n: usize,
    when: serde_json::Value,
    body_bytes: usize,
) -> Result<(), String> {
    let body = "x".repeat(body_bytes);
    let mut left = n;
    while left > 0 {
        let k = left.min(1000);
        let mut m = serde_json::json!({"body": body});
        if let Some(obj) = when.as_object() {
            for (key, v) in obj {
                m[key] = v.clone();
            }
        }
        let msgs = vec![m; k];
        let resp = http
            .post(format!("{base}/v1/topics/{topic}/messages/batch"))
            .json(&serde_json::json!({ "messages": msgs }))
            .send()
            .await
            .map_err(|e| format!("produce: {e}"))?;
        check(resp).await?;
        left -= k;
    }
    Ok(())
}

/// Runs the burst and each paced rate on `server` (a delayd).
pub async fn run(
    server: &Server,
    burst: usize,
    rates: &[u64],
    secs: f64,
    body_bytes: usize,
) -> Result<Vec<PushRun>, String> {
    let base = format!("http://127.0.0.1:{}", server.port);
    let http = reqwest::Client::new();
    let mut out = Vec::new();
    for rate in std::iter::once(0).chain(rates.iter().copied()) {
        let (url, seen) = receiver().await?;
        let t = topic("push");
        let resp = http
            .put(format!("{base}/v1/topics/{t}/push"))
            .json(&serde_json::json!({"url": url, "max_in_flight": 64, "timeout_ms": 10_000}))
            .send()
            .await
            .map_err(|e| format!("subscribe: {e}"))?;
        check(resp).await?;
        let expected = if rate == 0 {
            // Everything due at the same moment, far enough ahead that producing is over by then.
            let at = now_ms() + 3_000 + (burst as i64 / 20);
            produce(&http, &base, &t, burst, serde_json::json!({"deliver_at_ms": at}), body_bytes).await?;
            burst
        } else {
            // Every 10 ms, a batch of rate/100 due one second later.
            let per_tick = (rate / 100).max(1) as usize;
            let ticks = (secs * 100.0) as usize;
            let start = Instant::now();
            for i in 0..ticks {
                let next = start + Duration::from_millis(10 * i as u64);
                tokio::time::sleep_until(next.into()).await;
                produce(&http, &base, &t, per_tick, serde_json::json!({"delay_ms": 1000}), body_bytes)
                    .await?;
            }
            per_tick * ticks
        };
        let deadline = Instant::now() + Duration::from_secs(60 + expected as u64 / 1000);
        loop {
            let n = seen.lock().unwrap_or_else(|p| p.into_inner()).arrivals.len();
            if n >= expected {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("only {n} of {expected} pushes arrived at {rate} msgs/s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let arrivals = std::mem::take(&mut seen.lock().unwrap_or_else(|p| p.into_inner()).arrivals);
        let mut lateness: Vec<i64> = arrivals.iter().map(|(at, due)| at - due).collect();
        lateness.sort_unstable();
        let first = arrivals.iter().map(|a| a.0).min().unwrap_or(0);
        let last = arrivals.iter().map(|a| a.0).max().unwrap_or(0);
        let per_sec = if rate == 0 {
            arrivals.len() as f64 / (((last - first) as f64) / 1000.0).max(0.001)
        } else {
            arrivals.len() as f64 / secs
        };
        let _ = http.delete(format!("{base}/v1/topics/{t}/push")).send().await;
        out.push(PushRun { rate, delivered: arrivals.len(), per_sec, lateness });
    }
    Ok(out)
}
