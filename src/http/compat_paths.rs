//! The paths of the original (ouqiang) API, which the connection layer and the router tell apart
//! from `/v1` before any handler runs.

/// The paths of the original API.
const PATHS: [&str; 5] = ["/push", "/pop", "/finish", "/delete", "/get"];

/// Whether `path` is one of the original API's.
pub(crate) fn is_compat_path(path: &str) -> bool {
    PATHS.contains(&path)
}
