"""Defaults that suit agents (issue 25): the port bound before the model loads and `/health`
saying `loading`, requests queued by default, `max_tokens` clamped on every endpoint (and the
clamp reported), aliases, a readable request log, environment variables, and errors that say
what to do.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import openai
import pytest

from conftest import (
    CLIENT_TIMEOUT,
    DEFAULT_CONTEXT,
    HF_DIR,
    REPO_ROOT,
    SERVED_MODEL,
    http_request,
    make_anthropic,
    make_openai,
)


def wait_ready(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http_request(server, "GET", "/health", timeout=5).status == 200:
            return
        time.sleep(0.1)
    pytest.fail("/health never answered 200")


def test_port_is_bound_and_health_says_loading_before_the_model_is_ready(start_server):
    server = start_server("--load-delay-ms", "3000", ready=False)
    health = http_request(server, "GET", "/health", timeout=5)
    assert health.status == 503, health.body
    body = health.json()
    assert body["status"] == "loading" and body["loading_s"] >= 0, body
    assert health.headers.get("retry-after"), "503 loading without Retry-After"
    # The model lists answer while loading (clients probe them first).
    models = http_request(server, "GET", "/v1/models", timeout=5)
    assert models.status == 200 and models.json()["data"][0]["id"] == SERVED_MODEL
    # Generation endpoints answer 503 in their own error shapes, with a code to act on.
    chat = http_request(
        server, "POST", "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=5,
    )
    assert chat.status == 503, chat.body
    err = chat.json()["error"]
    assert err["code"] == "model_loading" and "loading" in err["message"], err
    msg = http_request(
        server, "POST", "/v1/messages",
        {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=5,
    )
    assert msg.status == 503 and msg.json()["type"] == "error", msg.body
    # Then it becomes ready and serves.
    wait_ready(server)
    out = make_openai(server).chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert any("ready on http://" in line for line in server.stdout_lines), server.stdout_lines


def test_a_port_in_use_is_reported_before_loading(deltafin_bin, store):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [str(deltafin_bin), "serve", "--model", str(store), "--port", str(port), "--load-delay-ms", "30000"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )
        elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "port" in proc.stderr, proc.stderr
    # The 30 s load delay never started: the bind failed first.
    assert elapsed < 20, elapsed


def test_two_requests_at_once_both_answer_by_default(start_server, script_file):
    """The default queue: an agent's follow-up and its title request, sent together."""
    server = start_server("--token-delay-ms", "30", "--script", str(script_file))
    client = make_openai(server)
    results: list = [None, None]

    def ask(i: int) -> None:
        results[i] = client.chat.completions.create(
            model=SERVED_MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8,
            temperature=0, timeout=CLIENT_TIMEOUT,
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CLIENT_TIMEOUT + 5)
    assert all(r is not None and r.choices[0].finish_reason for r in results), results


@pytest.mark.parametrize("endpoint", ["chat", "completions", "messages"])
def test_max_tokens_beyond_the_context_is_clamped_and_reported(default_server, endpoint):
    asked = 32000
    assert asked > DEFAULT_CONTEXT
    if endpoint == "chat":
        body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": asked,
                "temperature": 0, "stop": ["."]}
        path = "/v1/chat/completions"
    elif endpoint == "completions":
        body = {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": asked, "temperature": 0, "stop": ["."]}
        path = "/v1/completions"
    else:
        body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": asked,
                "temperature": 0, "stop_sequences": ["."]}
        path = "/v1/messages"
    # Enough room to generate, but the request is about the grant, not the output: cap the
    # work with a stop sequence and a short prompt; the tiny model may still run long, so the
    # timeout is generous.
    r = http_request(default_server, "POST", path, body, timeout=300)
    assert r.status == 200, r.body[:500]
    clamp = r.json()["deltafin"]["max_tokens_clamped"]
    assert clamp["requested"] == asked
    assert 0 < clamp["granted"] < DEFAULT_CONTEXT, clamp


def test_aliases_are_listed_and_answered(start_server):
    server = start_server("--alias", "gpt-4o", "--alias", "kimi-k3", "--alias", "gpt-4o")
    models = http_request(server, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_MODEL, "gpt-4o", "kimi-k3"]
    assert http_request(server, "GET", "/v1/models/kimi-k3").status == 200
    out = make_openai(server).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert out.choices[0].message is not None
    msg = make_anthropic(server).messages.create(
        model="kimi-k3", messages=[{"role": "user", "content": "hi"}], max_tokens=2, timeout=CLIENT_TIMEOUT,
    )
    assert msg.stop_reason in ("max_tokens", "end_turn")
    with pytest.raises(openai.NotFoundError):
        make_openai(server).chat.completions.create(
            model="not-a-name", messages=[{"role": "user", "content": "hi"}], max_tokens=2, timeout=CLIENT_TIMEOUT,
        )


def test_one_plain_log_line_per_request(start_server):
    server = start_server()
    client = make_openai(server)
    client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    client.completions.create(model=SERVED_MODEL, prompt="hello", max_tokens=2, temperature=0, timeout=CLIENT_TIMEOUT)
    http_request(server, "GET", "/v1/models")
    http_request(server, "POST", "/v1/chat/completions", {"model": "nope", "messages": []})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        log = server.stderr_text()
        if "POST /v1/chat/completions 404" in log:
            break
        time.sleep(0.1)
    log = server.stderr_text()
    assert "\x1b[" not in log, "colour codes in a log that is not a terminal"
    lines = [line for line in log.splitlines() if "deltafin::request" in line]
    chat = [line for line in lines if "POST /v1/chat/completions 200" in line]
    assert len(chat) == 1, lines
    assert "prompt " in chat[0] and "generated" in chat[0] and "tokens/s" in chat[0] and "first token" in chat[0]
    assert len([line for line in lines if "POST /v1/completions 200" in line]) == 1, lines
    assert len([line for line in lines if "GET /v1/models 200" in line]) == 1, lines
    assert len([line for line in lines if "POST /v1/chat/completions 404" in line]) == 1, lines
    # Health polls stay out of the log.
    http_request(server, "GET", "/health")
    assert "/health" not in server.stderr_text()


def test_environment_variables_configure_the_server(deltafin_bin, store, tmp_path):
    env = dict(os.environ, DELTAFIN_MODEL=str(store), DELTAFIN_PORT="0", DELTAFIN_HOST="127.0.0.1",
               DELTAFIN_API_KEY="sekrit")
    proc = subprocess.Popen(
        [str(deltafin_bin), "serve", "--served-model-name", SERVED_MODEL], cwd=REPO_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        url = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready on http://" in line:
                url = line.split("ready on ")[1].split()[0]
                break
        assert url, "no ready line"
        host, port = url.removeprefix("http://").split(":")

        class S:  # the shape http_request needs
            pass

        s = S()
        s.host, s.port = host, int(port)
        assert http_request(s, "GET", "/v1/models").status == 401
        assert http_request(s, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"}).status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_short_flags_and_llama_server_names(deltafin_bin, store):
    """`-m STORE -c N` and `--ctx-size N`, as in llama-server."""
    for args in (["-m", str(store), "-c", "512"], ["--model", str(store), "--ctx-size", "512"]):
        proc = subprocess.run(
            [str(deltafin_bin), "generate", *args, "--prompt", "hi", "--max-tokens", "1", "--json"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr


def test_a_checkpoint_given_as_a_store_says_how_to_convert_it(deltafin_bin):
    proc = subprocess.run(
        [str(deltafin_bin), "serve", "--model", str(HF_DIR), "--port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "Hugging Face checkpoint" in proc.stderr and "deltafin convert --from" in proc.stderr, proc.stderr
    assert "os error" not in proc.stderr, proc.stderr



def test_argument_mistakes_are_reported_before_loading(deltafin_bin, tmp_path):
    """`generate` without a prompt says so before it opens (or fails to open) the store."""
    proc = subprocess.run(
        [str(deltafin_bin), "generate", "-m", str(tmp_path / "no-such-store")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "pass exactly one of --prompt, --prompt-tokens or --chat" in proc.stderr, proc.stderr


def test_a_context_beyond_the_model_is_refused_before_listening(deltafin_bin, store):
    proc = subprocess.run(
        [str(deltafin_bin), "serve", "-m", str(store), "--port", "0", "-c", "999999", "--load-delay-ms", "30000"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "max_position_embeddings" in proc.stderr, proc.stderr
    assert "listening on" not in proc.stdout, proc.stdout


def test_a_failed_generation_is_logged_once(start_server):
    """The engine logs a failed generation's line; the HTTP layer does not log it again."""
    server = start_server("--inject-faults")
    r = http_request(server, "POST", "/v1/chat/completions",
                     {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "inject-engine-error"}],
                      "max_tokens": 2})
    assert r.status == 500, r.body
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "POST /v1/chat/completions 500" not in server.stderr_text():
        time.sleep(0.1)
    lines = [line for line in server.stderr_text().splitlines() if "POST /v1/chat/completions 500" in line]
    assert len(lines) == 1, lines
