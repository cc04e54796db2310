"""POST /v1/completions (legacy text completions) through the official `openai` client."""

from __future__ import annotations

import re

import pytest

from conftest import (
    CLIENT_TIMEOUT,
    PLAIN_PROMPT,
    RIDDLE_ANSWER,
    RIDDLE_REASONING,
    RIDDLE_TRIGGER,
    SERVED_MODEL,
    http_request,
)

# Special-token renderings (`[BOS]`, `<|open|>`, ...) may appear in the random model's text;
# stop strings are chosen away from them.
SPECIAL_RE = re.compile(r"\[[A-Za-z_]+\]|<\|[^|]*\|>")


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=SERVED_MODEL, prompt=prompt, timeout=CLIENT_TIMEOUT, **kw)


def test_completion_shape(openai_client, default_server):
    r = complete(openai_client, PLAIN_PROMPT, max_tokens=6)
    assert r.object == "text_completion"
    assert r.model == SERVED_MODEL
    assert isinstance(r.id, str) and r.id
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert 1 <= u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    tok = http_request(default_server, "POST", "/tokenize", {"model": SERVED_MODEL, "prompt": PLAIN_PROMPT})
    assert tok.status == 200
    assert u.prompt_tokens == tok.json()["count"]


def test_greedy_completion_is_deterministic(openai_client):
    a = complete(openai_client, PLAIN_PROMPT)
    b = complete(openai_client, PLAIN_PROMPT)
    assert a.usage.completion_tokens > 0 and a.choices[0].text
    assert (a.choices[0].text, a.choices[0].finish_reason) == (b.choices[0].text, b.choices[0].finish_reason)


def test_seeded_completion_is_reproducible_and_seed_matters(openai_client):
    def run(seed):
        return complete(openai_client, PLAIN_PROMPT, temperature=1.0, top_p=0.9, seed=seed).choices[0].text

    a1, a2 = run(11), run(11)
    assert a1 == a2 and a1
    others = {run(s) for s in (12, 13)}
    assert others != {a1}, "three different seeds gave the same 40-token sample"


def test_max_tokens_limits_output(openai_client):
    r = complete(openai_client, PLAIN_PROMPT, max_tokens=5, temperature=1.0, seed=5)
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.choices[0].finish_reason in ("length", "stop")
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 5


def test_scripted_completion_length_is_exact(scripted_openai):
    r = complete(scripted_openai, f"Tell a {RIDDLE_TRIGGER}:", max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_scripted_completion_returns_raw_text(scripted_openai):
    """Completions do no chat parsing: the scripted markup comes back as text."""
    r = complete(scripted_openai, f"Tell a {RIDDLE_TRIGGER}:", max_tokens=300)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert text.startswith(RIDDLE_REASONING)
    assert RIDDLE_ANSWER in text
    assert text.index(RIDDLE_ANSWER) > len(RIDDLE_REASONING)


def _pick_stop(text: str) -> str | None:
    """A 2-4 char ASCII alnum run from the middle of `text`, away from special tokens,
    whose first occurrence is well inside the text and preceded by an ASCII character."""
    banned = [m.span() for m in SPECIAL_RE.finditer(text)]
    for m in re.finditer(r"[A-Za-z0-9]{2,4}", text):
        start, end = m.span()
        if start < 3 or end > len(text) - 1:
            continue
        if any(s - 1 <= start < e + 1 or s - 1 < end <= e + 1 for s, e in banned):
            continue
        if not text[start - 1].isascii():
            continue
        candidate = m.group(0)
        if text.index(candidate) == start:
            return candidate
    return None


def test_stop_string_truncates_completion(openai_client):
    prompts = [PLAIN_PROMPT, "Once upon a time", "The harbour was quiet", "Count the waves."]
    for prompt in prompts:
        base = complete(openai_client, prompt, max_tokens=60)
        text = base.choices[0].text
        stop = _pick_stop(text)
        if stop is None:
            continue
        cut = complete(openai_client, prompt, max_tokens=60, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)], (stop, text)
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens <= base.usage.completion_tokens
        return
    pytest.fail("no usable stop string in any greedy output (model emits almost no ASCII?)")


def test_token_id_prompt_equals_string_prompt(openai_client, default_server, reference_encoding):
    prompt = "Hello, world! It's 2026."
    ids = reference_encoding.encode(prompt, allowed_special="all")
    assert reference_encoding.decode(ids) == prompt
    by_text = complete(openai_client, prompt, max_tokens=20)
    by_ids = complete(openai_client, ids, max_tokens=20)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens
    assert by_ids.usage.completion_tokens == by_text.usage.completion_tokens


def test_completion_logprobs_legacy_format(openai_client):
    r = complete(openai_client, PLAIN_PROMPT, max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None
    n = r.usage.completion_tokens
    assert len(lp.tokens) == n
    assert len(lp.token_logprobs) == n
    assert len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    distinct = 0
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        # Keys are token strings, so byte tokens that render alike ("\ufffd") can collide.
        assert 1 <= len(tops) <= 3
        assert all(v <= 0.0 for v in tops.values())
        if len(tops) == 3:
            distinct += 1
            # Greedy: the chosen token is the most likely one.
            assert abs(max(tops.values()) - chosen) < 1e-4, (chosen, tops)
    assert distinct >= 1, lp.top_logprobs


def test_streaming_completion_equals_non_streaming(openai_client):
    whole = complete(openai_client, PLAIN_PROMPT, max_tokens=32)
    text, finish, n_chunks = "", None, 0
    usage = None
    for chunk in complete(
        openai_client, PLAIN_PROMPT, max_tokens=32, stream=True, stream_options={"include_usage": True}
    ):
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason is not None:
                finish = chunk.choices[0].finish_reason
    assert text == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert n_chunks >= 2
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_scripted_streaming_completion_stop_is_held_back(scripted_openai):
    """A multi-token stop string must not leak its first tokens into the stream."""
    stop = "answer is"
    chunks = []
    finish = None
    for chunk in complete(
        scripted_openai, f"Tell a {RIDDLE_TRIGGER}:", max_tokens=300, stop=[stop], stream=True
    ):
        if chunk.choices:
            chunks.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(chunks)
    assert finish == "stop"
    assert stop not in text
    assert text.endswith("The ")
    assert text.startswith(RIDDLE_REASONING)


def test_end_of_message_stops_unless_ignore_eos(scripted_openai):
    """The model's EOS (`<|end_of_msg|>`) ends generation; vLLM's `ignore_eos` extension keeps
    going past it (for benchmarks), and then the token is ordinary output."""
    prompt = "Please stop at the early end."
    stopped = complete(scripted_openai, prompt)
    assert stopped.choices[0].text == "first"
    assert stopped.choices[0].finish_reason == "stop"
    went_on = complete(scripted_openai, prompt, extra_body={"ignore_eos": True})
    assert went_on.choices[0].text == "first<|end_of_msg|>second"
    assert went_on.usage.completion_tokens > stopped.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_multibyte_characters_split_across_tokens_arrive_whole(scripted_openai, stream):
    """The tiny vocabulary spells é, 東 and 🌍 as several byte tokens; raw completions must hold
    a split character until its last byte instead of printing U+FFFD."""
    from conftest import UNICODE_TEXT

    if stream:
        chunks = complete(scripted_openai, "unicode please", stream=True)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        text = complete(scripted_openai, "unicode please").choices[0].text
    assert text == UNICODE_TEXT
    assert "\ufffd" not in text
