"""One generation at a time (`--max-batch 1`; batching has test_batching.py): 429 when busy, FIFO
queue with --queue N, disconnect cancels.

The long-running request is the scripted "marathon" reply (never ends before max_tokens) on a
server with --token-delay-ms, so the engine is busy for a known time whatever the weights.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import anthropic
import openai
import pytest

from conftest import (
    CLIENT_TIMEOUT,
    MARATHON_PROMPT,
    PLAIN_PROMPT,
    SERVED_MODEL,
    Server,
    assert_openai_error,
    http_request,
    make_anthropic,
    make_openai,
    scrape_metrics,
    wait_until_idle,
)

BUSY_DELAY_MS = 50
QUEUE_DELAY_MS = 30


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def busy_server(module_launcher, script_file) -> Server:
    # --queue 0: the reference runtime's immediate 429 (the default queues 16).
    return module_launcher.start(
        "--max-batch", "1", "--queue", "0", "--token-delay-ms", str(BUSY_DELAY_MS), "--script", str(script_file)
    )


def start_marathon(client, max_tokens: int):
    """Starts a streaming request and returns (stream, iterator) once the first token arrived."""
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=user(MARATHON_PROMPT), max_tokens=max_tokens, temperature=0,
        stream=True, timeout=CLIENT_TIMEOUT,
    )
    it = iter(stream)
    for chunk in it:
        if chunk.choices:
            d = chunk.choices[0].delta
            if d.content or (d.model_extra or {}).get("reasoning_content"):
                return stream, it
    pytest.fail("marathon stream ended before its first token")


def drain(it) -> tuple[str | None, float]:
    finish = None
    for chunk in it:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish, time.monotonic()


def assert_retry_after(value: str | None) -> None:
    assert value is not None, "429 without Retry-After"
    assert re.fullmatch(r"\d+", value.strip()), value


def queue_length(server: Server) -> float:
    return scrape_metrics(server)["deltafin_queue_length"]


def wait_queue_length(server: Server, target: float, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if queue_length(server) == target:
            return
        time.sleep(0.02)
    pytest.fail(f"deltafin_queue_length never reached {target} (last {queue_length(server)})")


class Background:
    """A non-streaming chat request in a thread; records the result and when it finished."""

    def __init__(self, client, prompt: str, max_tokens: int) -> None:
        self.result = None
        self.error: BaseException | None = None
        self.done_at: float | None = None

        def run() -> None:
            try:
                self.result = client.chat.completions.create(
                    model=SERVED_MODEL, messages=user(prompt), max_tokens=max_tokens, temperature=0,
                    timeout=CLIENT_TIMEOUT,
                )
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e
            finally:
                self.done_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(CLIENT_TIMEOUT + 5)
        assert not self.thread.is_alive(), "background request never finished"
        assert self.error is None, f"background request failed: {self.error!r}"
        return self.result


# ---------------------------------------------------------------------------------------------


def test_busy_server_answers_429_with_retry_after(busy_server):
    wait_until_idle(busy_server)
    client = make_openai(busy_server)
    stream, _ = start_marathon(client, max_tokens=200)
    try:
        with pytest.raises(openai.RateLimitError) as exc:
            client.chat.completions.create(
                model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=2, timeout=CLIENT_TIMEOUT
            )
        e = exc.value
        assert e.status_code == 429
        assert "rate_limit_exceeded" in (e.type, e.code), (e.type, e.code)
        assert_retry_after(e.response.headers.get("retry-after"))

        raw = http_request(
            busy_server, "POST", "/v1/completions",
            {"model": SERVED_MODEL, "prompt": PLAIN_PROMPT, "max_tokens": 2},
        )
        err = assert_openai_error(raw, 429)
        assert "rate_limit_exceeded" in (err["type"], err["code"]), err
        assert_retry_after(raw.headers.get("retry-after"))

        with pytest.raises(anthropic.RateLimitError):
            make_anthropic(busy_server).messages.create(
                model=SERVED_MODEL, max_tokens=2, messages=user(PLAIN_PROMPT), timeout=CLIENT_TIMEOUT
            )

        # Non-generating endpoints stay available while the engine is busy.
        assert http_request(busy_server, "GET", "/health").status == 200
        assert http_request(busy_server, "GET", "/v1/models").status == 200
    finally:
        stream.close()
    wait_until_idle(busy_server)


def test_closing_openai_stream_cancels_generation(busy_server):
    wait_until_idle(busy_server)
    client = make_openai(busy_server)
    before = scrape_metrics(busy_server)["deltafin_generated_tokens_total"]
    # 500 tokens x 50 ms = 25 s if it ran to the end.
    stream, it = start_marathon(client, max_tokens=500)
    next(it)
    next(it)
    stream.close()
    closed_at = time.monotonic()
    _assert_free_within(busy_server, closed_at, seconds=3.0)
    generated = scrape_metrics(busy_server)["deltafin_generated_tokens_total"] - before
    assert generated < 200, f"{generated} tokens generated after the client went away"


def test_dropping_raw_connection_cancels_generation(busy_server):
    wait_until_idle(busy_server)
    body = json.dumps({
        "model": SERVED_MODEL, "prompt": MARATHON_PROMPT, "max_tokens": 500, "temperature": 0, "stream": True,
    }).encode()
    sock = socket.create_connection((busy_server.host, busy_server.port), timeout=CLIENT_TIMEOUT)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        received = b""
        while received.count(b"data:") < 3:
            data = sock.recv(65536)
            assert data, f"connection closed early: {received[:500]!r}"
            received += data
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
    finally:
        sock.close()
    _assert_free_within(busy_server, time.monotonic(), seconds=3.0)


def _assert_free_within(server: Server, since: float, seconds: float) -> None:
    client = make_openai(server)
    while True:
        try:
            r = client.chat.completions.create(
                model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=2, timeout=CLIENT_TIMEOUT
            )
            assert r.usage.completion_tokens >= 1
            return
        except openai.RateLimitError:
            if time.monotonic() - since > seconds:
                pytest.fail(f"server still busy {seconds}s after the client disconnected")
            time.sleep(0.1)


def test_queue_of_one_waits_then_rejects(start_server, script_file):
    server = start_server("--max-batch", "1", "--queue", "1", "--token-delay-ms", str(QUEUE_DELAY_MS), "--script", str(script_file))
    client = make_openai(server)
    assert queue_length(server) == 0

    # A: 100 tokens x 30 ms = 3 s.
    stream, it = start_marathon(client, max_tokens=100)
    try:
        base = queue_length(server)  # 0, or 1 if the running request counts
        b = Background(client, MARATHON_PROMPT, max_tokens=5)
        wait_queue_length(server, base + 1)

        with pytest.raises(openai.RateLimitError) as exc:
            client.chat.completions.create(
                model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=2, timeout=CLIENT_TIMEOUT
            )
        assert_retry_after(exc.value.response.headers.get("retry-after"))
        assert b.done_at is None, "queued request finished while A was still running"

        finish_a, a_done = drain(it)
    finally:
        stream.close()
    assert finish_a == "length"
    result_b = b.join()
    assert result_b.choices[0].finish_reason == "length"
    assert result_b.usage.completion_tokens == 5
    assert b.done_at > a_done, "B finished before A: not queued behind it"
    assert queue_length(server) == 0


def test_queue_of_two_is_fifo(start_server, script_file):
    server = start_server("--max-batch", "1", "--queue", "2", "--token-delay-ms", str(QUEUE_DELAY_MS), "--script", str(script_file))
    client = make_openai(server)

    stream, it = start_marathon(client, max_tokens=100)
    try:
        base = queue_length(server)
        b = Background(client, MARATHON_PROMPT, max_tokens=5)
        wait_queue_length(server, base + 1)
        c = Background(client, MARATHON_PROMPT, max_tokens=5)
        wait_queue_length(server, base + 2)

        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=2, timeout=CLIENT_TIMEOUT
            )
        finish_a, a_done = drain(it)
    finally:
        stream.close()
    assert finish_a == "length"
    rb, rc = b.join(), c.join()
    assert rb.usage.completion_tokens == 5 and rc.usage.completion_tokens == 5
    assert a_done < b.done_at < c.done_at, "queued requests did not run first-in first-out"


def test_keep_alive_comments_flow_while_the_prompt_is_processed(start_server):
    """A slow prompt (every 8-token chunk held 250 ms, so the prompt takes over a second) and a
    0.1 s keep-alive: comment lines must arrive before the first data chunk, so clients with read
    timeouts stay connected. The chunk is forced: the plan's own chunk would take the whole prompt
    in one step, and one 250 ms step leaves only two keep-alive periods."""
    server = start_server(
        "--token-delay-ms", "250", "--keep-alive-s", "0.1", "--prefill-chunk", "8"
    )
    conn = socket.create_connection((server.host, server.port), timeout=CLIENT_TIMEOUT)
    try:
        body = json.dumps({
            "model": SERVED_MODEL, "stream": True, "max_tokens": 1,
            "messages": user("a long prompt " * 10),
        }).encode()
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        buf = b""
        started = time.monotonic()
        while b"data: " not in buf and time.monotonic() - started < CLIENT_TIMEOUT:
            chunk = conn.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        before_data = rest.split(b"data: ", 1)[0]
        assert before_data.count(b": keep-alive") >= 3, before_data
    finally:
        conn.close()


def test_a_queued_request_whose_client_leaves_frees_its_place(start_server, script_file):
    """--queue 1: A runs, B waits and then disconnects; C must get B's place (wait, not 429)."""
    server = start_server("--max-batch", "1", "--queue", "1", "--token-delay-ms", str(QUEUE_DELAY_MS), "--script", str(script_file))
    client = make_openai(server)
    stream, it = start_marathon(client, max_tokens=100)
    try:
        base = queue_length(server)
        waiting = client.chat.completions.create(
            model=SERVED_MODEL, messages=user(MARATHON_PROMPT), max_tokens=5, stream=True, timeout=CLIENT_TIMEOUT
        )
        wait_queue_length(server, base + 1)
        waiting.close()
        wait_queue_length(server, base)
        c = Background(client, MARATHON_PROMPT, max_tokens=3)
        wait_queue_length(server, base + 1)
        drain(it)
    finally:
        stream.close()
    assert c.join().usage.completion_tokens == 3


def test_shutdown_does_not_wait_for_open_streams(start_server, script_file):
    """SIGTERM with a long stream open: the process exits within the grace period, not after
    the generation (500 tokens x 50 ms = 25 s)."""
    import signal

    server = start_server("--token-delay-ms", "50", "--script", str(script_file))
    client = make_openai(server)
    stream, it = start_marathon(client, max_tokens=500)
    next(it)
    t0 = time.monotonic()
    server.stopped_by_test = True
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 10
    stream.close()
