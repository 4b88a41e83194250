#!/usr/bin/env python3
"""Server CPU after a burst of acked reservations: each leaves a timer that comes due when its
time-to-run ends and is read and skipped, work that looks like idle CPU if measured too soon.

Starts BIN (pinned to CPU 0) on a fresh data directory, fills N messages due in 1 to 30 days,
produces M ready messages on topic `cu`, pops them (time-to-run 30 s) and acks each with 4
clients, then prints the server's CPU (% of one core) every 5 s for 90 s.

    python3 benches/reservation_timers.py BIN N M

See docs/benchmarks.md, "Scale".
"""
import http.client, json, os, random, socket, subprocess, sys, tempfile, time, threading
bin_, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = tempfile.mkdtemp(prefix="delayd-timers-")
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
fill("bl", n, lambda: {"body": "x" * 100, "delay_ms": 86400000 + random.randrange(29 * 86400000)})
fill("cu", m, lambda: {"body": "y" * 100})
def worker():
    c = conn()
    while True:
        c.request("POST", "/v1/topics/cu/pop?max=1000&ttr_ms=30000"); b = json.loads(c.getresponse().read())
        if not b["messages"]: return
        for x in b["messages"]:
            c.request("POST", "/v1/ack", json.dumps({"receipt": x["receipt"]}), {"Content-Type": "application/json"}); c.getresponse().read()
t0 = time.time()
ts = [threading.Thread(target=worker) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"popped and acked {m} in {time.time()-t0:.1f}s", flush=True)
tick = os.sysconf("SC_CLK_TCK")
def cpu(): f = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split(); return int(f[11]) + int(f[12])
a = cpu(); t = time.time()
for i in range(18):
    time.sleep(5)
    b = cpu(); now = time.time()
    print(f"{now-t0:6.1f}s after the pops began: CPU {(b-a)/tick/(now-t)*100:5.2f}% of a core", flush=True)
    a, t = b, now
p.terminate(); p.wait()
import shutil; shutil.rmtree(d, ignore_errors=True)
