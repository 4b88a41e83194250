//! Checks `storage-format.md` against real files.
//!
//! A data directory is written through the public broker API (small segments, small queue files and
//! a small index so that segments roll, queues span files and the index grows), then every file in
//! it is parsed by the reader in `mod reader`, which was written from the document alone: its own
//! CRC-32, its own id hash, its own structs; nothing from delayd's storage modules. The reader then
//! replays the commit log with the document's dispatch rules and requires the consume queues, the
//! id index and the checkpoint to be exactly what that replay predicts.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use delayd::broker::{Broker, BrokerConfig, MessageState, Nacked, PopRequest, ProduceRequest, When};

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

    /// Sorted `(number, path)` of the entries of `dir` named by exactly `digits` ASCII digits;
    /// panics on any other entry, since the document allows nothing else there.
    fn numbered(dir: &Path, digits: usize) -> Vec<(u64, PathBuf)> {
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

    /// A decoded record.
    #[derive(Debug, Clone)]
    pub enum Rec {
        Put {
            deliver_at_ms: u64,
            max_attempts: u32,
            request_kind: u8,
            route: Route,
            id: Vec<u8>,
            topic: Vec<u8>,
            backoff_ms: Vec<u64>,
            body: Vec<u8>,
        },
        Transition {
            msg_offset: u64,
            id_hash: u64,
            seq: u32,
            prev_state: u8,
            state: u8,
            cause: u8,
            home: u8,
            attempt: u32,
            deliver_at_ms: u64,
            route: Route,
        },
        Hop {
            msg_offset: u64,
            id_hash: u64,
            seq: u32,
            route: Route,
        },
        EndOfSegment,
    }

    pub const KIND_PUT: u8 = 1;
    pub const KIND_TRANSITION: u8 = 2;
    pub const KIND_HOP: u8 = 3;
    pub const KIND_EOS: u8 = 0x7F;

    pub const STATE_DELAYED: u8 = 1;
    pub const STATE_READY: u8 = 2;
    pub const STATE_RESERVED: u8 = 3;
    pub const STATE_DONE: u8 = 4;
    pub const STATE_CANCELLED: u8 = 5;
    pub const STATE_DEAD: u8 = 6;
    pub const CAUSE_DEAD_LETTER: u8 = 6;
    pub const HOME_DEAD_LETTER: u8 = 1;

    struct Cur<'a> {
        b: &'a [u8],
        pos: usize,
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
            match tag {
                // The document says writers put zeros in unused route fields.
                0 | 1 if a != 0 || b != 0 => Err("non-zero unused route fields".into()),
                0 => Ok(Route::None),
                1 => Ok(Route::Topic),
                2 => Ok(Route::Level { level_ms: a, due_ms: b }),
                t => Err(format!("unknown route tag {t}")),
            }
        }
    }

    /// What is at the start of a buffer.
    pub enum Frame {
        Empty,
        Record(Rec, usize),
    }

    /// Decodes the record at the start of `buf` with the document's nine validity rules.
    pub fn parse_record(buf: &[u8]) -> Result<Frame, String> {
        if buf.len() < 12 {
            return if all_zero(buf) { Ok(Frame::Empty) } else { Err("truncated header".into()) };
        }
        let len = le32(buf, 0) as usize;
        if len == 0 && all_zero(&buf[..12]) {
            return Ok(Frame::Empty);
        }
        if le16(buf, 4) != 0xD71A {
            return Err("bad magic".into());
        }
        if buf[6] != 1 {
            return Err(format!("unknown version {}", buf[6]));
        }
        let kind = buf[7];
        if ![KIND_PUT, KIND_TRANSITION, KIND_HOP, KIND_EOS].contains(&kind) {
            return Err(format!("unknown kind {kind}"));
        }
        if !(12..=64 << 20).contains(&len) {
            return Err(format!("bad len {len}"));
        }
        if buf.len() < len {
            return Err("truncated record".into());
        }
        let rec = &buf[..len];
        if crc32(&[&rec[0..8], &rec[12..]]) != le32(rec, 8) {
            return Err("crc mismatch".into());
        }
        let mut c = Cur { b: rec, pos: 12 };
        let out = match kind {
            KIND_EOS => Rec::EndOfSegment,
            KIND_PUT => {
                let _created_ms = c.u64()?;
                let deliver_at_ms = c.u64()?;
                let _ttr_ms = c.u64()?;
                let max_attempts = c.u32()?;
                let request_kind = c.u8()?;
                let _request_value = c.u64()?;
                let route = c.route()?;
                let n = c.u16()? as usize;
                let id = c.take(n)?.to_vec();
                let n = c.u16()? as usize;
                let topic = c.take(n)?.to_vec();
                let n = c.u16()? as usize;
                let backoff_ms = (0..n).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
                let n = c.u32()? as usize;
                let body = c.take(n)?.to_vec();
                Rec::Put { deliver_at_ms, max_attempts, request_kind, route, id, topic, backoff_ms, body }
            }
            KIND_TRANSITION => Rec::Transition {
                msg_offset: c.u64()?,
                id_hash: c.u64()?,
                seq: c.u32()?,
                prev_state: c.enum_u8("state", 1..=6)?,
                state: c.enum_u8("state", 1..=6)?,
                cause: c.enum_u8("cause", 1..=7)?,
                home: c.enum_u8("home", 0..=1)?,
                attempt: c.u32()?,
                deliver_at_ms: {
                    let _time_ms = c.u64()?;
                    c.u64()?
                },
                route: c.route()?,
            },
            _ => Rec::Hop {
                msg_offset: c.u64()?,
                id_hash: c.u64()?,
                seq: c.u32()?,
                route: {
                    let _target_ms = c.u64()?;
                    c.route()?
                },
            },
        };
        if c.pos != len {
            return Err(format!("{} trailing bytes", len - c.pos));
        }
        Ok(Frame::Record(out, len))
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
        /// One past the last record.
        pub end: u64,
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
            end: 0,
            segments: segs.len(),
            end_of_segment_markers: 0,
        };
        let mut expect_base = 0u64;
        for (i, (base, path)) in segs.iter().enumerate() {
            let bytes = fs::read(path).unwrap();
            assert_eq!(*base, expect_base, "segment {} does not follow the previous one", path.display());
            expect_base = base + bytes.len() as u64;
            let last = i + 1 == segs.len();
            let mut pos = 0usize;
            loop {
                let at = base + pos as u64;
                match parse_record(&bytes[pos..]) {
                    Ok(Frame::Empty) => {
                        assert!(last, "end of data at {at} in a segment that is not the last");
                        assert!(all_zero(&bytes[pos..]), "non-zero bytes after the end of data at {at}");
                        log.end = at;
                        break;
                    }
                    Ok(Frame::Record(Rec::EndOfSegment, len)) => {
                        assert_eq!(len, 12, "end-of-segment marker at {at} is not 12 bytes");
                        assert!(!last, "end-of-segment marker in the last segment at {at}");
                        assert!(all_zero(&bytes[pos + 12..]), "non-zero bytes after the marker at {at}");
                        log.end_of_segment_markers += 1;
                        break;
                    }
                    Ok(Frame::Record(rec, len)) => {
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

    // ---- replay (the document's dispatch rules) ----------------------------------------------

    /// A queue, ordered as the checkpoint orders them: levels by duration, then topics by name.
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum QKey {
        Level(u64),
        Topic(String),
    }

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
    }

    /// The derived state a replay of the log predicts.
    #[derive(Default)]
    pub struct Model {
        pub slots: BTreeMap<u64, Slot>,
        pub queues: BTreeMap<QKey, Vec<(u64, u32, u64)>>,
        pub reserved: BTreeMap<String, u64>,
        pub dead: BTreeMap<String, u64>,
        pub ids: HashMap<Vec<u8>, u64>,
        pub causes_seen: BTreeSet<u8>,
        pub hops: usize,
    }

    impl Model {
        fn touch(&mut self, q: QKey) -> &mut Vec<(u64, u32, u64)> {
            self.queues.entry(q).or_default()
        }
        fn route(&mut self, route: Route, topic_queue: &str, entry: (u64, u32, u64)) {
            match route {
                Route::None => {}
                Route::Topic => self.touch(QKey::Topic(topic_queue.to_string())).push(entry),
                Route::Level { level_ms, due_ms } => {
                    self.touch(QKey::Level(level_ms)).push((entry.0, entry.1, due_ms))
                }
            }
        }
    }

    fn put_of(log: &Log, msg_offset: u64) -> (&[u8], &[u8]) {
        let i = *log.by_offset.get(&msg_offset).unwrap_or_else(|| panic!("no record at {msg_offset}"));
        match &log.records[i].rec {
            Rec::Put { id, topic, .. } => (id, topic),
            other => panic!("record at {msg_offset} should be a Put, is {other:?}"),
        }
    }

    /// Replays the log from the start, checking the cross-record rules as it goes.
    pub fn replay(log: &Log, levels: &[u64]) -> Model {
        let mut m = Model::default();
        for l in levels {
            m.touch(QKey::Level(*l));
        }
        for r in &log.records {
            let (o, s) = (r.offset, r.len);
            match &r.rec {
                Rec::Put { deliver_at_ms, route, id, topic, .. } => {
                    assert!(!id.is_empty() && !topic.is_empty(), "empty id or topic at {o}");
                    assert!(m.ids.insert(id.clone(), o).is_none(), "id {id:?} produced twice");
                    assert_ne!(*route, Route::None, "a Put without a queue entry at {o}");
                    let state = if *route == Route::Topic { STATE_READY } else { STATE_DELAYED };
                    let slot = Slot {
                        hash: id_hash(id),
                        msg_offset: o,
                        last_offset: o,
                        seq: 0,
                        attempt: 0,
                        state,
                        dead_letter_home: false,
                    };
                    m.slots.insert(o, slot);
                    let topic = String::from_utf8(topic.clone()).unwrap();
                    m.route(*route, &topic, (o, s, *deliver_at_ms));
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
                    deliver_at_ms,
                    route,
                } => {
                    assert!(msg_offset < &o, "transition at {o} points forward");
                    let (id, topic) = put_of(log, *msg_offset);
                    assert_eq!(*h, id_hash(id), "transition at {o}: id_hash is not the hash of the id");
                    let topic = String::from_utf8(topic.to_vec()).unwrap();
                    let slot = m.slots.get_mut(msg_offset).unwrap();
                    assert_eq!(*seq, slot.seq + 1, "transition at {o}: seq is not dense");
                    assert_eq!(*prev_state, slot.state, "transition at {o}: prev_state is not the state");
                    slot.last_offset = o;
                    slot.seq = *seq;
                    slot.attempt = (*attempt).min(u32::from(u16::MAX)) as u16;
                    slot.state = *state;
                    slot.dead_letter_home = *home == HOME_DEAD_LETTER;
                    m.causes_seen.insert(*cause);
                    let queue =
                        if *home == HOME_DEAD_LETTER { format!("{topic}.dlq") } else { topic.clone() };
                    let prev_queue = if *cause == CAUSE_DEAD_LETTER { topic.clone() } else { queue.clone() };
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
                Rec::Hop { msg_offset, id_hash: h, seq, route } => {
                    let (id, _) = put_of(log, *msg_offset);
                    assert_eq!(*h, id_hash(id), "hop at {o}: id_hash is not the hash of the id");
                    assert!(*seq <= m.slots[msg_offset].seq, "hop at {o} continues a future timer");
                    assert!(matches!(route, Route::Level { .. }), "hop at {o} is not routed to a level");
                    m.hops += 1;
                    m.route(*route, "", (o, s, 0));
                }
                Rec::EndOfSegment => unreachable!("markers are not listed"),
            }
        }
        m
    }

    // ---- consume queues ---------------------------------------------------------------------

    /// The written entries of the queue in `dir`, and how many files hold them.
    pub fn read_queue(dir: &Path) -> (Vec<(u64, u32, u64)>, usize) {
        let files = numbered(dir, 20);
        let mut entries = vec![];
        let mut per_file = None;
        let mut ended = false;
        for (k, (first, path)) in files.iter().enumerate() {
            let bytes = fs::read(path).unwrap();
            assert!(
                !bytes.is_empty() && bytes.len() % 20 == 0,
                "{}: size not a multiple of 20",
                path.display()
            );
            let n = (bytes.len() / 20) as u64;
            assert_eq!(*per_file.get_or_insert(n), n, "{}: files differ in size", path.display());
            assert_eq!(*first, k as u64 * n, "{}: files must be named 0, N, 2N, ...", path.display());
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
        (entries, files.len())
    }

    /// Checks each entry against the record it points at, per the queue family.
    pub fn check_queue_entries(log: &Log, key: &QKey, entries: &[(u64, u32, u64)]) {
        for w in entries.windows(2) {
            assert!(w[0].0 < w[1].0, "{key:?}: entries do not ascend in log offset");
        }
        for &(off, size, tag) in entries {
            let i =
                *log.by_offset.get(&off).unwrap_or_else(|| panic!("{key:?}: {off} is not a record boundary"));
            let r = &log.records[i];
            assert_eq!(size, r.len, "{key:?}: entry size is not the record length at {off}");
            match (key, &r.rec) {
                (QKey::Level(l), Rec::Put { route, .. })
                | (QKey::Level(l), Rec::Transition { route, .. })
                | (QKey::Level(l), Rec::Hop { route, .. }) => {
                    assert_eq!(*route, Route::Level { level_ms: *l, due_ms: tag }, "{key:?} at {off}");
                }
                (QKey::Topic(t), Rec::Put { route, topic, deliver_at_ms, .. }) => {
                    assert_eq!(*route, Route::Topic, "{key:?} at {off}");
                    assert_eq!(t.as_bytes(), &topic[..], "{key:?}: Put of another topic at {off}");
                    assert_eq!(tag, *deliver_at_ms, "{key:?}: tag at {off}");
                }
                (QKey::Topic(t), Rec::Transition { route, msg_offset, home, deliver_at_ms, .. }) => {
                    assert_eq!(*route, Route::Topic, "{key:?} at {off}");
                    let (_, topic) = put_of(log, *msg_offset);
                    let topic = std::str::from_utf8(topic).unwrap();
                    let want = if *home == HOME_DEAD_LETTER { format!("{topic}.dlq") } else { topic.into() };
                    assert_eq!(t, &want, "{key:?}: transition of another queue at {off}");
                    assert_eq!(tag, *deliver_at_ms, "{key:?}: tag at {off}");
                }
                (k, rec) => panic!("{k:?}: entry at {off} points at {rec:?}"),
            }
        }
    }

    // ---- id index ---------------------------------------------------------------------------

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
        assert_eq!(le16(&b, 4), 2, "{name}: index version");
        assert_eq!(le16(&b, 6), 0, "{name}: index reserved bytes");
        let slots = le64(&b, 8);
        assert!(slots.is_power_of_two() && slots >= 64, "{name}: slot count {slots}");
        assert!(all_zero(&b[16..64]), "{name}: index header reserved bytes");
        assert_eq!(b.len() as u64, 64 + 32 * slots, "{name}: index file size");
        let slot = |i: u64| &b[64 + 32 * i as usize..64 + 32 * (i as usize + 1)];
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
            };
            let (id, _) = put_of(log, got.msg_offset);
            assert_eq!(got.hash, id_hash(id), "{name}: slot {i}: hash is not the hash of the Put's id");
            // Slots never move: every slot from the home slot up to this one is occupied.
            let mut j = got.hash & mask;
            while j != i {
                assert!(is_occupied(j), "{name}: slot {i}: empty slot {j} between its home slot and itself");
                j = (j + 1) & mask;
            }
            assert!(ids.insert(got.msg_offset), "{name}: two slots for the Put at {}", got.msg_offset);
            occupied.push((i, got, s[31] & 0x04 != 0));
        }
        IndexTable { slots, occupied }
    }

    /// Parses `index/ids` (and `index/ids.next` during a resize) and checks the messages they hold
    /// together against the log and the replay. Returns the larger slot count.
    pub fn check_index(dir: &Path, log: &Log, model: &Model) -> u64 {
        let old = read_index_table(&dir.join("ids"), log);
        let next_path = dir.join("ids.next");
        let next = next_path.exists().then(|| read_index_table(&next_path, log));
        // The messages: live slots of ids.next, plus live slots of ids that ids.next does not know.
        let mut live = BTreeMap::new();
        let mut known = BTreeSet::new();
        for (_, s, removed) in next.iter().flat_map(|t| &t.occupied) {
            known.insert(s.msg_offset);
            if !removed {
                live.insert(s.msg_offset, s.clone());
            }
        }
        for (_, s, removed) in &old.occupied {
            if !removed && !known.contains(&s.msg_offset) {
                live.insert(s.msg_offset, s.clone());
            }
        }
        for (off, got) in &live {
            assert_eq!(model.slots.get(off), Some(got), "slot for the Put at {off} differs from the replay");
        }
        assert_eq!(live.len(), model.slots.len(), "every Put has exactly one slot");
        old.slots.max(next.map_or(0, |t| t.slots))
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
    }

    /// Parses `checkpoint`: (dispatched, queues).
    pub fn read_checkpoint(path: &Path) -> (u64, Vec<CpQueue>) {
        let b = fs::read(path).unwrap();
        assert!(b.len() >= 24, "checkpoint too short");
        let (body, crc) = b.split_at(b.len() - 4);
        assert_eq!(crc32(&[body]), le32(crc, 0), "checkpoint crc");
        assert_eq!(&body[0..4], b"DLCK", "checkpoint magic");
        assert_eq!(le16(body, 4), 1, "checkpoint version");
        assert_eq!(le16(body, 6), 0, "checkpoint reserved");
        let dispatched = le64(body, 8);
        let n = le32(body, 16);
        let mut c = Cur { b: body, pos: 20 };
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
            });
        }
        assert_eq!(c.pos, body.len(), "checkpoint queue records do not end at the crc");
        (dispatched, queues)
    }

    /// Parses `clean_shutdown`: the log end.
    pub fn read_clean_marker(path: &Path) -> u64 {
        let b = fs::read(path).unwrap();
        assert_eq!(b.len(), 20, "clean marker size");
        assert_eq!(crc32(&[&b[..16]]), le32(&b, 16), "clean marker crc");
        assert_eq!(&b[0..4], b"DLCS", "clean marker magic");
        assert_eq!(le16(&b, 4), 1, "clean marker version");
        assert_eq!(le16(&b, 6), 0, "clean marker reserved");
        le64(&b, 8)
    }

    // ---- the whole directory ----------------------------------------------------------------

    /// What a full check found, for the scenario's own assertions.
    pub struct Report {
        pub log: Log,
        pub model: Model,
        pub index_slots: u64,
        pub queue_files: BTreeMap<QKey, usize>,
    }

    /// Parses every file of a cleanly shut down data directory and checks it against the document.
    pub fn check_data_dir(dir: &Path, levels: &[u64]) -> Report {
        // Only the documented names may exist (no temporaries after a clean shutdown).
        for e in fs::read_dir(dir).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(
                ["LOCK", "clean_shutdown", "checkpoint", "commitlog", "cq", "index"].contains(&name.as_str()),
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
        assert_eq!(pid, std::process::id(), "the broker ran in this process");

        let log = read_log(dir);
        let model = replay(&log, levels);

        // Queues on disk: exactly the ones the replay touched, each with exactly the predicted entries.
        let mut on_disk = BTreeMap::new();
        let mut queue_files = BTreeMap::new();
        for e in fs::read_dir(dir.join("cq")).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(name == "level" || name == "topic", "unexpected cq/{name}");
        }
        for (ms, path) in numbered(&dir.join("cq").join("level"), 12) {
            let (entries, files) = read_queue(&path);
            on_disk.insert(QKey::Level(ms), entries);
            queue_files.insert(QKey::Level(ms), files);
        }
        if dir.join("cq").join("topic").exists() {
            for e in fs::read_dir(dir.join("cq").join("topic")).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().into_string().unwrap();
                let topic = name.strip_prefix("t-").unwrap_or_else(|| panic!("cq/topic/{name} lacks t-"));
                let (entries, files) = read_queue(&e.path());
                on_disk.insert(QKey::Topic(topic.to_string()), entries);
                queue_files.insert(QKey::Topic(topic.to_string()), files);
            }
        }
        for (key, entries) in &on_disk {
            check_queue_entries(&log, key, entries);
        }
        let disk_keys: Vec<&QKey> = on_disk.keys().collect();
        let model_keys: Vec<&QKey> = model.queues.keys().collect();
        assert_eq!(disk_keys, model_keys, "queue directories vs queues the log implies");
        for (key, entries) in &on_disk {
            assert_eq!(entries, &model.queues[key], "{key:?}: entries differ from the replay of the log");
        }

        let index_slots = check_index(&dir.join("index"), &log, &model);

        let (dispatched, cp) = read_checkpoint(&dir.join("checkpoint"));
        assert_eq!(dispatched, log.end, "checkpoint.dispatched after a clean shutdown");
        let cp_keys: Vec<&QKey> = cp.iter().map(|q| &q.key).collect();
        assert_eq!(cp_keys, model_keys, "checkpoint lists every queue, levels first, then topics by name");
        for q in &cp {
            let entries = &on_disk[&q.key];
            assert_eq!(q.len, entries.len() as u64, "{:?}: checkpoint len vs entries in the files", q.key);
            assert!(q.cursor <= q.len, "{:?}: cursor past the end", q.key);
            match &q.key {
                QKey::Level(_) => assert_eq!((q.reserved, q.dead), (0, 0), "{:?}: level counters", q.key),
                QKey::Topic(t) => {
                    let want = (
                        model.reserved.get(t).copied().unwrap_or(0),
                        model.dead.get(t).copied().unwrap_or(0),
                    );
                    assert_eq!((q.reserved, q.dead), want, "{t}: checkpoint counters vs replay");
                }
            }
        }
        assert_eq!(read_clean_marker(&dir.join("clean_shutdown")), log.end, "clean marker log_end");
        Report { log, model, index_slots, queue_files }
    }
}

use reader::{check_data_dir, crc32, id_hash, QKey, Rec};

const LEVELS: [u64; 3] = [50, 200, 1000];

fn config(dir: &Path) -> BrokerConfig {
    let mut c = BrokerConfig::with_defaults(dir);
    c.segment_bytes = 64 << 10;
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
        assert!(matches!(b.nack(&d.receipt, Some(delay)).await.unwrap(), Nacked::Retry { .. }));
    }
    // A short time-to-run: these expire (one is finished by id first).
    let short = pop(&b, "orders", 10, Some(100)).await;
    assert_eq!(short.len(), 10);
    b.ack_id(&short[0].id).await.unwrap();
    let expiring = short[5].id.clone();
    for d in pop(&b, "dl", 5, None).await {
        assert!(matches!(b.nack(&d.receipt, None).await.unwrap(), Nacked::DeadLettered { .. }));
    }
    let dead = pop(&b, "dl.dlq", 2, None).await;
    assert_eq!(dead.len(), 2);
    b.ack(&dead[0].receipt).await.unwrap();

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_parses_with_only_the_format_document() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    write_scenario(&dir).await;
    let r = check_data_dir(&dir, &LEVELS);

    // The scenario reached every structure the document describes, so the checks above meant something.
    assert!(r.log.segments >= 3, "segments rolled: {}", r.log.segments);
    assert_eq!(r.log.end_of_segment_markers, r.log.segments - 1);
    assert!(r.index_slots > 64, "the index grew: {} slots", r.index_slots);
    assert!(r.queue_files[&QKey::Topic("orders".into())] > 1, "a queue spans files");
    assert!(r.model.queues.contains_key(&QKey::Topic("dl.dlq".into())), "dead-letter queue exists");
    assert!(r.model.hops > 0, "hop records were written");
    assert_eq!(r.model.causes_seen.iter().copied().collect::<Vec<_>>(), (1..=7).collect::<Vec<u8>>());
    let kinds = |f: fn(&Rec) -> bool| r.log.records.iter().filter(|x| f(&x.rec)).count();
    assert!(kinds(|x| matches!(x, Rec::Transition { .. })) > 0);
    assert!(kinds(|x| matches!(x, Rec::Put { request_kind: 2, .. })) == 1);
    assert!(kinds(|x| matches!(x, Rec::Put { request_kind: 3, .. })) == 1);
    assert!(
        kinds(|x| matches!(x, Rec::Put { backoff_ms, max_attempts: 1, .. } if backoff_ms == &[100, 200]))
            == 5
    );
    assert!(kinds(|x| matches!(x, Rec::Put { body, .. } if body.len() > 2000)) > 0);

    // Semantic spot checks through the document's meaning of the index.
    let slot_of = |id: &str| {
        let off = r.model.ids[id.as_bytes()];
        r.model.slots[&off].clone()
    };
    assert_eq!(slot_of("a").hash, 0x02c0_bdbf_4814_20f8);
    assert_eq!(slot_of("order-1").hash, 0xedf2_3fc2_e07f_a9d3);
    assert_eq!(slot_of("订单-42").hash, 0xf765_2255_494d_b662);
    assert_eq!(slot_of("f-3").state, reader::STATE_CANCELLED);
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
    let r2 = check_data_dir(&dir, &LEVELS);
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
    let r3 = check_data_dir(&dir, &LEVELS);

    // The reader is not vacuous: single-byte damage to each kind of file is caught.
    let put =
        r3.log.records.iter().find(|x| matches!(&x.rec, Rec::Put { body, .. } if body.len() > 100)).unwrap();
    let seg = std::fs::read_dir(dir.join("commitlog"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap().parse::<u64>().unwrap())
        .filter(|base| *base <= put.offset)
        .max()
        .unwrap();
    let at = (put.offset - seg) as usize + put.len as usize - 1;
    must_fail(&dir, &format!("commitlog/{seg:020}"), at, "crc mismatch");
    must_fail(&dir, "cq/topic/t-orders/00000000000000000000", 12, "tag");
    must_fail(&dir, "checkpoint", 9, "checkpoint crc");
    must_fail(&dir, "clean_shutdown", 9, "clean marker crc");
    // During a resize the live copy of a message may be in ids.next; damage the one that counts.
    let index_file = if dir.join("index/ids.next").exists() { "index/ids.next" } else { "index/ids" };
    let idx = std::fs::read(dir.join(index_file)).unwrap();
    let used = (0..(idx.len() - 64) / 32).find(|i| idx[64 + 32 * i + 31] & 0x05 == 0x01).unwrap();
    must_fail(&dir, index_file, 64 + 32 * used + 30, "differs from the replay");
}

/// Copies the data dir, flips one byte of `file` at `at`, and requires the reader to reject it
/// with a message containing `expect`.
fn must_fail(dir: &Path, file: &str, at: usize, expect: &str) {
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
    let err = std::panic::catch_unwind(|| check_data_dir(tmp.path(), &LEVELS)).err();
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
