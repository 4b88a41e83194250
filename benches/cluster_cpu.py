#!/usr/bin/env python3
"""CPU and context switches per write in each delayd process, thread by thread.

Starts three nodes (or one with --single) pinned to CPU 0 on fresh data directories, waits for a
leader, produces to it from this process (run it on another CPU: `taskset -c 1`) and reads each
thread's CPU time and voluntary / involuntary context switches from /proc before and after.
`--clients 1` sends one write at a time on one connection; more clients use that many connections
at once. `--perf "ARGS"` also runs `perf record ARGS -p PIDS -o FILE` over the measured window.

    taskset -c 1 python3 benches/cluster_cpu.py BIN SECONDS [--single] [--clients N] [--perf "-g"]

Run old and new binaries alternately, several times: this VM's figures move by a fifth between
runs. See docs/benchmarks.md, "Replicated cluster".
"""
import argparse, asyncio, glob, http.client, json, os, shutil, socket, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser()
ap.add_argument("bin")
ap.add_argument("secs", type=float)
ap.add_argument("--single", action="store_true")
ap.add_argument("--clients", type=int, default=1)
ap.add_argument("--perf", default=None)
ap.add_argument("--perf-out", default="perf.data")
a = ap.parse_args()


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    return port


n = 1 if a.single else 3
base = tempfile.mkdtemp(prefix="delayd-cpu-")
api = [free_port() for _ in range(n)]
links = [free_port() for _ in range(n)]
env = dict(os.environ, DELAYD_FLUSH="sync", DELAYD_LOG_LEVEL="warn")
if not a.single:
    env.update(DELAYD_PEERS=",".join(f"{i + 1}=127.0.0.1:{links[i]}" for i in range(n)),
               DELAYD_CLUSTER_SECRET="cluster-cpu-benchmark-secret")
procs = []
for i in range(n):
    args = ["taskset", "-c", "0", a.bin, "--data-dir", f"{base}/n{i + 1}", "--listen", f"127.0.0.1:{api[i]}"]
    if not a.single:
        args += ["--node-id", str(i + 1), "--cluster-listen", f"127.0.0.1:{links[i]}"]
    procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def stop():
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill(); p.wait()
    shutil.rmtree(base, ignore_errors=True)


leader = None
deadline = time.time() + 20
while leader is None and time.time() < deadline:
    time.sleep(0.1)
    try:
        c = http.client.HTTPConnection("127.0.0.1", api[0], timeout=2)
        c.request("GET", "/v1/stats" if a.single else "/v1/cluster")
        b = json.loads(c.getresponse().read())
        leader = 1 if a.single else (b.get("leader_id") or None)
    except (OSError, ValueError):
        pass
if leader is None:
    stop()
    sys.exit("no leader within 20 s")
time.sleep(1.0)
port = api[leader - 1]
tick = os.sysconf("SC_CLK_TCK")


def threads(pid):
    """(name:tid) -> [CPU ticks, voluntary switches, involuntary switches]."""
    out = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            st = open(t + "/stat").read()
            status = open(t + "/status").read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[f"{name}:{t.rsplit('/', 1)[1]}"] = [int(f[11]) + int(f[12]), vol, invol]
    return out


body = json.dumps({"body": "x" * 100, "delay_ms": 3600000})
request = (f"POST /v1/topics/t/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n{body}").encode()


async def client(until, count):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    while time.time() < until:
        w.write(request)
        head = await r.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 201"):
            raise RuntimeError(head[:60])
        await r.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        count[0] += 1
    w.close()


async def load(secs, clients):
    count = [0]
    await asyncio.gather(*(client(time.time() + secs, count) for _ in range(clients)))
    return count[0]


asyncio.run(load(0.5, a.clients))  # warm-up
perf = None
if a.perf is not None:
    perf = subprocess.Popen(["perf", "record", "-q", *a.perf.split(), "-o", a.perf_out,
                             "-p", ",".join(str(p.pid) for p in procs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
before = [threads(p.pid) for p in procs]
t0 = time.time()
writes = asyncio.run(load(a.secs, a.clients))
took = time.time() - t0
after = [threads(p.pid) for p in procs]
if perf:
    perf.send_signal(2); perf.wait()
print(f"{'one node' if a.single else f'leader node {leader}'}, {a.clients} client(s): {writes / took:,.0f} writes/s")
total = 0.0
for i, (b, f) in enumerate(zip(before, after)):
    rows = []
    for name, now in f.items():
        d = [x - y for x, y in zip(now, b.get(name, [0, 0, 0]))]
        if d[0] or d[1]:
            rows.append((name, d[0] / tick * 1e6 / writes, d[1] / writes, d[2] / writes))
    cpu = sum(r[1] for r in rows); total += cpu
    role = " (leader)" if i + 1 == leader else ""
    print(f"  node {i + 1}{role}: {cpu:.0f} us CPU a write, {sum(r[2] for r in rows):.2f} voluntary switches a write")
    for name, us, vol, invol in sorted(rows, key=lambda r: -r[1]):
        if us >= 0.5:
            print(f"    {name:24s} {us:6.1f} us  {vol:5.2f} vol  {invol:5.2f} invol")
print(f"  all nodes: {total:.0f} us CPU a write")
stop()
