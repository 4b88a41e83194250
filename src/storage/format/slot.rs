//! The id index file: 4 KiB pages. The first holds the header (`magic "DLYI", version u16,
//! reserved u16, slots u64`, zeros to the end of the page); each later one 102 slots of 40 bytes
//! (`hash u64, msg_offset u64, last_offset u64, seq u32, attempt u16, state u8, flags u8, len u32,
//! reserved u32`) and 16 bytes of zeros.

use super::{u16_at, u32_at, u64_at, DecodeError, Home, State};
use crate::storage::types::{IdHash, LogOffset};

/// Magic at the start of an index file ("DLYI").
pub const INDEX_MAGIC: u32 = u32::from_le_bytes(*b"DLYI");
/// Layout version of the index files.
pub const INDEX_VERSION: u16 = 3;
/// Bytes before the first slot.
pub const INDEX_HEADER_BYTES: usize = 64;
/// Bytes per slot.
pub const SLOT_BYTES: usize = 40;
/// Bytes of a page of the index file. No slot crosses one: a power loss keeps or loses each page
/// written since the last sync whole, so it keeps or loses each slot whole (a slot half old and
/// half new could say a record was applied while holding the state from before it).
pub const INDEX_PAGE_BYTES: usize = 4096;
/// Slots in each page after the header's (the page's last 16 bytes are zero).
pub const SLOTS_PER_PAGE: usize = INDEX_PAGE_BYTES / SLOT_BYTES;

/// Byte position of slot `i` in an index file.
pub fn slot_position(i: u64) -> usize {
    let i = i as usize;
    INDEX_PAGE_BYTES * (1 + i / SLOTS_PER_PAGE) + SLOT_BYTES * (i % SLOTS_PER_PAGE)
}

/// Size of an index file of `slots` slots: the header's page and the slots' pages.
pub fn index_file_bytes(slots: u64) -> u64 {
    INDEX_PAGE_BYTES as u64 * (1 + slots.div_ceil(SLOTS_PER_PAGE as u64))
}
/// The slot is occupied (live or removed); a never-used slot is all zero.
const FLAG_USED: u8 = 1;
/// The message belongs to its topic's dead-letter queue.
const FLAG_DEAD_LETTER: u8 = 2;
/// The message left the index; the slot stays occupied so probe paths and merges still see it.
const FLAG_REMOVED: u8 = 4;
/// Where the flags byte sits in a slot (so a removal rewrites one byte).
pub const SLOT_FLAGS_AT: usize = 31;

/// One message's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// `format::id_hash` of the id.
    pub hash: IdHash,
    /// Commit-log offset of the Put record.
    pub msg_offset: LogOffset,
    /// Commit-log offset of the last record applied to this slot (Put or Transition).
    pub last_offset: LogOffset,
    /// Sequence number: 0 at Put, +1 per transition.
    pub seq: u32,
    /// Deliveries so far (saturates at u16::MAX).
    pub attempt: u16,
    /// Current state.
    pub state: State,
    /// Which topic queue the message belongs to.
    pub home: Home,
    /// Length of the record at `msg_offset`: what keeping the message costs the log, known
    /// without reading the log (a count of the live bytes after a crash is then a pass over the
    /// table alone, whatever the page cache holds of the log).
    pub len: u32,
}

impl Slot {
    /// The slot's bytes as stored for a live message.
    pub fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut b = [0u8; SLOT_BYTES];
        b[0..8].copy_from_slice(&self.hash.get().to_le_bytes());
        b[8..16].copy_from_slice(&self.msg_offset.get().to_le_bytes());
        b[16..24].copy_from_slice(&self.last_offset.get().to_le_bytes());
        b[24..28].copy_from_slice(&self.seq.to_le_bytes());
        b[28..30].copy_from_slice(&self.attempt.to_le_bytes());
        b[30] = self.state as u8;
        b[SLOT_FLAGS_AT] = FLAG_USED | if self.home == Home::DeadLetter { FLAG_DEAD_LETTER } else { 0 };
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Reads an occupied slot (live or removed) from exactly [`SLOT_BYTES`] bytes, refusing an
    /// empty slot, unknown flag bits, an unknown state, a record length too short for any message
    /// record and non-zero reserved bytes.
    pub fn decode(b: &[u8]) -> Result<Slot, DecodeError> {
        let b: &[u8; SLOT_BYTES] =
            b.try_into().map_err(|_| DecodeError::Invalid("index slot is not 32 bytes"))?;
        if !slot_is_occupied(b) {
            return Err(DecodeError::Empty);
        }
        if b[SLOT_FLAGS_AT] & !(FLAG_USED | FLAG_DEAD_LETTER | FLAG_REMOVED) != 0 {
            return Err(DecodeError::Invalid("unknown index slot flags"));
        }
        let state = State::from_u8(b[30]).ok_or(DecodeError::Invalid("unknown state"))?;
        if (u32_at(b, 32) as usize) < super::HEADER_BYTES {
            return Err(DecodeError::Invalid("index slot's record length is shorter than a record header"));
        }
        if u32_at(b, 36) != 0 {
            return Err(DecodeError::Invalid("index slot's reserved bytes are not zero"));
        }
        Ok(Slot { state, ..Slot::from_bytes(b) })
    }

    /// Reads a slot on the look-up path, where the flags were already tested. An unknown state
    /// byte can only come from a damaged file; it reads as done so the message is never delivered
    /// early or twice, and a rebuild (which [`Slot::decode`] triggers through the index check)
    /// fixes it.
    pub fn from_bytes(b: &[u8; SLOT_BYTES]) -> Slot {
        Slot {
            hash: slot_hash(b),
            msg_offset: slot_msg_offset(b),
            last_offset: LogOffset::new(u64_at(b, 16)),
            seq: u32_at(b, 24),
            attempt: u16_at(b, 28),
            state: State::from_u8(b[30]).unwrap_or(State::Done),
            home: if b[SLOT_FLAGS_AT] & FLAG_DEAD_LETTER != 0 { Home::DeadLetter } else { Home::Main },
            len: u32_at(b, 32),
        }
    }
}

/// The id hash a slot holds, without decoding the rest (probing compares only this).
pub fn slot_hash(b: &[u8; SLOT_BYTES]) -> IdHash {
    IdHash::new(u64_at(b, 0))
}

/// The message offset a slot holds, without decoding the rest.
pub fn slot_msg_offset(b: &[u8; SLOT_BYTES]) -> LogOffset {
    LogOffset::new(u64_at(b, 8))
}

/// Whether the slot was ever used (live or removed): probe paths run over these.
pub fn slot_is_occupied(b: &[u8; SLOT_BYTES]) -> bool {
    b[SLOT_FLAGS_AT] & FLAG_USED != 0
}

/// Whether the slot holds a message still in the index.
pub fn slot_is_live(b: &[u8; SLOT_BYTES]) -> bool {
    b[SLOT_FLAGS_AT] & (FLAG_USED | FLAG_REMOVED) == FLAG_USED
}

/// The flags byte of `b` once marked removed, to write at [`SLOT_FLAGS_AT`].
pub fn slot_removed_flags(b: &[u8; SLOT_BYTES]) -> u8 {
    b[SLOT_FLAGS_AT] | FLAG_REMOVED
}

/// The header of a table of `slots` slots.
pub fn encode_index_header(slots: u64) -> [u8; INDEX_HEADER_BYTES] {
    let mut h = [0u8; INDEX_HEADER_BYTES];
    h[0..4].copy_from_slice(&INDEX_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&INDEX_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&slots.to_le_bytes());
    h
}

/// The slot count in an index header of exactly [`INDEX_HEADER_BYTES`] bytes, after checking
/// its magic and version. Reserved bytes are not checked (a future writer may use them); whether
/// the count fits the file is the caller's check.
pub fn decode_index_header(b: &[u8]) -> Result<u64, DecodeError> {
    let b: &[u8; INDEX_HEADER_BYTES] = b.try_into().map_err(|_| DecodeError::Truncated)?;
    if u32_at(b, 0) != INDEX_MAGIC {
        return Err(DecodeError::Invalid("bad index magic"));
    }
    if u16_at(b, 4) != INDEX_VERSION {
        return Err(DecodeError::Invalid("unsupported index version"));
    }
    Ok(u64_at(b, 8))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn slot() -> impl Strategy<Value = Slot> {
        let len = super::super::HEADER_BYTES as u32..=u32::MAX;
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>(), any::<u16>(), 1u8..=6, any::<bool>(), len)
            .prop_map(|(hash, msg_offset, last_offset, seq, attempt, state, dl, len)| Slot {
                hash: IdHash::new(hash),
                msg_offset: LogOffset::new(msg_offset),
                last_offset: LogOffset::new(last_offset),
                seq,
                attempt,
                state: State::from_u8(state).expect("1..=6 are states"),
                home: if dl { Home::DeadLetter } else { Home::Main },
                len,
            })
    }

    proptest! {
        #[test]
        fn index_slot_round_trips(s in slot()) {
            let b = s.encode();
            prop_assert_eq!(Slot::decode(&b), Ok(s));
            prop_assert_eq!(Slot::from_bytes(&b), s);
            prop_assert!(slot_is_live(&b) && slot_is_occupied(&b));
            prop_assert_eq!((slot_hash(&b), slot_msg_offset(&b)), (s.hash, s.msg_offset));
            let mut removed = b;
            removed[SLOT_FLAGS_AT] = slot_removed_flags(&b);
            prop_assert!(!slot_is_live(&removed) && slot_is_occupied(&removed));
            prop_assert_eq!(Slot::decode(&removed), Ok(s));
        }

        #[test]
        fn index_slot_prefix_or_tail_is_an_error_never_a_panic(
            s in slot(), cut in 0usize..SLOT_BYTES, tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let b = s.encode();
            prop_assert!(Slot::decode(&b[..cut]).is_err());
            prop_assert!(Slot::decode(&[&b[..], &tail].concat()).is_err());
        }

        #[test]
        fn index_slot_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let decoded = Slot::decode(&b);
            if let Ok(s) = decoded {
                // Whatever decodes is a slot that encodes back to the same fields.
                prop_assert_eq!(Slot::from_bytes(&s.encode()), s);
            }
            if let Ok(fixed) = <&[u8; SLOT_BYTES]>::try_from(&b[..]) {
                let _ = Slot::from_bytes(fixed);
            }
        }

        #[test]
        fn index_header_round_trips(slots in any::<u64>()) {
            prop_assert_eq!(decode_index_header(&encode_index_header(slots)), Ok(slots));
        }

        #[test]
        fn index_header_prefix_or_tail_is_an_error_never_a_panic(
            slots in any::<u64>(), cut in 0usize..INDEX_HEADER_BYTES,
            tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let h = encode_index_header(slots);
            prop_assert!(decode_index_header(&h[..cut]).is_err());
            prop_assert!(decode_index_header(&[&h[..], &tail].concat()).is_err());
        }

        #[test]
        fn index_header_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = decode_index_header(&b);
        }
    }

    #[test]
    fn an_unknown_state_reads_as_done_on_the_look_up_path_and_fails_the_strict_decode() {
        let s = Slot {
            hash: IdHash::new(1),
            msg_offset: LogOffset::new(2),
            last_offset: LogOffset::new(3),
            seq: 4,
            attempt: 5,
            state: State::Ready,
            home: Home::Main,
            len: 100,
        };
        let mut b = s.encode();
        b[30] = 99;
        assert_eq!(Slot::from_bytes(&b).state, State::Done);
        assert!(Slot::decode(&b).is_err());
        let mut b = s.encode();
        b[32..36].copy_from_slice(&3u32.to_le_bytes());
        assert!(Slot::decode(&b).is_err(), "a record length below a header's");
        let mut b = s.encode();
        b[39] = 1;
        assert!(Slot::decode(&b).is_err(), "reserved bytes set");
        assert_eq!(Slot::decode(&[0u8; SLOT_BYTES]), Err(DecodeError::Empty));
    }

    /// The bytes storage-format.md gives, written out by hand: the layout did not move with the code.
    #[test]
    fn slot_and_header_bytes_are_the_documented_ones() {
        let s = Slot {
            hash: IdHash::new(0x0102_0304_0506_0708),
            msg_offset: LogOffset::new(0x1112_1314_1516_1718),
            last_offset: LogOffset::new(0x2122_2324_2526_2728),
            seq: 0x3132_3334,
            attempt: 0x4142,
            state: State::Reserved,
            home: Home::DeadLetter,
            len: 0x5152_5354,
        };
        let mut want = vec![8, 7, 6, 5, 4, 3, 2, 1, 0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11];
        want.extend([
            0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21, 0x34, 0x33, 0x32, 0x31, 0x42, 0x41, 3, 3,
        ]);
        want.extend([0x54, 0x53, 0x52, 0x51, 0, 0, 0, 0]);
        assert_eq!(s.encode()[..], want[..]);
        assert_eq!((SLOTS_PER_PAGE, slot_position(0), slot_position(101), slot_position(102)), (102, 4096, 8136, 8192));
        assert_eq!((index_file_bytes(64), index_file_bytes(102), index_file_bytes(103)), (8192, 8192, 12288));
        let mut header = b"DLYI\x03\x00\x00\x00\x40\x00\x00\x00\x00\x00\x00\x00".to_vec();
        header.resize(INDEX_HEADER_BYTES, 0);
        assert_eq!(encode_index_header(64)[..], header[..]);
    }
}
