//! Topic operations under `/v1/topics`: listing with counts, pause and resume, browsing,
//! redrive and purge.

use axum::extract::{RawQuery, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::extract::{OptionalJsonBody, PathParam};
use super::native::{MessageAnswer, TOPIC_PARAM};
use super::{topic_name, validate, AppState};
use crate::engine::WalkPos;
use crate::message::{MessageState, TopicInfo};
use crate::storage::store::dead_letter_topic;

// As in `native`: answers are structs so the OpenAPI schemas come from them, fields in the
// alphabetical order `json!` wrote them in.

/// The answer to `GET /v1/topics`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TopicsAnswer {
    /// Every topic with a queue, a live message or a pause, by name.
    topics: Vec<TopicInfo>,
}

/// `GET /v1/topics`
#[utoipa::path(
    get,
    path = "/v1/topics",
    tag = "topics",
    operation_id = "list_topics",
    summary = "Every topic with exact counts by state",
    responses((status = 200, description = "The topics, by name", body = TopicsAnswer))
)]
pub(crate) async fn list(State(st): State<AppState>) -> Result<Json<TopicsAnswer>, ApiError> {
    let mut topics = st.broker().topics().await?;
    for t in &mut topics {
        t.topic = topic_name::shown(&t.topic);
    }
    topics.sort_by(|a, b| a.topic.cmp(&b.topic));
    Ok(Json(TopicsAnswer { topics }))
}

/// The answer to a pause or resume.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PauseAnswer {
    /// Whether pops on the topic now find nothing.
    paused: bool,
    /// The topic.
    topic: String,
}

/// `POST /v1/topics/{topic}/pause`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/pause",
    tag = "topics",
    operation_id = "pause_topic",
    summary = "Stop pops on a topic (durable) until it is resumed",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "Paused", body = PauseAnswer),
        (status = 400, description = "The topic is invalid", body = ErrorBody),
        (status = 429, description = "It would create a topic past max_topics", body = ErrorBody),
    )
)]
pub(crate) async fn pause(st: State<AppState>, topic: PathParam) -> Result<Json<PauseAnswer>, ApiError> {
    set_paused(st, topic, true).await
}

/// `POST /v1/topics/{topic}/resume`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/resume",
    tag = "topics",
    operation_id = "resume_topic",
    summary = "Let pops on a paused topic find messages again",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "Resumed", body = PauseAnswer),
        (status = 400, description = "The topic is invalid", body = ErrorBody),
    )
)]
pub(crate) async fn resume(st: State<AppState>, topic: PathParam) -> Result<Json<PauseAnswer>, ApiError> {
    set_paused(st, topic, false).await
}

async fn set_paused(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    paused: bool,
) -> Result<Json<PauseAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    st.broker().set_paused(&topic, paused).await?;
    Ok(Json(PauseAnswer { paused, topic: topic_name::shown(&topic) }))
}

/// Entries per page when `limit` is not given.
const DEFAULT_LIMIT: usize = 50;

/// A page of a browse.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BrowseAnswer {
    /// At most `limit` messages; fewer does not mean the last page.
    messages: Vec<MessageAnswer>,
    /// Pass back as `cursor` for the next page; null on the last one.
    next_cursor: Option<String>,
}

/// `GET /v1/topics/{topic}/messages?state=S&limit=N&cursor=C`
#[utoipa::path(
    get,
    path = "/v1/topics/{topic}/messages",
    tag = "topics",
    operation_id = "browse_topic",
    summary = "A page of a topic's live messages in one state",
    params(
        ("topic" = String, Path, description = TOPIC_PARAM),
        ("state" = Option<String>, Query, description = "ready (default), delayed, reserved or dead (those waiting in {topic}.dlq)"),
        ("limit" = Option<u32>, Query, minimum = 1, description = "Messages per page, 1..=max_batch (default 50)"),
        ("cursor" = Option<String>, Query, description = "next_cursor of the previous page"),
    ),
    responses(
        (status = 200, description = "A page", body = BrowseAnswer),
        (status = 400, description = "A query parameter is invalid or unknown, or a bad cursor", body = ErrorBody),
    )
)]
pub(crate) async fn browse(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    RawQuery(query): RawQuery,
) -> Result<Json<BrowseAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
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
    let messages = messages.iter().map(MessageAnswer::from).collect();
    let next_cursor = next.map(|p| format!("{}.{}", p.queue, p.entry));
    Ok(Json(BrowseAnswer { messages, next_cursor }))
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
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedriveBody {
    /// Only these dead letters (at most `max_batch`); others are left alone.
    ids: Option<Vec<String>>,
}

/// The answer to a redrive.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RedriveAnswer {
    /// Dead letters moved back to the topic.
    moved: u64,
}

/// `POST /v1/topics/{topic}/redrive`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/redrive",
    tag = "topics",
    operation_id = "redrive_topic",
    summary = "Move dead letters from {topic}.dlq back to the topic, ready now",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    request_body(content = Option<RedriveBody>, description = "Optional: without a body, every dead letter"),
    responses(
        (status = 200, description = "Moved", body = RedriveAnswer),
        (status = 400, description = "The topic or an id is invalid, or too many ids", body = ErrorBody),
        (status = 415, description = "A body not sent as application/json", body = ErrorBody),
    )
)]
pub(crate) async fn redrive(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    OptionalJsonBody(body): OptionalJsonBody<RedriveBody>,
) -> Result<Json<RedriveAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
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
    Ok(Json(RedriveAnswer { moved }))
}

/// The answer to a purge.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PurgeAnswer {
    /// Messages cancelled.
    cancelled: u64,
}

/// `POST /v1/topics/{topic}/purge`
#[utoipa::path(
    post,
    path = "/v1/topics/{topic}/purge",
    tag = "topics",
    operation_id = "purge_topic",
    summary = "Cancel every delayed, ready and reserved message of a topic",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "Purged", body = PurgeAnswer),
        (status = 400, description = "The topic is invalid", body = ErrorBody),
    )
)]
pub(crate) async fn purge(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<PurgeAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let cancelled = st.broker().purge(&topic).await?;
    Ok(Json(PurgeAnswer { cancelled }))
}
