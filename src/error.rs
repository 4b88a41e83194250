//! One error type for the whole broker; the HTTP layer maps each variant to a status and a stable code.

use std::io;

/// Every failure the broker reports to a caller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is malformed or out of range; `field` names it.
    #[error("invalid {field}: {message}")]
    Invalid { field: String, message: String },
    /// The id, receipt or topic does not exist (or the receipt expired).
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the current state (duplicate id with other content, already acked).
    #[error("{0}")]
    Conflict(String),
    /// A body or batch exceeds a configured limit.
    #[error("{0}")]
    TooLarge(String),
    /// A produce would create a topic past `max_topics`.
    #[error("{0}")]
    TooManyTopics(String),
    /// The store refuses writes (a failed flush poisons it, the disk is full) or is shutting down.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A data file failed validation; the offset says where.
    #[error("corrupt data in {file} at offset {offset}: {reason}")]
    Corrupt { file: String, offset: u64, reason: String },
    /// Configuration that cannot be used.
    #[error("config: {0}")]
    Config(String),
    /// An I/O error: the operation, the file it was on (if any) and the OS error, kept apart so
    /// each reader (the log, a client, the poison record) takes what it needs.
    #[error("{op}{}: {source}", file.as_ref().map(|f| format!(" {}", f.display())).unwrap_or_default())]
    Io {
        op: String,
        file: Option<std::path::PathBuf>,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Builds an `Invalid` error for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid { field: field.into(), message: message.into() }
    }

    /// Wraps an I/O error with what was being done, on no file in particular.
    pub fn io(op: impl Into<String>, source: io::Error) -> Self {
        Error::Io { op: op.into(), file: None, source }
    }

    /// Wraps an I/O error with what was being done and on which file.
    pub fn io_at(op: impl Into<String>, file: impl AsRef<std::path::Path>, source: io::Error) -> Self {
        Error::Io { op: op.into(), file: Some(file.as_ref().to_path_buf()), source }
    }

    /// A stable snake_case code for API clients.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Invalid { .. } => "invalid_argument",
            Error::NotFound(_) => "not_found",
            Error::Conflict(_) => "conflict",
            Error::TooLarge(_) => "too_large",
            Error::TooManyTopics(_) => "too_many_topics",
            Error::Unavailable(_) => "unavailable",
            Error::Corrupt { .. } => "corrupt_data",
            Error::Config(_) => "bad_config",
            Error::Io { .. } => "io_error",
        }
    }
}

/// Shorthand used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
