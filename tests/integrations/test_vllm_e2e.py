"""One real end-to-end run: `tsukimi up --engine vllm` with one vLLM instance (tiny model),
a completion through the router, the instance's KV events in the router's index, the repeat
of the prompt placed on it and served from its cache, and every process gone after SIGTERM.

The same cluster first serves `tsukimi bench vllm --quick`'s workload (its report's shape);
the PD cluster of test_pd_through_the_pool starts beside it (two CPUs start three vLLM
processes faster than two, then two more).

Skipped when .venv-vllm is missing. The model is `.models/tiny` (make vllm) or, when that is
absent, a tiny random Llama built for the test (tests/integrations/tiny_vllm_model.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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


Up = tuple[str, dict[str, object], Callable[[], None]]  # the API's URL, the state file, stop()
PD_ARGS = ("--mode", "pd", "--connector", "tsukimi")


class _Starting:
    """`tsukimi up --engine vllm --model MODEL_DIR EXTRA...`, started in a process of its own at
    once; `ready()` waits for its state file. `close()` stops it (SIGTERM, then SIGKILL)."""

    def __init__(self, model_dir: Path, workdir: Path, extra: tuple[str, ...]) -> None:
        self.workdir, self.state = workdir, workdir / "state.json"
        cmd = [sys.executable, "-m", "tsukimi.cli", "up", "--engine", "vllm", "--model", str(model_dir), *extra]
        cmd += ["--port", str(free_port()), "--state-file", str(self.state), "--log-dir", str(workdir / "logs")]
        # NOTE: vLLM leaves `vllm_dist_*` rendezvous files in $TMPDIR: a folder of its own, removed
        self.temp = tempfile.mkdtemp(prefix="tsukimi-up-vllm-")
        with (workdir / "up.log").open("wb") as log:
            env = {**os.environ, "TMPDIR": self.temp}
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.started = time.monotonic()

    def ready(self) -> Up:
        """The API's URL, the state file's content and stop(), once up (AssertionError with the
        log's tail when it exits or is not up 400 s after its start)."""
        while not self.state.exists():
            assert self.proc.poll() is None, (self.workdir / "up.log").read_text()[-3000:]
            assert time.monotonic() < self.started + 400, "tsukimi up did not come up in 400 s"
            time.sleep(0.5)
        info = json.loads(self.state.read_text())
        return str(info["api"]), info, self.close

    def close(self) -> None:
        _stop(self.proc)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def pd_starting(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Starting]:
    """The PD cluster (`PD_ARGS`), starting beside the colocated one (three vLLM starts on two
    CPUs take less than two after one another); its test asks `ready()`."""
    starting = _Starting(model_dir, tmp_path_factory.mktemp("pd"), PD_ARGS)
    try:
        yield starting
    finally:
        starting.close()


@pytest.fixture(scope="module")
def colocated(model_dir: Path, pd_starting: _Starting, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """One colocated instance, shared by this module's tests: started once (a minute on two
    CPUs), just after the PD cluster began to start; test_completion_events_and_cache_hit,
    which stops it, runs last of them."""
    starting = _Starting(model_dir, tmp_path_factory.mktemp("colocated"), ("--instances", "1"))
    try:
        yield starting.ready()
    finally:
        starting.close()


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


def test_bench_vllm_reports_on_a_running_cluster(colocated: Up, model_dir: Path) -> None:
    """`tsukimi bench vllm --quick`'s report (2 conversations of 2 turns) measured on this
    module's cluster instead of clusters of its own (`run_bench` launches one per system; the
    CLI's flags are checked in tests/bench/test_reports.py): the row and the verdicts' shape.
    The row is `tsukimi_routing` (Conductor placement, local prefix caching, no pool), what
    `tsukimi up --engine vllm` runs; its prompts share no block with the test below."""
    from tests.bench.report_checks import check_report, verdict_names
    from tsukimi.bench import vllm as bench
    from tsukimi.bench.report import begin, finish

    api, info, _ = colocated
    processes = info["processes"]
    assert isinstance(processes, list)
    urls = [str(p["url"]) for p in processes if str(p["name"]).startswith("vllm-")]
    cfg = bench.VllmBenchConfig(model=str(model_dir), systems=("tsukimi_routing",), conversations=2, turns=2)
    start = begin("bench vllm", cfg)
    row, _ = bench.measure_system(cfg, "tsukimi_routing", api, urls, None)
    figures = {"runs": [row], "ratios": bench.ratios([row])}
    report = check_report(finish(start, figures, bench.verdicts(figures)), "bench vllm")
    runs = report.figures["runs"]
    assert isinstance(runs, list) and [r["system"] for r in runs] == ["tsukimi_routing"]
    assert "error" not in runs[0] and runs[0]["requests"] == 4, runs[0]
    assert verdict_names(report) >= {"tsukimi_vs_vllm_rr", "tokens_equal"}
    assert "| tsukimi_routing |" in bench.markdown(report.figures)


def test_completion_events_and_cache_hit(colocated: Up, model_dir: Path) -> None:
    """Runs last of the tests on `colocated`: it stops the cluster."""
    api, info, stop = colocated
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


def test_pd_through_the_pool(pd_starting: _Starting, model_dir: Path) -> None:
    """The router's two steps on real vLLM + TsukimiConnector: the prefill instance makes the
    first token, the decode instance continues from it, loading the prompt's full blocks from
    the pool instead of computing them."""
    api, info, _ = pd_starting.ready()
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
