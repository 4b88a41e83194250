//! Topic operations under `/v1/topics`: listing with counts, pause and resume.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::extract::PathParam;
use super::{validate, AppState};

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
