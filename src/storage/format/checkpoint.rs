//! The checkpoint file and the clean-shutdown marker: what the engine restarts from.
//!
//! Checkpoint: `magic "DLCK", version u16, reserved u16, dispatched u64, queue count u32`, then
//! per queue `kind u8, name len u16, name, len, cursor, reserved, dead, delayed, ready (u64 each)`,
//! then the paused, the push and the flow lists (`count u32`, then `topic len u16, topic, offset
//! u64` each),
//! then a CRC32 of everything before it. Clean marker: `magic "DLCS", version u16, reserved u16,
//! log end u64, CRC32`.

use super::{Dec, DecodeError, Enc};

/// Magic of the checkpoint file ("DLCK").
pub const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"DLCK");
/// Magic of the clean-shutdown marker ("DLCS").
pub const CLEAN_MAGIC: u32 = u32::from_le_bytes(*b"DLCS");
/// Layout version of both files (4: per-topic state counts, paused topics, push subscriptions,
/// flow control).
pub const CHECKPOINT_VERSION: u16 = 4;
/// Bytes of a clean-shutdown marker.
pub const CLEAN_MARKER_BYTES: usize = 20;

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

/// The clean-shutdown marker holding the log end.
pub fn encode_clean_marker(log_end: u64) -> [u8; CLEAN_MARKER_BYTES] {
    let mut b = [0u8; CLEAN_MARKER_BYTES];
    b[0..4].copy_from_slice(&CLEAN_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    b[8..16].copy_from_slice(&log_end.to_le_bytes());
    let crc = crc32fast::hash(&b[..16]);
    b[16..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The log end in a clean-shutdown marker of exactly [`CLEAN_MARKER_BYTES`] bytes. Its version is
/// not checked: the marker only lets recovery skip a scan, and its CRC and magic say it is whole.
pub fn decode_clean_marker(b: &[u8]) -> Result<u64, DecodeError> {
    let b: &[u8; CLEAN_MARKER_BYTES] =
        b.try_into().map_err(|_| DecodeError::Invalid("clean marker is not 20 bytes"))?;
    if crc32fast::hash(&b[..16]) != super::u32_at(b, 16) {
        return Err(DecodeError::Invalid("crc mismatch"));
    }
    if super::u32_at(b, 0) != CLEAN_MAGIC {
        return Err(DecodeError::Invalid("bad magic"));
    }
    Ok(super::u64_at(b, 8))
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
        fn clean_marker_round_trips(end in any::<u64>()) {
            prop_assert_eq!(decode_clean_marker(&encode_clean_marker(end)), Ok(end));
        }

        #[test]
        fn clean_marker_prefix_or_tail_is_an_error_never_a_panic(
            end in any::<u64>(), cut in 0usize..CLEAN_MARKER_BYTES,
            tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let b = encode_clean_marker(end);
            prop_assert!(decode_clean_marker(&b[..cut]).is_err());
            prop_assert!(decode_clean_marker(&[&b[..], &tail].concat()).is_err());
        }

        #[test]
        fn clean_marker_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_clean_marker(&b);
        }
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

        let mut marker = b"DLCS\x04\x00\x00\x00\x08\x07\x06\x05\x04\x03\x02\x01".to_vec();
        let crc = crc32fast::hash(&marker);
        marker.extend(crc.to_le_bytes());
        assert_eq!(encode_clean_marker(0x0102_0304_0506_0708)[..], marker[..]);
    }
}
