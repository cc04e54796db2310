"""Prompt states kept on disk (`serve --state-dir`): two conversations interleaved each resume
from their own stored turn, answers equal a server without the store token for token (with
logprobs), a restarted server finds the states again, and corrupt snapshots are dropped unused.
Driven through the official openai client over loopback."""

from __future__ import annotations

from pathlib import Path

import openai

from conftest import CLIENT_TIMEOUT, SERVED_MODEL, scrape_metrics


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def stop(server) -> None:
    """End a server on purpose (a restart), so teardown does not report it."""
    server.stopped_by_test = True
    server.stop()


def ask(server, prompt: str, max_tokens: int = 6):
    r = client(server).completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2, timeout=CLIENT_TIMEOUT
    )
    lp = r.choices[0].logprobs
    return r.choices[0].text, list(zip(lp.tokens, lp.token_logprobs)), r.usage


A1 = "The lighthouse keeper wrote in his log that the storm had passed, and"
B1 = "A recipe for bread begins with flour, water, salt and"


def test_conversations_resume_from_disk_across_requests_and_restarts(start_server, tmp_path: Path):
    states = tmp_path / "states"
    plain = start_server()
    stored = start_server("--state-dir", str(states), "--state-budget", "1G")
    # First turns of two conversations, interleaved; each leaves its prompt and its turn.
    a1, b1 = ask(stored, A1), ask(stored, B1)
    a2_prompt, b2_prompt = A1 + a1[0] + " Then", B1 + b1[0] + " Then"
    # Second turns, interleaved: each resumes from its own first turn on disk (the in-memory
    # cache holds only the last prompt, which is the other conversation's).
    for prompt, first in [(a2_prompt, a1), (b2_prompt, b1)]:
        text, lps, usage = ask(stored, prompt)
        assert usage.prompt_tokens_details.cached_tokens >= first[2].prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        # Bit for bit what a server without the store answers (the logprobs are exact floats).
        assert (text, lps) == ask(plain, prompt)[:2]
    m = scrape_metrics(stored)
    assert m["deltafin_state_hits_total"] >= 2
    assert m["deltafin_state_snapshots_written_total"] >= 4
    assert m["deltafin_state_bytes"] > 0
    # A restart: the new process resumes conversation A from the disk.
    stop(stored)
    again = start_server("--state-dir", str(states), "--state-budget", "1G")
    text, lps, usage = ask(again, a2_prompt)
    assert usage.prompt_tokens_details.cached_tokens >= a1[2].prompt_tokens
    assert (text, lps) == ask(plain, a2_prompt)[:2]
    stop(again)
    # Corrupt every snapshot: a new process finds them, refuses and deletes each, and answers
    # as from scratch.
    files = list(states.glob("*.dfstate"))
    assert files
    for f in files:
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    broken = start_server("--state-dir", str(states), "--state-budget", "1G")
    text, lps, usage = ask(broken, b2_prompt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert (text, lps) == ask(plain, b2_prompt)[:2]
    assert scrape_metrics(broken)["deltafin_state_dropped_total"] >= 1
