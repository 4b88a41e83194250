//! Administration: `POST /v1/admin/backup`, a consistent copy of the data directory while the
//! broker runs (see `storage::backup` and docs/backup.md).

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::extract::JsonBody;
use super::AppState;
use crate::storage::backup::BackupReport;

/// The body of a backup.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BackupBody {
    /// Directory on the server's machine to copy into: an absolute path, absent or empty, outside
    /// the data directory. It is created (0700) with missing parents.
    #[schema(example = "/var/backups/delayd/2026-11-26")]
    to: String,
}

/// `POST /v1/admin/backup`
#[utoipa::path(
    post,
    path = "/v1/admin/backup",
    tag = "operations",
    operation_id = "backup",
    summary = "Copy the data directory while the broker runs; a broker started on the copy serves \
               every change acknowledged before this request",
    description = "Copies the commit log up to its end when the request is handled, and the receipt \
                   key, into `to` on the server's file system; the queues, index and checkpoint are \
                   rebuilt from the log when a broker starts on the copy. The answer comes once the \
                   copy is complete and durable. Refused on a cluster node. See docs/backup.md.",
    request_body = BackupBody,
    responses(
        (status = 200, description = "Copied", body = BackupReport),
        (status = 400, description = "`to` is not absolute, or lies inside the data directory", body = ErrorBody),
        (status = 409, description = "`to` is not empty, or not a directory; or this is a cluster node", body = ErrorBody),
        (status = 415, description = "Not sent as application/json", body = ErrorBody),
        (status = 503, description = "The copy failed (it is removed again)", body = ErrorBody),
    )
)]
pub(crate) async fn backup(
    State(st): State<AppState>,
    JsonBody(b): JsonBody<BackupBody>,
) -> Result<Json<BackupReport>, ApiError> {
    if b.to.is_empty() {
        return Err(ApiError::invalid("to", "must be an absolute path on the server's machine"));
    }
    Ok(Json(st.broker().backup(std::path::PathBuf::from(b.to)).await?))
}
