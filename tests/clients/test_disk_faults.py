"""A corrupt expert record on disk costs one request, never the server.

The server runs on a private packed store; between requests a layer file is corrupted on disk
(so the engine's retry reads the same bad bytes) and later restored. The request that meets the
corruption fails with an OpenAI-style error naming the layer and expert and no server path; the
server keeps answering, and the request after the restore gives the same text as before.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import openai
import pytest

from conftest import CLIENT_TIMEOUT, HF_DIR, REPO_ROOT, SERVED_MODEL, ServerLauncher, http_request, make_openai

PROMPT = "The lighthouse keeper counted the boats"
# The expert cache line of the plan a server prints at start.
SLOTS_RE = re.compile(r"expert cache .*\((\d+) slots per layer x \d+ MoE layers, of (\d+) experts\)")


@pytest.fixture
def packed_server(deltafin_bin: Path, tmp_path: Path):
    store = tmp_path / "packed"
    subprocess.run(
        # The budget below is sized against the int8 spine's bytes.
        [str(deltafin_bin), "convert", "--from", str(HF_DIR), "--to", str(store), "--experts", "pack", "--spine", "int8"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    # A budget that leaves about half the experts a cache slot: a cache of every expert would
    # serve the next request from memory and hide the corruption. The plan's fixed overhead and
    # state sizes move with the engine, so the budget is not written down but found from the
    # server's own plan: the smallest that gives each layer at least half its experts.
    lo, hi = 16 << 10, 1 << 20  # KiB: too small to start, and room for every expert
    assert planned_slots(deltafin_bin, store, lo) is None
    top = planned_slots(deltafin_bin, store, hi)
    assert top is not None and top[0] == top[1], top
    while hi - lo > 8:
        mid = (lo + hi) // 2
        got = planned_slots(deltafin_bin, store, mid)
        if got is not None and 2 * got[0] >= got[1]:
            hi = mid
        else:
            lo = mid
    slots, experts = planned_slots(deltafin_bin, store, hi)
    assert slots < experts, f"at {hi} KiB every expert has a slot: nothing would be read"
    launcher = ServerLauncher(deltafin_bin, store, tmp_path)
    server = launcher.start("--memory-budget", f"{hi}K")
    yield server, store
    launcher.stop_all()


def planned_slots(binary: Path, store: Path, kib: int) -> tuple[int, int] | None:
    """(cache slots per layer, experts per layer) of the plan `serve` prints at start with a budget
    of `kib` KiB, or None where it refuses the budget."""
    proc = subprocess.Popen(
        [str(binary), "serve", "--model", str(store), "--port", "0", "--memory-budget", f"{kib}K"],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = SLOTS_RE.search(line)
            if m:
                return int(m.group(1)), int(m.group(2))
        return None
    finally:
        proc.kill()
        proc.wait(timeout=10)


def complete(client) -> str:
    r = client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    return r.choices[0].text


def test_a_corrupt_record_fails_one_request_and_the_next_is_served(packed_server):
    server, store = packed_server
    client = make_openai(server, timeout=CLIENT_TIMEOUT, max_retries=0)
    before = complete(client)
    layer_files = sorted((store / "experts").glob("layer-*.bin"))
    assert layer_files
    originals = {f: f.read_bytes() for f in layer_files}
    try:
        for f, data in originals.items():
            bad = bytearray(data)
            bad[::61] = bytes(b ^ 0x5A for b in bad[::61])
            f.write_bytes(bytes(bad))
        with pytest.raises(openai.APIStatusError) as err:
            complete(client)
        message = err.value.message
        assert "layer" in message and "expert" in message and "checksum" in message, message
        assert str(store) not in message and "layer-" not in message, f"a server path leaked: {message}"
        assert 500 <= err.value.status_code < 600, err.value.status_code
        health = http_request(server, "GET", "/health")
        assert health.status in (200, 503), health.status
    finally:
        for f, data in originals.items():
            f.write_bytes(data)
    assert complete(client) == before
    assert server.alive()
