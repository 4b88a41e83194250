#!/usr/bin/env python3
"""A delayd consumer loop to copy: pop, work, ack or nack with the error, touch long jobs, stop
gracefully on SIGTERM or Ctrl-C. Standard library only (Python 3.8+).

    DELAYD_URL=http://127.0.0.1:9277 DELAYD_TOKEN=... python3 worker.py orders

Replace `handle` with your work. A job that raises is nacked with the exception's text, which
delayd keeps as the message's last error (GET /v1/messages/{id}, the dashboard, dead letters).
"""

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

URL = os.environ.get("DELAYD_URL", "http://127.0.0.1:9277").rstrip("/")
TOKEN = os.environ.get("DELAYD_TOKEN", "")
# How long a popped message stays reserved before delayd gives it to another consumer. Long
# jobs are kept reserved by touching them every TTR_MS / 3 while they run.
TTR_MS = int(os.environ.get("DELAYD_TTR_MS", "30000"))
BATCH = int(os.environ.get("DELAYD_BATCH", "10"))
# A pop waits this long for a message; it also bounds how long a stop takes to be noticed.
WAIT_MS = 5000

stopping = threading.Event()


class DelaydError(Exception):
    """An answer other than 2xx, with delayd's error code."""

    def __init__(self, status, body):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def call(method, path, body=None, timeout=30.0):
    """One request; follows a cluster's 307 to the leader (urllib will not for a POST)."""
    data = None if body is None else json.dumps(body).encode()
    url = URL + path
    for _ in range(5):
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if TOKEN:
            req.add_header("Authorization", "Bearer " + TOKEN)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code in (307, 308) and e.headers.get("Location"):
                url = urllib.parse.urljoin(url, e.headers["Location"])
                continue
            raise DelaydError(e.code, e.read().decode(errors="replace")) from None
    raise DelaydError(307, "too many redirects")


def handle(message):
    """Your work. This one understands a few test bodies: {"sleep_ms": N} works N ms,
    {"fail": "why"} raises."""
    body = json.loads(message["body"]) if message["body"].startswith("{") else {}
    if body.get("sleep_ms"):
        time.sleep(body["sleep_ms"] / 1000)
    if body.get("fail"):
        raise RuntimeError(body["fail"])


def keep_reserved(receipt, done):
    """Touches the reservation every TTR_MS / 3 until `done` is set."""
    while not done.wait(TTR_MS / 3000):
        try:
            call("POST", "/v1/touch", {"receipt": receipt, "ttr_ms": TTR_MS})
        except (DelaydError, OSError) as e:
            print(f"touch failed: {e}", file=sys.stderr)


def settle(path, body):
    """An ack or nack, retried while delayd is unreachable or has no leader (503); any other
    refusal (e.g. 404: the reservation ran out and the message went to another consumer) is
    logged, as retrying cannot change it."""
    for attempt in range(10):
        try:
            return call("POST", path, body)
        except DelaydError as e:
            if e.status != 503:
                print(f"{path} refused: {e}", file=sys.stderr)
                return {}
        except OSError as e:
            print(f"{path} failed: {e}", file=sys.stderr)
        time.sleep(min(0.2 * 2**attempt, 5))
    return {}


def work_on(message):
    done = threading.Event()
    toucher = threading.Thread(target=keep_reserved, args=(message["receipt"], done), daemon=True)
    toucher.start()
    try:
        handle(message)
    except Exception as e:  # the job's failure, whatever it is, goes back to delayd
        done.set()
        toucher.join()
        error = f"{type(e).__name__}: {e}"[:2000]
        answer = settle("/v1/nack", {"receipt": message["receipt"], "error": error})
        print(f"{message['id']} nacked: {answer.get('state')}", flush=True)
        return
    done.set()
    toucher.join()
    if settle("/v1/ack", {"receipt": message["receipt"]}):
        print(f"{message['id']} acked", flush=True)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: worker.py TOPIC")
    topic = sys.argv[1]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"worker on {topic} at {URL}", flush=True)
    while not stopping.is_set():
        try:
            got = call("POST", f"/v1/topics/{topic}/pop?max={BATCH}&wait_ms={WAIT_MS}&ttr_ms={TTR_MS}",
                       timeout=WAIT_MS / 1000 + 30)
        except (DelaydError, OSError) as e:
            # delayd restarting, a leader election, a network blip: wait, then pop again.
            print(f"pop failed: {e}", file=sys.stderr)
            stopping.wait(1)
            continue
        # Messages already popped are finished even when a stop comes meanwhile: each is acked or
        # nacked, never left to its time-to-run.
        for message in got.get("messages", []):
            work_on(message)
    print("worker stopped", flush=True)


if __name__ == "__main__":
    main()
