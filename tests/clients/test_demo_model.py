"""The bundled demo model (models/k3-demo, trained) through the server: the official openai client's
completion of the fixed prompt is the greedy continuation its training framework recorded
(models/k3-demo/continuation.json: PyTorch, float32), token for token, with a bf16 spine, whole and
streamed. (The model was trained on plain documents, never on K3's chat format.)"""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import CLIENT_TIMEOUT, REPO_ROOT, SERVED_MODEL, ServerLauncher, make_openai

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

