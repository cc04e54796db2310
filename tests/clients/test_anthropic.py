"""POST /v1/messages (Anthropic Messages API) through the official `anthropic` client."""

from __future__ import annotations

import json

import anthropic
import pytest

from conftest import (
    API_KEY,
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
    WEATHER_TOOL_ANTHROPIC,
    WEATHER_TOOL_ARGS,
    WEATHER_TOOL_NAME,
    http_request,
    make_anthropic,
)

RAW_EVENT_TYPES = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}
DELTA_TYPES = {
    "thinking": {"thinking_delta", "signature_delta"},
    "text": {"text_delta"},
    "tool_use": {"input_json_delta"},
}

# anthropic 2.x's messages.create has no temperature/top_p/top_k arguments; they go in the body.
GREEDY = {"temperature": 0}

RIDDLE_BLOCKS = [("thinking", RIDDLE_REASONING), ("text", RIDDLE_ANSWER)]
WEATHER_BLOCKS = [
    ("thinking", WEATHER_REASONING),
    ("text", WEATHER_ANSWER),
    ("tool_use", WEATHER_TOOL_NAME, WEATHER_TOOL_ARGS),
]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def blocks_of(message) -> list[tuple]:
    out = []
    for block in message.content:
        if block.type == "thinking":
            assert isinstance(block.signature, str)
            out.append(("thinking", block.thinking))
        elif block.type == "text":
            out.append(("text", block.text))
        elif block.type == "tool_use":
            assert isinstance(block.id, str) and block.id
            out.append(("tool_use", block.name, block.input))
        else:
            pytest.fail(f"unexpected content block {block!r}")
    return out


def summary(message) -> dict:
    """The parts of a Message that must agree between streamed and non-streamed runs."""
    return {
        "type": message.type,
        "role": message.role,
        "model": message.model,
        "content": blocks_of(message),
        "stop_reason": message.stop_reason,
        "stop_sequence": message.stop_sequence,
        # Prompt tokens, whether computed or read from stored state.
        "input_tokens": message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
        "output_tokens": message.usage.output_tokens,
    }


def create(client, prompt: str, **kw):
    kw.setdefault("max_tokens", 300)
    kw.setdefault("extra_body", GREEDY)
    return client.messages.create(model=SERVED_MODEL, messages=user(prompt), timeout=CLIENT_TIMEOUT, **kw)


def stream_events(client, prompt: str, **kw):
    """Returns (raw events, final message) of a `messages.stream` run."""
    kw.setdefault("max_tokens", 300)
    kw.setdefault("extra_body", GREEDY)
    with client.messages.stream(model=SERVED_MODEL, messages=user(prompt), timeout=CLIENT_TIMEOUT, **kw) as stream:
        events = [e for e in stream if e.type in RAW_EVENT_TYPES]
        final = stream.get_final_message()
    return events, final


def check_event_sequence(events) -> dict[int, list]:
    """Asserts message_start, per-block start/delta.../stop, message_delta, message_stop.
    Returns {block index: [delta events]}."""
    types = [e.type for e in events]
    assert types[0] == "message_start", types
    assert types[-2:] == ["message_delta", "message_stop"], types
    deltas: dict[int, list] = {}
    i, index = 1, 0
    while events[i].type == "content_block_start":
        start = events[i]
        assert start.index == index, (start.index, index)
        kind = start.content_block.type
        assert kind in DELTA_TYPES, kind
        i += 1
        deltas[index] = []
        while events[i].type == "content_block_delta":
            assert events[i].index == index, "deltas of different blocks interleaved"
            assert events[i].delta.type in DELTA_TYPES[kind], (kind, events[i].delta.type)
            deltas[index].append(events[i])
            i += 1
        assert events[i].type == "content_block_stop" and events[i].index == index, types
        assert deltas[index], f"block {index} ({kind}) had no deltas"
        i += 1
        index += 1
    assert i == len(events) - 2, f"unexpected events: {types[i:]}"
    final_delta = events[-2]
    assert final_delta.delta.stop_reason is not None
    assert final_delta.usage.output_tokens >= 1
    return deltas


# ---------------------------------------------------------------------------------------------
# Non-streaming
# ---------------------------------------------------------------------------------------------


def test_messages_riddle_thinking_and_text(scripted_anthropic, reference_encoding):
    msg = create(scripted_anthropic, RIDDLE_PROMPT)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.model == SERVED_MODEL
    assert isinstance(msg.id, str) and msg.id
    assert blocks_of(msg) == RIDDLE_BLOCKS
    assert msg.stop_reason == "end_turn"
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens > 0
    n = len(reference_encoding.encode(RIDDLE_TEXT, allowed_special="all"))
    assert msg.usage.output_tokens in (n - 1, n), (msg.usage.output_tokens, n)


def test_messages_weather_tool_use(scripted_anthropic):
    msg = create(scripted_anthropic, WEATHER_PROMPT, tools=[WEATHER_TOOL_ANTHROPIC])
    assert blocks_of(msg) == WEATHER_BLOCKS
    assert msg.stop_reason == "tool_use"


def test_messages_usage_matches_openai_chat(scripted_anthropic, scripted_openai):
    msg = create(scripted_anthropic, RIDDLE_PROMPT)
    chat = scripted_openai.chat.completions.create(
        model=SERVED_MODEL, messages=user(RIDDLE_PROMPT), max_tokens=300, temperature=0, timeout=CLIENT_TIMEOUT
    )
    # Anthropic counts prompt tokens read from stored state apart from input_tokens.
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens


def test_messages_max_tokens(scripted_anthropic):
    msg = create(scripted_anthropic, RIDDLE_PROMPT, max_tokens=3)
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 3
    kinds = [b[0] for b in blocks_of(msg)]
    assert kinds == ["thinking"], kinds
    assert RIDDLE_REASONING.startswith(msg.content[0].thinking)


def test_messages_stop_sequence(scripted_anthropic):
    msg = create(scripted_anthropic, RIDDLE_PROMPT, stop_sequences=["nope-never", "answer is"])
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "answer is"
    assert blocks_of(msg) == [("thinking", RIDDLE_REASONING), ("text", "The ")]


def test_messages_greedy_is_deterministic(scripted_anthropic):
    a = create(scripted_anthropic, PLAIN_PROMPT, max_tokens=16)
    b = create(scripted_anthropic, PLAIN_PROMPT, max_tokens=16)
    assert a.usage.output_tokens >= 1
    assert summary(a) == summary(b)


def test_messages_system_and_tool_result_turns(scripted_anthropic):
    msg = scripted_anthropic.messages.create(
        model=SERVED_MODEL,
        max_tokens=4,
        extra_body=GREEDY,
        system="You are a forecaster.",
        tools=[WEATHER_TOOL_ANTHROPIC],
        messages=[
            {"role": "user", "content": "Forecast for Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": WEATHER_TOOL_NAME,
                     "input": {"city": "Oslo", "days": 1}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
        timeout=CLIENT_TIMEOUT,
    )
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert 1 <= msg.usage.output_tokens <= 4
    short = scripted_anthropic.messages.create(
        model=SERVED_MODEL, max_tokens=4, extra_body=GREEDY, system="You are a forecaster.",
        tools=[WEATHER_TOOL_ANTHROPIC], messages=user("Forecast for Oslo?"), timeout=CLIENT_TIMEOUT,
    )
    total = lambda m: m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)  # noqa: E731
    assert total(msg) > total(short)


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, tools, expected",
    [
        (RIDDLE_PROMPT, None, RIDDLE_BLOCKS),
        (WEATHER_PROMPT, [WEATHER_TOOL_ANTHROPIC], WEATHER_BLOCKS),
    ],
    ids=["riddle", "weather"],
)
def test_messages_stream_matches_non_streaming(scripted_anthropic, prompt, tools, expected):
    kw = {"tools": tools} if tools else {}
    whole = create(scripted_anthropic, prompt, **kw)
    events, final = stream_events(scripted_anthropic, prompt, **kw)
    deltas = check_event_sequence(events)

    assert blocks_of(final) == expected
    assert summary(final) == summary(whole)

    # Incremental: thinking and text arrive in more than one delta each.
    for index, (kind, *_rest) in enumerate(expected):
        if kind in ("thinking", "text"):
            content_deltas = [d for d in deltas[index] if d.delta.type in ("thinking_delta", "text_delta")]
            assert len(content_deltas) >= 2, (kind, len(content_deltas))
        if kind == "tool_use":
            start = [e for e in events if e.type == "content_block_start" and e.index == index][0]
            assert start.content_block.name == WEATHER_TOOL_NAME
            assert start.content_block.id
            partial = "".join(d.delta.partial_json for d in deltas[index])
            assert json.loads(partial) == WEATHER_TOOL_ARGS


def test_messages_stream_stop_sequence(scripted_anthropic):
    events, final = stream_events(scripted_anthropic, RIDDLE_PROMPT, stop_sequences=["answer is"])
    check_event_sequence(events)
    assert final.stop_reason == "stop_sequence"
    assert final.stop_sequence == "answer is"
    assert blocks_of(final) == [("thinking", RIDDLE_REASONING), ("text", "The ")]


def test_messages_stream_max_tokens(scripted_anthropic):
    events, final = stream_events(scripted_anthropic, RIDDLE_PROMPT, max_tokens=3)
    check_event_sequence(events)
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3


def test_raw_messages_sse_has_event_names(scripted_server):
    """Each SSE `event:` name equals the `type` of its `data:` payload."""
    import http.client

    conn = http.client.HTTPConnection(scripted_server.host, scripted_server.port, timeout=CLIENT_TIMEOUT)
    try:
        conn.request(
            "POST", "/v1/messages",
            body=json.dumps({"model": SERVED_MODEL, "max_tokens": 50, "stream": True, "messages": user(RIDDLE_PROMPT)}),
            headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/event-stream")
        raw = resp.read().decode("utf-8")
    finally:
        conn.close()
    pairs = []
    for frame in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        event = [line[6:].strip() for line in lines if line.startswith("event:")]
        data = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert len(event) == 1 and len(data) == 1, frame
        pairs.append((event[0], json.loads(data[0])["type"]))
    assert pairs and all(e == t for e, t in pairs), pairs
    assert pairs[0][0] == "message_start" and pairs[-1][0] == "message_stop"
    assert "[DONE]" not in raw


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_messages_bad_request_raises_bad_request_error(scripted_anthropic):
    with pytest.raises(anthropic.BadRequestError) as exc:
        scripted_anthropic.messages.create(model=SERVED_MODEL, max_tokens=8, messages=[], timeout=CLIENT_TIMEOUT)
    assert exc.value.status_code == 400


def test_messages_unknown_model_raises_not_found(scripted_anthropic):
    with pytest.raises(anthropic.NotFoundError):
        scripted_anthropic.messages.create(
            model="claude-nonexistent", max_tokens=8, messages=user("hi"), timeout=CLIENT_TIMEOUT
        )


def test_messages_error_body_has_anthropic_shape(scripted_server):
    resp = http_request(
        scripted_server, "POST", "/v1/messages",
        {"model": SERVED_MODEL, "max_tokens": 8, "messages": []},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert resp.status == 400
    body = resp.json()
    assert body.get("type") == "error", body
    assert body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_messages_wrong_api_key_raises_authentication_error(api_key_server):
    client = make_anthropic(api_key_server, api_key="wrong-key")
    with pytest.raises(anthropic.AuthenticationError) as exc:
        client.messages.create(model=SERVED_MODEL, max_tokens=8, messages=user("hi"), timeout=CLIENT_TIMEOUT)
    assert exc.value.status_code == 401


def test_messages_correct_api_key_is_accepted(api_key_server):
    client = make_anthropic(api_key_server, api_key=API_KEY)
    msg = create(client, RIDDLE_PROMPT)
    assert blocks_of(msg) == RIDDLE_BLOCKS
