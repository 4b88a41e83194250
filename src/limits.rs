//! Limits on what a request may carry, checked on input by both HTTP APIs and again by the engine.
//!
//! One place, below every layer that checks them, so the API, the engine and the configuration
//! cannot disagree. Limits an operator may tune are config keys (`max_body_bytes`, `max_batch`,
//! `max_delay`, ...); those here are fixed, and the ceilings of some keys.

/// Longest topic name, in bytes (topics are ASCII, so also characters).
pub const MAX_TOPIC_LEN: usize = 128;
/// Longest client-chosen id, in bytes of UTF-8.
pub const MAX_ID_BYTES: usize = 128;
/// Most steps a per-message backoff may have.
pub const MAX_BACKOFF_STEPS: usize = 1000;
/// Highest accepted `max_attempts`, per message or as a key (the index keeps attempts in 16 bits).
pub const MAX_ATTEMPTS_LIMIT: u32 = 10_000;
/// `max_attempts` of a message that is never dead-lettered (a compat job by default, as the
/// original redelivers forever); kept in the Put as is.
pub const UNLIMITED_ATTEMPTS: u32 = u32::MAX;
/// Longest time-to-run the compat API accepts, in seconds (the original's limit).
pub const COMPAT_MAX_TTR_S: u64 = 86_400;
/// Room for the JSON envelope around a body of `max_body_bytes` (escaping, other fields, batch
/// framing): a request may be this much larger than the largest body.
pub const ENVELOPE_BYTES: usize = 64 << 10;
/// Highest `max_batch`: most messages one batch produce or pop may carry.
pub const MAX_BATCH_LIMIT: usize = 100_000;
