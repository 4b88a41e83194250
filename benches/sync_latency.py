#!/usr/bin/env python3
"""The disk's own fdatasync latency, with no delayd running: appends 200 bytes to a preallocated
file and fdatasyncs it, about 2,000 times a second (the sync rate of a 1,000 msgs/s stream popped
and acked in `sync` mode), and reports the latency percentiles and the windows of slow syncs
(over 1.5 ms) with their start times, so their period can be compared with a lateness run's.

    python3 benches/sync_latency.py [SECONDS] [DIR]

SECONDS defaults to 15, DIR to the current directory (put it on the disk delayd's data is on).
See docs/benchmarks.md, "Stream lateness".
"""
import os, sys, time

secs = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
path = os.path.join(sys.argv[2] if len(sys.argv) > 2 else ".", "sync_latency.dat")
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
try:
    os.posix_fallocate(fd, 0, 64 << 20)
    buf, pos, lat = b"x" * 200, 0, []
    end = time.monotonic() + secs
    while time.monotonic() < end:
        os.pwrite(fd, buf, pos)
        pos = (pos + 200) % (64 << 20)
        t0 = time.monotonic()
        os.fdatasync(fd)
        lat.append((t0, (time.monotonic() - t0) * 1000))
        time.sleep(0.0004)
finally:
    os.close(fd)
    os.unlink(path)

s = sorted(ms for _, ms in lat)
n = len(s)
print(f"{n} syncs: p50 {s[n // 2]:.2f} ms, p99 {s[int(n * .99)]:.2f}, p99.9 {s[int(n * .999)]:.2f}, max {s[-1]:.2f}")
base, windows = lat[0][0], []
for t, ms in lat:
    if ms <= 1.5:
        continue
    if windows and t - windows[-1][1] < 0.05:
        w = windows[-1]
        w[1], w[2], w[3] = t, max(w[2], ms), w[3] + 1
    else:
        windows.append([t, t, ms, 1])
print(f"{len(windows)} windows of syncs over 1.5 ms (start s: longest ms x count):")
print(" ".join(f"{a - base:.2f}:{m:.1f}x{c}" for a, _, m, c in windows))
