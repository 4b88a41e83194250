//! delayd: a durable, single-node delay-message broker on an append-only commit log.
//!
//! The public surface is re-exported here: [`Broker`] and its [`BrokerConfig`], the requests and
//! answers in [`message`], [`Config`] (flags, environment, TOML), [`Error`], and the HTTP front end
//! ([`router`], [`serve`]) with the push runner ([`run_push`]) that `src/bin/delayd.rs` assembles.
//! The storage, engine and scheduler are crate-private; the `internals` feature makes them public
//! for the benches and integration tests that drive them directly (it is not a stable API).
//!
//! Layout, and the life of a message:
//! - `storage` owns every file. A produce is one `Put` record appended to the commit log; the
//!   dispatcher immediately derives an entry in a delay-level consume queue (or the topic queue when
//!   it is due now) and a slot in the mapped id index.
//! - `schedule` holds the level list, the hop planner and one `schedule::scheduler::LevelScheduler`
//!   per level, which reads its queue in order and hands out entries as they fall due.
//! - `engine` is the state machine: a due timer either hops to the next level (a small `Hop`
//!   record; the body is never copied) or moves the message to its topic queue (a `Transition`).
//!   Pop, ack, nack, cancel and reservation expiry are `Transition`s too.
//! - [`broker`] runs the engine: a lone request on the thread that parsed it, a load on the
//!   engine thread with group commit; timers, long-poll wake-ups and checkpoints on that thread.
//! - [`message`] holds the requests and answers both `engine` and `broker` speak, and [`config`] the
//!   settings (with [`config::BrokerConfig`], what the core needs of them), so neither of the two
//!   imports the other's types.
//! - `http` serves the native and compat APIs over the broker.

/// Declares modules that are public with the `internals` feature (for benches and integration
/// tests) and crate-private without it. Without the feature, what only benches and tests call reads
/// as dead code, so that lint is off there; the feature build (which `cargo test`, `cargo bench`
/// and `cargo clippy --all-targets` use) still checks every private item.
macro_rules! internal_mod {
    ($($name:ident;)*) => {$(
        #[cfg(feature = "internals")]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code, unused_imports)]
        pub(crate) mod $name;
    )*};
}

pub mod broker;
pub mod cluster;
pub mod config;
#[cfg(test)]
mod crash_model_tests;
#[cfg(test)]
mod engine_tests;
pub mod error;
#[cfg(test)]
mod flow_tests;
pub mod http;
#[cfg(test)]
mod last_error_tests;
mod limits;
mod live;
pub mod message;
mod push;
mod push_health;
#[cfg(test)]
mod reclaim_tests;
#[cfg(test)]
mod recovery_tests;
#[cfg(test)]
mod reschedule_tests;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod topic_tests;
pub mod units;

internal_mod! {
    engine;
    metrics;
    schedule;
    storage;
}

/// The broker: open a data directory, then produce, pop, ack and administer messages.
pub use broker::Broker;
/// What the broker needs of the configuration (data directory, levels, flush mode, limits).
pub use config::BrokerConfig;
/// The whole configuration: defaults, TOML file, `DELAYD_*` variables and flags, validated.
pub use config::Config;
/// Every failure the broker reports, and its result type.
pub use error::{Error, Result};
/// Builds the HTTP API (native `/v1`, compat, `/metrics`, `/ui`) over a broker.
pub use http::{router, AppState, Limits};
/// Serves a router on a listener with delayd's connection limits and timeouts.
pub use http::{serve, ServeConfig};
/// When a produced message becomes due.
pub use message::When;
/// Answers from the broker.
pub use message::{Delivery, MessageInfo, MessageState, Nacked, Produced, Stats};
/// Requests to the broker.
pub use message::{PopRequest, ProduceRequest, PushConfig};
/// The broker's counters and histograms ([`Broker::metrics`]), which `/metrics` renders.
pub use metrics::{Histogram, Metrics, PushMetrics};
/// Delivers messages of topics with a push subscription (webhook or NATS JetStream) until dropped.
pub use push::run as run_push;
