//! Request extraction that answers every failure with the JSON error shape, never axum's plain text.

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::server::BodyTimedOut;

/// A JSON request body parsed into `T`; requires `Content-Type: application/json`.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        require_json_content_type(req.headers())?;
        let bytes = RawBody::from_request(req, state).await?.0;
        parse_json(&bytes).map(JsonBody)
    }
}

/// The raw request body, whatever its type, within the body limit.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Bytes::from_request(req, state).await.map(RawBody).map_err(body_rejection)
    }
}

/// A JSON body parsed into `T`, or `T::default()` when the request has no body at all (an
/// operation whose body is optional, such as a redrive of everything).
pub struct OptionalJsonBody<T>(pub T);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let has_type = req.headers().contains_key(header::CONTENT_TYPE);
        let headers = req.headers().clone();
        let bytes = RawBody::from_request(req, state).await?.0;
        if bytes.is_empty() && !has_type {
            return Ok(OptionalJsonBody(T::default()));
        }
        require_json_content_type(&headers)?;
        parse_json(&bytes).map(OptionalJsonBody)
    }
}

/// One path parameter, percent-decoded.
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(p)| PathParam(p))
            .map_err(|e: PathRejection| ApiError::invalid("path", e.body_text()))
    }
}

fn body_rejection(e: BytesRejection) -> ApiError {
    if caused_by::<BodyTimedOut>(&e) {
        ApiError::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", BodyTimedOut.to_string())
    } else if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(
            "request body exceeds the configured limit (max_body_bytes plus 64KiB of envelope)",
        )
    } else {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("cannot read request body: {}", e.body_text()),
        )
    }
}

/// Whether `E` is anywhere in the chain of sources of `e`.
fn caused_by<E: std::error::Error + 'static>(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<E>() {
            return true;
        }
        cur = err.source();
    }
    false
}

fn require_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Err(ApiError::unsupported_media_type(None));
    };
    let text = value.to_str().unwrap_or("");
    let essence = text.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json")) {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(Some(text)))
    }
}

/// Parses JSON into `T`, naming the offending field (as a path like `messages[3].delay_ms`) on error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Nearly every request is valid: parse it plainly, and only a failure again with the path
    // tracked for the error message (tracking it on every request cost ~2% of a produce's CPU).
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(path_error)?;
    de.end().map_err(|e| ApiError::bad_json(format!("malformed JSON: {e}")))?;
    Ok(value)
}

/// Deserializes one element of an already-checked JSON document into `T`, naming the offending
/// field on error. The element is parsed straight from its text: no intermediate `Value` tree.
pub fn from_raw<T: DeserializeOwned>(raw: &serde_json::value::RawValue) -> Result<T, ApiError> {
    // As in `parse_json`: the path is tracked only to explain a failure.
    if let Ok(value) = serde_json::from_str(raw.get()) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // A line and column inside one element would not point anywhere useful in the request.
        let (line, column) = (e.inner().line(), e.inner().column());
        let at = format!(" at line {line} column {column}");
        let mut err = path_error(e);
        if let Some(stripped) = err.message.strip_suffix(&at) {
            err.message = stripped.to_string();
        }
        err
    })
}

fn path_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    match inner.classify() {
        serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof
        | serde_json::error::Category::Io => ApiError::bad_json(format!("malformed JSON: {inner}")),
        serde_json::error::Category::Data => {
            if path == "." || path.is_empty() {
                // Missing and unknown fields are reported at the parent; serde's message names them.
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_argument",
                    format!("invalid request body: {inner}"),
                )
            } else {
                ApiError::invalid(&path, inner)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct T {
        body: String,
        delay_ms: Option<u64>,
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_json::<T>(br#"{"body":"x","delay_ms":-1}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("delay_ms"), "{}", e.message);
        let e = parse_json::<T>(br#"{"body":"x","dleay_ms":1}"#).unwrap_err();
        assert!(e.message.contains("dleay_ms"), "{}", e.message);
        let e = parse_json::<T>(br#"{"delay_ms":1}"#).unwrap_err();
        assert!(e.message.contains("body"), "{}", e.message);
        let e = parse_json::<T>(br#"{"body":7}"#).unwrap_err();
        assert!(e.message.starts_with("invalid body"), "{}", e.message);
        let e = parse_json::<T>(br#"{"body":"x","delay_ms":184467440737095516160}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_json::<T>(br#"{"body":"x"} trailing"#).unwrap_err();
        assert_eq!(e.code, "invalid_json");
        let e = parse_json::<T>(b"{\"body\":").unwrap_err();
        assert_eq!(e.code, "invalid_json");
        assert!(parse_json::<T>(br#"{"body":"x","delay_ms":5}"#).is_ok());
    }

    /// A body that fails at once with the body timeout, as `server::RequestBody` does past its deadline.
    struct LateBody;

    impl http_body::Body for LateBody {
        type Data = Bytes;
        type Error = Box<dyn std::error::Error + Send + Sync>;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(Some(Err(Box::new(BodyTimedOut))))
        }
    }

    #[tokio::test]
    async fn a_late_body_is_408_through_the_extractor_layers() {
        let req = Request::new(axum::body::Body::new(LateBody));
        let Err(e) = RawBody::from_request(req, &()).await else { panic!("a late body was read") };
        assert_eq!((e.status, e.code), (StatusCode::REQUEST_TIMEOUT, "request_timeout"));
        assert!(e.message.contains("http_body_timeout"), "{}", e.message);
    }

    #[test]
    fn content_type_must_be_json() {
        let mut h = HeaderMap::new();
        assert_eq!(require_json_content_type(&h).unwrap_err().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        h.insert(header::CONTENT_TYPE, "application/x-www-form-urlencoded".parse().unwrap());
        assert_eq!(require_json_content_type(&h).unwrap_err().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        h.insert(header::CONTENT_TYPE, "application/json; charset=utf-8".parse().unwrap());
        assert!(require_json_content_type(&h).is_ok());
        h.insert(header::CONTENT_TYPE, "application/vnd.delayd+json".parse().unwrap());
        assert!(require_json_content_type(&h).is_ok());
    }
}
