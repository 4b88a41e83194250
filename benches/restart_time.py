#!/usr/bin/env python3
"""Restart time of a delayd server holding a large backlog: from spawning the binary to the first
pop that returns a message made ready before the stop.

Starts BIN on a fresh data directory (DELAYD_FLUSH=sync), produces 10 ready messages on topic
`probe` and N messages due in 1 to 30 days on topic `bl` (batches of 1000, 100-byte bodies), then
stops it with SIGTERM, SIGKILL and SIGTERM again, each time restarting it on the same data and
timing until a pop of `probe` returns a message. The server's `store opened` log line (on stderr,
kept in restart_time.log beside the data directory) says how the open's time was spent.

    python3 benches/restart_time.py BIN N

RESTART_KILLS=K repeats the SIGKILL restart K times (1). With RESTART_PERF=FILE the SIGKILL restart's first RESTART_PERF_SECS seconds (5) are profiled
with `perf record -a -g` into FILE.

Run old and new binaries one after the other, several times, and compare medians.
See docs/benchmarks.md, "Scale".
"""
import http.client, json, os, random, shutil, signal, socket, subprocess, sys, tempfile, time

bin_, n = sys.argv[1], int(sys.argv[2])
d = tempfile.mkdtemp(prefix="delayd-restart-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, DELAYD_DATA_DIR=d + "/data", DELAYD_LISTEN=f"127.0.0.1:{port}",
           DELAYD_FLUSH="sync", DELAYD_LOG_LEVEL="info")
log = open(d + "/restart_time.log", "w")
TIMINGS = ("log_ms", "check_ms", "replay_ms", "recount_ms", "redispatched")  # recount_ms: before 2026-11-27


def start():
    return subprocess.Popen([bin_], env=env, stdout=subprocess.DEVNULL, stderr=log)


def conn():
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def first_pop(t0):
    while True:
        try:
            c = conn()
            c.request("POST", "/v1/topics/probe/pop?max=1")
            r = c.getresponse()
            b = r.read()
            if r.status == 200 and json.loads(b)["messages"]:
                return time.time() - t0
        except OSError:
            pass
        time.sleep(0.005)


p = start()
try:
    while True:
        try:
            c = conn(); c.request("GET", "/v1/stats"); c.getresponse().read(); break
        except OSError:
            time.sleep(0.05)
    c = conn()
    for i in range(10):
        c.request("POST", "/v1/topics/probe/messages", json.dumps({"body": "p"}), {"Content-Type": "application/json"})
        c.getresponse().read()
    sent, t0 = 0, time.time()
    while sent < n:
        k = min(1000, n - sent)
        msgs = [{"body": "x" * 100, "delay_ms": 86400000 + random.randrange(29 * 86400000)} for _ in range(k)]
        c.request("POST", "/v1/topics/bl/messages/batch", json.dumps({"messages": msgs}), {"Content-Type": "application/json"})
        r = c.getresponse(); r.read()
        if r.status >= 300:
            sys.exit(f"batch refused: {r.status}")
        sent += k
    print(f"filled {n} in {time.time() - t0:.1f} s", flush=True)
    # Allocated bytes per held message, by part of the data directory.
    for part in ("commitlog", "index", "cq"):
        used = sum(os.stat(os.path.join(r, f)).st_blocks * 512
                   for r, _, fs in os.walk(f"{d}/data/{part}") for f in fs)
        print(f"  {part}: {used / 2**30:.2f} GiB, {used / n:.0f} B per message", flush=True)
    time.sleep(3)
    kills = int(os.environ.get("RESTART_KILLS", "1"))
    perf_done = False
    for sig in (signal.SIGTERM, *[signal.SIGKILL] * kills, signal.SIGTERM):
        p.send_signal(sig); p.wait()
        perf = None
        if sig == signal.SIGKILL and os.environ.get("RESTART_PERF") and not perf_done:
            perf_done = True
            # Every CPU, for a few seconds: the open runs on threads of its own.
            perf = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "499", "-o", os.environ["RESTART_PERF"],
                                     "--", "sleep", os.environ.get("RESTART_PERF_SECS", "5")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        t0 = time.time(); p = start()
        took = first_pop(t0)
        log.flush()
        opened = [l for l in open(d + "/restart_time.log") if "store opened" in l][-1:]
        fields = " ".join(w for l in opened for w in l.split() if w.split("=")[0] in TIMINGS)
        print(f"{sig.name}: first pop after {took:.3f} s ({fields})", flush=True)
        if perf:
            perf.wait()
        time.sleep(2)
finally:
    p.terminate(); p.wait()
    shutil.rmtree(d, ignore_errors=True)
