//! The message model: what clients ask the broker for and what it answers.
//!
//! These types sit below both `engine` (which applies requests) and `broker` (which carries them
//! to the engine thread), so neither has to import the other's types.

use bytes::Bytes;

use crate::storage::reclaim::ReclaimStats;

/// When a produced message should become ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum When {
    /// Ready now.
    Now,
    /// Milliseconds after the broker receives the request.
    DelayMs(u64),
    /// An absolute unix time in milliseconds.
    AtMs(u64),
    /// A named level: 1-based index into the configured list.
    LevelIndex(u32),
}

/// One message to produce.
#[derive(Debug, Clone)]
pub struct ProduceRequest {
    /// Client-chosen id; the broker makes one when absent.
    pub id: Option<String>,
    /// Opaque payload (the HTTP API carries UTF-8 strings).
    pub body: Bytes,
    /// When it becomes ready.
    pub when: When,
    /// Per-message time-to-run.
    pub ttr_ms: Option<u64>,
    /// Per-message delivery limit.
    pub max_attempts: Option<u32>,
    /// Per-message retry schedule for nack.
    pub backoff_ms: Option<Vec<u64>>,
}

/// Result of a produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Produced {
    /// The message id.
    pub id: String,
    /// When it becomes ready, unix ms.
    pub deliver_at_ms: u64,
    /// False when this was an idempotent repeat of an earlier produce.
    pub created: bool,
}

/// What a pop asks for.
#[derive(Debug, Clone)]
pub struct PopRequest {
    /// Topics to take from, in order of preference.
    pub topics: Vec<String>,
    /// Most messages to return.
    pub max: usize,
    /// Long-poll: how long to wait for a message when none is ready.
    pub wait_ms: u64,
    /// Reservation length; falls back to the message's, then the default.
    pub ttr_ms: Option<u64>,
}

/// A message handed to a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Message id.
    pub id: String,
    /// Topic it was popped from.
    pub topic: String,
    /// Payload.
    pub body: Bytes,
    /// Token for ack/nack of this delivery only.
    pub receipt: String,
    /// 1 for the first delivery.
    pub attempt: u32,
    /// When the message became due, unix ms.
    pub deliver_at_ms: u64,
    /// Reservation length in ms.
    pub ttr_ms: u64,
}

/// What a reschedule asks for: a new due time and, optionally, new delivery settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RescheduleRequest {
    /// The new due time: [`When::DelayMs`] from the broker's receive time, or [`When::AtMs`]
    /// (a past time, or 0, means now).
    pub when: When,
    /// A new time-to-run for later deliveries.
    pub ttr_ms: Option<u64>,
    /// A new attempt limit.
    pub max_attempts: Option<u32>,
    /// Also move a reserved message (its receipt stops working).
    pub force: bool,
}

/// Where a reschedule moved a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rescheduled {
    /// The message id.
    pub id: String,
    /// `Delayed`, or `Ready` (`Dead` in a dead-letter topic) when due at once.
    pub state: MessageState,
    /// Its new due time, unix ms.
    pub deliver_at_ms: u64,
}

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageState {
    /// Waiting on a delay level.
    Delayed,
    /// In its topic queue, poppable.
    Ready,
    /// Popped, waiting for ack within its time-to-run.
    Reserved,
    /// Acked.
    Done,
    /// Cancelled before delivery.
    Cancelled,
    /// Moved to the dead-letter topic.
    Dead,
}

/// A look-up by id.
#[derive(Debug, Clone)]
pub struct MessageInfo {
    /// Message id.
    pub id: String,
    /// Original topic.
    pub topic: String,
    /// The dead-letter topic holding it, once it was dead-lettered (also while a consumer of that
    /// topic has it reserved, and after it is acked there).
    pub dead_letter_topic: Option<String>,
    /// Current state.
    pub state: MessageState,
    /// Next due time (or the due time it was delivered at), unix ms.
    pub deliver_at_ms: u64,
    /// Deliveries so far.
    pub attempt: u32,
    /// Payload.
    pub body: Bytes,
    /// Time-to-run carried by the message.
    pub ttr_ms: u64,
    /// When it was produced, unix ms.
    pub created_at_ms: u64,
    /// Why its latest failed delivery failed, once one did with a reason.
    pub last_error: Option<LastError>,
}

/// Why a message's latest failed delivery failed: the error its consumer gave with the nack, or
/// the push delivery's failure.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct LastError {
    /// The reason, at most 2048 bytes (a longer one is cut at a character boundary).
    pub message: String,
    /// When the delivery failed, unix ms.
    pub time_ms: u64,
    /// The delivery that failed (1 for the first).
    pub attempt: u32,
}

/// A [`LastError`] from the bytes a record holds (UTF-8, checked when it was decoded).
pub(crate) fn last_error(message: &[u8], time_ms: u64, attempt: u32) -> LastError {
    LastError { message: String::from_utf8_lossy(message).into_owned(), time_ms, attempt }
}

/// One recorded change of a message, as `GET /v1/messages/{id}/history` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct HistoryEntry {
    /// Unix ms of the change (for `produced`, of the produce).
    pub time_ms: u64,
    /// What happened: `produced`, `carried` (reclaim moved it), or the cause of a state change
    /// (`due`, `reserve`, `ack`, `nack`, `expire`, `dead_letter`, `cancel`, `redrive`,
    /// `reschedule`, `touch`).
    pub event: &'static str,
    /// The state it left the message in.
    pub state: MessageState,
    /// Deliveries so far, after the change.
    pub attempt: u32,
    /// The record's `deliver_at_ms` (when it falls due, or a reservation's end).
    pub deliver_at_ms: u64,
    /// The failure this change recorded (a nack with an error, a failed push, the dead-lettering
    /// that followed one), or for `carried` the last one the copy kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<LastError>,
}

/// Result of a nack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Nacked {
    /// Scheduled again at this unix ms.
    Retry { deliver_at_ms: u64 },
    /// Attempts exhausted: moved to this dead-letter topic.
    DeadLettered { topic: String },
}

/// Per-level counters.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct LevelStats {
    /// Level duration in ms.
    pub level_ms: u64,
    /// Timers not yet fired, of live messages only: the entry of a message acked, nacked or
    /// cancelled before its timer fired is left out (docs/operations.md, Metrics, says which still count).
    pub backlog: u64,
    /// Due time of the head entry, unix ms.
    pub next_due_ms: Option<u64>,
}

/// What happened to a topic's messages since this process started, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TopicCounts {
    /// Messages accepted by produce.
    pub produced: u64,
    /// Acks accepted.
    pub acked: u64,
    /// Nacks accepted.
    pub nacked: u64,
    /// Messages moved to the topic's dead-letter topic.
    pub dead_lettered: u64,
}

/// Per-topic counters.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct TopicStats {
    /// Topic name.
    pub topic: String,
    /// Messages in the queue not yet popped (exact: counted by state, kept across restarts).
    pub ready: u64,
    /// Messages popped and not yet acked.
    pub reserved: u64,
    /// Messages waiting on a delay level.
    pub delayed: u64,
    /// Messages moved to `{topic}.dlq` since the topic was last created (forgetting it resets this).
    pub dead_lettered: u64,
    /// What happened to its messages since the start (`/metrics` only).
    #[serde(skip)]
    pub counts: TopicCounts,
    /// When its oldest ready message became due, unix ms (`/metrics` only); None without one.
    #[serde(skip)]
    pub oldest_ready_ms: Option<u64>,
}

/// A topic's push subscription: delayd itself consumes the topic and delivers each due message.
/// Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct PushConfig {
    /// The topic consumed.
    pub topic: String,
    /// The webhook URL each message is POSTed to, or the NATS server's URL.
    pub url: String,
    /// For a NATS JetStream target, the subject each message is published to; `None`: a webhook.
    pub nats_subject: Option<String>,
    /// Signing secret for `Delayd-Signature` (never shown by the API).
    pub secret: Option<String>,
    /// How long one delivery may take, ms; the reservation is this plus a margin.
    pub timeout_ms: u32,
    /// Most deliveries under way at once.
    pub max_in_flight: u32,
    /// When it was set, unix ms.
    pub created_at_ms: u64,
}

impl std::fmt::Debug for PushConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushConfig")
            .field("topic", &self.topic)
            .field("url", &self.url)
            .field("nats_subject", &self.nats_subject)
            .field("secret", &self.secret.as_ref().map(|_| REDACTED))
            .field("timeout_ms", &self.timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("created_at_ms", &self.created_at_ms)
            .finish()
    }
}

/// What `Debug` shows in place of a secret.
pub const REDACTED: &str = "<redacted>";

/// A topic as `GET /v1/topics` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct TopicInfo {
    /// Topic name (a dead-letter topic ends in `.dlq` and is listed too).
    pub topic: String,
    /// Messages in the queue, not yet popped.
    pub ready: u64,
    /// Messages popped and not yet acked.
    pub reserved: u64,
    /// Messages waiting for their due time.
    pub delayed: u64,
    /// Messages now in `{topic}.dlq` and not finished (0 for a dead-letter topic itself).
    pub dead_lettered: u64,
    /// Pops on it find nothing until it is resumed.
    pub paused: bool,
    /// Its flow control, when it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow: Option<FlowConfig>,
}

/// A topic's flow control (`/v1/topics/{topic}/flow`): limits on how fast and how many of its
/// messages are handed out, by pops and push alike. A limit left out is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct FlowConfig {
    /// Deliveries per second at most (a token bucket's rate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_per_second: Option<u32>,
    /// Deliveries at once after a quiet spell (the bucket's size); with `max_per_second` only,
    /// default `max_per_second`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Messages of the topic reserved (popped, not yet acked) at once at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_reserved: Option<u32>,
    /// When it was set, unix ms.
    pub updated_at_ms: u64,
}

/// Snapshot for `/v1/stats` and `/metrics`.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct Stats {
    /// One entry per level, ascending.
    pub levels: Vec<LevelStats>,
    /// One entry per topic, by name.
    pub topics: Vec<TopicStats>,
    /// Bytes used by the data directory's files.
    pub disk_bytes: u64,
    /// Topic queues whose files are open (mapped, with a handle) now; at most `open_queues`.
    pub open_queues: usize,
    /// Bytes of the commit-log segment files.
    pub log_bytes: u64,
    /// Bytes ever appended to the commit log (its end offset), carries included.
    pub log_written_bytes: u64,
    /// Bytes of the records of every message still indexed (live or final within retention).
    pub live_bytes: u64,
    /// Messages in the id index (live, or final within `done_retention`).
    pub index_entries: u64,
    /// Slots of the id index table new messages go to; it grows before it fills up.
    pub index_slots: u64,
    /// What reclaim did since start.
    pub reclaim: ReclaimCounts,
    /// False while writes are refused: a sync failed (until a restart), or the last write ran out
    /// of disk space or file handles (until one succeeds).
    pub store_writable: bool,
    /// Why writes are refused (operation, file, OS error), if they are.
    pub store_error: Option<String>,
}

/// What reclaim did since start, as `/v1/stats` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[schema(as = ReclaimStats)]
pub struct ReclaimCounts {
    /// Messages copied forward.
    pub carried: u64,
    /// Bytes of Carry records written.
    pub carried_bytes: u64,
    /// Commit-log segments deleted.
    pub segments_deleted: u64,
    /// Bytes of segment files deleted.
    pub segment_bytes_deleted: u64,
    /// Consume-queue files deleted.
    pub queue_files_deleted: u64,
    /// Final messages removed from the id index after `done_retention`.
    pub expired: u64,
    /// Emptied topics forgotten: files and directory deleted, no longer counted in `max_topics`.
    pub topics_forgotten: u64,
    /// Records read by scans of the oldest segments (a scan runs only when the segments' counts
    /// say it could free or carry something, and again only once something there changed).
    pub scanned_records: u64,
}

impl From<ReclaimStats> for ReclaimCounts {
    fn from(s: ReclaimStats) -> Self {
        let ReclaimStats {
            carried,
            carried_bytes,
            segments_deleted,
            segment_bytes_deleted,
            queue_files_deleted,
            expired,
            topics_forgotten,
            scanned_records,
        } = s;
        ReclaimCounts {
            carried,
            carried_bytes,
            segments_deleted,
            segment_bytes_deleted,
            queue_files_deleted,
            expired,
            topics_forgotten,
            scanned_records,
        }
    }
}
