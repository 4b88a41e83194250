//! Starting, killing and restarting the servers under test, and reading their memory and disk use.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::systems::{Engine, System};

/// A process-unique scratch directory, removed on drop.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates a fresh directory under the system temp dir (or `base` when given).
    pub fn new(base: Option<&Path>, label: &str) -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let root = base.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
        let path = root.join(format!("delayd-bench-{}-{}-{}", std::process::id(), n, label));
        std::fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Removals still running in the background; `finish_cleanup` waits for them.
static CLEANUP: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

impl ScratchDir {
    /// Removes the directory now, waiting for the removal.
    pub fn remove_now(mut self) -> std::io::Result<()> {
        let path = std::mem::take(&mut self.path);
        std::fs::remove_dir_all(&path)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        // Deleting a data dir just written through a mapping can take seconds on ext4 while its
        // pages are written back; do it off the benchmark's path.
        let path = std::mem::take(&mut self.path);
        let h = std::thread::spawn(move || {
            let _ = std::fs::remove_dir_all(&path);
        });
        CLEANUP.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }
}

/// Waits until every scratch directory is gone.
pub fn finish_cleanup() {
    let handles = std::mem::take(&mut *CLEANUP.lock().unwrap_or_else(|e| e.into_inner()));
    for h in handles {
        let _ = h.join();
    }
}

/// Where to find the server programs.
#[derive(Debug, Clone)]
pub struct Programs {
    /// The delayd binary.
    pub delayd: PathBuf,
    /// redis-server, when installed.
    pub redis: Option<PathBuf>,
    /// beanstalkd, when installed.
    pub beanstalkd: Option<PathBuf>,
    /// Parent of the scratch directories.
    pub tmp_base: Option<PathBuf>,
    /// Extra `DELAYD_*` settings for every delayd started.
    pub delayd_env: Vec<(String, String)>,
    /// CPU list (`taskset -c` syntax) the servers run on; None when not pinned.
    pub server_cpus: Option<String>,
}

/// Asks the kernel for a free loopback port. Another process could take it before we bind it again,
/// but on a benchmark machine that race is rare and shows up as a clear start-up error.
pub fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Looks a program up on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

/// A running server under test with its own data directory and port.
pub struct Server {
    /// What runs here.
    pub system: System,
    /// Loopback port it listens on.
    pub port: u16,
    child: Option<Child>,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    data: ScratchDir,
    log_path: PathBuf,
    cpus: Option<String>,
}

impl Server {
    /// Starts a fresh server for `system` and waits until it answers.
    pub async fn start(system: System, progs: &Programs) -> Result<Server, String> {
        let port = free_port().map_err(|e| format!("no free port: {e}"))?;
        let mut server = Server::prepare(system, progs, &system.name(), port, Vec::new(), Vec::new())?;
        server.spawn_and_wait().await?;
        Ok(server)
    }

    /// A server for `system` on `port` with its own fresh data dir (named after `label`), with
    /// `extra_args` after its usual arguments and `extra_env` after its usual settings; not
    /// started yet.
    pub fn prepare(
        system: System,
        progs: &Programs,
        label: &str,
        port: u16,
        extra_args: Vec<String>,
        extra_env: Vec<(String, String)>,
    ) -> Result<Server, String> {
        let data = ScratchDir::new(progs.tmp_base.as_deref(), label)
            .map_err(|e| format!("cannot create a temp dir: {e}"))?;
        let log_path = data.path().join("server.log");
        let (program, mut args, mut envs) = match system.engine {
            Engine::Delayd => {
                let dir = data.path().join("data");
                let args = vec![
                    "--listen".to_string(),
                    format!("127.0.0.1:{port}"),
                    "--data-dir".to_string(),
                    dir.display().to_string(),
                ];
                let mut envs = vec![
                    ("DELAYD_FLUSH".to_string(), if system.strict { "sync" } else { "async" }.to_string()),
                    ("DELAYD_LOG_LEVEL".to_string(), "warn".to_string()),
                ];
                envs.extend(progs.delayd_env.iter().cloned());
                (progs.delayd.clone(), args, envs)
            }
            Engine::RedisLua | Engine::RedisPlain => {
                let Some(redis) = progs.redis.clone() else {
                    return Err("redis-server is not installed".to_string());
                };
                let dir = data.path().join("redis");
                std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                let args: Vec<String> = [
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    &dir.display().to_string(),
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    if system.strict { "always" } else { "everysec" },
                    "--save",
                    "",
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "yes",
                    "--loglevel",
                    "warning",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                (redis, args, Vec::new())
            }
            Engine::Beanstalkd => {
                let Some(bin) = progs.beanstalkd.clone() else {
                    return Err("beanstalkd is not installed".to_string());
                };
                let dir = data.path().join("binlog");
                std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                // -f 0: fsync the binlog after every write, as delayd's sync flush and Redis's
                // appendfsync always do.
                let args =
                    ["-l", "127.0.0.1", "-p", &port.to_string(), "-b", &dir.display().to_string(), "-f", "0"]
                        .iter()
                        .map(|s| s.to_string())
                        .collect();
                (bin, args, Vec::new())
            }
        };
        args.extend(extra_args);
        envs.extend(extra_env);
        Ok(Server {
            system,
            port,
            child: None,
            program,
            args,
            envs,
            data,
            log_path,
            cpus: progs.server_cpus.clone(),
        })
    }

    /// Starts the process without waiting for it to answer.
    pub fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| format!("cannot open {}: {e}", self.log_path.display()))?;
        let log2 = log.try_clone().map_err(|e| format!("cannot clone log handle: {e}"))?;
        // taskset execs the server in its own process, so the pid we keep is the server's.
        let mut cmd = match &self.cpus {
            Some(cpus) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpus).arg(&self.program);
                c
            }
            None => Command::new(&self.program),
        };
        cmd.args(&self.args).stdin(Stdio::null()).stdout(log).stderr(log2);
        if self.system.engine == Engine::Delayd {
            // delayd refuses to start on a DELAYD_* variable that is not one of its keys, and the
            // bench's own (DELAYD_BENCH_FONT) are set in the shell it inherits from.
            for (name, _) in std::env::vars_os() {
                let ours = name.as_encoded_bytes().starts_with(delayd::config::ENV_PREFIX.as_bytes());
                if ours && name.to_str().and_then(delayd::config::key_of_env_var).is_none() {
                    cmd.env_remove(&name);
                }
            }
        }
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Spawns the process and waits until it answers its protocol; returns how long that took.
    pub async fn spawn_and_wait(&mut self) -> Result<Duration, String> {
        let t0 = Instant::now();
        self.spawn()?;
        self.wait_ready(t0).await
    }

    /// Waits until the spawned process answers its protocol; returns how long since `t0`.
    pub async fn wait_ready(&mut self, t0: Instant) -> Result<Duration, String> {
        let deadline = t0 + Duration::from_secs(60);
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!(
                        "{} exited during start-up ({status}); its log says:\n{}",
                        self.program.display(),
                        self.log_tail()
                    ));
                }
            }
            if self.answers().await {
                return Ok(t0.elapsed());
            }
            if Instant::now() > deadline {
                self.kill9();
                return Err(format!(
                    "{} did not answer on port {} within 60 s; its log says:\n{}",
                    self.program.display(),
                    self.port,
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn answers(&self) -> bool {
        match self.system.engine {
            Engine::Delayd => {
                let url = format!("http://127.0.0.1:{}/healthz", self.port);
                let client = reqwest::Client::builder().timeout(Duration::from_millis(500)).build();
                match client {
                    Ok(c) => matches!(c.get(url).send().await, Ok(r) if r.status().is_success()),
                    Err(_) => false,
                }
            }
            Engine::RedisLua | Engine::RedisPlain => {
                let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port)) else {
                    return false;
                };
                let Ok(mut con) = client.get_multiplexed_async_connection().await else {
                    return false;
                };
                // While the AOF loads, Redis answers LOADING errors; that is not ready yet.
                redis::cmd("PING").query_async::<String>(&mut con).await.is_ok()
            }
            Engine::Beanstalkd => crate::beanstalk::answers(self.port).await,
        }
    }

    /// The last lines of the server's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The server's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the spawned process has exited (reaped if so).
    pub fn has_exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) => {
                self.child = None;
                true
            }
            Some(_) => false,
            None => true,
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait up to 10 s for a clean exit, else SIGKILL.
    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(10));
    }

    /// SIGTERM and wait up to `limit` for a clean exit, else SIGKILL. Returns how long the clean
    /// exit took; None when it had to be killed or nothing was running.
    pub fn stop_within(&mut self, limit: Duration) -> Option<Duration> {
        let mut child = self.child.take()?;
        let t0 = Instant::now();
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return Some(t0.elapsed()),
                Ok(None) if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(5)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return None;
                }
            }
        }
    }

    /// Stops the server and waits until nothing of it is left: the process exited and reaped, its
    /// data dir removed (which on ext4 can take seconds of writeback), the file system's dirty
    /// pages written back, its port free. Returns how
    /// long the process took to exit.
    pub fn finish(mut self) -> Result<Duration, String> {
        let t = Instant::now();
        self.stop();
        let exited = t.elapsed();
        let port = self.port;
        let data = std::mem::replace(&mut self.data, ScratchDir { path: PathBuf::new() });
        let path = data.path().to_path_buf();
        data.remove_now().map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
        // Whatever the server and the removal left dirty (a Redis AOF, the journal) is written back
        // now, not under the next server's fdatasyncs: a sync-mode lateness tail once measured 63 ms
        // in a full run against 2-5 ms on a quiet disk. `sync -f` syncs the one file system.
        if let Some(parent) = path.parent() {
            let _ = Command::new("sync").arg("-f").arg(parent).status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        // std binds with SO_REUSEADDR, so connections in TIME_WAIT do not count as "in use".
        while TcpListener::bind(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("port {port} still in use 10 s after the server exited"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(exited)
    }

    /// Anonymous resident memory of the server process in bytes (RssAnon in /proc/PID/status).
    pub fn rss_anon_bytes(&self) -> Option<u64> {
        status_bytes(self.pid()?, "RssAnon")
    }

    /// Resident memory of the server process in bytes (VmRSS: anonymous, file-backed and shared).
    pub fn rss_bytes(&self) -> Option<u64> {
        status_bytes(self.pid()?, "VmRSS")
    }

    /// (allocated, apparent) bytes of the server's data files, the log excluded.
    pub fn disk_bytes(&self) -> (u64, u64) {
        let mut total = (0, 0);
        let sub = match self.system.engine {
            Engine::Delayd => "data",
            Engine::Beanstalkd => "binlog",
            Engine::RedisLua | Engine::RedisPlain => "redis",
        };
        dir_usage(&self.data.path().join(sub), &mut total);
        total
    }

    /// (allocated, apparent) bytes under one subdirectory of a delayd data dir, e.g. `commitlog`;
    /// zeros when it does not exist.
    pub fn delayd_subdir_bytes(&self, sub: &str) -> (u64, u64) {
        let mut total = (0, 0);
        dir_usage(&self.data.path().join("data").join(sub), &mut total);
        total
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn dir_usage(dir: &Path, total: &mut (u64, u64)) {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for entry in rd.flatten() {
        let Ok(md) = entry.metadata() else { continue };
        if md.is_dir() {
            dir_usage(&entry.path(), total);
        } else {
            total.0 += md.blocks() * 512;
            total.1 += md.len();
        }
    }
}

/// `beanstalkd -v`, for the report.
pub fn beanstalkd_version(bin: &Path) -> String {
    Command::new(bin)
        .arg("-v")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

/// `redis-server --version`, for the report.
pub fn redis_version(redis: &Path) -> String {
    Command::new(redis)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

/// A memory figure of process `pid` from /proc/PID/status (`field` as "VmRSS"), in bytes.
pub fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| {
        let kib: u64 =
            l.strip_prefix(field)?.strip_prefix(':')?.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    })
}
