//! `PUT/GET/DELETE /v1/topics/{topic}/flow`: a topic's flow control.

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::extract::{JsonBody, PathParam};
use super::native::TOPIC_PARAM;
use super::{topic_name, AppState};
use crate::message::FlowConfig;
use crate::storage::format::MAX_FLOW_VALUE;

/// The body of a `PUT`: at least one of `max_per_second` and `max_reserved`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FlowBody {
    /// Deliveries per second at most, pops and push together (1 to 1000000).
    max_per_second: Option<u64>,
    /// Deliveries at once after a quiet spell (1 to 1000000; only with `max_per_second`, whose
    /// value it defaults to).
    burst: Option<u64>,
    /// Messages of the topic reserved (popped, not yet acked) at once at most (1 to 1000000).
    max_reserved: Option<u64>,
}

/// A topic's flow control as shown.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct FlowAnswer {
    /// The topic.
    topic: String,
    /// Deliveries per second at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_per_second: Option<u32>,
    /// Deliveries at once after a quiet spell.
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<u32>,
    /// Messages reserved at once at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_reserved: Option<u32>,
    /// When it was set, unix ms.
    updated_at_ms: u64,
}

/// The answer to removing flow control.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct FlowRemoved {
    /// Always true.
    removed: bool,
    /// The topic.
    topic: String,
}

/// `field`'s value when given, checked to be 1 to [`MAX_FLOW_VALUE`].
fn limit(field: &str, v: Option<u64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if (1..=u64::from(MAX_FLOW_VALUE)).contains(&n) => Ok(Some(n as u32)),
        Some(_) => Err(ApiError::invalid(field, format!("must be 1 to {MAX_FLOW_VALUE}"))),
    }
}

/// The flow control a body asks for, or a 400 that says what is wrong with it.
fn checked(body: &FlowBody) -> Result<FlowConfig, ApiError> {
    let max_per_second = limit("max_per_second", body.max_per_second)?;
    let burst = limit("burst", body.burst)?;
    let max_reserved = limit("max_reserved", body.max_reserved)?;
    if burst.is_some() && max_per_second.is_none() {
        return Err(ApiError::invalid("burst", "only with max_per_second (it sizes the rate's bucket)"));
    }
    if max_per_second.is_none() && max_reserved.is_none() {
        return Err(ApiError::invalid(
            "max_per_second",
            "give max_per_second or max_reserved, or both (DELETE removes flow control)",
        ));
    }
    let burst = max_per_second.map(|r| burst.unwrap_or(r));
    Ok(FlowConfig { max_per_second, burst, max_reserved, updated_at_ms: 0 })
}

/// `PUT /v1/topics/{topic}/flow`
#[utoipa::path(
    put,
    path = "/v1/topics/{topic}/flow",
    tag = "topics",
    operation_id = "set_flow",
    summary = "Set or replace a topic's flow control: a rate (token bucket) and a cap on reserved messages, for pops and push",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    request_body = FlowBody,
    responses(
        (status = 200, description = "The flow control now in effect", body = FlowAnswer),
        (status = 400, description = "A limit is out of range, a burst without a rate, or no limit at all", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
        (status = 429, description = "A new topic past max_topics", body = ErrorBody),
    )
)]
pub(crate) async fn put(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(body): JsonBody<FlowBody>,
) -> Result<Json<FlowAnswer>, ApiError> {
    let stored = topic_name::stored_or_400(&topic)?;
    let cfg = checked(&body)?;
    st.broker().set_flow(&stored, Some(cfg)).await?;
    get(State(st), PathParam(topic)).await
}

/// `GET /v1/topics/{topic}/flow`
#[utoipa::path(
    get,
    path = "/v1/topics/{topic}/flow",
    tag = "topics",
    operation_id = "get_flow",
    summary = "A topic's flow control",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "The flow control in effect", body = FlowAnswer),
        (status = 404, description = "The topic has none", body = ErrorBody),
    )
)]
pub(crate) async fn get(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<FlowAnswer>, ApiError> {
    let stored = topic_name::stored_or_400(&topic)?;
    let cfg = st.broker().flow_of(&stored).await?.ok_or_else(|| {
        ApiError::from(crate::error::Error::NotFound(format!(
            "topic {:?} has no flow control",
            topic_name::shown(&stored)
        )))
    })?;
    Ok(Json(FlowAnswer {
        topic: topic_name::shown(&stored),
        max_per_second: cfg.max_per_second,
        burst: cfg.burst,
        max_reserved: cfg.max_reserved,
        updated_at_ms: cfg.updated_at_ms,
    }))
}

/// `DELETE /v1/topics/{topic}/flow`
#[utoipa::path(
    delete,
    path = "/v1/topics/{topic}/flow",
    tag = "topics",
    operation_id = "delete_flow",
    summary = "Remove a topic's flow control",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "Removed", body = FlowRemoved),
        (status = 404, description = "The topic has none", body = ErrorBody),
    )
)]
pub(crate) async fn delete(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<FlowRemoved>, ApiError> {
    let stored = topic_name::stored_or_400(&topic)?;
    st.broker().set_flow(&stored, None).await?;
    Ok(Json(FlowRemoved { removed: true, topic: topic_name::shown(&stored) }))
}
