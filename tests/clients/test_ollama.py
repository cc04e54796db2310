"""The Ollama API (`/api/*`) through the official `ollama` Python client: chat and generate,
whole and streamed (NDJSON), `options`, `think`, tools, and the model listings; plus what a
raw client sees (NDJSON lines, Ollama's `{"error": ...}`).

Scripted replies (conftest) stand in for a trained K3.
"""

from __future__ import annotations

import json

import ollama
import pytest

from conftest import (
    CLIENT_TIMEOUT,
    RIDDLE_ANSWER,
    RIDDLE_PROMPT,
    RIDDLE_REASONING,
    SERVED_MODEL,
    WEATHER_PROMPT,
    WEATHER_TOOL_ARGS,
    WEATHER_TOOL_NAME,
    WEATHER_TOOL_OPENAI,
    http_request,
)


@pytest.fixture(scope="module")
def client(scripted_server):
    return ollama.Client(host=scripted_server.url, timeout=CLIENT_TIMEOUT)


def test_list_show_ps_and_version(client, scripted_server):
    names = [m.model for m in client.list().models]
    assert f"{SERVED_MODEL}:latest" in names
    info = client.show(SERVED_MODEL)
    assert "tools" in info.capabilities and "thinking" in info.capabilities
    assert info.details.family == "kimi_k3"
    running = client.ps().models
    assert [m.model for m in running] == [f"{SERVED_MODEL}:latest"]
    assert running[0].context_length > 0
    v = http_request(scripted_server, "GET", "/api/version").json()
    assert v["version"].count(".") == 2


def test_chat_returns_thinking_and_content(client):
    r = client.chat(model=SERVED_MODEL, messages=[{"role": "user", "content": RIDDLE_PROMPT}],
                    options={"temperature": 0, "num_predict": 200})
    assert r.message.role == "assistant"
    assert r.message.content == RIDDLE_ANSWER
    assert r.message.thinking == RIDDLE_REASONING
    assert r.done and r.done_reason == "stop"
    # prompt_eval_count counts the prompt tokens computed: 0 when an earlier test left this
    # prompt's state to resume from.
    assert r.prompt_eval_count is not None and r.eval_count > 0 and r.total_duration > 0


def test_chat_streams_ndjson_chunks(client):
    parts = list(client.chat(model=f"{SERVED_MODEL}:latest", messages=[{"role": "user", "content": RIDDLE_PROMPT}],
                             options={"temperature": 0, "num_predict": 200}, stream=True))
    assert len(parts) > 3
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == RIDDLE_ANSWER
    assert "".join(p.message.thinking or "" for p in parts) == RIDDLE_REASONING
    assert parts[-1].eval_count > 0


def test_chat_with_tools_and_a_tool_result(client):
    messages = [{"role": "user", "content": WEATHER_PROMPT}]
    r = client.chat(model=SERVED_MODEL, messages=messages, tools=[WEATHER_TOOL_OPENAI],
                    options={"temperature": 0, "num_predict": 300})
    calls = r.message.tool_calls
    assert calls and calls[0].function.name == WEATHER_TOOL_NAME
    assert dict(calls[0].function.arguments) == WEATHER_TOOL_ARGS
    messages.append(r.message)
    messages.append({"role": "tool", "content": "21 C", "tool_name": WEATHER_TOOL_NAME})
    again = client.chat(model=SERVED_MODEL, messages=messages, tools=[WEATHER_TOOL_OPENAI],
                        options={"temperature": 0, "num_predict": 300})
    assert again.done
    # The history (with the tool result) was rendered: a longer prompt, the first one's state reused.
    assert again.prompt_eval_count >= 1


def test_chat_stream_sends_tool_calls_whole(client):
    parts = list(client.chat(model=SERVED_MODEL, messages=[{"role": "user", "content": WEATHER_PROMPT}],
                             tools=[WEATHER_TOOL_OPENAI], options={"temperature": 0, "num_predict": 300}, stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert len(calls) == 1 and dict(calls[0].function.arguments) == WEATHER_TOOL_ARGS


def test_think_false_and_num_predict(client):
    r = client.chat(model=SERVED_MODEL, messages=[{"role": "user", "content": RIDDLE_PROMPT}], think=False,
                    options={"temperature": 0, "num_predict": 2})
    assert r.done_reason == "length" and r.eval_count == 2


def test_generate_whole_and_streamed(client):
    r = client.generate(model=SERVED_MODEL, prompt=RIDDLE_PROMPT, options={"temperature": 0, "num_predict": 200})
    assert r.response == RIDDLE_ANSWER and r.thinking == RIDDLE_REASONING and r.done
    parts = list(client.generate(model=SERVED_MODEL, prompt=RIDDLE_PROMPT, system="Be brief.",
                                 options={"temperature": 0, "num_predict": 200}, stream=True))
    assert "".join(p.response for p in parts) == RIDDLE_ANSWER and parts[-1].done


def test_errors_are_ollama_shaped(client, scripted_server):
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "not found" in exc.value.error
    r = http_request(scripted_server, "POST", "/api/chat",
                     {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 0}})
    assert r.status == 400 and "num_predict" in r.json()["error"], r.body


def test_raw_ndjson_lines(scripted_server):
    r = http_request(scripted_server, "POST", "/api/generate",
                     {"model": SERVED_MODEL, "prompt": RIDDLE_PROMPT, "options": {"temperature": 0, "num_predict": 200}})
    assert r.status == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in r.body.decode().splitlines()]
    assert all(x["model"] == SERVED_MODEL and x["created_at"].endswith("Z") for x in lines)
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
