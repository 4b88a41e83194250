//! The consume-queue entry: 20 bytes per entry, `offset u64, size u32, tag u64`.

use super::{u32_at, u64_at, DecodeError};
use crate::storage::types::{LogOffset, UnixMs};

/// Bytes per entry: log offset u64, record size u32, tag u64.
pub const ENTRY_BYTES: usize = 20;

/// One consume-queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Commit-log offset of the record.
    pub offset: LogOffset,
    /// Size of that record in bytes; never zero for a written entry.
    pub size: u32,
    /// Level queues: the due time in unix ms. Topic queues: the time the message became due.
    pub tag: UnixMs,
}

impl Entry {
    /// The entry's bytes as they are stored.
    pub fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[0..8].copy_from_slice(&self.offset.get().to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b[12..20].copy_from_slice(&self.tag.get().to_le_bytes());
        b
    }

    /// Reads an entry from exactly [`ENTRY_BYTES`] bytes. An unwritten (all-zero) entry decodes
    /// with `size` 0: queues tell written entries apart by it, so it is not an error here.
    pub fn decode(b: &[u8]) -> Result<Entry, DecodeError> {
        let b: &[u8; ENTRY_BYTES] =
            b.try_into().map_err(|_| DecodeError::Invalid("queue entry is not 20 bytes"))?;
        Ok(Entry::from_bytes(b))
    }

    /// Reads an entry from its stored bytes (the hot path: no length to check).
    pub fn from_bytes(b: &[u8; ENTRY_BYTES]) -> Entry {
        Entry { offset: LogOffset::new(u64_at(b, 0)), size: u32_at(b, 8), tag: UnixMs::new(u64_at(b, 12)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn queue_entry_round_trips(offset in any::<u64>(), size in any::<u32>(), tag in any::<u64>()) {
            let e = Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(tag) };
            prop_assert_eq!(Entry::decode(&e.encode()), Ok(e));
        }

        #[test]
        fn queue_entry_prefix_or_tail_is_an_error_never_a_panic(
            offset in any::<u64>(), size in any::<u32>(), tag in any::<u64>(),
            cut in 0usize..ENTRY_BYTES, tail in proptest::collection::vec(any::<u8>(), 1..32),
        ) {
            let b = Entry { offset: LogOffset::new(offset), size, tag: UnixMs::new(tag) }.encode();
            prop_assert!(Entry::decode(&b[..cut]).is_err());
            let long = [&b[..], &tail].concat();
            prop_assert!(Entry::decode(&long).is_err());
        }

        #[test]
        fn queue_entry_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(Entry::decode(&b).is_ok(), b.len() == ENTRY_BYTES);
        }
    }

    #[test]
    fn queue_entry_layout_is_little_endian() {
        let e = Entry {
            offset: LogOffset::new(0x0102_0304_0506_0708),
            size: 0x0A0B_0C0D,
            tag: UnixMs::new(0x1112_1314_1516_1718),
        };
        let b = e.encode();
        assert_eq!(b[..8], [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(b[8..12], [0x0D, 0x0C, 0x0B, 0x0A]);
        assert_eq!(b[12..], [0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11]);
    }
}
