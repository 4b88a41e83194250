//! `PUT/GET/DELETE /v1/topics/{topic}/push`: a topic's push subscription.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use url::Url;
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::extract::{JsonBody, PathParam};
use super::native::TOPIC_PARAM;
use super::{topic_name, AppState};
use crate::message::PushConfig;
use crate::storage::format::{MAX_PUSH_SECRET_BYTES, MAX_PUSH_URL_BYTES};

/// Delivery timeout when the subscription names none, ms.
const DEFAULT_TIMEOUT_MS: u32 = 10_000;
/// Longest delivery timeout a subscription may ask for, ms.
const MAX_TIMEOUT_MS: u32 = 300_000;
/// Deliveries under way at once when the subscription names no limit.
const DEFAULT_MAX_IN_FLIGHT: u32 = 16;
/// Most deliveries under way at once a subscription may ask for.
const MAX_IN_FLIGHT: u32 = 1_024;

/// Held from counting the subscriptions until the new one is stored, so two PUTs at once cannot
/// both take the last place under `max_push_subscriptions`.
static SUBSCRIBING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The body of a subscribe: `url` (a webhook) or `nats`, not both. Its `Debug` never shows the
/// secret.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PushBody {
    /// The webhook each due message is POSTed to (`http` or `https`).
    url: Option<String>,
    /// Signs each POST (`Delayd-Signature`); webhooks only; never shown back.
    secret: Option<String>,
    /// How long one delivery may take, ms (1 to 300000, default 10000).
    timeout_ms: Option<u32>,
    /// Most deliveries under way at once (1 to 1024, default 16).
    max_in_flight: Option<u32>,
    /// A NATS JetStream target instead of a webhook.
    nats: Option<NatsTarget>,
}

impl std::fmt::Debug for PushBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushBody")
            .field("url", &self.url)
            .field("secret", &self.secret.as_ref().map(|_| crate::message::REDACTED))
            .field("timeout_ms", &self.timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("nats", &self.nats)
            .finish()
    }
}

/// A NATS JetStream target.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NatsTarget {
    /// The NATS server (`nats://` or `tls://`).
    url: String,
    /// The subject each due message is published to.
    subject: String,
}

/// A push subscription as shown (never its secret).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PushAnswer {
    /// Failed deliveries since the last success (kept in memory: 0 after a restart).
    consecutive_failures: u64,
    /// When it was set, unix ms.
    created_at_ms: u64,
    /// Deliveries the target accepted in the last 60 seconds.
    delivered_1m: u64,
    /// Deliveries that failed in the last 60 seconds.
    failed_1m: u64,
    /// Whether POSTs are signed.
    has_secret: bool,
    /// The last failed delivery: what happened (HTTP status and the start of the answer, a
    /// timeout, a connection error) and when; null while none failed since this process started.
    last_error: Option<crate::push_health::LastError>,
    /// When the target last accepted a delivery, unix ms; null while none did since this process
    /// started.
    last_success_ms: Option<u64>,
    /// Most deliveries under way at once.
    max_in_flight: u32,
    /// The NATS JetStream target, for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    nats: Option<NatsTarget>,
    /// How long one delivery may take, ms.
    timeout_ms: u32,
    /// The topic consumed.
    topic: String,
    /// The webhook, for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    /// What weakens delivery to this target, found when it was set (a NATS stream with one
    /// replica, or one that could not be read then); absent when nothing does.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
}

/// The answer to removing a subscription.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RemovedAnswer {
    /// Always true.
    removed: bool,
    /// The topic.
    topic: String,
}

/// `PUT /v1/topics/{topic}/push`
#[utoipa::path(
    put,
    path = "/v1/topics/{topic}/push",
    tag = "push",
    operation_id = "set_push",
    summary = "Set or replace a topic's push subscription (a webhook or a NATS JetStream subject)",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    request_body = PushBody,
    responses(
        (status = 200, description = "The subscription", body = PushAnswer),
        (status = 400, description = "A field is invalid, the host is not allowed, or the NATS stream keeps messages in memory only", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
        (status = 429, description = "A new subscription past max_push_subscriptions, or a new topic past max_topics", body = ErrorBody),
    )
)]
pub(crate) async fn put(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
    JsonBody(body): JsonBody<PushBody>,
) -> Result<Json<PushAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let allowed = st.limits().push_allowed_hosts.as_deref();
    let (url, nats_subject) = match (body.url, body.nats) {
        (Some(url), None) => {
            check_url(&url, &["http", "https"], "url", allowed)?;
            (url, None)
        }
        (None, Some(n)) => {
            check_url(&n.url, &["nats", "tls"], "nats.url", allowed)?;
            check_subject(&n.subject)?;
            (n.url, Some(n.subject))
        }
        (Some(_), Some(_)) => return Err(ApiError::invalid("url", "give url (a webhook) or nats, not both")),
        (None, None) => {
            return Err(ApiError::invalid(
                "url",
                "required: the webhook to POST each message to (or nats: {url, subject})",
            ))
        }
    };
    if body.secret.is_some() && nats_subject.is_some() {
        return Err(ApiError::invalid("secret", "signs webhook requests only; a NATS target has none"));
    }
    if let Some(s) = &body.secret {
        if s.is_empty() || s.len() > MAX_PUSH_SECRET_BYTES {
            return Err(ApiError::invalid("secret", format!("must be 1 to {MAX_PUSH_SECRET_BYTES} bytes")));
        }
    }
    let timeout_ms = body.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
    if !(1..=MAX_TIMEOUT_MS).contains(&timeout_ms) {
        return Err(ApiError::invalid("timeout_ms", format!("must be 1 to {MAX_TIMEOUT_MS}")));
    }
    let max_in_flight = body.max_in_flight.unwrap_or(DEFAULT_MAX_IN_FLIGHT);
    if !(1..=MAX_IN_FLIGHT).contains(&max_in_flight) {
        return Err(ApiError::invalid("max_in_flight", format!("must be 1 to {MAX_IN_FLIGHT}")));
    }
    // Checked before the stream is asked for too, so a PUT that will be refused does not wait on a
    // NATS server first.
    room_for(&st, &topic).await?;
    let warnings = match &nats_subject {
        Some(subject) => nats_warnings(&topic, &url, subject).await?,
        None => Vec::new(),
    };
    let cfg = PushConfig {
        topic: topic.clone(),
        url,
        nats_subject,
        secret: body.secret,
        timeout_ms,
        max_in_flight,
        created_at_ms: 0,
    };
    {
        let _one_at_a_time = SUBSCRIBING.lock().await;
        room_for(&st, &topic).await?;
        st.broker().set_push(&topic, Some(cfg)).await?;
    }
    // `get` takes the name as the client wrote it, as every route does.
    let Json(mut answer) = get(State(st), PathParam(topic_name::shown(&topic))).await?;
    answer.warnings = warnings;
    Ok(Json(answer))
}

/// 429 when `topic` has no subscription and `max_push_subscriptions` exist already.
async fn room_for(st: &AppState, topic: &str) -> Result<(), ApiError> {
    let (_, subs) = st.broker().pushes().await?;
    let cap = st.broker().config().max_push_subscriptions;
    if subs.len() >= cap && !subs.iter().any(|s| s.topic == topic) {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_push_subscriptions",
            format!(
                "{} push subscriptions exist, the most max_push_subscriptions allows; topic {topic:?} has none",
                subs.len()
            ),
        ));
    }
    Ok(())
}

/// Reads the JetStream stream a NATS subscription would publish to: a memory stream is refused
/// (its server's restart loses what delayd delivered and forgot); what weakens the guarantee
/// otherwise is returned for the answer, and logged.
async fn nats_warnings(topic: &str, url: &str, subject: &str) -> Result<Vec<String>, ApiError> {
    let warnings = match crate::push::check_nats_stream(url, subject, crate::push::NATS_CHECK_TIMEOUT).await {
        Ok(facts) => {
            if let Some(why) = facts.refusal() {
                return Err(ApiError::invalid("nats", why));
            }
            facts.warnings()
        }
        // Accepted: the stream may come later. The worker reads it before its first delivery and
        // does not deliver to a memory stream.
        Err(why) => vec![format!(
            "cannot read the stream's configuration now ({why}); delayd reads it again before the first delivery and does not deliver to a stream kept in memory"
        )],
    };
    for w in &warnings {
        tracing::warn!(topic, url, "push subscription: {w}");
    }
    Ok(warnings)
}

/// `GET /v1/topics/{topic}/push`
#[utoipa::path(
    get,
    path = "/v1/topics/{topic}/push",
    tag = "push",
    operation_id = "get_push",
    summary = "A topic's push subscription (never its secret)",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "The subscription", body = PushAnswer),
        (status = 404, description = "The topic has none", body = ErrorBody),
    )
)]
pub(crate) async fn get(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<PushAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    let cfg = st.broker().push_of(&topic).await?.ok_or_else(|| {
        ApiError::from(crate::error::Error::NotFound(format!(
            "topic {:?} has no push subscription",
            topic_name::shown(&topic)
        )))
    })?;
    // Never the secret itself: only whether there is one.
    let (url, nats) = match cfg.nats_subject {
        Some(subject) => (None, Some(NatsTarget { url: cfg.url, subject })),
        None => (Some(cfg.url), None),
    };
    let health = st.broker().push_metrics().health.view(&cfg.topic, super::now_ms());
    Ok(Json(PushAnswer {
        consecutive_failures: health.consecutive_failures,
        created_at_ms: cfg.created_at_ms,
        delivered_1m: health.delivered_1m,
        failed_1m: health.failed_1m,
        last_error: health.last_error,
        last_success_ms: health.last_success_ms,
        has_secret: cfg.secret.is_some(),
        max_in_flight: cfg.max_in_flight,
        nats,
        timeout_ms: cfg.timeout_ms,
        topic: topic_name::shown(&cfg.topic),
        url,
        warnings: Vec::new(),
    }))
}

/// `DELETE /v1/topics/{topic}/push`
#[utoipa::path(
    delete,
    path = "/v1/topics/{topic}/push",
    tag = "push",
    operation_id = "delete_push",
    summary = "Remove a topic's push subscription",
    params(("topic" = String, Path, description = TOPIC_PARAM)),
    responses(
        (status = 200, description = "Removed", body = RemovedAnswer),
        (status = 404, description = "The topic has none", body = ErrorBody),
    )
)]
pub(crate) async fn delete(
    State(st): State<AppState>,
    PathParam(topic): PathParam,
) -> Result<Json<RemovedAnswer>, ApiError> {
    let topic = topic_name::stored_or_400(&topic)?;
    st.broker().set_push(&topic, None).await?;
    Ok(Json(RemovedAnswer { removed: true, topic: topic_name::shown(&topic) }))
}

/// Only absolute URLs of one of `schemes` with a host (one of `allowed`, when set), without
/// credentials in them.
fn check_url(url: &str, schemes: &[&str], field: &str, allowed: Option<&[String]>) -> Result<(), ApiError> {
    if url.len() > MAX_PUSH_URL_BYTES {
        return Err(ApiError::invalid(field, format!("must be at most {MAX_PUSH_URL_BYTES} bytes")));
    }
    let parsed = Url::parse(url).map_err(|e| ApiError::invalid(field, format!("not a URL: {e}")))?;
    if !schemes.contains(&parsed.scheme()) {
        return Err(ApiError::invalid(field, format!("only {} URLs", schemes.join(" and "))));
    }
    let host = parsed.host_str().unwrap_or_default().trim_matches(['[', ']']).to_ascii_lowercase();
    if host.is_empty() {
        return Err(ApiError::invalid(field, "needs a host"));
    }
    if let Some(allowed) = allowed {
        if !allowed.iter().any(|a| a.trim_matches(['[', ']']) == host) {
            return Err(ApiError::invalid(field, format!("host {host} is not in push_allowed_hosts")));
        }
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(ApiError::invalid(field, "must not carry credentials"));
    }
    Ok(())
}

/// A NATS subject to publish to: dot-separated tokens, no wildcards or whitespace.
fn check_subject(s: &str) -> Result<(), ApiError> {
    let token_ok = |t: &str| !t.is_empty() && !t.contains(['*', '>']) && !t.chars().any(char::is_whitespace);
    if s.len() <= 255 && s.split('.').all(token_ok) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "nats.subject",
            "must be 1 to 255 bytes of dot-separated tokens without wildcards or spaces",
        ))
    }
}
