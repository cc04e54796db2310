"""Error handling: OpenAI-shaped 4xx errors, API keys, body limits, and hostile raw HTTP.

After every hostile input the server must still answer GET /health, and whatever it answered
(when it answered over HTTP) must be a 4xx, never a 5xx.
"""

from __future__ import annotations

import json
import select
import socket
import time

import openai
import pytest

from conftest import (
    API_KEY,
    CLIENT_TIMEOUT,
    DEFAULT_CONTEXT,
    PLAIN_PROMPT,
    SERVED_MODEL,
    Server,
    assert_healthy,
    assert_openai_error,
    http_request,
    make_openai,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY_DEFAULT = 8 * 1024 * 1024


def chat_body(**overrides) -> dict:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": PLAIN_PROMPT}], "max_tokens": 2}
    body.update(overrides)
    return body


# ---------------------------------------------------------------------------------------------
# OpenAI-shaped errors for well-formed but invalid requests
# ---------------------------------------------------------------------------------------------


def test_malformed_json_is_400(default_server):
    resp = http_request(default_server, "POST", CHAT, b'{"model": "k3-tiny", "messages": [')
    err = assert_openai_error(resp, 400)
    assert err["type"] == "invalid_request_error"


def test_missing_model_is_400(default_server):
    body = chat_body()
    del body["model"]
    err = assert_openai_error(http_request(default_server, "POST", CHAT, body), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_model_is_404(default_server, path):
    body = chat_body(model="gpt-9") if path == CHAT else {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}
    err = assert_openai_error(http_request(default_server, "POST", path, body), 404)
    assert err["code"] == "model_not_found"


def test_unknown_model_raises_not_found_in_client(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=2, timeout=CLIENT_TIMEOUT
        )
    assert exc.value.code == "model_not_found"


@pytest.mark.parametrize(
    "overrides, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),  # -1 is accepted (vLLM: "no limit")
        ({"top_k": 1.5}, "top_k"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 2}, "n"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else v,
)
def test_bad_chat_parameter_is_400_naming_param(default_server, overrides, param):
    err = assert_openai_error(http_request(default_server, "POST", CHAT, chat_body(**overrides)), 400)
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["param"], str) and err["param"].startswith(param), err


def test_bad_parameter_raises_bad_request_in_client(openai_client):
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5, max_tokens=2,
            timeout=CLIENT_TIMEOUT,
        )
    assert exc.value.status_code == 400
    assert exc.value.param == "temperature"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("size", ["6k-tokens", "2MB"])
def test_prompt_longer_than_context_is_400(default_server, reference_encoding, path, size):
    text = "x " * 3000 if size == "6k-tokens" else "lorem ipsum " * (2 * 1024 * 1024 // 12)
    if size == "6k-tokens":
        assert len(reference_encoding.encode(text)) > DEFAULT_CONTEXT
    body = (
        chat_body(messages=[{"role": "user", "content": text}])
        if path == CHAT
        else {"model": SERVED_MODEL, "prompt": text, "max_tokens": 2}
    )
    err = assert_openai_error(http_request(default_server, "POST", path, body), 400)
    assert err["code"] == "context_length_exceeded"
    assert_healthy(default_server)


def test_body_over_limit_is_413(default_server):
    filler = "a" * (MAX_BODY_DEFAULT + 1024 * 1024)
    body = json.dumps(chat_body(messages=[{"role": "user", "content": filler}])).encode()
    status, raw = send_large_body(default_server, CHAT, body)
    assert status == 413, raw[:500]
    _, _, payload = raw.partition(b"\r\n\r\n")
    assert b'"error"' in payload, raw[:500]
    assert_healthy(default_server)


# ---------------------------------------------------------------------------------------------
# API keys
# ---------------------------------------------------------------------------------------------


def test_api_key_missing_is_401(api_key_server):
    err = assert_openai_error(http_request(api_key_server, "POST", CHAT, chat_body()), 401)
    assert err["code"] == "invalid_api_key"
    err = assert_openai_error(http_request(api_key_server, "GET", "/v1/models"), 401)
    assert err["code"] == "invalid_api_key"


def test_api_key_wrong_bearer_is_401(api_key_server):
    client = make_openai(api_key_server, api_key="wrong-key")
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, timeout=CLIENT_TIMEOUT
        )
    assert exc.value.status_code == 401
    assert exc.value.code == "invalid_api_key"


def test_api_key_wrong_x_api_key_is_401(api_key_server):
    resp = http_request(api_key_server, "POST", CHAT, chat_body(), headers={"x-api-key": "nope"})
    assert assert_openai_error(resp, 401)["code"] == "invalid_api_key"


def test_api_key_correct_bearer_is_accepted(api_key_server):
    client = make_openai(api_key_server, api_key=API_KEY)
    r = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, timeout=CLIENT_TIMEOUT
    )
    assert r.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list(timeout=CLIENT_TIMEOUT)] == [SERVED_MODEL]


def test_api_key_correct_x_api_key_is_accepted(api_key_server):
    resp = http_request(api_key_server, "POST", CHAT, chat_body(), headers={"x-api-key": API_KEY})
    assert resp.status == 200, resp.body
    resp = http_request(api_key_server, "GET", "/v1/models", headers={"x-api-key": API_KEY})
    assert resp.status == 200, resp.body


def test_health_needs_no_api_key(api_key_server):
    assert_healthy(api_key_server)


# ---------------------------------------------------------------------------------------------
# Hostile bodies (well-framed HTTP): 4xx JSON, server stays up
# ---------------------------------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE_BODIES = [
    ("invalid-json", CHAT, b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "hi"}'),
    ("trailing-garbage", CHAT, json.dumps(chat_body()).encode() + b"}}}"),
    ("empty-body", CHAT, b""),
    ("invalid-utf8", CHAT,
     b'{"model": "k3-tiny", "messages": [{"role": "user", "content": "\xff\xfe\xc3("}], "max_tokens": 2}'),
    ("json-array", CHAT, b"[1, 2, 3]"),
    ("json-string", CHAT, b'"hello"'),
    ("json-null", CHAT, b"null"),
    ("nested-100k-body", CHAT, nested(100_000).encode()),
    ("nested-100k-in-messages", CHAT,
     ('{"model": "k3-tiny", "max_tokens": 2, "messages": ' + nested(100_000) + "}").encode()),
    ("nested-100k-objects", CHAT, ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()),
    ("max_tokens-1e30", CHAT, json.dumps(chat_body(max_tokens=1e30)).encode()),
    ("max_tokens-10**30", CHAT, json.dumps(chat_body(max_tokens=10**30)).encode()),
    ("max_tokens-2**64", CHAT, json.dumps(chat_body(max_tokens=2**64)).encode()),
    ("temperature-1e400", CHAT, json.dumps(chat_body()).replace('"max_tokens": 2', '"max_tokens": 2, "temperature": 1e400').encode()),
    ("temperature-nan", CHAT, json.dumps(chat_body()).replace('"max_tokens": 2', '"max_tokens": 2, "temperature": NaN').encode()),
    ("seed-2**70", CHAT, json.dumps(chat_body(seed=2**70)).encode()),
    ("messages-string", CHAT, json.dumps(chat_body(messages="hello")).encode()),
    ("messages-null-item", CHAT, json.dumps(chat_body(messages=[None])).encode()),
    ("content-number", CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": 42}])).encode()),
    ("content-bad-part", CHAT,
     json.dumps(chat_body(messages=[{"role": "user", "content": [{"type": "video", "url": 1}]}])).encode()),
    ("role-number", CHAT, json.dumps(chat_body(messages=[{"role": 1, "content": "hi"}])).encode()),
    ("model-number", CHAT, json.dumps(chat_body(model=7)).encode()),
    ("max_tokens-string", CHAT, json.dumps(chat_body(max_tokens="5")).encode()),
    ("temperature-string", CHAT, json.dumps(chat_body(temperature="hot")).encode()),
    ("stop-number", CHAT, json.dumps(chat_body(stop=5)).encode()),
    ("stream-string", CHAT, json.dumps(chat_body(stream="yes")).encode()),
    ("tools-string", CHAT, json.dumps(chat_body(tools="get_weather")).encode()),
    ("prompt-id-vocab", COMPLETIONS, b'{"model": "k3-tiny", "prompt": [320], "max_tokens": 2}'),
    ("prompt-id-huge", COMPLETIONS, b'{"model": "k3-tiny", "prompt": [1, 2, 1000000000], "max_tokens": 2}'),
    ("prompt-id-negative", COMPLETIONS, b'{"model": "k3-tiny", "prompt": [1, -1], "max_tokens": 2}'),
    ("prompt-id-float", COMPLETIONS, b'{"model": "k3-tiny", "prompt": [1, 2.5], "max_tokens": 2}'),
    ("prompt-id-2**64", COMPLETIONS, b'{"model": "k3-tiny", "prompt": [18446744073709551616], "max_tokens": 2}'),
    ("prompt-object", COMPLETIONS, b'{"model": "k3-tiny", "prompt": {"text": "hi"}, "max_tokens": 2}'),
    ("detokenize-out-of-vocab", "/detokenize", b'{"model": "k3-tiny", "tokens": [1, 99999]}'),
    ("detokenize-negative", "/detokenize", b'{"model": "k3-tiny", "tokens": [-5]}'),
    ("tokenize-number", "/tokenize", b'{"model": "k3-tiny", "prompt": 12}'),
]


@pytest.mark.parametrize("path, body", [(p, b) for _, p, b in HOSTILE_BODIES], ids=[n for n, _, _ in HOSTILE_BODIES])
def test_hostile_body_is_rejected_cleanly(default_server, path, body):
    resp = http_request(default_server, "POST", path, body)
    assert_openai_error(resp)
    assert_healthy(default_server)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        nested(100_000).encode(),
        b'{"model": "k3-tiny", "max_tokens": 1e30, "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "k3-tiny", "max_tokens": 2, "messages": "hi"}',
        b'{"model": "k3-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": 3}]}',
    ],
    ids=["invalid-json", "array", "nested-100k", "max_tokens-1e30", "messages-string", "content-number"],
)
def test_hostile_anthropic_body_is_rejected_cleanly(default_server, body):
    resp = http_request(default_server, "POST", "/v1/messages", body, headers={"anthropic-version": "2023-06-01"})
    assert 400 <= resp.status < 500, (resp.status, resp.body[:500])
    assert isinstance(resp.json(), dict)
    assert_healthy(default_server)


# ---------------------------------------------------------------------------------------------
# Hostile HTTP framing (raw sockets)
# ---------------------------------------------------------------------------------------------


def connect(server: Server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def read_response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Reads until EOF, a complete Content-Length body, or `timeout`; b'' when nothing came."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and len(body) >= int(value.strip() or 0):
                    return data
    return data


def status_of(raw: bytes) -> int | None:
    if not raw:
        return None
    assert raw.startswith(b"HTTP/1."), raw[:200]
    return int(raw.split(b" ", 2)[1])


def assert_4xx_or_silent(raw: bytes) -> None:
    status = status_of(raw)
    assert status is None or 400 <= status < 500, raw[:500]


def send_large_body(server: Server, path: str, body: bytes) -> tuple[int | None, bytes]:
    """Sends a POST whose body may be refused early; returns (status, raw response)."""
    sock = connect(server)
    try:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        view = memoryview(body)
        sent = 0
        while sent < len(body):
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break  # the server answered early
            try:
                sent += sock.send(view[sent : sent + 65536])
            except (BrokenPipeError, ConnectionResetError):
                break
        raw = read_response(sock, timeout=10)
        return status_of(raw), raw
    finally:
        sock.close()


def test_enormous_content_length_with_short_body(default_server):
    sock = connect(default_server)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999999999\r\n\r\n{\"model\": "
        )
        raw = read_response(sock, timeout=2)
    finally:
        sock.close()
    status = status_of(raw)
    assert status in (None, 400, 413), raw[:500]
    assert_healthy(default_server)


def test_garbage_request_line(default_server):
    sock = connect(default_server)
    try:
        sock.sendall(b"\x16\x03\x01 GARBAGE \x00\xff NOT-HTTP\r\n\r\n")
        raw = read_response(sock, timeout=5)
    finally:
        sock.close()
    assert_4xx_or_silent(raw)
    assert_healthy(default_server)


def test_bad_chunked_encoding(default_server):
    sock = connect(default_server)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nZZZ\r\n{}\r\n0\r\n\r\n"
        )
        raw = read_response(sock, timeout=5)
    finally:
        sock.close()
    assert_4xx_or_silent(raw)
    assert_healthy(default_server)


def test_huge_header_is_refused(default_server):
    sock = connect(default_server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n")
        raw = read_response(sock, timeout=5)
    except (BrokenPipeError, ConnectionResetError):
        raw = b""
    finally:
        sock.close()
    assert_4xx_or_silent(raw)
    assert_healthy(default_server)


def test_slowloris_partial_headers_then_close(default_server):
    for _ in range(5):
        sock = connect(default_server)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        time.sleep(0.1)
        sock.close()
    assert_healthy(default_server)


def test_health_answers_while_slow_clients_hold_connections(default_server):
    socks = []
    try:
        for _ in range(16):
            s = connect(default_server)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        started = time.monotonic()
        assert_healthy(default_server, timeout=5)
        assert time.monotonic() - started < 5
    finally:
        for s in socks:
            s.close()
    assert_healthy(default_server)


def test_many_connections_opened_and_dropped(default_server):
    for _ in range(50):
        s = connect(default_server)
        s.close()
    assert_healthy(default_server)


def test_request_after_abrupt_reset(default_server):
    """RST (SO_LINGER 0) in the middle of a request body."""
    sock = connect(default_server)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n{\"model\": \"k3-tiny\""
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    assert_healthy(default_server)
    resp = http_request(default_server, "POST", CHAT, chat_body())
    assert resp.status == 200, resp.body[:500]


def test_pathological_text_is_tokenised_without_stalling_the_server(default_server):
    """A megabyte of spaces (deep regex backtracking) and of one letter (one huge BPE piece):
    tokenised on the blocking pool in pieces, as the reference tokenizer cuts long runs, while
    /health keeps answering."""
    import threading

    results = {}

    def tokenize(name, text):
        results[name] = http_request(default_server, "POST", "/tokenize", {"prompt": text}, timeout=120)

    threads = [
        threading.Thread(target=tokenize, args=("spaces", " " * 1_000_000 + "x")),
        threading.Thread(target=tokenize, args=("letters", "a" * 1_000_000)),
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    assert http_request(default_server, "GET", "/health", timeout=10).status == 200
    assert time.monotonic() - t0 < 5
    for t in threads:
        t.join(130)
    for name in ("spaces", "letters"):
        r = results[name]
        assert r.status == 200, (name, r.body[:200])
        assert r.json()["count"] > 0
    assert_healthy(default_server)


def test_chat_with_a_huge_message_is_refused_cleanly(default_server):
    r = http_request(
        default_server, "POST", "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": [{"role": "user", "content": " " * 1_000_000}]},
        timeout=120,
    )
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert_healthy(default_server)


def test_named_tool_choice_must_name_a_declared_tool(default_server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": SERVED_MODEL, "max_tokens": 1, "tools": [tool],
        "messages": [{"role": "user", "content": "hi"}],
        "tool_choice": {"type": "function", "function": {"name": "g"}},
    }
    err = assert_openai_error(http_request(default_server, "POST", "/v1/chat/completions", body), 400)
    assert err["param"] == "tool_choice"
