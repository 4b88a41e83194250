//! A bare HTTP/1.1 client on one `TcpStream`, for tests that watch the connection itself:
//! keep-alive, `Connection: close`, closes by the server and timeouts.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

use super::NEVER_HANG;

/// One answer as it came off the wire.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Status code.
    pub status: u16,
    /// Header fields, names in lower case, in order.
    pub headers: Vec<(String, String)>,
    /// The body (empty for an answer to `HEAD`).
    pub body: Vec<u8>,
}

impl Answer {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// Whether the server said it closes the connection after this answer.
    pub fn closes(&self) -> bool {
        self.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }

    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

/// A request as bytes: `Host` and, for a body, `Content-Length` are added.
pub fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: delayd.test\r\n");
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        out.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// One client connection and the bytes read past the last answer.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    /// Connects to `base` (`http://127.0.0.1:PORT`); reads and writes give up after [`NEVER_HANG`].
    pub fn open(base: &str) -> std::io::Result<Conn> {
        let addr = base.trim_start_matches("http://");
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(NEVER_HANG))?;
        stream.set_write_timeout(Some(NEVER_HANG))?;
        Ok(Conn { stream, buf: Vec::new() })
    }

    /// Writes raw bytes.
    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends `req` and reads its answer; `head` says the request was a `HEAD` (no answer body).
    pub fn exchange(&mut self, req: &[u8], head: bool) -> std::io::Result<Answer> {
        self.send(req)?;
        self.answer(head)
    }

    /// Reads one answer; an end of stream before it is complete is an `UnexpectedEof` error.
    pub fn answer(&mut self, head: bool) -> std::io::Result<Answer> {
        let end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            self.fill()?;
        };
        let text = String::from_utf8_lossy(&self.buf[..end]).into_owned();
        self.buf.drain(..end + 4);
        let mut lines = text.split("\r\n");
        let status_line = lines.next().unwrap_or("");
        let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| {
            std::io::Error::new(ErrorKind::InvalidData, format!("status line {status_line:?}"))
        })?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut answer = Answer { status, headers, body: Vec::new() };
        if head || status == 204 || status == 304 || (100..200).contains(&status) {
            return Ok(answer);
        }
        let len: usize = answer.header("content-length").and_then(|v| v.parse().ok()).ok_or_else(|| {
            std::io::Error::new(ErrorKind::InvalidData, format!("no content-length: {text}"))
        })?;
        while self.buf.len() < len {
            self.fill()?;
        }
        answer.body = self.buf.drain(..len).collect();
        Ok(answer)
    }

    /// Waits up to `limit` for the server to close the connection; true if it did (an end of
    /// stream or a reset), false if the connection was still open then.
    pub fn closed_within(&mut self, limit: Duration) -> bool {
        if self.stream.set_read_timeout(Some(limit)).is_err() {
            return true;
        }
        let mut chunk = [0u8; 4096];
        let closed = loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => break true,
                // Bytes after an answer that said close would be a bug of their own; keep reading.
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
        };
        let _ = self.stream.set_read_timeout(Some(NEVER_HANG));
        closed
    }

    /// Bytes received that were not part of an answer.
    pub fn unread(&self) -> &[u8] {
        &self.buf
    }

    fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 16 << 10];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "the server closed the connection"));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

impl Conn {
    /// Connects to `base` from the loopback address `source` (any of 127.0.0.0/8 on Linux), so a
    /// test can be several client addresses.
    pub fn open_from(base: &str, source: std::net::Ipv4Addr) -> std::io::Result<Conn> {
        let addr: std::net::SocketAddr = base
            .trim_start_matches("http://")
            .parse()
            .map_err(|e| std::io::Error::new(ErrorKind::InvalidInput, format!("{base}: {e}")))?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
        let stream = rt.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind((source, 0).into())?;
            socket.connect(addr).await?.into_std()
        })?;
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(NEVER_HANG))?;
        stream.set_write_timeout(Some(NEVER_HANG))?;
        Ok(Conn { stream, buf: Vec::new() })
    }
}
