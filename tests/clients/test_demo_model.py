"""The bundled demo model (models/k3-demo, trained, then fine-tuned on K3's chat format) through the
server, with a bf16 spine:
- the official openai client's completion of the fixed prompt is the greedy continuation its
  training framework recorded (models/k3-demo/continuation.json: PyTorch, float32), token for
  token, whole and streamed;
- a chat question asked through every API the server speaks (chat completions whole and streamed,
  the Responses API, Anthropic Messages, Ollama's /api/chat, each with its official client) gets
  the recorded greedy answer (models/k3-demo/chat.json): the same reasoning, the thinking span
  closed, and the same answer;
- with a `lookup_docs` tool declared the model calls it with the recorded arguments, and after the
  tool's result answers as recorded."""

import json
import subprocess
from pathlib import Path

import pytest

import ollama

from conftest import CLIENT_TIMEOUT, REPO_ROOT, SERVED_MODEL, ServerLauncher, make_anthropic, make_openai

DEMO = REPO_ROOT / "models" / "k3-demo"


@pytest.fixture(scope="module")
def demo_server(deltafin_bin: Path, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("demo") / "store"
    subprocess.run(
        [str(deltafin_bin), "convert", "--from", str(DEMO / "hf"), "--to", str(store), "--spine", "bf16"],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=300,
    )
    launcher = ServerLauncher(deltafin_bin, store, tmp_path_factory.mktemp("demo-logs"))
    yield launcher.start()
    launcher.stop_all()


def test_completion_is_the_recorded_continuation(demo_server):
    rec = json.loads((DEMO / "continuation.json").read_text())
    client = make_openai(demo_server)
    r = client.completions.create(
        model=SERVED_MODEL, prompt=rec["prompt"], max_tokens=len(rec["tokens"]), temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.usage.prompt_tokens == len(rec["prompt_ids"])
    assert r.usage.completion_tokens == len(rec["tokens"])
    assert r.choices[0].text == rec["text"]


def test_streamed_completion_is_the_recorded_continuation(demo_server):
    rec = json.loads((DEMO / "continuation.json").read_text())
    client = make_openai(demo_server)
    stream = client.completions.create(
        model=SERVED_MODEL, prompt=rec["prompt"], max_tokens=len(rec["tokens"]), temperature=0, stream=True,
        timeout=CLIENT_TIMEOUT,
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == rec["text"]



CHAT = json.loads((DEMO / "chat.json").read_text())


def reasoning_of(obj) -> str | None:
    """The server's `reasoning_content` (an extra field to the openai client)."""
    return (obj.model_extra or {}).get("reasoning_content")


def test_chat_completion_is_the_recorded_answer(demo_server):
    client = make_openai(demo_server)
    r = client.chat.completions.create(
        model=SERVED_MODEL, messages=CHAT["messages"], max_tokens=200, temperature=0, timeout=CLIENT_TIMEOUT,
    )
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert reasoning_of(m) == CHAT["reasoning"]
    assert m.content == CHAT["content"]
    assert not m.tool_calls
    assert r.usage.prompt_tokens == len(CHAT["prompt_ids"])
    assert r.usage.completion_tokens == len(CHAT["tokens"])


def test_streamed_chat_completion_is_the_recorded_answer(demo_server):
    client = make_openai(demo_server)
    stream = client.chat.completions.create(
        model=SERVED_MODEL, messages=CHAT["messages"], max_tokens=200, temperature=0, stream=True,
        timeout=CLIENT_TIMEOUT,
    )
    reasoning, content, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning.append(reasoning_of(d) or "")
        content.append(d.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == CHAT["reasoning"]
    assert "".join(content) == CHAT["content"]
    assert finish == "stop"


def test_responses_api_gives_the_recorded_answer(demo_server):
    client = make_openai(demo_server)
    r = client.responses.create(
        model=SERVED_MODEL, input=CHAT["messages"][0]["content"], max_output_tokens=200, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.status == "completed"
    assert r.output_text == CHAT["content"]
    reasoning = [c.text for o in r.output if o.type == "reasoning" for c in (o.content or [])]
    assert "".join(reasoning) == CHAT["reasoning"]


def test_anthropic_messages_give_the_recorded_answer(demo_server):
    client = make_anthropic(demo_server)
    # greedy: this client version takes no `temperature` argument, the API still does
    r = client.messages.create(
        model=SERVED_MODEL, messages=CHAT["messages"], max_tokens=200, extra_body={"temperature": 0},
        timeout=CLIENT_TIMEOUT,
    )
    assert r.stop_reason == "end_turn"
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == CHAT["reasoning"]
    assert r.content[1].text == CHAT["content"]


def test_ollama_chat_gives_the_recorded_answer(demo_server):
    client = ollama.Client(host=demo_server.url, timeout=CLIENT_TIMEOUT)
    r = client.chat(model=SERVED_MODEL, messages=CHAT["messages"], options={"temperature": 0, "num_predict": 200})
    assert r.done_reason == "stop"
    assert r.message.thinking == CHAT["reasoning"]
    assert r.message.content == CHAT["content"]


def test_tool_call_and_answer_from_its_result(demo_server):
    trip = CHAT["tool_round_trip"]
    client = make_openai(demo_server)
    messages = [{"role": "user", "content": trip["question"]}]
    r = client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, tools=trip["tools"], max_tokens=200, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert reasoning_of(m) == trip["first_reasoning"]
    assert len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert call.function.name == trip["call"]["name"]
    assert json.loads(call.function.arguments) == trip["call"]["arguments"]
    # the client sends the turn back with its reasoning, as chat_eval.py rendered it
    messages.append({
        "role": "assistant", "content": m.content or "", "reasoning_content": reasoning_of(m),
        "tool_calls": [{"id": call.id, "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments}}],
    })
    messages.append({"role": "tool", "tool_call_id": call.id, "content": trip["tool_result"]})
    r = client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, tools=trip["tools"], max_tokens=200, temperature=0,
        timeout=CLIENT_TIMEOUT,
    )
    assert r.choices[0].finish_reason == "stop"
    assert reasoning_of(r.choices[0].message) == trip["answer_reasoning"]
    assert r.choices[0].message.content == trip["answer"]
