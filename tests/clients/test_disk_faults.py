"""A corrupt expert record on disk costs one request, never the server.

The server runs on a private packed store; between requests a layer file is corrupted on disk
(so the engine's retry reads the same bad bytes) and later restored. The request that meets the
corruption fails with an OpenAI-style error naming the layer and expert and no server path; the
server keeps answering, and the request after the restore gives the same text as before.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import openai
import pytest

from conftest import CLIENT_TIMEOUT, HF_DIR, REPO_ROOT, SERVED_MODEL, ServerLauncher, http_request, make_openai

PROMPT = "The lighthouse keeper counted the boats"


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
    # A budget that leaves about half the experts a cache slot (9 of 16 per layer here):
    # a cache of every expert would serve the next request from memory and hide the corruption.
    launcher = ServerLauncher(deltafin_bin, store, tmp_path)
    server = launcher.start("--memory-budget", "98M")
    yield server, store
    launcher.stop_all()


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
