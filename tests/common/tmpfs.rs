//! A small real filesystem for tests of a full disk: a tmpfs mounted for the test (needs root).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted for the test, unmounted when dropped.
pub struct Tmpfs(pub PathBuf, Option<tempfile::TempDir>);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (e.g. `16m`) on a new temporary directory.
    pub fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        mount(dir.path(), size)?;
        Ok(Tmpfs(dir.path().to_path_buf(), Some(dir)))
    }

    /// Mounts a tmpfs of `size` on `dir`, hiding what it holds until unmounted.
    pub fn mount_at(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        mount(dir, size)?;
        Ok(Tmpfs(dir.to_path_buf(), None))
    }
}

fn mount(dir: &Path, size: &str) -> Result<(), String> {
    {
        let uid = Command::new("id").arg("-u").output().map_err(|e| format!("id -u: {e}"))?;
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            return Err("not root: cannot mount a tmpfs".into());
        }
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!("mount -t tmpfs failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Free bytes on the filesystem holding `path`.
pub fn free_bytes(path: &Path) -> u64 {
    let out = Command::new("df").args(["-B1", "--output=avail"]).arg(path).output().expect("df");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1).and_then(|l| l.trim().parse().ok()).expect("df output")
}
