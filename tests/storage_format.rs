//! Checks `storage-format.md` against real files.
//!
//! Data directories are written by the real broker, then every file in them is parsed by the reader
//! in `mod reader`, which was written from the document alone: its own CRC-32, its own id hash, its
//! own structs; nothing from delayd's storage modules. The reader then replays the commit log with
//! the document's dispatch rules and requires the consume queues, the id index and the checkpoint to
//! be exactly what that replay predicts (within what reclaim may have deleted).
//!
//! * `a_data_dir_parses_with_only_the_format_document` goes through the in-process broker API with
//!   small segments, small queue files and a small index, so that segments roll, queues span files
//!   and the index grows, and reaches every record kind a client can cause.
//! * `a_reclaimed_data_dir_parses_with_only_the_format_document` runs the `delayd` binary with small
//!   segments and a one-second `done_retention` until reclaim has carried live messages forward and
//!   deleted the oldest segment and consume-queue files, so the log starts past 0, queues start past
//!   file 0, Carry records exist and expired messages have left the index.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use delayd::broker::{
    Broker, BrokerConfig, MessageState, Nacked, PopRequest, ProduceRequest, RescheduleRequest, When,
};
use serde_json::json;

/// An independent reader of a delayd data directory, per `storage-format.md`.
mod reader {
    use std::collections::{BTreeMap, BTreeSet, HashMap};
    use std::fs;
    use std::path::{Path, PathBuf};

    // ---- primitives -------------------------------------------------------------------------

    const CRC_TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };

    /// CRC-32 (IEEE, reflected 0xEDB88320, init and final XOR 0xFFFFFFFF) over `parts` in order.
    pub fn crc32(parts: &[&[u8]]) -> u32 {
        let mut c = 0xFFFF_FFFFu32;
        for p in parts {
            for &b in *p {
                c = CRC_TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
            }
        }
        c ^ 0xFFFF_FFFF
    }

    /// FNV-1a 64 followed by the splitmix64 finaliser.
    pub fn id_hash(id: &[u8]) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in id {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= h >> 30;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 27;
        h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^ (h >> 31)
    }

    /// The level entry for a timer `remaining_ms` away at `now_ms`: the largest configured level
    /// `<= remaining`, due at `now + level`; below the smallest level, the smallest one due at
    /// `now + remaining`.
    pub fn plan_hop(levels: &[u64], now_ms: u64, remaining_ms: u64) -> Route {
        match levels.iter().rev().find(|l| **l <= remaining_ms) {
            Some(l) => Route::Level { level_ms: *l, due_ms: now_ms + l },
            None => Route::Level { level_ms: levels[0], due_ms: now_ms + remaining_ms },
        }
    }

    fn le16(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }
    fn le64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    fn all_zero(b: &[u8]) -> bool {
        b.iter().all(|x| *x == 0)
    }

    fn utf8(b: &[u8]) -> String {
        String::from_utf8(b.to_vec()).expect("delayd writes topics as ASCII")
    }

    /// Sorted `(number, path)` of the entries of `dir` named by exactly `digits` ASCII digits;
    /// panics on any other entry, since the document allows nothing else there.
    pub fn numbered(dir: &Path, digits: usize) -> Vec<(u64, PathBuf)> {
        let mut out = vec![];
        for e in fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            assert!(
                name.len() == digits && name.bytes().all(|b| b.is_ascii_digit()),
                "unexpected entry {:?} in {}",
                name,
                dir.display()
            );
            out.push((name.parse().unwrap(), e.path()));
        }
        out.sort();
        out
    }

    // ---- records ----------------------------------------------------------------------------

    /// Route tag and values.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Route {
        None,
        Topic,
        Level { level_ms: u64, due_ms: u64 },
    }

    /// The Put payload layout: a Put's payload, and a Carry's after its own 34 bytes.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Msg {
        pub created_ms: u64,
        pub deliver_at_ms: u64,
        pub ttr_ms: u64,
        pub max_attempts: u32,
        pub request_kind: u8,
        pub request_value: u64,
        pub route: Route,
        pub id: Vec<u8>,
        pub topic: Vec<u8>,
        pub backoff_ms: Vec<u64>,
        pub body: Vec<u8>,
        /// A Put of record version 2: it replaces the message its id named.
        pub replaces: bool,
    }

    /// A decoded record.
    #[derive(Debug, Clone)]
    pub enum Rec {
        Put(Msg),
        Transition {
            msg_offset: u64,
            id_hash: u64,
            seq: u32,
            prev_state: u8,
            state: u8,
            cause: u8,
            home: u8,
            attempt: u32,
            time_ms: u64,
            deliver_at_ms: u64,
            route: Route,
            /// Versions 2 and 3 (a Reserve or a Redrive): the due time it records.
            due_ms: Option<u64>,
            /// Versions 3 and 5: the message's record this change follows.
            prev_offset: Option<u64>,
            /// Version 5 (a Reschedule): the message's `ttr_ms` and `max_attempts` from then on.
            settings: Option<(u64, u32)>,
            /// Version 7 (a Nack or DeadLetter with a reason): the reason, UTF-8.
            error: Option<Vec<u8>>,
        },
        Hop {
            msg_offset: u64,
            id_hash: u64,
            seq: u32,
            target_ms: u64,
            route: Route,
        },
        Pause {
            paused: bool,
            time_ms: u64,
            topic: Vec<u8>,
        },
        Push {
            target: u8,
            time_ms: u64,
            timeout_ms: u32,
            max_in_flight: u32,
            topic: Vec<u8>,
            url: Vec<u8>,
            subject: Vec<u8>,
            secret: Vec<u8>,
        },
        Flow {
            time_ms: u64,
            max_per_second: u32,
            burst: u32,
            max_reserved: u32,
            topic: Vec<u8>,
        },
        Carry {
            prev_msg_offset: u64,
            seq: u32,
            attempt: u32,
            state: u8,
            home: u8,
            time_ms: u64,
            deliver_at_ms: u64,
            msg: Msg,
            /// Version 7: the message's last failure, `(error_time_ms, error_attempt, reason)`.
            last_error: Option<(u64, u32, Vec<u8>)>,
        },
        EndOfSegment,
    }

    pub const KIND_PUT: u8 = 1;
    pub const KIND_TRANSITION: u8 = 2;
    pub const KIND_HOP: u8 = 3;
    pub const KIND_CARRY: u8 = 4;
    pub const KIND_PAUSE: u8 = 5;
    pub const KIND_PUSH: u8 = 6;
    pub const KIND_FLOW: u8 = 8;
    pub const KIND_EOS: u8 = 0x7F;

    /// Record versions (validity rules 7 and 8): Carry, Pause and Push are version 2; Put is 1 or 2
    /// (2 replaces); Transition 1, 2 (ends with a due time) or 3 (a due time and a link; delayd
    /// writes every Transition so), 5 (a Reschedule: version 3 and the settings it sets), 6 (a
    /// Touch, as version 3) or 7 (a Nack or DeadLetter: version 3 and its reason); Carry also 7
    /// (with the message's last failure); Hop and EndOfSegment 1.
    pub const VERSION: u8 = 1;
    pub const VERSION_CARRY: u8 = 2;
    pub const VERSION_LINKED: u8 = 3;
    pub const VERSION_RESCHEDULE: u8 = 5;
    pub const VERSION_TOUCH: u8 = 6;
    pub const VERSION_ERROR: u8 = 7;
    /// Flow (kind 8) is version 8, and version 8 is only Flow.
    pub const VERSION_FLOW: u8 = 8;

    pub const STATE_DELAYED: u8 = 1;
    pub const STATE_READY: u8 = 2;
    pub const STATE_RESERVED: u8 = 3;
    pub const STATE_DONE: u8 = 4;
    pub const STATE_CANCELLED: u8 = 5;
    pub const STATE_DEAD: u8 = 6;
    pub const CAUSE_DUE: u8 = 1;
    pub const CAUSE_RESERVE: u8 = 2;
    pub const CAUSE_NACK: u8 = 4;
    pub const CAUSE_DEAD_LETTER: u8 = 6;
    pub const CAUSE_REDRIVE: u8 = 8;
    pub const CAUSE_RESCHEDULE: u8 = 9;
    pub const CAUSE_TOUCH: u8 = 10;
    pub const HOME_DEAD_LETTER: u8 = 1;

    fn is_final(state: u8) -> bool {
        state == STATE_DONE || state == STATE_CANCELLED
    }

    struct Cur<'a> {
        b: &'a [u8],
        pos: usize,
        /// Where the bytes are valid (rule 9 does not check them) but not what delayd writes.
        unwritten: Vec<String>,
    }

    impl<'a> Cur<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
            let end = self.pos.checked_add(n).ok_or("length overflow")?;
            let s =
                self.b.get(self.pos..end).ok_or_else(|| format!("field at {} past record end", self.pos))?;
            self.pos = end;
            Ok(s)
        }
        fn u8(&mut self) -> Result<u8, String> {
            Ok(self.take(1)?[0])
        }
        fn u16(&mut self) -> Result<u16, String> {
            Ok(le16(self.take(2)?, 0))
        }
        fn u32(&mut self) -> Result<u32, String> {
            Ok(le32(self.take(4)?, 0))
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(le64(self.take(8)?, 0))
        }
        /// A failure reason: `error_len u16`, 1 to 2048, then that many UTF-8 bytes.
        fn error(&mut self) -> Result<Vec<u8>, String> {
            let n = self.u16()? as usize;
            if !(1..=2048).contains(&n) {
                return Err(format!("error_len {n}, not 1 to 2048"));
            }
            let b = self.take(n)?.to_vec();
            String::from_utf8(b).map(String::into_bytes).map_err(|_| "error is not UTF-8".to_string())
        }
        fn enum_u8(&mut self, what: &str, valid: std::ops::RangeInclusive<u8>) -> Result<u8, String> {
            let v = self.u8()?;
            if valid.contains(&v) {
                Ok(v)
            } else {
                Err(format!("unknown {what} {v}"))
            }
        }
        fn route(&mut self) -> Result<Route, String> {
            let tag = self.u8()?;
            let a = self.u64()?;
            let b = self.u64()?;
            if matches!(tag, 0 | 1) && (a != 0 || b != 0) {
                // Ignored on read; delayd writes zeros there.
                self.unwritten.push(format!("non-zero unused route fields after tag {tag}"));
            }
            match tag {
                0 => Ok(Route::None),
                1 => Ok(Route::Topic),
                2 => Ok(Route::Level { level_ms: a, due_ms: b }),
                t => Err(format!("unknown route tag {t}")),
            }
        }
        /// The Put payload layout, from `created_ms` to the body.
        fn msg(&mut self) -> Result<Msg, String> {
            let created_ms = self.u64()?;
            let deliver_at_ms = self.u64()?;
            let ttr_ms = self.u64()?;
            let max_attempts = self.u32()?;
            // Not checked on read (rule 9); delayd writes 0 to 3.
            let request_kind = self.u8()?;
            if request_kind > 3 {
                self.unwritten.push(format!("request kind {request_kind}"));
            }
            let request_value = self.u64()?;
            let route = self.route()?;
            let n = self.u16()? as usize;
            let id = self.take(n)?.to_vec();
            let n = self.u16()? as usize;
            let topic = self.take(n)?.to_vec();
            let n = self.u16()? as usize;
            let backoff_ms = (0..n).map(|_| self.u64()).collect::<Result<Vec<_>, _>>()?;
            let n = self.u32()? as usize;
            let body = self.take(n)?.to_vec();
            Ok(Msg {
                created_ms,
                deliver_at_ms,
                ttr_ms,
                max_attempts,
                request_kind,
                request_value,
                route,
                id,
                topic,
                backoff_ms,
                body,
                replaces: false,
            })
        }
    }

    /// Decodes the record at the start of `buf` with the document's validity rules, in its order:
    /// the record and its length, or None for the end of data (an empty header).
    pub fn parse_record(buf: &[u8]) -> Result<Option<(Rec, usize)>, String> {
        Ok(parse(buf)?.map(|(rec, len, _)| (rec, len)))
    }

    /// [`parse_record`], and also what the document says delayd writes in the bytes validity does
    /// not check (`request_kind` 0 to 3, zeros in unused route fields).
    pub fn parse_record_as_written(buf: &[u8]) -> Result<Option<(Rec, usize)>, String> {
        match parse(buf)? {
            Some((_, _, unwritten)) if !unwritten.is_empty() => {
                Err(format!("valid, but not as delayd writes it: {}", unwritten.join(", ")))
            }
            other => Ok(other.map(|(rec, len, _)| (rec, len))),
        }
    }

    /// The record, its length and where it departs from what delayd writes.
    fn parse(buf: &[u8]) -> Result<Option<(Rec, usize, Vec<String>)>, String> {
        // 1-2: a header's worth of bytes, or the end of data.
        if buf.len() < 12 {
            return if all_zero(buf) { Ok(None) } else { Err("truncated header".into()) };
        }
        let len = le32(buf, 0) as usize;
        if len == 0 && all_zero(&buf[..12]) {
            return Ok(None);
        }
        // 3-5: magic, length, availability.
        if le16(buf, 4) != 0xD71A {
            return Err("bad magic".into());
        }
        if !(12..=64 << 20).contains(&len) {
            return Err(format!("bad len {len}"));
        }
        if buf.len() < len {
            return Err("truncated record".into());
        }
        // 6: the CRC, before the version, so that a flipped bit reads as damage.
        let rec = &buf[..len];
        if crc32(&[&rec[0..8], &rec[12..]]) != le32(rec, 8) {
            return Err("crc mismatch".into());
        }
        // 7-8: a version this reader knows, a known kind, and the version that kind is written with.
        let (version, kind) = (rec[6], rec[7]);
        if ![
            VERSION,
            VERSION_CARRY,
            VERSION_LINKED,
            VERSION_RESCHEDULE,
            VERSION_TOUCH,
            VERSION_ERROR,
            VERSION_FLOW,
        ]
        .contains(&version)
        {
            return Err(format!("unknown version {version}"));
        }
        if ![KIND_PUT, KIND_TRANSITION, KIND_HOP, KIND_CARRY, KIND_PAUSE, KIND_PUSH, KIND_FLOW, KIND_EOS]
            .contains(&kind)
        {
            return Err(format!("unknown kind {kind}"));
        }
        if ([KIND_PAUSE, KIND_PUSH].contains(&kind) && version != VERSION_CARRY)
            || (kind == KIND_CARRY && ![VERSION_CARRY, VERSION_ERROR].contains(&version))
            || (version == VERSION_ERROR && ![KIND_TRANSITION, KIND_CARRY].contains(&kind))
            || (version == VERSION_CARRY
                && ![KIND_CARRY, KIND_PAUSE, KIND_PUSH, KIND_PUT, KIND_TRANSITION].contains(&kind))
            || ([VERSION_LINKED, VERSION_RESCHEDULE, VERSION_TOUCH].contains(&version)
                && kind != KIND_TRANSITION)
            || ((version == VERSION_FLOW) != (kind == KIND_FLOW))
        {
            return Err(format!(
                "kind {kind} with record version {version} (Pause and Push are 2, Carry 2 or 7, Put 1 \
                 or 2, Transition 1 to 3 or 5 to 7, Flow 8, Hop and EndOfSegment 1)"
            ));
        }
        // 9: the payload decodes exactly.
        let mut c = Cur { b: rec, pos: 12, unwritten: vec![] };
        let out = match kind {
            KIND_EOS => Rec::EndOfSegment,
            KIND_PUT => Rec::Put(Msg { replaces: version == VERSION_CARRY, ..c.msg()? }),
            KIND_TRANSITION => {
                let linked =
                    [VERSION_LINKED, VERSION_RESCHEDULE, VERSION_TOUCH, VERSION_ERROR].contains(&version);
                let t = Rec::Transition {
                    msg_offset: c.u64()?,
                    id_hash: c.u64()?,
                    seq: c.u32()?,
                    prev_state: c.enum_u8("state", 1..=6)?,
                    state: c.enum_u8("state", 1..=6)?,
                    cause: c.enum_u8("cause", 1..=10)?,
                    home: c.enum_u8("home", 0..=1)?,
                    attempt: c.u32()?,
                    time_ms: c.u64()?,
                    deliver_at_ms: c.u64()?,
                    route: c.route()?,
                    due_ms: match version {
                        VERSION_CARRY => Some(c.u64()?),
                        _ if linked => Some(c.u64()?).filter(|d| *d != 0),
                        _ => None,
                    },
                    prev_offset: if linked { Some(c.u64()?) } else { None },
                    settings: if version == VERSION_RESCHEDULE { Some((c.u64()?, c.u32()?)) } else { None },
                    error: if version == VERSION_ERROR { Some(c.error()?) } else { None },
                };
                if let Rec::Transition { cause, .. } = t {
                    if (cause == CAUSE_RESCHEDULE) != (version == VERSION_RESCHEDULE)
                        || (cause == CAUSE_TOUCH) != (version == VERSION_TOUCH)
                        || (version == VERSION_ERROR && ![CAUSE_NACK, CAUSE_DEAD_LETTER].contains(&cause))
                    {
                        return Err(format!(
                            "cause {cause} with record version {version} (a Reschedule is 5, a Touch 6, \
                             7 only a Nack or DeadLetter)"
                        ));
                    }
                }
                t
            }
            KIND_HOP => Rec::Hop {
                msg_offset: c.u64()?,
                id_hash: c.u64()?,
                seq: c.u32()?,
                target_ms: c.u64()?,
                route: c.route()?,
            },
            KIND_PUSH => {
                let target = c.enum_u8("push target", 0..=2)?;
                let (time_ms, timeout_ms, max_in_flight) = (c.u64()?, c.u32()?, c.u32()?);
                let mut field = |max: usize| -> Result<Vec<u8>, String> {
                    let n = c.u16()? as usize;
                    if n > max {
                        return Err(format!("push field of {n} bytes, more than {max}"));
                    }
                    Ok(c.take(n)?.to_vec())
                };
                let (topic, url, subject, secret) = (field(255)?, field(2048)?, field(255)?, field(1024)?);
                if topic.is_empty() || (target != 0 && url.is_empty()) {
                    return Err("push record without a topic or url".into());
                }
                Rec::Push { target, time_ms, timeout_ms, max_in_flight, topic, url, subject, secret }
            }
            KIND_FLOW => {
                let (time_ms, max_per_second, burst, max_reserved) = (c.u64()?, c.u32()?, c.u32()?, c.u32()?);
                let n = c.u16()? as usize;
                let topic = c.take(n)?.to_vec();
                if topic.is_empty() || topic.len() > 255 {
                    return Err(format!("flow topic of {} bytes", topic.len()));
                }
                if [max_per_second, burst, max_reserved].iter().any(|v| *v > 1_000_000)
                    || (burst == 0) != (max_per_second == 0)
                {
                    return Err(format!("flow limits {max_per_second}/{burst}/{max_reserved}"));
                }
                Rec::Flow { time_ms, max_per_second, burst, max_reserved, topic }
            }
            KIND_PAUSE => Rec::Pause {
                paused: c.enum_u8("pause flag", 0..=1)? == 1,
                time_ms: c.u64()?,
                topic: {
                    let n = c.u16()? as usize;
                    let t = c.take(n)?.to_vec();
                    if t.is_empty() || t.len() > 255 {
                        return Err(format!("pause topic of {} bytes", t.len()));
                    }
                    t
                },
            },
            _ => Rec::Carry {
                prev_msg_offset: c.u64()?,
                seq: c.u32()?,
                attempt: c.u32()?,
                state: c.enum_u8("state", 1..=6)?,
                home: c.enum_u8("home", 0..=1)?,
                time_ms: c.u64()?,
                deliver_at_ms: c.u64()?,
                msg: c.msg()?,
                last_error: if version == VERSION_ERROR {
                    Some((c.u64()?, c.u32()?, c.error()?))
                } else {
                    None
                },
            },
        };
        if c.pos != len {
            return Err(format!("{} trailing bytes", len - c.pos));
        }
        Ok(Some((out, len, c.unwritten)))
    }

    // ---- commit log -------------------------------------------------------------------------

    /// One record of the log with its global offset.
    #[derive(Debug, Clone)]
    pub struct LogRec {
        pub offset: u64,
        pub len: u32,
        pub rec: Rec,
    }

    /// Every record of the log, in order (end-of-segment markers excluded).
    pub struct Log {
        pub records: Vec<LogRec>,
        pub by_offset: HashMap<u64, usize>,
        /// The first segment's base: offsets below it were reclaimed (references to them are stale).
        pub start: u64,
        /// One past the last record.
        pub end: u64,
        /// Segment bases (file names), ascending.
        pub bases: Vec<u64>,
        /// Segment file sizes, in the order of `bases`.
        pub sizes: Vec<u64>,
        /// Global offsets of the EndOfSegment markers.
        pub markers: Vec<u64>,
        pub segments: usize,
        pub end_of_segment_markers: usize,
    }

    /// Walks every segment of `commitlog/`, checking names, sizes, frames and the zero tails.
    pub fn read_log(dir: &Path) -> Log {
        let segs = numbered(&dir.join("commitlog"), 20);
        assert!(!segs.is_empty(), "no commit-log segment");
        let mut log = Log {
            records: vec![],
            by_offset: HashMap::new(),
            start: segs[0].0,
            end: 0,
            bases: segs.iter().map(|(base, _)| *base).collect(),
            sizes: vec![],
            markers: vec![],
            segments: segs.len(),
            end_of_segment_markers: 0,
        };
        // Reclaim deletes segments from the front, so the first one may start anywhere; from there
        // on each starts where the previous one ends.
        let mut expect_base = log.start;
        let mut ended = false;
        for (i, (base, path)) in segs.iter().enumerate() {
            let bytes = fs::read(path).unwrap();
            assert_eq!(*base, expect_base, "segment {} does not follow the previous one", path.display());
            expect_base = base + bytes.len() as u64;
            log.sizes.push(bytes.len() as u64);
            let last = i + 1 == segs.len();
            if ended {
                // "The next segment is made ahead": only zeroes, past the end of the log.
                assert!(last && all_zero(&bytes), "segment {} after the end of data", path.display());
                break;
            }
            let mut pos = 0usize;
            loop {
                let at = base + pos as u64;
                match parse_record_as_written(&bytes[pos..]) {
                    Ok(None) => {
                        assert!(
                            last || i + 2 == segs.len(),
                            "end of data at {at} before the last two segments"
                        );
                        ended = true;
                        assert!(all_zero(&bytes[pos..]), "non-zero bytes after the end of data at {at}");
                        log.end = at;
                        break;
                    }
                    Ok(Some((Rec::EndOfSegment, len))) => {
                        assert_eq!(len, 12, "end-of-segment marker at {at} is not 12 bytes");
                        assert!(!last, "end-of-segment marker in the last segment at {at}");
                        assert!(all_zero(&bytes[pos + 12..]), "non-zero bytes after the marker at {at}");
                        log.end_of_segment_markers += 1;
                        log.markers.push(at);
                        break;
                    }
                    Ok(Some((rec, len))) => {
                        log.by_offset.insert(at, log.records.len());
                        log.records.push(LogRec { offset: at, len: len as u32, rec });
                        pos += len;
                    }
                    Err(e) => panic!("invalid record at global offset {at} ({}): {e}", path.display()),
                }
            }
        }
        log
    }

    /// The EndOfSegment and tail-reserve rules, for a log whose every run had `segment_bytes`: each
    /// record leaves room for a marker after it, each message (Put, Carry) not at a segment's start
    /// also the tail reserve, and the record after a marker did not fit before it.
    pub fn check_segment_fill(log: &Log, segment_bytes: u64) {
        let reserve = (segment_bytes / 16).min(4 << 20);
        let message = |r: &Rec| matches!(r, Rec::Put(_) | Rec::Carry { .. });
        let segment = |at: u64| {
            let i = log.bases.partition_point(|b| *b <= at) - 1;
            (log.bases[i], log.sizes[i])
        };
        for r in &log.records {
            let (base, size) = segment(r.offset);
            let (p, need) = (r.offset - base, u64::from(r.len) + 12);
            assert!(p + need <= size, "record at {} leaves no room for an EndOfSegment", r.offset);
            if message(&r.rec) && p > 0 {
                assert!(
                    p + need + reserve <= size,
                    "message at {} eats into the segment's tail reserve of {reserve} bytes",
                    r.offset
                );
            }
        }
        for &at in &log.markers {
            let (base, size) = segment(at);
            let next = base + size;
            let Some(&i) = log.by_offset.get(&next) else {
                assert!(log.markers.contains(&next), "nothing follows the marker at {at}");
                continue;
            };
            let r = &log.records[i];
            let keep = if message(&r.rec) { reserve } else { 0 };
            assert!(
                (at - base) + u64::from(r.len) + 12 + keep > size,
                "marker at {at}, yet the record at {next} would have fit before it"
            );
        }
    }

    // ---- replay (the document's dispatch rules) ----------------------------------------------

    /// A queue, ordered as the checkpoint orders them: levels by duration, then topics by name.
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum QKey {
        Level(u64),
        Topic(String),
    }

    /// A consume-queue entry: `(log_offset, size, tag)`.
    pub type Entry = (u64, u32, u64);

    /// What an index slot must hold.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Slot {
        pub hash: u64,
        pub msg_offset: u64,
        pub last_offset: u64,
        pub seq: u32,
        pub attempt: u16,
        pub state: u8,
        pub dead_letter_home: bool,
        /// Length of the record at `msg_offset`.
        pub len: u32,
    }

    /// The derived state a replay of the log predicts.
    #[derive(Default)]
    pub struct Model {
        /// Slots by `msg_offset` (the message's newest Put or Carry), expired messages included.
        pub slots: BTreeMap<u64, Slot>,
        pub queues: BTreeMap<QKey, Vec<Entry>>,
        pub reserved: BTreeMap<String, u64>,
        pub dead: BTreeMap<String, u64>,
        /// Id → offset of the newest Put or Carry with that id.
        pub ids: HashMap<Vec<u8>, u64>,
        pub causes_seen: BTreeSet<u8>,
        pub hops: usize,
        pub carries: usize,
        /// Routed Transitions and Hops whose message lies below the log's start. Dispatch skips them,
        /// so they have a queue entry only if they were dispatched before the segment went (a
        /// running broker), not if the queues were rebuilt since.
        pub skipped: BTreeSet<u64>,
        /// A message record below the log's start that a Carry replaced → that Carry's offset.
        pub carried_from: HashMap<u64, u64>,
        /// `time_ms` of the final Transition of each message that reached Done or Cancelled.
        pub final_ms: HashMap<u64, u64>,
        /// Per live message: the due time a Reserve delivers and a Done or Cancelled keeps (the
        /// `deliver_at_ms` of its latest record that is not a Reserve).
        pub due_ms: HashMap<u64, u64>,
        /// Messages whose id was produced again: they must have expired first.
        pub superseded: Vec<u64>,
        /// Paused topics → offset of the Pause record in effect.
        pub paused: BTreeMap<String, u64>,
        /// Topics with a push subscription → offset of the Push record in effect.
        pub push: BTreeMap<String, u64>,
        /// Topics with flow control → offset of the Flow record in effect.
        pub flow: BTreeMap<String, u64>,
    }

    impl Model {
        fn touch(&mut self, q: QKey) -> &mut Vec<Entry> {
            self.queues.entry(q).or_default()
        }
        fn route(&mut self, route: Route, topic_queue: &str, entry: Entry) {
            match route {
                Route::None => {}
                Route::Topic => self.touch(QKey::Topic(topic_queue.to_string())).push(entry),
                Route::Level { level_ms, due_ms } => {
                    self.touch(QKey::Level(level_ms)).push((entry.0, entry.1, due_ms))
                }
            }
        }
        /// A new message takes `id`: an id comes back only after its previous message expired.
        fn take_id(&mut self, id: &[u8], at: u64) {
            if let Some(old) = self.ids.insert(id.to_vec(), at) {
                let s = &self.slots[&old];
                assert!(is_final(s.state), "id {id:?} at {at} while its message at {old} is live");
                self.superseded.push(old);
            }
        }
    }

    /// The message record (Put or Carry) at `at`.
    pub fn msg_of(log: &Log, at: u64) -> &Msg {
        let i = *log.by_offset.get(&at).unwrap_or_else(|| panic!("no record at {at}"));
        match &log.records[i].rec {
            Rec::Put(m) | Rec::Carry { msg: m, .. } => m,
            other => panic!("record at {at} should be a Put or a Carry, is {other:?}"),
        }
    }

    /// The `deliver_at_ms` a Put, Transition or Carry holds.
    fn deliver_at_of(rec: &Rec) -> u64 {
        match rec {
            Rec::Put(m) => m.deliver_at_ms,
            Rec::Transition { deliver_at_ms, .. } | Rec::Carry { deliver_at_ms, .. } => *deliver_at_ms,
            other => panic!("{other:?} is no message's record"),
        }
    }

    /// A Put's due time and route from its request and `created_ms`, by the document's table of
    /// times (delay_policy chain, the default): `created_ms` is the clock rounded down, and a delay
    /// or a level counts from it rounded up (the same millisecond, or the next).
    fn check_put_plan(levels: &[u64], o: u64, m: &Msg) {
        let now = m.created_ms;
        let ready_now = (m.deliver_at_ms, m.route) == (now, Route::Topic);
        let rounded_up = |from: Option<u64>| from.is_some_and(|f| f == now || f == now + 1);
        match (m.request_kind, m.request_value) {
            (0, 0) | (1, 0) => assert!(ready_now, "put at {o}: ready at once, due at created_ms"),
            (0, v) => panic!("put at {o}: request_kind 0 with value {v}"),
            (1, d) => {
                let from = m.deliver_at_ms.checked_sub(d);
                assert!(rounded_up(from), "put at {o}: a delay counts from created_ms rounded up: {m:?}");
                assert_eq!(m.route, plan_hop(levels, m.deliver_at_ms - d, d), "put at {o}: a delay's route");
            }
            (2, t) if t <= now => assert!(ready_now, "put at {o}: a time already past is ready at once"),
            (2, t) => {
                assert_eq!(m.deliver_at_ms, t, "put at {o}: due at the time asked for");
                assert_eq!(m.route, plan_hop(levels, now, t - now), "put at {o}: a time's route");
            }
            (3, i) => {
                let l = levels[(i as usize).checked_sub(1).expect("levels count from 1")];
                let from = m.deliver_at_ms.checked_sub(l);
                assert!(rounded_up(from), "put at {o}: a level counts from created_ms rounded up");
                assert_eq!(m.route, Route::Level { level_ms: l, due_ms: m.deliver_at_ms }, "put at {o}");
            }
            (k, _) => panic!("put at {o}: request_kind {k}"),
        }
    }

    /// A Transition's due time and route from its `time_ms`, by the document's table of times.
    fn check_transition_plan(
        levels: &[u64],
        o: u64,
        cause: u8,
        state: u8,
        time_ms: u64,
        deliver_at_ms: u64,
        route: Route,
    ) {
        let (t, d) = (time_ms, deliver_at_ms);
        match (cause, state) {
            (CAUSE_RESERVE | CAUSE_TOUCH, _) => {
                assert!(d > t, "reserve at {o}: expires after it was made");
                assert_eq!(route, plan_hop(levels, t, d - t), "reserve at {o}: the expiry timer's route");
            }
            // Only a nack with a delay or a reschedule makes a message Delayed; a delay counts
            // from the clock rounded up (a reschedule to a time, from the clock itself).
            (_, STATE_DELAYED) => assert!(
                [t, t + 1].iter().any(|&from| d > from && route == plan_hop(levels, from, d - from)),
                "transition at {o}: due {d} by {route:?} is no delay counted from {t} rounded up"
            ),
            (CAUSE_DUE, _) => {
                assert!(d <= t, "due at {o}: fired before its time");
                assert_eq!(route, Route::Topic, "due at {o}");
            }
            // A nack without delay, an expiry, a dead-lettering, a redrive, a reschedule to now: due
            // at the change.
            (_, STATE_READY | STATE_DEAD) => {
                assert_eq!((d, route), (t, Route::Topic), "transition at {o}: ready at its time_ms")
            }
            _ => assert_eq!(route, Route::None, "transition at {o} to a final state"),
        }
    }

    /// Replays the log from its first record, checking the cross-record rules as it goes.
    pub fn replay(log: &Log, levels: &[u64]) -> Model {
        let mut m = Model::default();
        for l in levels {
            m.touch(QKey::Level(*l));
        }
        // Transitions and Hops that name a message record below the log's start, by that offset.
        let mut orphans: BTreeMap<u64, Vec<&LogRec>> = BTreeMap::new();
        for r in &log.records {
            let (o, s) = (r.offset, r.len);
            match &r.rec {
                Rec::Put(msg) => {
                    assert!(!msg.id.is_empty() && !msg.topic.is_empty(), "empty id or topic at {o}");
                    assert_ne!(msg.route, Route::None, "a Put without a queue entry at {o}");
                    check_put_plan(levels, o, msg);
                    if msg.replaces {
                        // The message the id named is final (its Cancel came first) and leaves the index.
                        if let Some(old) = m.ids.remove(&msg.id) {
                            let s = m.slots.remove(&old).expect("the replaced message's slot");
                            assert!(is_final(s.state), "a replacing Put at {o} met a live message at {old}");
                        }
                    }
                    m.take_id(&msg.id, o);
                    let state = if msg.route == Route::Topic { STATE_READY } else { STATE_DELAYED };
                    let slot = Slot {
                        hash: id_hash(&msg.id),
                        msg_offset: o,
                        last_offset: o,
                        seq: 0,
                        attempt: 0,
                        state,
                        dead_letter_home: false,
                        len: s,
                    };
                    m.slots.insert(o, slot);
                    m.due_ms.insert(o, msg.deliver_at_ms);
                    m.route(msg.route, &utf8(&msg.topic), (o, s, msg.deliver_at_ms));
                }
                Rec::Transition {
                    msg_offset,
                    id_hash: h,
                    seq,
                    prev_state,
                    state,
                    cause,
                    home,
                    attempt,
                    time_ms,
                    deliver_at_ms,
                    route,
                    due_ms,
                    prev_offset,
                    settings,
                    error: _,
                } => {
                    assert!(msg_offset < &o, "transition at {o} points forward");
                    if let Some((ttr, max)) = settings {
                        assert!(*ttr >= 1 && *max >= 1, "reschedule at {o}: settings {settings:?}");
                    }
                    assert_eq!(
                        due_ms.is_some(),
                        [CAUSE_RESERVE, CAUSE_REDRIVE, CAUSE_TOUCH].contains(cause),
                        "transition at {o}: a due time exactly for a Reserve or a Redrive (record version 2)"
                    );
                    if *cause == CAUSE_REDRIVE {
                        assert_eq!(
                            (*prev_state, *state, *home, *attempt, *due_ms),
                            (STATE_DEAD, STATE_READY, 0, 0, Some(*deliver_at_ms)),
                            "redrive at {o}: Dead in the dead-letter topic to Ready at home, attempts reset, due now"
                        );
                        let was = m.slots.get(msg_offset).is_none_or(|s| s.dead_letter_home);
                        assert!(was, "redrive at {o} of a message not dead-lettered");
                    }
                    check_transition_plan(levels, o, *cause, *state, *time_ms, *deliver_at_ms, *route);
                    m.causes_seen.insert(*cause);
                    if *msg_offset < log.start {
                        // Its message was carried forward or expired: no index change, no counter,
                        // no entry in a replay.
                        orphans.entry(*msg_offset).or_default().push(r);
                        if *route != Route::None {
                            m.skipped.insert(o);
                        }
                        continue;
                    }
                    let msg = msg_of(log, *msg_offset);
                    assert_eq!(*h, id_hash(&msg.id), "transition at {o}: id_hash is not the hash of the id");
                    let topic = utf8(&msg.topic);
                    let slot = m.slots.get_mut(msg_offset).unwrap_or_else(|| {
                        panic!("transition at {o} names {msg_offset}, where its message no longer lives")
                    });
                    assert_eq!(*seq, slot.seq + 1, "transition at {o}: seq is not dense");
                    assert_eq!(
                        *prev_offset,
                        Some(slot.last_offset),
                        "transition at {o}: its link is not the message's previous record"
                    );
                    assert_eq!(*prev_state, slot.state, "transition at {o}: prev_state is not the state");
                    slot.last_offset = o;
                    slot.seq = *seq;
                    slot.attempt = (*attempt).min(u32::from(u16::MAX)) as u16;
                    slot.state = *state;
                    slot.dead_letter_home = *home == HOME_DEAD_LETTER;
                    if is_final(*state) {
                        m.final_ms.insert(*msg_offset, *time_ms);
                    }
                    // A Reserve records the due time it delivers and an ack or cancel keeps it, so
                    // GET shows the same deliver_at_ms before and after.
                    let due = m.due_ms.get(msg_offset).copied();
                    if *cause == CAUSE_REDRIVE {
                        m.due_ms.insert(*msg_offset, *deliver_at_ms);
                    } else if let Some(d) = due_ms {
                        assert_eq!(Some(*d), due, "transition at {o}: the reserved delivery's due time");
                        assert!(d <= time_ms, "transition at {o}: delivered before it was due");
                    } else if is_final(*state) {
                        assert_eq!(
                            Some(*deliver_at_ms),
                            due,
                            "transition at {o}: a final state keeps the due time"
                        );
                    } else {
                        m.due_ms.insert(*msg_offset, *deliver_at_ms);
                    }
                    let queue =
                        if *home == HOME_DEAD_LETTER { format!("{topic}.dlq") } else { topic.clone() };
                    let prev_queue = match *cause {
                        CAUSE_DEAD_LETTER => topic.clone(),
                        CAUSE_REDRIVE => format!("{topic}.dlq"),
                        _ => queue.clone(),
                    };
                    if *prev_state == STATE_RESERVED {
                        m.touch(QKey::Topic(prev_queue.clone()));
                        let r = m.reserved.entry(prev_queue).or_default();
                        *r = r.saturating_sub(1);
                    }
                    if *state == STATE_RESERVED {
                        m.touch(QKey::Topic(queue.clone()));
                        *m.reserved.entry(queue.clone()).or_default() += 1;
                    }
                    if *cause == CAUSE_DEAD_LETTER {
                        m.touch(QKey::Topic(topic.clone()));
                        *m.dead.entry(topic.clone()).or_default() += 1;
                    }
                    m.route(*route, &queue, (o, s, *deliver_at_ms));
                }
                Rec::Hop { msg_offset, id_hash: h, seq, target_ms, route } => {
                    assert!(msg_offset < &o, "hop at {o} points forward");
                    let Route::Level { due_ms, .. } = route else {
                        panic!("hop at {o} is not routed to a level")
                    };
                    assert!(due_ms <= target_ms, "hop at {o} is due after its timer's final time");
                    // The largest level that fits what is left of the timer at the time the hop was
                    // planned (due - level), or the smallest one landing on the final time.
                    let Route::Level { level_ms, .. } = *route else { unreachable!() };
                    let planned = due_ms.checked_sub(level_ms).expect("a hop planned before 1970");
                    assert_eq!(
                        *route,
                        plan_hop(levels, planned, target_ms - planned),
                        "hop at {o}: its level"
                    );
                    m.hops += 1;
                    if *msg_offset < log.start {
                        orphans.entry(*msg_offset).or_default().push(r);
                        m.skipped.insert(o);
                        continue;
                    }
                    let msg = msg_of(log, *msg_offset);
                    assert_eq!(*h, id_hash(&msg.id), "hop at {o}: id_hash is not the hash of the id");
                    let slot = m.slots.get(msg_offset).unwrap_or_else(|| {
                        panic!("hop at {o} names {msg_offset}, where its message no longer lives")
                    });
                    assert!(*seq <= slot.seq, "hop at {o} continues a future timer");
                    m.route(*route, "", (o, s, 0));
                }
                Rec::Carry {
                    prev_msg_offset: prev,
                    seq,
                    attempt,
                    state,
                    home,
                    time_ms,
                    deliver_at_ms,
                    msg,
                    last_error,
                } => {
                    assert!(prev < &o, "carry at {o} points forward");
                    if let Some((at, failed, _)) = last_error {
                        assert!(
                            failed <= attempt && at <= time_ms,
                            "carry at {o}: a failure after the carry"
                        );
                    }
                    assert!(!msg.id.is_empty() && !msg.topic.is_empty(), "empty id or topic at {o}");
                    let dead_letter_home = *home == HOME_DEAD_LETTER;
                    match *state {
                        STATE_DELAYED => {
                            let want = plan_hop(levels, *time_ms, deliver_at_ms.saturating_sub(*time_ms));
                            assert_eq!(msg.route, want, "carry at {o}: a Delayed message's route");
                        }
                        STATE_READY | STATE_DEAD => {
                            assert_eq!(msg.route, Route::Topic, "carry at {o}: a {state} message's route");
                            assert!(deliver_at_ms <= time_ms, "carry at {o}: became ready after the carry");
                            assert_eq!(
                                *state == STATE_DEAD,
                                dead_letter_home,
                                "carry at {o}: Dead exactly when home is DeadLetter"
                            );
                        }
                        // A final message kept for done_retention: no entry, and its retention
                        // still counts from when it became final.
                        STATE_DONE | STATE_CANCELLED => {
                            assert_eq!(msg.route, Route::None, "carry at {o}: a final message's route");
                            m.final_ms.insert(o, *time_ms);
                        }
                        other => panic!("carry at {o} of a message in state {other}"),
                    }
                    let carried = Slot {
                        hash: id_hash(&msg.id),
                        msg_offset: o,
                        last_offset: o,
                        seq: *seq,
                        attempt: (*attempt).min(u32::from(u16::MAX)) as u16,
                        state: *state,
                        dead_letter_home,
                        len: s,
                    };
                    if *prev >= log.start {
                        let before = msg_of(log, *prev);
                        assert_eq!(
                            &Msg { route: before.route, ..msg.clone() },
                            before,
                            "carry at {o} does not repeat the message at {prev}"
                        );
                        let old = m
                            .slots
                            .remove(prev)
                            .unwrap_or_else(|| panic!("carry at {o}: no message lives at {prev}"));
                        assert!(old.last_offset < o, "carry at {o}: the slot is ahead of it");
                        let last = &log.records[log.by_offset[&old.last_offset]].rec;
                        assert_eq!(
                            *deliver_at_ms,
                            deliver_at_of(last),
                            "carry at {o}: deliver_at_ms is not that of the message's last record ({})",
                            old.last_offset
                        );
                        assert_eq!(
                            Slot { msg_offset: o, last_offset: o, len: s, ..old },
                            carried,
                            "carry at {o} does not record the state of the message at {prev}"
                        );
                        assert_eq!(m.ids.insert(msg.id.clone(), o), Some(*prev), "carry at {o}: id");
                    } else {
                        assert!(m.carried_from.insert(*prev, o).is_none(), "two carries replace {prev}");
                        m.take_id(&msg.id, o);
                    }
                    assert!(m.slots.insert(o, carried).is_none());
                    m.due_ms.remove(prev);
                    m.due_ms.insert(o, *deliver_at_ms);
                    m.carries += 1;
                    let topic = utf8(&msg.topic);
                    let queue = if dead_letter_home { format!("{topic}.dlq") } else { topic };
                    m.route(msg.route, &queue, (o, s, *deliver_at_ms));
                }
                Rec::Flow { time_ms, max_per_second, burst, max_reserved, topic } => {
                    assert!(*time_ms > 0, "flow at {o} without a time");
                    // All three 0 removes the topic's flow control; anything else is the one in effect.
                    if *max_per_second == 0 && *burst == 0 && *max_reserved == 0 {
                        m.flow.remove(&utf8(topic));
                    } else {
                        m.flow.insert(utf8(topic), o);
                    }
                }
                Rec::Pause { paused, topic, time_ms } => {
                    assert!(*time_ms > 0, "pause at {o} without a time");
                    // The latest Pause of a topic decides; a resume needs no record to stay so.
                    let topic = utf8(topic);
                    if *paused {
                        m.paused.insert(topic, o);
                    } else {
                        m.paused.remove(&topic);
                    }
                }
                Rec::Push { target, time_ms, timeout_ms, max_in_flight, topic, url, subject, secret } => {
                    assert!(*time_ms > 0, "push at {o} without a time");
                    let topic = utf8(topic);
                    if *target == 0 {
                        assert!(
                            url.is_empty() && subject.is_empty() && secret.is_empty(),
                            "push removal at {o}"
                        );
                        m.push.remove(&topic);
                    } else {
                        assert!(*timeout_ms > 0 && *max_in_flight > 0, "push at {o}: limits");
                        let scheme = String::from_utf8_lossy(url);
                        assert!(
                            *target != 1 || scheme.starts_with("http://") || scheme.starts_with("https://"),
                            "webhook at {o}: {scheme}"
                        );
                        m.push.insert(topic, o);
                    }
                }
                Rec::EndOfSegment => unreachable!("markers are not listed"),
            }
        }

        // Records naming a reclaimed message record: they all belong to one message, which was
        // either carried forward (they precede the Carry, which records the state they left) or
        // expired (they end in a final state).
        for (p, recs) in &orphans {
            let carry = m.carried_from.get(p).map(|c| &log.records[log.by_offset[c]]);
            let hash = match carry {
                Some(LogRec { rec: Rec::Carry { msg, .. }, .. }) => id_hash(&msg.id),
                _ => match recs[0].rec {
                    Rec::Transition { id_hash, .. } | Rec::Hop { id_hash, .. } => id_hash,
                    _ => unreachable!(),
                },
            };
            let mut last: Option<(u32, u8, u8, u32, u64)> = None;
            for r in recs {
                if let Some(c) = carry {
                    assert!(
                        r.offset < c.offset,
                        "record at {} names {p} after the Carry at {}",
                        r.offset,
                        c.offset
                    );
                }
                match r.rec {
                    Rec::Hop { id_hash: h, .. } => {
                        assert_eq!(h, hash, "hop at {}: another message", r.offset)
                    }
                    Rec::Transition {
                        id_hash: h,
                        seq,
                        prev_state,
                        state,
                        home,
                        attempt,
                        deliver_at_ms,
                        ..
                    } => {
                        assert_eq!(h, hash, "transition at {}: another message", r.offset);
                        if let Some((s, st, ..)) = last {
                            assert_eq!(seq, s + 1, "transition at {}: seq is not dense", r.offset);
                            assert_eq!(prev_state, st, "transition at {}: prev_state", r.offset);
                        }
                        last = Some((seq, state, home, attempt, deliver_at_ms));
                    }
                    _ => unreachable!(),
                }
            }
            match (carry, last) {
                (
                    Some(LogRec {
                        offset,
                        rec: Rec::Carry { seq, state, home, attempt, deliver_at_ms, .. },
                        ..
                    }),
                    Some(t),
                ) => assert_eq!(
                    (*seq, *state, *home, *attempt, *deliver_at_ms),
                    t,
                    "carry at {offset}: the state it carries, and its last record's deliver_at_ms"
                ),
                (None, Some((_, state, ..))) => {
                    assert!(
                        is_final(state),
                        "the message at {p} is gone, yet its last transition left it {state}"
                    )
                }
                _ => {}
            }
        }

        // Level tags: up to 1 ms below an earlier entry's (planned from the clock rounded up, then
        // down), on the smallest level up to its duration (sub-level remainders).
        for (key, entries) in &m.queues {
            let QKey::Level(l) = key else { continue };
            let slack = if *l <= levels[0] { *l } else { 1 };
            let mut highest = 0;
            for &(off, _, tag) in entries {
                assert!(
                    tag + slack >= highest,
                    "{key:?}: entry at {off} due {tag}, more than {slack} ms below {highest}"
                );
                highest = highest.max(tag);
            }
        }
        m
    }

    // ---- consume queues ---------------------------------------------------------------------

    /// The files of one queue.
    pub struct Queue {
        /// Index of the first entry on disk (the first file's name); None when no file is left.
        pub first: Option<u64>,
        pub files: usize,
        /// The written entries from `first` on.
        pub entries: Vec<Entry>,
    }

    /// The written entries of the queue in `dir`.
    pub fn read_queue(dir: &Path) -> Queue {
        let files = numbered(dir, 20);
        let mut entries = vec![];
        let mut per_file = None;
        let mut ended = false;
        for (k, (name, path)) in files.iter().enumerate() {
            let bytes = fs::read(path).unwrap();
            assert!(bytes.len() % 20 == 0, "{}: size not a multiple of 20", path.display());
            let n = (bytes.len() / 20) as u64;
            if k + 1 < files.len() {
                // Every file but the last is full, so it gives N.
                assert!(n > 0, "{}: an empty file before the last", path.display());
                assert_eq!(*per_file.get_or_insert(n), n, "{}: full files differ in size", path.display());
            } else if let Some(full) = per_file {
                assert!(n <= full, "{}: the last file is longer than N = {full} entries", path.display());
            }
            // Reclaim deletes files from the front: consecutive j·N, (j+1)·N, ... from any j.
            if let Some(n) = per_file {
                assert_eq!(
                    files[0].0 % n,
                    0,
                    "{}: the first file is not named j·N (N = {n})",
                    path.display()
                );
                assert_eq!(
                    *name,
                    files[0].0 + k as u64 * n,
                    "{}: files must be consecutive j·N, (j+1)·N, ...",
                    path.display()
                );
            }
            for e in bytes.chunks_exact(20) {
                let (off, size, tag) = (le64(e, 0), le32(e, 8), le64(e, 12));
                if size == 0 {
                    assert!(all_zero(e), "{}: unwritten entry with non-zero bytes", path.display());
                    ended = true;
                } else {
                    assert!(!ended, "{}: written entry after an unwritten one", path.display());
                    entries.push((off, size, tag));
                }
            }
        }
        Queue { first: files.first().map(|f| f.0), files: files.len(), entries }
    }

    /// The topic of the message a Transition names, if its record is still somewhere in the log.
    fn topic_of(log: &Log, model: &Model, msg_offset: u64) -> Option<String> {
        let at = if msg_offset >= log.start { msg_offset } else { *model.carried_from.get(&msg_offset)? };
        Some(utf8(&msg_of(log, at).topic))
    }

    /// Checks each entry against the record it points at, per the queue family.
    pub fn check_queue_entries(log: &Log, model: &Model, key: &QKey, entries: &[Entry]) {
        for w in entries.windows(2) {
            assert!(w[0].0 < w[1].0, "{key:?}: entries do not ascend in log offset");
        }
        for &(off, size, tag) in entries {
            if off < log.start {
                continue; // stale: its record was reclaimed
            }
            let i =
                *log.by_offset.get(&off).unwrap_or_else(|| panic!("{key:?}: {off} is not a record boundary"));
            let r = &log.records[i];
            assert_eq!(size, r.len, "{key:?}: entry size is not the record length at {off}");
            match (key, &r.rec) {
                (QKey::Level(l), Rec::Put(Msg { route, .. }))
                | (QKey::Level(l), Rec::Carry { msg: Msg { route, .. }, .. })
                | (QKey::Level(l), Rec::Transition { route, .. })
                | (QKey::Level(l), Rec::Hop { route, .. }) => {
                    assert_eq!(*route, Route::Level { level_ms: *l, due_ms: tag }, "{key:?} at {off}");
                }
                (QKey::Topic(t), Rec::Put(msg)) => {
                    assert_eq!(msg.route, Route::Topic, "{key:?} at {off}");
                    assert_eq!(t.as_bytes(), &msg.topic[..], "{key:?}: Put of another topic at {off}");
                    assert_eq!(tag, msg.deliver_at_ms, "{key:?}: tag at {off}");
                }
                (QKey::Topic(t), Rec::Carry { msg, home, deliver_at_ms, .. }) => {
                    assert_eq!(msg.route, Route::Topic, "{key:?} at {off}");
                    let topic = utf8(&msg.topic);
                    let want = if *home == HOME_DEAD_LETTER { format!("{topic}.dlq") } else { topic };
                    assert_eq!(t, &want, "{key:?}: carry of another queue at {off}");
                    assert_eq!(tag, *deliver_at_ms, "{key:?}: tag at {off}");
                }
                (QKey::Topic(t), Rec::Transition { route, msg_offset, home, deliver_at_ms, .. }) => {
                    assert_eq!(*route, Route::Topic, "{key:?} at {off}");
                    // An expired message's topic went with its Put.
                    if let Some(topic) = topic_of(log, model, *msg_offset) {
                        let want = if *home == HOME_DEAD_LETTER { format!("{topic}.dlq") } else { topic };
                        assert_eq!(t, &want, "{key:?}: transition of another queue at {off}");
                    }
                    assert_eq!(tag, *deliver_at_ms, "{key:?}: tag at {off}");
                }
                (k, rec) => panic!("{k:?}: entry at {off} points at {rec:?}"),
            }
        }
    }

    /// Whether a topic-queue entry is live by the document's rule: its record's message still has
    /// the record's seq and is Ready or Dead.
    pub fn topic_entry_live(log: &Log, model: &Model, off: u64) -> bool {
        let Some(&i) = log.by_offset.get(&off).filter(|_| off >= log.start) else { return false };
        let (msg, seq) = match &log.records[i].rec {
            Rec::Put(_) => (off, 0),
            Rec::Carry { seq, .. } => (off, *seq),
            Rec::Transition { msg_offset, seq, .. } | Rec::Hop { msg_offset, seq, .. } => (*msg_offset, *seq),
            Rec::Pause { .. } | Rec::Push { .. } | Rec::Flow { .. } | Rec::EndOfSegment => return false,
        };
        model.slots.get(&msg).is_some_and(|s| s.seq == seq && matches!(s.state, STATE_READY | STATE_DEAD))
    }

    /// Checks the queue's entries against the replay: past the entries of reclaimed records (and
    /// the optional ones of skipped records), the queue ends with exactly the entries the replay
    /// implies. Entries may be missing from its front only if they were in files reclaim deleted,
    /// or, for a topic, if it was forgotten once emptied and started again at entry 0 (then none of
    /// them is live); returns true in that second case.
    pub fn check_queue_against_replay(log: &Log, model: &Model, key: &QKey, q: &Queue) -> bool {
        let want = model.queues.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let stale = q.entries.iter().take_while(|e| e.0 < log.start).count();
        let got: Vec<Entry> =
            q.entries[stale..].iter().filter(|e| !model.skipped.contains(&e.0)).copied().collect();
        let missing = want.len().saturating_sub(got.len());
        assert_eq!(got, want[missing..], "{key:?}: entries differ from the replay of the log");
        let first = q.first.unwrap_or(u64::MAX);
        if missing == 0 || (stale == 0 && first > 0 && missing as u64 <= first) {
            return false;
        }
        let restarted = matches!(key, QKey::Topic(_))
            && want[..missing].iter().all(|e| !topic_entry_live(log, model, e.0));
        assert!(
            restarted,
            "{key:?}: {missing} entries the log implies are missing, not in deleted files (first {first}) \
             nor read before the topic was forgotten"
        );
        true
    }

    // ---- id index ---------------------------------------------------------------------------

    /// What the index holds.
    pub struct Index {
        pub slots: u64,
        /// Live slots by `msg_offset`.
        pub used: BTreeMap<u64, Slot>,
        /// Messages the replay knows that reclaim expired out of the index.
        pub expired: BTreeSet<u64>,
    }

    /// Byte position of index slot `i`: 4 KiB pages after the header's, 102 slots to a page.
    pub fn index_slot_at(i: u64) -> usize {
        4096 * (1 + i as usize / 102) + 40 * (i as usize % 102)
    }

    /// One parsed index table: slot count and its occupied slots as (position, slot, removed).
    pub struct IndexTable {
        pub slots: u64,
        pub occupied: Vec<(u64, Slot, bool)>,
    }

    /// Parses one index table file, checking its header, slot encoding and probing invariant.
    pub fn read_index_table(path: &Path, log: &Log) -> IndexTable {
        let name = path.display();
        let b = fs::read(path).unwrap();
        assert!(b.len() >= 64, "{name}: index shorter than its header");
        assert_eq!(&b[0..4], b"DLYI", "{name}: index magic");
        assert_eq!(le16(&b, 4), 3, "{name}: index version");
        assert_eq!(le16(&b, 6), 0, "{name}: index reserved bytes");
        let slots = le64(&b, 8);
        assert!(slots.is_power_of_two() && slots >= 64, "{name}: slot count {slots}");
        assert!(all_zero(&b[16..4096]), "{name}: index header reserved bytes and the rest of its page");
        // 4 KiB pages after the header's, each 102 slots of 40 bytes and 16 zero bytes.
        assert_eq!(b.len() as u64, 4096 * (1 + slots.div_ceil(102)), "{name}: index file size");
        for page in (4096..b.len()).step_by(4096) {
            assert!(all_zero(&b[page + 4080..page + 4096]), "{name}: the padding of the page at {page}");
        }
        let slot = |i: u64| &b[index_slot_at(i)..index_slot_at(i) + 40];
        let is_occupied = |i: u64| slot(i)[31] & 1 != 0;
        let mask = slots - 1;
        let mut occupied = Vec::new();
        let mut ids = BTreeSet::new();
        for i in 0..slots {
            let s = slot(i);
            if !is_occupied(i) {
                assert!(all_zero(s), "{name}: empty slot {i} is not all zero");
                continue;
            }
            assert_eq!(s[31] & !0x07, 0, "{name}: slot {i}: unknown flag bits");
            let got = Slot {
                hash: le64(s, 0),
                msg_offset: le64(s, 8),
                last_offset: le64(s, 16),
                seq: le32(s, 24),
                attempt: le16(s, 28),
                state: s[30],
                dead_letter_home: s[31] & 0x02 != 0,
                len: le32(s, 32),
            };
            assert!(all_zero(&s[36..40]), "{name}: slot {i}: reserved bytes");
            let removed = s[31] & 0x04 != 0;
            // A removed slot may outlive its record: reclaim deletes segments of expired messages.
            if !removed || log.by_offset.contains_key(&got.msg_offset) {
                let msg = msg_of(log, got.msg_offset);
                assert_eq!(
                    got.hash,
                    id_hash(&msg.id),
                    "{name}: slot {i}: hash is not the hash of the message's id"
                );
            }
            // Slots never move: every slot from the home slot up to this one is occupied.
            let mut j = got.hash & mask;
            while j != i {
                assert!(is_occupied(j), "{name}: slot {i}: empty slot {j} between its home slot and itself");
                j = (j + 1) & mask;
            }
            assert!(ids.insert(got.msg_offset), "{name}: two slots for the message at {}", got.msg_offset);
            occupied.push((i, got, removed));
        }
        IndexTable { slots, occupied }
    }

    /// Parses `index/ids` (and `index/ids.next` during a resize) and checks the messages they hold
    /// together against the log and the replay: every message has its slot unless it expired,
    /// which only a message final since before `expiry_cutoff_ms` can, in log order of the final
    /// transitions.
    pub fn check_index(dir: &Path, log: &Log, model: &Model, expiry_cutoff_ms: u64) -> Index {
        let old = read_index_table(&dir.join("ids"), log);
        let next_path = dir.join("ids.next");
        let next = next_path.exists().then(|| read_index_table(&next_path, log));
        // The messages: live slots of ids.next, plus live slots of ids that ids.next does not know.
        let mut found = BTreeMap::new();
        let mut known = BTreeSet::new();
        for (_, s, removed) in next.iter().flat_map(|t| &t.occupied) {
            known.insert(s.msg_offset);
            if !removed {
                found.insert(s.msg_offset, s.clone());
            }
        }
        for (_, s, removed) in &old.occupied {
            if !removed && !known.contains(&s.msg_offset) {
                found.insert(s.msg_offset, s.clone());
            }
        }
        for (off, got) in &found {
            assert_eq!(
                model.slots.get(off),
                Some(got),
                "slot for the message at {off} differs from the replay"
            );
        }

        let expired: BTreeSet<u64> = model.slots.keys().filter(|k| !found.contains_key(k)).copied().collect();
        for k in &expired {
            let s = &model.slots[k];
            assert!(is_final(s.state), "the message at {k} (state {}) has no index slot", s.state);
            let at = model.final_ms[k];
            assert!(
                at <= expiry_cutoff_ms,
                "the message at {k}, final at {at}, expired within done_retention"
            );
        }
        let mut finals: Vec<(u64, u64)> = model
            .slots
            .values()
            .filter(|s| is_final(s.state))
            .map(|s| (s.last_offset, s.msg_offset))
            .collect();
        finals.sort();
        // The walk removes final messages in log order of their last record: a prefix of `finals`.
        // Reclaim's scan also removes expired ones it meets in the segments it scans (Reclaim step
        // 2), which it does only up to the first segment still holding an indexed message.
        let walked: BTreeSet<u64> =
            finals.iter().take_while(|f| expired.contains(&f.1)).map(|f| f.1).collect();
        let first_kept = found.keys().min().copied().unwrap_or(u64::MAX);
        let scanned_to = log.bases.iter().copied().find(|b| *b > first_kept).unwrap_or(u64::MAX);
        for k in expired.difference(&walked) {
            assert!(
                *k < scanned_to,
                "the message at {k} expired out of log order, past the segments reclaim scanned (to {scanned_to})"
            );
        }
        for old in &model.superseded {
            assert!(expired.contains(old), "an id came back while its message at {old} was still indexed");
        }
        Index { slots: old.slots.max(next.map_or(0, |t| t.slots)), used: found, expired }
    }

    // ---- checkpoint and clean marker --------------------------------------------------------

    /// One queue record of the checkpoint.
    #[derive(Debug)]
    pub struct CpQueue {
        pub key: QKey,
        pub len: u64,
        pub cursor: u64,
        pub reserved: u64,
        pub dead: u64,
        pub delayed: u64,
        pub ready: u64,
    }

    /// Topics, each with the offset of a record (its Pause, Push or Flow in effect).
    pub type TopicOffsets = BTreeMap<String, u64>;

    /// Parses `checkpoint`: (dispatched, queues, paused topics with their Pause record's offset,
    /// push subscriptions with their Push record's offset, flow control with its Flow record's).
    pub fn read_checkpoint(path: &Path) -> (u64, Vec<CpQueue>, TopicOffsets, TopicOffsets, TopicOffsets) {
        let b = fs::read(path).unwrap();
        // The header, P, S, F and the CRC: a version 4 checkpoint listing nothing.
        assert!(b.len() >= 36, "checkpoint shorter than 36 bytes");
        let (body, crc) = b.split_at(b.len() - 4);
        assert_eq!(crc32(&[body]), le32(crc, 0), "checkpoint crc");
        assert_eq!(&body[0..4], b"DLCK", "checkpoint magic");
        assert_eq!(le16(body, 4), 4, "checkpoint version");
        assert_eq!(le16(body, 6), 0, "checkpoint reserved");
        let dispatched = le64(body, 8);
        let n = le32(body, 16);
        let mut c = Cur { b: body, pos: 20, unwritten: vec![] };
        let mut queues = vec![];
        for _ in 0..n {
            let kind = c.u8().unwrap();
            let len = c.u16().unwrap() as usize;
            let name = String::from_utf8(c.take(len).unwrap().to_vec()).unwrap();
            let key = match kind {
                0 => {
                    assert!(name.bytes().all(|b| b.is_ascii_digit()) && !name.starts_with('0'), "{name}");
                    QKey::Level(name.parse().unwrap())
                }
                1 => QKey::Topic(name),
                k => panic!("checkpoint queue kind {k}"),
            };
            queues.push(CpQueue {
                key,
                len: c.u64().unwrap(),
                cursor: c.u64().unwrap(),
                reserved: c.u64().unwrap(),
                dead: c.u64().unwrap(),
                delayed: c.u64().unwrap(),
                ready: c.u64().unwrap(),
            });
        }
        let mut lists = [BTreeMap::new(), BTreeMap::new(), BTreeMap::new()];
        for list in &mut lists {
            for _ in 0..c.u32().unwrap() {
                let len = c.u16().unwrap() as usize;
                let name = String::from_utf8(c.take(len).unwrap().to_vec()).unwrap();
                assert!(
                    list.insert(name, c.u64().unwrap()).is_none(),
                    "a topic listed twice in the checkpoint"
                );
            }
        }
        assert_eq!(c.pos, body.len(), "checkpoint records do not end at the crc");
        let [paused, push, flow] = lists;
        (dispatched, queues, paused, push, flow)
    }

    /// Checks the receipt key file against its layout; returns the key.
    pub fn read_receipt_key(path: &Path) -> Vec<u8> {
        let b = fs::read(path).unwrap();
        assert_eq!(b.len(), 44, "receipt key size");
        assert_eq!(&b[0..4], b"DLRK", "receipt key magic");
        assert_eq!(le16(&b, 4), 1, "receipt key version");
        assert_eq!(le16(&b, 6), 0, "receipt key reserved");
        assert_eq!(crc32(&[&b[..40]]), le32(&b, 40), "receipt key crc");
        b[8..40].to_vec()
    }

    /// What a version 5 clean-shutdown marker holds.
    pub struct CleanMarker {
        pub log_end: u64,
        pub index_slots: u64,
        pub index_filled: u64,
        pub index_live: u64,
        pub live_bytes: u64,
        /// Per segment: base, bytes of the records it must keep, reserved messages.
        pub segments: Vec<(u64, u64, u64)>,
    }

    /// Parses `clean_shutdown` (version 5, the one delayd writes).
    pub fn read_clean_marker(path: &Path) -> CleanMarker {
        let b = fs::read(path).unwrap();
        assert!(b.len() >= 56, "clean marker size {}", b.len());
        let n = b.len() - 4;
        assert_eq!(crc32(&[&b[..n]]), le32(&b, n), "clean marker crc");
        assert_eq!(&b[0..4], b"DLCS", "clean marker magic");
        assert_eq!(le16(&b, 4), 5, "clean marker version");
        assert_eq!(le16(&b, 6), 0, "clean marker reserved");
        let count = le32(&b, 48) as usize;
        assert_eq!(b.len(), 56 + 24 * count, "clean marker size for {count} segments");
        let segments: Vec<(u64, u64, u64)> = (0..count)
            .map(|i| 52 + 24 * i)
            .map(|at| (le64(&b, at), le64(&b, at + 8), le64(&b, at + 16)))
            .collect();
        assert!(segments.windows(2).all(|w| w[0].0 < w[1].0), "clean marker segments ascend");
        CleanMarker {
            log_end: le64(&b, 8),
            index_slots: le64(&b, 16),
            index_filled: le64(&b, 24),
            index_live: le64(&b, 32),
            live_bytes: le64(&b, 40),
            segments,
        }
    }

    /// Checks the clean marker's counts against the index table and the log: the slots of `ids`
    /// (all zero during a resize), the live Put and Carry records' bytes, and per segment those
    /// bytes plus the Pause, Push and Flow records in effect, and its reserved messages.
    fn check_clean_marker(dir: &Path, log: &Log, model: &Model, index: &Index) {
        let m = read_clean_marker(&dir.join("clean_shutdown"));
        assert_eq!(m.log_end, log.end, "clean marker log_end");
        if dir.join("index/ids.next").exists() {
            assert_eq!(
                (m.index_slots, m.index_filled, m.index_live),
                (0, 0, 0),
                "clean marker index counts in a resize"
            );
        } else {
            let t = read_index_table(&dir.join("index/ids"), log);
            let live = t.occupied.iter().filter(|(_, _, removed)| !removed).count() as u64;
            assert_eq!(
                (m.index_slots, m.index_filled, m.index_live),
                (t.slots, t.occupied.len() as u64, live),
                "clean marker index slots, occupied, live"
            );
        }
        let len_at = |offset: u64| u64::from(log.records[log.by_offset[&offset]].len);
        let base_of = |offset: u64| *log.bases.iter().rev().find(|b| **b <= offset).unwrap();
        let mut segs: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut live_bytes = 0;
        for (offset, slot) in &index.used {
            live_bytes += len_at(*offset);
            let c = segs.entry(base_of(*offset)).or_default();
            c.0 += len_at(*offset);
            c.1 += u64::from(slot.state == STATE_RESERVED);
        }
        for offset in model.paused.values().chain(model.push.values()).chain(model.flow.values()) {
            segs.entry(base_of(*offset)).or_default().0 += len_at(*offset);
        }
        assert_eq!(m.live_bytes, live_bytes, "clean marker live_bytes vs the live slots' records");
        let segs: Vec<(u64, u64, u64)> =
            segs.into_iter().filter(|(_, c)| *c != (0, 0)).map(|(b, (bytes, r))| (b, bytes, r)).collect();
        assert_eq!(m.segments, segs, "clean marker segments (base, bytes, reserved)");
    }

    // ---- the whole directory ----------------------------------------------------------------

    /// What the reader must know about the broker that wrote a directory.
    pub struct Writer<'a> {
        /// Configured delay levels (each has a queue; Carry routes are planned on them).
        pub levels: &'a [u64],
        /// The broker's process id, which `LOCK` holds.
        pub pid: u32,
        /// `done_retention` in ms: only messages final for that long may have left the index.
        pub done_retention_ms: u64,
        /// `segment_bytes` of every run that wrote the log, which sets the tail reserve.
        pub segment_bytes: u64,
    }

    /// What a full check found, for the scenario's own assertions.
    pub struct Report {
        pub log: Log,
        pub model: Model,
        pub index: Index,
        pub queues: BTreeMap<QKey, Queue>,
        pub checkpoint: Vec<CpQueue>,
        /// Queue entries pointing below the log's start (stale: their records were reclaimed).
        pub stale_entries: usize,
        /// Queue entries of records the replay skips (their message lies below the log's start).
        pub skipped_entries: usize,
    }

    /// Parses every file of a cleanly shut down data directory and checks it against the document.
    pub fn check_data_dir(dir: &Path, writer: &Writer) -> Report {
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
        // Only the documented names may exist (no temporaries after a clean shutdown).
        for e in fs::read_dir(dir).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(
                [
                    "LOCK",
                    "clean_shutdown",
                    "checkpoint",
                    "commitlog",
                    "cq",
                    "index",
                    "reserve",
                    "receipt_key"
                ]
                .contains(&name.as_str()),
                "unexpected {name:?} in the data dir"
            );
        }
        let mut index_entries: Vec<String> = fs::read_dir(dir.join("index"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        index_entries.sort();
        assert!(
            index_entries == ["ids"] || index_entries == ["ids", "ids.next"],
            "index/ holds ids, and ids.next during a resize: {index_entries:?}"
        );

        let lock = fs::read_to_string(dir.join("LOCK")).unwrap();
        let pid: u32 = lock.lines().next().unwrap().parse().expect("LOCK starts with a decimal pid");
        assert_eq!(pid, writer.pid, "LOCK holds the pid of the broker that wrote the directory");

        let log = read_log(dir);
        check_segment_fill(&log, writer.segment_bytes);
        let model = replay(&log, writer.levels);

        // Queues on disk: at least the ones the replay touched (exactly those while the log is
        // whole), each ending with the predicted entries.
        let mut queues = BTreeMap::new();
        for e in fs::read_dir(dir.join("cq")).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(name == "level" || name == "topic", "unexpected cq/{name}");
        }
        for (ms, path) in numbered(&dir.join("cq").join("level"), 12) {
            queues.insert(QKey::Level(ms), read_queue(&path));
        }
        if dir.join("cq").join("topic").exists() {
            for e in fs::read_dir(dir.join("cq").join("topic")).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().into_string().unwrap();
                let topic = name.strip_prefix("t-").unwrap_or_else(|| panic!("cq/topic/{name} lacks t-"));
                queues.insert(QKey::Topic(topic.to_string()), read_queue(&e.path()));
            }
        }
        for (key, q) in &queues {
            check_queue_entries(&log, &model, key, &q.entries);
        }
        let disk_keys: Vec<&QKey> = queues.keys().collect();
        let model_keys: Vec<&QKey> = model.queues.keys().collect();
        if log.start == 0 {
            for k in &disk_keys {
                assert!(model.queues.contains_key(k), "{k:?}: a queue directory the log does not imply");
            }
        }
        // A queue the log implies may lack a directory only if it is a topic forgotten once emptied:
        // none of its entries is live.
        let mut restarted: BTreeSet<&QKey> = BTreeSet::new();
        for k in &model_keys {
            if !queues.contains_key(k) {
                assert!(
                    matches!(k, QKey::Topic(_))
                        && model.queues[*k].iter().all(|e| !topic_entry_live(&log, &model, e.0)),
                    "{k:?}: the log implies a queue with live entries that has no directory"
                );
                restarted.insert(k);
            }
        }
        for (key, q) in &queues {
            if check_queue_against_replay(&log, &model, key, q) {
                restarted.insert(key);
            }
        }
        let entries = || queues.values().flat_map(|q| q.entries.iter());
        let stale_entries = entries().filter(|e| e.0 < log.start).count();
        let skipped_entries = entries().filter(|e| model.skipped.contains(&e.0)).count();

        let cutoff = (now_ms as u64).saturating_sub(writer.done_retention_ms);
        let index = check_index(&dir.join("index"), &log, &model, cutoff);

        let (dispatched, checkpoint, paused, push, flow) = read_checkpoint(&dir.join("checkpoint"));
        assert_eq!(flow, model.flow, "checkpoint flow control vs the latest Flow records");
        assert_eq!(push, model.push, "checkpoint push subscriptions vs the latest Push records");
        assert_eq!(paused, model.paused, "checkpoint paused topics vs the latest Pause records");
        // Per queue, the live messages by state, from the replayed slots: what the counts say.
        let mut counts: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for s in model.slots.values() {
            let topic = utf8(&msg_of(&log, s.msg_offset).topic);
            let queue = if s.dead_letter_home { format!("{topic}.dlq") } else { topic };
            let c = counts.entry(queue).or_default();
            match s.state {
                STATE_READY | STATE_DEAD => c.0 += 1,
                STATE_RESERVED => c.1 += 1,
                STATE_DELAYED => c.2 += 1,
                _ => {}
            }
        }
        counts.retain(|_, c| *c != (0, 0, 0));
        let cp_counts: BTreeMap<String, (u64, u64, u64)> = checkpoint
            .iter()
            .filter_map(|q| match &q.key {
                QKey::Topic(t) => Some((t.clone(), (q.ready, q.reserved, q.delayed))),
                QKey::Level(_) => None,
            })
            .filter(|(_, c)| *c != (0, 0, 0))
            .collect();
        assert_eq!(
            cp_counts, counts,
            "checkpoint (ready, reserved, delayed) per topic vs the replayed states"
        );
        assert_eq!(dispatched, log.end, "checkpoint.dispatched after a clean shutdown");
        let cp_keys: Vec<&QKey> = checkpoint.iter().map(|q| &q.key).collect();
        assert!(
            cp_keys.windows(2).all(|w| w[0] < w[1]),
            "checkpoint lists levels first, then topics by name"
        );
        for k in &disk_keys {
            assert!(cp_keys.contains(k), "{k:?}: a queue on disk that the checkpoint does not list");
        }
        for q in &checkpoint {
            assert!(q.cursor <= q.len, "{:?}: cursor past the end", q.key);
            let Some(d) = queues.get(&q.key) else {
                // A topic without a directory (no entry yet, or restarted empty): nothing unread.
                assert!(matches!(q.key, QKey::Topic(_)), "{:?}: a level queue without a directory", q.key);
                assert_eq!(q.cursor, q.len, "{:?}: no directory, yet entries unread", q.key);
                continue;
            };
            match d.first {
                Some(first) => {
                    let held = first + d.entries.len() as u64;
                    assert_eq!(q.len, held, "{:?}: checkpoint len vs entries in the files", q.key);
                    // Only files wholly behind the cursor are deleted.
                    assert!(first <= q.cursor, "{:?}: file {first} is past the cursor {}", q.key, q.cursor);
                }
                None => assert_eq!(q.cursor, q.len, "{:?}: no file left, yet entries unread", q.key),
            }
            match &q.key {
                QKey::Level(_) => {
                    assert_eq!(
                        (q.reserved, q.dead, q.delayed, q.ready),
                        (0, 0, 0, 0),
                        "{:?}: level counters",
                        q.key
                    )
                }
                QKey::Topic(t) => {
                    let reserved = model.reserved.get(t).copied().unwrap_or(0);
                    let dead = model.dead.get(t).copied().unwrap_or(0);
                    assert_eq!(q.reserved, reserved, "{t}: checkpoint reserved vs replay");
                    // `dead` counts since the topic was last created (forgetting resets it); a
                    // reclaimed log only shows the dead-letterings it kept.
                    match (log.start == 0, restarted.contains(&q.key)) {
                        (true, false) => assert_eq!(q.dead, dead, "{t}: checkpoint dead vs replay"),
                        (true, true) => assert!(q.dead <= dead, "{t}: checkpoint dead {} > {dead}", q.dead),
                        (false, false) => {
                            assert!(q.dead >= dead, "{t}: checkpoint dead {} < {dead} in the log", q.dead)
                        }
                        (false, true) => {}
                    }
                }
            }
        }
        check_clean_marker(dir, &log, &model, &index);
        assert!(
            read_receipt_key(&dir.join("receipt_key")).iter().any(|b| *b != 0),
            "an all-zero receipt key"
        );
        Report { log, model, index, queues, checkpoint, stale_entries, skipped_entries }
    }
}
use common::Server;
use reader::{check_data_dir, crc32, id_hash, QKey, Rec, Route, Writer};

const LEVELS: [u64; 3] = [50, 200, 1000];
/// Segment size of the in-process broker.
const SEGMENT_BYTES: u64 = 64 << 10;

/// How the in-process broker of the first scenario was configured, for the reader.
fn in_process() -> Writer<'static> {
    let done_retention_ms = BrokerConfig::with_defaults(Path::new("unused")).done_retention_ms;
    Writer { levels: &LEVELS, pid: std::process::id(), done_retention_ms, segment_bytes: SEGMENT_BYTES }
}

fn config(dir: &Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = SEGMENT_BYTES;
    c.cq_entries_per_file = 8;
    c.index_initial_slots = 64;
    c.levels_ms = LEVELS.to_vec();
    c
}

fn req(id: Option<String>, body: Vec<u8>, when: When) -> ProduceRequest {
    ProduceRequest { id, body: Bytes::from(body), when, ttr_ms: None, max_attempts: None, backoff_ms: None }
}

fn body(i: usize) -> Vec<u8> {
    // Varied lengths and contents, up to ~2 KiB, so records straddle pages and segments roll.
    (0..(i * 373) % 2100).map(|j| (i * 31 + j) as u8).collect()
}

async fn pop(b: &Broker, topic: &str, max: usize, ttr_ms: Option<u64>) -> Vec<delayd::broker::Delivery> {
    b.pop(PopRequest { topics: vec![topic.to_string()], max, wait_ms: 0, ttr_ms }).await.unwrap()
}

async fn wait_state(b: &Broker, id: &str, want: MessageState) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = b.get(id).await.unwrap().state;
        if s == want {
            return;
        }
        assert!(Instant::now() < deadline, "{id} stuck in {s:?}, expected {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Drives every kind of record and transition into the data dir.
async fn write_scenario(dir: &Path) {
    let b = Broker::open(config(dir)).unwrap();
    // Ready at once, with the documented test-vector ids among them.
    for id in ["a", "order-1", "订单-42"] {
        b.produce("orders", req(Some(id.into()), b"vector".to_vec(), When::Now)).await.unwrap();
    }
    for i in 0..150 {
        b.produce("orders", req(Some(format!("o-{i}")), body(i), When::Now)).await.unwrap();
    }
    // Generated ids, an absolute time in the past, a named level.
    b.produce("orders", req(None, body(7), When::Now)).await.unwrap();
    b.produce("orders", req(Some("past".into()), vec![], When::AtMs(1_000))).await.unwrap();
    b.produce("orders", req(Some("lvl".into()), body(3), When::LevelIndex(2))).await.unwrap();
    // Replacing puts (the compat /push of a known id): of a delayed message, and of a done one.
    b.produce("later", req(Some("rp-1".into()), body(4), When::DelayMs(3_600_000))).await.unwrap();
    b.replace("orders", req(Some("rp-1".into()), body(5), When::Now)).await.unwrap();
    b.produce("orders", req(Some("rp-2".into()), body(6), When::Now)).await.unwrap();
    b.ack_id("rp-2").await.unwrap();
    b.replace("orders", req(Some("rp-2".into()), body(8), When::Now)).await.unwrap();
    // Chained delays: 300 ms = a 200 ms level entry, then hops on the 50 ms level.
    for i in 0..40 {
        b.produce("later", req(Some(format!("l-{i}")), body(i + 11), When::DelayMs(300 + i as u64)))
            .await
            .unwrap();
    }
    // Far delays, half cancelled.
    for i in 0..20 {
        b.produce("far", req(Some(format!("f-{i}")), body(i), When::DelayMs(3_600_000))).await.unwrap();
    }
    for i in 0..10 {
        b.cancel(&format!("f-{i}")).await.unwrap();
    }
    // One attempt only, with an own backoff: a nack dead-letters them.
    for i in 0..5 {
        let mut r = req(Some(format!("d-{i}")), body(i + 5), When::Now);
        r.max_attempts = Some(1);
        r.backoff_ms = Some(vec![100, 200]);
        b.produce("dl", r).await.unwrap();
    }

    // A timer that fires after the far messages' first level entry (due in 1 s, final in 1 h), so
    // those have certainly hopped by the time it is ready.
    b.produce("tick", req(Some("tick".into()), vec![], When::DelayMs(1_200))).await.unwrap();

    // Pop with a long time-to-run (so no reservation runs out under a slow machine): ack some,
    // nack some (now and later).
    let got = pop(&b, "orders", 30, Some(60_000)).await;
    assert_eq!(got.len(), 30);
    for d in &got[..20] {
        b.ack(&d.receipt).await.unwrap();
    }
    for (k, d) in got[20..].iter().enumerate() {
        let delay = if k % 2 == 0 { 0 } else { 130 };
        // One nack gives its reason (a Transition of version 7).
        let error = (k == 1).then(|| "timeout: no answer".to_string());
        assert!(matches!(
            b.nack_with_error(&d.receipt, Some(delay), error).await.unwrap(),
            Nacked::Retry { .. }
        ));
    }
    // A short time-to-run: these expire (one is finished by id first).
    let short = pop(&b, "orders", 10, Some(100)).await;
    assert_eq!(short.len(), 10);
    b.ack_id(&short[0].id).await.unwrap();
    let expiring = short[5].id.clone();
    for d in pop(&b, "dl", 5, None).await {
        let error = (d.id == "d-3").then(|| "killed it".to_string());
        assert!(matches!(
            b.nack_with_error(&d.receipt, None, error).await.unwrap(),
            Nacked::DeadLettered { .. }
        ));
    }
    let dead = pop(&b, "dl.dlq", 2, None).await;
    assert_eq!(dead.len(), 2);
    b.ack(&dead[0].receipt).await.unwrap();
    // A redrive moves one dead letter back (a Redrive Transition); it is delivered and acked
    // there, so "dl" empties again. Unknown and reserved ids are left alone.
    let ids = vec!["d-2".to_string(), dead[1].id.clone(), "no-such-id".to_string()];
    assert_eq!(b.redrive("dl", Some(ids)).await.unwrap(), 1);
    let back = pop(&b, "dl", 5, None).await;
    assert_eq!(back.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["d-2"]);
    assert_eq!(back[0].attempt, 1, "attempts were reset");
    b.ack(&back[0].receipt).await.unwrap();
    // A purge cancels a topic's delayed, ready and reserved messages.
    b.produce("gone", req(Some("g-delayed".into()), vec![1], When::DelayMs(3_600_000))).await.unwrap();
    b.produce("gone", req(Some("g-ready".into()), vec![2], When::Now)).await.unwrap();
    b.produce("gone", req(Some("g-reserved".into()), vec![3], When::Now)).await.unwrap();
    wait_state(&b, "g-reserved", MessageState::Ready).await;
    let g = b
        .pop(PopRequest { topics: vec!["gone".into()], max: 1, wait_ms: 0, ttr_ms: Some(60_000) })
        .await
        .unwrap();
    assert_eq!(g.len(), 1);
    assert_eq!(b.purge("gone").await.unwrap(), 3);
    // Reschedules (Transitions of version 5): one later with new settings, one to now.
    let resched = |when, ttr_ms| RescheduleRequest { when, ttr_ms, max_attempts: Some(3), force: false };
    b.produce("moved", req(Some("m-later".into()), vec![4], When::DelayMs(60_000))).await.unwrap();
    b.produce("moved", req(Some("m-now".into()), vec![5], When::DelayMs(3_600_000))).await.unwrap();
    b.reschedule("m-later", resched(When::DelayMs(7_200_000), Some(5_000))).await.unwrap();
    b.reschedule("m-now", resched(When::AtMs(0), None)).await.unwrap();
    // A Touch (version 6) extends a reservation; the receipt still acks it.
    b.produce("touched", req(Some("t-1".into()), vec![6], When::Now)).await.unwrap();
    wait_state(&b, "t-1", MessageState::Ready).await;
    let held = pop(&b, "touched", 1, Some(60_000)).await;
    assert!(b.touch(&held[0].receipt, 120_000).await.unwrap() > 0);
    b.ack(&held[0].receipt).await.unwrap();

    // Let timers fire: reservations expire, chained delays arrive after their hops.
    wait_state(&b, &expiring, MessageState::Ready).await;
    wait_state(&b, "l-39", MessageState::Ready).await;
    wait_state(&b, "tick", MessageState::Ready).await;
    let later =
        b.pop(PopRequest { topics: vec!["later".into()], max: 10, wait_ms: 0, ttr_ms: None }).await.unwrap();
    assert!(!later.is_empty());
    for d in &later {
        b.ack(&d.receipt).await.unwrap();
    }
    assert_eq!(b.get("f-3").await.unwrap().state, MessageState::Cancelled);
    // Pauses: one ended by a resume, one in effect on a topic with messages, one on a topic
    // that has none.
    b.set_paused("orders", true).await.unwrap();
    b.set_paused("orders", false).await.unwrap();
    b.set_paused("far", true).await.unwrap();
    b.set_paused("ghost", true).await.unwrap();
    // Flow control: one replaced, one removed, one in effect.
    let flow = |rate: Option<u32>, reserved: Option<u32>| delayd::message::FlowConfig {
        max_per_second: rate,
        burst: rate,
        max_reserved: reserved,
        updated_at_ms: 0,
    };
    b.set_flow("orders", Some(flow(Some(5), None))).await.unwrap();
    b.set_flow("orders", Some(flow(Some(1000), Some(9)))).await.unwrap();
    b.set_flow("far", Some(flow(None, Some(2)))).await.unwrap();
    b.set_flow("far", None).await.unwrap();
    // Push subscriptions: one replaced, one removed, one in effect (to an address nobody serves:
    // its deliveries fail and the reader sees only the records).
    let hook = |url: &str, secret: Option<&str>| delayd::message::PushConfig {
        topic: String::new(),
        url: url.into(),
        nats_subject: None,
        secret: secret.map(Into::into),
        timeout_ms: 1000,
        max_in_flight: 4,
        created_at_ms: 0,
    };
    b.set_push("hooked", Some(hook("http://127.0.0.1:9/a", None))).await.unwrap();
    b.set_push("hooked", Some(hook("https://127.0.0.1:9/b", Some("s")))).await.unwrap();
    b.set_push("unhooked", Some(hook("http://127.0.0.1:9/c", None))).await.unwrap();
    b.set_push("unhooked", None).await.unwrap();
    b.shutdown().await.unwrap();
}

#[test]
fn reader_primitives_match_the_documented_vectors() {
    assert_eq!(crc32(&[b"123456789"]), 0xCBF4_3926);
    assert_eq!(crc32(&[b"1234", b"56789"]), 0xCBF4_3926);
    assert_eq!(id_hash(b"a"), 0x02c0_bdbf_4814_20f8);
    assert_eq!(id_hash(b"order-1"), 0xedf2_3fc2_e07f_a9d3);
    assert_eq!(id_hash("订单-42".as_bytes()), 0xf765_2255_494d_b662);
}

#[test]
fn a_checkpoint_listing_nothing_is_36_bytes() {
    // magic, version 4, reserved, dispatched, Q = 0, P = 0, S = 0, F = 0, then the CRC.
    let mut b = b"DLCK".to_vec();
    b.extend_from_slice(&4u16.to_le_bytes());
    b.extend_from_slice(&[0; 2]);
    b.extend_from_slice(&4096u64.to_le_bytes());
    b.extend_from_slice(&[0; 16]);
    let crc = crc32(&[&b]);
    b.extend_from_slice(&crc.to_le_bytes());
    assert_eq!(b.len(), 36);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("checkpoint");
    std::fs::write(&path, &b).unwrap();
    let (dispatched, queues, paused, push, flow) = reader::read_checkpoint(&path);
    assert_eq!((dispatched, queues.len(), paused.len(), push.len(), flow.len()), (4096, 0, 0, 0, 0));
    // Without F it is 32 bytes, which the document says no version 4 checkpoint is.
    let mut short = b[..28].to_vec();
    let crc = crc32(&[&short]);
    short.extend_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, &short).unwrap();
    let err = std::panic::catch_unwind(|| reader::read_checkpoint(&path)).err();
    let msg = err.and_then(|e| {
        e.downcast_ref::<String>().cloned().or(e.downcast_ref::<&str>().map(|s| s.to_string()))
    });
    assert!(msg.is_some_and(|m| m.contains("shorter than 36 bytes")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_parses_with_only_the_format_document() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    write_scenario(&dir).await;
    let r = check_data_dir(&dir, &in_process());

    // The scenario reached every structure the document describes, so the checks above meant something.
    assert!(r.log.segments >= 3, "segments rolled: {}", r.log.segments);
    assert_eq!(r.log.end_of_segment_markers, r.log.segments - 1);
    // Done messages pin their segment for done_retention (a day here): nothing was reclaimed from
    // the log, so the replay predicts every queue and slot.
    assert_eq!(r.log.start, 0, "the first segment is still there");
    assert!(r.index.expired.is_empty() && r.model.carries == 0);
    assert!(r.index.slots > 64, "the index grew: {} slots", r.index.slots);
    assert!(r.queues[&QKey::Topic("orders".into())].files > 1, "a queue spans files");
    assert!(r.model.queues.contains_key(&QKey::Topic("dl.dlq".into())), "dead-letter queue exists");
    // Every message of "dl" was read and dead-lettered: the topic was forgotten, directory and all.
    assert!(r.model.queues.contains_key(&QKey::Topic("dl".into())));
    assert!(!r.queues.contains_key(&QKey::Topic("dl".into())), "the emptied topic dl still has a directory");
    assert!(r.model.hops > 0, "hop records were written");
    assert_eq!(r.model.causes_seen.iter().copied().collect::<Vec<_>>(), (1..=10).collect::<Vec<u8>>());
    let kinds = |f: fn(&Rec) -> bool| r.log.records.iter().filter(|x| f(&x.rec)).count();
    assert!(kinds(|x| matches!(x, Rec::Transition { .. })) > 0);
    assert_eq!(kinds(|x| matches!(x, Rec::Transition { settings: Some((5_000, 3)), state: 1, .. })), 1);
    assert_eq!(kinds(|x| matches!(x, Rec::Transition { settings: Some((_, 3)), state: 2, .. })), 1);
    // A Reschedule is version 5 only (its settings are 12 bytes past version 3's layout).
    let moved =
        r.log.records.iter().find(|x| matches!(x.rec, Rec::Transition { settings: Some(_), .. })).unwrap();
    let moved = record_bytes(&dir, &r.log, moved.offset, moved.len);
    let err = reader::parse_record(&reframe(&moved, 3)).err();
    assert!(err.as_deref().is_some_and(|e| e.contains("a Reschedule is 5")), "{err:?}");
    // A Touch is version 6 only, with the version 3 layout.
    let touch = r.log.records.iter().find(|x| matches!(x.rec, Rec::Transition { cause: 10, .. })).unwrap();
    let touch = record_bytes(&dir, &r.log, touch.offset, touch.len);
    assert_eq!((touch.len(), touch[6]), (89, 6));
    let err = reader::parse_record(&reframe(&touch, 3)).err();
    assert!(err.as_deref().is_some_and(|e| e.contains("a Touch 6")), "{err:?}");
    // A Nack and a DeadLetter with reasons are version 7: version 3 and `error_len` and the bytes.
    let with_error: Vec<_> = r
        .log
        .records
        .iter()
        .filter_map(|x| match &x.rec {
            Rec::Transition { cause, error: Some(e), .. } => Some((*cause, e.clone(), x)),
            _ => None,
        })
        .collect();
    let causes: Vec<(u8, &[u8])> = with_error.iter().map(|(c, e, _)| (*c, &e[..])).collect();
    assert_eq!(causes, [(4, &b"timeout: no answer"[..]), (6, &b"killed it"[..])]);
    let failed = record_bytes(&dir, &r.log, with_error[1].2.offset, with_error[1].2.len);
    assert_eq!((failed.len(), failed[6]), (89 + 2 + 9, 7));
    let err = reader::parse_record(&reframe(&failed, 3)).err();
    assert!(err.as_deref().is_some_and(|e| e.contains("trailing") || e.contains("len")), "{err:?}");
    assert!(kinds(|x| matches!(x, Rec::Put(m) if m.request_kind == 2)) == 1);
    assert!(kinds(|x| matches!(x, Rec::Put(m) if m.request_kind == 3)) == 1);
    assert!(kinds(|x| matches!(x, Rec::Put(m) if m.max_attempts == 1 && m.backoff_ms == [100, 200])) == 5);
    assert!(kinds(|x| matches!(x, Rec::Put(m) if m.body.len() > 2000)) > 0);
    assert_eq!(kinds(|x| matches!(x, Rec::Put(m) if m.replaces)), 2);
    assert_eq!(kinds(|x| matches!(x, Rec::Pause { .. })), 4);
    assert_eq!(kinds(|x| matches!(x, Rec::Push { .. })), 4);
    assert_eq!(kinds(|x| matches!(x, Rec::Flow { .. })), 4);
    assert_eq!(r.model.flow.keys().map(String::as_str).collect::<Vec<_>>(), ["orders"]);
    let flow = r.log.records.iter().find(|x| matches!(x.rec, Rec::Flow { .. })).unwrap();
    let flow = record_bytes(&dir, &r.log, flow.offset, flow.len);
    assert_eq!((flow.len(), flow[6], flow[7]), (34 + "orders".len(), 8, 8), "a Flow is kind 8, version 8");
    let err = reader::parse_record(&reframe(&flow, 2)).err();
    assert!(err.as_deref().is_some_and(|e| e.contains("kind 8 with record version 2")), "{err:?}");
    assert_eq!(r.model.push.keys().map(String::as_str).collect::<Vec<_>>(), ["hooked"]);
    assert_eq!(r.model.paused.keys().map(String::as_str).collect::<Vec<_>>(), ["far", "ghost"]);
    let counted = r.checkpoint.iter().filter(|q| q.delayed > 0 || q.ready > 0 || q.reserved > 0).count();
    assert!(counted >= 3, "the checkpoint counts messages by state in several topics");

    // Semantic spot checks through the document's meaning of the index.
    let slot_of = |id: &str| {
        let off = r.model.ids[id.as_bytes()];
        r.model.slots[&off].clone()
    };
    assert_eq!(slot_of("a").hash, 0x02c0_bdbf_4814_20f8);
    assert_eq!(slot_of("order-1").hash, 0xedf2_3fc2_e07f_a9d3);
    assert_eq!(slot_of("订单-42").hash, 0xf765_2255_494d_b662);
    assert_eq!(slot_of("f-3").state, reader::STATE_CANCELLED);
    for id in ["rp-1", "rp-2"] {
        let off = r.model.ids[id.as_bytes()];
        assert_eq!(reader::msg_of(&r.log, off).topic, b"orders", "{id}: the replacing message holds the id");
        assert_eq!(r.model.slots.values().filter(|s| s.hash == id_hash(id.as_bytes())).count(), 1, "{id}");
    }
    assert_eq!(slot_of("f-13").state, reader::STATE_DELAYED);
    // d-0 and d-1 were popped from the dead-letter topic; d-4 was not.
    assert_eq!(slot_of("d-4").state, reader::STATE_DEAD);
    assert!(slot_of("d-4").dead_letter_home);
    assert_eq!(slot_of("d-1").state, reader::STATE_RESERVED);
    assert!(slot_of("d-1").dead_letter_home);
    assert_eq!(slot_of("a").state, reader::STATE_DONE);
    assert_eq!(slot_of("o-140").state, reader::STATE_READY);
    assert!([reader::STATE_READY, reader::STATE_RESERVED, reader::STATE_DONE].contains(&slot_of("l-0").state));

    // Reopen (clean start), write a little more, shut down: still a valid directory.
    {
        let b = Broker::open(config(&dir)).unwrap();
        assert_eq!(b.get("f-3").await.unwrap().state, MessageState::Cancelled);
        b.produce("orders", req(Some("second-run".into()), body(9), When::DelayMs(60))).await.unwrap();
        wait_state(&b, "second-run", MessageState::Ready).await;
        b.shutdown().await.unwrap();
    }
    let r2 = check_data_dir(&dir, &in_process());
    assert!(r2.log.end > r.log.end);
    for (old, new) in r.log.records.iter().zip(&r2.log.records) {
        assert_eq!((old.offset, old.len), (new.offset, new.len), "a reopen rewrote the log");
    }

    // Delete every derived file: the rebuilt queues and index must again be what the log implies.
    std::fs::remove_dir_all(dir.join("cq")).unwrap();
    std::fs::remove_dir_all(dir.join("index")).unwrap();
    {
        let b = Broker::open(config(&dir)).unwrap();
        assert_eq!(b.get("d-4").await.unwrap().state, MessageState::Dead);
        b.shutdown().await.unwrap();
    }
    let r3 = check_data_dir(&dir, &in_process());

    // The reader is not vacuous: single-byte damage to each kind of file is caught.
    let put = r3.log.records.iter().find(|x| matches!(&x.rec, Rec::Put(m) if m.body.len() > 100)).unwrap();
    let seg = std::fs::read_dir(dir.join("commitlog"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap().parse::<u64>().unwrap())
        .filter(|base| *base <= put.offset)
        .max()
        .unwrap();
    let at = (put.offset - seg) as usize + put.len as usize - 1;
    must_fail(&dir, &in_process(), &format!("commitlog/{seg:020}"), at, "crc mismatch");
    let orders = r3.queues[&QKey::Topic("orders".into())].first.unwrap();
    must_fail(&dir, &in_process(), &format!("cq/topic/t-orders/{orders:020}"), 12, "tag");
    must_fail(&dir, &in_process(), "checkpoint", 9, "checkpoint crc");
    must_fail(&dir, &in_process(), "clean_shutdown", 9, "clean marker crc");
    // During a resize the live copy of a message may be in ids.next; damage the one that counts.
    let index_file = if dir.join("index/ids.next").exists() { "index/ids.next" } else { "index/ids" };
    let idx = std::fs::read(dir.join(index_file)).unwrap();
    let slots = u64::from_le_bytes(idx[8..16].try_into().unwrap());
    let used = (0..slots).map(reader::index_slot_at).find(|&p| idx[p + 31] & 0x05 == 0x01).unwrap();
    must_fail(&dir, &in_process(), index_file, used + 30, "differs from the replay");
}

// ---- reclaim, on the real binary -----------------------------------------------------------

const RECLAIM_LEVELS: [u64; 5] = [100, 1_000, 10_000, 60_000, 3_600_000];

/// 64 KiB segments (so bodies up to 8 KiB), 64-entry queue files, and done messages forgotten a
/// second after their ack.
const RECLAIM_ENV: [(&str, &str); 5] = [
    ("DELAYD_SEGMENT_BYTES", "64KiB"),
    ("DELAYD_MAX_BODY_BYTES", "8KiB"),
    ("DELAYD_CQ_ENTRIES_PER_FILE", "64"),
    ("DELAYD_DONE_RETENTION", "1s"),
    ("DELAYD_LEVELS", "100ms 1s 10s 1m 1h"),
];

/// The smallest numbered file name in `dir`, if any.
fn first_file(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).min()
}

/// Whether some consume queue of the data dir has lost its first file to reclaim.
fn a_queue_file_was_reclaimed(data: &Path) -> bool {
    ["level", "topic"].iter().any(|family| {
        let queues = std::fs::read_dir(data.join("cq").join(family)).into_iter().flatten().flatten();
        queues.into_iter().any(|q| first_file(&q.path()).is_some_and(|f| f > 0))
    })
}

/// The bytes of the record at `offset`, read from its segment file.
fn record_bytes(data: &Path, log: &reader::Log, offset: u64, len: u32) -> Vec<u8> {
    let base = *log.bases.iter().rev().find(|b| **b <= offset).unwrap();
    let seg = std::fs::read(data.join("commitlog").join(format!("{base:020}"))).unwrap();
    let at = (offset - base) as usize;
    seg[at..at + len as usize].to_vec()
}

/// `rec` with another version byte and a CRC that matches again.
fn reframe(rec: &[u8], version: u8) -> Vec<u8> {
    let mut b = rec.to_vec();
    b[6] = version;
    let crc = crc32(&[&b[0..8], &b[12..]]);
    b[8..12].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The Carry records of `id`, oldest first.
fn carries_of<'a>(r: &'a reader::Report, id: &str) -> Vec<&'a reader::LogRec> {
    let of_id = |x: &&reader::LogRec| matches!(&x.rec, Rec::Carry { msg, .. } if msg.id == id.as_bytes());
    r.log.records.iter().filter(of_id).collect()
}

#[test]
fn a_reclaimed_data_dir_parses_with_only_the_format_document() {
    let started = Instant::now();
    let mut s = Server::start(&RECLAIM_ENV);
    let data = s.data_dir();
    // Two messages that outlive the first segment: reclaim has to carry them before deleting it.
    let long = s.produce("far", &json!({"id": "long", "body": "an hour away", "delay_ms": 3_600_000}));
    let long_at = long["deliver_at_ms"].as_u64().unwrap();
    let idle = s.produce("idle", &json!({"id": "idle", "body": "nobody pops this topic"}));
    let idle_at = idle["deliver_at_ms"].as_u64().unwrap();
    // Compat jobs: a topic outside [A-Za-z0-9._-] is stored escaped, a delay in seconds as ms
    // under request_kind 1.
    for (topic, id, delay) in [("order:close", "cj-now", 0), ("50%", "cj-later", 3600)] {
        let job = json!({"topic": topic, "id": id, "delay": delay, "ttr": 30, "body": "compat"});
        let (status, v) = s.post("/push", &job);
        assert_eq!((status, &v["code"]), (200, &json!(0)), "compat push: {v}");
    }
    // A message nacked for an hour: once carried, its Carry holds the due time of its last record
    // (the Nack), not its Put's.
    s.produce("nacked", &json!({"id": "nacked", "body": "back in an hour"}));
    let (got, _) = s.pop("nacked", 1, 2000, Some(60_000));
    assert_eq!(got.len(), 1);
    let nack = json!({"receipt": got[0]["receipt"], "delay_ms": 3_600_000, "error": "HTTP 503: try later"});
    let (status, v) = s.post("/v1/nack", &nack);
    assert_eq!(status, 200, "nack: {v}");
    let nacked_at = v["deliver_at_ms"].as_u64().unwrap();

    // Short-lived messages (half ready at once, half after a few hundred ms), popped and acked, until
    // the first segment and some read queue files are gone. Each deletion waits for a durable
    // checkpoint (every 5 s while records are written), so the churn goes on, slower, meanwhile.
    let body = ".".repeat(1000);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut churned = 0;
    while churned < 300
        || first_file(&data.join("commitlog")) == Some(0)
        || !a_queue_file_was_reclaimed(&data)
    {
        assert!(Instant::now() < deadline, "no reclaim within 60 s ({churned} churned); log:\n{}", s.log());
        if churned >= 300 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let msgs: Vec<_> = (0..20)
            .map(|k| {
                churned += 1;
                let delay = if k % 2 == 0 { 0 } else { 150 + 10 * k };
                json!({"id": format!("c-{churned}"), "body": body, "delay_ms": delay})
            })
            .collect();
        let (status, v) = s.post("/v1/topics/churn/messages/batch", &json!({ "messages": msgs }));
        assert_eq!(status, 201, "batch -> {v}");
        let (got, _) = s.pop("churn", 100, 200, None);
        for m in got {
            assert_eq!(s.ack(m["receipt"].as_str().unwrap()), 200, "ack {}", m["id"]);
        }
    }
    let pid = s.pid();
    assert!(s.terminate().success(), "clean shutdown; log:\n{}", s.log());
    let writer = Writer { levels: &RECLAIM_LEVELS, pid, done_retention_ms: 1_000, segment_bytes: 64 << 10 };
    let r = check_data_dir(&data, &writer);

    // Segments were deleted from the front; the ones left follow on from the first.
    assert!(r.log.start > 0 && r.log.bases[0] == r.log.start, "log starts at {}", r.log.start);
    assert!(r.log.segments >= 2, "{} segments", r.log.segments);
    // A queue lost its first files (the reader checked its cursor is past them).
    let trimmed: Vec<_> = r.queues.iter().filter(|(_, q)| q.first.is_some_and(|f| f > 0)).collect();
    assert!(!trimmed.is_empty(), "no queue starts past file 0");
    for (key, q) in &trimmed {
        let cp = r.checkpoint.iter().find(|c| &c.key == *key).unwrap();
        assert!(cp.cursor >= q.first.unwrap(), "{key:?}: files deleted ahead of the reader");
    }
    // Messages done for over a second left the index, while the log still holds their records.
    assert!(!r.index.expired.is_empty(), "no expired message in the log");
    assert!(r.index.used.len() < r.model.slots.len());

    // The queues still hold entries of reclaimed records and of records naming reclaimed messages
    // (dispatched while those existed); the replay predicts neither, and the reader accounts for both.
    assert!(
        r.stale_entries > 0 && r.skipped_entries > 0,
        "{} stale, {} skipped",
        r.stale_entries,
        r.skipped_entries
    );

    // Both long-lived messages were carried, from their Puts (the log's first two records, the first
    // at 0 and the second right after a 76 + 4 + 3 + 12 byte Put) and then from Carry to Carry.
    for (id, put_at) in [("long", 0), ("idle", 95)] {
        let chain = carries_of(&r, id);
        assert!(!chain.is_empty(), "{id} was not carried");
        let prevs: Vec<u64> = chain
            .iter()
            .map(|c| match c.rec {
                Rec::Carry { prev_msg_offset, .. } => prev_msg_offset,
                _ => unreachable!(),
            })
            .collect();
        let mut want = vec![put_at];
        want.extend(chain.iter().take(chain.len() - 1).map(|c| c.offset));
        assert_eq!(prevs, want, "{id}: each Carry replaces the previous record of the message");
    }
    let long_c = *carries_of(&r, "long").last().unwrap();
    let idle_c = *carries_of(&r, "idle").last().unwrap();
    let Rec::Carry { seq, attempt, state, home, time_ms, deliver_at_ms, msg, .. } = &long_c.rec else {
        unreachable!()
    };
    assert_eq!((*seq, *attempt, *state, *home), (0, 0, reader::STATE_DELAYED, 0), "long: carried state");
    assert_eq!(*deliver_at_ms, long_at, "long: still due in an hour");
    let want_msg = (&b"far"[..], &b"an hour away"[..], long_at, 1, 3_600_000);
    assert_eq!(
        (&msg.topic[..], &msg.body[..], msg.deliver_at_ms, msg.request_kind, msg.request_value),
        want_msg,
        "long: the message as produced"
    );
    // Under an hour remains, so the next hop is on the minute level.
    let hop = Route::Level { level_ms: 60_000, due_ms: time_ms + 60_000 };
    assert_eq!(msg.route, hop, "long: carried onto its next level hop");
    assert!(r.queues[&QKey::Level(60_000)].entries.contains(&(long_c.offset, long_c.len, time_ms + 60_000)));

    let Rec::Carry { seq, attempt, state, home, time_ms, deliver_at_ms, msg, .. } = &idle_c.rec else {
        unreachable!()
    };
    assert_eq!((*seq, *attempt, *state, *home), (0, 0, reader::STATE_READY, 0), "idle: carried state");
    assert!(*deliver_at_ms == idle_at && idle_at <= *time_ms, "idle: ready since it was produced");
    let want_msg = (&b"idle"[..], &b"nobody pops this topic"[..], idle_at, 0, 0);
    assert_eq!(
        (&msg.topic[..], &msg.body[..], msg.deliver_at_ms, msg.request_kind, msg.request_value),
        want_msg,
        "idle: the message as produced"
    );
    assert_eq!(msg.route, Route::Topic, "idle: carried into its topic queue");
    assert!(r.queues[&QKey::Topic("idle".into())].entries.contains(&(idle_c.offset, idle_c.len, idle_at)));

    let nacked_c = carries_of(&r, "nacked");
    assert!(!nacked_c.is_empty(), "nacked was not carried");
    let Rec::Carry { state, deliver_at_ms, msg, last_error, .. } = &nacked_c[0].rec else { unreachable!() };
    assert_eq!((*state, *deliver_at_ms), (reader::STATE_DELAYED, nacked_at), "nacked: the Carry's due time");
    // Its reason rides along (a Carry of version 7), the Nack that held it going with its segment.
    assert_eq!(
        record_bytes(&data, &r.log, nacked_c[0].offset, nacked_c[0].len)[6],
        7,
        "nacked: a Carry's version"
    );
    let (_, failed, reason) = last_error.as_ref().expect("nacked: the Carry keeps the last error");
    assert_eq!((*failed, &reason[..]), (1, &b"HTTP 503: try later"[..]));
    assert!(msg.deliver_at_ms < nacked_at, "nacked: its Put was due at once");

    // Compat jobs as stored: the escaped topic names the message and its queue directory.
    for (id, topic, value) in [("cj-now", "order%3Aclose", 0), ("cj-later", "50%25", 3_600_000)] {
        let msg = reader::msg_of(&r.log, r.model.ids[id.as_bytes()]);
        assert_eq!(
            (&msg.topic[..], msg.request_kind, msg.request_value, msg.max_attempts),
            (topic.as_bytes(), 1, value, u32::MAX),
            "{id}: a compat job as stored"
        );
    }
    assert!(r.queues.contains_key(&QKey::Topic("order%3Aclose".into())), "the escaped topic's directory");

    // Their index slots moved to the Carries.
    for (id, c, state) in [("long", long_c, reader::STATE_DELAYED), ("idle", idle_c, reader::STATE_READY)] {
        assert_eq!(r.model.ids[id.as_bytes()], c.offset);
        let want = reader::Slot {
            hash: id_hash(id.as_bytes()),
            msg_offset: c.offset,
            last_offset: c.offset,
            seq: 0,
            attempt: 0,
            state,
            dead_letter_home: false,
            len: c.len,
        };
        assert_eq!(r.index.used.get(&c.offset), Some(&want), "{id}: index slot");
    }

    // The reader tells record versions apart: a Carry is version 2, a Put 1 or 2, a Transition 1 to
    // 3 (delayd writes 3), a Hop 1.
    let carry = record_bytes(&data, &r.log, long_c.offset, long_c.len);
    assert!(matches!(reader::parse_record(&carry), Ok(Some((Rec::Carry { .. }, _)))));
    let put = r.log.records.iter().find(|x| matches!(x.rec, Rec::Put(_))).unwrap();
    let put = record_bytes(&data, &r.log, put.offset, put.len);
    assert!(matches!(reader::parse_record(&put), Ok(Some((Rec::Put(m), _))) if !m.replaces));
    // A Put of version 2 is the same layout and replaces the message its id named.
    assert!(matches!(reader::parse_record(&reframe(&put, 2)), Ok(Some((Rec::Put(m), _))) if m.replaces));
    // request_kind (offset 40) is not checked on read: another value is valid, only not what
    // delayd writes.
    let mut odd = put.clone();
    odd[40] = 9;
    let odd = reframe(&odd, odd[6]);
    assert!(
        matches!(reader::parse_record(&odd), Ok(Some((Rec::Put(m), _))) if m.request_kind == 9),
        "validity rule 9 does not check request_kind"
    );
    let err = reader::parse_record_as_written(&odd).err();
    assert!(err.as_deref().is_some_and(|e| e.contains("request kind 9")), "{err:?}");
    let transition =
        r.log.records.iter().find(|x| matches!(x.rec, Rec::Transition { due_ms: None, .. })).unwrap();
    let transition = record_bytes(&data, &r.log, transition.offset, transition.len);
    let hop = r.log.records.iter().find(|x| matches!(x.rec, Rec::Hop { .. })).unwrap();
    let hop = record_bytes(&data, &r.log, hop.offset, hop.len);
    for (bytes, want) in [
        (reframe(&carry, 1), "kind 4 with record version 1"),
        (reframe(&hop, 2), "kind 3 with record version 2"),
        (reframe(&hop, 3), "kind 3 with record version 3"),
        // Transitions are written as version 3: 16 bytes (a due time, a link) past version 1's
        // layout, 8 past version 2's.
        (reframe(&transition, 1), "16 trailing bytes"),
        (reframe(&transition, 2), "8 trailing bytes"),
        (reframe(&carry, 4), "unknown version 4"),
        (reframe(&hop, 5), "kind 3 with record version 5"),
    ] {
        let err = reader::parse_record(&bytes).err();
        assert!(err.as_deref().is_some_and(|e| e.contains(want)), "expected {want:?}, got {err:?}");
    }

    // The reader is not vacuous on what reclaim left: damage to the carried message's slot or to its
    // topic entry is caught.
    // During a resize the slot that counts is the one in ids.next if it has the message, else in ids.
    let (index_file, slot) = ["index/ids.next", "index/ids"]
        .into_iter()
        .filter(|f| data.join(f).exists())
        .find_map(|f| {
            let idx = std::fs::read(data.join(f)).unwrap();
            let slots = u64::from_le_bytes(idx[8..16].try_into().unwrap());
            (0..slots)
                .map(reader::index_slot_at)
                .find(|&p| idx[p + 31] & 0x05 == 0x01 && idx[p + 8..p + 16] == long_c.offset.to_le_bytes())
                .map(|i| (f, i))
        })
        .unwrap();
    must_fail(&data, &writer, index_file, slot + 30, "differs from the replay");
    let idle_q = &r.queues[&QKey::Topic("idle".into())];
    let k = idle_q.entries.iter().position(|e| e.0 == idle_c.offset).unwrap() as u64;
    let first = idle_q.first.unwrap();
    let n = std::fs::metadata(data.join(format!("cq/topic/t-idle/{first:020}"))).unwrap().len() / 20;
    let file = format!("cq/topic/t-idle/{:020}", first + k / n * n);
    must_fail(&data, &writer, &file, 20 * (k % n) as usize + 12, "tag");

    // Rebuild the derived files from a log that starts past 0: Transitions and Hops of reclaimed
    // messages are skipped, the Carries re-create the slots of the messages they hold.
    std::fs::remove_dir_all(data.join("cq")).unwrap();
    std::fs::remove_dir_all(data.join("index")).unwrap();
    s.restart();
    let (status, v) = s.get("/v1/messages/long");
    assert_eq!((status, &v["state"], v["deliver_at_ms"].as_u64()), (200, &json!("delayed"), Some(long_at)));
    let (status, v) = s.get("/v1/messages/idle");
    assert_eq!((status, &v["state"]), (200, &json!("ready")));
    let pid = s.pid();
    assert!(s.terminate().success(), "clean shutdown; log:\n{}", s.log());
    let r2 = check_data_dir(&data, &Writer { pid, ..writer });
    assert!(r2.log.start >= r.log.start);
    for (id, state) in [("long", reader::STATE_DELAYED), ("idle", reader::STATE_READY)] {
        let at = r2.model.ids[id.as_bytes()];
        assert!(matches!(r2.log.records[r2.log.by_offset[&at]].rec, Rec::Carry { .. }), "{id}");
        assert_eq!(r2.index.used[&at].state, state, "{id} after the rebuild");
    }
    eprintln!("reclaim scenario: {churned} churned in {:?}", started.elapsed());
}

/// Copies the data dir, flips one byte of `file` at `at`, and requires the reader to reject it
/// with a message containing `expect`.
fn must_fail(dir: &Path, writer: &Writer, file: &str, at: usize, expect: &str) {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &to.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    copy(dir, tmp.path());
    let path = tmp.path().join(file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let err = std::panic::catch_unwind(|| check_data_dir(tmp.path(), writer)).err();
    let msg = err.map(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    });
    assert!(
        msg.as_deref().is_some_and(|m| m.contains(expect)),
        "flipping byte {at} of {file}: expected a failure mentioning {expect:?}, got {msg:?}"
    );
}

/// Segment files in `data`'s commit log, oldest first, with whether each holds any non-zero byte.
fn segments_with_data(data: &Path) -> Vec<(u64, bool)> {
    reader::numbered(&data.join("commitlog"), 20)
        .into_iter()
        .map(|(base, path)| (base, std::fs::read(path).unwrap().iter().any(|b| *b != 0)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_made_ahead_parses_as_past_the_end_of_data() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let b = Broker::open(config(&dir)).unwrap();
    // Near the end of a segment the next one is made on a helper thread: produce until it exists
    // while the log still ends in the segment before it. A roll may overtake the helper; then the
    // next segment's end is tried, so this ends within a few segments.
    let mut made_ahead = false;
    for i in 0..20_000 {
        b.produce("t", req(Some(format!("m-{i}")), vec![b'x'; 200], When::DelayMs(3_600_000))).await.unwrap();
        let segs = segments_with_data(&dir);
        if segs.len() >= 2 && segs[segs.len() - 2].1 && !segs[segs.len() - 1].1 {
            made_ahead = true;
            break;
        }
        // Give the helper a moment once it may have started (the last 1/8 of a 64 KiB segment).
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(made_ahead, "no segment was made ahead of the roll");
    b.shutdown().await.unwrap();
    let segs = segments_with_data(&dir);
    assert!(!segs[segs.len() - 1].1, "the segment made ahead is still empty after shutdown: {segs:?}");

    let r = check_data_dir(&dir, &in_process());
    assert_eq!(r.log.segments, segs.len(), "the reader walked the empty segment too");
    let (active, ahead) = (segs[segs.len() - 2].0, segs[segs.len() - 1].0);
    assert!((active..ahead).contains(&r.log.end), "the log ends in the segment before: {}", r.log.end);

    // Reopened (recovery drops the unused segment, step 5), the log goes on where it ended.
    let b = Broker::open(config(&dir)).unwrap();
    b.produce("t", req(Some("after".into()), vec![b'y'; 10], When::Now)).await.unwrap();
    b.shutdown().await.unwrap();
    check_data_dir(&dir, &in_process());
}
