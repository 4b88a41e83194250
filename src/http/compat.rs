//! A drop-in for the HTTP API of ouqiang/delay-queue: `/push`, `/pop`, `/finish`, `/delete`, `/get`.
//!
//! Every reply is HTTP 200 with `{"code": 0|1, "message", "data"}` as that API does. Bodies are read as
//! JSON whatever the Content-Type says (its clients, and curl, often send a form type with a JSON body);
//! a body that is not JSON is read as `application/x-www-form-urlencoded`. Unlike that API, delays
//! count from the push to the millisecond, so a job never fires early.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::RawBody;
use super::native::pop_or_shutdown;
use super::{topic_name, validate, AppState};
use crate::error::Error;
use crate::limits::COMPAT_MAX_TTR_S;
use crate::message::{MessageState, PopRequest, ProduceRequest, When};

/// Checks a compat job id: the original takes any non-empty string; storage refuses control
/// characters and more than 128 bytes.
fn compat_id(id: &str) -> Result<(), String> {
    crate::engine::validate_id(id).map_err(|e| e.to_string())
}

/// The raw request body; even a failure to read it (too large, cut off) is a `code: 1` reply with HTTP 200.
pub(crate) struct CompatBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for CompatBody {
    type Rejection = Json<CompatReply>;

    async fn from_request(req: Request, state: &S) -> Result<Self, Json<CompatReply>> {
        match RawBody::from_request(req, state).await {
            Ok(RawBody(bytes)) => Ok(CompatBody(bytes)),
            Err(e) => Err(fail(e.message)),
        }
    }
}

/// A refused bearer token on a compat path: HTTP 401 (missing or wrong) or 403 (read-only) as on
/// `/v1`, with the compat body shape its clients parse (`code` 1, the message, `data` null). A 403
/// also carries the `/v1` `error` object, so either kind of client reads why.
pub(crate) fn refused(denied: ApiError) -> axum::response::Response {
    use axum::response::IntoResponse;
    if denied.status == axum::http::StatusCode::FORBIDDEN {
        let body = serde_json::json!({
            "code": 1,
            "message": denied.message,
            "data": null,
            "error": {"code": denied.code, "message": denied.message},
        });
        return (denied.status, Json(body)).into_response();
    }
    let mut resp = (denied.status, reply(1, &denied.message, Value::Null)).into_response();
    resp.headers_mut()
        .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
    resp
}

/// Every compat answer, errors and 401 included. Fields in the alphabetical order `json!` wrote
/// them in; the OpenAPI schema is derived from this struct.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CompatReply {
    /// 0 on success, 1 on failure.
    code: u8,
    /// What the call returns (see each path), or null.
    #[schema(value_type = Option<Object>)]
    data: Value,
    /// `ok`, or what went wrong.
    message: String,
}

fn reply(code: u8, message: &str, data: Value) -> Json<CompatReply> {
    Json(CompatReply { code, data, message: message.to_string() })
}

fn ok(data: Value) -> Json<CompatReply> {
    reply(0, "ok", data)
}

fn fail(message: impl Into<String>) -> Json<CompatReply> {
    reply(1, &message.into(), Value::Null)
}

// The request bodies below only describe what `fields` reads from a JSON object or a form: the
// handlers read any method, any content type, and numbers as numbers or strings, which a typed
// struct could not take as the original does.

/// `/push`: a job.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only, never built
pub(crate) struct CompatPushBody {
    /// Any non-empty string.
    topic: String,
    /// Any non-empty string; a job with this id is replaced.
    id: String,
    /// Seconds from now, ≥ 0.
    delay: u64,
    /// Time-to-run in seconds, 1..=86400.
    ttr: u32,
    /// The payload.
    body: String,
}

/// `/pop`: the topics to pop from.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only, never built
pub(crate) struct CompatPopBody {
    /// One topic, or several as `a,b`.
    topic: String,
}

/// `/finish`, `/delete`, `/get`: the job's id.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only, never built
pub(crate) struct CompatIdBody {
    /// The job id.
    id: String,
}

const COMPAT_METHODS: &str = "Any method but HEAD is accepted, as by the original; clients use POST. \
    The body is read as JSON whatever the Content-Type, else as a form.";

/// Reads the fields of a compat request from a JSON object or a form body.
fn fields(body: &[u8]) -> Result<Map<String, Value>, String> {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return match v {
            Value::Object(m) => Ok(m),
            _ => Err("request body must be a JSON object".into()),
        };
    }
    let text =
        std::str::from_utf8(body).map_err(|_| "request body is neither JSON nor a form".to_string())?;
    if !text.contains('=') {
        return Err("cannot parse request body as JSON or as a form".into());
    }
    Ok(form_urlencoded::parse(text.as_bytes())
        .map(|(k, v)| (k.into_owned(), Value::String(v.into_owned())))
        .collect())
}

fn string_field(m: &Map<String, Value>, key: &str) -> Result<String, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.trim().to_string()),
        Some(other) => Err(format!("{key} must be a string, got {other}")),
    }
}

/// An integer field that a JSON client sends as a number and a form as a string.
fn int_field(m: &Map<String, Value>, key: &str) -> Result<i64, String> {
    let bad = || format!("{key} must be an integer number of seconds");
    match m.get(key) {
        None | Some(Value::Null) => Err(format!("{key} is required")),
        Some(Value::Number(n)) => n.as_i64().ok_or_else(bad),
        Some(Value::String(s)) => s.trim().parse::<i64>().map_err(|_| bad()),
        Some(_) => Err(bad()),
    }
}

fn api_message(e: ApiError) -> String {
    e.message
}

fn push_request(st: &AppState, m: &Map<String, Value>) -> Result<(String, ProduceRequest), String> {
    let limits = st.limits();
    let topic = string_field(m, "topic")?;
    let id = string_field(m, "id")?;
    let body = string_field(m, "body")?;
    if id.is_empty() {
        return Err("id must not be empty".into());
    }
    if topic.is_empty() {
        return Err("topic must not be empty".into());
    }
    let topic = topic_name::stored(&topic)?;
    compat_id(&id)?;
    validate::body(limits, &body).map_err(api_message)?;
    let delay = int_field(m, "delay")?;
    let delay_ms = u64::try_from(delay)
        .ok()
        .and_then(|d| d.checked_mul(1000))
        .filter(|d| *d <= limits.max_delay_ms)
        .ok_or_else(|| format!("delay must be 0 to {} seconds", limits.max_delay_ms / 1000))?;
    let ttr = int_field(m, "ttr")?;
    let ttr_s = u64::try_from(ttr)
        .ok()
        .filter(|t| (1..=COMPAT_MAX_TTR_S).contains(t))
        .ok_or_else(|| format!("ttr must be 1 to {COMPAT_MAX_TTR_S} seconds"))?;
    let req = ProduceRequest {
        id: Some(id),
        body: body.into(),
        when: When::DelayMs(delay_ms),
        ttr_ms: Some(ttr_s * 1000),
        max_attempts: Some(limits.compat_max_attempts.unwrap_or(crate::limits::UNLIMITED_ATTEMPTS)),
        backoff_ms: None,
    };
    Ok((topic, req))
}

/// `POST /push {topic, id, delay, ttr, body}`
#[utoipa::path(
    post,
    path = "/push",
    tag = "compat",
    operation_id = "compat_push",
    summary = "Add or replace a job (ouqiang/delay-queue)",
    description = COMPAT_METHODS,
    request_body(content((CompatPushBody = "application/json"), (CompatPushBody = "application/x-www-form-urlencoded"))),
    responses(
        (status = 200, description = "code 0 and data null, or code 1 and why", body = CompatReply),
        (status = 401, description = "Missing or wrong bearer token (code 1)", body = CompatReply),
    )
)]
pub(crate) async fn push(State(st): State<AppState>, CompatBody(raw): CompatBody) -> Json<CompatReply> {
    let m = match fields(&raw) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    let (topic, req) = match push_request(&st, &m) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    // The original stores a job with a Redis SET: a push always wins over the job its id named.
    match st.broker().replace(&topic, req).await {
        Ok(()) => ok(Value::Null),
        Err(e) => fail(format!("push failed: {}", ApiError::from(e).message)),
    }
}

/// `POST /pop {topic}`: comma-separated topics, long-polls up to `compat_max_wait`.
#[utoipa::path(
    post,
    path = "/pop",
    tag = "compat",
    operation_id = "compat_pop",
    summary = "Take one ready job, waiting up to compat_max_wait (ouqiang/delay-queue)",
    description = COMPAT_METHODS,
    request_body(content((CompatPopBody = "application/json"), (CompatPopBody = "application/x-www-form-urlencoded"))),
    responses(
        (status = 200, description = "data {id, body, topic}, or null when nothing came", body = CompatReply),
        (status = 401, description = "Missing or wrong bearer token (code 1)", body = CompatReply),
    )
)]
pub(crate) async fn pop(State(st): State<AppState>, CompatBody(raw): CompatBody) -> Json<CompatReply> {
    let topics = match fields(&raw).and_then(|m| string_field(&m, "topic")) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let topics: Vec<&str> = topics.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
    if topics.is_empty() {
        return fail("topic must not be empty");
    }
    let topics = match topics.into_iter().map(topic_name::stored).collect::<Result<Vec<_>, _>>() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let req = PopRequest { topics, max: 1, wait_ms: st.limits().compat_max_wait_ms, ttr_ms: None };
    match pop_or_shutdown(&st, req).await {
        Ok(deliveries) => match deliveries.first() {
            // `topic` is not in the original's answer; a popular fork of its client reads it.
            Some(d) => ok(json!({
                "id": d.id,
                "body": String::from_utf8_lossy(&d.body),
                "topic": topic_name::shown(&d.topic),
            })),
            None => ok(Value::Null),
        },
        Err(e) => fail(format!("pop failed: {}", e.message)),
    }
}

fn id_of(raw: &[u8]) -> Result<String, String> {
    let id = string_field(&fields(raw)?, "id")?;
    if id.is_empty() {
        return Err("id must not be empty".into());
    }
    compat_id(&id)?;
    Ok(id)
}

/// Whether an error only says the job is already gone, which the original API treats as success.
fn already_gone(e: &Error) -> bool {
    matches!(e, Error::NotFound(_) | Error::Conflict(_))
}

/// `POST /finish {id}`: the job is done; in the original API this removes it in any state.
#[utoipa::path(
    post,
    path = "/finish",
    tag = "compat",
    operation_id = "compat_finish",
    summary = "Finish a job (ouqiang/delay-queue)",
    description = COMPAT_METHODS,
    request_body(content((CompatIdBody = "application/json"), (CompatIdBody = "application/x-www-form-urlencoded"))),
    responses(
        (status = 200, description = "code 0 and data null, or code 1 and why", body = CompatReply),
        (status = 401, description = "Missing or wrong bearer token (code 1)", body = CompatReply),
    )
)]
pub(crate) async fn finish(State(st): State<AppState>, CompatBody(raw): CompatBody) -> Json<CompatReply> {
    let id = match id_of(&raw) {
        Ok(id) => id,
        Err(e) => return fail(e),
    };
    match st.broker().ack_id(&id).await {
        Ok(()) => ok(Value::Null),
        Err(e) if already_gone(&e) => match st.broker().cancel(&id).await {
            Ok(()) => ok(Value::Null),
            Err(e) if already_gone(&e) => ok(Value::Null),
            Err(e) => fail(format!("finish failed: {}", ApiError::from(e).message)),
        },
        Err(e) => fail(format!("finish failed: {}", ApiError::from(e).message)),
    }
}

/// `POST /delete {id}`
#[utoipa::path(
    post,
    path = "/delete",
    tag = "compat",
    operation_id = "compat_delete",
    summary = "Delete a job; an unknown id is not an error (ouqiang/delay-queue)",
    description = COMPAT_METHODS,
    request_body(content((CompatIdBody = "application/json"), (CompatIdBody = "application/x-www-form-urlencoded"))),
    responses(
        (status = 200, description = "code 0 and data null, or code 1 and why", body = CompatReply),
        (status = 401, description = "Missing or wrong bearer token (code 1)", body = CompatReply),
    )
)]
pub(crate) async fn delete(State(st): State<AppState>, CompatBody(raw): CompatBody) -> Json<CompatReply> {
    let id = match id_of(&raw) {
        Ok(id) => id,
        Err(e) => return fail(e),
    };
    match st.broker().cancel(&id).await {
        Ok(()) => ok(Value::Null),
        Err(e) if already_gone(&e) => ok(Value::Null),
        Err(e) => fail(format!("delete failed: {}", ApiError::from(e).message)),
    }
}

/// `POST /get {id}`: `data` is the job with `delay` as absolute unix seconds, or null once it is gone.
#[utoipa::path(
    post,
    path = "/get",
    tag = "compat",
    operation_id = "compat_get",
    summary = "Look a job up (ouqiang/delay-queue)",
    description = COMPAT_METHODS,
    request_body(content((CompatIdBody = "application/json"), (CompatIdBody = "application/x-www-form-urlencoded"))),
    responses(
        (status = 200, description = "data {topic, id, delay (absolute unix s), ttr, body}, or null once finished or deleted", body = CompatReply),
        (status = 401, description = "Missing or wrong bearer token (code 1)", body = CompatReply),
    )
)]
pub(crate) async fn get(State(st): State<AppState>, CompatBody(raw): CompatBody) -> Json<CompatReply> {
    let id = match id_of(&raw) {
        Ok(id) => id,
        Err(e) => return fail(e),
    };
    match st.broker().get(&id).await {
        Ok(info) if !matches!(info.state, MessageState::Done | MessageState::Cancelled) => ok(json!({
            "topic": topic_name::shown(&info.topic),
            "id": info.id,
            // Rounded up so a client never computes a time before the real due time.
            "delay": info.deliver_at_ms.div_ceil(1000),
            "ttr": info.ttr_ms.div_ceil(1000),
            "body": String::from_utf8_lossy(&info.body),
        })),
        Ok(_) => ok(Value::Null),
        Err(Error::NotFound(_)) => ok(Value::Null),
        Err(e) => fail(format!("get failed: {}", ApiError::from(e).message)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_parse_as_json_or_form() {
        let m = fields(br#"{"topic":"t","id":"1","delay":3,"ttr":5,"body":"b"}"#).unwrap();
        assert_eq!(int_field(&m, "delay"), Ok(3));
        assert_eq!(string_field(&m, "topic"), Ok("t".into()));
        let m = fields(b"topic=t&id=1&delay=3&ttr=5&body=%7B%22a%22%3A1%7D").unwrap();
        assert_eq!(int_field(&m, "delay"), Ok(3));
        assert_eq!(string_field(&m, "body"), Ok("{\"a\":1}".into()));
        assert!(fields(b"[1,2]").is_err());
        assert!(fields(b"garbage").is_err());
        assert!(fields(&[0xff, 0xfe]).is_err());
        let m = fields(br#"{"delay":"x","ttr":1.5,"body":3}"#).unwrap();
        assert!(int_field(&m, "delay").is_err());
        assert!(int_field(&m, "ttr").is_err());
        assert!(int_field(&m, "missing").unwrap_err().contains("required"));
        assert!(string_field(&m, "body").is_err());
    }
}
