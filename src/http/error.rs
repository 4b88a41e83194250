//! The one error type of the HTTP layer: `{"error": {"code", "message"}}` with a matching status.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::Error;

/// An error answer: status, stable snake_case code and a sentence for humans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable sentence; names the offending field for 400s.
    pub message: String,
}

impl ApiError {
    /// Builds an error from its parts.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into() }
    }

    /// 400 for an invalid field; the message starts with the field name.
    pub fn invalid(field: &str, message: impl std::fmt::Display) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_argument", format!("invalid {field}: {message}"))
    }

    /// 400 for a body that is not the JSON the endpoint expects.
    pub fn bad_json(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", message)
    }

    /// 401 for a missing or wrong bearer token.
    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token: send Authorization: Bearer <token>",
        )
    }

    /// 403 for a valid token that may not call this route (the read-only one on a write).
    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 404 for a path that matches no endpoint.
    pub fn no_route(path: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "no_such_endpoint", format!("no endpoint at {path}"))
    }

    /// 413 for a request or field over its limit.
    pub fn too_large(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }

    /// 415 for a body that is not declared as JSON.
    pub fn unsupported_media_type(found: Option<&str>) -> Self {
        let found = found.map(|f| format!("got {f:?}")).unwrap_or_else(|| "none was sent".into());
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("expected Content-Type: application/json, {found}"),
        )
    }

    /// The JSON document sent as the body.
    pub fn envelope(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { code: self.code.to_string(), message: self.message.clone() } }
    }

    /// [`envelope`](Self::envelope) as a JSON value.
    pub fn body(&self) -> serde_json::Value {
        // Two strings always serialize; Null only keeps this free of a panic path.
        serde_json::to_value(self.envelope()).unwrap_or(serde_json::Value::Null)
    }
}

/// Every error answer of the native API: `{"error": {"code", "message"}}`. The handlers send this
/// struct, and the OpenAPI document's `Error` schema is derived from it, so the two cannot differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable snake_case code, e.g. `invalid_argument`, `not_found`, `unauthorized`.
    #[schema(example = "invalid_argument")]
    pub code: String,
    /// A sentence for humans; a 400's names the field.
    #[schema(example = "invalid delay_ms: must be 0 to 2592000000")]
    pub message: String,
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::Invalid { .. } => StatusCode::BAD_REQUEST,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::Conflict(_) => StatusCode::CONFLICT,
            Error::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Error::TooManyTopics(_) => StatusCode::TOO_MANY_REQUESTS,
            // Disk full, a poisoned store after a failed flush, shutting down: the client may retry later.
            Error::Unavailable(_) | Error::Io { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Error::Corrupt { .. } | Error::Config(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let message = if status.is_server_error() {
            // The whole story (file, offset, OS error) goes to the log; the client learns what
            // failed and why, but not where the files are.
            StoreFailureLog::global().note(&e);
            // Built from the error's fields, so the file is simply left out; the scrub stays for
            // messages that arrive as text (a poisoned store's reason).
            let told = match &e {
                Error::Io { op, source, .. } => format!("{op}: {source}"),
                Error::Corrupt { offset, reason, .. } => format!("corrupt data at offset {offset}: {reason}"),
                other => other.to_string(),
            };
            format!("{}; the server log has the details", without_paths(&told))
        } else {
            e.to_string()
        };
        ApiError { status, code: e.code(), message }
    }
}

/// How often a store failure that keeps happening is logged again, with the count since.
const REMIND_EVERY: std::time::Duration = std::time::Duration::from_secs(30);
/// Distinct failures remembered at once; past it the one seen least recently is forgotten.
const DISTINCT_FAILURES: usize = 32;

/// The log of failed requests: the first of each distinct failure at ERROR, then one reminder
/// per [`REMIND_EVERY`] with how many more there were. On a full disk every client's every
/// write fails the same way; one line each would bury everything else in the log (and, on the
/// same disk, fill what little space is left).
#[derive(Default)]
struct StoreFailureLog {
    seen: std::sync::Mutex<Vec<Seen>>,
}

struct Seen {
    /// The failure without its numbers (offsets, sizes), so the same failure at another offset
    /// counts as the same.
    kind: String,
    logged_at: std::time::Instant,
    since: u64,
}

impl StoreFailureLog {
    fn global() -> &'static StoreFailureLog {
        static LOG: std::sync::OnceLock<StoreFailureLog> = std::sync::OnceLock::new();
        LOG.get_or_init(StoreFailureLog::default)
    }

    fn note(&self, e: &Error) {
        let text = e.to_string();
        let kind: String = text.chars().filter(|c| !c.is_ascii_digit()).collect();
        let now = std::time::Instant::now();
        let repeated = {
            let Ok(mut seen) = self.seen.lock() else { return };
            match seen.iter().position(|s| s.kind == kind) {
                Some(i) if now.duration_since(seen[i].logged_at) < REMIND_EVERY => {
                    seen[i].since += 1;
                    return;
                }
                Some(i) => {
                    let since = seen[i].since;
                    seen[i].since = 0;
                    seen[i].logged_at = now;
                    Some(since)
                }
                None => {
                    if seen.len() >= DISTINCT_FAILURES {
                        if let Some(oldest) = (0..seen.len()).min_by_key(|&i| seen[i].logged_at) {
                            seen.swap_remove(oldest);
                        }
                    }
                    seen.push(Seen { kind, logged_at: now, since: 0 });
                    None
                }
            }
        };
        match repeated {
            None | Some(0) => tracing::error!(error = %text, "request failed in the store"),
            Some(n) => tracing::error!(
                error = %text,
                repeated = n,
                "request failed in the store, again ({n} more like it since the last line)"
            ),
        }
    }
}

/// `text` with every word that names a file (one holding a `/`) replaced by `<file>`.
/// "Input/output error", the one OS error message with a slash, is not a file.
fn without_paths(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let core = word.trim_matches(|c: char| matches!(c, '(' | ')' | ',' | ':' | ';' | '"' | '\''));
        if core.contains('/') && core != "Input/output" {
            out.push_str(&word.replace(core, "<file>"));
        } else {
            out.push_str(word);
        }
    }
    out
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.envelope())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_store_error_maps_to_its_status_and_code() {
        let cases = [
            (Error::invalid("delay_ms", "too big"), 400, "invalid_argument"),
            (Error::NotFound("no such id".into()), 404, "not_found"),
            (Error::Conflict("differs".into()), 409, "conflict"),
            (Error::TooLarge("big".into()), 413, "too_large"),
            (Error::TooManyTopics("full".into()), 429, "too_many_topics"),
            (Error::Unavailable("disk full".into()), 503, "unavailable"),
            (Error::io("flush", std::io::Error::other("EIO")), 503, "io_error"),
            (Error::Corrupt { file: "f".into(), offset: 3, reason: "crc".into() }, 500, "corrupt_data"),
        ];
        for (err, status, code) in cases {
            let msg = err.to_string();
            let api = ApiError::from(err);
            assert_eq!(api.status.as_u16(), status, "{msg}");
            assert_eq!(api.code, code);
            if status < 500 {
                assert_eq!(api.message, msg);
            } else {
                assert!(api.message.ends_with("; the server log has the details"), "{}", api.message);
            }
        }
    }

    #[test]
    fn server_errors_name_no_file() {
        let cases = [
            (
                Error::Unavailable(
                    "a sync failed earlier (fdatasync /var/lib/delayd/commitlog/00000000000000000000: \
                     Input/output error (os error 5)); writes are refused until a restart"
                        .into(),
                ),
                "store unavailable: a sync failed earlier (fdatasync <file>: Input/output error (os error 5)); \
                 writes are refused until a restart",
            ),
            (
                Error::io_at("preallocate", "./data/commitlog/00000000000067108864", std::io::Error::from_raw_os_error(28)),
                "preallocate: No space left on device (os error 28)",
            ),
            (
                Error::Corrupt { file: "/srv/d/index/ids-1".into(), offset: 7, reason: "crc".into() },
                "corrupt data at offset 7: crc",
            ),
            (Error::Unavailable("the broker is shutting down".into()), "store unavailable: the broker is shutting down"),
        ];
        for (err, want) in cases {
            let api = ApiError::from(err);
            assert_eq!(api.message, format!("{want}; the server log has the details"));
        }
    }

    #[test]
    fn invalid_names_the_field() {
        let api = ApiError::from(Error::invalid("ttr_ms", "must be at least 1"));
        assert!(api.message.contains("ttr_ms"), "{}", api.message);
        assert_eq!(ApiError::invalid("topic", "bad").message, "invalid topic: bad");
    }

    #[tokio::test]
    async fn response_has_the_json_shape_and_headers() {
        let resp = ApiError::unauthorized().into_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers().get(header::WWW_AUTHENTICATE).unwrap(), "Bearer");
        assert!(resp
            .headers()
            .get(header::CONTENT_TYPE)
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("application/json"));
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "unauthorized");
        assert!(v["error"]["message"].as_str().unwrap().contains("Bearer"));
        let resp = ApiError::from(Error::Unavailable("disk full".into())).into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers().get(header::RETRY_AFTER).unwrap(), "1");
    }
}
