//! CPU pinning: the servers under test on some CPUs, the benchmark's clients (and the Redis designs'
//! movers, which run in this process) on the others, so the load generator never takes CPU time from
//! the server it measures.

use crate::servers::which;

/// Which CPUs each side runs on, or why neither is pinned.
#[derive(Debug, Clone)]
pub struct Pinning {
    /// CPU list for the servers, in `taskset -c` syntax; None when not pinned.
    pub server: Option<String>,
    /// The report header's sentence about pinning.
    pub note: String,
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    Some(cpus)
}

fn cpu_list(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// The CPUs this process may run on, from /proc/self/status.
fn allowed_cpus() -> Option<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpu_list(line)
}

/// Splits the allowed CPUs: the first half (rounded up) for the servers, the rest for the clients.
pub fn split(cpus: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    if cpus.len() < 2 {
        return None;
    }
    let (server, client) = cpus.split_at(cpus.len().div_ceil(2));
    Some((server.to_vec(), client.to_vec()))
}

/// Pins this process to the client CPUs and returns the servers' CPUs. Must run before any other
/// thread starts (threads inherit the affinity of the thread that creates them).
pub fn pin(disabled: bool) -> Pinning {
    let not = |why: String| Pinning { server: None, note: format!("not pinned: {why}") };
    if disabled {
        return not("--no-pin".to_string());
    }
    let Some(cpus) = allowed_cpus() else {
        return not("cannot read the allowed CPUs from /proc/self/status".to_string());
    };
    let Some((server, client)) = split(&cpus) else {
        return not(format!("only {} CPU available", cpus.len()));
    };
    if which("taskset").is_none() {
        return not("taskset (util-linux) is not installed".to_string());
    }
    if let Err(e) = set_own_affinity(&client) {
        return not(format!("sched_setaffinity failed: {e}"));
    }
    Pinning {
        note: format!(
            "servers pinned to CPU {} (taskset), the benchmark's clients and the Redis movers to CPU {} \
             (sched_setaffinity)",
            cpu_list(&server),
            cpu_list(&client)
        ),
        server: Some(cpu_list(&server)),
    }
}

#[allow(unsafe_code)]
fn set_own_affinity(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data that CPU_ZERO/CPU_SET initialise; sched_setaffinity reads it
    // for the calling thread (pid 0) and keeps no pointer to it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cpus {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(std::io::Error::other(format!("CPU {c} is beyond CPU_SETSIZE")));
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_split_servers_first() {
        assert_eq!(parse_cpu_list("0-1"), Some(vec![0, 1]));
        assert_eq!(parse_cpu_list("0-2,5,7-8\n"), Some(vec![0, 1, 2, 5, 7, 8]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(split(&[0, 1]), Some((vec![0], vec![1])));
        assert_eq!(split(&[0, 1, 2]), Some((vec![0, 1], vec![2])));
        assert_eq!(split(&[4]), None);
        assert_eq!(cpu_list(&[0, 2]), "0,2");
    }
}
