//! delayd: a durable, single-node delay-message broker on an append-only commit log.
//!
//! Layout, and the life of a message:
//! - [`storage`] owns every file. A produce is one `Put` record appended to the commit log; the
//!   dispatcher immediately derives an entry in a delay-level consume queue (or the topic queue when
//!   it is due now) and a slot in the mapped id index.
//! - [`schedule`] holds the level list, the hop planner and one [`schedule::scheduler::LevelScheduler`]
//!   per level, which reads its queue in order and hands out entries as they fall due.
//! - [`engine`] is the state machine: a due timer either hops to the next level (a small `Hop`
//!   record; the body is never copied) or moves the message to its topic queue (a `Transition`).
//!   Pop, ack, nack, cancel and reservation expiry are `Transition`s too.
//! - [`broker`] runs the engine: a lone request on the thread that parsed it, a load on the
//!   engine thread with group commit; timers, long-poll wake-ups and checkpoints on that thread.
//! - [`message`] holds the requests and answers both `engine` and `broker` speak, and [`config`] the
//!   settings (with [`config::BrokerConfig`], what the core needs of them), so neither of the two
//!   imports the other's types.
//! - `http` serves the native and compat APIs over the broker.

pub mod broker;
pub mod config;
#[cfg(test)]
mod crash_model_tests;
pub mod engine;
#[cfg(test)]
mod engine_tests;
pub mod error;
pub mod http;
pub mod limits;
mod live;
pub mod message;
pub mod metrics;
pub mod push;
#[cfg(test)]
mod reclaim_tests;
#[cfg(test)]
mod recovery_tests;
pub mod schedule;
pub mod storage;
#[cfg(test)]
mod topic_tests;
pub mod units;

pub use broker::Broker;
pub use error::{Error, Result};
