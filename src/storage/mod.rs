//! The append-only store: commit log, consume queues, id index, checkpoint, and the dispatcher that
//! derives queues and index from the log.
//!
//! The `pub` modules are public only with the `internals` feature (lib.rs declares `storage`
//! crate-private without it), for the benches and integration tests that drive them directly.

pub mod backup;
pub mod checkpoint;
pub mod commitlog;
pub mod consumequeue;
pub mod durability;
pub mod format;
pub mod index;
pub mod io;
pub mod mmap;
pub mod replica;
pub(crate) mod reclaim;
pub(crate) mod reserve;
pub(crate) mod secret;
pub mod store;
#[cfg(test)]
pub(crate) mod synced;
mod sys;
pub(crate) mod types;
pub(crate) mod warmer;
pub(crate) mod writer;

pub use types::{IdHash, LogOffset, QueueIndex, UnixMs};
