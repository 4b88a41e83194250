//! beanstalkd as a system under test, spoken to in its text protocol over TCP: `use` + `put` to
//! produce, `watch` + `reserve-with-timeout` to pop, `delete` to ack, `stats-tube` for the ready count.
//!
//! beanstalkd delays and TTRs are whole seconds: a delay is rounded up to the next second, and the due
//! time the bench measures lateness against is that rounded-up time (the body carries it), so its
//! lateness is never flattered by a due time it could not have honoured.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

use crate::queue::{body_for, now_ms, parse_body, Delivery, Job};

/// A reply line of beanstalkd, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `INSERTED <id>`: the put was accepted (written to the binlog first when it is on).
    Inserted(u64),
    /// `BURIED <id>`: the put was accepted but buried, as beanstalkd does when it cannot grow the
    /// ready queue's heap; a buried job is never delivered until kicked.
    Buried(u64),
    /// `RESERVED <id> <bytes>`; the body follows.
    Reserved(u64, usize),
    /// `DELETED`.
    Deleted,
    /// `NOT_FOUND`.
    NotFound,
    /// `TIMED_OUT`: nothing was ready within the reserve's timeout.
    TimedOut,
    /// `DEADLINE_SOON`: a job this connection holds is within a second of its TTR.
    DeadlineSoon,
    /// `USING <tube>`.
    Using(String),
    /// `WATCHING <count>`.
    Watching(u64),
    /// `NOT_IGNORED`: the last watched tube cannot be ignored.
    NotIgnored,
    /// `RELEASED`.
    Released,
    /// `OK <bytes>`; YAML data follows.
    Ok(usize),
}

/// A reply that says the command failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerError {
    /// `OUT_OF_MEMORY`: the server could not allocate memory for the job.
    OutOfMemory,
    /// `INTERNAL_ERROR`.
    Internal,
    /// `BAD_FORMAT`.
    BadFormat,
    /// `UNKNOWN_COMMAND`.
    UnknownCommand,
    /// `EXPECTED_CRLF`: the job body was not followed by CRLF.
    ExpectedCrlf,
    /// `JOB_TOO_BIG`: the body is over the server's `-z` limit.
    JobTooBig,
    /// `DRAINING`: the server takes no new jobs (SIGUSR1).
    Draining,
    /// Anything the protocol does not define.
    Unexpected(String),
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ServerError::OutOfMemory => "OUT_OF_MEMORY",
            ServerError::Internal => "INTERNAL_ERROR",
            ServerError::BadFormat => "BAD_FORMAT",
            ServerError::UnknownCommand => "UNKNOWN_COMMAND",
            ServerError::ExpectedCrlf => "EXPECTED_CRLF",
            ServerError::JobTooBig => "JOB_TOO_BIG",
            ServerError::Draining => "DRAINING",
            ServerError::Unexpected(line) => return write!(f, "unexpected reply {line:?}"),
        };
        write!(f, "beanstalkd answered {s}")
    }
}

/// Parses one reply line (without its CRLF).
pub fn parse_reply(line: &str) -> Result<Reply, ServerError> {
    let mut it = line.split(' ');
    let word = it.next().unwrap_or("");
    let args: Vec<&str> = it.collect();
    let bad = || ServerError::Unexpected(line.to_string());
    let num =
        |i: usize| -> Result<u64, ServerError> { args.get(i).and_then(|a| a.parse().ok()).ok_or_else(bad) };
    let reply = match (word, args.len()) {
        ("INSERTED", 1) => Reply::Inserted(num(0)?),
        ("BURIED", 1) => Reply::Buried(num(0)?),
        ("RESERVED", 2) => Reply::Reserved(num(0)?, num(1)? as usize),
        ("DELETED", 0) => Reply::Deleted,
        ("NOT_FOUND", 0) => Reply::NotFound,
        ("TIMED_OUT", 0) => Reply::TimedOut,
        ("DEADLINE_SOON", 0) => Reply::DeadlineSoon,
        ("USING", 1) => Reply::Using(args[0].to_string()),
        ("WATCHING", 1) => Reply::Watching(num(0)?),
        ("NOT_IGNORED", 0) => Reply::NotIgnored,
        ("RELEASED", 0) => Reply::Released,
        ("OK", 1) => Reply::Ok(num(0)? as usize),
        ("OUT_OF_MEMORY", 0) => return Err(ServerError::OutOfMemory),
        ("INTERNAL_ERROR", 0) => return Err(ServerError::Internal),
        ("BAD_FORMAT", 0) => return Err(ServerError::BadFormat),
        ("UNKNOWN_COMMAND", 0) => return Err(ServerError::UnknownCommand),
        ("EXPECTED_CRLF", 0) => return Err(ServerError::ExpectedCrlf),
        ("JOB_TOO_BIG", 0) => return Err(ServerError::JobTooBig),
        ("DRAINING", 0) => return Err(ServerError::Draining),
        _ => return Err(bad()),
    };
    Ok(reply)
}

/// The value of `key` in a `stats` / `stats-tube` YAML answer.
pub fn stats_value(yaml: &str, key: &str) -> Option<u64> {
    yaml.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A delay in whole seconds, rounded up: beanstalkd cannot delay by less than its delay.
pub fn delay_secs(delay_ms: u64) -> u64 {
    delay_ms.div_ceil(1000)
}

/// The `put` command for one job: header line, body, CRLF.
pub fn put_command(body: &str, delay_s: u64, ttr_s: u64) -> Vec<u8> {
    let mut v = format!("put 0 {delay_s} {ttr_s} {}\r\n", body.len()).into_bytes();
    v.extend_from_slice(body.as_bytes());
    v.extend_from_slice(b"\r\n");
    v
}

/// One connection and the tubes it uses and watches.
struct Conn {
    io: BufStream<TcpStream>,
    using: String,
    watching: String,
    /// The reply line read so far: a pop's wait can end while a line is half read, and the next
    /// read carries on from here.
    line: Vec<u8>,
    /// A blocking reserve was sent whose reply has not been read.
    outstanding: bool,
}

impl Conn {
    async fn open(port: u16) -> Result<Conn, String> {
        let s = TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| format!("connect: {e}"))?;
        let _ = s.set_nodelay(true);
        Ok(Conn {
            io: BufStream::new(s),
            using: "default".into(),
            watching: "default".into(),
            line: Vec::new(),
            outstanding: false,
        })
    }

    async fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.io.write_all(bytes).await.map_err(|e| format!("write: {e}"))?;
        self.io.flush().await.map_err(|e| format!("write: {e}"))
    }

    /// The next reply line; a server error is an `Ok(Err(..))` so the caller can read on.
    async fn reply(&mut self) -> Result<Result<Reply, ServerError>, String> {
        self.fill_line().await?;
        let line = std::mem::take(&mut self.line);
        let text = String::from_utf8_lossy(&line);
        Ok(parse_reply(text.trim_end_matches(['\r', '\n'])))
    }

    /// Reads until a whole reply line is buffered. Cancelling it loses nothing: `read_until` keeps
    /// what it read in `self.line`, and the next call goes on from there.
    async fn fill_line(&mut self) -> Result<(), String> {
        while !self.line.ends_with(b"\n") {
            let n = self.io.read_until(b'\n', &mut self.line).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("beanstalkd closed the connection".to_string());
            }
        }
        Ok(())
    }

    /// Reads the reply of a reserve left waiting by a pop that gave up, and releases the job it
    /// may have taken, so the connection can be used for something else.
    async fn settle(&mut self) -> Result<(), String> {
        if !self.outstanding {
            return Ok(());
        }
        let mut taken = Vec::new();
        take_reserved(self, &mut taken).await?;
        self.outstanding = false;
        for d in taken {
            let cmd = format!("release {} 0 0\r\n", d.token);
            self.expect(&cmd, |r| matches!(r, Reply::Released | Reply::Buried(_))).await?;
        }
        Ok(())
    }

    /// The `bytes` of data after a RESERVED or OK line, without its CRLF.
    async fn data(&mut self, bytes: usize) -> Result<Vec<u8>, String> {
        let mut buf = vec![0; bytes + 2];
        self.io.read_exact(&mut buf).await.map_err(|e| format!("read: {e}"))?;
        buf.truncate(bytes);
        Ok(buf)
    }

    async fn expect(&mut self, cmd: &str, ok: impl Fn(&Reply) -> bool) -> Result<Reply, String> {
        self.send(cmd.as_bytes()).await?;
        match self.reply().await? {
            Ok(r) if ok(&r) => Ok(r),
            Ok(r) => Err(format!("{} got {r:?}", cmd.trim_end())),
            Err(e) => Err(format!("{}: {e}", cmd.trim_end())),
        }
    }

    async fn use_tube(&mut self, tube: &str) -> Result<(), String> {
        if self.using != tube {
            self.expect(&format!("use {tube}\r\n"), |r| matches!(r, Reply::Using(_))).await?;
            self.using = tube.to_string();
        }
        Ok(())
    }

    /// Watches `tube` alone, so a reserve takes only its jobs.
    async fn watch_only(&mut self, tube: &str) -> Result<(), String> {
        if self.watching != tube {
            self.expect(&format!("watch {tube}\r\n"), |r| matches!(r, Reply::Watching(_))).await?;
            let old = std::mem::replace(&mut self.watching, tube.to_string());
            self.expect(&format!("ignore {old}\r\n"), |r| matches!(r, Reply::Watching(_))).await?;
        }
        Ok(())
    }
}

/// Whether a beanstalkd answers on `port` (used while it starts).
pub async fn answers(port: u16) -> bool {
    match Conn::open(port).await {
        Ok(mut c) => c.expect("list-tubes\r\n", |r| matches!(r, Reply::Ok(_))).await.is_ok(),
        Err(_) => false,
    }
}

/// A beanstalkd client. Clones share the connection: beanstalkd lets only the connection that
/// reserved a job delete it, so a consumer's acks must go where its pops went.
#[derive(Clone)]
pub struct BeanQ {
    port: u16,
    body_bytes: usize,
    conn: Arc<tokio::sync::Mutex<Option<Conn>>>,
}

impl BeanQ {
    /// A client for the beanstalkd on `port`; it connects on first use.
    pub fn new(port: u16, body_bytes: usize) -> BeanQ {
        BeanQ { port, body_bytes, conn: Arc::new(tokio::sync::Mutex::new(None)) }
    }

    async fn lock(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Conn>>, String> {
        let mut guard = self.conn.lock().await;
        if guard.is_none() {
            *guard = Some(Conn::open(self.port).await?);
        }
        Ok(guard)
    }

    /// Puts `jobs` on `topic` in one pipeline: per-job acceptance (a BURIED job is not accepted:
    /// it would never be delivered), or the first error reply, read after every reply so the
    /// connection stays in step.
    pub async fn produce(&self, topic: &str, jobs: &[Job]) -> Result<Vec<bool>, String> {
        let mut g = self.lock().await?;
        let Some(c) = g.as_mut() else { return Err("no connection".to_string()) };
        let r = put_all(c, topic, jobs, self.body_bytes).await;
        if matches!(r, Err(Fail::Io(_))) {
            *g = None;
        }
        r.map_err(Fail::into_string)
    }

    /// Reserves up to `max` jobs of `topic`, waiting up to `wait_ms` for the first. `ttr_ms` is not
    /// used: beanstalkd fixes a job's TTR when it is put.
    pub async fn pop(&self, topic: &str, max: usize, wait_ms: u64) -> Result<Vec<Delivery>, String> {
        let mut g = self.lock().await?;
        let Some(c) = g.as_mut() else { return Err("no connection".to_string()) };
        let r = reserve(c, topic, max, wait_ms).await;
        if r.is_err() {
            *g = None;
        }
        r
    }

    /// Deletes a reserved job; false when the server no longer knew it (or it was not ours).
    pub async fn ack(&self, d: &Delivery) -> Result<bool, String> {
        let mut g = self.lock().await?;
        let Some(c) = g.as_mut() else { return Err("no connection".to_string()) };
        let cmd = format!("delete {}\r\n", d.token);
        let r = match c.settle().await {
            Ok(()) => c.expect(&cmd, |r| matches!(r, Reply::Deleted | Reply::NotFound)).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(r) => Ok(r == Reply::Deleted),
            Err(e) => {
                *g = None;
                Err(e)
            }
        }
    }

    /// Jobs of `topic` ready now (`current-jobs-ready`); 0 for a tube the server does not have.
    pub async fn ready_count(&self, topic: &str) -> Result<usize, String> {
        let mut g = self.lock().await?;
        let Some(c) = g.as_mut() else { return Err("no connection".to_string()) };
        let r = tube_ready(c, topic).await;
        if r.is_err() {
            *g = None;
        }
        r
    }
}

/// Why a produce failed: the connection (it must be dropped) or a reply (it stays usable).
enum Fail {
    Io(String),
    Refused(ServerError),
}

impl Fail {
    fn into_string(self) -> String {
        match self {
            Fail::Io(e) => e,
            Fail::Refused(e) => e.to_string(),
        }
    }
}

async fn put_all(c: &mut Conn, topic: &str, jobs: &[Job], body_bytes: usize) -> Result<Vec<bool>, Fail> {
    c.settle().await.map_err(Fail::Io)?;
    c.use_tube(topic).await.map_err(Fail::Io)?;
    let now = now_ms();
    let mut wire = Vec::new();
    for j in jobs {
        let delay_s = delay_secs(j.delay_ms);
        let due_ms = now + delay_s as i64 * 1000;
        let body = body_for(j.seq, due_ms, body_bytes);
        wire.extend(put_command(&body, delay_s, delay_secs(j.ttr_ms).max(1)));
    }
    c.send(&wire).await.map_err(Fail::Io)?;
    let mut out = Vec::with_capacity(jobs.len());
    let mut refused = None;
    for _ in jobs {
        match c.reply().await.map_err(Fail::Io)? {
            Ok(Reply::Inserted(_)) => out.push(true),
            Ok(Reply::Buried(_)) => out.push(false),
            Ok(r) => return Err(Fail::Io(format!("put got {r:?}"))),
            Err(e) => {
                refused.get_or_insert(e);
                out.push(false);
            }
        }
    }
    match refused {
        Some(e) => Err(Fail::Refused(e)),
        None => Ok(out),
    }
}

/// One blocking reserve, then `max - 1` non-blocking ones pipelined behind it. The server's timeout
/// is whole seconds, so the wait ends at `wait_ms` here and the reserve stays outstanding: the next
/// pop reads its reply instead of sending another. Dropping the connection instead would make
/// beanstalkd release a job it was just handing over, to be delivered again later.
async fn reserve(c: &mut Conn, topic: &str, max: usize, wait_ms: u64) -> Result<Vec<Delivery>, String> {
    if c.outstanding && c.watching != topic {
        c.settle().await?;
    }
    if !c.outstanding {
        c.watch_only(topic).await?;
        c.send(format!("reserve-with-timeout {}\r\n", delay_secs(wait_ms).max(1)).as_bytes()).await?;
        c.outstanding = true;
    }
    match tokio::time::timeout(Duration::from_millis(wait_ms.max(1)), c.fill_line()).await {
        Err(_) => return Ok(Vec::new()),
        Ok(r) => r?,
    }
    c.outstanding = false;
    let mut out = Vec::new();
    if !take_reserved(c, &mut out).await? || max <= 1 {
        return Ok(out);
    }
    c.send("reserve-with-timeout 0\r\n".repeat(max - 1).as_bytes()).await?;
    for _ in 1..max {
        take_reserved(c, &mut out).await?;
    }
    Ok(out)
}

/// Reads one reserve's reply; true when it reserved a job (pushed onto `out`).
async fn take_reserved(c: &mut Conn, out: &mut Vec<Delivery>) -> Result<bool, String> {
    match c.reply().await? {
        Ok(Reply::Reserved(id, bytes)) => {
            let at_ms = now_ms();
            let data = c.data(bytes).await?;
            let body = String::from_utf8_lossy(&data);
            let (seq, due_ms) = parse_body(&body).ok_or_else(|| format!("foreign body {body:?}"))?;
            out.push(Delivery { seq, due_ms, at_ms, token: id.to_string() });
            Ok(true)
        }
        Ok(Reply::TimedOut | Reply::DeadlineSoon) => Ok(false),
        Ok(r) => Err(format!("reserve got {r:?}")),
        Err(e) => Err(format!("reserve: {e}")),
    }
}

async fn tube_ready(c: &mut Conn, topic: &str) -> Result<usize, String> {
    c.settle().await?;
    c.send(format!("stats-tube {topic}\r\n").as_bytes()).await?;
    match c.reply().await? {
        Ok(Reply::Ok(bytes)) => {
            let data = c.data(bytes).await?;
            let yaml = String::from_utf8_lossy(&data);
            stats_value(&yaml, "current-jobs-ready")
                .map(|n| n as usize)
                .ok_or_else(|| "stats-tube without current-jobs-ready".to_string())
        }
        Ok(Reply::NotFound) => Ok(0),
        Ok(r) => Err(format!("stats-tube got {r:?}")),
        Err(e) => Err(format!("stats-tube: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_and_errors_are_named() {
        assert_eq!(parse_reply("INSERTED 17"), Ok(Reply::Inserted(17)));
        assert_eq!(parse_reply("BURIED 3"), Ok(Reply::Buried(3)));
        assert_eq!(parse_reply("RESERVED 5 100"), Ok(Reply::Reserved(5, 100)));
        assert_eq!(parse_reply("TIMED_OUT"), Ok(Reply::TimedOut));
        assert_eq!(parse_reply("DEADLINE_SOON"), Ok(Reply::DeadlineSoon));
        assert_eq!(parse_reply("DELETED"), Ok(Reply::Deleted));
        assert_eq!(parse_reply("NOT_FOUND"), Ok(Reply::NotFound));
        assert_eq!(parse_reply("RELEASED"), Ok(Reply::Released));
        assert_eq!(parse_reply("USING bench-x-1"), Ok(Reply::Using("bench-x-1".into())));
        assert_eq!(parse_reply("WATCHING 2"), Ok(Reply::Watching(2)));
        assert_eq!(parse_reply("OK 42"), Ok(Reply::Ok(42)));
        assert_eq!(parse_reply("OUT_OF_MEMORY"), Err(ServerError::OutOfMemory));
        assert_eq!(parse_reply("EXPECTED_CRLF"), Err(ServerError::ExpectedCrlf));
        assert_eq!(parse_reply("JOB_TOO_BIG"), Err(ServerError::JobTooBig));
        assert_eq!(parse_reply("DRAINING"), Err(ServerError::Draining));
        assert_eq!(parse_reply("INTERNAL_ERROR"), Err(ServerError::Internal));
        assert_eq!(ServerError::OutOfMemory.to_string(), "beanstalkd answered OUT_OF_MEMORY");
        for junk in ["", "INSERTED", "INSERTED x", "RESERVED 5", "HELLO", "DELETED 3"] {
            assert!(
                matches!(parse_reply(junk), Err(ServerError::Unexpected(_))),
                "{junk:?} should not parse"
            );
        }
    }

    #[test]
    fn delays_round_up_to_whole_seconds_and_puts_are_framed() {
        assert_eq!(delay_secs(0), 0);
        assert_eq!(delay_secs(1), 1);
        assert_eq!(delay_secs(1000), 1);
        assert_eq!(delay_secs(1001), 2);
        assert_eq!(put_command("abc", 2, 30), b"put 0 2 30 3\r\nabc\r\n".to_vec());
    }

    #[test]
    fn stats_values_are_found_by_key() {
        let yaml = "---\nname: t\ncurrent-jobs-urgent: 0\ncurrent-jobs-ready: 12\ncurrent-jobs-reserved: 3\n";
        assert_eq!(stats_value(yaml, "current-jobs-ready"), Some(12));
        assert_eq!(stats_value(yaml, "current-jobs-reserved"), Some(3));
        assert_eq!(stats_value(yaml, "current-jobs-delayed"), None);
    }

    /// Against a real beanstalkd: a put is reserved after its whole-second delay, carries the
    /// rounded-up due time, and a delete by the reserving client succeeds once.
    #[tokio::test]
    #[ignore = "needs beanstalkd (apt-get install beanstalkd); .ci/run installs it and runs this"]
    async fn a_real_beanstalkd_delays_reserves_and_deletes() {
        use crate::servers::{which, Programs, Server};
        use crate::systems::System;
        let bin = which("beanstalkd").expect("beanstalkd on PATH (apt-get install beanstalkd)");
        let progs = Programs {
            delayd: std::path::PathBuf::new(),
            redis: None,
            beanstalkd: Some(bin),
            tmp_base: None,
            delayd_env: Vec::new(),
            server_cpus: None,
        };
        let server = Server::start(System::BEANSTALKD, &progs).await.expect("beanstalkd starts");
        let q = BeanQ::new(server.port, 64);
        let t0 = now_ms();
        let jobs =
            [Job { seq: 1, delay_ms: 300, ttr_ms: 30_000 }, Job { seq: 2, delay_ms: 0, ttr_ms: 30_000 }];
        assert_eq!(q.produce("t", &jobs).await.expect("put"), vec![true, true]);
        assert_eq!(q.ready_count("t").await.expect("stats-tube"), 1, "the delayed job is not ready");
        let first = q.pop("t", 5, 200).await.expect("reserve");
        assert_eq!(first.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![2]);
        let later = q.pop("t", 5, 3_000).await.expect("reserve");
        assert_eq!(later.len(), 1);
        let d = &later[0];
        assert_eq!(d.seq, 1);
        assert!(d.due_ms >= t0 + 1000, "a 300 ms delay is due a whole second later");
        assert!(d.at_ms >= d.due_ms, "delivered {} ms before its due time", d.due_ms - d.at_ms);
        assert!(q.ack(d).await.expect("delete"));
        assert!(!q.ack(d).await.expect("second delete"), "a deleted job is gone");

        // A pop that gives up before beanstalkd's whole-second timeout leaves its reserve waiting:
        // the next pop takes up its reply, so the job comes once, on time, on the same connection.
        let t1 = now_ms();
        q.produce("t", &[Job { seq: 3, delay_ms: 500, ttr_ms: 30_000 }]).await.expect("put");
        assert!(q.pop("t", 5, 100).await.expect("reserve").is_empty(), "not due yet");
        let mut got = Vec::new();
        while got.is_empty() && now_ms() < t1 + 5_000 {
            got = q.pop("t", 5, 100).await.expect("reserve");
        }
        assert_eq!(got.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![3]);
        assert!(got[0].at_ms >= got[0].due_ms);
        assert!(q.ack(&got[0]).await.expect("delete"));

        // A job the waiting reserve took while nobody asked is released when the connection is
        // used for something else, not lost.
        q.produce("t", &[Job { seq: 4, delay_ms: 1, ttr_ms: 30_000 }]).await.expect("put");
        assert!(q.pop("t", 1, 1).await.expect("reserve").len() <= 1);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(q.ready_count("t").await.expect("stats-tube"), 1, "the job is ready again");
        let again = q.pop("t", 1, 500).await.expect("reserve");
        assert_eq!(again.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![4]);
        assert!(q.ack(&again[0]).await.expect("delete"));
        server.finish().expect("beanstalkd stops and its data dir is removed");
    }
}
