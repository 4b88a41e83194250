//! The data directory's receipt key: 32 random bytes that sign every delivery receipt, so a
//! consumer cannot ack or nack a delivery it was not given by guessing its receipt.
//!
//! The key is not derived from the log and nothing else depends on it: a missing or damaged key
//! file is replaced by a new key, which only invalidates receipts handed out before (their
//! messages come back when their time-to-run ends, as for a consumer that died).

use std::path::Path;

use tracing::warn;

use super::checkpoint::write_atomic;
use super::durability::Durability;
use crate::error::{Error, Result};

pub use super::format::receipt_key::KEY_BYTES;
use super::format::receipt_key::{decode_receipt_key, encode_receipt_key};

/// Reads the key in `path`, or makes, stores and returns a new one when the file is missing or
/// fails its check.
pub fn load_or_create(path: &Path, holds_log: bool, durability: &Durability) -> Result<[u8; KEY_BYTES]> {
    match std::fs::read(path) {
        Ok(b) => match decode_receipt_key(&b) {
            Ok(key) => {
                super::io::keep_private(path, "the receipt key");
                return Ok(key);
            }
            Err(_) => warn!(
                file = %path.display(),
                "receipt key damaged; making a new one (receipts handed out before are refused, \
                 their messages come back after their time-to-run)"
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && holds_log => warn!(
            file = %path.display(),
            "receipt key missing from a data directory that holds a log; making a new one (receipts \
             handed out before are refused with 404, their messages come back after their \
             time-to-run). Restore the file from a backup of this directory to keep them valid"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io_at("read", path, e)),
    }
    let key = random_key()?;
    write_atomic(path, &encode_receipt_key(&key), durability)?;
    Ok(key)
}

/// The receipt key of a cluster, the same on every node: HMAC-SHA256 of a fixed label under the
/// cluster's secret, so a receipt a leader handed out is still valid after a failover.
pub fn derive_key(secret: &str) -> [u8; KEY_BYTES] {
    use hmac::{Hmac, Mac};
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(b"delayd receipt key v1");
    let mut key = [0u8; KEY_BYTES];
    let out = mac.finalize().into_bytes();
    key.copy_from_slice(&out[..KEY_BYTES]);
    key
}

/// 32 bytes from the kernel's CSPRNG (getrandom(2), which blocks only before the pool is seeded).
fn random_key() -> Result<[u8; KEY_BYTES]> {
    let mut key = [0u8; KEY_BYTES];
    let mut filled = 0;
    while filled < KEY_BYTES {
        let rest = &mut key[filled..];
        // SAFETY: the pointer and length describe `rest`, a live, writable buffer.
        #[allow(unsafe_code)]
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        filled += n as usize;
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_made_once_kept_across_opens_and_replaced_when_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("receipt_key");
        let d = Durability::new(dir.path());
        let a = load_or_create(&path, false, &d).unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), super::super::format::receipt_key::KEY_FILE_BYTES);
        assert_eq!(load_or_create(&path, false, &d).unwrap(), a, "the key survives a reopen");
        let other =
            load_or_create(&tempfile::tempdir().unwrap().path().join("receipt_key"), false, &d).unwrap();
        assert_ne!(a, other, "each data directory has its own key");
        let mut b = std::fs::read(&path).unwrap();
        b[10] ^= 1;
        std::fs::write(&path, &b).unwrap();
        let c = load_or_create(&path, false, &d).unwrap();
        assert_ne!(c, a, "a damaged key is replaced");
        assert_eq!(load_or_create(&path, false, &d).unwrap(), c);
    }
}
