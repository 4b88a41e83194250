//! Topic operations under `/v1/topics`: listing with counts, pause and resume, browsing,
//! redrive and purge.

use axum::extract::{RawQuery, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::extract::{OptionalJsonBody, PathParam};
use super::native::info_json;
use super::{validate, AppState};
use crate::engine::WalkPos;
use crate::message::MessageState;
use crate::storage::store::dead_letter_topic;

/// `GET /v1/topics`
pub(crate) async fn list(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let topics = st.broker().topics().await?;
    Ok(Json(json!({ "topics": topics })))
}

/// `POST /v1/topics/{topic}/pause`
pub(crate) async fn pause(st: State<AppState>, topic: PathParam) -> Result<Json<Value>, ApiError> {
    set_paused(st, topic, true).await
}

/// `POST /v1/topics/{topic}/resume`
pub(crate) async fn resume(st: State<AppState>, topic: PathParam) -> Result<Json<Value>, ApiError> {
    set_paused(st, topic, false).await
}

async fn set_paused(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    paused: bool,
) -> Result<Json<Value>, ApiError> {
    validate::topic(&topic)?;
    st.broker().set_paused(&topic, paused).await?;
    Ok(Json(json!({ "topic": topic, "paused": paused })))
}

/// Entries per page when `limit` is not given.
const DEFAULT_LIMIT: usize = 50;

/// `GET /v1/topics/{topic}/messages?state=S&limit=N&cursor=C`
pub(crate) async fn browse(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    validate::topic(&topic)?;
    let (mut state, mut limit, mut at) = (MessageState::Ready, DEFAULT_LIMIT, WalkPos::default());
    let max = st.limits().max_batch;
    for (key, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match key.as_ref() {
            "state" => {
                state = match value.as_ref() {
                    "delayed" => MessageState::Delayed,
                    "ready" => MessageState::Ready,
                    "reserved" => MessageState::Reserved,
                    "dead" => MessageState::Dead,
                    other => {
                        return Err(ApiError::invalid(
                            "state",
                            format!("{other:?} is not delayed, ready, reserved or dead"),
                        ))
                    }
                }
            }
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=max).contains(n))
                    .ok_or_else(|| ApiError::invalid("limit", format!("must be 1 to {max}")))?;
            }
            "cursor" => at = parse_cursor(&value)?,
            other => {
                return Err(ApiError::invalid(other, "unknown query parameter (use state, limit, cursor)"));
            }
        }
    }
    // Dead letters wait in the dead-letter topic's queue.
    let queue = if state == MessageState::Dead && !topic.ends_with(".dlq") {
        dead_letter_topic(&topic)
    } else {
        topic
    };
    let (messages, next) = st.broker().browse(&queue, state, at, limit).await?;
    let messages: Vec<Value> = messages.iter().map(info_json).collect();
    let next_cursor = next.map(|p| format!("{}.{}", p.queue, p.entry));
    Ok(Json(json!({ "messages": messages, "next_cursor": next_cursor })))
}

/// A `next_cursor` as this server writes it: `<queue>.<entry>`.
fn parse_cursor(c: &str) -> Result<WalkPos, ApiError> {
    let bad =
        || ApiError::invalid("cursor", "not a cursor this server handed out (pass next_cursor as given)");
    let (q, e) = c.split_once('.').ok_or_else(bad)?;
    let parse = |s: &str| s.parse::<u64>().ok().filter(|_| s.bytes().all(|b| b.is_ascii_digit()));
    Ok(WalkPos { queue: parse(q).ok_or_else(bad)? as usize, entry: parse(e).ok_or_else(bad)? })
}

/// The body of a redrive: every dead letter, or those with these ids.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedriveBody {
    ids: Option<Vec<String>>,
}

/// `POST /v1/topics/{topic}/redrive`
pub(crate) async fn redrive(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    OptionalJsonBody(body): OptionalJsonBody<RedriveBody>,
) -> Result<Json<Value>, ApiError> {
    validate::topic(&topic)?;
    let ids = body.ids;
    if let Some(ids) = &ids {
        if ids.len() > st.limits().max_batch {
            return Err(ApiError::invalid("ids", format!("at most {} per call", st.limits().max_batch)));
        }
        for id in ids {
            validate::id("ids", id)?;
        }
    }
    let moved = st.broker().redrive(&topic, ids).await?;
    Ok(Json(json!({ "moved": moved })))
}

/// `POST /v1/topics/{topic}/purge`
pub(crate) async fn purge(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<Value>, ApiError> {
    validate::topic(&topic)?;
    let cancelled = st.broker().purge(&topic).await?;
    Ok(Json(json!({ "cancelled": cancelled })))
}
