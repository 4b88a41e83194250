//! The native JSON API under `/v1`.

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::extract::{from_raw, JsonBody, PathParam};
use super::openapi::{BackoffValue, LevelValue};
use super::server::{HttpStats, ServerView};
use super::{now_ms, topic_name, validate, AppState, Limits};
use crate::message::{
    Delivery, HistoryEntry, LastError, MessageInfo, MessageState, Nacked, PopRequest, ProduceRequest,
    Produced, RescheduleRequest, Rescheduled, Stats, When,
};

// The answers below are structs rather than `json!` so that the OpenAPI schemas are derived from
// what is sent. Their fields are in alphabetical order, the order `json!` used to write them in,
// so the bytes on the wire did not change.

/// The body of a produce, one element of a batch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProduceBody {
    /// 1–128 bytes of UTF-8 without whitespace or control characters; unique across the broker.
    /// Made by the broker when absent.
    id: Option<String>,
    /// The payload, at most `max_body_bytes`.
    body: String,
    /// Delay from the server's receive time, 0..=`max_delay`. At most one of `delay_ms`,
    /// `deliver_at_ms` and `level`; none means now.
    delay_ms: Option<u64>,
    /// Absolute due time, unix ms, at most `max_delay` ahead; a past time means now. A nonzero value
    /// below 10^11 is refused: it looks like unix seconds.
    deliver_at_ms: Option<u64>,
    #[schema(value_type = Option<LevelValue>)]
    level: Option<Value>,
    /// Time-to-run of each delivery, ≥ 1.
    #[schema(minimum = 1)]
    ttr_ms: Option<u64>,
    /// Deliveries before the message is dead-lettered, ≥ 1.
    #[schema(minimum = 1)]
    max_attempts: Option<u32>,
    #[schema(value_type = Option<BackoffValue>)]
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
            When::AtMs(validate::deliver_at(limits, "deliver_at_ms", at, now_ms())?)
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

/// Where a produced message went.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ProduceAnswer {
    /// When it is due, unix ms.
    deliver_at_ms: u64,
    /// Its id, given or made.
    id: String,
}

impl From<&Produced> for ProduceAnswer {
    fn from(p: &Produced) -> Self {
        ProduceAnswer { deliver_at_ms: p.deliver_at_ms, id: p.id.clone() }
    }
}

/// The path parameter `{topic}`, as every topic route documents it.
pub(crate) const TOPIC_PARAM: &str = "The topic, percent-encoded. A name of A-Z a-z 0-9 . _ - (1–128 \
     characters) or any other (a compat topic such as order:close), stored escaped in at most 128 bytes";

/// `POST /v1/topics/{topic}/messages`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/messages",
    tag = "messages",
    operation_id = "produce",
    summary = "Produce one message",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    request_body = ProduceBody,
    responses(
        (status = 201, description = "Stored", body = ProduceAnswer),
        (status = 200, description = "An identical earlier produce: its original result", body = ProduceAnswer),
        (status = 400, description = "A field is invalid; the message names it", body = ErrorBody),
        (status = 409, description = "The id is in use with other content or another topic", body = ErrorBody),
        (status = 413, description = "The body is over max_body_bytes", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
        (status = 429, description = "It would create a topic past max_topics", body = ErrorBody),
    )
)]
pub(crate) async fn produce(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(body): JsonBody<ProduceBody>,
) -> Result<Response, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let req = body.into_request(st.limits())?;
    let produced = st.broker().produce(&topic, req).await?;
    // A repeat of an earlier identical produce is a safe retry: 200 with the original result.
    let status = if produced.created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(ProduceAnswer::from(&produced))).into_response())
}

/// The body of a batch produce.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchBody {
    // Kept as text and parsed one by one, so a bad message gets its own error in its slot.
    /// At most `max_batch` messages.
    #[schema(value_type = Vec<ProduceBody>)]
    messages: Vec<Box<serde_json::value::RawValue>>,
}

/// The answer to a batch produce: one result per message, in order.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BatchAnswer {
    results: Vec<BatchResult>,
}

/// One message's result in a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub(crate) enum BatchResult {
    /// Stored.
    Stored(ProduceAnswer),
    /// Refused; the other messages are stored all the same.
    Failed(ErrorBody),
}

/// `POST /v1/topics/{topic}/messages/batch`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/messages/batch",
    tag = "messages",
    operation_id = "produce_batch",
    summary = "Produce several messages with one flush",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    request_body = BatchBody,
    responses(
        (status = 201, description = "One result per message, in order; valid ones are stored even when others fail", body = BatchAnswer),
        (status = 400, description = "The envelope or topic is invalid", body = ErrorBody),
        (status = 413, description = "More than max_batch messages", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn produce_batch(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(batch): JsonBody<BatchBody>,
) -> Result<Response, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let limits = st.limits();
    if batch.messages.len() > limits.max_batch {
        return Err(ApiError::too_large(format!(
            "batch has {} messages, more than max_batch {}",
            batch.messages.len(),
            limits.max_batch
        )));
    }
    // Valid messages go to the broker together (one flush); invalid ones keep their slot with an error.
    let mut results: Vec<Option<BatchResult>> = Vec::with_capacity(batch.messages.len());
    let mut valid = Vec::new();
    for (i, raw) in batch.messages.into_iter().enumerate() {
        match from_raw::<ProduceBody>(&raw).and_then(|b| b.into_request(limits)) {
            Ok(req) => {
                results.push(None);
                valid.push((i, req));
            }
            Err(e) => results.push(Some(BatchResult::Failed(e.envelope()))),
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
                Ok(p) => BatchResult::Stored(ProduceAnswer::from(&p)),
                Err(e) => BatchResult::Failed(ApiError::from(e).envelope()),
            });
        }
    }
    // Every slot was filled above (the count was checked); an empty one would be a bug, and
    // shifting the others into it would misreport which message was stored.
    let results = results.into_iter().collect::<Option<Vec<_>>>().ok_or_else(|| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "a batch slot was left without a result")
    })?;
    Ok((StatusCode::CREATED, Json(BatchAnswer { results })).into_response())
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

/// The answer to a pop.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PopAnswer {
    /// Up to `max` messages, none when nothing was ready within `wait_ms`.
    messages: Vec<DeliveryAnswer>,
}

#[cfg(test)]
impl PopAnswer {
    /// The answer holding `messages` (the pop handler writes it with `json::pop_answer`).
    pub(crate) fn new(messages: Vec<DeliveryAnswer>) -> PopAnswer {
        PopAnswer { messages }
    }
}

/// One popped message.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeliveryAnswer {
    /// 1 for the first delivery.
    attempt: u32,
    /// The payload.
    body: String,
    /// When it became due, unix ms.
    deliver_at_ms: u64,
    /// Its id.
    id: String,
    /// Opaque token to ack or nack this delivery, and only this one.
    receipt: String,
}

impl From<&Delivery> for DeliveryAnswer {
    fn from(d: &Delivery) -> Self {
        DeliveryAnswer {
            attempt: d.attempt,
            body: String::from_utf8_lossy(&d.body).into_owned(),
            deliver_at_ms: d.deliver_at_ms,
            id: d.id.clone(),
            receipt: d.receipt.clone(),
        }
    }
}

/// Pops with the shutdown signal in the race, so a long-poll does not hold up a graceful stop.
pub(crate) async fn pop_or_shutdown(st: &AppState, req: PopRequest) -> Result<Vec<Delivery>, ApiError> {
    tokio::select! {
        r = st.broker().pop(req) => Ok(r?),
        _ = st.shutting_down() => Ok(Vec::new()),
    }
}

/// `POST /v1/topics/{topic}/pop?max=N&wait_ms=W&ttr_ms=T`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/pop",
    tag = "messages",
    operation_id = "pop",
    summary = "Reserve ready messages, waiting for them up to wait_ms",
    params(
        ("topic" = String, Path, description = TOPIC_PARAM),
        ("max" = Option<u32>, Query, minimum = 1, description = "Most messages to return, 1..=max_batch (default 1)"),
        ("wait_ms" = Option<u64>, Query, description = "Longest wait for a message (default 0), capped at max_wait"),
        ("ttr_ms" = Option<u64>, Query, minimum = 1, description = "Reservation length; else the message's, else default_ttr"),
    ),
    responses(
        (status = 200, description = "The reserved messages, possibly none", body = PopAnswer),
        (status = 400, description = "A query parameter is invalid or unknown", body = ErrorBody),
    )
)]
pub(crate) async fn pop(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let q = parse_pop_query(query.as_deref(), st.limits())?;
    let req = PopRequest { topics: vec![topic], max: q.max, wait_ms: q.wait_ms, ttr_ms: q.ttr_ms };
    let deliveries = pop_or_shutdown(&st, req).await?;
    // The `PopAnswer` schema, written without serde_json's escape walk over plain bodies.
    let json = super::json::pop_answer(&deliveries);
    Ok(([(axum::http::header::CONTENT_TYPE, "application/json")], json).into_response())
}

fn receipt(r: &str) -> Result<(), ApiError> {
    if r.is_empty() || r.len() > 512 {
        return Err(ApiError::invalid("receipt", "must be 1 to 512 bytes, as returned by pop"));
    }
    Ok(())
}

/// The body of an ack.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AckBody {
    /// The receipt the pop returned.
    receipt: String,
}

/// The answer to an ack.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AckAnswer {
    /// Always true: a failed ack is an error.
    acked: bool,
}

/// `POST /v1/ack`
#[utoipa::path(
    post,
    path = "/v1/ack",
    tag = "messages",
    operation_id = "ack",
    summary = "Finish a delivery: the message will not come back",
    request_body = AckBody,
    responses(
        (status = 200, description = "Acked", body = AckAnswer),
        (status = 400, description = "The receipt is malformed", body = ErrorBody),
        (status = 404, description = "Unknown or expired receipt", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn ack(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<AckBody>,
) -> Result<Json<AckAnswer>, ApiError> {
    receipt(&b.receipt)?;
    st.broker().ack(&b.receipt).await?;
    Ok(Json(AckAnswer { acked: true }))
}

/// The body of a touch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TouchBody {
    /// The receipt the pop returned; it stays valid.
    receipt: String,
    /// The reservation now ends this long after the server's receive time, ≥ 1.
    #[schema(minimum = 1)]
    ttr_ms: u64,
}

/// The answer to a touch.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TouchAnswer {
    /// When the reservation now ends, unix ms.
    expires_at_ms: u64,
}

/// `POST /v1/touch`
#[utoipa::path(
    post,
    path = "/v1/touch",
    tag = "messages",
    operation_id = "touch",
    summary = "Extend a reservation for a long job; the receipt stays valid",
    request_body = TouchBody,
    responses(
        (status = 200, description = "Extended", body = TouchAnswer),
        (status = 400, description = "The receipt is malformed or ttr_ms is invalid", body = ErrorBody),
        (status = 404, description = "Unknown or expired receipt", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn touch(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<TouchBody>,
) -> Result<Json<TouchAnswer>, ApiError> {
    receipt(&b.receipt)?;
    let ttr = validate::ttr(st.limits(), "ttr_ms", b.ttr_ms)?;
    Ok(Json(TouchAnswer { expires_at_ms: st.broker().touch(&b.receipt, ttr).await? }))
}

/// The body of a nack.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NackBody {
    /// The receipt the pop returned.
    receipt: String,
    /// Retry after this long; without it, after the next step of the message's backoff.
    delay_ms: Option<u64>,
    /// Why the work failed, kept as the message's `last_error` (durably, in the nack's own
    /// record). At most 2048 bytes are kept: a longer one is cut at a character boundary. An
    /// empty one records nothing.
    error: Option<String>,
}

/// What a nack did: `{"state":"retry","deliver_at_ms"}` or `{"state":"dead","topic"}`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct NackAnswer {
    /// With `retry`: when it comes back, unix ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    deliver_at_ms: Option<u64>,
    /// `retry`, or `dead` when its attempts are used up.
    state: NackState,
    /// With `dead`: the dead-letter topic it moved to (`{topic}.dlq`).
    #[serde(skip_serializing_if = "Option::is_none")]
    topic: Option<String>,
}

/// Where a nacked message went.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum NackState {
    /// Scheduled again.
    Retry,
    /// Dead-lettered.
    Dead,
}

impl From<Nacked> for NackAnswer {
    fn from(n: Nacked) -> Self {
        match n {
            Nacked::Retry { deliver_at_ms } => {
                NackAnswer { deliver_at_ms: Some(deliver_at_ms), state: NackState::Retry, topic: None }
            }
            Nacked::DeadLettered { topic } => NackAnswer {
                deliver_at_ms: None,
                state: NackState::Dead,
                topic: Some(topic_name::shown(&topic)),
            },
        }
    }
}

/// `POST /v1/nack`
#[utoipa::path(
    post,
    path = "/v1/nack",
    tag = "messages",
    operation_id = "nack",
    summary = "Give a delivery back: retry later, or dead-letter once attempts are used up",
    request_body = NackBody,
    responses(
        (status = 200, description = "Scheduled again or dead-lettered", body = NackAnswer),
        (status = 400, description = "A field is invalid", body = ErrorBody),
        (status = 404, description = "Unknown or expired receipt", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn nack(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<NackBody>,
) -> Result<Json<NackAnswer>, ApiError> {
    receipt(&b.receipt)?;
    let delay = b.delay_ms.map(|d| validate::delay(st.limits(), "delay_ms", d)).transpose()?;
    Ok(Json(NackAnswer::from(st.broker().nack_with_error(&b.receipt, delay, b.error).await?)))
}

/// A message as a look-up or a browse shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct MessageAnswer {
    /// Deliveries so far.
    attempt: u32,
    /// The payload.
    body: String,
    /// The dead-letter topic holding it, once it was dead-lettered.
    #[serde(skip_serializing_if = "Option::is_none")]
    dead_letter_topic: Option<String>,
    /// When it was produced, unix ms.
    created_at_ms: u64,
    /// When it is (or was) due, unix ms; while reserved, the end of the reservation; after an
    /// ack or cancel, the due time of the delivery it ended.
    deliver_at_ms: u64,
    /// Its id.
    id: String,
    /// Why its latest failed delivery failed (a nack's `error`, a push failure), once one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<LastError>,
    /// Where it is in its life.
    state: MessageState,
    /// The topic it was produced to.
    topic: String,
}

impl From<&MessageInfo> for MessageAnswer {
    fn from(m: &MessageInfo) -> Self {
        MessageAnswer {
            attempt: m.attempt,
            body: String::from_utf8_lossy(&m.body).into_owned(),
            created_at_ms: m.created_at_ms,
            dead_letter_topic: m.dead_letter_topic.as_deref().map(topic_name::shown),
            deliver_at_ms: m.deliver_at_ms,
            id: m.id.clone(),
            last_error: m.last_error.clone(),
            state: m.state,
            topic: topic_name::shown(&m.topic),
        }
    }
}

/// The path parameter `{id}`, as every message route documents it.
const ID_PARAM: &str = "The message id, percent-encoded";

/// `GET /v1/messages/{id}`
#[utoipa::path(
    get,
    path = "/v1/messages/{id}",
    tag = "messages",
    operation_id = "get_message",
    summary = "Look a message up by id",
    params(("id" = String, Path, description = ID_PARAM)),
    responses(
        (status = 200, description = "The message", body = MessageAnswer),
        (status = 400, description = "The id is invalid", body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
    )
)]
pub(crate) async fn get_message(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<MessageAnswer>, ApiError> {
    validate::id("id", &id)?;
    Ok(Json(MessageAnswer::from(&st.broker().get(&id).await?)))
}

/// The answer to a cancel.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CancelAnswer {
    /// The cancelled message.
    id: String,
    /// Always `cancelled`.
    state: MessageState,
}

/// A message's recorded changes.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HistoryAnswer {
    /// True when the list reaches back to the produce.
    complete: bool,
    /// Newest first, at most 100.
    history: Vec<HistoryEntry>,
    /// The message.
    id: String,
}

/// `GET /v1/messages/{id}/history`
#[utoipa::path(
    get,
    path = "/v1/messages/{id}/history",
    tag = "messages",
    operation_id = "history",
    summary = "A message's recorded changes, newest first",
    params(("id" = String, Path, description = ID_PARAM)),
    responses(
        (status = 200, description = "Its history", body = HistoryAnswer),
        (status = 400, description = "The id is invalid", body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
    )
)]
pub(crate) async fn history(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<HistoryAnswer>, ApiError> {
    validate::id("id", &id)?;
    let (history, complete) = st.broker().history(&id).await?;
    Ok(Json(HistoryAnswer { complete, history, id }))
}

/// `DELETE /v1/messages/{id}`
#[utoipa::path(
    delete,
    path = "/v1/messages/{id}",
    tag = "messages",
    operation_id = "cancel",
    summary = "Cancel a message that has not been acked",
    params(("id" = String, Path, description = ID_PARAM)),
    responses(
        (status = 200, description = "Cancelled", body = CancelAnswer),
        (status = 400, description = "The id is invalid", body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
        (status = 409, description = "Already acked", body = ErrorBody),
    )
)]
pub(crate) async fn cancel(
    State(st): State<AppState>,
    PathParam(id): PathParam,
) -> Result<Json<CancelAnswer>, ApiError> {
    validate::id("id", &id)?;
    st.broker().cancel(&id).await?;
    Ok(Json(CancelAnswer { id, state: MessageState::Cancelled }))
}

/// The body of a reschedule: exactly one of `delay_ms` and `deliver_at_ms`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RescheduleBody {
    /// New due time: this long after the server's receive time, 0..=`max_delay` (0: now).
    delay_ms: Option<u64>,
    /// New due time, unix ms, at most `max_delay` ahead; 0 or a past time means now. A nonzero
    /// value below 10^11 is refused: it looks like unix seconds.
    deliver_at_ms: Option<u64>,
    /// A new time-to-run for its later deliveries, ≥ 1.
    #[schema(minimum = 1)]
    ttr_ms: Option<u64>,
    /// A new limit of deliveries before it is dead-lettered, ≥ 1.
    #[schema(minimum = 1)]
    max_attempts: Option<u32>,
    /// Also move a reserved message; its consumer's receipt then stops working.
    #[serde(default)]
    force: bool,
}

impl RescheduleBody {
    /// Checks every field and builds the broker request.
    fn into_request(self, limits: &Limits) -> Result<RescheduleRequest, ApiError> {
        let when = match (self.delay_ms, self.deliver_at_ms) {
            (Some(d), None) => When::DelayMs(validate::delay(limits, "delay_ms", d)?),
            (None, Some(at)) => When::AtMs(validate::deliver_at(limits, "deliver_at_ms", at, now_ms())?),
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid("delay_ms", "give only one of delay_ms and deliver_at_ms"))
            }
            (None, None) => {
                return Err(ApiError::invalid(
                    "delay_ms",
                    "give the new due time: delay_ms, or deliver_at_ms (0 for now)",
                ))
            }
        };
        let ttr_ms = self.ttr_ms.map(|t| validate::ttr(limits, "ttr_ms", t)).transpose()?;
        if self.max_attempts == Some(0) {
            return Err(ApiError::invalid("max_attempts", "must be at least 1"));
        }
        Ok(RescheduleRequest { when, ttr_ms, max_attempts: self.max_attempts, force: self.force })
    }
}

/// Where a reschedule moved the message.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RescheduleAnswer {
    /// Its new due time, unix ms.
    deliver_at_ms: u64,
    /// The message.
    id: String,
    /// `delayed`, or `ready` (`dead` in a dead-letter topic) when due at once.
    state: MessageState,
}

impl From<Rescheduled> for RescheduleAnswer {
    fn from(r: Rescheduled) -> Self {
        RescheduleAnswer { deliver_at_ms: r.deliver_at_ms, id: r.id, state: r.state }
    }
}

/// `PATCH /v1/messages/{id}`
#[utoipa::path(
    patch,
    path = "/v1/messages/{id}",
    tag = "messages",
    operation_id = "reschedule",
    summary = "Move a pending message to a new due time, keeping its id (one durable record)",
    params(("id" = String, Path, description = ID_PARAM)),
    request_body = RescheduleBody,
    responses(
        (status = 200, description = "Moved", body = RescheduleAnswer),
        (status = 400, description = "A field is invalid; the message names it", body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
        (status = 409, description = "Done or cancelled, or reserved without \"force\": true", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn reschedule(
    State(st): State<AppState>,
    PathParam(id): PathParam,
    JsonBody(b): JsonBody<RescheduleBody>,
) -> Result<Json<RescheduleAnswer>, ApiError> {
    validate::id("id", &id)?;
    let req = b.into_request(st.limits())?;
    Ok(Json(RescheduleAnswer::from(st.broker().reschedule(&id, req).await?)))
}

/// The answer of `/v1/stats`: the store's figures, and the HTTP server's.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StatsAnswer {
    #[serde(flatten)]
    store: Stats,
    /// Connections and request bodies; absent when the router is not served by delayd's server.
    #[serde(skip_serializing_if = "Option::is_none")]
    http: Option<HttpStats>,
    /// The process' soft limit on open files (`RLIMIT_NOFILE`, raised to the hard one at start);
    /// null when unlimited or unknown.
    nofile_soft: Option<u64>,
    /// The hard limit on open files; null when unlimited or unknown.
    nofile_hard: Option<u64>,
}

/// `GET /v1/stats`
#[utoipa::path(
    get,
    path = "/v1/stats",
    tag = "operations",
    operation_id = "stats",
    summary = "Levels, topics, storage and reclaim counters",
    responses((status = 200, description = "A snapshot", body = StatsAnswer))
)]
pub(crate) async fn stats(
    State(st): State<AppState>,
    server: Option<Extension<ServerView>>,
) -> Result<Json<Value>, ApiError> {
    let mut store = st.broker().stats().await?;
    for t in &mut store.topics {
        t.topic = topic_name::shown(&t.topic);
    }
    let files = super::process::file_limit().ok();
    let answer = StatsAnswer {
        store,
        http: server.map(|Extension(s)| s.stats()),
        nofile_soft: files.and_then(|f| f.soft),
        nofile_hard: files.and_then(|f| f.hard),
    };
    serde_json::to_value(&answer).map(Json).map_err(|e| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("cannot encode stats: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> Limits {
        Limits {
            auth_token: None,
            read_token: None,
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
        assert_eq!(req(json!({"body": "", "deliver_at_ms": 0})).unwrap().when, When::AtMs(0));
        let past = 1_600_000_000_000;
        assert_eq!(req(json!({"body": "", "deliver_at_ms": past})).unwrap().when, When::AtMs(past));
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
            (json!({"body": "x", "deliver_at_ms": 1_795_660_000}), "deliver_at_ms"),
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
