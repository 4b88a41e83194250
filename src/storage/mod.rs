//! The append-only store: commit log, consume queues, id index, checkpoint, and the dispatcher that
//! derives queues and index from the log.

pub mod checkpoint;
pub mod commitlog;
pub mod consumequeue;
pub mod durability;
pub mod format;
pub mod index;
pub mod io;
pub mod mmap;
pub mod reclaim;
pub mod reserve;
pub mod secret;
pub mod store;
#[cfg(test)]
pub mod synced;
pub mod types;
pub mod warmer;
pub mod writer;

pub use types::{IdHash, LogOffset, QueueIndex, UnixMs};
