//! Receipts: the signed token that names one delivery, made by a pop and checked by ack and nack.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Signs and checks receipts. A receipt names one delivery (the message's Put offset and the seq
/// its reservation made) and carries a 64-bit HMAC-SHA256 tag of both under the data directory's
/// key: a consumer holding receipts cannot derive another delivery's by guessing.
#[derive(Clone)]
pub(crate) struct Receipts {
    mac: Hmac<Sha256>,
}

/// Hex digits of a receipt: offset (16), seq (8), tag (16).
const RECEIPT_LEN: usize = 40;

impl Receipts {
    pub(crate) fn new(key: &[u8]) -> Receipts {
        // HMAC takes a key of any length, so this cannot fail.
        let mac = <Hmac<Sha256> as Mac>::new_from_slice(key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key"));
        Receipts { mac }
    }

    fn tag(&self, msg_offset: u64, seq: u32) -> Hmac<Sha256> {
        let mut m = self.mac.clone();
        m.update(&msg_offset.to_le_bytes());
        m.update(&seq.to_le_bytes());
        m
    }

    pub(crate) fn encode(&self, msg_offset: u64, seq: u32) -> String {
        let tag = self.tag(msg_offset, seq).finalize().into_bytes();
        let mut out = format!("{msg_offset:016x}{seq:08x}");
        for b in &tag[..8] {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// The delivery a receipt names, if it is well formed and its tag checks out (compared in
    /// constant time); every failure reads as an unknown receipt.
    pub(crate) fn decode(&self, receipt: &str) -> Result<(u64, u32)> {
        let bad = || Error::NotFound("unknown or expired receipt".to_string());
        if receipt.len() != RECEIPT_LEN || !receipt.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let off = u64::from_str_radix(&receipt[..16], 16).map_err(|_| bad())?;
        let seq = u32::from_str_radix(&receipt[16..24], 16).map_err(|_| bad())?;
        let mut tag = [0u8; 8];
        for (i, b) in tag.iter_mut().enumerate() {
            *b = u8::from_str_radix(&receipt[24 + 2 * i..26 + 2 * i], 16).map_err(|_| bad())?;
        }
        self.tag(off, seq).verify_truncated_left(&tag).map_err(|_| bad())?;
        Ok((off, seq))
    }
}
