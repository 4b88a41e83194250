//! What a cluster node keeps beside its log: Raft's term, vote and commit (`cluster/raft_state`),
//! and the atomic, durable replace every small cluster file is written with.

use std::path::{Path, PathBuf};

use raft::prelude::HardState;

use crate::error::{Error, Result};

/// The persisted part of Raft's state: term, vote and commit index, in `cluster/raft_state`.
fn hard_state_path(dir: &Path) -> PathBuf {
    dir.join("cluster").join("raft_state")
}

/// Reads the persisted term, vote and commit (zeroes when there is none yet).
pub fn load_hard_state(dir: &Path) -> Result<HardState> {
    let path = hard_state_path(dir);
    let mut hs = HardState::default();
    match std::fs::read(&path) {
        Ok(b) if b.len() == 28 && crc32fast::hash(&b[..24]).to_le_bytes() == b[24..28] => {
            let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            hs.term = word(0);
            hs.vote = word(1);
            hs.commit = word(2);
            Ok(hs)
        }
        Ok(_) => Err(Error::Corrupt {
            file: path.display().to_string(),
            offset: 0,
            reason: "raft state file damaged (bad length or CRC); the node's vote is unknown".into(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(hs),
        Err(e) => Err(Error::io_at("read", &path, e)),
    }
}

/// Writes term, vote and commit durably before any message that depends on them goes out.
pub(crate) fn save_hard_state(dir: &Path, hs: &HardState) -> Result<()> {
    let path = hard_state_path(dir);
    let mut b = Vec::with_capacity(28);
    for v in [hs.term, hs.vote, hs.commit] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&crc32fast::hash(&b).to_le_bytes());
    write_durably(&path, &b).map_err(|e| Error::io_at("write", &path, e))
}

/// Replaces `path` with `bytes` atomically and durably: a private temporary file synced,
/// renamed over it, and the directory synced (created 0700, itself synced into its parent, the
/// first time).
pub(crate) fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    if !dir.is_dir() {
        crate::storage::io::create_private_dir(dir).map_err(std::io::Error::other)?;
        if let Some(parent) = dir.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    // A temp file left by a crash keeps the mode it was made with; `mode` covers new ones only.
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    f.write_all(bytes)?;
    f.sync_data()?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}
