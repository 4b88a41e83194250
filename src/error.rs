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
    /// An I/O error with the path or operation that caused it.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Builds an `Invalid` error for `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid { field: field.into(), message: message.into() }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io { context: context.into(), source }
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
