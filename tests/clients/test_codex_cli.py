"""A real coding agent against `deltafin serve`: OpenAI's Codex CLI (npm `@openai/codex`, pinned
in scripts/ensure-agent-clis.sh) speaks the Responses API to a provider with `wire_api =
"responses"`, runs the shell command the (scripted) model asks for, sends its output back as a
`function_call_output`, and prints the model's final answer.

Codex's own instructions and tool definitions make a prompt of about 30,000 tokens in the tiny
fixture's 320-token vocabulary, so the server runs a copy of k3-tiny whose config allows
131,072 positions (random weights either way: the replies are scripted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import HF_DIR, REPO_ROOT, ServerLauncher, k3_reasoning, k3_response, K3_END_OF_MESSAGE

CODEX = os.environ.get("DELTAFIN_CODEX", str(REPO_ROOT / "target/agent-clis/node_modules/.bin/codex"))
MARKER = "DELTAFIN_TOOL_OK"
TASK = "Please write the marker file"
ANSWER = "Done: the file is written."
COMMAND = f"echo deltafin-tool-ran > codex-was-here.txt && echo {MARKER}"


def exec_command_call(cmd: str) -> str:
    """Codex's shell tool (`exec_command`, one `cmd` string), its whole arguments as JSON."""
    args = json.dumps({"cmd": cmd})
    return (
        '<|open|>tools<|sep|><|open|>call tool="exec_command" index="1"<|sep|>'
        f'<|open|>json type="object"<|sep|>{args}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    )


@pytest.fixture(scope="module")
def long_store(deltafin_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("long")
    hf = root / "hf"
    shutil.copytree(HF_DIR, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 131072
    (hf / "config.json").write_text(json.dumps(cfg))
    out = root / "store"
    subprocess.run([str(deltafin_bin), "convert", "--from", str(hf), "--to", str(out)], check=True,
                   capture_output=True, cwd=REPO_ROOT, timeout=120)
    return out


def test_codex_cli_completes_a_tool_call_round_trip(deltafin_bin, long_store, tmp_path):
    assert Path(CODEX).exists(), f"Codex CLI not found at {CODEX}: run scripts/ensure-agent-clis.sh"
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"replies": [
        # After the command ran, its output (a function_call_output) holds the marker.
        {"when": MARKER, "text": k3_reasoning("The command ran.") + k3_response(ANSWER) + K3_END_OF_MESSAGE},
        {"when": TASK, "text": k3_reasoning("I will run a shell command.") + exec_command_call(COMMAND)
         + K3_END_OF_MESSAGE},
    ]}))
    launcher = ServerLauncher(deltafin_bin, long_store, tmp_path)
    try:
        server = launcher.start("--context", "100000", "--script", str(script))
        home = tmp_path / "codex-home"
        home.mkdir()
        (home / "config.toml").write_text(
            'model = "k3-tiny"\nmodel_provider = "deltafin"\n'
            "[model_providers.deltafin]\n"
            f'name = "Deltafin"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\n'
        )
        work = tmp_path / "work"
        work.mkdir()
        env = dict(os.environ, CODEX_HOME=str(home), NO_COLOR="1")
        proc = subprocess.run(
            [CODEX, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK],
            cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
        )
        print(proc.stdout[-3000:])
        assert proc.returncode == 0, proc.stderr[-4000:]
        # Codex ran the command the model asked for, and printed the model's last answer.
        assert (work / "codex-was-here.txt").read_text().strip() == "deltafin-tool-ran"
        assert ANSWER in proc.stdout, proc.stdout[-3000:]
        # Two requests: the call, then the answer after the tool output; the second resumed from
        # the first one's prompt state.
        log = server.stderr_text()
        lines = [line for line in log.splitlines() if "POST /v1/responses 200" in line]
        assert len(lines) == 2, lines
        prompt, cached = map(int, re.search(r"prompt (\d+) tokens \((\d+) cached\)", lines[1]).groups())
        first_prompt = int(re.search(r"prompt (\d+) tokens", lines[0]).group(1))
        assert cached >= first_prompt and prompt > first_prompt, lines
    finally:
        launcher.stop_all()
