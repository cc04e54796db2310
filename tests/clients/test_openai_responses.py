"""The Responses API (`/v1/responses`) through the official `openai` client: create, stream,
tools with a `function_call_output` round trip, `previous_response_id` with cached tokens,
`GET` and `DELETE`, and errors in OpenAI's shape.

Scripted replies (conftest) stand in for a trained K3: "weather" reasons, answers and calls
`get_weather`; "riddle" reasons and answers.
"""

from __future__ import annotations

import json

import openai
import pytest

from conftest import (
    CLIENT_TIMEOUT,
    PLAIN_PROMPT,
    RIDDLE_ANSWER,
    RIDDLE_PROMPT,
    RIDDLE_REASONING,
    SERVED_MODEL,
    WEATHER_ANSWER,
    WEATHER_PROMPT,
    WEATHER_REASONING,
    WEATHER_TOOL_ARGS,
    WEATHER_TOOL_NAME,
    WEATHER_TOOL_OPENAI,
    http_request,
)

# The Responses API's flat function tool.
WEATHER_TOOL = {"type": "function", "name": WEATHER_TOOL_NAME, **{
    k: v for k, v in WEATHER_TOOL_OPENAI["function"].items() if k != "name"
}}


def reasoning_text(item) -> str:
    return "".join(c.text for c in (item.content or []))


def test_create_returns_reasoning_and_message_items(scripted_openai):
    r = scripted_openai.responses.create(
        model=SERVED_MODEL, input=RIDDLE_PROMPT, max_output_tokens=200, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"], kinds
    assert reasoning_text(r.output[0]) == RIDDLE_REASONING
    assert r.output_text == RIDDLE_ANSWER
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_instructions_and_message_items_are_accepted(scripted_openai):
    r = scripted_openai.responses.create(
        model=SERVED_MODEL, instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": RIDDLE_PROMPT}]}],
        max_output_tokens=200, temperature=0, reasoning={"effort": "low"}, timeout=CLIENT_TIMEOUT,
    )
    assert r.output_text == RIDDLE_ANSWER
    assert r.instructions == "Answer briefly."


def test_max_output_tokens_makes_it_incomplete(scripted_openai):
    r = scripted_openai.responses.create(
        model=SERVED_MODEL, input=RIDDLE_PROMPT, max_output_tokens=3, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    # The item it ended inside is incomplete too.
    assert r.output[-1].status == "incomplete"
    events = list(scripted_openai.responses.create(
        model=SERVED_MODEL, input=RIDDLE_PROMPT, max_output_tokens=3, temperature=0, stream=True, timeout=CLIENT_TIMEOUT,
    ))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def test_stream_sends_the_documented_event_sequence(scripted_openai):
    events = list(scripted_openai.responses.create(
        model=SERVED_MODEL, input=WEATHER_PROMPT, tools=[WEATHER_TOOL], max_output_tokens=300, temperature=0,
        stream=True, timeout=CLIENT_TIMEOUT,
    ))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for k in ("response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
              "response.output_text.delta", "response.output_text.done", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done"):
        assert k in kinds, (k, kinds)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == WEATHER_ANSWER
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == WEATHER_REASONING
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == WEATHER_TOOL_ARGS
    # Every added item is done, in order, and the final response lists the same items.
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done
    final = events[-1].response
    assert [o.id for o in final.output] == done
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]


def test_stream_helper_accumulates_the_response(scripted_openai):
    """The SDK's `responses.stream()` rebuilds the response from the events and checks their
    order as it goes."""
    with scripted_openai.responses.stream(
        model=SERVED_MODEL, input=RIDDLE_PROMPT, max_output_tokens=200, temperature=0, timeout=CLIENT_TIMEOUT,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == RIDDLE_ANSWER


def test_tool_call_round_trip_with_function_call_output(scripted_openai):
    first = scripted_openai.responses.create(
        model=SERVED_MODEL, input=[{"role": "user", "content": WEATHER_PROMPT}], tools=[WEATHER_TOOL],
        max_output_tokens=300, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == WEATHER_TOOL_NAME and json.loads(call.arguments) == WEATHER_TOOL_ARGS
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    # The client runs the tool and sends its output with the whole history (store=false style).
    history = [{"role": "user", "content": WEATHER_PROMPT}] + [o.model_dump(exclude_none=True) for o in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'})
    second = scripted_openai.responses.create(
        model=SERVED_MODEL, input=history, tools=[WEATHER_TOOL], max_output_tokens=300, temperature=0,
        store=False, timeout=CLIENT_TIMEOUT,
    )
    assert second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens
    # The first prompt's state was kept: the second prompt extends it.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # store=false: not retrievable.
    with pytest.raises(openai.NotFoundError):
        scripted_openai.responses.retrieve(second.id, timeout=CLIENT_TIMEOUT)


def test_previous_response_id_continues_with_cached_tokens(scripted_openai):
    first = scripted_openai.responses.create(
        model=SERVED_MODEL, input=WEATHER_PROMPT, tools=[WEATHER_TOOL], max_output_tokens=300, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    call = next(o for o in first.output if o.type == "function_call")
    second = scripted_openai.responses.create(
        model=SERVED_MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C and sunny"}],
        max_output_tokens=300, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # A third turn, a new user message, on top of the second: the conversation is carried (the
    # prompt is longer than the first's). K3's template drops the reasoning of finished turns
    # once a new user message comes, so this prompt does not extend the last one and is
    # computed again (as in chat completions; `--state-dir` keeps more states to resume from).
    third = scripted_openai.responses.create(
        model=SERVED_MODEL, previous_response_id=second.id, input=RIDDLE_PROMPT, max_output_tokens=200,
        temperature=0, timeout=CLIENT_TIMEOUT,
    )
    assert third.output_text == RIDDLE_ANSWER
    assert third.usage.input_tokens > first.usage.input_tokens


def test_get_and_delete_a_stored_response(scripted_openai):
    r = scripted_openai.responses.create(
        model=SERVED_MODEL, input=RIDDLE_PROMPT, max_output_tokens=200, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    again = scripted_openai.responses.retrieve(r.id, timeout=CLIENT_TIMEOUT)
    assert again.id == r.id and again.output_text == RIDDLE_ANSWER
    scripted_openai.responses.delete(r.id, timeout=CLIENT_TIMEOUT)
    with pytest.raises(openai.NotFoundError):
        scripted_openai.responses.retrieve(r.id, timeout=CLIENT_TIMEOUT)
    with pytest.raises(openai.BadRequestError) as exc:
        scripted_openai.responses.create(
            model=SERVED_MODEL, previous_response_id=r.id, input="more", max_output_tokens=5, timeout=CLIENT_TIMEOUT,
        )
    assert exc.value.body["param"] == "previous_response_id"


def test_errors_name_the_field(scripted_server):
    cases = [
        ({"model": SERVED_MODEL}, "input"),
        ({"model": SERVED_MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"model": SERVED_MODEL, "input": "hi", "tools": [{"type": "holodeck"}]}, "tools[0]"),
        ({"model": SERVED_MODEL, "input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"model": SERVED_MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": SERVED_MODEL, "input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
    ]
    for body, param in cases:
        r = http_request(scripted_server, "POST", "/v1/responses", body)
        assert r.status == 400, (body, r.body)
        assert r.json()["error"]["param"] == param, (body, r.body)
    r = http_request(scripted_server, "POST", "/v1/responses", {"model": "nope", "input": "hi"})
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found", r.body


def test_plain_model_output_is_a_message(openai_client):
    """The random tiny model without a script: whatever it produces arrives as items."""
    r = openai_client.responses.create(
        model=SERVED_MODEL, input=PLAIN_PROMPT, max_output_tokens=8, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens >= 1
