#!/usr/bin/env python3
"""Background hop load of long delays: the CPU a delayd server spends moving timers across
levels while nothing else happens.

Starts BIN on a fresh data directory pinned to CPU 0 (DELAYD_FLUSH from $FLUSH, default sync),
produces N messages due DELAY_MS plus a random 0..SPREAD_MS later (batches of 1000, 100-byte
bodies), waits 65 s so every timer is in its steady hopping, then reads the server's CPU time
(/proc/PID/stat) and `delayd_hops_total` over MEASURE_S seconds.

    python3 benches/hop_cost.py BIN N DELAY_MS "LEVELS" MEASURE_S [SPREAD_MS]

Time-scaled runs stand in for days: with levels 1/1440 of the real ones, a minute plays a day.
See docs/benchmarks.md, "Long delays: hops and the levels".
"""
import http.client, json, os, random, shutil, socket, subprocess, sys, tempfile, time

bin_, n, delay, levels, measure = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
spread = int(sys.argv[6]) if len(sys.argv) > 6 else 60000
data = tempfile.mkdtemp(prefix="delayd-hops-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
env = dict(os.environ, DELAYD_DATA_DIR=data, DELAYD_LISTEN=f"127.0.0.1:{port}",
           DELAYD_FLUSH=os.environ.get("FLUSH", "sync"), DELAYD_LEVELS=levels, DELAYD_LOG_LEVEL="warn")
server = subprocess.Popen(["taskset", "-c", "0", bin_], env=env, stderr=subprocess.DEVNULL)


def conn():
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def cpu_secs():
    f = open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def hops():
    c = conn(); c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith("delayd_hops_total "):
            return float(line.split()[1])
    raise SystemExit("no delayd_hops_total in /metrics")


try:
    for _ in range(200):
        try:
            c = conn(); c.request("GET", "/v1/stats"); c.getresponse().read(); break
        except OSError:
            time.sleep(0.05)
    c, sent, t0 = conn(), 0, time.time()
    while sent < n:
        k = min(1000, n - sent)
        msgs = [{"body": "x" * 100, "delay_ms": delay + random.randrange(spread)} for _ in range(k)]
        c.request("POST", "/v1/topics/hop/messages/batch", json.dumps({"messages": msgs}),
                  {"Content-Type": "application/json"})
        r = c.getresponse(); r.read()
        if r.status != 201:
            raise SystemExit(f"batch answered {r.status}")
        sent += k
    fill = time.time() - t0
    time.sleep(65)
    c0, h0, w0 = cpu_secs(), hops(), time.time()
    time.sleep(measure)
    c1, h1, w1 = cpu_secs(), hops(), time.time()
    rate = (h1 - h0) / (w1 - w0)
    per = (c1 - c0) / (h1 - h0) * 1e6 if h1 > h0 else float("nan")
    print(f"n={n} levels='{levels}' flush={env['DELAYD_FLUSH']} fill {n / fill:.0f}/s: "
          f"CPU {100 * (c1 - c0) / (w1 - w0):.2f}% of a core, {rate:.0f} hops/s, {per:.1f} us CPU per hop")
finally:
    server.terminate(); server.wait()
    shutil.rmtree(data, ignore_errors=True)
