//! Every byte layout delayd writes lives here, encoded and decoded nowhere else: the record frame
//! and header, each record kind and the id hash (this file), the consume-queue entry
//! ([`entry`]), the id index slot and header ([`slot`]), the checkpoint and the clean-shutdown
//! marker ([`checkpoint`]) and the receipt key file ([`receipt_key`]).
//!
//! All integers are little-endian; host- and big-endian conversions are denied crate-wide (see
//! `Cargo.toml`). `storage-format.md` documents the same layouts for outside readers; change both
//! together. Fixed-size layouts encode to arrays and decode without allocating, so the hot paths
//! (queue reads, index probes) cost what the hand-written parsers did.

use crate::error::{Error, Result};

pub mod checkpoint;
pub mod entry;
pub mod receipt_key;
pub mod slot;

/// First two bytes after the length of every record; never zero so a zero-filled region never decodes.
pub const RECORD_MAGIC: u16 = 0xD71A;
/// Version written in records of the original kinds (Put, Transition, Hop, EndOfSegment).
pub const RECORD_VERSION: u8 = 1;
/// Version of records of kinds added later (Carry, Pause, Push), of a Put that replaces the message
/// its id named before (the compat `/push`), and of a Transition with a due time but no link back
/// (delayd now links every Transition, so writes those as [`RECORD_VERSION_LINKED`]): a delayd that knows only version 1 refuses to start on them instead of
/// taking them for damage, or for a Put that leaves the old message in place.
pub const RECORD_VERSION_CARRY: u8 = 2;
/// Version of a Transition that links back to the message's record before it (so a look-up can
/// show the message's history) and always has room for a due time.
pub const RECORD_VERSION_LINKED: u8 = 3;
/// Version of a Raft mark, the kind a cluster adds: a delayd from before clusters refuses to start
/// on a replicated log ("written by a newer delayd") instead of taking its marks for damage.
pub const RECORD_VERSION_RAFT: u8 = 4;
/// Version of a Reschedule Transition: the version 3 layout followed by the message's delivery
/// settings from then on (`ttr_ms`, `max_attempts`). A delayd that does not know it refuses to
/// start instead of delivering the message at its old time.
pub const RECORD_VERSION_RESCHEDULE: u8 = 5;
/// Version of a Touch Transition (the version 3 layout): a delayd that does not know it refuses to
/// start instead of expiring the reservation at its old time.
pub const RECORD_VERSION_TOUCH: u8 = 6;
/// Version of a record that holds a message's failure reason: a Nack or DeadLetter Transition
/// with the error its consumer (or the pusher) gave (the version 3 layout, then `error_len u16`
/// and the UTF-8 bytes), and a Carry of a message that has a last error (the version 2 layout,
/// then `error_time_ms u64, error_attempt u32, error_len u16` and the bytes). A delayd that does
/// not know it refuses to start instead of losing the reason.
pub const RECORD_VERSION_ERROR: u8 = 7;
/// Version of a Flow record (a topic's flow control), the only version that kind has: a delayd
/// that does not know it refuses to start instead of delivering the topic unthrottled.
pub const RECORD_VERSION_FLOW: u8 = 8;
/// Largest `max_per_second`, `burst` and `max_reserved` a Flow record holds.
pub const MAX_FLOW_VALUE: u32 = 1_000_000;
/// Longest failure reason kept, in bytes; a longer one is cut at a UTF-8 boundary (see
/// [`bounded_error`]).
pub const MAX_ERROR_BYTES: usize = 2048;
/// Frame header: len u32, magic u16, version u8, kind u8, crc u32.
pub const HEADER_BYTES: usize = 12;
/// Largest record the log accepts (a frame must also fit in one segment).
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// Longest topic name in bytes.
pub const MAX_TOPIC_BYTES: usize = 255;
/// Longest id in bytes.
pub const MAX_ID_BYTES: usize = 255;

/// What a record says; the numeric values are on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A produced message with its body.
    Put = 1,
    /// A state change of an existing message.
    Transition = 2,
    /// A timer moved to its next delay level; the message state is unchanged.
    Hop = 3,
    /// A live message copied forward out of an old segment, with its current state.
    Carry = 4,
    /// A topic paused or resumed by an operator.
    Pause = 5,
    /// A topic's push subscription set, replaced or removed.
    Push = 6,
    /// Closes one entry of a cluster's replicated log: its term and index (the records since the
    /// previous mark are the entry's).
    Raft = 7,
    /// A topic's flow control set, replaced or removed by an operator.
    Flow = 8,
    /// Closes a segment: the next record starts at the next segment.
    EndOfSegment = 0x7F,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Put),
            2 => Some(Kind::Transition),
            3 => Some(Kind::Hop),
            4 => Some(Kind::Carry),
            5 => Some(Kind::Pause),
            6 => Some(Kind::Push),
            7 => Some(Kind::Raft),
            8 => Some(Kind::Flow),
            0x7F => Some(Kind::EndOfSegment),
            _ => None,
        }
    }
}

/// Message states as stored in records and the id index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    /// Waiting on a delay level.
    Delayed = 1,
    /// In its topic queue.
    Ready = 2,
    /// Popped, within its time-to-run.
    Reserved = 3,
    /// Acked.
    Done = 4,
    /// Cancelled.
    Cancelled = 5,
    /// In the dead-letter topic, poppable there.
    Dead = 6,
}

impl State {
    /// Decodes a state byte.
    pub fn from_u8(v: u8) -> Option<State> {
        match v {
            1 => Some(State::Delayed),
            2 => Some(State::Ready),
            3 => Some(State::Reserved),
            4 => Some(State::Done),
            5 => Some(State::Cancelled),
            6 => Some(State::Dead),
            _ => None,
        }
    }

    /// Done and cancelled messages never move again.
    pub fn is_final(self) -> bool {
        matches!(self, State::Done | State::Cancelled)
    }
}

/// Which topic queue of a message: its own, or `{topic}.dlq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Home {
    /// The topic the message was produced to.
    Main = 0,
    /// The dead-letter topic.
    DeadLetter = 1,
}

/// Why a transition happened; recorded so counters replay exactly and operators can read history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Cause {
    /// The delay elapsed: the message entered its topic queue.
    Due = 1,
    /// A consumer popped it.
    Reserve = 2,
    /// The consumer acked it.
    Ack = 3,
    /// The consumer nacked it.
    Nack = 4,
    /// Its time-to-run expired without an ack.
    Expire = 5,
    /// Attempts ran out: moved to the dead-letter topic.
    DeadLetter = 6,
    /// Cancelled by id.
    Cancel = 7,
    /// An operator moved it from the dead-letter topic back to its topic (written in a Transition
    /// of version 2 or later, today always 3, so a delayd that knows only version 1 refuses the
    /// log instead of taking it for damage).
    Redrive = 8,
    /// An operator moved a pending message to a new due time, possibly with a new time-to-run and
    /// attempt limit (written only in Transitions of version 5, which hold those settings).
    Reschedule = 9,
    /// A consumer extended its reservation (written only in Transitions of version 6). The
    /// message stays reserved under the same receipt.
    Touch = 10,
}

impl Cause {
    /// Decodes a cause byte.
    pub fn from_u8(v: u8) -> Option<Cause> {
        match v {
            1 => Some(Cause::Due),
            2 => Some(Cause::Reserve),
            3 => Some(Cause::Ack),
            4 => Some(Cause::Nack),
            5 => Some(Cause::Expire),
            6 => Some(Cause::DeadLetter),
            7 => Some(Cause::Cancel),
            8 => Some(Cause::Redrive),
            9 => Some(Cause::Reschedule),
            10 => Some(Cause::Touch),
            _ => None,
        }
    }
}

/// Where the record that carries it puts an index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// No consume-queue entry (ack, cancel).
    None,
    /// The message's topic queue (main or dead-letter, per the record's home).
    Topic,
    /// A delay-level queue: the level's duration and the entry's due time, unix ms.
    Level { level_ms: u64, due_ms: u64 },
}

const ROUTE_BYTES: usize = 17;

/// A produced message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Put<'a> {
    /// Unix ms the broker accepted it.
    pub created_ms: u64,
    /// Unix ms it becomes ready.
    pub deliver_at_ms: u64,
    /// Time-to-run in ms.
    pub ttr_ms: u64,
    /// Deliveries before dead-lettering.
    pub max_attempts: u32,
    /// How the producer asked for the delay: 0 now, 1 delay_ms, 2 deliver_at_ms, 3 level index.
    pub request_kind: u8,
    /// The value the producer sent with `request_kind`.
    pub request_value: u64,
    /// First consume-queue entry: the topic, or the first level hop.
    pub route: Route,
    /// Message id.
    pub id: &'a [u8],
    /// Topic name.
    pub topic: &'a [u8],
    /// Retry steps for nack, ms; empty means the broker default.
    pub backoff_ms: Vec<u64>,
    /// Payload.
    pub body: &'a [u8],
    /// The message replaces any earlier one with its id, which is final by then (written as record
    /// version 2; always false inside a Carry).
    pub replaces: bool,
}

/// A state change of the message whose Put record is at `msg_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition<'a> {
    /// Commit-log offset of the message's Put record.
    pub msg_offset: u64,
    /// Hash of the message id (see [`id_hash`]), to find its index slot without reading the Put.
    pub id_hash: u64,
    /// The message's sequence number after this change; each transition adds one.
    pub seq: u32,
    /// State before the change, so counters replay exactly.
    pub prev_state: State,
    /// State after the change.
    pub state: State,
    /// Why it changed.
    pub cause: Cause,
    /// Queue the message belongs to after the change.
    pub home: Home,
    /// Deliveries so far after the change.
    pub attempt: u32,
    /// Unix ms of the change.
    pub time_ms: u64,
    /// Delayed: when it becomes ready; Reserved: when the reservation expires; Done and Cancelled:
    /// the due time the message had; else when it became ready.
    pub deliver_at_ms: u64,
    /// Consume-queue entry this change implies.
    pub route: Route,
    /// Reserve and Redrive only: when the delivery it reserves fell due, so that an ack or cancel
    /// can keep it (0 on disk for none in version 3); `None` in version 1 records.
    pub due_ms: Option<u64>,
    /// The message's record this change follows (its Put, Carry or previous Transition), for its
    /// history (version 3); `None` in older records.
    pub prev_offset: Option<u64>,
    /// Reschedule only (version 5): the message's delivery settings from this change on, in place
    /// of its Put's.
    pub settings: Option<DeliverySettings>,
    /// Nack or DeadLetter only (version 7): why the delivery failed, UTF-8, 1 to
    /// [`MAX_ERROR_BYTES`] bytes (a longer one is cut when encoded).
    pub error: Option<&'a [u8]>,
}

impl Transition<'_> {
    /// The same change without its reason: what dispatch reads, free of the log's borrow.
    pub fn without_error(&self) -> Transition<'static> {
        Transition {
            msg_offset: self.msg_offset,
            id_hash: self.id_hash,
            seq: self.seq,
            prev_state: self.prev_state,
            state: self.state,
            cause: self.cause,
            home: self.home,
            attempt: self.attempt,
            time_ms: self.time_ms,
            deliver_at_ms: self.deliver_at_ms,
            route: self.route,
            due_ms: self.due_ms,
            prev_offset: self.prev_offset,
            settings: self.settings,
            error: None,
        }
    }
}

/// Why a message's latest failed delivery failed, as a Carry keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastError<'a> {
    /// Unix ms of the failure (the time of the Transition that recorded it).
    pub time_ms: u64,
    /// The delivery that failed (its `attempt`).
    pub attempt: u32,
    /// The reason, UTF-8, 1 to [`MAX_ERROR_BYTES`] bytes.
    pub message: &'a [u8],
}

/// `error` cut to at most [`MAX_ERROR_BYTES`] bytes, at a character boundary.
pub fn bounded_error(error: &str) -> &str {
    if error.len() <= MAX_ERROR_BYTES {
        return error;
    }
    let mut end = MAX_ERROR_BYTES;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    &error[..end]
}

/// [`bounded_error`] for bytes known to be UTF-8 (an invalid tail is dropped).
fn bounded_error_bytes(error: &[u8]) -> &[u8] {
    let text = match std::str::from_utf8(error) {
        Ok(t) => t,
        Err(e) => std::str::from_utf8(&error[..e.valid_up_to()]).unwrap_or_default(),
    };
    bounded_error(text).as_bytes()
}

/// A message's time-to-run and attempt limit, as a Reschedule sets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliverySettings {
    /// Time-to-run of each delivery, ms.
    pub ttr_ms: u64,
    /// Deliveries before dead-lettering (`u32::MAX`: never).
    pub max_attempts: u32,
}

/// A topic paused (pops on it find nothing) or resumed. The latest one per topic counts; reclaim
/// copies a pause forward before it deletes the segment holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pause<'a> {
    /// Paused (true) or resumed.
    pub paused: bool,
    /// Unix ms of the operator's request (of the original one, in a copy).
    pub time_ms: u64,
    /// The topic (as produced; a dead-letter topic ends in `.dlq`).
    pub topic: &'a [u8],
}

/// A topic's flow control set or replaced, or removed (every limit 0). The latest one per topic
/// counts; reclaim copies the one in effect forward, as it does a pause. A limit of 0 is none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow<'a> {
    /// Unix ms of the operator's request (of the original one, in a copy).
    pub time_ms: u64,
    /// Deliveries per second (pops and push), a token bucket's rate; 0: unlimited.
    pub max_per_second: u32,
    /// The token bucket's size (deliveries at once after a quiet spell); 0 with no rate.
    pub burst: u32,
    /// Most messages of the topic reserved at once; 0: unlimited.
    pub max_reserved: u32,
    /// The topic.
    pub topic: &'a [u8],
}

impl Flow<'_> {
    /// Whether the record removes the topic's flow control.
    pub fn is_clear(&self) -> bool {
        self.max_per_second == 0 && self.burst == 0 && self.max_reserved == 0
    }
}

/// What kind of consensus entry a [`RaftMark`] closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EntryKind {
    /// Records (the ones between the previous mark and this one), or none: a new leader's empty
    /// entry.
    Normal = 0,
    /// A membership change; its encoded change is the mark's payload.
    ConfChange = 1,
}

/// The end of one entry of a cluster's replicated log. The entry's records are the ones from
/// `data_start` up to this mark; on a single node there are no marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftMark<'a> {
    /// The consensus term of the leader that made the entry.
    pub term: u64,
    /// The entry's index in the replicated log (1, 2, ...).
    pub index: u64,
    /// Normal or membership change.
    pub kind: EntryKind,
    /// Log offset of the entry's first record (the mark's own offset when it has none).
    pub data_start: u64,
    /// The membership change for [`EntryKind::ConfChange`]; empty otherwise.
    pub payload: &'a [u8],
}

/// Most payload bytes a Raft mark holds (an encoded membership change is far smaller).
pub const MAX_RAFT_PAYLOAD_BYTES: usize = 64 << 10;

/// Where a push subscription delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PushTarget {
    /// None: the record removes the subscription.
    None = 0,
    /// An HTTP(S) webhook at `url`.
    Webhook = 1,
    /// A NATS JetStream `subject` on the server at `url`.
    Nats = 2,
}

/// Longest push URL in bytes.
pub const MAX_PUSH_URL_BYTES: usize = 2048;
/// Longest push secret in bytes.
pub const MAX_PUSH_SECRET_BYTES: usize = 1024;

/// A topic's push subscription set or replaced (`target` not None) or removed. The latest one
/// per topic counts; reclaim copies the one in effect forward, as it does a pause. Its `Debug`
/// (and so a [`Record`]'s) never shows the secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Push<'a> {
    /// Where deliveries go; None removes the subscription.
    pub target: PushTarget,
    /// Unix ms of the operator's request (of the original one, in a copy).
    pub time_ms: u64,
    /// How long one delivery may take, ms.
    pub timeout_ms: u32,
    /// Most deliveries under way at once.
    pub max_in_flight: u32,
    /// The topic.
    pub topic: &'a [u8],
    /// Webhook URL, or the NATS server URL.
    pub url: &'a [u8],
    /// NATS subject (empty for a webhook).
    pub subject: &'a [u8],
    /// Signing secret (empty for none).
    pub secret: &'a [u8],
}

impl std::fmt::Debug for Push<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        f.debug_struct("Push")
            .field("target", &self.target)
            .field("time_ms", &self.time_ms)
            .field("timeout_ms", &self.timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("topic", &text(self.topic))
            .field("url", &text(self.url))
            .field("subject", &text(self.subject))
            .field("secret", &(!self.secret.is_empty()).then_some(crate::message::REDACTED))
            .finish()
    }
}

/// A timer moved on to its next level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hop {
    /// Commit-log offset of the message's Put record.
    pub msg_offset: u64,
    /// Hash of the message id.
    pub id_hash: u64,
    /// The sequence number the timer belongs to; a newer one makes it stale.
    pub seq: u32,
    /// Unix ms the timer finally fires.
    pub target_ms: u64,
    /// Next level entry (always `Route::Level`).
    pub route: Route,
}

/// A live message re-put at the end of the log so the segment holding its Put can be deleted.
///
/// From its dispatch on, the message lives at the Carry's offset: transitions, hops and receipts
/// name that offset, and records naming `prev_msg_offset` are stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carry<'a> {
    /// Offset of the Put or Carry this one replaces.
    pub prev_msg_offset: u64,
    /// The message's sequence number (unchanged by carrying).
    pub seq: u32,
    /// Deliveries so far.
    pub attempt: u32,
    /// The message's state (never Reserved: a receipt names the record it was handed out from).
    pub state: State,
    /// Which topic queue the message belongs to.
    pub home: Home,
    /// Unix ms of the carry; for a final message, when it became final (its retention runs on).
    pub time_ms: u64,
    /// Delayed: when it becomes ready; otherwise as the record it replaces said.
    pub deliver_at_ms: u64,
    /// The message as produced; its `route` is the entry the carry makes (topic or level).
    pub put: Put<'a>,
    /// The message's last failure, kept across the copy (written as record version 7).
    pub last_error: Option<LastError<'a>>,
}

/// A decoded record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// See [`Put`].
    Put(Put<'a>),
    /// See [`Transition`].
    Transition(Transition<'a>),
    /// See [`Hop`].
    Hop(Hop),
    /// See [`Carry`].
    Carry(Carry<'a>),
    /// See [`Pause`].
    Pause(Pause<'a>),
    /// See [`Push`].
    Push(Push<'a>),
    /// See [`RaftMark`].
    Raft(RaftMark<'a>),
    /// See [`Flow`].
    Flow(Flow<'a>),
    /// End of segment.
    EndOfSegment,
}

impl Record<'_> {
    /// The route this record implies for the dispatcher.
    pub fn route(&self) -> Route {
        match self {
            Record::Put(p) => p.route,
            Record::Transition(t) => t.route,
            Record::Hop(h) => h.route,
            Record::Carry(c) => c.put.route,
            Record::Pause(_) | Record::Push(_) | Record::Flow(_) | Record::Raft(_) | Record::EndOfSegment => {
                Route::None
            }
        }
    }

    /// The record's bytes, framed and checksummed: the one way any record is encoded.
    pub fn encode(&self) -> Result<Vec<u8>> {
        match self {
            Record::Put(p) => encode_put(p),
            Record::Transition(t) => Ok(encode_transition(t)),
            Record::Hop(h) => Ok(encode_hop(h)),
            Record::Carry(c) => encode_carry(c),
            Record::Pause(p) => encode_pause(p),
            Record::Push(p) => encode_push(p),
            Record::Raft(m) => encode_raft(m),
            Record::Flow(f) => encode_flow(f),
            Record::EndOfSegment => Ok(encode_end_of_segment()),
        }
    }

    /// True for the records that carry a message's body (Put and Carry).
    pub fn has_body(&self) -> bool {
        matches!(self, Record::Put(_) | Record::Carry(_))
    }
}

/// Why bytes at an offset are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// All zero: the unwritten, preallocated part of a segment.
    Empty,
    /// Not enough bytes for the header or the length it claims.
    Truncated,
    /// Wrong magic, version, kind, length or CRC, or a malformed payload.
    Invalid(&'static str),
}

/// FNV-1a 64 of the id, then the splitmix64 finaliser so linear probing sees well-spread values.
pub fn id_hash(id: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The little-endian integer at `at` in a fixed-size layout (offsets are constants within `N`).
fn u16_at<const N: usize>(b: &[u8; N], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

/// See [`u16_at`].
fn u32_at<const N: usize>(b: &[u8; N], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// See [`u16_at`].
fn u64_at<const N: usize>(b: &[u8; N], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// The 12-byte frame header every record starts with: `len u32, magic u16, version u8, kind u8,
/// crc u32`. Version and kind are raw bytes: whether they are valid (and go together) is decided
/// after the CRC, by [`check_frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Length of the whole record, header included.
    pub len: u32,
    /// Always [`RECORD_MAGIC`] in a header that decodes.
    pub magic: u16,
    /// Record version byte.
    pub version: u8,
    /// Record kind byte.
    pub kind: u8,
    /// CRC32 of the first 8 header bytes and the payload.
    pub crc: u32,
}

impl RecordHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4..6].copy_from_slice(&self.magic.to_le_bytes());
        b[6] = self.version;
        b[7] = self.kind;
        b[8..12].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    /// Reads exactly [`HEADER_BYTES`] bytes: `Empty` for zeroes (unwritten log space),
    /// `Truncated` for fewer bytes, `Invalid` for more or for a wrong magic. Nothing is said about
    /// the record behind it: [`check_frame`] checks its length, CRC, version and kind.
    pub fn decode(b: &[u8]) -> Result<RecordHeader, DecodeError> {
        if b.len() < HEADER_BYTES {
            return Err(if b.iter().all(|x| *x == 0) { DecodeError::Empty } else { DecodeError::Truncated });
        }
        let b: &[u8; HEADER_BYTES] =
            b.try_into().map_err(|_| DecodeError::Invalid("bytes after the header"))?;
        if b.iter().all(|x| *x == 0) {
            return Err(DecodeError::Empty);
        }
        let h = RecordHeader::from_bytes(b);
        if h.magic != RECORD_MAGIC {
            return Err(DecodeError::Invalid("bad magic"));
        }
        Ok(h)
    }

    /// Reads the fields without checking anything (for a header a queue or the index points at,
    /// whose record was checked when it was dispatched).
    pub fn from_bytes(b: &[u8; HEADER_BYTES]) -> RecordHeader {
        RecordHeader { len: u32_at(b, 0), magic: u16_at(b, 4), version: b[6], kind: b[7], crc: u32_at(b, 8) }
    }
}

/// Whether `b` has the record magic where a header at its start would: a cheap filter before
/// [`check_frame`] when scanning for records.
pub fn has_record_magic(b: &[u8]) -> bool {
    b.get(4..6) == Some(&RECORD_MAGIC.to_le_bytes()[..])
}

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn route(&mut self, r: Route) {
        match r {
            Route::None => {
                self.u8(0);
                self.u64(0);
                self.u64(0);
            }
            Route::Topic => {
                self.u8(1);
                self.u64(0);
                self.u64(0);
            }
            Route::Level { level_ms, due_ms } => {
                self.u8(2);
                self.u64(level_ms);
                self.u64(due_ms);
            }
        }
    }
}

struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Invalid("length overflow"))?;
        let s = self.buf.get(self.pos..end).ok_or(DecodeError::Invalid("field past record end"))?;
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn state(&mut self) -> Result<State, DecodeError> {
        State::from_u8(self.u8()?).ok_or(DecodeError::Invalid("unknown state"))
    }
    fn route(&mut self) -> Result<Route, DecodeError> {
        let tag = self.u8()?;
        let a = self.u64()?;
        let b = self.u64()?;
        match tag {
            0 => Ok(Route::None),
            1 => Ok(Route::Topic),
            2 => Ok(Route::Level { level_ms: a, due_ms: b }),
            _ => Err(DecodeError::Invalid("unknown route")),
        }
    }
    fn home(&mut self) -> Result<Home, DecodeError> {
        match self.u8()? {
            0 => Ok(Home::Main),
            1 => Ok(Home::DeadLetter),
            _ => Err(DecodeError::Invalid("unknown home")),
        }
    }
    fn put(&mut self) -> Result<Put<'a>, DecodeError> {
        let created_ms = self.u64()?;
        let deliver_at_ms = self.u64()?;
        let ttr_ms = self.u64()?;
        let max_attempts = self.u32()?;
        let request_kind = self.u8()?;
        let request_value = self.u64()?;
        let route = self.route()?;
        let n = self.u16()? as usize;
        let id = self.take(n)?;
        let n = self.u16()? as usize;
        let topic = self.take(n)?;
        let n = self.u16()? as usize;
        let mut backoff_ms = Vec::with_capacity(n.min(self.buf.len() / 8));
        for _ in 0..n {
            backoff_ms.push(self.u64()?);
        }
        let n = self.u32()? as usize;
        let body = self.take(n)?;
        Ok(Put {
            created_ms,
            deliver_at_ms,
            ttr_ms,
            max_attempts,
            request_kind,
            request_value,
            route,
            id,
            topic,
            backoff_ms,
            body,
            replaces: false,
        })
    }
    /// A failure reason: `len u16` (1 to [`MAX_ERROR_BYTES`]) and that many UTF-8 bytes.
    fn error(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u16()? as usize;
        if n == 0 || n > MAX_ERROR_BYTES {
            return Err(DecodeError::Invalid("error length"));
        }
        let message = self.take(n)?;
        std::str::from_utf8(message).map_err(|_| DecodeError::Invalid("error is not UTF-8"))?;
        Ok(message)
    }

    fn done(&self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(DecodeError::Invalid("trailing bytes in record"))
        }
    }
}

fn frame(kind: Kind, payload_len: usize, fill: impl FnOnce(&mut Enc)) -> Vec<u8> {
    let version = if matches!(kind, Kind::Carry | Kind::Pause | Kind::Push) {
        RECORD_VERSION_CARRY
    } else {
        RECORD_VERSION
    };
    frame_v(kind, version, payload_len, fill)
}

fn frame_v(kind: Kind, version: u8, payload_len: usize, fill: impl FnOnce(&mut Enc)) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(HEADER_BYTES + payload_len));
    e.0.extend_from_slice(&[0; HEADER_BYTES]);
    fill(&mut e);
    let mut buf = e.0;
    // The CRC covers the header's first 8 bytes, so they go in before it is computed.
    let mut h =
        RecordHeader { len: buf.len() as u32, magic: RECORD_MAGIC, version, kind: kind as u8, crc: 0 };
    buf[..HEADER_BYTES].copy_from_slice(&h.encode());
    h.crc = frame_crc(&buf);
    buf[..HEADER_BYTES].copy_from_slice(&h.encode());
    buf
}

fn frame_crc(record: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&record[0..8]);
    h.update(&record[HEADER_BYTES..]);
    h.finalize()
}

/// Checks a Put's field widths and returns its payload length.
fn put_payload_len(p: &Put<'_>, extra: usize) -> Result<usize> {
    if p.id.len() > MAX_ID_BYTES || p.id.is_empty() {
        return Err(Error::invalid("id", format!("must be 1 to {MAX_ID_BYTES} bytes")));
    }
    if p.topic.len() > MAX_TOPIC_BYTES || p.topic.is_empty() {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_BYTES} bytes")));
    }
    if p.backoff_ms.len() > u16::MAX as usize {
        return Err(Error::invalid("backoff", "too many steps"));
    }
    let payload = extra
        + 8 * 3
        + 4
        + 1
        + 8
        + ROUTE_BYTES
        + 2
        + p.id.len()
        + 2
        + p.topic.len()
        + 2
        + 8 * p.backoff_ms.len()
        + 4
        + p.body.len();
    let total = HEADER_BYTES + payload;
    if total > MAX_RECORD_BYTES {
        return Err(Error::TooLarge(format!("record of {total} bytes exceeds {MAX_RECORD_BYTES}")));
    }
    Ok(payload)
}

impl Enc {
    /// A failure reason already bounded to [`MAX_ERROR_BYTES`]: `len u16` and the bytes.
    fn error(&mut self, message: &[u8]) {
        self.u16(message.len() as u16);
        self.0.extend_from_slice(message);
    }

    fn put(&mut self, p: &Put<'_>) {
        self.u64(p.created_ms);
        self.u64(p.deliver_at_ms);
        self.u64(p.ttr_ms);
        self.u32(p.max_attempts);
        self.u8(p.request_kind);
        self.u64(p.request_value);
        self.route(p.route);
        self.u16(p.id.len() as u16);
        self.0.extend_from_slice(p.id);
        self.u16(p.topic.len() as u16);
        self.0.extend_from_slice(p.topic);
        self.u16(p.backoff_ms.len() as u16);
        for b in &p.backoff_ms {
            self.u64(*b);
        }
        self.u32(p.body.len() as u32);
        self.0.extend_from_slice(p.body);
    }
}

/// Encodes a Put record. Fails if a field exceeds its width.
pub fn encode_put(p: &Put<'_>) -> Result<Vec<u8>> {
    let payload = put_payload_len(p, 0)?;
    let version = if p.replaces { RECORD_VERSION_CARRY } else { RECORD_VERSION };
    Ok(frame_v(Kind::Put, version, payload, |e| e.put(p)))
}

/// Bytes a Carry record adds in front of the Put fields it repeats.
pub const CARRY_EXTRA_BYTES: usize = 8 + 4 + 4 + 1 + 1 + 8 + 8;

/// Encodes a Carry record. Fails if a field exceeds its width.
pub fn encode_carry(c: &Carry<'_>) -> Result<Vec<u8>> {
    let error = c.last_error.map(|l| (l, bounded_error_bytes(l.message))).filter(|(_, m)| !m.is_empty());
    let extra = error.map_or(0, |(_, m)| 8 + 4 + 2 + m.len());
    let payload = put_payload_len(&c.put, CARRY_EXTRA_BYTES + extra)?;
    let version = if error.is_some() { RECORD_VERSION_ERROR } else { RECORD_VERSION_CARRY };
    Ok(frame_v(Kind::Carry, version, payload, |e| {
        e.u64(c.prev_msg_offset);
        e.u32(c.seq);
        e.u32(c.attempt);
        e.u8(c.state as u8);
        e.u8(c.home as u8);
        e.u64(c.time_ms);
        e.u64(c.deliver_at_ms);
        e.put(&c.put);
        if let Some((l, message)) = error {
            e.u64(l.time_ms);
            e.u32(l.attempt);
            e.error(message);
        }
    }))
}

/// Encodes a Transition record.
pub fn encode_transition(t: &Transition<'_>) -> Vec<u8> {
    // A reason goes only with a Nack or DeadLetter, linked, never with settings; cut to its bound.
    let error = t
        .error
        .map(bounded_error_bytes)
        .filter(|m| !m.is_empty() && matches!(t.cause, Cause::Nack | Cause::DeadLetter))
        .filter(|_| t.settings.is_none());
    let (version, extra) = match (t.settings, t.prev_offset, t.due_ms) {
        _ if error.is_some() => (RECORD_VERSION_ERROR, 16 + 2 + error.map_or(0, <[u8]>::len)),
        (Some(_), _, _) => (RECORD_VERSION_RESCHEDULE, 16 + 12),
        (None, Some(_), _) if t.cause == Cause::Touch => (RECORD_VERSION_TOUCH, 16),
        (None, Some(_), _) => (RECORD_VERSION_LINKED, 16),
        (None, None, Some(_)) => (RECORD_VERSION_CARRY, 8),
        (None, None, None) => (RECORD_VERSION, 0),
    };
    frame_v(Kind::Transition, version, 8 + 8 + 4 + 4 + 4 + 8 + 8 + ROUTE_BYTES + extra, |e| {
        e.u64(t.msg_offset);
        e.u64(t.id_hash);
        e.u32(t.seq);
        e.u8(t.prev_state as u8);
        e.u8(t.state as u8);
        e.u8(t.cause as u8);
        e.u8(t.home as u8);
        e.u32(t.attempt);
        e.u64(t.time_ms);
        e.u64(t.deliver_at_ms);
        e.route(t.route);
        match (t.settings, t.prev_offset, t.due_ms) {
            (Some(s), prev, due) => {
                e.u64(due.unwrap_or(0));
                e.u64(prev.unwrap_or(0));
                e.u64(s.ttr_ms);
                e.u32(s.max_attempts);
            }
            (None, Some(prev), due) => {
                e.u64(due.unwrap_or(0));
                e.u64(prev);
            }
            (None, None, due) if error.is_some() => {
                e.u64(due.unwrap_or(0));
                e.u64(0);
            }
            (None, None, Some(due)) => e.u64(due),
            (None, None, None) => {}
        }
        if let Some(message) = error {
            e.error(message);
        }
    })
}

/// Encodes a Pause record. Fails on an empty or too long topic.
pub fn encode_pause(p: &Pause<'_>) -> Result<Vec<u8>> {
    if p.topic.is_empty() || p.topic.len() > MAX_TOPIC_BYTES {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_BYTES} bytes")));
    }
    Ok(frame(Kind::Pause, 1 + 8 + 2 + p.topic.len(), |e| {
        e.u8(u8::from(p.paused));
        e.u64(p.time_ms);
        e.u16(p.topic.len() as u16);
        e.0.extend_from_slice(p.topic);
    }))
}

/// Encodes a Push record. Fails on a field longer than its limit, or a subscription without a
/// URL.
pub fn encode_push(p: &Push<'_>) -> Result<Vec<u8>> {
    if p.topic.is_empty() || p.topic.len() > MAX_TOPIC_BYTES {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_BYTES} bytes")));
    }
    if p.url.len() > MAX_PUSH_URL_BYTES || (p.target != PushTarget::None && p.url.is_empty()) {
        return Err(Error::invalid("url", format!("must be 1 to {MAX_PUSH_URL_BYTES} bytes")));
    }
    if p.subject.len() > MAX_TOPIC_BYTES {
        return Err(Error::invalid("subject", format!("must be at most {MAX_TOPIC_BYTES} bytes")));
    }
    if p.secret.len() > MAX_PUSH_SECRET_BYTES {
        return Err(Error::invalid("secret", format!("must be at most {MAX_PUSH_SECRET_BYTES} bytes")));
    }
    let len = 1 + 8 + 4 + 4 + 2 * 4 + p.topic.len() + p.url.len() + p.subject.len() + p.secret.len();
    Ok(frame(Kind::Push, len, |e| {
        e.u8(p.target as u8);
        e.u64(p.time_ms);
        e.u32(p.timeout_ms);
        e.u32(p.max_in_flight);
        for field in [p.topic, p.url, p.subject, p.secret] {
            e.u16(field.len() as u16);
            e.0.extend_from_slice(field);
        }
    }))
}

/// Encodes a Flow record. Fails on an empty or too long topic, a value over
/// [`MAX_FLOW_VALUE`], or a burst without a rate.
pub fn encode_flow(f: &Flow<'_>) -> Result<Vec<u8>> {
    if f.topic.is_empty() || f.topic.len() > MAX_TOPIC_BYTES {
        return Err(Error::invalid("topic", format!("must be 1 to {MAX_TOPIC_BYTES} bytes")));
    }
    if [f.max_per_second, f.burst, f.max_reserved].iter().any(|&v| v > MAX_FLOW_VALUE)
        || (f.burst == 0) != (f.max_per_second == 0)
    {
        return Err(Error::invalid("flow", format!("limits must be at most {MAX_FLOW_VALUE}, a burst only with a rate")));
    }
    Ok(frame_v(Kind::Flow, RECORD_VERSION_FLOW, 8 + 4 * 3 + 2 + f.topic.len(), |e| {
        e.u64(f.time_ms);
        e.u32(f.max_per_second);
        e.u32(f.burst);
        e.u32(f.max_reserved);
        e.u16(f.topic.len() as u16);
        e.0.extend_from_slice(f.topic);
    }))
}

/// Encodes a Raft mark. Fails on a payload over [`MAX_RAFT_PAYLOAD_BYTES`].
pub fn encode_raft(m: &RaftMark<'_>) -> Result<Vec<u8>> {
    if m.payload.len() > MAX_RAFT_PAYLOAD_BYTES {
        return Err(Error::invalid("payload", format!("must be at most {MAX_RAFT_PAYLOAD_BYTES} bytes")));
    }
    Ok(frame_v(Kind::Raft, RECORD_VERSION_RAFT, 8 + 8 + 1 + 8 + 4 + m.payload.len(), |e| {
        e.u64(m.term);
        e.u64(m.index);
        e.u8(m.kind as u8);
        e.u64(m.data_start);
        e.u32(m.payload.len() as u32);
        e.0.extend_from_slice(m.payload);
    }))
}

/// Encodes a Hop record.
pub fn encode_hop(h: &Hop) -> Vec<u8> {
    frame(Kind::Hop, 8 + 8 + 4 + 8 + ROUTE_BYTES, |e| {
        e.u64(h.msg_offset);
        e.u64(h.id_hash);
        e.u32(h.seq);
        e.u64(h.target_ms);
        e.route(h.route);
    })
}

/// Encodes the end-of-segment marker.
pub fn encode_end_of_segment() -> Vec<u8> {
    frame(Kind::EndOfSegment, 0, |_| {})
}

/// Reads the frame at the start of `buf`: returns its total length after checking magic, version and CRC.
pub fn check_frame(buf: &[u8]) -> Result<(usize, Kind), DecodeError> {
    check_frame_with(buf, Verify::Crc)
}

/// Whether a decode checks the record's CRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Checks the CRC over the whole record: for anything read to be trusted or handed out.
    Crc,
    /// Checks the frame's structure only (magic, length, version, kind, fields), not the CRC, so
    /// the bytes past the fields (a message's body) are never touched: for a record the index or a
    /// queue points at, whose fields were verified when it was dispatched, read for those fields.
    Fields,
}

fn check_frame_with(buf: &[u8], verify: Verify) -> Result<(usize, Kind), DecodeError> {
    let h = RecordHeader::decode(buf.get(..HEADER_BYTES).unwrap_or(buf))?;
    let len = h.len as usize;
    if !(HEADER_BYTES..=MAX_RECORD_BYTES).contains(&len) {
        return Err(DecodeError::Invalid("bad record length"));
    }
    if buf.len() < len {
        return Err(DecodeError::Truncated);
    }
    if verify == Verify::Crc {
        #[cfg(test)]
        if h.kind == Kind::Put as u8 || h.kind == Kind::Carry as u8 {
            body_checks::note();
        }
        if frame_crc(&buf[..len]) != h.crc {
            return Err(DecodeError::Invalid("crc mismatch"));
        }
    }
    // Checked after the CRC, so a flipped bit reads as damage and an intact record from a newer
    // writer reads as such.
    let known = [
        RECORD_VERSION,
        RECORD_VERSION_CARRY,
        RECORD_VERSION_LINKED,
        RECORD_VERSION_RAFT,
        RECORD_VERSION_RESCHEDULE,
        RECORD_VERSION_TOUCH,
        RECORD_VERSION_ERROR,
        RECORD_VERSION_FLOW,
    ];
    if !known.contains(&h.version) {
        return Err(DecodeError::Invalid("unsupported record version"));
    }
    let kind = Kind::from_u8(h.kind).ok_or(DecodeError::Invalid("unknown record kind"))?;
    // Carry, Pause and Push exist only as version 2; a Put may be 1 or 2 (2: it replaces); a Transition
    // 1, 2 (it ends with a due time), 3 (a due time and a link to the record before it) or 5 (a
    // Reschedule: version 3 and the settings it sets), 6 (a Touch, as version 3) or 7 (version 3 and
    // a failure reason), a Carry also 7 (with the message's last failure); the rest only 1.
    let v2 = h.version == RECORD_VERSION_CARRY;
    let with_error = h.version == RECORD_VERSION_ERROR;
    let only_v2 = matches!(kind, Kind::Pause | Kind::Push) || (kind == Kind::Carry && !with_error);
    let v3 = h.version == RECORD_VERSION_LINKED;
    if (only_v2 && !v2)
        || (v2 && !matches!(kind, Kind::Carry | Kind::Pause | Kind::Push | Kind::Put | Kind::Transition))
        || ((v3 || h.version == RECORD_VERSION_RESCHEDULE || h.version == RECORD_VERSION_TOUCH)
            && kind != Kind::Transition)
        || ((h.version == RECORD_VERSION_RAFT) != (kind == Kind::Raft))
        || (with_error && !matches!(kind, Kind::Transition | Kind::Carry))
        || ((h.version == RECORD_VERSION_FLOW) != (kind == Kind::Flow))
    {
        return Err(DecodeError::Invalid("record kind and version do not match"));
    }
    Ok((len, kind))
}

/// Decodes and checks the record at the start of `buf`; returns it and its length.
pub fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    decode_with(buf, Verify::Crc)
}

/// Counts, per thread, the CRC checks of records that hold a body (Put, Carry), so tests can hold
/// each path to the checks it is allowed.
#[cfg(test)]
pub(crate) mod body_checks {
    use std::cell::Cell;

    thread_local! {
        static CHECKS: Cell<u64> = const { Cell::new(0) };
    }

    pub(super) fn note() {
        CHECKS.with(|c| c.set(c.get() + 1));
    }

    /// Checks on this thread since the last call.
    pub(crate) fn take() -> u64 {
        CHECKS.with(|c| c.replace(0))
    }
}

/// Decodes a record for its fields, never reading a message's body: a Put's or Carry's CRC (which
/// covers the body) is not checked, any other record's is (they are small). For records the index
/// or a queue points at, read for their id, topic or times; the body is checked where a consumer
/// reads it.
pub fn decode_fields(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    let kind = RecordHeader::decode(buf.get(..HEADER_BYTES).unwrap_or(buf))?.kind;
    let verify =
        if kind == Kind::Put as u8 || kind == Kind::Carry as u8 { Verify::Fields } else { Verify::Crc };
    decode_with(buf, verify)
}

/// Decodes the record at the start of `buf`, checking its CRC or only its structure.
pub fn decode_with(buf: &[u8], verify: Verify) -> Result<(Record<'_>, usize), DecodeError> {
    let (len, kind) = check_frame_with(buf, verify)?;
    let mut d = Dec { buf: &buf[..len], pos: HEADER_BYTES };
    let with_error = buf[6] == RECORD_VERSION_ERROR;
    let rec = match kind {
        Kind::EndOfSegment => Record::EndOfSegment,
        Kind::Hop => Record::Hop(Hop {
            msg_offset: d.u64()?,
            id_hash: d.u64()?,
            seq: d.u32()?,
            target_ms: d.u64()?,
            route: d.route()?,
        }),
        Kind::Transition => {
            let linked = matches!(
                buf[6],
                RECORD_VERSION_LINKED | RECORD_VERSION_RESCHEDULE | RECORD_VERSION_TOUCH | RECORD_VERSION_ERROR
            );
            let t = Transition {
                msg_offset: d.u64()?,
                id_hash: d.u64()?,
                seq: d.u32()?,
                prev_state: d.state()?,
                state: d.state()?,
                cause: Cause::from_u8(d.u8()?).ok_or(DecodeError::Invalid("unknown cause"))?,
                home: d.home()?,
                attempt: d.u32()?,
                time_ms: d.u64()?,
                deliver_at_ms: d.u64()?,
                route: d.route()?,
                due_ms: match buf[6] {
                    RECORD_VERSION_CARRY => Some(d.u64()?),
                    _ if linked => Some(d.u64()?).filter(|due| *due != 0),
                    _ => None,
                },
                prev_offset: if linked { Some(d.u64()?) } else { None },
                settings: if buf[6] == RECORD_VERSION_RESCHEDULE {
                    Some(DeliverySettings { ttr_ms: d.u64()?, max_attempts: d.u32()? })
                } else {
                    None
                },
                error: if with_error { Some(d.error()?) } else { None },
            };
            // A Reschedule exists only as version 5 and a Touch only as version 6, and those
            // versions only as them; version 7 holds a Nack's or DeadLetter's reason.
            if (t.cause == Cause::Reschedule) != (buf[6] == RECORD_VERSION_RESCHEDULE)
                || (t.cause == Cause::Touch) != (buf[6] == RECORD_VERSION_TOUCH)
                || (with_error && !matches!(t.cause, Cause::Nack | Cause::DeadLetter))
            {
                return Err(DecodeError::Invalid("transition cause and version do not match"));
            }
            Record::Transition(t)
        }
        Kind::Put => Record::Put(Put { replaces: buf[6] == RECORD_VERSION_CARRY, ..d.put()? }),
        Kind::Raft => Record::Raft(RaftMark {
            term: d.u64()?,
            index: d.u64()?,
            kind: match d.u8()? {
                0 => EntryKind::Normal,
                1 => EntryKind::ConfChange,
                _ => return Err(DecodeError::Invalid("unknown raft entry kind")),
            },
            data_start: d.u64()?,
            payload: {
                let n = d.u32()? as usize;
                if n > MAX_RAFT_PAYLOAD_BYTES {
                    return Err(DecodeError::Invalid("raft payload length"));
                }
                d.take(n)?
            },
        }),
        Kind::Pause => Record::Pause(Pause {
            paused: match d.u8()? {
                0 => false,
                1 => true,
                _ => return Err(DecodeError::Invalid("pause flag is neither 0 nor 1")),
            },
            time_ms: d.u64()?,
            topic: {
                let n = d.u16()? as usize;
                let t = d.take(n)?;
                if t.is_empty() || n > MAX_TOPIC_BYTES {
                    return Err(DecodeError::Invalid("pause topic length"));
                }
                t
            },
        }),
        Kind::Flow => {
            let (time_ms, max_per_second, burst, max_reserved) = (d.u64()?, d.u32()?, d.u32()?, d.u32()?);
            let n = d.u16()? as usize;
            let topic = d.take(n)?;
            let f = Flow { time_ms, max_per_second, burst, max_reserved, topic };
            if topic.is_empty() || n > MAX_TOPIC_BYTES {
                return Err(DecodeError::Invalid("flow topic length"));
            }
            if [max_per_second, burst, max_reserved].iter().any(|&v| v > MAX_FLOW_VALUE)
                || (burst == 0) != (max_per_second == 0)
            {
                return Err(DecodeError::Invalid("flow limits out of range"));
            }
            Record::Flow(f)
        }
        Kind::Push => {
            let target = match d.u8()? {
                0 => PushTarget::None,
                1 => PushTarget::Webhook,
                2 => PushTarget::Nats,
                _ => return Err(DecodeError::Invalid("unknown push target")),
            };
            let (time_ms, timeout_ms, max_in_flight) = (d.u64()?, d.u32()?, d.u32()?);
            let mut field = |max: usize| -> Result<&[u8], DecodeError> {
                let n = d.u16()? as usize;
                if n > max {
                    return Err(DecodeError::Invalid("push field too long"));
                }
                d.take(n)
            };
            let (topic, url, subject, secret) = (
                field(MAX_TOPIC_BYTES)?,
                field(MAX_PUSH_URL_BYTES)?,
                field(MAX_TOPIC_BYTES)?,
                field(MAX_PUSH_SECRET_BYTES)?,
            );
            if topic.is_empty() || (target != PushTarget::None && url.is_empty()) {
                return Err(DecodeError::Invalid("push record without a topic or url"));
            }
            Record::Push(Push { target, time_ms, timeout_ms, max_in_flight, topic, url, subject, secret })
        }
        Kind::Carry => Record::Carry(Carry {
            prev_msg_offset: d.u64()?,
            seq: d.u32()?,
            attempt: d.u32()?,
            state: d.state()?,
            home: d.home()?,
            time_ms: d.u64()?,
            deliver_at_ms: d.u64()?,
            put: d.put()?,
            last_error: if with_error {
                Some(LastError { time_ms: d.u64()?, attempt: d.u32()?, message: d.error()? })
            } else {
                None
            },
        }),
    };
    d.done()?;
    Ok((rec, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn route() -> impl Strategy<Value = Route> {
        prop_oneof![
            Just(Route::None),
            Just(Route::Topic),
            (any::<u64>(), any::<u64>()).prop_map(|(level_ms, due_ms)| Route::Level { level_ms, due_ms }),
        ]
    }

    fn state() -> impl Strategy<Value = State> {
        (1u8..=6).prop_map(|v| State::from_u8(v).expect("1..=6 are states"))
    }

    /// The encoded bytes of a record of any kind.
    fn any_record() -> impl Strategy<Value = Vec<u8>> {
        let bytes = |n: std::ops::Range<usize>| proptest::collection::vec(any::<u8>(), n);
        fn put<'a>(id: &'a [u8], body: &'a [u8], route: Route, replaces: bool) -> Put<'a> {
            Put {
                created_ms: 1,
                deliver_at_ms: 2,
                ttr_ms: 3,
                max_attempts: 4,
                request_kind: 1,
                request_value: 5,
                route,
                id,
                topic: b"t",
                backoff_ms: vec![7],
                body,
                replaces,
            }
        }
        prop_oneof![
            (bytes(1..20), bytes(0..100), route(), any::<bool>())
                .prop_map(|(id, body, r, rp)| encode_put(&put(&id, &body, r, rp)).unwrap()),
            (
                any::<u64>(),
                state(),
                route(),
                proptest::option::of(1..u64::MAX),
                proptest::option::of(any::<u64>())
            )
                .prop_map(|(mo, s, r, due_ms, prev_offset)| encode_transition(&Transition {
                    msg_offset: mo,
                    id_hash: 9,
                    seq: 2,
                    prev_state: State::Ready,
                    state: s,
                    cause: Cause::Nack,
                    home: Home::Main,
                    attempt: 1,
                    time_ms: 3,
                    deliver_at_ms: 4,
                    route: r,
                    due_ms,
                    prev_offset: if due_ms.is_some_and(|d| d % 2 == 0) { Some(7) } else { prev_offset },
                    settings: None,
                    error: due_ms.is_some_and(|d| d % 2 == 0).then_some(&b"boom"[..]),
                })),
            (any::<u64>(), route()).prop_map(|(mo, r)| encode_hop(&Hop {
                msg_offset: mo,
                id_hash: 1,
                seq: 2,
                target_ms: 3,
                route: r,
            })),
            (bytes(1..20), bytes(0..100), state(), route()).prop_map(|(id, body, s, r)| encode_carry(
                &Carry {
                    prev_msg_offset: 1,
                    seq: 2,
                    attempt: 3,
                    state: s,
                    home: Home::DeadLetter,
                    time_ms: 4,
                    deliver_at_ms: 5,
                    put: put(&id, &body, r, false),
                    last_error: (body.len() % 2 == 0).then_some(LastError {
                        time_ms: 6,
                        attempt: 2,
                        message: "é".as_bytes()
                    }),
                }
            )
            .unwrap()),
            (any::<bool>(), bytes(1..40)).prop_map(|(paused, topic)| encode_pause(&Pause {
                paused,
                time_ms: 1,
                topic: &topic,
            })
            .unwrap()),
            (bytes(1..40), bytes(1..60), bytes(0..20)).prop_map(|(topic, url, secret)| encode_push(&Push {
                target: PushTarget::Webhook,
                time_ms: 1,
                timeout_ms: 2,
                max_in_flight: 3,
                topic: &topic,
                url: &url,
                subject: b"",
                secret: &secret,
            })
            .unwrap()),
            (bytes(1..40), 0u32..2000, 0u32..50).prop_map(|(topic, rate, reserved)| encode_flow(&Flow {
                time_ms: 1,
                max_per_second: rate,
                burst: rate,
                max_reserved: reserved,
                topic: &topic,
            })
            .unwrap()),
            Just(encode_end_of_segment()),
        ]
    }

    proptest! {
        #[test]
        fn put_round_trips(
            created in any::<u64>(), deliver in any::<u64>(), ttr in any::<u64>(), max in any::<u32>(),
            rk in 0u8..4, rv in any::<u64>(), r in route(),
            id in proptest::collection::vec(any::<u8>(), 1..40),
            topic in proptest::collection::vec(any::<u8>(), 1..40),
            backoff in proptest::collection::vec(any::<u64>(), 0..5),
            body in proptest::collection::vec(any::<u8>(), 0..300), replaces in any::<bool>(),
        ) {
            let p = Put { created_ms: created, deliver_at_ms: deliver, ttr_ms: ttr, max_attempts: max,
                request_kind: rk, request_value: rv, route: r, id: &id, topic: &topic,
                backoff_ms: backoff, body: &body, replaces };
            let buf = encode_put(&p).unwrap();
            let (rec, len) = decode(&buf).unwrap();
            prop_assert_eq!(len, buf.len());
            prop_assert_eq!(rec, Record::Put(p));
        }

        #[test]
        fn transition_round_trips(
            mo in any::<u64>(), h in any::<u64>(), seq in any::<u32>(), ps in state(), s in state(),
            c in 1u8..=10, dl in any::<bool>(), att in any::<u32>(), t in any::<u64>(), d in any::<u64>(), r in route(),
            due in proptest::option::of(1..u64::MAX), prev in proptest::option::of(any::<u64>()),
            ttr in any::<u64>(), max in any::<u32>(), err in proptest::option::of("\\PC{1,40}"),
        ) {
            let cause = Cause::from_u8(c).unwrap();
            // A Reschedule always links back and holds its settings (version 5).
            let resched = cause == Cause::Reschedule;
            let touch = cause == Cause::Touch;
            // A reason goes with a Nack or DeadLetter, which then links back (version 7).
            let error = err.as_deref().map(str::as_bytes).filter(|_| matches!(cause, Cause::Nack | Cause::DeadLetter));
            let prev = if resched || touch || error.is_some() { Some(prev.unwrap_or(0)) } else { prev };
            let settings = resched.then_some(DeliverySettings { ttr_ms: ttr, max_attempts: max });
            let tr = Transition { msg_offset: mo, id_hash: h, seq, prev_state: ps, state: s,
                cause, home: if dl { Home::DeadLetter } else { Home::Main }, attempt: att, time_ms: t,
                deliver_at_ms: d, route: r, due_ms: due, prev_offset: prev, settings, error };
            let buf = encode_transition(&tr);
            let (len, version) = match (resched, prev, due) {
                _ if error.is_some() => (91 + error.map_or(0, <[u8]>::len), 7),
                (true, _, _) => (101, 5),
                (false, _, _) if touch => (89, 6),
                (false, Some(_), _) => (89, 3),
                (false, None, Some(_)) => (81, 2),
                (false, None, None) => (73, 1),
            };
            prop_assert_eq!((buf.len(), buf[6]), (len, version));
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Transition(tr), buf.len()));
        }

        #[test]
        fn carry_round_trips(
            prev in any::<u64>(), seq in any::<u32>(), att in any::<u32>(), s in state(), dl in any::<bool>(),
            t in any::<u64>(), d in any::<u64>(), r in route(),
            id in proptest::collection::vec(any::<u8>(), 1..40),
            body in proptest::collection::vec(any::<u8>(), 0..300),
            err in proptest::option::of(("\\PC{1,40}", any::<u64>(), any::<u32>())),
        ) {
            let last_error = err.as_ref().map(|(m, time_ms, attempt)| LastError { time_ms: *time_ms,
                attempt: *attempt, message: m.as_bytes() });
            let c = Carry { prev_msg_offset: prev, seq, attempt: att, state: s,
                home: if dl { Home::DeadLetter } else { Home::Main }, time_ms: t, deliver_at_ms: d,
                put: Put { created_ms: 1, deliver_at_ms: 2, ttr_ms: 3, max_attempts: 4, request_kind: 1,
                    request_value: 5, route: r, id: &id, topic: b"t.dlq", backoff_ms: vec![9], body: &body,
                    replaces: false }, last_error };
            let buf = encode_carry(&c).unwrap();
            let extra = last_error.map_or(0, |l| 14 + l.message.len());
            prop_assert_eq!(buf.len(), encode_put(&c.put).unwrap().len() + CARRY_EXTRA_BYTES + extra);
            prop_assert_eq!(buf[6], if last_error.is_some() { 7 } else { 2 });
            let n = buf.len();
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Carry(c), n));
        }

        #[test]
        fn pause_round_trips(paused in any::<bool>(), t in any::<u64>(),
                             topic in proptest::collection::vec(any::<u8>(), 1..=255)) {
            let p = Pause { paused, time_ms: t, topic: &topic };
            let buf = encode_pause(&p).unwrap();
            prop_assert_eq!(buf.len(), HEADER_BYTES + 11 + topic.len());
            prop_assert_eq!(buf[6], RECORD_VERSION_CARRY);
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Pause(p), buf.len()));
        }

        #[test]
        fn push_round_trips(target in 0u8..3, t in any::<u64>(), timeout in any::<u32>(), inflight in any::<u32>(),
                            topic in proptest::collection::vec(any::<u8>(), 1..=255),
                            url in proptest::collection::vec(any::<u8>(), 1..300),
                            subject in proptest::collection::vec(any::<u8>(), 0..40),
                            secret in proptest::collection::vec(any::<u8>(), 0..64)) {
            let target = [PushTarget::None, PushTarget::Webhook, PushTarget::Nats][target as usize];
            let p = Push { target, time_ms: t, timeout_ms: timeout, max_in_flight: inflight, topic: &topic,
                url: &url, subject: &subject, secret: &secret };
            let buf = encode_push(&p).unwrap();
            prop_assert_eq!(buf.len(), HEADER_BYTES + 25 + topic.len() + url.len() + subject.len() + secret.len());
            prop_assert_eq!(buf[6], RECORD_VERSION_CARRY);
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Push(p), buf.len()));
        }

        #[test]
        fn flow_round_trips(t in any::<u64>(), rate in 0..=MAX_FLOW_VALUE, burst in 1..=MAX_FLOW_VALUE,
                            reserved in 0..=MAX_FLOW_VALUE,
                            topic in proptest::collection::vec(any::<u8>(), 1..=255)) {
            let f = Flow { time_ms: t, max_per_second: rate, burst: if rate == 0 { 0 } else { burst },
                max_reserved: reserved, topic: &topic };
            let buf = encode_flow(&f).unwrap();
            prop_assert_eq!(buf.len(), HEADER_BYTES + 22 + topic.len());
            prop_assert_eq!(buf[6], RECORD_VERSION_FLOW);
            prop_assert_eq!(buf[7], Kind::Flow as u8);
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Flow(f), buf.len()));
        }

        #[test]
        fn flow_out_of_range_is_refused(over in (MAX_FLOW_VALUE + 1).., which in 0usize..3) {
            let mut v = [1, 1, 1];
            v[which] = over;
            let f = Flow { time_ms: 1, max_per_second: v[0], burst: v[1], max_reserved: v[2], topic: b"t" };
            prop_assert!(encode_flow(&f).is_err());
            // Written past the encoder's check: decoding refuses it too, as does a version other than 8.
            let ok = encode_flow(&Flow { max_per_second: 1, burst: 1, max_reserved: 1, ..f }).unwrap();
            let mut bad = ok.clone();
            bad[HEADER_BYTES + 8 + 4 * which..HEADER_BYTES + 12 + 4 * which].copy_from_slice(&over.to_le_bytes());
            let mut h = RecordHeader::decode(&bad[..HEADER_BYTES]).unwrap();
            h.crc = frame_crc(&bad);
            bad[..HEADER_BYTES].copy_from_slice(&h.encode());
            prop_assert!(decode(&bad).is_err());
            let mut v2 = ok;
            v2[6] = RECORD_VERSION_CARRY;
            let mut h = RecordHeader::decode(&v2[..HEADER_BYTES]).unwrap();
            h.crc = frame_crc(&v2);
            v2[..HEADER_BYTES].copy_from_slice(&h.encode());
            prop_assert!(decode(&v2).is_err());
        }

        #[test]
        fn hop_round_trips(mo in any::<u64>(), h in any::<u64>(), seq in any::<u32>(), t in any::<u64>(),
                           r in route()) {
            let hop = Hop { msg_offset: mo, id_hash: h, seq, target_ms: t, route: r };
            let buf = encode_hop(&hop);
            prop_assert_eq!(decode(&buf).unwrap(), (Record::Hop(hop), buf.len()));
        }

        #[test]
        fn any_prefix_or_flipped_byte_is_an_error_never_a_panic(
            body in proptest::collection::vec(any::<u8>(), 0..200), cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(), bit in 0u8..8,
        ) {
            let p = Put { created_ms: 1, deliver_at_ms: 2, ttr_ms: 3, max_attempts: 4, request_kind: 1,
                request_value: 5, route: Route::Topic, id: b"id", topic: b"t", backoff_ms: vec![7],
                body: &body, replaces: false };
            let buf = encode_put(&p).unwrap();
            let n = cut.index(buf.len());
            prop_assert!(decode(&buf[..n]).is_err());
            let mut bad = buf.clone();
            let i = flip.index(bad.len());
            bad[i] ^= 1 << bit;
            prop_assert!(decode(&bad).is_err());
        }

        #[test]
        fn garbage_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&buf);
            let _ = decode_with(&buf, Verify::Fields);
        }

        /// A fields-only read gives the same record as a checked one, and a cut record is an error
        /// for it too: it skips the CRC, never the bounds.
        #[test]
        fn a_fields_read_matches_the_checked_one_and_a_cut_record_is_an_error(
            buf in any_record(), cut in any::<prop::sample::Index>(),
        ) {
            prop_assert_eq!(decode_with(&buf, Verify::Fields).unwrap(), decode(&buf).unwrap());
            let n = cut.index(buf.len());
            prop_assert!(decode_with(&buf[..n], Verify::Fields).is_err());
        }

        /// What a fields-only read skips: a flipped bit in a Put's body is not seen (the body is
        /// never read), while the checked read refuses it.
        #[test]
        fn a_fields_read_never_looks_at_the_body(
            body in proptest::collection::vec(any::<u8>(), 1..200), flip in any::<prop::sample::Index>(),
        ) {
            let p = Put { created_ms: 1, deliver_at_ms: 2, ttr_ms: 3, max_attempts: 4, request_kind: 1,
                request_value: 5, route: Route::Topic, id: b"id", topic: b"t", backoff_ms: vec![7],
                body: &body, replaces: false };
            let mut buf = encode_put(&p).unwrap();
            let at = buf.len() - body.len() + flip.index(body.len());
            buf[at] ^= 1;
            prop_assert!(decode(&buf).is_err());
            let Ok((Record::Put(q), _)) = decode_with(&buf, Verify::Fields) else { panic!("not a put") };
            prop_assert_eq!((q.id, q.topic, q.deliver_at_ms), (&b"id"[..], &b"t"[..], 2));
        }

        /// Every kind, not only a Put: a cut record is an error, bytes after its frame are not
        /// read (the next record starts there), and bytes slipped into its frame (its length and
        /// CRC made to match, so only the payload parser can tell) are an error.
        #[test]
        fn any_record_cut_or_grown_inside_its_frame_is_an_error_never_a_panic(
            buf in any_record(), cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 1..24),
        ) {
            let (rec, len) = decode(&buf).unwrap();
            prop_assert_eq!(len, buf.len());
            prop_assert!(decode(&buf[..cut.index(buf.len())]).is_err());
            let after = [&buf[..], &tail].concat();
            prop_assert_eq!(decode(&after).unwrap(), (rec, len));
            let mut grown = after;
            let mut h = RecordHeader::decode(&grown[..HEADER_BYTES]).unwrap();
            h.len = grown.len() as u32;
            grown[..HEADER_BYTES].copy_from_slice(&h.encode());
            h.crc = frame_crc(&grown);
            grown[..HEADER_BYTES].copy_from_slice(&h.encode());
            prop_assert!(decode(&grown).is_err());
        }

        #[test]
        fn record_header_round_trips(len in any::<u32>(), version in any::<u8>(), kind in any::<u8>(), crc in any::<u32>()) {
            let h = RecordHeader { len, magic: RECORD_MAGIC, version, kind, crc };
            let b = h.encode();
            prop_assert_eq!(RecordHeader::decode(&b), Ok(h));
            prop_assert_eq!(RecordHeader::from_bytes(&b), h);
            prop_assert!(has_record_magic(&b));
        }

        #[test]
        fn record_header_prefix_or_tail_is_an_error_never_a_panic(
            len in any::<u32>(), version in any::<u8>(), kind in any::<u8>(), crc in any::<u32>(),
            cut in 0usize..HEADER_BYTES, tail in proptest::collection::vec(any::<u8>(), 1..24),
        ) {
            let b = RecordHeader { len, magic: RECORD_MAGIC, version, kind, crc }.encode();
            prop_assert!(RecordHeader::decode(&b[..cut]).is_err());
            prop_assert!(RecordHeader::decode(&[&b[..], &tail].concat()).is_err());
        }

        #[test]
        fn record_header_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            if let Ok(h) = RecordHeader::decode(&b) {
                prop_assert_eq!(h.magic, RECORD_MAGIC);
            }
            let _ = has_record_magic(&b);
        }
    }

    #[test]
    fn zeroes_decode_as_empty() {
        assert_eq!(decode(&[0u8; 64]).unwrap_err(), DecodeError::Empty);
        assert_eq!(decode(&[0u8; 5]).unwrap_err(), DecodeError::Empty);
    }

    #[test]
    fn end_of_segment_round_trips() {
        let buf = encode_end_of_segment();
        assert_eq!(buf.len(), HEADER_BYTES);
        assert_eq!(decode(&buf).unwrap(), (Record::EndOfSegment, HEADER_BYTES));
    }

    #[test]
    fn a_long_error_is_cut_at_a_character_boundary() {
        // 2047 ASCII bytes then a 2-byte character: the character would end past the bound.
        let long = format!("{}é and more", "x".repeat(MAX_ERROR_BYTES - 1));
        assert_eq!(bounded_error(&long).len(), MAX_ERROR_BYTES - 1);
        assert_eq!(bounded_error("short"), "short");
        let mut t = Transition {
            msg_offset: 1,
            id_hash: 2,
            seq: 3,
            prev_state: State::Reserved,
            state: State::Delayed,
            cause: Cause::Nack,
            home: Home::Main,
            attempt: 1,
            time_ms: 4,
            deliver_at_ms: 5,
            route: Route::Topic,
            due_ms: None,
            prev_offset: Some(0),
            settings: None,
            error: Some(long.as_bytes()),
        };
        let buf = encode_transition(&t);
        let Ok((Record::Transition(back), _)) = decode(&buf) else { panic!("decodes") };
        assert_eq!(back.error.map(<[u8]>::len), Some(MAX_ERROR_BYTES - 1));
        // Version 7 only with a Nack or DeadLetter: an Ack's reason is dropped, not written.
        t.cause = Cause::Ack;
        assert_eq!(encode_transition(&t)[6], RECORD_VERSION_LINKED);
        let mut forged = encode_transition(&Transition { cause: Cause::Nack, ..t });
        forged[HEADER_BYTES + 22] = Cause::Ack as u8;
        let crc = frame_crc(&forged);
        forged[8..12].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&forged).unwrap_err(), DecodeError::Invalid("transition cause and version do not match"));
    }

    #[test]
    fn oversized_fields_are_refused() {
        let long = vec![b'x'; MAX_ID_BYTES + 1];
        let p = Put {
            created_ms: 0,
            deliver_at_ms: 0,
            ttr_ms: 0,
            max_attempts: 1,
            request_kind: 0,
            request_value: 0,
            route: Route::Topic,
            id: &long,
            topic: b"t",
            backoff_ms: vec![],
            body: b"",
            replaces: false,
        };
        assert!(matches!(encode_put(&p), Err(Error::Invalid { .. })));
    }
}
