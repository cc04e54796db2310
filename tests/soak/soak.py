"""Soak test of `deltafin serve` on loopback (not part of CI; run by scripts/soak.sh).

Starts the server on a converted store, runs CLIENTS threads for SECONDS, each picking at random
among: chat (streamed and whole), completions (streamed and whole), Anthropic messages, streams
closed mid-way, hostile bodies (bad JSON, wrong types, bodies over the limit, large bodies under
it) and /tokenize. Reports requests served, 429s, client-side errors by kind, 5xx answers, and
the server's resident memory (VmRSS of /proc/PID/status) at start, every REPORT_EVERY seconds,
and at the end.

Exit status: 0 when the server stayed up, answered no 5xx and its RSS did not grow by more than
--max-rss-growth-mb between the first report and the end; 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai

# Loopback traffic must never go through a proxy from the environment.
os.environ["NO_PROXY"] = ",".join(x for x in [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"] if x)
os.environ["no_proxy"] = os.environ["NO_PROXY"]

MODEL = "soak"
LISTENING_RE = re.compile(r"deltafin serve: ready on http://([\d.]+):(\d+)")
WORDS = "the lighthouse keeper counted boats in the harbour while gulls argued over nets".split()


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Tally:
    """Counts by category, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: collections.Counter[str] = collections.Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.c)


def vm_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, host: str, port: int, max_body: int, tally: Tally) -> None:
        self.host, self.port, self.max_body, self.t = host, port, max_body, tally
        base = f"http://{host}:{port}"
        self.oai = openai.OpenAI(base_url=base + "/v1", api_key="soak", max_retries=0, timeout=120)
        self.ant = anthropic.Anthropic(base_url=base, api_key="soak", max_retries=0, timeout=120)
        self.actions = self.ACTIONS

    # -- outcome bookkeeping ------------------------------------------------------------------

    def status(self, action: str, code: int, expected_4xx: bool = False) -> None:
        if 200 <= code < 300:
            self.t.add("served")
        elif code == 429:
            self.t.add("429")
        elif code >= 500:
            self.t.add("5xx")
            self.t.add(f"5xx:{action}:{code}")
        elif expected_4xx:
            self.t.add("4xx expected (hostile input)")
        else:
            self.t.add(f"4xx unexpected:{action}:{code}")

    def client_error(self, action: str, e: BaseException) -> None:
        if isinstance(e, openai.APIStatusError):
            return self.status(action, e.status_code)
        if isinstance(e, anthropic.APIStatusError):
            return self.status(action, e.status_code)
        self.t.add(f"client error:{action}:{type(e).__name__}")

    # -- actions ------------------------------------------------------------------------------

    def chat(self, rng: random.Random, stream: bool) -> None:
        msgs = [{"role": "user", "content": prompt_text(rng, rng.randint(3, 60))}]
        n = rng.randint(1, 24)
        if stream:
            s = self.oai.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=n, stream=True,
                stream_options={"include_usage": True}, temperature=rng.choice([0, 0.8]),
            )
            finished = False
            for chunk in s:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            self.t.add("served" if finished else "client error:chat-stream:no finish_reason")
        else:
            r = self.oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n)
            assert r.choices[0].finish_reason in ("length", "stop", "tool_calls"), r
            self.t.add("served")

    def completion(self, rng: random.Random, stream: bool) -> None:
        n = rng.randint(1, 24)
        p = prompt_text(rng, rng.randint(3, 60))
        if stream:
            finished = False
            for chunk in self.oai.completions.create(model=MODEL, prompt=p, max_tokens=n, stream=True):
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            self.t.add("served" if finished else "client error:completion-stream:no finish_reason")
        else:
            r = self.oai.completions.create(model=MODEL, prompt=p, max_tokens=n, seed=rng.randint(0, 99))
            assert r.usage.completion_tokens >= 1, r
            self.t.add("served")

    def messages(self, rng: random.Random) -> None:
        msgs = [{"role": "user", "content": prompt_text(rng, rng.randint(3, 40))}]
        if rng.random() < 0.5:
            with self.ant.messages.stream(model=MODEL, max_tokens=rng.randint(1, 16), messages=msgs) as s:
                s.get_final_message()
        else:
            self.ant.messages.create(model=MODEL, max_tokens=rng.randint(1, 16), messages=msgs)
        self.t.add("served")

    def disconnect(self, rng: random.Random) -> None:
        """A stream closed after a few chunks: the server must cancel and free the engine."""
        s = self.oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt_text(rng, 20)}],
            max_tokens=200, stream=True,
        )
        for i, _ in enumerate(s):
            if i >= rng.randint(1, 4):
                break
        s.close()
        self.t.add("disconnected mid-stream")

    def raw(self, path: str, body: bytes, timeout: float = 120) -> int:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def hostile(self, rng: random.Random) -> None:
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"])
        kind = rng.choice(["bad json", "wrong types", "non-object", "over limit", "large"])
        if kind == "bad json":
            body = b'{"model": "soak", "messages": [{"role": "user", "content": "hi"'
        elif kind == "wrong types":
            body = json.dumps(rng.choice([
                {"model": MODEL, "messages": "hi", "max_tokens": 2},
                {"model": MODEL, "messages": [{"role": "user", "content": 3}], "max_tokens": 2},
                {"model": MODEL, "prompt": {"x": 1}, "max_tokens": "many"},
                {"model": 7, "prompt": "hi", "max_tokens": 2},
                {"model": MODEL, "prompt": [1, 2.5], "max_tokens": -1},
            ])).encode()
        elif kind == "non-object":
            body = rng.choice([b"[]", b"null", b"42", b'"text"', b"\xff\xfe garbage"])
        elif kind == "over limit":
            body = b'{"model": "soak", "prompt": "' + b"a" * (self.max_body + 1024) + b'"}'
        else:
            # Under the limit but far over the context: refused after tokenising (or tokenised,
            # for /tokenize).
            body = json.dumps({
                "model": MODEL, "max_tokens": 2, "prompt": " x" * 1_500_000,
                "messages": [{"role": "user", "content": " x" * 1_500_000}],
            }).encode()
        try:
            code = self.raw(path, body)
        except (BrokenPipeError, ConnectionResetError) as e:
            # Refused before the whole body went out (413 on a declared length over the limit).
            self.t.add(f"hostile: connection closed while sending ({type(e).__name__})")
            return
        self.status(f"hostile {kind} {path}", code, expected_4xx=True)

    def tokenize(self, rng: random.Random) -> None:
        if rng.random() < 0.2:
            body = {"prompt": prompt_text(rng, rng.randint(10_000, 200_000))}
        elif rng.random() < 0.5:
            body = {"messages": [{"role": "user", "content": prompt_text(rng, 50)}]}
        else:
            body = {"prompt": prompt_text(rng, rng.randint(1, 500))}
        self.status("tokenize", self.raw("/tokenize", json.dumps(body).encode()))

    ACTIONS = [
        ("chat-stream", 20), ("chat", 15), ("completion-stream", 10), ("completion", 10),
        ("messages", 8), ("disconnect", 10), ("hostile", 12), ("tokenize", 15),
    ]

    def one(self, rng: random.Random) -> None:
        action = rng.choices([a for a, _ in self.actions], [w for _, w in self.actions])[0]
        self.t.add(f"sent:{action}")
        try:
            match action:
                case "chat-stream":
                    self.chat(rng, stream=True)
                case "chat":
                    self.chat(rng, stream=False)
                case "completion-stream":
                    self.completion(rng, stream=True)
                case "completion":
                    self.completion(rng, stream=False)
                case "messages":
                    self.messages(rng)
                case "disconnect":
                    self.disconnect(rng)
                case "hostile":
                    self.hostile(rng)
                case "tokenize":
                    self.tokenize(rng)
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            self.client_error(action, e)
            if getattr(e, "status_code", 0) == 429:
                # Back off a little, not the full Retry-After: the point is to keep the queue full.
                time.sleep(rng.uniform(0.01, 0.2))
        except Exception as e:  # noqa: BLE001 - every failure kind is counted, none ends the soak
            self.client_error(action, e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--queue", type=int, default=4)
    ap.add_argument("--report-every", type=float, default=30)
    ap.add_argument("--max-body-bytes", type=int, default=8 << 20, help="the server's default --max-body-bytes")
    ap.add_argument("--max-rss-growth-mb", type=float, default=64)
    ap.add_argument("--log", default=None, help="server stderr file (default: beside the store)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--actions", default="",
        help="comma-separated subset of " + ",".join(a for a, _ in Soak.ACTIONS) + " (to find what grows memory)",
    )
    a = ap.parse_args()

    log_path = Path(a.log or Path(a.store).parent / "server.stderr")
    log = open(log_path, "wb")
    server = subprocess.Popen(
        [a.bin, "serve", "--model", a.store, "--port", "0", "--queue", str(a.queue), "--served-model-name", MODEL],
        stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
    )
    assert server.stdout is not None
    host = port = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = server.stdout.readline().decode(errors="replace")
        if not line:
            break
        m = LISTENING_RE.search(line)
        if m:
            host, port = m.group(1), int(m.group(2))
            break
    if port is None:
        print(f"the server did not start; see {log_path}", file=sys.stderr)
        server.kill()
        return 1
    threading.Thread(target=lambda: server.stdout.read(), daemon=True).start()

    tally = Tally()
    soak = Soak(host, port, a.max_body_bytes, tally)
    if a.actions:
        only = a.actions.split(",")
        unknown = set(only) - {x for x, _ in Soak.ACTIONS}
        if unknown:
            print(f"unknown actions {sorted(unknown)}", file=sys.stderr)
            server.kill()
            return 2
        soak.actions = [(x, w) for x, w in Soak.ACTIONS if x in only]
    stop = threading.Event()
    rss: list[tuple[float, int | None]] = []
    t0 = time.monotonic()

    def report(label: str) -> None:
        now = time.monotonic() - t0
        kib = vm_kib(server.pid, "VmRSS")
        rss.append((now, kib))
        s = tally.snapshot()
        mib = f"{kib / 1024:.1f} MiB" if kib is not None else "gone"
        print(
            f"[{now:6.1f}s] {label:5} RSS {mib:>10}  served {s.get('served', 0)}  429 {s.get('429', 0)}  "
            f"5xx {s.get('5xx', 0)}  hostile-4xx {s.get('4xx expected (hostile input)', 0)}  "
            f"client errors {sum(v for k, v in s.items() if k.startswith('client error'))}",
            flush=True,
        )

    report("start")

    def client(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        while not stop.is_set():
            soak.one(rng)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    next_report = a.report_every
    while True:
        left = a.seconds - (time.monotonic() - t0)
        if left <= 0:
            break
        time.sleep(min(1.0, left))
        if server.poll() is not None:
            print(f"the server exited ({server.returncode})", file=sys.stderr)
            break
        if time.monotonic() - t0 >= next_report:
            report("every")
            next_report += a.report_every
    stop.set()
    for t in threads:
        t.join(timeout=150)
    # Health and metrics once the load is gone.
    alive = server.poll() is None
    health = metrics = None
    if alive:
        time.sleep(1)
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        health = (r.status, r.read().decode())
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    report("end")
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
    stderr = log_path.read_text(errors="replace")

    s = tally.snapshot()
    print("\n== totals")
    for k in sorted(s):
        print(f"  {k:60} {s[k]}")
    if health:
        print(f"  /health after the load: {health[0]} {health[1]}")
    if metrics:
        keep = ("deltafin_requests_total", "deltafin_rejected_busy_total", "deltafin_cancelled_total",
                "deltafin_failed_total", "deltafin_generated_tokens_total", "deltafin_degraded")
        print("== server metrics")
        for line in metrics.splitlines():
            if line.startswith(keep):
                print("  " + line)
    panicked = "panicked" in stderr
    first = next((k for _, k in rss[1:] if k is not None), rss[0][1])
    last = rss[-1][1]
    growth_mb = (last - first) / 1024 if (first is not None and last is not None) else None
    print("== RSS (MiB): " + ", ".join(f"{t:.0f}s {k / 1024:.1f}" for t, k in rss if k is not None))
    if growth_mb is not None:
        print(f"== RSS growth from the first periodic report to the end: {growth_mb:+.1f} MiB")
    print(f"== server log: {log_path} ({stderr.count('ERROR')} ERROR lines, panicked: {panicked})")
    ok = alive and not panicked and s.get("5xx", 0) == 0 and growth_mb is not None and growth_mb <= a.max_rss_growth_mb
    print("SOAK " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
