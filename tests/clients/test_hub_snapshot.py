"""A store from `deltafin install` is a Hugging Face cache the official client reads as its own.

`deltafin install --mode full` from the test origin (`deltafin-test-origin`, a loopback
imitation of the Hub, built by `cargo test --workspace` beside the deltafin binary) must leave
`STORE/hub` a valid Hub cache: huggingface_hub, offline, finds the snapshot and every file in it
byte for byte, and `scan_cache_dir` reports one clean revision of the right size. A stream
install's cache must not present its partial shards as cached files.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

# huggingface_hub reads these when it is imported: never the network, never the user's cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from huggingface_hub import hf_hub_download, scan_cache_dir, snapshot_download, try_to_load_from_cache  # noqa: E402
from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_DIR = REPO_ROOT / "fixtures" / "k3-small" / "hf"
REPO = "org/k3-small"
REPO_FOLDER = "models--org--k3-small"
STARTUP_TIMEOUT = 30.0  # seconds until the origin prints its endpoint
INSTALL_TIMEOUT = 300.0  # seconds for one install


def fixture_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(HF_DIR.iterdir()) if p.is_file()}


def is_shard(name: str) -> bool:
    return name.endswith(".safetensors")


def child_env(tmp: Path) -> dict[str, str]:
    """The environment of a deltafin child: no token, no endpoint, an empty Hub cache and
    HOME, short HTTP back-offs, loopback never through a proxy."""
    proxies = ("http_proxy", "https_proxy", "all_proxy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k.lower() not in proxies}
    (tmp / "home").mkdir(exist_ok=True)
    (tmp / "hf-cache").mkdir(exist_ok=True)
    env.update(
        HOME=str(tmp / "home"),
        HF_HUB_CACHE=str(tmp / "hf-cache"),
        NO_PROXY="127.0.0.1,localhost",
        DELTAFIN_HTTP_BACKOFF_MS="10",
        DELTAFIN_HTTP_ATTEMPTS="3",
    )
    return env


@pytest.fixture(scope="module")
def origin(deltafin_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The test origin serving the k3-small fixture as org/k3-small; yields its endpoint."""
    binary = deltafin_bin.parent / "deltafin-test-origin"
    if not binary.exists():
        pytest.skip(
            f"{binary} is absent: `cargo test --workspace` (or `cargo build -p deltafin-test-origin`) "
            "builds it beside DELTAFIN_BIN"
        )
    tmp = tmp_path_factory.mktemp("origin")
    proc = subprocess.Popen(
        [str(binary), "--repo", f"{REPO}={HF_DIR}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(tmp),
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""), daemon=True).start()
    try:
        try:
            line = lines.get(timeout=STARTUP_TIMEOUT)
        except queue.Empty:
            line = ""
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "endpoint" not in fields:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"deltafin-test-origin printed {line!r}, not its endpoint; stderr: {err}", pytrace=False)
        yield fields["endpoint"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def install(deltafin_bin: Path, endpoint: str, tmp: Path, mode: str) -> tuple[Path, dict]:
    """`deltafin install org/k3-small --mode MODE`; returns the store and the JSON report."""
    store = tmp / "store"
    r = subprocess.run(
        [str(deltafin_bin), "install", REPO, "--to", str(store), "--mode", mode, "--endpoint", endpoint,
         "--no-hub-cache", "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=child_env(tmp),
        timeout=INSTALL_TIMEOUT,
    )
    assert r.returncode == 0, f"install --mode {mode} failed:\n{r.stderr}"
    assert "panicked" not in r.stderr, r.stderr
    return store, json.loads(r.stdout)


@pytest.fixture(scope="module")
def full_store(deltafin_bin: Path, origin: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return install(deltafin_bin, origin, tmp_path_factory.mktemp("full"), "full")


@pytest.fixture(scope="module")
def stream_store(deltafin_bin: Path, origin: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return install(deltafin_bin, origin, tmp_path_factory.mktemp("stream"), "stream")


def test_full_install_is_a_snapshot_huggingface_hub_reads_offline(full_store: tuple[Path, dict]) -> None:
    store, report = full_store
    hub = store / "hub"
    snap = Path(snapshot_download(REPO, cache_dir=hub, local_files_only=True))
    assert snap == hub / REPO_FOLDER / "snapshots" / report["commit"]
    assert (hub / REPO_FOLDER / "refs" / "main").read_text().strip() == report["commit"]

    want = fixture_files()
    assert sorted(p.name for p in snap.iterdir()) == sorted(want)
    for name, data in want.items():
        assert (snap / name).read_bytes() == data, f"{name} differs from the fixture's"

    config = Path(hf_hub_download(REPO, "config.json", cache_dir=hub, local_files_only=True))
    assert config == snap / "config.json"
    assert config.read_bytes() == want["config.json"]
    shard = "model-00002-of-000013.safetensors"
    path = Path(hf_hub_download(REPO, shard, cache_dir=hub, local_files_only=True))
    assert path.read_bytes() == want[shard]


def test_scan_cache_dir_reports_one_clean_revision(full_store: tuple[Path, dict]) -> None:
    store, report = full_store
    info = scan_cache_dir(store / "hub")
    assert list(info.warnings) == []
    assert len(info.repos) == 1
    repo = next(iter(info.repos))
    assert repo.repo_id == REPO and repo.repo_type == "model"
    assert len(repo.revisions) == 1
    rev = next(iter(repo.revisions))
    assert rev.commit_hash == report["commit"]
    assert set(rev.refs) == {"main"}
    want = fixture_files()
    assert sorted(f.file_name for f in rev.files) == sorted(want)
    total = sum(len(d) for d in want.values())
    assert repo.size_on_disk == total
    assert rev.size_on_disk == total


def test_stream_install_does_not_present_partial_shards(stream_store: tuple[Path, dict]) -> None:
    store, report = stream_store
    hub = store / "hub"
    want = fixture_files()
    shard = "model-00002-of-000013.safetensors"
    # The shard is on disk only in part (a `.deltafin-partial` blob): not a cached file.
    assert try_to_load_from_cache(REPO, shard, cache_dir=hub) is None
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download(REPO, shard, cache_dir=hub, local_files_only=True)
    # The small files are finished and verified: cached.
    config = try_to_load_from_cache(REPO, "config.json", cache_dir=hub)
    assert isinstance(config, str), config
    assert Path(config).read_bytes() == want["config.json"]
    assert Path(config).parent.name == report["commit"]

    info = scan_cache_dir(hub)
    assert list(info.warnings) == []
    (repo,) = info.repos
    (rev,) = repo.revisions
    small = sorted(n for n in want if not is_shard(n))
    assert sorted(f.file_name for f in rev.files) == small
    assert repo.size_on_disk == sum(len(want[n]) for n in small)
