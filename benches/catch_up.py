#!/usr/bin/env python3
"""How fast a catch-up becomes ready: M messages falling due at the same moment, with no consumer.

Starts BIN (pinned to CPU 0) on a fresh data directory, fills N messages due in 1 to 30 days,
produces M messages on topic `cu` all due at one time a little after they are in, then polls
`GET /v1/stats` every 50 ms from that time until all M are ready and prints the rate. With a
fourth argument, `perf record`s the server for 8 s from the due time into that file.

    python3 benches/catch_up.py BIN N M [PERF_OUT]

Run old and new binaries alternately, several times. See docs/benchmarks.md, "Scale".
"""
import http.client, json, os, random, shutil, socket, subprocess, sys, tempfile, time
bin_, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
perf_out = sys.argv[4] if len(sys.argv) > 4 else None
d = tempfile.mkdtemp(prefix="delayd-catchup-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, DELAYD_DATA_DIR=d, DELAYD_LISTEN=f"127.0.0.1:{port}", DELAYD_FLUSH="sync", DELAYD_LOG_LEVEL="warn")
p = subprocess.Popen(["taskset", "-c", "0", bin_], env=env, stderr=subprocess.DEVNULL)
def conn(): return http.client.HTTPConnection("127.0.0.1", port, timeout=60)
while True:
    try: c = conn(); c.request("GET", "/v1/stats"); c.getresponse().read(); break
    except OSError: time.sleep(0.05)
def fill(topic, count, mk):
    c = conn(); sent = 0
    while sent < count:
        k = min(1000, count - sent)
        c.request("POST", f"/v1/topics/{topic}/messages/batch", json.dumps({"messages": [mk() for _ in range(k)]}), {"Content-Type": "application/json"})
        r = c.getresponse(); r.read(); sent += k
t0 = time.time()
fill("bl", n, lambda: {"body": "x" * 100, "delay_ms": 86400000 + random.randrange(29 * 86400000)})
print(f"filled {n} in {time.time()-t0:.1f}s", flush=True)
# Room to produce all M before they fall due: 20,000 a second (measured 35,000 at 100 million).
due = int(time.time() * 1000) + 15000 + m // 20
t0 = time.time()
fill("cu", m, lambda: {"body": "y" * 100, "deliver_at_ms": due})
print(f"produced {m} due at once in {time.time()-t0:.1f}s; due in {(due/1000 - time.time()):.1f}s", flush=True)
if time.time() >= due / 1000:
    # Some fell due while the rest were still being produced: the rate would mix both.
    p.terminate(); p.wait()
    shutil.rmtree(d, ignore_errors=True)
    sys.exit("not measured: the due time passed before all were produced")
def ready():
    c = conn(); c.request("GET", "/v1/stats"); b = json.loads(c.getresponse().read())
    for t in b.get("topics", []):
        if t.get("topic") == "cu": return t.get("ready", 0)
    return 0
while time.time() < due / 1000: time.sleep(0.01)
pp = None
if perf_out:
    pp = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-p", str(p.pid), "-o", perf_out, "--", "sleep", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
start = time.time(); last = 0
while True:
    r = ready()
    if r >= m: break
    time.sleep(0.05)
took = time.time() - start
print(f"{m} ready in {took:.2f}s: {m/took:.0f}/s", flush=True)
if pp: pp.wait()
p.terminate(); p.wait()
shutil.rmtree(d, ignore_errors=True)
