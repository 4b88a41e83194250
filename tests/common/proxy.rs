//! An in-test TCP proxy for one directed link, whose mode (pass, cut, blackhole, delay) can be
//! switched while connections are open: the partitions of the cluster tests.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a blocked read or accept waits before it looks at the stop flag again.
const POLL: Duration = Duration::from_millis(20);

/// What a link does with its traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward every byte as it comes.
    Pass,
    /// Close every open connection at once and close new ones as soon as they are accepted.
    Cut,
    /// Keep connections open but drop every byte, both ways.
    Blackhole,
    /// Forward each chunk this long after it arrived, in order.
    Delay(Duration),
}

/// State shared by the proxy's threads.
struct Shared {
    target: SocketAddr,
    mode: Mutex<Mode>,
    stop: AtomicBool,
    next_id: AtomicU64,
    /// Both sockets of every open connection, so a cut or a drop can close them from outside.
    conns: Mutex<HashMap<u64, (TcpStream, TcpStream)>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    fn mode(&self) -> Mode {
        *self.mode.lock().expect("mode lock")
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn spawn(self: &Arc<Self>, f: impl FnOnce(Arc<Shared>) + Send + 'static) {
        let me = Arc::clone(self);
        let handle = std::thread::spawn(move || f(me));
        let mut threads = self.threads.lock().expect("threads lock");
        threads.retain(|t| !t.is_finished());
        threads.push(handle);
    }

    /// Shuts down every open connection; their pump threads then see the end and exit.
    fn close_all(&self) {
        for (a, b) in self.conns.lock().expect("conns lock").values() {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

/// A proxy on 127.0.0.1 for one directed link to `target`; dropping it stops its threads and
/// closes its sockets.
pub struct LinkProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl LinkProxy {
    /// Starts a proxy listening on 127.0.0.1:0 that forwards to `target`, in `Pass` mode.
    pub fn start(target: SocketAddr) -> LinkProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        // Non-blocking so the accept loop can notice the stop flag.
        listener.set_nonblocking(true).expect("non-blocking listener");
        let shared = Arc::new(Shared {
            target,
            mode: Mutex::new(Mode::Pass),
            stop: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let me = Arc::clone(&shared);
        let accept = std::thread::spawn(move || accept_loop(listener, me));
        LinkProxy { addr, shared, accept: Some(accept) }
    }

    /// The address to connect to instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address traffic is forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.shared.target
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.shared.mode()
    }

    /// Switches the mode; `Cut` closes every open connection before it returns.
    pub fn set(&self, mode: Mode) {
        *self.shared.mode.lock().expect("mode lock") = mode;
        if mode == Mode::Cut {
            self.shared.close_all();
        }
    }

    /// How many connections are open through the proxy now.
    pub fn open_connections(&self) -> usize {
        self.shared.conns.lock().expect("conns lock").len()
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        self.shared.close_all();
        // Joined threads may have started others (a pump its writer): join until none are left.
        loop {
            let threads = std::mem::take(&mut *self.shared.threads.lock().expect("threads lock"));
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stopping() {
        match listener.accept() {
            Ok((client, _)) => {
                if shared.mode() == Mode::Cut {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                // Connecting may take a moment; the accept loop stays free meanwhile.
                shared.spawn(move |s| connect(client, s));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Connects an accepted client to the target and starts the pumps of both directions.
fn connect(client: TcpStream, shared: Arc<Shared>) {
    let _ = client.set_nonblocking(false);
    let Ok(server) = TcpStream::connect_timeout(&shared.target, Duration::from_secs(2)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
    let clones = (client.try_clone(), server.try_clone(), server.try_clone(), client.try_clone());
    let (Ok(c_read), Ok(s_write), Ok(s_read), Ok(c_write)) = clones else {
        return;
    };
    {
        let mut conns = shared.conns.lock().expect("conns lock");
        // A cut that came while connecting must not leave this connection open.
        if shared.mode() == Mode::Cut || shared.stopping() {
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        conns.insert(id, (client, server));
    }
    let left = Arc::new(AtomicU64::new(2));
    for (from, to) in [(c_read, s_write), (s_read, c_write)] {
        let left = Arc::clone(&left);
        shared.spawn(move |s| {
            pump(from, to, &s);
            // The last direction to finish forgets the connection.
            if left.fetch_sub(1, Ordering::SeqCst) == 1 {
                s.conns.lock().expect("conns lock").remove(&id);
            }
        });
    }
}

/// A chunk read from one side and when it may be written to the other.
struct Chunk {
    bytes: Vec<u8>,
    due: Instant,
}

/// Moves one direction: this thread reads and stamps, a writer thread sends each chunk when due.
fn pump(mut from: TcpStream, to: TcpStream, shared: &Arc<Shared>) {
    let _ = from.set_read_timeout(Some(POLL));
    let (tx, rx): (Sender<Chunk>, Receiver<Chunk>) = mpsc::channel();
    let writer_out = to.try_clone();
    shared.spawn(move |s| {
        if let Ok(out) = writer_out {
            write_loop(rx, out, &s);
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    while !shared.stopping() {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let due = match shared.mode() {
                    Mode::Pass => Instant::now(),
                    Mode::Delay(d) => Instant::now() + d,
                    Mode::Blackhole => continue,
                    Mode::Cut => break,
                };
                if tx.send(Chunk { bytes: buf[..n].to_vec(), due }).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => {
                // A reset on one side resets the other: nothing queued is worth delivering.
                let _ = to.shutdown(Shutdown::Both);
                break;
            }
        }
    }
    // The writer sends what is queued, then half-closes the other side, as the peer did.
    drop(tx);
    let _ = from.shutdown(Shutdown::Read);
}

fn write_loop(rx: Receiver<Chunk>, mut out: TcpStream, shared: &Arc<Shared>) {
    for chunk in rx {
        while Instant::now() < chunk.due {
            if shared.stopping() {
                return;
            }
            std::thread::sleep(chunk.due.saturating_duration_since(Instant::now()).min(POLL));
        }
        match shared.mode() {
            // Bytes queued before the link went dark are lost with it.
            Mode::Blackhole => continue,
            Mode::Cut => return,
            Mode::Pass | Mode::Delay(_) => {}
        }
        if out.write_all(&chunk.bytes).is_err() {
            let _ = out.shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = out.shutdown(Shutdown::Write);
}
