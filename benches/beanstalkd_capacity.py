#!/usr/bin/env python3
"""The backlog at which beanstalkd's RSS reaches a cap, and its bytes per job.

Starts beanstalkd on CPU 0 without a binlog (it keeps every job in RAM either way; the binlog
changes the time a fill takes, not what a job costs in memory), then puts jobs in chunks of 1
million over one pipelined connection: 100-byte bodies, delays of 1 to 30 days in whole seconds,
TTR 30 s, as delayd-bench's beanstalkd system produces them. After every chunk it prints the jobs
held and the server's VmRSS per job; it stops once VmRSS passes CAP_GIB (16).

    python3 benches/beanstalkd_capacity.py [CAP_GIB]

See docs/benchmarks.md, "Scale".
"""
import os, random, socket, subprocess, sys, threading, time

cap = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
CHUNK = 1_000_000
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
srv = subprocess.Popen(["taskset", "-c", "0", "beanstalkd", "-l", "127.0.0.1", "-p", str(port)])
os.sched_setaffinity(0, {1})


def rss_bytes():
    for line in open(f"/proc/{srv.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


try:
    for _ in range(200):
        try:
            c = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.05)
    c.sendall(b"use bl\r\n")
    if not c.recv(64).startswith(b"USING"):
        sys.exit("beanstalkd did not take `use bl`")
    rnd, held, t0, refused = random.Random(1), 0, time.time(), 0
    while True:
        replies = {"INSERTED": 0, "other": 0}

        def read(n):
            buf = b""
            got = 0
            while got < n:
                data = c.recv(1 << 20)
                if not data:
                    return
                buf += data
                lines = buf.split(b"\r\n")
                buf = lines.pop()
                for l in lines:
                    got += 1
                    replies["INSERTED" if l.startswith(b"INSERTED") else "other"] += 1

        reader = threading.Thread(target=read, args=(CHUNK,))
        reader.start()
        out = []
        for i in range(held, held + CHUNK):
            body = b"%d:" % i
            body += b"x" * (100 - len(body))
            out.append(b"put 0 %d 30 100\r\n%s\r\n" % (86400 + rnd.randrange(29 * 86400), body))
            if len(out) == 10_000:
                c.sendall(b"".join(out)); out = []
        c.sendall(b"".join(out))
        reader.join()
        held += replies["INSERTED"]
        refused += replies["other"]
        rss = rss_bytes()
        print(f"{time.time() - t0:7.1f} s: {held:,} jobs, VmRSS {rss / held:.0f} B/job ({rss / 2**30:.2f} GiB), "
              f"not inserted {refused}", flush=True)
        if rss >= cap * 2**30 or replies["other"]:
            print(f"RSS cap of {cap:g} GiB passed at {held:,} jobs held" if rss >= cap * 2**30
                  else f"refused at {held:,} jobs held")
            break
finally:
    srv.terminate(); srv.wait()
