#!/usr/bin/env python3
"""The largest backlog the Lua Redis delay queue holds under `maxmemory`, and its bytes per job.

Starts redis-server on CPU 0 with `maxmemory` MAXMEM (16gb), `noeviction`, and no AOF or RDB
(persistence changes the time a fill takes, not what a job costs in memory), then writes jobs in
chunks of 1 million through `redis-cli --pipe`, each exactly as delayd-bench's `redis-lua`
design stores it (its produce script's effects: `HSET job:{id}` with topic, a 100-byte body, due,
ttr, state, attempt and bucket, and `ZADD` into one of three bucket sets), due in 1 to 30 days.
After every chunk it prints the jobs held, `used_memory` and `used_memory_rss` per job; it stops
at the first chunk with a write refused, and prints how many jobs Redis then holds.

    python3 benches/redis_capacity.py [MAXMEM]

See docs/benchmarks.md, "Scale".
"""
import os, random, shutil, socket, subprocess, sys, tempfile, time

maxmem = sys.argv[1] if len(sys.argv) > 1 else "16gb"
CHUNK, BODY, BUCKETS = 1_000_000, 100, 3
d = tempfile.mkdtemp(prefix="redis-cap-")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
srv = subprocess.Popen(["taskset", "-c", "0", "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                        "--dir", d, "--save", "", "--appendonly", "no", "--maxmemory", maxmem,
                        "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
os.sched_setaffinity(0, {1})


def cli(*args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True).stdout


def fnv(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def bulk(x):
    return b"$%d\r\n%s\r\n" % (len(x), x)


def chunk(first, rnd, now):
    """RESP for jobs first .. first + CHUNK: the HSET and ZADD of delayd-bench's Lua produce."""
    out = []
    for seq in range(first, first + CHUNK):
        id_ = str(seq).encode()
        due = str(now + 86_400_000 + rnd.randrange(29 * 86_400_000)).encode()
        body = b"%s:%s:" % (id_, due)
        body += b"x" * (BODY - len(body))
        bucket = b"dq:bucket:%d" % (fnv(id_) % BUCKETS)
        out.append(b"*16\r\n" + b"".join(bulk(x) for x in (
            b"HSET", b"job:" + id_, b"topic", b"bl", b"body", body, b"due", due, b"ttr", b"30000",
            b"state", b"delay", b"attempt", b"0", b"bucket", bucket)))
        out.append(b"*4\r\n" + bulk(b"ZADD") + bulk(bucket) + bulk(due) + bulk(id_))
    return b"".join(out)


try:
    while True:
        if cli("PING").strip() == "PONG":
            break
        time.sleep(0.05)
    rnd, now, first, t0 = random.Random(1), int(time.time() * 1000), 0, time.time()
    while True:
        r = subprocess.run(["redis-cli", "-p", str(port), "--pipe"], input=chunk(first, rnd, now),
                           capture_output=True)
        first += CHUNK
        info = dict(l.split(":", 1) for l in cli("INFO", "memory").splitlines() if ":" in l)
        jobs = int(cli("DBSIZE").strip()) - BUCKETS
        used, rss = int(info["used_memory"]), int(info["used_memory_rss"])
        errors = r.stdout.decode().rsplit("errors: ", 1)[-1].split(",")[0].strip()
        print(f"{time.time() - t0:7.1f} s: {jobs:,} jobs, used_memory {used / jobs:.0f} B/job "
              f"({used / 2**30:.2f} GiB), RSS {rss / jobs:.0f} B/job ({rss / 2**30:.2f} GiB), errors {errors}",
              flush=True)
        if errors != "0":
            print(f"refused at {jobs:,} jobs held (maxmemory {maxmem})")
            break
finally:
    srv.terminate(); srv.wait()
    shutil.rmtree(d, ignore_errors=True)
