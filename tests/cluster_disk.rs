//! A follower's disk fills up under load: the cluster goes on answering every write on the
//! leader and the other follower (a majority), loses nothing acknowledged, and the full node
//! catches up once it has room again.
//!
//! Needs root to mount a tmpfs: ignored by a plain `cargo test`; `.ci/run` runs it as root with
//! `--ignored`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::tmpfs::{free_bytes, Tmpfs};
use serde_json::json;

/// Copies the files of `from` into `to` (a flat data directory tree).
fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            std::fs::create_dir_all(&target).expect("mkdir");
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

#[test]
#[ignore = "needs root to mount a tmpfs; .ci/run runs it as root"]
fn a_follower_whose_disk_fills_holds_nothing_back_and_catches_up_later() {
    let mut c = Cluster::start(3, &[]);
    let leader = c.wait_leader(Duration::from_secs(15));
    let full = (1..=3).find(|i| *i != leader).expect("a follower");
    // Move the follower's data directory onto a 12 MiB tmpfs.
    c.terminate(full);
    let data = c.node(full).data_dir();
    let saved = tempfile::tempdir().expect("tmp");
    copy_tree(&data, saved.path());
    let fs = Tmpfs::mount_at(&data, "12m").expect("mount a tmpfs");
    copy_tree(saved.path(), &data);
    std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o700)).expect("chmod");
    c.restart(full);
    c.wait_leader(Duration::from_secs(15));
    let client = c.client();
    // 24 MiB of messages: twice what the follower's disk holds. Every one is answered 201 by the
    // leader and the other follower.
    let body = "d".repeat(32 << 10);
    for k in 0..768 {
        let r = client
            .produce("disk", &json!({"body": body, "id": format!("d{k}")}))
            .unwrap_or_else(|e| panic!("produce d{k}: {e}\n{}", c.describe()));
        assert_eq!(r.status, 201, "d{k}: {:?}\n{}", r.body, c.describe());
    }
    assert!(
        free_bytes(&data) < 2 << 20,
        "the follower's disk did not fill: {} bytes free",
        free_bytes(&data)
    );
    let log = c.node(full).log();
    assert!(log.contains("cannot append the replicated log here"), "{log}");
    // Room again (the tmpfs grows): the follower catches up.
    let out = std::process::Command::new("mount")
        .args(["-o", "remount,size=128m"])
        .arg(&fs.0)
        .output()
        .expect("remount");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let views = c.views();
        let led = views[leader - 1].as_ref().and_then(|v| v["last_index"].as_u64()).unwrap_or(0);
        let got = views[full - 1].as_ref().and_then(|v| v["applied_index"].as_u64()).unwrap_or(0);
        if got >= led && led > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "node {full} stuck at {got} of {led}:\n{}", c.describe());
        std::thread::sleep(Duration::from_millis(300));
    }
    // It holds everything: with the leader gone, it and the other follower deliver every message.
    c.kill9(leader);
    c.wait_leader(Duration::from_secs(15));
    let mut seen = std::collections::HashSet::new();
    let until = Instant::now() + Duration::from_secs(60);
    while seen.len() < 768 && Instant::now() < until {
        for m in client.pop("disk", 100, 500, None).expect("pop").messages() {
            seen.insert(m["id"].as_str().unwrap_or_default().to_string());
            client.ack(m["receipt"].as_str().unwrap_or_default()).expect("ack");
        }
    }
    assert_eq!(seen.len(), 768, "missing after failover:\n{}", c.describe());
    drop(c);
    drop(fs);
}
