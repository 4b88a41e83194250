#!/usr/bin/env python3
"""Which files a running process's major page faults land in, and where in each.

Records the process's major faults with their addresses for SECONDS (`perf record -e
major-faults -d`, sampled), maps each address to the file mapped there (from /proc/PID/maps,
read at the start), and prints the faults per file, delayd's numbered segment and queue files
grouped by directory. For the file with the most faults it prints how they spread over it in
twentieths, so a copy's fronts or a random spread show.

    python3 benches/fault_map.py PID [SECONDS]

Run it while the load is on (for example beside `benches/produce_at_backlog.py`). See
docs/benchmarks.md, "Scale".
"""
import bisect, collections, os, subprocess, sys, tempfile

pid, secs = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
maps = []
for line in open(f"/proc/{pid}/maps"):
    f = line.split()
    lo, hi = (int(x, 16) for x in f[0].split("-"))
    maps.append((lo, hi, int(f[2], 16), f[5] if len(f) > 5 else "[anonymous]"))
maps.sort()
starts = [m[0] for m in maps]
with tempfile.TemporaryDirectory() as d:
    data = os.path.join(d, "faults.data")
    subprocess.run(["perf", "record", "-q", "-e", "major-faults", "-d", "-p", str(pid), "-o", data, "--",
                    "sleep", str(secs)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = subprocess.run(["perf", "script", "-i", data, "-F", "addr"], check=True, capture_output=True, text=True).stdout
addrs = [int(x, 16) for x in out.split()]


def group(path):
    """A file's name, with delayd's numbered files folded into their directory."""
    head, tail = os.path.split(path)
    return head + "/*" if tail.isdigit() else path


per, where = collections.Counter(), collections.defaultdict(list)
for a in addrs:
    i = bisect.bisect_right(starts, a) - 1
    if i < 0 or not maps[i][0] <= a < maps[i][1]:
        per["[not mapped at the start]"] += 1
        continue
    lo, hi, off, path = maps[i]
    per[group(path)] += 1
    where[path].append((a - lo + off, hi - lo + off))
print(f"{len(addrs)} major faults sampled in {secs:g} s")
for path, n in per.most_common(12):
    print(f"{n:8d}  {100 * n / max(1, len(addrs)):5.1f} %  {path}")
if where:
    path, spots = max(where.items(), key=lambda kv: len(kv[1]))
    size = max(end for _, end in spots)
    tw = collections.Counter(min(19, at * 20 // size) for at, _ in spots)
    print(f"spread over {path} ({size >> 20} MiB mapped), twentieths: " +
          " ".join(f"{k}:{tw[k]}" for k in range(20) if tw[k]))
