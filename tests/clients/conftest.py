"""Shared fixtures for the `deltafin serve` client tests.

Everything here drives the real binary on loopback:

* ``store``            - the k3-tiny fixture converted once per session (``deltafin convert``).
* ``start_server``     - factory: ``start_server(*extra_args)`` launches ``deltafin serve`` and
                         returns a :class:`Server` (``.url`` is the base URL, no ``/v1``); the
                         process is stopped when the test ends.
* ``default_server``   - one plain server shared by the whole session.
* ``scripted_server``  - one server with ``--script`` (the scripted replies below).
* ``api_key_server``   - one server with ``--api-key`` (:data:`API_KEY`).

``--script`` and ``--token-delay-ms`` are test instruments: only a binary built with the cargo
feature ``test-instruments`` has them (``cargo build --features deltafin/test-instruments``;
``scripts/test.sh`` runs the tests against the one its ``cargo test`` run builds that way).
Release builds do not.

The scripted reply texts (Kimi K3's output markup) live in ONE place: the
"SCRIPTED REPLIES" section below.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest

# Loopback traffic must never go through a proxy from the environment.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(
        x for x in [os.environ.get(_var, ""), "127.0.0.1", "localhost", "::1"] if x
    )

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = REPO_ROOT / "fixtures" / "k3-tiny"
HF_DIR = FIXTURE_DIR / "hf"
TOKENIZER_CHECK = FIXTURE_DIR / "tokenizer_check.json"

SERVED_MODEL = "k3-tiny"
API_KEY = "deltafin-test-key-7f3a"
CLIENT_TIMEOUT = 60.0  # seconds, for every client call
STARTUP_TIMEOUT = 60.0  # seconds until the "listening on" line
DEFAULT_CONTEXT = 4096  # serve's default --context
LISTENING_RE = re.compile(r"deltafin serve: listening on (http://\S+)")
READY_RE = re.compile(r"deltafin serve: ready on (http://\S+)")

# =============================================================================================
# SCRIPTED REPLIES  (adjust here if the K3 output markup changes)
#
# `--script FILE` replaces the sampled tokens by the tokens of TEXT when the last user message
# (chat / messages) or the prompt (completions) contains WHEN. The prompt already ends with
# `<|open|>think<|sep|>`, so a reply starts inside the reasoning section.
# =============================================================================================


def k3_reasoning(text: str) -> str:
    """Reasoning section body plus its close (the open tag is the end of the prompt)."""
    return f"{text}<|close|>think<|sep|>"


def k3_response(text: str) -> str:
    return f"<|open|>response<|sep|>{text}<|close|>response<|sep|>"


def k3_tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """`calls` = [(name, {key: value})]; numbers become type="number" (K3's encoder has no
    integer type), strings type="string"."""
    out = ["<|open|>tools<|sep|>"]
    for index, (name, args) in enumerate(calls, start=1):
        out.append(f'<|open|>call tool="{name}" index="{index}"<|sep|>')
        for key, value in args.items():
            kind = "number" if isinstance(value, (int, float)) else "string"
            out.append(f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>')
        out.append("<|close|>call<|sep|>")
    out.append("<|close|>tools<|sep|>")
    return "".join(out)


K3_END_OF_MESSAGE = "<|close|>message<|sep|><|end_of_msg|>"

# "weather": reasoning + a short answer + one tool call.
WEATHER_TRIGGER = "weather"
WEATHER_PROMPT = "What is the weather in Paris for the next 3 days?"
WEATHER_REASONING = "The user wants weather."
WEATHER_ANSWER = "Let me check."
WEATHER_TOOL_NAME = "get_weather"
WEATHER_TOOL_ARGS = {"city": "Paris", "days": 3}
WEATHER_TEXT = (
    k3_reasoning(WEATHER_REASONING)
    + k3_response(WEATHER_ANSWER)
    + k3_tool_calls([(WEATHER_TOOL_NAME, WEATHER_TOOL_ARGS)])
    + K3_END_OF_MESSAGE
)

# "riddle": reasoning + answer, no tools.
RIDDLE_TRIGGER = "riddle"
RIDDLE_PROMPT = "Solve this riddle for me, please."
RIDDLE_REASONING = "Think step by step."
RIDDLE_ANSWER = "The answer is 42."
RIDDLE_TEXT = k3_reasoning(RIDDLE_REASONING) + k3_response(RIDDLE_ANSWER) + K3_END_OF_MESSAGE

# "marathon": a long reasoning-only reply that never ends early; keeps the engine busy for
# exactly max_tokens steps (used with --token-delay-ms by the concurrency tests).
MARATHON_TRIGGER = "marathon"
MARATHON_PROMPT = "Run the marathon."
MARATHON_TEXT = "tick tock " * 400

# "early end": the end-of-message token in the middle of a reply (for `ignore_eos`).
EARLY_END_TRIGGER = "early end"
EARLY_END_TEXT = "first<|end_of_msg|>second"

# "unicode please": characters that the tiny vocabulary spells as several byte tokens.
UNICODE_TRIGGER = "unicode please"
UNICODE_TEXT = "naïve café — 東京 🌍!"

SCRIPT = {
    "replies": [
        {"when": UNICODE_TRIGGER, "text": UNICODE_TEXT},
        {"when": EARLY_END_TRIGGER, "text": EARLY_END_TEXT},
        {"when": WEATHER_TRIGGER, "text": WEATHER_TEXT},
        {"when": RIDDLE_TRIGGER, "text": RIDDLE_TEXT},
        {"when": MARATHON_TRIGGER, "text": MARATHON_TEXT},
    ]
}

# OpenAI-format tool definition matching the weather script.
WEATHER_TOOL_OPENAI = {
    "type": "function",
    "function": {
        "name": WEATHER_TOOL_NAME,
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
            },
            "required": ["city", "days"],
        },
    },
}
# Anthropic-format tool definition matching the weather script.
WEATHER_TOOL_ANTHROPIC = {
    "name": WEATHER_TOOL_NAME,
    "description": "Weather forecast for a city.",
    "input_schema": WEATHER_TOOL_OPENAI["function"]["parameters"],
}

# A prompt with no trigger word, for tests of the (random) model itself.
PLAIN_PROMPT = "The lighthouse keeper counted the boats."


# =============================================================================================
# Binary, store, servers
# =============================================================================================


def _find_binary() -> Path:
    env = os.environ.get("DELTAFIN_BIN")
    if env:
        p = Path(env)
        if not p.is_absolute() and not p.exists():
            p = REPO_ROOT / p
        return p
    # The debug binary first: the test suite builds it with the test instruments; a release
    # build normally lacks them.
    for rel in ("target/debug/deltafin", "target/release/deltafin"):
        p = REPO_ROOT / rel
        if p.exists():
            return p
    return REPO_ROOT / "target/debug/deltafin"


def _instruments_hint(stderr: str) -> str:
    """A pointer to the cargo feature when the binary refused a test-instrument flag."""
    if any(f"unexpected argument '{flag}'" in stderr for flag in ("--script", "--token-delay-ms", "--inject-faults")):
        return (
            "\nthis binary was built without the test instruments; build it with "
            "`cargo build --features deltafin/test-instruments` (or set DELTAFIN_BIN)"
        )
    return ""


@pytest.fixture(scope="session")
def deltafin_bin() -> Path:
    path = _find_binary()
    if not path.exists():
        pytest.fail(
            f"deltafin binary not found at {path}; build it "
            "(cargo build --features deltafin/test-instruments) or set DELTAFIN_BIN",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def store(deltafin_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    proc = subprocess.run(
        [str(deltafin_bin), "convert", "--from", str(HF_DIR), "--to", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"deltafin convert failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}",
            pytrace=False,
        )
    return out


@pytest.fixture(scope="session")
def script_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT, indent=2))
    return path


@dataclass
class Server:
    """A running `deltafin serve` process."""

    url: str  # base URL without /v1, e.g. http://127.0.0.1:41234
    args: list[str]
    proc: subprocess.Popen
    stderr_path: Path
    stdout_lines: list[str] = field(default_factory=list)
    stdout_pump: threading.Thread | None = None
    stopped_by_test: bool = False  # a test ended the process on purpose

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        port = urlsplit(self.url).port
        assert port is not None
        return port

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.stdout_pump is not None:
            self.stdout_pump.join(timeout=5)


class ServerLauncher:
    """Starts servers and stops them all (checking for panics) at teardown."""

    def __init__(self, binary: Path, store: Path, log_dir: Path) -> None:
        self.binary = binary
        self.store = store
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def start(self, *extra_args: str, ready: bool = True) -> Server:
        """Start a server and return once it is ready (the model loaded), or with `ready=False`
        as soon as it listens (the port is bound before the model loads)."""
        args = [
            str(self.binary),
            "serve",
            "--model",
            str(self.store),
            "--port",
            "0",
            "--served-model-name",
            SERVED_MODEL,
            *map(str, extra_args),
        ]
        n = len(self.servers)
        stderr_path = self.log_dir / f"server-{n}.stderr"
        stderr_file = open(stderr_path, "wb")
        proc = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
        )
        stderr_file.close()
        lines: "queue.Queue[str | None]" = queue.Queue()
        stdout_lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                stdout_lines.append(line)
                lines.put(line)
            lines.put(None)

        pump_thread = threading.Thread(target=pump, daemon=True)
        pump_thread.start()
        server = Server(
            url="", args=args, proc=proc, stderr_path=stderr_path, stdout_lines=stdout_lines, stdout_pump=pump_thread
        )
        self.servers.append(server)

        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                server.stop()
                pytest.fail(
                    f"`{' '.join(args)}` printed no '{'ready' if ready else 'listening'} on' line within {STARTUP_TIMEOUT}s\n"
                    f"stdout:\n" + "\n".join(stdout_lines) + f"\nstderr:\n{server.stderr_text()}",
                    pytrace=False,
                )
            try:
                line = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                proc.wait(timeout=10)
                pytest.fail(
                    f"`{' '.join(args)}` exited with {proc.returncode} before it was ready\n"
                    f"stdout:\n" + "\n".join(stdout_lines) + f"\nstderr:\n{server.stderr_text()}"
                    + _instruments_hint(server.stderr_text()),
                    pytrace=False,
                )
            m = (READY_RE if ready else LISTENING_RE).search(line)
            if m:
                server.url = m.group(1).rstrip("/")
                return server

    def stop_all(self) -> None:
        problems = []
        for server in self.servers:
            died_early = server.proc.poll() is not None
            server.stop()
            stderr = server.stderr_text()
            if "panicked" in stderr:
                problems.append(f"server {server.args} panicked:\n{stderr[-4000:]}")
            elif died_early and server.url and not server.stopped_by_test:
                problems.append(
                    f"server {server.args} had exited ({server.proc.returncode}) before teardown:\n"
                    f"{stderr[-4000:]}"
                )
        self.servers.clear()
        if problems:
            pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def _session_launcher(deltafin_bin: Path, store: Path, tmp_path_factory: pytest.TempPathFactory):
    launcher = ServerLauncher(deltafin_bin, store, tmp_path_factory.mktemp("server-logs"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_launcher(deltafin_bin: Path, store: Path, tmp_path_factory: pytest.TempPathFactory):
    """For module-scoped servers (concurrency tests)."""
    launcher = ServerLauncher(deltafin_bin, store, tmp_path_factory.mktemp("server-logs"))
    yield launcher
    launcher.stop_all()


@pytest.fixture
def start_server(deltafin_bin: Path, store: Path, tmp_path: Path):
    """Factory: `start_server(*extra_args) -> Server`; stopped at the end of the test."""
    launcher = ServerLauncher(deltafin_bin, store, tmp_path)
    yield launcher.start
    launcher.stop_all()


@pytest.fixture(scope="session")
def default_server(_session_launcher: ServerLauncher) -> Server:
    return _session_launcher.start()


@pytest.fixture(scope="session")
def scripted_server(_session_launcher: ServerLauncher, script_file: Path) -> Server:
    return _session_launcher.start("--script", str(script_file))


@pytest.fixture(scope="session")
def api_key_server(_session_launcher: ServerLauncher, script_file: Path) -> Server:
    return _session_launcher.start("--api-key", API_KEY, "--script", str(script_file))


# =============================================================================================
# Clients
# =============================================================================================


def make_openai(server: Server, api_key: str = "unused", **kw):
    import openai

    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", CLIENT_TIMEOUT)
    return openai.OpenAI(base_url=server.v1, api_key=api_key, **kw)


def make_anthropic(server: Server, api_key: str = "unused", **kw):
    import anthropic

    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", CLIENT_TIMEOUT)
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, **kw)


@pytest.fixture(scope="session")
def openai_client(default_server: Server):
    return make_openai(default_server)


@pytest.fixture(scope="session")
def scripted_openai(scripted_server: Server):
    return make_openai(scripted_server)


@pytest.fixture(scope="session")
def scripted_anthropic(scripted_server: Server):
    return make_anthropic(scripted_server)


# =============================================================================================
# Tokenizer reference (the `tiktoken` package with K3's regex and specials)
# =============================================================================================


@pytest.fixture(scope="session")
def reference_encoding():
    import tiktoken

    check = json.loads(TOKENIZER_CHECK.read_text())
    ranks: dict[bytes, int] = {}
    for line in (HF_DIR / "tiktoken.model").read_bytes().splitlines():
        if line.strip():
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    specials = {s["content"]: s["id"] for s in check["special_tokens"]}
    return tiktoken.Encoding(
        name="k3-tiny", pat_str=check["pat_str"], mergeable_ranks=ranks, special_tokens=specials
    )


@pytest.fixture(scope="session")
def vocab_size() -> int:
    config = json.loads((HF_DIR / "config.json").read_text())
    return int(config["text_config"]["vocab_size"])


# =============================================================================================
# Raw HTTP helpers
# =============================================================================================


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(
    server: Server,
    method: str,
    path: str,
    body: bytes | str | dict | list | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = CLIENT_TIMEOUT,
) -> RawResponse:
    """One request with http.client; dict/list bodies are sent as JSON."""
    hdrs = dict(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8")
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return RawResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def iter_sse_data(resp: http.client.HTTPResponse) -> Iterator[str]:
    """Yields the payload of every `data:` line of an SSE response (comments are skipped)."""
    while True:
        line = resp.readline()
        if not line:
            return
        text = line.decode("utf-8").rstrip("\r\n")
        if text.startswith("data:"):
            yield text[5:].lstrip(" ")


def assert_openai_error(resp: RawResponse, status: int | None = None) -> dict:
    """A 4xx with an OpenAI-shaped error body; returns the inner `error` object."""
    if status is not None:
        assert resp.status == status, (resp.status, resp.body[:500])
    assert 400 <= resp.status < 500, (resp.status, resp.body[:500])
    assert "application/json" in resp.headers.get("content-type", ""), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "param" in err and "code" in err, err
    return err


def assert_healthy(server: Server, timeout: float = 10.0) -> None:
    assert server.alive(), f"server exited ({server.proc.returncode}):\n{server.stderr_text()[-4000:]}"
    resp = http_request(server, "GET", "/health", timeout=timeout)
    assert resp.status == 200, (resp.status, resp.body)
    assert resp.json()["status"] == "ok"


def wait_until_idle(server: Server, timeout: float = 20.0) -> None:
    """Polls with a tiny completion until the engine accepts work (no 429)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = http_request(
            server,
            "POST",
            "/v1/completions",
            {"model": SERVED_MODEL, "prompt": "idle?", "max_tokens": 1, "temperature": 0},
        )
        if last.status == 200:
            return
        assert last.status == 429, (last.status, last.body[:500])
        time.sleep(0.1)
    pytest.fail(f"server still busy after {timeout}s: {last}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over all label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\d+)?$", line)
        assert m, f"unparseable metrics line: {line!r}"
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def scrape_metrics(server: Server) -> dict[str, float]:
    resp = http_request(server, "GET", "/metrics")
    assert resp.status == 200, resp
    return parse_metrics(resp.body.decode("utf-8"))
