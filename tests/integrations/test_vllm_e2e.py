"""One real end-to-end run: `tsukimi up --engine vllm` with one vLLM instance (tiny model),
a completion through the router, the instance's KV events in the router's index, the repeat
of the prompt placed on it and served from its cache, and every process gone after SIGTERM.

Skipped when .venv-vllm is missing. The model is `.models/tiny` (make vllm) or, when that is
absent, a tiny random Llama built for the test (tests/integrations/tiny_vllm_model.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm_env import ROOT, vllm_python
from tsukimi.netio import free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = vllm_python()
    if python is None:
        pytest.skip(".venv-vllm is missing: run make vllm")
    made = ROOT / ".models" / "tiny"
    if (made / "config.json").is_file():
        return made
    from tsukimi.engine.weights import default_gguf_path

    out = tmp_path_factory.mktemp("model") / "tiny"
    build = [str(python), str(Path(__file__).with_name("tiny_vllm_model.py")), str(out), str(default_gguf_path())]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture
def cluster(
    model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, dict[str, object], Callable[[], None]]]:
    """`tsukimi up --engine vllm` with the flags the test's `up_args` marker gives (default: one
    colocated instance)."""
    marker = request.node.get_closest_marker("up_args")
    extra = list(marker.args) if marker else ["--instances", "1"]
    state, port = tmp_path / "state.json", free_port()
    cmd = [
        sys.executable,
        "-m",
        "tsukimi.cli",
        "up",
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        *extra,
        "--port",
        str(port),
        "--state-file",
        str(state),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with (tmp_path / "up.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not state.exists():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "tsukimi up did not come up in 400 s"
            time.sleep(0.5)
        info = json.loads(state.read_text())
        yield str(info["api"]), info, lambda: _stop(proc)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # NOTE: each child runs in a session (process group) of its own
    except ProcessLookupError:
        return False
    return True


def test_completion_events_and_cache_hit(
    cluster: tuple[str, dict[str, object], Callable[[], None]], model_dir: Path
) -> None:
    api, info, stop = cluster
    prompt = list(range(100, 100 + 3 * 128 + 5))  # three full 128-token blocks
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{api}/v1/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    while httpx.get(f"{api}/stats").json()["index_blocks"].get("vllm-0/hbm", 0) < 3:
        assert time.monotonic() < deadline, httpx.get(f"{api}/stats").text
        time.sleep(0.1)
    second = httpx.post(f"{api}/v1/completions", json=body, timeout=120, headers={"X-Request-Id": "again"})
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * 128
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    [record] = httpx.get(f"{api}/decisions", params={"request_id": "again"}).json()["decisions"]
    assert (record["prefill"], record["cached_tokens"], record["accepted"]) == ("vllm-0", 3 * 128, True)
    stats = httpx.get(f"{api}/stats").json()
    assert stats["backend"] == "vllm" and stats["kv_events"]["vllm-0"]["gaps"] == 0
    streamed = httpx.post(f"{api}/v1/completions", json={**body, "stream": True}, timeout=120)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    processes = info["processes"]
    assert isinstance(processes, list) and {p["name"] for p in processes} == {"vllm-0", "router"}
    stop()
    # NOTE: killed grandchildren (vLLM's engine core) linger until init reaps them: a moment
    deadline = time.monotonic() + 10
    while any(_group_alive(p["pid"]) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p["name"] for p in processes if _group_alive(p["pid"])] == []


@pytest.mark.up_args("--mode", "pd", "--connector", "tsukimi")
def test_pd_through_the_pool(cluster: tuple[str, dict[str, object], Callable[[], None]], model_dir: Path) -> None:
    """The router's two steps on real vLLM + TsukimiConnector: the prefill instance makes the
    first token, the decode instance continues from it, loading the prompt's full blocks from
    the pool instead of computing them."""
    api, info, _ = cluster
    prompt = list(range(100, 100 + 5 * 128))
    body = {
        "model": str(model_dir),
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{api}/v1/completions", json=body, timeout=120)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    usage = events[-1]["usage"]
    assert len(tokens) == 6 and usage["completion_tokens"] == 6
    asked = {"request_id": response.headers["x-request-id"]}
    [record] = httpx.get(f"{api}/decisions", params=asked).json()["decisions"]
    assert (record["mode"], record["prefill"], record["decode"]) == ("pd", "vllm-0", "vllm-1")
    # NOTE: the decode instance's prompt is the 640 tokens and the first one: all 5 blocks load
    assert record["pool_tokens"] >= 4 * 128, record
    stats = httpx.get(f"{api}/stats").json()
    assert stats["mode"] == "pd" and stats["conductor"]["accepted"] == 1
    assert stats["index_blocks"]["vllm-0/hbm"] == 5 and stats["index_blocks"]["pool/dram"] >= 5
    assert {p["name"] for p in info["processes"]} == {"master", "vllm-0", "vllm-1", "router"}  # type: ignore[union-attr]


def test_missing_model_names_make_vllm(tmp_path: Path) -> None:
    from tsukimi.errors import ConfigError
    from tsukimi.integrations.vllm.launch import VllmClusterConfig

    venv = tmp_path / "venv"
    with pytest.raises(ConfigError, match="make vllm"):
        VllmClusterConfig(venv=str(venv)).model_path()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    with pytest.raises(ConfigError, match=r"model folder .*nothing.* is missing.*make vllm"):
        VllmClusterConfig(model="nothing", venv=str(venv), models_dir=str(tmp_path)).model_path()
