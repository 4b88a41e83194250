//! The process' own resources, read from `/proc/self` (Linux) for the standard `process_*` metrics.
//!
//! Each value is read on its own; one that `/proc` does not give (another OS, a field missing) is
//! left out rather than reported as 0.

use std::path::Path;

/// Clock ticks per second of the times in `/proc/self/stat`: USER_HZ, which the kernel fixes at
/// 100 for user space on every architecture delayd builds for. Reading it needs `sysconf`, which
/// is `unsafe`; Prometheus' own Go client hard-codes 100 for the same reason.
const USER_HZ: f64 = 100.0;

/// One reading of the process' resources.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProcessStats {
    /// User plus system CPU time, seconds.
    pub cpu_seconds: Option<f64>,
    /// Resident memory, bytes.
    pub resident_memory_bytes: Option<u64>,
    /// Virtual memory, bytes.
    pub virtual_memory_bytes: Option<u64>,
    /// Open file descriptors.
    pub open_fds: Option<u64>,
    /// Soft limit on open file descriptors (absent when unlimited).
    pub max_fds: Option<u64>,
    /// Start time, unix seconds.
    pub start_time_seconds: Option<f64>,
    /// OS threads.
    pub threads: Option<u64>,
}

/// Reads this process' resources from `/proc`.
pub fn read() -> ProcessStats {
    read_from(Path::new("/proc"))
}

fn read_from(proc: &Path) -> ProcessStats {
    let text = |p: &str| std::fs::read_to_string(proc.join(p)).ok();
    let stat = text("self/stat").and_then(|s| parse_stat(&s));
    let status = text("self/status");
    let kib = |key: &str| status.as_deref().and_then(|s| status_field(s, key)).map(|v| v * 1024);
    let boot = text("stat").and_then(|s| parse_boot_time(&s));
    ProcessStats {
        cpu_seconds: stat.map(|s| (s.utime + s.stime) as f64 / USER_HZ),
        resident_memory_bytes: kib("VmRSS"),
        virtual_memory_bytes: kib("VmSize"),
        open_fds: std::fs::read_dir(proc.join("self/fd")).ok().map(|d| d.count() as u64),
        max_fds: text("self/limits").and_then(|s| parse_max_open_files(&s)),
        start_time_seconds: stat.zip(boot).map(|(s, boot)| boot as f64 + s.start_ticks as f64 / USER_HZ),
        threads: status.as_deref().and_then(|s| status_field(s, "Threads")),
    }
}

/// The fields of `/proc/self/stat` delayd reports, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
}

/// Parses `/proc/[pid]/stat`. The command name (field 2) may hold spaces and parentheses, so the
/// fields are counted from the last `)`.
fn parse_stat(s: &str) -> Option<Stat> {
    let rest = &s[s.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 (state): field n is at n - 3.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat { utime: field(14)?, stime: field(15)?, start_ticks: field(22)? })
}

/// A number after `key:` in `/proc/[pid]/status` (the unit, if any, is dropped).
fn status_field(s: &str, key: &str) -> Option<u64> {
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The boot time, unix seconds, from the `btime` line of `/proc/stat`.
fn parse_boot_time(s: &str) -> Option<u64> {
    s.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

/// The soft limit of the `Max open files` line of `/proc/[pid]/limits`.
fn parse_max_open_files(s: &str) -> Option<u64> {
    s.lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The limit on open file descriptors (`RLIMIT_NOFILE`): soft (what the process may open now)
/// and hard (what it may raise the soft limit to); `None` for unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLimit {
    /// The limit in force.
    pub soft: Option<u64>,
    /// The most the soft limit may be raised to.
    pub hard: Option<u64>,
}

impl FileLimit {
    /// The soft limit as a number of handles, unlimited as `u64::MAX`.
    pub fn soft_or_max(&self) -> u64 {
        self.soft.unwrap_or(u64::MAX)
    }
}

fn limit(v: libc::rlim_t) -> Option<u64> {
    (v != libc::RLIM_INFINITY).then_some(v)
}

/// Bytes an unprivileged writer may still use on the file system holding `dir` (statvfs:
/// available blocks times the fragment size), or None when it cannot be asked.
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data, valid when zeroed; the call reads a NUL-terminated path
    // that lives across it and writes one struct through a pointer to a live, writable one.
    #[allow(unsafe_code)]
    let (rc, st) = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(path.as_ptr(), &mut st), st)
    };
    if rc != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    let (avail, frsize) = (st.f_bavail as u64, st.f_frsize as u64);
    avail.checked_mul(frsize)
}

fn getrlimit_nofile() -> std::io::Result<libc::rlimit> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live, writable one.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rl)
}

/// This process' limit on open file descriptors now.
pub fn file_limit() -> std::io::Result<FileLimit> {
    let rl = getrlimit_nofile()?;
    Ok(FileLimit { soft: limit(rl.rlim_cur), hard: limit(rl.rlim_max) })
}

/// Raises the soft limit on open file descriptors to the hard limit, as Redis, nginx and Go
/// programs do: every connection and every open queue costs one, and the soft limit many systems
/// start a service with (1024) is far below what the hard limit allows. Returns the limit before
/// and after.
pub fn raise_file_limit() -> std::io::Result<(FileLimit, FileLimit)> {
    let before = getrlimit_nofile()?;
    if before.rlim_cur == before.rlim_max {
        let same = FileLimit { soft: limit(before.rlim_cur), hard: limit(before.rlim_max) };
        return Ok((same, same));
    }
    let raised = libc::rlimit { rlim_cur: before.rlim_max, rlim_max: before.rlim_max };
    // SAFETY: setrlimit reads one `rlimit` through a pointer to a live one.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((FileLimit { soft: limit(before.rlim_cur), hard: limit(before.rlim_max) }, file_limit()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_a_command_name_holding_spaces_and_parentheses() {
        let line = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 1500 0 0 0 250 75 0 0 20 0 9 0 \
                    123456 104857600 2048 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(parse_stat(line), Some(Stat { utime: 250, stime: 75, start_ticks: 123456 }));
        assert_eq!(parse_stat("4242 (cut"), None);
        assert_eq!(parse_stat("4242 (short) S 1 2"), None);
    }

    #[test]
    fn parses_status_limits_and_boot_time() {
        let status = "Name:\tdelayd\nVmSize:\t  204800 kB\nVmRSS:\t    8192 kB\nThreads:\t9\n";
        assert_eq!(status_field(status, "VmRSS"), Some(8192));
        assert_eq!(status_field(status, "VmSize"), Some(204_800));
        assert_eq!(status_field(status, "Threads"), Some(9));
        assert_eq!(status_field(status, "VmSwap"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
        assert_eq!(
            parse_max_open_files(
                "Max open files            unlimited            unlimited            files\n"
            ),
            None
        );
        assert_eq!(parse_boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 5\n"), Some(1_700_000_000));
    }

    #[test]
    fn reads_the_file_limit() {
        let l = file_limit().expect("getrlimit");
        assert!(l.soft.is_some_and(|s| s >= 3) || l.soft.is_none(), "{l:?}");
        assert!(l.soft_or_max() <= l.hard.unwrap_or(u64::MAX), "{l:?}");
    }

    #[test]
    fn reads_this_process_on_linux() {
        if !Path::new("/proc/self/stat").exists() {
            return;
        }
        let p = read();
        assert!(p.open_fds.is_some_and(|n| n >= 3), "{p:?}");
        assert!(p.resident_memory_bytes.is_some_and(|b| b > 0), "{p:?}");
        assert!(p.virtual_memory_bytes >= p.resident_memory_bytes, "{p:?}");
        assert!(p.cpu_seconds.is_some(), "{p:?}");
        assert!(p.threads.is_some_and(|n| n >= 1), "{p:?}");
        let started = p.start_time_seconds.expect("start time");
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        assert!(started > 1e9 && started <= now + 1.0, "{started} vs now {now}");
    }
}
