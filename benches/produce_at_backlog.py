#!/usr/bin/env python3
"""Batch produce throughput of a delayd server holding a backlog of N messages.

Starts BIN pinned to CPU 0 (DELAYD_FLUSH=sync, a fresh data directory), fills it with N messages
due in 1 to 30 days (4 clients, batches of 1,000, 100-byte bodies; the fill's time is printed,
and it grows the id index through every resize from its initial size), waits SETTLE seconds
(15), then runs ROUNDS rounds of SECS seconds (10) of 8 clients producing batches of 100 messages
due in an hour, from CPU 1. Each round prints msgs/s and the server's CPU per message. With
PERF_FILE the last round is profiled with `perf record -g -p PID`. After the fill and after the
rounds it prints the engine steps over 10 ms of CPU and the steps' id index resize parts, from
`/metrics`. With SLOW_STEPS=FILE the server logs each step over 10 ms with its parts (at debug
level, for its step timer only) and those lines are copied to FILE. The fill and each round also
print the server's major page faults and the bytes it read from the disk (a fault on a
preallocated page never written counts as major but reads nothing).

    python3 benches/produce_at_backlog.py BIN N [ROUNDS] [PERF_FILE]

Run old and new binaries one after the other, several times. See docs/benchmarks.md, "Scale".
"""
import http.client, json, os, random, shutil, socket, subprocess, sys, tempfile, threading, time
bin_, n = sys.argv[1], int(sys.argv[2])
if n <= 0 or n % 1000:
    sys.exit("N must be a positive multiple of 1000 (the fill's batch size)")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
perf_file = sys.argv[4] if len(sys.argv) > 4 else None
SECS = float(os.environ.get("SECS", "10"))
d = tempfile.mkdtemp(prefix="delayd-prod-", dir=os.environ.get("TMPDIR_BASE", "/tmp"))
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, DELAYD_DATA_DIR=d + "/data", DELAYD_LISTEN=f"127.0.0.1:{port}", DELAYD_FLUSH="sync",
           DELAYD_LOG_LEVEL="info,delayd::broker::step_timer=debug" if os.environ.get("SLOW_STEPS") else "info")
log = open(d + "/server.log", "w")
p = subprocess.Popen(["taskset", "-c", "0", bin_], env=env, stdout=subprocess.DEVNULL, stderr=log)
os.sched_setaffinity(0, {1})
def server_counters():
    """The server's user + system CPU seconds (every thread), major page faults and bytes read
    from the disk, so far."""
    fields = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
    io = dict(l.split(": ") for l in open(f"/proc/{p.pid}/io").read().splitlines())
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[9]), int(io["read_bytes"])
def conn(): return http.client.HTTPConnection("127.0.0.1", port, timeout=60)
def steps(when):
    """Prints the engine-step and index-resize figures of `/metrics`."""
    c = conn(); c.request("GET", "/metrics"); text = c.getresponse().read().decode()
    v = {}
    for line in text.splitlines():
        if not line.startswith("#") and " " in line:
            k, x = line.rsplit(" ", 1); v[k] = float(x)
    over = lambda h: int(v.get(h + "_count", 0) - v.get(h + '_bucket{le="0.01"}', 0))
    cpu, rs = "delayd_engine_step_cpu_seconds", "delayd_index_resize_step_seconds"
    print(f"{when}: {int(v.get(cpu + '_count', 0))} engine steps, {over(cpu)} over 10 ms of CPU (longest "
          f"{v.get(cpu + '_max', 0) * 1000:.1f} ms); {int(v.get(rs + '_count', 0))} steps resized the index, "
          f"{over(rs)} of those parts over 10 ms (longest {v.get(rs + '_max', 0) * 1000:.1f} ms); "
          f"index {int(v.get('delayd_index_entries', 0))} entries / {int(v.get('delayd_index_slots', 0))} slots", flush=True)
def post(c, path, body):
    c.request("POST", path, body, {"Content-Type": "application/json"}); r = c.getresponse(); r.read()
    if r.status >= 300: raise SystemExit(f"refused {r.status}")
try:
    while True:
        try: c = conn(); c.request("GET", "/v1/stats"); c.getresponse().read(); break
        except OSError: time.sleep(0.05)
    rnd = random.Random(1)
    pool = [json.dumps({"messages": [{"body": "x" * 100, "delay_ms": 86400000 + rnd.randrange(29 * 86400000)} for _ in range(1000)]}) for _ in range(64)]
    t0 = time.time(); lock = threading.Lock(); left = [n // 1000]
    def filler(k):
        c = conn(); i = k
        while True:
            with lock:
                if left[0] <= 0: return
                left[0] -= 1
            post(c, "/v1/topics/bl/messages/batch", pool[i % 64]); i += 7
    ts = [threading.Thread(target=filler, args=(k,)) for k in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    _, maj, rd = server_counters()
    print(f"filled {n} in {time.time()-t0:.1f} s ({maj} major faults, {rd / 2**20:.0f} MiB read)", flush=True)
    steps("after the fill")
    time.sleep(float(os.environ.get("SETTLE", "15")))
    body = json.dumps({"messages": [{"body": "y" * 100, "delay_ms": 3600000} for _ in range(100)]})
    for r in range(rounds):
        stop = time.time() + SECS; count = [0] * 8
        def w(k):
            c = conn()
            while time.time() < stop:
                post(c, "/v1/topics/load/messages/batch", body); count[k] += 100
        perf = None
        if perf_file and r == rounds - 1:
            perf = subprocess.Popen(["perf", "record", "-g", "-F", "999", "-p", str(p.pid), "-o", perf_file, "--", "sleep", str(SECS - 1)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu0, maj0, rd0 = server_counters()
        ws = [threading.Thread(target=w, args=(k,)) for k in range(8)]
        t1 = time.time(); [t.start() for t in ws]; [t.join() for t in ws]; el = time.time() - t1
        cpu1, maj1, rd1 = server_counters()
        if perf: perf.wait()
        cpu = cpu1 - cpu0
        print(f"round {r}: {sum(count)/el:.0f} msgs/s, server cpu {cpu/el*100:.0f}%, {cpu*1e6/max(1,sum(count)):.1f} us/msg, "
              f"{maj1 - maj0} major faults, {(rd1 - rd0) / 2**20:.0f} MiB read", flush=True)
        time.sleep(2)
    steps("after the rounds")
finally:
    p.terminate(); p.wait()
    if os.environ.get("SLOW_STEPS"):
        log.close()
        with open(d + "/server.log") as src, open(os.environ["SLOW_STEPS"], "w") as out:
            out.writelines(l for l in src if "slow engine step" in l)
    shutil.rmtree(d, ignore_errors=True)
