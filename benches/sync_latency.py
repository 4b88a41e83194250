#!/usr/bin/env python3
"""The disk's own fdatasync latency, with no delayd running: appends 200 bytes to a preallocated
file and fdatasyncs it, about 2,000 times a second (the sync rate of a 1,000 msgs/s stream popped
and acked in `sync` mode), and reports the latency percentiles and the windows of slow syncs
(over 1.5 ms) with their start times, so their period can be compared with a lateness run's.

    python3 benches/sync_latency.py [SECONDS] [DIR]

SECONDS defaults to 15, DIR to the current directory (put it on the disk delayd's data is on).
See docs/benchmarks.md, "Stream lateness".

With BESIDE=N another process writes one byte into N random pages a second of a 1 GiB file in
DIR, the way the id index takes a large backlog's slot writes (mapped with MADV_RANDOM, so each
page is a folio of its own, and written whole beforehand, as a long-lived table is), and
fdatasyncs it every BESIDE_SYNC_S seconds (5, as delayd's checkpoint does; 0: never, and the
kernel writes it back). Its preparation takes some 15 s before the measurement starts.
"""
import os, subprocess, sys, time

# The writer beside, run as `python3 -c BESIDE_WRITER RATE EVERY PATH`.
BESIDE_WRITER = r"""
import mmap, os, random, sys, time
rate, every, path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
size = 1 << 30
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.posix_fallocate(fd, 0, size)
m = mmap.mmap(fd, size)
m.madvise(mmap.MADV_RANDOM)
pages = size // 4096
for p in range(pages):
    m[p * 4096] = 1
os.fdatasync(fd)
print("ready", flush=True)
r, last = random.Random(7), time.monotonic()
while True:
    t = time.monotonic()
    for _ in range(rate // 100):
        p = r.randrange(pages)
        m[p * 4096 + 8] = (m[p * 4096 + 8] + 1) & 255
    if every and t - last >= every:
        a = time.monotonic()
        os.fdatasync(fd)
        print(f"the writer beside: its fdatasync took {time.monotonic() - a:.2f} s", file=sys.stderr, flush=True)
        last = time.monotonic()
    time.sleep(max(0, 0.01 - (time.monotonic() - t)))
"""

secs = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
path = os.path.join(sys.argv[2] if len(sys.argv) > 2 else ".", "sync_latency.dat")
beside, beside_path = None, path + ".beside"
if int(os.environ.get("BESIDE", "0")) > 0:
    beside = subprocess.Popen([sys.executable, "-c", BESIDE_WRITER, os.environ["BESIDE"],
                               os.environ.get("BESIDE_SYNC_S", "5"), beside_path], stdout=subprocess.PIPE, text=True)
    if beside.stdout.readline().strip() != "ready":
        sys.exit("the writer beside did not start")
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
    if beside:
        beside.kill()
        beside.wait()
        os.unlink(beside_path)

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
