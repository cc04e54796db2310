"""POST /v1/chat/completions through the official `openai` client (and raw SSE once)."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from conftest import (
    CLIENT_TIMEOUT,
    PLAIN_PROMPT,
    RIDDLE_ANSWER,
    RIDDLE_PROMPT,
    RIDDLE_REASONING,
    RIDDLE_TEXT,
    SERVED_MODEL,
    WEATHER_ANSWER,
    WEATHER_PROMPT,
    WEATHER_REASONING,
    WEATHER_TOOL_ARGS,
    WEATHER_TOOL_NAME,
    WEATHER_TOOL_OPENAI,
    http_request,
    iter_sse_data,
    scrape_metrics,
)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    return extra.get("reasoning_content", getattr(message, "reasoning_content", None))


def delta_reasoning(delta) -> str | None:
    extra = delta.model_extra or {}
    return extra.get("reasoning_content", getattr(delta, "reasoning_content", None))


def full_output(message) -> tuple[str, str]:
    return (reasoning_of(message) or "", message.content or "")


def collect_stream(stream) -> dict:
    """Reassembles a chat.completion.chunk stream."""
    out = {
        "role": None,
        "reasoning": "",
        "content": "",
        "reasoning_chunks": 0,
        "content_chunks": 0,
        "tool_calls": {},
        "finish_reason": None,
        "usage": None,
        "chunks": 0,
        "ids": set(),
        "models": set(),
        "after_finish": [],
    }
    for chunk in stream:
        out["chunks"] += 1
        assert chunk.object == "chat.completion.chunk"
        out["ids"].add(chunk.id)
        out["models"].add(chunk.model)
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        if not chunk.choices:
            continue
        assert len(chunk.choices) == 1 and chunk.choices[0].index == 0
        if out["finish_reason"] is not None:
            out["after_finish"].append(chunk)
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.role is not None:
            assert out["role"] is None, "role sent twice"
            out["role"] = delta.role
        r = delta_reasoning(delta)
        if r:
            out["reasoning"] += r
            out["reasoning_chunks"] += 1
        if delta.content:
            out["content"] += delta.content
            out["content_chunks"] += 1
        for tc in delta.tool_calls or []:
            slot = out["tool_calls"].setdefault(tc.index, {"id": None, "type": None, "name": "", "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "tool call id sent twice"
                slot["id"] = tc.id
            if tc.type:
                slot["type"] = tc.type
            if tc.function is not None:
                if tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
        if choice.finish_reason is not None:
            out["finish_reason"] = choice.finish_reason
    return out


def script_token_count(encoding, text: str) -> int:
    return len(encoding.encode(text, allowed_special="all"))


# ---------------------------------------------------------------------------------------------
# Basic shape, determinism, sampling
# ---------------------------------------------------------------------------------------------


def test_chat_response_shape(openai_client):
    resp = openai_client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "system", "content": "You are terse."}, *user(PLAIN_PROMPT)],
        max_tokens=8,
        temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert resp.object == "chat.completion"
    assert resp.model == SERVED_MODEL
    assert isinstance(resp.id, str) and resp.id
    assert isinstance(resp.created, int) and resp.created > 1_600_000_000
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 0
    assert 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 8


def test_chat_raw_json_has_fingerprint_and_deltafin_block(default_server):
    resp = http_request(
        default_server,
        "POST",
        "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": user(PLAIN_PROMPT), "max_tokens": 2, "temperature": 0},
    )
    assert resp.status == 200, resp.body
    assert "application/json" in resp.headers["content-type"]
    body = resp.json()
    assert isinstance(body.get("system_fingerprint"), str)
    # Time to first token apart from the decode rate (llama.cpp's `timings` names).
    t = body["timings"]
    assert t["ttft_s"] > 0 and t["prompt_ms"] == pytest.approx(t["ttft_s"] * 1e3)
    assert t["prompt_n"] + t["prompt_cached_n"] == body["usage"]["prompt_tokens"]
    assert t["predicted_n"] == body["usage"]["completion_tokens"] - 1
    assert isinstance(body.get("deltafin"), dict) and "numerics" in body["deltafin"]
    # Where the routed experts computed (`serve --device`; the CPU by default).
    assert body["deltafin"]["device"] == "cpu"


def test_device_auto_names_the_device_it_settled_on(start_server):
    # `serve --device auto` with an adapter that will not open computes on the CPU, and every
    # response says so (not the GPU it asked for).
    server = start_server("--device", "auto", "--gpu-adapter", "no-such-adapter-7f3a")
    resp = http_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"model": SERVED_MODEL, "messages": user(PLAIN_PROMPT), "max_tokens": 2, "temperature": 0},
    )
    assert resp.status == 200, resp.body
    assert resp.json()["deltafin"]["device"] == "cpu"


def test_greedy_chat_is_deterministic(openai_client):
    def run():
        r = openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=24, temperature=0,
            timeout=CLIENT_TIMEOUT,
        )
        return full_output(r.choices[0].message), r.usage.completion_tokens, r.choices[0].finish_reason

    first, second = run(), run()
    assert first[1] > 0 and (first[0][0] or first[0][1]), "empty generation"
    assert first == second


def test_seeded_sampling_is_reproducible(openai_client):
    def run(seed):
        r = openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=40,
            temperature=0.9, top_p=0.95, seed=seed, extra_body={"top_k": 100},
            timeout=CLIENT_TIMEOUT,
        )
        return full_output(r.choices[0].message), r.usage.completion_tokens

    a, b = run(1234), run(1234)
    assert a[1] > 0
    assert a == b


def test_different_seeds_give_different_outputs(openai_client):
    def run(seed):
        r = openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=40,
            temperature=1.0, seed=seed, timeout=CLIENT_TIMEOUT,
        )
        return full_output(r.choices[0].message)

    outputs = {run(seed) for seed in (1, 2, 3)}
    assert len(outputs) >= 2, outputs


@pytest.mark.parametrize(
    "sampling",
    [
        pytest.param({"temperature": 1.0, "extra_body": {"top_k": 1}}, id="top_k=1"),
        pytest.param({"temperature": 1.0, "top_p": 1e-6}, id="tiny-top_p"),
    ],
)
def test_degenerate_sampling_equals_greedy(openai_client, sampling):
    greedy = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=16, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    sampled = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=16, seed=7,
        timeout=CLIENT_TIMEOUT, **sampling,
    )
    assert full_output(sampled.choices[0].message) == full_output(greedy.choices[0].message)


def test_max_completion_tokens_is_respected(openai_client):
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_completion_tokens=3, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert 1 <= r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3


def test_prompt_tokens_match_tokenize_endpoint(openai_client, default_server):
    messages = [{"role": "system", "content": "Be brief."}, *user(PLAIN_PROMPT)]
    tok = http_request(default_server, "POST", "/tokenize", {"model": SERVED_MODEL, "messages": messages})
    assert tok.status == 200, tok.body
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=1, temperature=0, timeout=CLIENT_TIMEOUT
    )
    assert r.usage.prompt_tokens == tok.json()["count"]


def test_multi_turn_with_tool_result_is_accepted(openai_client):
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Forecast for Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": WEATHER_TOOL_NAME, "arguments": json.dumps({"city": "Oslo", "days": 1})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, tools=[WEATHER_TOOL_OPENAI], max_tokens=4, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0
    # The tool result must be part of the prompt: more tokens than without it.
    r2 = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=messages[:2], tools=[WEATHER_TOOL_OPENAI], max_tokens=4, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.usage.prompt_tokens > r2.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_chat_logprobs_greedy(openai_client):
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3, timeout=CLIENT_TIMEOUT,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content, "no logprobs returned"
    assert 1 <= len(lp.content) <= r.usage.completion_tokens
    for entry in lp.content:
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0.0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert all(t <= 0.0 for t in tops)
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert abs(entry.logprob - tops[0]) < 1e-4, (entry.logprob, tops)


def test_chat_logprobs_absent_unless_requested(openai_client):
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=2, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.choices[0].logprobs is None


# ---------------------------------------------------------------------------------------------
# Streaming (unscripted)
# ---------------------------------------------------------------------------------------------


def test_streaming_greedy_equals_non_streaming(openai_client):
    kwargs = dict(model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=32, temperature=0,
                  timeout=CLIENT_TIMEOUT)
    whole = openai_client.chat.completions.create(**kwargs)
    got = collect_stream(
        openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert got["role"] == "assistant"
    assert len(got["ids"]) == 1 and got["models"] == {SERVED_MODEL}
    assert (got["reasoning"], got["content"]) == full_output(whole.choices[0].message)
    assert got["finish_reason"] == whole.choices[0].finish_reason
    assert got["usage"] is not None
    assert got["usage"].completion_tokens == whole.usage.completion_tokens
    assert got["usage"].prompt_tokens == whole.usage.prompt_tokens


def test_streaming_without_include_usage_has_no_usage(openai_client):
    got = collect_stream(
        openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=4, temperature=0, stream=True,
            timeout=CLIENT_TIMEOUT,
        )
    )
    assert got["finish_reason"] in ("stop", "length")
    assert got["usage"] is None


def test_raw_sse_framing(default_server):
    conn = http.client.HTTPConnection(default_server.host, default_server.port, timeout=CLIENT_TIMEOUT)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps({
                "model": SERVED_MODEL, "messages": user(PLAIN_PROMPT), "max_tokens": 6,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            }),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        payloads = list(iter_sse_data(resp))
    finally:
        conn.close()
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finishes) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    assert chunks.index(finishes[0]) < len(chunks) - 1


# ---------------------------------------------------------------------------------------------
# Scripted replies: reasoning / content / tool calls, incremental parsing
# ---------------------------------------------------------------------------------------------


def test_scripted_riddle_reasoning_and_content(scripted_openai, reference_encoding):
    r = scripted_openai.chat.completions.create(
        model=SERVED_MODEL, messages=user(RIDDLE_PROMPT), max_tokens=200, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    msg = r.choices[0].message
    assert reasoning_of(msg) == RIDDLE_REASONING
    assert msg.content == RIDDLE_ANSWER
    assert not msg.tool_calls
    assert r.choices[0].finish_reason == "stop"
    n = script_token_count(reference_encoding, RIDDLE_TEXT)
    assert r.usage.completion_tokens in (n - 1, n), (r.usage.completion_tokens, n)


def test_scripted_weather_tool_call(scripted_openai):
    r = scripted_openai.chat.completions.create(
        model=SERVED_MODEL, messages=user(WEATHER_PROMPT), tools=[WEATHER_TOOL_OPENAI], max_tokens=300,
        temperature=0, timeout=CLIENT_TIMEOUT,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert reasoning_of(choice.message) == WEATHER_REASONING
    assert choice.message.content == WEATHER_ANSWER
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert isinstance(call.id, str) and call.id
    assert call.function.name == WEATHER_TOOL_NAME
    assert json.loads(call.function.arguments) == WEATHER_TOOL_ARGS


def test_scripted_streaming_riddle_matches_non_streaming(scripted_openai):
    kwargs = dict(model=SERVED_MODEL, messages=user(RIDDLE_PROMPT), max_tokens=200, temperature=0,
                  timeout=CLIENT_TIMEOUT)
    whole = scripted_openai.chat.completions.create(**kwargs)
    got = collect_stream(
        scripted_openai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert got["role"] == "assistant"
    assert got["reasoning"] == RIDDLE_REASONING
    assert got["content"] == RIDDLE_ANSWER
    # Incremental: the multi-token texts arrive in more than one delta each.
    assert got["reasoning_chunks"] >= 2 and got["content_chunks"] >= 2, got
    assert got["finish_reason"] == "stop"
    assert not got["tool_calls"]
    assert not got["after_finish"], "choice chunks after the finish_reason chunk"
    assert got["usage"].completion_tokens == whole.usage.completion_tokens


def test_scripted_streaming_tool_call(scripted_openai):
    got = collect_stream(
        scripted_openai.chat.completions.create(
            model=SERVED_MODEL, messages=user(WEATHER_PROMPT), tools=[WEATHER_TOOL_OPENAI], max_tokens=300,
            temperature=0, stream=True, timeout=CLIENT_TIMEOUT,
        )
    )
    assert got["reasoning"] == WEATHER_REASONING
    assert got["content"] == WEATHER_ANSWER
    assert got["finish_reason"] == "tool_calls"
    assert list(got["tool_calls"]) == [0]
    call = got["tool_calls"][0]
    assert call["id"] and call["type"] == "function"
    assert call["name"] == WEATHER_TOOL_NAME
    assert json.loads(call["arguments"]) == WEATHER_TOOL_ARGS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("stop", ["answer is", ["zzz-not-there", "answer is"]], ids=["str", "list"])
def test_stop_string_cuts_content(scripted_openai, stream, stop):
    kwargs = dict(model=SERVED_MODEL, messages=user(RIDDLE_PROMPT), max_tokens=200, temperature=0,
                  stop=stop, timeout=CLIENT_TIMEOUT)
    if stream:
        got = collect_stream(scripted_openai.chat.completions.create(stream=True, **kwargs))
        reasoning, content, finish = got["reasoning"], got["content"], got["finish_reason"]
    else:
        r = scripted_openai.chat.completions.create(**kwargs)
        reasoning, content = full_output(r.choices[0].message)
        finish = r.choices[0].finish_reason
    assert reasoning == RIDDLE_REASONING
    assert content == RIDDLE_ANSWER[: RIDDLE_ANSWER.index("answer is")]
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_scripted_max_tokens_gives_length(scripted_openai, stream):
    kwargs = dict(model=SERVED_MODEL, messages=user(RIDDLE_PROMPT), max_tokens=3, temperature=0,
                  timeout=CLIENT_TIMEOUT)
    if stream:
        got = collect_stream(
            scripted_openai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        )
        assert got["finish_reason"] == "length"
        assert got["usage"].completion_tokens == 3
        assert RIDDLE_REASONING.startswith(got["reasoning"]) and got["content"] == ""
    else:
        r = scripted_openai.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 3
        reasoning, content = full_output(r.choices[0].message)
        assert RIDDLE_REASONING.startswith(reasoning) and content == ""


def test_script_does_not_fire_without_trigger(scripted_openai):
    r = scripted_openai.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=12, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    reasoning, content = full_output(r.choices[0].message)
    assert (reasoning, content) != (RIDDLE_REASONING, RIDDLE_ANSWER)
    assert WEATHER_REASONING not in reasoning


def test_script_keys_on_last_user_message(scripted_openai):
    messages = [
        {"role": "user", "content": RIDDLE_PROMPT},
        {"role": "assistant", "content": RIDDLE_ANSWER},
        {"role": "user", "content": PLAIN_PROMPT},
    ]
    r = scripted_openai.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=12, temperature=0, timeout=CLIENT_TIMEOUT
    )
    assert full_output(r.choices[0].message) != (RIDDLE_REASONING, RIDDLE_ANSWER)


# ---------------------------------------------------------------------------------------------
# Models, health, metrics
# ---------------------------------------------------------------------------------------------


def test_models_list_and_retrieve(openai_client):
    ids = [m.id for m in openai_client.models.list(timeout=CLIENT_TIMEOUT)]
    assert ids == [SERVED_MODEL]
    m = openai_client.models.retrieve(SERVED_MODEL, timeout=CLIENT_TIMEOUT)
    assert m.id == SERVED_MODEL and m.object == "model"


def test_models_retrieve_unknown_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.models.retrieve("no-such-model", timeout=CLIENT_TIMEOUT)
    assert exc.value.status_code == 404
    assert exc.value.code == "model_not_found"


def test_health(default_server):
    resp = http_request(default_server, "GET", "/health")
    assert resp.status == 200
    assert resp.json()["status"] == "ok"


METRIC_NAMES = [
    "deltafin_requests_total",
    "deltafin_prompt_tokens_total",
    "deltafin_generated_tokens_total",
    "deltafin_time_to_first_token_seconds_sum",
    "deltafin_time_to_first_token_seconds_count",
    "deltafin_seconds_per_token_sum",
    "deltafin_seconds_per_token_count",
    "deltafin_expert_bytes_read_total",
    "deltafin_expert_cache_hit_rate",
    "deltafin_queue_length",
]


def test_metrics_count_a_request(openai_client, default_server):
    before = scrape_metrics(default_server)
    missing = [n for n in METRIC_NAMES if n not in before]
    assert not missing, f"missing metrics: {missing}"
    r = openai_client.chat.completions.create(
        model=SERVED_MODEL, messages=user(PLAIN_PROMPT), max_tokens=8, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    after = scrape_metrics(default_server)
    assert after["deltafin_requests_total"] >= before["deltafin_requests_total"] + 1
    assert after["deltafin_prompt_tokens_total"] - before["deltafin_prompt_tokens_total"] == r.usage.prompt_tokens
    assert (after["deltafin_generated_tokens_total"] - before["deltafin_generated_tokens_total"]
            == r.usage.completion_tokens)
    assert after["deltafin_time_to_first_token_seconds_count"] == before["deltafin_time_to_first_token_seconds_count"] + 1
    assert after["deltafin_time_to_first_token_seconds_sum"] > before["deltafin_time_to_first_token_seconds_sum"]
    if r.usage.completion_tokens >= 2:
        assert after["deltafin_seconds_per_token_count"] > before["deltafin_seconds_per_token_count"]
    assert 0.0 <= after["deltafin_expert_cache_hit_rate"] <= 1.0
    assert after["deltafin_expert_bytes_read_total"] >= before["deltafin_expert_bytes_read_total"] >= 0
    assert after["deltafin_queue_length"] == 0


def test_next_chat_turn_reuses_the_previous_prompt_state(openai_client, default_server):
    """A chat's next turn resends the history: the server resumes from the previous prompt's
    state (only the new tokens run) and answers exactly as without the snapshot."""

    def ask(messages, **kw):
        return openai_client.chat.completions.create(
            model=SERVED_MODEL, messages=messages, temperature=0, timeout=CLIENT_TIMEOUT, **kw
        )

    def cached_total():
        return scrape_metrics(default_server)["deltafin_prompt_tokens_cached_total"]

    turn1 = user("Tell me about lighthouses.")
    first = ask(turn1, max_tokens=6)
    reasoning, content = full_output(first.choices[0].message)
    turn2 = turn1 + [
        {"role": "assistant", "content": content, "reasoning_content": reasoning},
        {"role": "user", "content": "And about boats?"},
    ]
    # A miss: an unrelated prompt replaces the snapshot first.
    ask(user("Something unrelated."), max_tokens=1)
    before = cached_total()
    miss = ask(turn2, max_tokens=8, logprobs=True, top_logprobs=2)
    assert cached_total() == before
    # A hit: turn 1's prompt is in the snapshot again.
    again = ask(turn1, max_tokens=1)
    before = cached_total()
    hit = ask(turn2, max_tokens=8, logprobs=True, top_logprobs=2)
    assert cached_total() - before == again.usage.prompt_tokens
    # OpenAI's field says the same per request.
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert hit.usage.prompt_tokens == miss.usage.prompt_tokens > again.usage.prompt_tokens
    assert full_output(hit.choices[0].message) == full_output(miss.choices[0].message)
    lp = lambda r: [(t.token, t.logprob) for t in r.choices[0].logprobs.content]  # noqa: E731
    assert lp(hit) == lp(miss)
