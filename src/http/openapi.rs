//! `GET /openapi.json`: an OpenAPI 3.1 document of the whole HTTP API, generated from the code.
//!
//! Each handler carries its operation (`#[utoipa::path]`) and the request and answer types derive
//! their schemas (`ToSchema`) from the structs the handlers parse and send. `super::routes`
//! registers every route together with its operation, so a route cannot be served without
//! being documented, and [`document`] derives each operation's security from the router it was
//! registered in: the one behind `require_token`, or the open one.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::Bytes;
use serde::Serialize;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{Content, OpenApi as Document, Ref, RefOr};
use utoipa::{Modify, OpenApi, ToSchema};

use super::error::{ApiError, ErrorBody};

/// Name of the bearer-token security scheme in the document (spelt out in `security(...)` too).
const BEARER: &str = "bearer";

/// The parts of the document no handler owns: info, tags, the security scheme, shared components.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "delayd",
        description = "A durable, single-node delay-message broker: the native JSON API under /v1, \
                       the ouqiang/delay-queue compatible API (tag compat), and operations endpoints."
    ),
    tags(
        (name = "messages", description = "Produce, pop, ack, nack, look up and cancel messages"),
        (name = "topics", description = "List, pause, resume, browse, redrive and purge topics"),
        (name = "operations", description = "Health, statistics, metrics and this document"),
        (name = "compat", description = "Drop-in API of ouqiang/delay-queue: always HTTP 200 with {code, message, data} (401 aside)"),
    ),
    components(schemas(ErrorBody)),
    security(("bearer" = [])),
    modifiers(&BearerScheme),
)]
struct Base;

/// Adds the bearer-token scheme that `security` refers to.
struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, doc: &mut Document) {
        let components = doc.components.get_or_insert_with(Default::default);
        let mut http = Http::new(HttpAuthScheme::Bearer);
        http.description = Some(
            "`Authorization: Bearer <token>` when the server has `auth_token` set; the scheme name in any case."
                .into(),
        );
        components.add_security_scheme(BEARER, SecurityScheme::Http(http));
    }
}

/// The shared responses, by name in `components/responses`.
const UNAUTHORIZED: &str = "Unauthorized";
const FORBIDDEN: &str = "Forbidden";
const ERROR: &str = "Error";

/// The whole document: [`Base`] plus the operations of the open router and of the one behind the
/// token. Open operations get an empty `security` (overriding the global bearer requirement);
/// the others get a `401` answer unless they describe their own (the compat paths do), and the
/// native ones a `default` error answer for the statuses every endpoint may give (503, 500).
pub(crate) fn document(open: Document, protected: Document) -> Document {
    let mut doc = Base::openapi();
    let components = doc.components.get_or_insert_with(Default::default);
    for (name, description) in [
        (UNAUTHORIZED, "auth_token is set and the Authorization: Bearer header is missing or wrong"),
        (
            FORBIDDEN,
            "The read_token was given, and this operation changes state (only auth_token may call it)",
        ),
        (
            ERROR,
            "Any other error, e.g. 503 while the store refuses writes or shuts down (with Retry-After: 1), \
             500 on damaged data",
        ),
    ] {
        let body = Content::new(Some(RefOr::Ref(Ref::from_schema_name(ErrorBody::name()))));
        let response = ResponseBuilder::new().description(description).content("application/json", body);
        components.responses.insert(name.to_string(), RefOr::T(response.build()));
    }
    let mut open = open;
    for item in open.paths.paths.values_mut() {
        for op in operations(item) {
            op.security = Some(Vec::new());
        }
    }
    let mut protected = protected;
    for (path, item) in protected.paths.paths.iter_mut() {
        for (method, op) in operations_by_method(item) {
            let responses = &mut op.responses.responses;
            responses.entry("401".into()).or_insert_with(|| RefOr::Ref(response_ref(UNAUTHORIZED)));
            if !super::is_read_route(&method, path) {
                responses.entry("403".into()).or_insert_with(|| RefOr::Ref(response_ref(FORBIDDEN)));
            }
            if path.starts_with("/v1/") {
                responses.entry("default".into()).or_insert_with(|| RefOr::Ref(response_ref(ERROR)));
            }
        }
    }
    doc.merge(open);
    doc.merge(protected);
    doc
}

fn response_ref(name: &str) -> Ref {
    Ref::new(format!("#/components/responses/{name}"))
}

/// Every operation of a path item with its method.
fn operations_by_method(item: &mut PathItem) -> impl Iterator<Item = (axum::http::Method, &mut Operation)> {
    use axum::http::Method;
    [
        (Method::GET, &mut item.get),
        (Method::PUT, &mut item.put),
        (Method::POST, &mut item.post),
        (Method::DELETE, &mut item.delete),
        (Method::OPTIONS, &mut item.options),
        (Method::HEAD, &mut item.head),
        (Method::PATCH, &mut item.patch),
        (Method::TRACE, &mut item.trace),
    ]
    .into_iter()
    .filter_map(|(m, op)| op.as_mut().map(|op| (m, op)))
}

/// Every operation of a path item, whatever its method.
pub(crate) fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// The document as served: serialized once, when the router is built.
#[derive(Clone)]
pub(crate) struct Served(Result<Bytes, String>);

impl Served {
    /// Serializes `doc` (pretty, for people reading it with curl).
    pub(crate) fn new(doc: &Document) -> Served {
        Served(serde_json::to_vec_pretty(doc).map(Bytes::from).map_err(|e| e.to_string()))
    }
}

/// `GET /openapi.json`
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    operation_id = "openapi",
    summary = "This OpenAPI document; needs no token",
    responses((status = 200, description = "The document", content_type = "application/json", body = Object))
)]
pub(crate) async fn serve(Extension(doc): Extension<Served>) -> Response {
    match doc.0 {
        Ok(bytes) => {
            ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], bytes).into_response()
        }
        // Cannot happen for utoipa's types (string keys only); answered rather than panicked on.
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("cannot encode the OpenAPI document: {e}"),
        )
        .into_response(),
    }
}

/// `level` of a produce: a 1-based index into `levels`, or a duration equal to one of them.
/// The handler keeps the field as a JSON value to name it in errors; this only describes it.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // a schema only, never built
pub(crate) enum LevelValue {
    /// 1-based index into the configured levels.
    Index(u32),
    /// A duration equal to a configured level, e.g. `1m`.
    Duration(String),
}

/// `backoff` of a produce: a list of durations, or one string of them separated by spaces.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // a schema only, never built
pub(crate) enum BackoffValue {
    /// `["2m", "10m", 3600000]`.
    List(Vec<DurationValue>),
    /// `"2m 10m 1h"`.
    Text(String),
}

/// A duration: milliseconds, or a string such as `250ms`, `30s`, `1h30m`.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // a schema only, never built
pub(crate) enum DurationValue {
    /// Milliseconds.
    Ms(u64),
    /// `250ms`, `30s`, `1h30m`, `2d`.
    Text(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text() -> Bytes {
        match Served::new(&crate::http::openapi_document()).0 {
            Ok(bytes) => bytes,
            Err(e) => panic!("the document does not serialize: {e}"),
        }
    }

    #[test]
    fn the_document_serializes_deterministically() {
        // Maps in utoipa's model are BTreeMaps (its `preserve_order` feature is off), so two builds,
        // here or in another process, write the same bytes: clients may cache and diff it.
        let first = text();
        for _ in 0..3 {
            assert_eq!(text(), first);
        }
        let doc: serde_json::Value = serde_json::from_slice(&first).expect("valid JSON");
        assert_eq!(doc["openapi"], "3.1.0");
    }

    #[test]
    fn open_and_protected_operations_are_told_apart() {
        let mut doc = crate::http::openapi_document();
        let mut seen = 0;
        for (path, item) in doc.paths.paths.iter_mut() {
            for op in operations(item) {
                seen += 1;
                let open = matches!(path.as_str(), "/healthz" | "/openapi.json");
                assert_eq!(op.security.as_ref().is_some_and(Vec::is_empty), open, "{path}");
                assert_eq!(op.responses.responses.contains_key("401"), !open, "{path}");
            }
        }
        assert!(seen > 20, "{seen} operations");
    }
}
