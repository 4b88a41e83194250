//! Receipts are unforgeable: a consumer holding its own receipts cannot ack or nack another
//! consumer's delivery by guessing, and receipts stay valid across a restart (the key is kept in
//! the data directory).

mod common;

use common::Server;
use serde_json::json;

/// Receipts a consumer could derive from one it holds: nearby offsets and seqs with its own tag,
/// and its own delivery with other tags.
fn guesses(own: &str) -> Vec<String> {
    let off = u64::from_str_radix(&own[..16], 16).unwrap();
    let seq = u32::from_str_radix(&own[16..24], 16).unwrap();
    let tag = &own[24..];
    let mut out = Vec::new();
    for d_off in 0..400u64 {
        for d_seq in [0u32, 1, 2, 3] {
            let (o, s) = (off.wrapping_sub(2_000).wrapping_add(d_off * 10), seq.wrapping_add(d_seq));
            if (o, s) != (off, seq) {
                out.push(format!("{o:016x}{s:08x}{tag}"));
            }
        }
    }
    for t in 0..200u64 {
        out.push(format!("{}{:016x}", &own[..24], t.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    }
    // The old, unsigned layout.
    out.push(own[..24].to_string());
    out
}

#[test]
fn guessed_receipts_are_refused_and_real_ones_survive_a_restart() {
    let mut s = Server::start(&[]);
    for i in 0..3 {
        s.produce("jobs", &json!({"id": format!("j{i}"), "body": "x"}));
    }
    let (mine, _) = s.pop("jobs", 1, 0, Some(600_000));
    let (theirs, _) = s.pop("jobs", 2, 0, Some(600_000));
    assert_eq!((mine.len(), theirs.len()), (1, 2));
    let own = mine[0]["receipt"].as_str().unwrap().to_string();
    assert_eq!(own.len(), 40, "{own}");

    let tried = guesses(&own);
    let mut accepted = Vec::new();
    for g in &tried {
        let (st, _) = s.post("/v1/ack", &json!({ "receipt": g }));
        if st != 404 {
            accepted.push((g.clone(), st));
        }
    }
    assert!(
        accepted.is_empty(),
        "{} of {} guessed receipts were accepted: {accepted:?}",
        accepted.len(),
        tried.len()
    );
    let (st, v) = s.post("/v1/nack", &json!({ "receipt": tried[1] }));
    Server::assert_error(st, &v, 404, "not_found");
    for m in &theirs {
        let (_, v) = s.get(&format!("/v1/messages/{}", m["id"].as_str().unwrap()));
        assert_eq!(v["state"], "reserved", "a guess touched another consumer's delivery: {v}");
    }

    // The key lives in the data directory: receipts handed out before a restart still work.
    s.restart();
    for m in &theirs {
        assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200, "receipt refused after a restart");
    }
    assert_eq!(s.ack(&own), 200);
    s.terminate();
}
