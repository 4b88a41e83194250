//! The dashboard at `GET /ui`: one static page, its script and its style sheet, compiled into the
//! binary so it works without network access beyond delayd itself.
//!
//! The page holds no data and needs no token: its script calls the JSON API under `/v1`, which
//! checks the token as for any client. Script and style are separate files (not inline) so the
//! Content-Security-Policy can forbid every inline script and every origin but this server's.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

const INDEX_HTML: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");

/// Only this server's own files and API; no inline code, no frames, no forms posted elsewhere.
/// `img-src data:` is for the empty favicon, which keeps the browser from asking for one.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `GET /ui`
pub(crate) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /ui/app.js`
pub(crate) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// `GET /ui/app.css`
pub(crate) async fn style() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The files change with the binary; `no-cache` makes the browser revalidate, so an upgrade
    // never runs an old script against a new API.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_page_is_served_with_its_type_and_a_strict_policy() {
        let resp = index().await;
        let h = resp.headers();
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
        assert_eq!(h[header::CACHE_CONTROL], "no-cache");
        let csp = h[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"), "{csp}");
    }

    #[test]
    fn the_page_loads_only_its_own_files() {
        // Relative paths, so the page also works behind a proxy that serves delayd under a prefix.
        assert!(INDEX_HTML.contains(r#"src="ui/app.js""#));
        assert!(INDEX_HTML.contains(r#"href="ui/app.css""#));
        for text in [INDEX_HTML, APP_JS, APP_CSS] {
            assert!(!text.contains("http://") && !text.contains("https://"), "an outside URL");
            assert!(!text.contains("<script>") && !text.contains("style=\""), "inline code the CSP forbids");
        }
    }
}
