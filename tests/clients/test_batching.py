"""Continuous batching through the server (`serve --max-batch N`), with the official openai client
on the trained demo model (bf16 spine):
- requests that arrive at staggered times while others run share the model's steps, and each
  gets exactly the tokens and log-probabilities it gets from a server that runs one request at a
  time (greedy and seeded sampling alike);
- a client that disconnects mid-stream takes only its own sequence out;
- a request that fails in a shared step gets its error (no server path), and the sequences that
  were in that step with it are computed again and still finish with their tokens alone;
- /metrics exports the batch size per step and /health the running sequences."""

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import CLIENT_TIMEOUT, REPO_ROOT, SERVED_MODEL, ServerLauncher, http_request, make_openai, scrape_metrics

DEMO = REPO_ROOT / "models" / "k3-demo"
STEP_DELAY_MS = 15
READ_FAULT_TRIGGER = "inject-read-fault"
INJECTED_PATH = "/srv/deltafin-injected"

# (prompt, max_tokens, sampling): greedy and seeded sampling, prompts of different lengths.
REQUESTS = [
    ("The river ran past the old mill, and", 24, {"temperature": 0}),
    ("Once upon a time", 18, {"temperature": 0.9, "seed": 7}),
    ("In the morning the market opened early; traders set out their goods and", 20, {"temperature": 0}),
    ("She wrote a letter to", 16, {"temperature": 0.7, "top_p": 0.9, "seed": 42}),
    ("A", 22, {"temperature": 1.0, "seed": 3}),
]


@pytest.fixture(scope="module")
def servers(deltafin_bin: Path, tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("demo") / "store"
    subprocess.run(
        [str(deltafin_bin), "convert", "--from", str(DEMO / "hf"), "--to", str(store), "--spine", "bf16"],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=300,
    )
    launcher = ServerLauncher(deltafin_bin, store, tmp_path_factory.mktemp("batch-logs"))
    solo = launcher.start("--max-batch", "1")
    batched = launcher.start(
        "--max-batch", "3", "--queue", "8", "--token-delay-ms", str(STEP_DELAY_MS), "--inject-faults",
    )
    yield solo, batched
    launcher.stop_all()


def test_max_batch_auto_comes_from_the_memory_plan(deltafin_bin: Path, servers, tmp_path: Path):
    solo, _ = servers
    store = solo.args[solo.args.index("--model") + 1]
    launcher = ServerLauncher(deltafin_bin, Path(store), tmp_path)
    try:
        # The demo model's states are small: the cap of 8. `auto` is the default.
        auto = launcher.start()
        assert scrape_metrics(auto)["deltafin_max_batch"] == 8
        assert "--max-batch auto: 8 sequences per step" in auto.stderr_text()
        # A budget a little above the model's minimum (about 112 MiB with one state of 1.9 MiB
        # at a context of 4,096) holds fewer: the plan has to fit every state.
        small = launcher.start("--max-batch", "auto", "--memory-budget", "120M")
        n = scrape_metrics(small)["deltafin_max_batch"]
        assert 1 <= n < 8, n
        assert f"--max-batch auto: {int(n)} sequences per step" in small.stderr_text()
        # A number is a cap on what the plan holds, not a demand beyond it.
        capped = launcher.start("--max-batch", "8", "--memory-budget", "120M")
        assert scrape_metrics(capped)["deltafin_max_batch"] == n
        assert f"--max-batch 8: {int(n)} sequences per step" in capped.stderr_text()
        two = launcher.start("--max-batch", "2")
        assert scrape_metrics(two)["deltafin_max_batch"] == 2
    finally:
        launcher.stop_all()
    bad = subprocess.run(
        [str(deltafin_bin), "serve", "--model", store, "--max-batch", "0"], capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and "neither a number" in bad.stderr


def complete(server, prompt: str, max_tokens: int, sampling: dict):
    client = make_openai(server)
    r = client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=max_tokens, logprobs=2, extra_body={"ignore_eos": True},
        timeout=CLIENT_TIMEOUT, **sampling,
    )
    c = r.choices[0]
    return c.text, c.logprobs.tokens, c.logprobs.token_logprobs, r.usage.completion_tokens


class Later:
    """A request in a thread, started after a delay."""

    def __init__(self, fn, delay: float) -> None:
        self.result = None
        self.error: BaseException | None = None

        def run() -> None:
            time.sleep(delay)
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(CLIENT_TIMEOUT + 5)
        assert not self.thread.is_alive(), "request never finished"
        assert self.error is None, f"request failed: {self.error!r}"
        return self.result


def alone(solo):
    return [complete(solo, p, n, s) for p, n, s in REQUESTS]


def test_staggered_requests_get_their_tokens_alone(servers):
    solo, batched = servers
    want = alone(solo)
    before = scrape_metrics(batched)
    # Arrivals while others run: each joins the batch between two steps (more than 3 queue).
    reqs = [Later(lambda r=r: complete(batched, *r), delay=0.04 * i) for i, r in enumerate(REQUESTS)]
    got = [r.join() for r in reqs]
    for (p, _, _), w, g in zip(REQUESTS, want, got):
        assert g == w, f"{p!r}: batched {g} against alone {w}"
    after = scrape_metrics(batched)
    steps = after["deltafin_batch_sequences_per_step_count"] - before["deltafin_batch_sequences_per_step_count"]
    seqs = after["deltafin_batch_sequences_per_step_sum"] - before["deltafin_batch_sequences_per_step_sum"]
    assert steps > 0 and seqs / steps > 1.0, "the requests shared steps"
    assert after["deltafin_batch_sequences_largest"] == 3, "at most --max-batch sequences per step"
    assert after["deltafin_max_batch"] == 3
    health = json.loads(http_request(batched, "GET", "/health").body)
    assert health["running_sequences"] == 0 and health["running"] is False


def test_a_client_that_leaves_takes_only_its_sequence_out(servers):
    solo, batched = servers
    want = alone(solo)[:2]
    cancelled_before = scrape_metrics(batched)["deltafin_cancelled_total"]
    client = make_openai(batched)
    stream = client.completions.create(
        model=SERVED_MODEL, prompt="A long story begins", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, timeout=CLIENT_TIMEOUT,
    )
    it = iter(stream)
    next(it)
    others = [Later(lambda r=r: complete(batched, *r), delay=0.0) for r in REQUESTS[:2]]
    for _ in range(5):
        next(it)
    stream.close()
    got = [o.join() for o in others]
    assert got == want
    deadline = time.monotonic() + 10
    while scrape_metrics(batched)["deltafin_cancelled_total"] < cancelled_before + 1:
        assert time.monotonic() < deadline, "the disconnect never cancelled its sequence"
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while json.loads(http_request(batched, "GET", "/health").body)["running_sequences"] != 0:
        assert time.monotonic() < deadline, "the cancelled sequence kept running"
        time.sleep(0.05)


def test_a_failing_request_fails_alone_and_the_others_finish(servers):
    solo, batched = servers
    want = alone(solo)[:2]
    failed_before = scrape_metrics(batched)["deltafin_failed_total"]
    others = [Later(lambda r=r: complete(batched, *r), delay=0.0) for r in REQUESTS[:2]]
    time.sleep(0.15)

    def faulty():
        return http_request(
            batched, "POST", "/v1/completions",
            {"model": SERVED_MODEL, "prompt": f"please {READ_FAULT_TRIGGER} now", "max_tokens": 4},
        )

    resp = faulty()
    assert resp.status >= 500, resp
    assert INJECTED_PATH not in resp.body.decode("utf-8", "replace")
    assert [o.join() for o in others] == want, "the sequences in the failed step finished as alone"
    # They were in the failed step with it, and were computed again.
    assert batched.stderr_text().count("recomputed after a failed step it did not cause") >= 2, batched.stderr_text()
    assert scrape_metrics(batched)["deltafin_failed_total"] == failed_before + 1
    # The server goes on: the next request is served as alone.
    assert complete(batched, *REQUESTS[2]) == alone(solo)[2]


SYSTEM = (
    "You are a careful assistant for a small library. Answer in one short sentence, and say when "
    "you do not know. The library opens at nine and closes at five; it lends books for three weeks."
)


@pytest.mark.parametrize("on_disk", [True, False], ids=["state-dir", "memory"])
@pytest.mark.parametrize("batch", ["1", "3"])
def test_requests_with_one_system_prompt_start_from_one_stored_state(
    servers, deltafin_bin: Path, tmp_path: Path, batch, on_disk
):
    solo, _ = servers
    store = solo.args[solo.args.index("--model") + 1]
    launcher = ServerLauncher(deltafin_bin, Path(store), tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    try:
        # Kept on disk with --state-dir; without it, in the prefix cache's memory slot for it.
        disk = ["--state-dir", str(tmp_path / "states")] if on_disk else []
        server = launcher.start("--max-batch", batch, *disk)
        client = make_openai(server)

        def ask(question: str):
            r = client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                max_tokens=12, temperature=0, timeout=CLIENT_TIMEOUT,
            )
            return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

        first = ask("When does the library open?")
        assert first[2] == 0, "nothing stored yet"
        # Another question after the same system prompt resumes from the state after it.
        second = ask("How long can I keep a book?")
        assert 0 < second[2] < second[1], second
        third = ask("Do you lend films?")
        assert third[2] == second[2], "the same shared start"
        # As the one-at-a-time server answers (bit-identical, whatever it resumed from).
        for q, got in [("How long can I keep a book?", second), ("Do you lend films?", third)]:
            r = make_openai(solo).chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                max_tokens=12, temperature=0, timeout=CLIENT_TIMEOUT,
            )
            assert r.choices[0].message.content == got[0]
    finally:
        launcher.stop_all()
