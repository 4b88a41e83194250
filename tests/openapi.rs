//! `GET /openapi.json` against the real binary: it is OpenAPI 3, it documents every route the
//! source registers and every endpoint docs/api.md and the README list, and every operation it
//! documents is served.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::Server;
use serde_json::Value;

const TOKEN: &str = "open-sesame";

/// Paths served on purpose outside the API document: the dashboard page and its assets (pages for
/// people, not an API). A route added here is one the test no longer asks to be documented.
const NOT_IN_THE_DOCUMENT: &[&str] = &["/ui", "/ui/app.js", "/ui/app.css"];

const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

fn server() -> Server {
    Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN)])
}

/// Fetches the document without a token, checking status and content type.
fn fetch(s: &Server) -> Value {
    let r = s.http().get(s.url("/openapi.json")).send().expect("GET /openapi.json");
    assert_eq!(r.status().as_u16(), 200, "/openapi.json needs no token");
    let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(ct.starts_with("application/json"), "content type {ct:?}");
    r.json().expect("/openapi.json is JSON")
}

/// Every (METHOD, path) the document has an operation for.
fn operations(doc: &Value) -> BTreeMap<(String, String), Value> {
    let paths = doc["paths"].as_object().expect("paths is an object");
    let mut out = BTreeMap::new();
    for (path, item) in paths {
        for m in METHODS {
            if let Some(op) = item.get(m) {
                out.insert((m.to_uppercase(), path.clone()), op.clone());
            }
        }
    }
    out
}

fn source(file: &str) -> String {
    let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The `.rs` files of `src/http/`, by name.
fn http_sources() -> Vec<(String, String)> {
    let dir = format!("{}/src/http", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("src/http")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files.into_iter().map(|p| (p.display().to_string(), std::fs::read_to_string(&p).expect("read"))).collect()
}

/// The path literal and method words of every `.route("...", ...)`-like call in `text`: routes
/// registered past `routes!`, which do not reach the document by themselves.
fn plain_routes(text: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut out = Vec::new();
    for call in [".route(", ".route_service(", ".nest(", ".nest_service("] {
        let mut rest = text;
        while let Some(at) = rest.find(call) {
            rest = &rest[at + call.len()..];
            let args = rest.trim_start();
            let Some(lit) = args.strip_prefix('"') else { continue };
            let Some(end) = lit.find('"') else { continue };
            let path = lit[..end].to_string();
            // The method router is the rest of the call: up to the next route call or statement end.
            let tail = &lit[end..];
            let stop = [".route", ";", ".merge", ".fallback", ".layer"]
                .iter()
                .filter_map(|s| tail.find(s))
                .min()
                .unwrap_or(tail.len());
            let methods = METHODS
                .iter()
                .filter(|m| tail[..stop].contains(&format!("{m}(")))
                .map(|m| m.to_uppercase())
                .collect();
            out.push((path, methods));
        }
    }
    out
}

#[test]
fn the_document_is_openapi_3_served_without_a_token_and_resolves() {
    let s = server();
    let doc = fetch(&s);
    let version = doc["openapi"].as_str().expect("openapi version string");
    assert!(version.starts_with("3."), "not OpenAPI 3: {version}");
    assert_eq!(doc["info"]["title"], "delayd");
    assert!(doc["info"]["version"].is_string());

    // It is the document the library builds, byte for byte once parsed.
    let built = serde_json::to_value(delayd::http::openapi_document()).expect("document serializes");
    assert_eq!(doc, built, "served document differs from delayd::http::openapi_document()");

    // The bearer scheme, global; the open operations say they need nothing.
    assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
    assert_eq!(doc["security"], serde_json::json!([{"bearer": []}]));
    let ops = operations(&doc);
    for ((method, path), op) in &ops {
        let open = matches!(path.as_str(), "/healthz" | "/openapi.json");
        if open {
            assert_eq!(op["security"], serde_json::json!([]), "{method} {path} is open");
        } else {
            assert!(op.get("security").is_none(), "{method} {path} inherits the bearer requirement");
            assert!(op["responses"].get("401").is_some(), "{method} {path} documents its 401");
        }
        assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()), "{method} {path}");
        // Every {param} of the path is a declared path parameter.
        let declared: BTreeSet<&str> = op["parameters"]
            .as_array()
            .map(|ps| ps.iter().filter(|p| p["in"] == "path").filter_map(|p| p["name"].as_str()).collect())
            .unwrap_or_default();
        for seg in path.split('/').filter(|seg| seg.starts_with('{')) {
            let name = seg.trim_start_matches('{').trim_end_matches('}');
            assert!(declared.contains(name), "{method} {path} does not declare {name}");
        }
    }
    let ids: Vec<&str> = ops.values().filter_map(|op| op["operationId"].as_str()).collect();
    assert_eq!(ids.len(), ops.len(), "every operation has an operationId");
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), ids.len(), "operationIds are unique: {ids:?}");

    // Every $ref points at something in the document.
    let text = doc.to_string();
    for r in text.split("\"$ref\":\"").skip(1).filter_map(|t| t.split('"').next()) {
        let pointer = r.strip_prefix('#').unwrap_or_else(|| panic!("external $ref {r}"));
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
    }
    assert!(doc.pointer("/components/schemas/Error/properties/error").is_some(), "the error shape");

    // Query parameters docs/api.md promises.
    let params = |m: &str, p: &str| -> BTreeSet<String> {
        ops[&(m.to_string(), p.to_string())]["parameters"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .filter(|p| p["in"] == "query")
                    .filter_map(|p| p["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        params("POST", "/v1/topics/{topic}/pop"),
        ["max", "ttr_ms", "wait_ms"].map(String::from).into()
    );
    assert_eq!(
        params("GET", "/v1/topics/{topic}/messages"),
        ["cursor", "limit", "state"].map(String::from).into()
    );
}

#[test]
fn every_route_in_the_source_and_every_listed_endpoint_is_documented() {
    let s = server();
    let doc = fetch(&s);
    let ops = operations(&doc);
    let documented: BTreeSet<&(String, String)> = ops.keys().collect();

    // Routes are registered with `routes!`, which documents them; any plain `.route(...)` left in
    // src/http must be in the document too (or listed in NOT_IN_THE_DOCUMENT).
    for (file, text) in http_sources() {
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for (path, methods) in plain_routes(text) {
            if NOT_IN_THE_DOCUMENT.contains(&path.as_str()) {
                continue;
            }
            assert!(
                ops.keys().any(|(_, p)| *p == path),
                "{file}: route {path} is served but not in /openapi.json: register it with routes!(handler) \
                 and give the handler a #[utoipa::path]"
            );
            for m in methods {
                assert!(
                    documented.contains(&(m.clone(), path.clone())),
                    "{file}: {m} {path} is served but not in /openapi.json"
                );
            }
        }
    }
    // Every handler registered with routes! carries an operation (the macro needs one to compile);
    // check the registration names the handlers the source annotates, so none is left unserved.
    let mod_rs = source("src/http/mod.rs");
    let annotated: usize = http_sources().iter().map(|(_, t)| t.matches("#[utoipa::path(").count()).sum();
    let registered: usize = mod_rs
        .split("routes!(")
        .skip(1)
        .map(|t| t.split(')').next().unwrap_or("").split(',').filter(|h| !h.trim().is_empty()).count())
        .sum();
    assert_eq!(
        annotated, registered,
        "#[utoipa::path] handlers vs handlers in routes!(...) in src/http/mod.rs"
    );
    assert_eq!(annotated, ops.len(), "one operation per annotated handler");

    // The endpoint tables of docs/api.md (the reference) and of the README (at a glance) each list
    // the same endpoints as the document.
    for file in ["docs/api.md", "README.md"] {
        let listed = endpoint_rows(&source(file));
        assert!(listed.len() > 10, "{file}: endpoint rows not found: {listed:?}");
        for endpoint in &listed {
            assert!(documented.contains(endpoint), "{file} lists {endpoint:?}, /openapi.json does not");
        }
        for endpoint in &documented {
            assert!(
                listed.contains(*endpoint),
                "/openapi.json has {endpoint:?}, {file}'s endpoint tables do not"
            );
        }
    }
}

/// The (METHOD, path) of every table row of `markdown` whose first cell is a method and a path in
/// backquotes, such as `POST /v1/ack`, the query string left off; the dashboard's pages left out.
fn endpoint_rows(markdown: &str) -> BTreeSet<(String, String)> {
    let mut listed = BTreeSet::new();
    for line in markdown.lines() {
        let Some(cell) = line.strip_prefix("| `") else { continue };
        let Some((method, rest)) = cell.split_once(' ') else { continue };
        if !METHODS.contains(&method.to_lowercase().as_str()) || !rest.starts_with('/') {
            continue;
        }
        let path: String = rest.chars().take_while(|c| !matches!(c, '`' | '?' | ' ')).collect();
        if !NOT_IN_THE_DOCUMENT.contains(&path.as_str()) {
            listed.insert((method.to_string(), path));
        }
    }
    listed
}

#[test]
fn every_documented_operation_is_served_with_the_documented_security() {
    let s = server();
    let doc = fetch(&s);
    let ops = operations(&doc);
    assert!(ops.len() > 20, "{}", ops.len());
    // A probe that does not exist shows what "not served" looks like, so the checks below mean something.
    let unserved =
        |status: u16, v: &Value| status == 405 || (status == 404 && v["error"]["code"] == "no_such_endpoint");
    let (st, v) = send(&s, "GET", "/v1/no-such-path", true);
    assert!(unserved(st, &v), "{st} {v}");
    let (st, v) = send(&s, "DELETE", "/v1/ack", true);
    assert!(unserved(st, &v), "{st} {v}");

    for ((method, path), op) in &ops {
        let concrete = path.replace("{topic}", "openapi-probe").replace("{id}", "openapi-probe-id");
        let (st, v) = send(&s, method, &concrete, true);
        assert!(!unserved(st, &v), "{method} {path} is documented but not served: {st} {v}");
        assert!(st < 500, "{method} {path}: {st} {v}");
        // Without a token: the open ones answer, the others are 401, as documented.
        let (st, v) = send(&s, method, &concrete, false);
        if op["security"] == serde_json::json!([]) {
            assert!(st != 401 && !unserved(st, &v), "{method} {path} is documented as open: {st} {v}");
        } else {
            assert_eq!(st, 401, "{method} {path} is documented as needing the token: {v}");
        }
    }
}

/// Sends `method path` with an empty JSON object as the body of a POST (enough for every operation
/// to be routed; most refuse it as a bad request, which is still an answer).
fn send(s: &Server, method: &str, path: &str, token: bool) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = s.http().request(method.clone(), s.url(path));
    if token {
        req = req.bearer_auth(TOKEN);
    }
    if method == reqwest::Method::POST {
        req = req.header("content-type", "application/json").body("{}");
    }
    common::answer(req.send())
}
