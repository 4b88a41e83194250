//! The native JSON API under `/v1`.

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::extract::{from_raw, JsonBody, PathParam};
use super::{now_ms, validate, AppState, Limits};
use crate::message::{Delivery, MessageInfo, Nacked, PopRequest, ProduceRequest, Produced, When};

/// The body of a produce, one element of a batch.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProduceBody {
    id: Option<String>,
    body: String,
    delay_ms: Option<u64>,
    deliver_at_ms: Option<u64>,
    level: Option<Value>,
    ttr_ms: Option<u64>,
    max_attempts: Option<u32>,
    backoff: Option<Value>,
}

impl ProduceBody {
    /// Checks every field and builds the broker request.
    fn into_request(self, limits: &Limits) -> Result<ProduceRequest, ApiError> {
        if let Some(id) = &self.id {
            validate::id("id", id)?;
        }
        validate::body(limits, &self.body)?;
        let given = [self.delay_ms.is_some(), self.deliver_at_ms.is_some(), self.level.is_some()];
        if given.iter().filter(|g| **g).count() > 1 {
            return Err(ApiError::invalid(
                "delay_ms",
                "give only one of delay_ms, deliver_at_ms and level (they are mutually exclusive)",
            ));
        }
        let when = if let Some(d) = self.delay_ms {
            When::DelayMs(validate::delay(limits, "delay_ms", d)?)
        } else if let Some(at) = self.deliver_at_ms {
            let latest = now_ms().saturating_add(limits.max_delay_ms);
            if at > latest {
                return Err(ApiError::invalid(
                    "deliver_at_ms",
                    format!("{at} is more than max_delay ({}ms) in the future", limits.max_delay_ms),
                ));
            }
            When::AtMs(at)
        } else if let Some(level) = &self.level {
            When::LevelIndex(validate::level(limits, level)?)
        } else {
            When::Now
        };
        let ttr_ms = self.ttr_ms.map(|t| validate::ttr(limits, "ttr_ms", t)).transpose()?;
        if self.max_attempts == Some(0) {
            return Err(ApiError::invalid("max_attempts", "must be at least 1"));
        }
        let backoff_ms = self.backoff.as_ref().map(|b| validate::backoff(limits, b)).transpose()?;
        Ok(ProduceRequest {
            id: self.id,
            body: Bytes::from(self.body),
            when,
            ttr_ms,
            max_attempts: self.max_attempts,
            backoff_ms,
        })
    }
}

fn produced_json(p: &Produced) -> Value {
    json!({"id": p.id, "deliver_at_ms": p.deliver_at_ms})
}

/// `POST /v1/topics/{topic}/messages`
pub(crate) async fn produce(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(body): JsonBody<ProduceBody>,
) -> Result<Response, ApiError> {
    validate::topic(&topic)?;
    let req = body.into_request(st.limits())?;
    let produced = st.broker().produce(&topic, req).await?;
    // A repeat of an earlier identical produce is a safe retry: 200 with the original result.
    let status = if produced.created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(produced_json(&produced))).into_response())
}

/// The body of a batch produce.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchBody {
    // Kept as text and parsed one by one, so a bad message gets its own error in its slot.
    messages: Vec<Box<serde_json::value::RawValue>>,
}

/// `POST /v1/topics/{topic}/messages/batch`
pub(crate) async fn produce_batch(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(batch): JsonBody<BatchBody>,
) -> Result<Response, ApiError> {
    validate::topic(&topic)?;
    let limits = st.limits();
    if batch.messages.len() > limits.max_batch {
        return Err(ApiError::too_large(format!(
            "batch has {} messages, more than max_batch {}",
            batch.messages.len(),
            limits.max_batch
        )));
    }
    // Valid messages go to the broker together (one flush); invalid ones keep their slot with an error.
    let mut results: Vec<Option<Value>> = Vec::with_capacity(batch.messages.len());
    let mut valid = Vec::new();
    for (i, raw) in batch.messages.into_iter().enumerate() {
        match from_raw::<ProduceBody>(&raw).and_then(|b| b.into_request(limits)) {
            Ok(req) => {
                results.push(None);
                valid.push((i, req));
            }
            Err(e) => results.push(Some(e.body())),
        }
    }
    if !valid.is_empty() {
        let (slots, reqs): (Vec<usize>, Vec<ProduceRequest>) = valid.into_iter().unzip();
        let outcomes = st.broker().produce_batch(&topic, reqs).await?;
        if outcomes.len() != slots.len() {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the broker returned a different number of results than messages",
            ));
        }
        for (slot, outcome) in slots.into_iter().zip(outcomes) {
            results[slot] = Some(match outcome {
                Ok(p) => produced_json(&p),
                Err(e) => ApiError::from(e).body(),
            });
        }
    }
    let results: Vec<Value> = results.into_iter().map(|r| r.unwrap_or(Value::Null)).collect();
    Ok((StatusCode::CREATED, Json(json!({"results": results}))).into_response())
}

/// Pop query parameters, parsed by hand so that every mistake gets a JSON error naming the parameter.
#[derive(Debug, PartialEq, Eq)]
struct PopQuery {
    max: usize,
    wait_ms: u64,
    ttr_ms: Option<u64>,
}

fn parse_pop_query(raw: Option<&str>, limits: &Limits) -> Result<PopQuery, ApiError> {
    let mut q = PopQuery { max: 1, wait_ms: 0, ttr_ms: None };
    for (key, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let num = || {
            value.trim().parse::<u64>().map_err(|_| {
                ApiError::invalid(&key, format!("{:?} is not a non-negative integer", value.as_ref()))
            })
        };
        match key.as_ref() {
            "max" => {
                let n = num()?;
                if n == 0 || n > limits.max_batch as u64 {
                    return Err(ApiError::invalid("max", format!("must be 1 to {}", limits.max_batch)));
                }
                q.max = n as usize;
            }
            // Longer waits are capped rather than refused, so clients need not know the server's cap.
            "wait_ms" => q.wait_ms = num()?.min(limits.max_wait_ms),
            "ttr_ms" => q.ttr_ms = Some(validate::ttr(limits, "ttr_ms", num()?)?),
            other => {
                return Err(ApiError::invalid(other, "unknown query parameter (use max, wait_ms, ttr_ms)"));
            }
        }
    }
    Ok(q)
}

fn delivery_json(d: &Delivery) -> Value {
    json!({
        "id": d.id,
        "body": String::from_utf8_lossy(&d.body),
        "receipt": d.receipt,
        "attempt": d.attempt,
        "deliver_at_ms": d.deliver_at_ms,
    })
}

/// Pops with the shutdown signal in the race, so a long-poll does not hold up a graceful stop.
pub(crate) async fn pop_or_shutdown(st: &AppState, req: PopRequest) -> Result<Vec<Delivery>, ApiError> {
    tokio::select! {
        r = st.broker().pop(req) => Ok(r?),
        _ = st.shutting_down() => Ok(Vec::new()),
    }
}

/// `POST /v1/topics/{topic}/pop?max=N&wait_ms=W&ttr_ms=T`
pub(crate) async fn pop(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    validate::topic(&topic)?;
    let q = parse_pop_query(query.as_deref(), st.limits())?;
    let req = PopRequest { topics: vec![topic], max: q.max, wait_ms: q.wait_ms, ttr_ms: q.ttr_ms };
    let deliveries = pop_or_shutdown(&st, req).await?;
    Ok(Json(json!({"messages": deliveries.iter().map(delivery_json).collect::<Vec<_>>()})))
}

fn receipt(r: &str) -> Result<(), ApiError> {
    if r.is_empty() || r.len() > 512 {
        return Err(ApiError::invalid("receipt", "must be 1 to 512 bytes, as returned by pop"));
    }
    Ok(())
}

/// The body of an ack.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AckBody {
    receipt: String,
}

/// `POST /v1/ack`
pub(crate) async fn ack(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<AckBody>,
) -> Result<Json<Value>, ApiError> {
    receipt(&b.receipt)?;
    st.broker().ack(&b.receipt).await?;
    Ok(Json(json!({"acked": true})))
}

/// The body of a nack.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NackBody {
    receipt: String,
    delay_ms: Option<u64>,
}

/// `POST /v1/nack`
pub(crate) async fn nack(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<NackBody>,
) -> Result<Json<Value>, ApiError> {
    receipt(&b.receipt)?;
    let delay = b.delay_ms.map(|d| validate::delay(st.limits(), "delay_ms", d)).transpose()?;
    Ok(Json(match st.broker().nack(&b.receipt, delay).await? {
        Nacked::Retry { deliver_at_ms } => json!({"state": "retry", "deliver_at_ms": deliver_at_ms}),
        Nacked::DeadLettered { topic } => json!({"state": "dead", "topic": topic}),
    }))
}

pub(crate) fn info_json(m: &MessageInfo) -> Value {
    let mut v = json!({
        "id": m.id,
        "topic": m.topic,
        "state": m.state,
        "deliver_at_ms": m.deliver_at_ms,
        "attempt": m.attempt,
        "created_at_ms": m.created_at_ms,
        "body": String::from_utf8_lossy(&m.body),
    });
    if let Some(dlq) = &m.dead_letter_topic {
        v["dead_letter_topic"] = json!(dlq);
    }
    v
}

/// `GET /v1/messages/{id}`
pub(crate) async fn get_message(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<Value>, ApiError> {
    validate::id("id", &id)?;
    Ok(Json(info_json(&st.broker().get(&id).await?)))
}

/// `GET /v1/messages/{id}/history`
pub(crate) async fn history(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<Value>, ApiError> {
    validate::id("id", &id)?;
    let (history, complete) = st.broker().history(&id).await?;
    Ok(Json(json!({"id": id, "history": history, "complete": complete})))
}

/// `DELETE /v1/messages/{id}`
pub(crate) async fn cancel(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<Value>, ApiError> {
    validate::id("id", &id)?;
    st.broker().cancel(&id).await?;
    Ok(Json(json!({"id": id, "state": "cancelled"})))
}

/// `GET /v1/stats`
pub(crate) async fn stats(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let stats = st.broker().stats().await?;
    serde_json::to_value(&stats).map(Json).map_err(|e| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("cannot encode stats: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            auth_token: None,
            max_body_bytes: 100,
            max_batch: 50,
            max_wait_ms: 2000,
            compat_max_wait_ms: 1000,
            compat_max_attempts: None,
            max_delay_ms: 60_000,
            levels_ms: vec![1000, 5000],
            push_allowed_hosts: None,
        }
    }

    fn req(v: Value) -> Result<ProduceRequest, ApiError> {
        let raw = serde_json::value::to_raw_value(&v).expect("a Value always serializes");
        super::super::extract::from_raw::<ProduceBody>(&raw)?.into_request(&limits())
    }

    #[test]
    fn a_bad_batch_element_names_its_field_without_a_position_inside_the_element() {
        let e = req(json!({"body": "x", "delay_ms": "soon"})).unwrap_err();
        assert_eq!(e.code, "invalid_argument");
        assert!(e.message.starts_with("invalid delay_ms: invalid type: string \"soon\""), "{}", e.message);
        assert!(!e.message.contains("line"), "{}", e.message);
        let e = req(json!({"body": "x", "colour": "red"})).unwrap_err();
        assert!(e.message.contains("unknown field `colour`") && !e.message.contains("line"), "{}", e.message);
        let e = req(json!(5)).unwrap_err();
        assert_eq!(e.code, "invalid_argument", "{}", e.message);
    }

    #[test]
    fn produce_fields_map_to_the_broker_request() {
        let r = req(json!({"id": "o-1", "body": "hi", "delay_ms": 250, "ttr_ms": 5, "max_attempts": 2,
                           "backoff": ["1s", 200]}))
        .unwrap();
        assert_eq!(r.id.as_deref(), Some("o-1"));
        assert_eq!(&r.body[..], b"hi");
        assert_eq!(r.when, When::DelayMs(250));
        assert_eq!(r.ttr_ms, Some(5));
        assert_eq!(r.max_attempts, Some(2));
        assert_eq!(r.backoff_ms, Some(vec![1000, 200]));
        assert_eq!(req(json!({"body": ""})).unwrap().when, When::Now);
        assert_eq!(req(json!({"body": "", "level": "5s"})).unwrap().when, When::LevelIndex(2));
        assert_eq!(req(json!({"body": "", "deliver_at_ms": 5})).unwrap().when, When::AtMs(5));
    }

    #[test]
    fn produce_rejections_name_the_field() {
        let cases = [
            (json!({"body": "x", "delay_ms": 60_001}), "delay_ms"),
            (json!({"body": "x", "delay_ms": -1}), "delay_ms"),
            (json!({"body": "x", "delay_ms": 1.5}), "delay_ms"),
            (json!({"body": "x", "delay_ms": "10"}), "delay_ms"),
            (json!({"body": "x", "delay_ms": 1, "level": 1}), "delay_ms"),
            (json!({"body": "x", "deliver_at_ms": u64::MAX}), "deliver_at_ms"),
            (json!({"body": "x", "level": 3}), "level"),
            (json!({"body": "x", "ttr_ms": 0}), "ttr_ms"),
            (json!({"body": "x", "max_attempts": 0}), "max_attempts"),
            (json!({"body": "x", "max_attempts": 5_000_000_000u64}), "max_attempts"),
            (json!({"body": "x", "backoff": "never"}), "backoff"),
            (json!({"body": 5}), "body"),
            (json!({"body": "x", "id": ""}), "id"),
            (json!({"body": "x", "id": 7}), "id"),
            (json!({"body": "x", "colour": "red"}), "colour"),
            (json!({"id": "a"}), "body"),
        ];
        for (v, field) in cases {
            let e = req(v.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{v}");
            assert!(e.message.contains(field), "{v}: {}", e.message);
        }
        let e = req(json!({"body": "x".repeat(101)})).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn pop_query() {
        let l = limits();
        assert_eq!(parse_pop_query(None, &l).unwrap(), PopQuery { max: 1, wait_ms: 0, ttr_ms: None });
        assert_eq!(
            parse_pop_query(Some("max=10&wait_ms=999999&ttr_ms=300"), &l).unwrap(),
            PopQuery { max: 10, wait_ms: 2000, ttr_ms: Some(300) }
        );
        for (q, field) in [
            ("max=0", "max"),
            ("max=51", "max"),
            ("max=-1", "max"),
            ("wait_ms=soon", "wait_ms"),
            ("ttr_ms=0", "ttr_ms"),
            ("colour=red", "colour"),
        ] {
            let e = parse_pop_query(Some(q), &l).unwrap_err();
            assert!(e.message.contains(field), "{q}: {}", e.message);
        }
    }
}
