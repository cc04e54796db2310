"""POST /tokenize and /detokenize against the `tiktoken` package (K3 regex and specials)."""

from __future__ import annotations

import json

import pytest

from conftest import (
    DEFAULT_CONTEXT,
    SERVED_MODEL,
    TOKENIZER_CHECK,
    http_request,
)

MIXED = "Hello 世界! Ünïcödé — 123456 naïve café, 中文字符 🚀🔥\ttabs\r\nand  spaces   \n\nDON'T we'll"
TEXTS = [
    MIXED,
    "The lighthouse keeper's daughter counted the boats.",
    "  leading spaces, trailing spaces   \n\nand blank lines\r\n",
    "emoji only 🚀🔥🎉 and a zero-width joiner 👩‍💻",
    "x",
    "",
]
WITH_MARKUP = '<|open|>message role="user"<|sep|>Count the waves.<|close|>message<|sep|><|end_of_msg|>'


def tokenize(server, **payload):
    resp = http_request(server, "POST", "/tokenize", {"model": SERVED_MODEL, **payload})
    assert resp.status == 200, resp.body[:500]
    return resp.json()


def detokenize(server, tokens):
    resp = http_request(server, "POST", "/detokenize", {"model": SERVED_MODEL, "tokens": tokens})
    assert resp.status == 200, resp.body[:500]
    return resp.json()["prompt"]


def test_reference_encoding_reproduces_fixture_cases(reference_encoding):
    """Guards the reference itself: the package must agree with tokenizer_check.json."""
    for case in json.loads(TOKENIZER_CHECK.read_text())["cases"]:
        if case.get("allowed_special") == "all":
            ids = reference_encoding.encode(case["text"], allowed_special="all")
        else:
            ids = reference_encoding.encode_ordinary(case["text"])
        assert ids == case["ids"], case["text"]


@pytest.mark.parametrize("text", TEXTS + [WITH_MARKUP], ids=range(len(TEXTS) + 1))
def test_tokenize_matches_tiktoken(default_server, reference_encoding, text):
    got = tokenize(default_server, prompt=text)
    expected = reference_encoding.encode(text, allowed_special="all")
    assert got["tokens"] == expected
    assert got["count"] == len(expected)
    assert got["max_model_len"] == DEFAULT_CONTEXT


def test_tokenize_recognises_special_tokens(default_server):
    tokens = tokenize(default_server, prompt="<|end_of_msg|>")["tokens"]
    assert tokens == [302]


@pytest.mark.parametrize("text", TEXTS + [WITH_MARKUP], ids=range(len(TEXTS) + 1))
def test_detokenize_round_trip(default_server, text):
    tokens = tokenize(default_server, prompt=text)["tokens"]
    assert detokenize(default_server, tokens) == text


def test_detokenize_matches_tiktoken_decode(default_server, reference_encoding):
    ids = list(range(0, 300, 7))
    assert detokenize(default_server, ids) == reference_encoding.decode(ids)


def test_tokenize_messages_uses_chat_template(default_server, reference_encoding):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count the waves."},
    ]
    got = tokenize(default_server, messages=messages)
    assert got["count"] == len(got["tokens"]) > 0
    text = detokenize(default_server, got["tokens"])
    assert "Be brief." in text and "Count the waves." in text
    assert text.index("Be brief.") < text.index("Count the waves.")
    # The generation prompt opens the reasoning section.
    assert text.endswith("<|open|>think<|sep|>"), text[-80:]
    # Adding a turn makes the prompt longer.
    longer = tokenize(default_server, messages=messages + [
        {"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Again?"},
    ])
    assert longer["count"] > got["count"]


def test_named_tool_choice_renders_as_required_with_only_that_tool(default_server):
    """K3's format has no "call this function" message: a named tool_choice is served as
    tool_choice=required with only the named tool declared."""
    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    g = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "call something"}]

    def tokens(**kw):
        r = http_request(default_server, "POST", "/tokenize", {"messages": messages, **kw})
        assert r.status == 200, r.body
        return r.json()["tokens"]

    named = tokens(tools=[f, g], tool_choice={"type": "function", "function": {"name": "g"}})
    assert named == tokens(tools=[g], tool_choice="required")
    assert named != tokens(tools=[f, g], tool_choice="required")
