#!/usr/bin/env python3
"""Compat `/push` of ids already in use (each replaces its message): pushes a second.

Starts BIN pinned to CPU 0 (DELAYD_FLUSH=sync, a fresh data directory), pushes N_IDS jobs due in
an hour one at a time, then for SECS seconds pushes random ones of those ids again from 4
connections (from CPU 1) and prints the rate. A replace whose new index slot lands on another page
than the old one syncs that page first (see storage-format.md, Dispatch: Put); this measures what
that costs.

    python3 benches/compat_replace.py BIN N_IDS SECS

Run old and new binaries one after the other, several times. See docs/benchmarks.md.
"""
import http.client, json, os, random, shutil, socket, subprocess, sys, tempfile, threading, time
bin_, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
d = tempfile.mkdtemp(prefix="delayd-repl-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, DELAYD_DATA_DIR=d + "/data", DELAYD_LISTEN=f"127.0.0.1:{port}", DELAYD_FLUSH="sync", DELAYD_LOG_LEVEL="warn")
p = subprocess.Popen(["taskset", "-c", "0", bin_], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
os.sched_setaffinity(0, {1})
def conn(): return http.client.HTTPConnection("127.0.0.1", port, timeout=60)
for _ in range(100):
    try:
        c = conn(); c.request("GET", "/v1/health"); c.getresponse().read(); break
    except Exception: time.sleep(0.1)
def push(c, i, delay):
    c.request("POST", "/push", json.dumps({"topic": "t", "id": f"job-{i}", "delay": delay, "ttr": 30, "body": "x" * 100}),
              {"Content-Type": "application/json"})
    r = c.getresponse(); r.read(); assert r.status == 200, r.status
c = conn()
for i in range(n): push(c, i, 3600)
counts = [0] * 4
stop = time.time() + secs
def worker(k):
    c = conn(); rnd = random.Random(k)
    while time.time() < stop:
        push(c, rnd.randrange(n), 3600); counts[k] += 1
ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
t0 = time.time(); [t.start() for t in ts]; [t.join() for t in ts]
print(f"{sum(counts) / (time.time() - t0):.0f} replaces/s ({n} ids)")
p.terminate(); p.wait(); shutil.rmtree(d)
