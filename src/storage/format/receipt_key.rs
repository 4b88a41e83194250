//! The receipt key file: `magic "DLRK", version u16, reserved u16, key (32 bytes), CRC32` of
//! everything before the CRC.

use super::{u16_at, u32_at, DecodeError};

/// Bytes of the key.
pub const KEY_BYTES: usize = 32;
/// `DLRK` little-endian: the file's magic.
const MAGIC: u32 = u32::from_le_bytes(*b"DLRK");
const VERSION: u16 = 1;
/// magic, version, reserved, key, CRC.
pub const KEY_FILE_BYTES: usize = 4 + 2 + 2 + KEY_BYTES + 4;

/// The key file's bytes.
pub fn encode_receipt_key(key: &[u8; KEY_BYTES]) -> [u8; KEY_FILE_BYTES] {
    let mut b = [0u8; KEY_FILE_BYTES];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[8..8 + KEY_BYTES].copy_from_slice(key);
    let crc = crc32fast::hash(&b[..8 + KEY_BYTES]);
    b[8 + KEY_BYTES..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The key in a key file of exactly [`KEY_FILE_BYTES`] bytes whose CRC, magic and version check.
pub fn decode_receipt_key(b: &[u8]) -> Result<[u8; KEY_BYTES], DecodeError> {
    let b: &[u8; KEY_FILE_BYTES] =
        b.try_into().map_err(|_| DecodeError::Invalid("receipt key file is not 44 bytes"))?;
    if crc32fast::hash(&b[..8 + KEY_BYTES]) != u32_at(b, 8 + KEY_BYTES) {
        return Err(DecodeError::Invalid("crc mismatch"));
    }
    if u32_at(b, 0) != MAGIC || u16_at(b, 4) != VERSION {
        return Err(DecodeError::Invalid("bad magic or version"));
    }
    let mut key = [0u8; KEY_BYTES];
    key.copy_from_slice(&b[8..8 + KEY_BYTES]);
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn receipt_key_round_trips(key in any::<[u8; KEY_BYTES]>()) {
            prop_assert_eq!(decode_receipt_key(&encode_receipt_key(&key)), Ok(key));
        }

        #[test]
        fn receipt_key_prefix_or_tail_is_an_error_never_a_panic(
            key in any::<[u8; KEY_BYTES]>(), cut in 0usize..KEY_FILE_BYTES,
            tail in proptest::collection::vec(any::<u8>(), 1..40),
        ) {
            let b = encode_receipt_key(&key);
            prop_assert!(decode_receipt_key(&b[..cut]).is_err());
            prop_assert!(decode_receipt_key(&[&b[..], &tail].concat()).is_err());
        }

        #[test]
        fn receipt_key_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode_receipt_key(&b);
        }
    }

    /// The bytes storage-format.md gives, written out by hand: the layout did not move with the code.
    #[test]
    fn receipt_key_bytes_are_the_documented_ones() {
        let key = [0xAB; KEY_BYTES];
        let mut want = b"DLRK\x01\x00\x00\x00".to_vec();
        want.extend(key);
        let crc = crc32fast::hash(&want);
        want.extend(crc.to_le_bytes());
        assert_eq!(encode_receipt_key(&key)[..], want[..]);
    }
}
