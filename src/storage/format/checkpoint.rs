//! The checkpoint file and the clean-shutdown marker: what the engine restarts from.
//!
//! Checkpoint: `magic "DLCK", version u16, reserved u16, dispatched u64, queue count u32`, then
//! per queue `kind u8, name len u16, name, len, cursor, reserved, dead, delayed, ready (u64 each)`,
//! then the paused, the push and the flow lists (`count u32`, then `topic len u16, topic, offset
//! u64` each),
//! then a CRC32 of everything before it. Clean marker: `magic "DLCS", version u16, reserved u16,
//! log end u64`, in version 5 the closing counts (index slots, filled and live, live bytes, then
//! `count u32` and per segment `base, bytes, reserved` as u64s), then a CRC32.

use super::{Dec, DecodeError, Enc};

/// Magic of the checkpoint file ("DLCK").
pub const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"DLCK");
/// Magic of the clean-shutdown marker ("DLCS").
pub const CLEAN_MAGIC: u32 = u32::from_le_bytes(*b"DLCS");
/// Layout version of both files (4: per-topic state counts, paused topics, push subscriptions,
/// flow control).
pub const CHECKPOINT_VERSION: u16 = 4;
/// Bytes of a version 4 clean-shutdown marker (the log end alone), as earlier delayds wrote it.
pub const CLEAN_MARKER_V4_BYTES: usize = 20;
/// Layout version of the clean-shutdown marker that carries the closing counts.
pub const CLEAN_MARKER_VERSION: u16 = 5;
/// Bytes of a version 5 marker before its segment list.
const CLEAN_MARKER_FIXED_BYTES: usize = 52;
/// Bytes of one segment's counts in a version 5 marker.
const CLEAN_MARKER_SEGMENT_BYTES: usize = 24;

/// What a clean shutdown vouches for: where the log ends and, from version 5, the counts dispatch
/// kept up to there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanMarker {
    /// Offset one past the last record.
    pub log_end: u64,
    /// The counts at the close; none in a version 4 marker.
    pub counts: Option<ClosedCounts>,
}

/// Counts dispatch keeps, as they were at a clean close: the next open takes them instead of
/// recounting the index and reading a record header per live message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClosedCounts {
    /// Slots of the table `index/ids`; 0 when a resize was under way (the index is then counted).
    pub index_slots: u64,
    /// Occupied slots (live and removed) of that table.
    pub index_filled: u64,
    /// Live slots of that table.
    pub index_live: u64,
    /// Bytes of the records live messages need (their Put or Carry).
    pub live_bytes: u64,
    /// Per segment that holds anything reclaim must keep, ascending: its base offset, the bytes
    /// of those records, and how many of its messages are reserved.
    pub segments: Vec<(u64, u64, u64)>,
}

/// Which family a queue belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueueKind {
    /// A delay level; the name is its duration in ms.
    Level = 0,
    /// A topic; the name is the topic.
    Topic = 1,
}

/// Saved state of one consume queue and its reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    /// Level or topic.
    pub kind: QueueKind,
    /// Level duration in ms (decimal) or topic name.
    pub name: String,
    /// Entries written (and durable) at checkpoint time.
    pub len: u64,
    /// Reader position: every entry below it was handled and its effect is durable.
    pub cursor: u64,
    /// Topics: messages reserved and not yet acked.
    pub reserved: u64,
    /// Topics: messages moved to the dead-letter topic.
    pub dead: u64,
    /// Topics: messages waiting on a delay level.
    pub delayed: u64,
    /// Topics: messages in the queue not yet popped.
    pub ready: u64,
}

/// Everything the engine restarts from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Commit-log offset up to which consume queues and the id index are durable.
    pub dispatched: u64,
    /// One entry per queue.
    pub queues: Vec<QueueState>,
    /// Paused topics, each with the log offset of its Pause record.
    pub paused: Vec<(String, u64)>,
    /// Topics with a push subscription, each with the log offset of its Push record.
    pub push: Vec<(String, u64)>,
    /// Topics with flow control, each with the log offset of its Flow record.
    pub flow: Vec<(String, u64)>,
    /// Which snapshot of this process it is (in memory only, 0 when loaded): reclaim must know a
    /// checkpoint was taken after its decision, which `dispatched` alone cannot tell when nothing
    /// was appended in between.
    pub serial: u64,
}

/// Why a checkpoint file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointDamage {
    /// It fails its CRC, magic or layout check: damaged, so it is rebuilt from the log.
    Damaged(String),
    /// It is intact but has another layout version: written by a different delayd.
    OtherVersion(u16),
}

impl std::fmt::Display for CheckpointDamage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointDamage::Damaged(why) => write!(f, "damaged ({why})"),
            CheckpointDamage::OtherVersion(v) => {
                write!(f, "layout version {v}, this delayd writes {CHECKPOINT_VERSION}")
            }
        }
    }
}

impl Checkpoint {
    /// Serialises with a trailing CRC32.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc(Vec::with_capacity(32 + self.queues.len() * 64));
        e.u32(CHECKPOINT_MAGIC);
        e.u16(CHECKPOINT_VERSION);
        e.u16(0);
        e.u64(self.dispatched);
        e.u32(self.queues.len() as u32);
        for q in &self.queues {
            e.u8(q.kind as u8);
            e.u16(q.name.len() as u16);
            e.0.extend_from_slice(q.name.as_bytes());
            for v in [q.len, q.cursor, q.reserved, q.dead, q.delayed, q.ready] {
                e.u64(v);
            }
        }
        for list in [&self.paused, &self.push, &self.flow] {
            e.u32(list.len() as u32);
            for (topic, offset) in list {
                e.u16(topic.len() as u16);
                e.0.extend_from_slice(topic.as_bytes());
                e.u64(*offset);
            }
        }
        let crc = crc32fast::hash(&e.0);
        e.u32(crc);
        e.0
    }

    /// Parses and checks a checkpoint; `None` for anything malformed.
    pub fn decode(b: &[u8]) -> Option<Checkpoint> {
        Checkpoint::decode_checked(b).ok()
    }

    /// Parses and checks a checkpoint, saying why it is unusable.
    pub fn decode_checked(b: &[u8]) -> Result<Checkpoint, CheckpointDamage> {
        let damaged = |why: &str| CheckpointDamage::Damaged(why.to_string());
        if b.len() < 24 {
            return Err(damaged("shorter than 24 bytes"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        let mut d = Dec { buf: crc, pos: 0 };
        if d.u32().ok() != Some(crc32fast::hash(body)) {
            return Err(damaged("CRC mismatch"));
        }
        let mut d = Dec { buf: body, pos: 0 };
        if d.u32().ok() != Some(CHECKPOINT_MAGIC) {
            return Err(damaged("bad magic"));
        }
        let version = d.u16().unwrap_or(0);
        if (1..=3).contains(&version) {
            // An older delayd's: everything in it can be derived again from the log.
            return Err(damaged(&format!("layout version {version}, without all of today's fields")));
        }
        if version != CHECKPOINT_VERSION {
            // Intact (the CRC matched) but from another delayd: it is not ours to overwrite.
            return Err(CheckpointDamage::OtherVersion(version));
        }
        Checkpoint::decode_body(d).map_err(|_| damaged("records do not parse or do not end at the CRC"))
    }

    /// Everything after the version, up to the CRC.
    fn decode_body(mut d: Dec<'_>) -> Result<Checkpoint, DecodeError> {
        d.u16()?;
        let dispatched = d.u64()?;
        let n = d.u32()?;
        let mut queues = Vec::new();
        for _ in 0..n {
            let kind = match d.u8()? {
                0 => QueueKind::Level,
                1 => QueueKind::Topic,
                _ => return Err(DecodeError::Invalid("unknown queue kind")),
            };
            let name = d.string()?;
            queues.push(QueueState {
                kind,
                name,
                len: d.u64()?,
                cursor: d.u64()?,
                reserved: d.u64()?,
                dead: d.u64()?,
                delayed: d.u64()?,
                ready: d.u64()?,
            });
        }
        let mut lists = [Vec::new(), Vec::new(), Vec::new()];
        for list in &mut lists {
            for _ in 0..d.u32()? {
                let topic = d.string()?;
                list.push((topic, d.u64()?));
            }
        }
        d.done()?;
        let [paused, push, flow] = lists;
        Ok(Checkpoint { dispatched, queues, paused, push, flow, serial: 0 })
    }
}

impl Dec<'_> {
    /// A UTF-8 string behind a u16 length.
    fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| DecodeError::Invalid("name is not UTF-8"))
    }
}

impl CleanMarker {
    /// The version 5 marker: log end, counts (all zero when there are none), CRC.
    pub fn encode(&self) -> Vec<u8> {
        let c = self.counts.clone().unwrap_or_default();
        let mut b = Vec::with_capacity(
            CLEAN_MARKER_FIXED_BYTES + CLEAN_MARKER_SEGMENT_BYTES * c.segments.len() + 4,
        );
        b.extend_from_slice(&CLEAN_MAGIC.to_le_bytes());
        b.extend_from_slice(&CLEAN_MARKER_VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        for v in [self.log_end, c.index_slots, c.index_filled, c.index_live, c.live_bytes] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(c.segments.len() as u32).to_le_bytes());
        for (base, bytes, reserved) in &c.segments {
            for v in [base, bytes, reserved] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// A marker of either layout: 20 bytes is version 4 (its version field is not checked: the
    /// marker only lets recovery skip work, and its CRC and magic say it is whole); anything else
    /// must be a whole version 5 marker. Version 5 always has counts.
    pub fn decode(b: &[u8]) -> Result<CleanMarker, DecodeError> {
        if b.len() < CLEAN_MARKER_V4_BYTES {
            return Err(DecodeError::Invalid("clean marker is shorter than 20 bytes"));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(body) != (Dec { buf: crc, pos: 0 }).u32()? {
            return Err(DecodeError::Invalid("crc mismatch"));
        }
        let mut d = Dec { buf: body, pos: 0 };
        if d.u32()? != CLEAN_MAGIC {
            return Err(DecodeError::Invalid("bad magic"));
        }
        let version = d.u16()?;
        d.u16()?;
        let log_end = d.u64()?;
        if b.len() == CLEAN_MARKER_V4_BYTES {
            return Ok(CleanMarker { log_end, counts: None });
        }
        if version != CLEAN_MARKER_VERSION {
            return Err(DecodeError::Invalid("unknown clean marker version"));
        }
        let (index_slots, index_filled, index_live, live_bytes) = (d.u64()?, d.u64()?, d.u64()?, d.u64()?);
        let n = d.u32()? as usize;
        if body.len() - d.pos != n.saturating_mul(CLEAN_MARKER_SEGMENT_BYTES) {
            return Err(DecodeError::Invalid("clean marker segment count does not match its size"));
        }
        let mut segments = Vec::with_capacity(n);
        for _ in 0..n {
            segments.push((d.u64()?, d.u64()?, d.u64()?));
        }
        let counts = ClosedCounts { index_slots, index_filled, index_live, live_bytes, segments };
        Ok(CleanMarker { log_end, counts: Some(counts) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        proptest::collection::vec(any::<char>(), 0..12).prop_map(|c| c.into_iter().collect())
    }

    fn checkpoint() -> impl Strategy<Value = Checkpoint> {
        let queue =
            (any::<bool>(), name(), proptest::array::uniform6(any::<u64>())).prop_map(|(topic, name, v)| {
                QueueState {
                    kind: if topic { QueueKind::Topic } else { QueueKind::Level },
                    name,
                    len: v[0],
                    cursor: v[1],
                    reserved: v[2],
                    dead: v[3],
                    delayed: v[4],
                    ready: v[5],
                }
            });
        let list = || proptest::collection::vec((name(), any::<u64>()), 0..4);
        (any::<u64>(), proptest::collection::vec(queue, 0..4), list(), list(), list()).prop_map(
            |(dispatched, queues, paused, push, flow)| Checkpoint { dispatched, queues, paused, push, flow, serial: 0 },
        )
    }

    proptest! {
        #[test]
        fn checkpoint_round_trips(cp in checkpoint()) {
            prop_assert_eq!(Checkpoint::decode_checked(&cp.encode()), Ok(cp));
        }

        #[test]
        fn checkpoint_prefix_or_tail_is_an_error_never_a_panic(
            cp in checkpoint(), cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let b = cp.encode();
            prop_assert!(Checkpoint::decode_checked(&b[..cut.index(b.len())]).is_err());
            prop_assert!(Checkpoint::decode_checked(&[&b[..], &tail].concat()).is_err());
        }

        /// Even bytes whose CRC matches (so the body parser runs) are refused, not panicked on.
        #[test]
        fn checkpoint_garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..200), v3 in any::<bool>()) {
            let mut b = body;
            if v3 && b.len() >= 6 {
                b[0..4].copy_from_slice(&CHECKPOINT_MAGIC.to_le_bytes());
                b[4..6].copy_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
            }
            let _ = Checkpoint::decode_checked(&b);
            let crc = crc32fast::hash(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            let _ = Checkpoint::decode_checked(&b);
        }

        #[test]
        fn clean_marker_round_trips(m in clean_marker()) {
            prop_assert_eq!(CleanMarker::decode(&m.encode()), Ok(m));
        }

        #[test]
        fn clean_marker_prefix_or_tail_is_an_error_never_a_panic(
            m in clean_marker(), cut in any::<prop::sample::Index>(),
            tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let b = m.encode();
            prop_assert!(CleanMarker::decode(&b[..cut.index(b.len())]).is_err());
            prop_assert!(CleanMarker::decode(&[&b[..], &tail].concat()).is_err());
        }

        /// Even bytes whose CRC and magic match (so the body parser runs) are refused, not panicked on.
        #[test]
        fn clean_marker_garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..128), framed in any::<bool>()) {
            let mut b = body;
            if framed && b.len() >= 6 {
                b[0..4].copy_from_slice(&CLEAN_MAGIC.to_le_bytes());
                b[4..6].copy_from_slice(&CLEAN_MARKER_VERSION.to_le_bytes());
            }
            let _ = CleanMarker::decode(&b);
            let crc = crc32fast::hash(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            let _ = CleanMarker::decode(&b);
        }
    }

    fn clean_marker() -> impl Strategy<Value = CleanMarker> {
        let segments = proptest::collection::vec(any::<(u64, u64, u64)>(), 0..5);
        (any::<u64>(), proptest::array::uniform4(any::<u64>()), segments).prop_map(|(log_end, v, segments)| {
            let counts = ClosedCounts {
                index_slots: v[0],
                index_filled: v[1],
                index_live: v[2],
                live_bytes: v[3],
                segments,
            };
            CleanMarker { log_end, counts: Some(counts) }
        })
    }

    /// A marker an earlier delayd left (20 bytes, version 4) still says where the log ends.
    #[test]
    fn a_version_4_marker_gives_the_log_end_without_counts() {
        let mut b = b"DLCS\x04\x00\x00\x00".to_vec();
        b.extend(77u64.to_le_bytes());
        let crc = crc32fast::hash(&b);
        b.extend(crc.to_le_bytes());
        assert_eq!(CleanMarker::decode(&b), Ok(CleanMarker { log_end: 77, counts: None }));
        b[9] ^= 1;
        assert!(CleanMarker::decode(&b).is_err(), "a flipped bit fails the crc");
    }

    /// The bytes storage-format.md gives, written out by hand: the layout did not move with the code.
    #[test]
    fn checkpoint_and_marker_bytes_are_the_documented_ones() {
        let cp = Checkpoint {
            dispatched: 5,
            queues: vec![QueueState {
                kind: QueueKind::Topic,
                name: "ab".into(),
                len: 1,
                cursor: 2,
                reserved: 3,
                dead: 4,
                delayed: 5,
                ready: 6,
            }],
            paused: vec![("p".into(), 7)],
            push: vec![],
            flow: vec![("f".into(), 8)],
            serial: 9,
        };
        let mut want = b"DLCK\x04\x00\x00\x00".to_vec();
        want.extend(5u64.to_le_bytes());
        want.extend(1u32.to_le_bytes());
        want.extend([1, 2, 0, b'a', b'b']);
        for v in 1..=6u64 {
            want.extend(v.to_le_bytes());
        }
        want.extend(1u32.to_le_bytes());
        want.extend([1, 0, b'p']);
        want.extend(7u64.to_le_bytes());
        want.extend(0u32.to_le_bytes());
        want.extend(1u32.to_le_bytes());
        want.extend([1, 0, b'f']);
        want.extend(8u64.to_le_bytes());
        let crc = crc32fast::hash(&want);
        want.extend(crc.to_le_bytes());
        assert_eq!(cp.encode(), want);
        assert_eq!(Checkpoint::default().encode().len(), 36, "an empty version 4 checkpoint");

        let m = CleanMarker {
            log_end: 0x0102_0304_0506_0708,
            counts: Some(ClosedCounts {
                index_slots: 64,
                index_filled: 3,
                index_live: 2,
                live_bytes: 300,
                segments: vec![(0, 200, 1), (65536, 100, 0)],
            }),
        };
        let mut marker = b"DLCS\x05\x00\x00\x00\x08\x07\x06\x05\x04\x03\x02\x01".to_vec();
        for v in [64u64, 3, 2, 300] {
            marker.extend(v.to_le_bytes());
        }
        marker.extend(2u32.to_le_bytes());
        for v in [0u64, 200, 1, 65536, 100, 0] {
            marker.extend(v.to_le_bytes());
        }
        let crc = crc32fast::hash(&marker);
        marker.extend(crc.to_le_bytes());
        assert_eq!(marker.len(), 56 + 2 * 24);
        assert_eq!(m.encode(), marker);
    }
}
