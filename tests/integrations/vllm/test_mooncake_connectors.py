"""vLLM's own Mooncake connectors, unchanged, on tsukimi (issue 14 item 4): vLLM runs under
`tsukimi compat exec`, so `import mooncake.store` / `mooncake.engine` in vLLM's code give
tsukimi's facade, over a `tsukimi compat mooncake-master`; the hook resolves `mooncake.*` to
tsukimi even where the real wheel is installed too (checked first).

- MooncakeStoreConnector (kv_both, one in-process `vllm.LLM`): prompts A, B (A's 640-token
  prefix, another tail), A again; B and the second A load the prefix from the pool
  (num_cached_tokens [0, 640, 640]); greedy tokens equal vLLM's without a connector.
- MooncakeConnector (PD): a prefill API server (kv_producer) and a decode API server
  (kv_consumer); a tiny proxy in this file speaks vLLM's protocol (transfer_id, the
  prefill's bootstrap server for its engine id); the prefill writes the KV blocks into the
  decode's cache with tsukimi's Transfer Engine; greedy tokens equal, the decode computes
  none of the prompt (cached_tokens is the prompt's length). On CPU torch, vLLM's connector
  needs a one-line torch patch (CPU_ACCELERATOR_SHIM, below) that has nothing to do with Mooncake.

The reference tokens come from the package's plain vLLM server (conftest.py `plain_server`,
CPU 1), which starts while the store connector's in-process vLLM (CPU 0) runs. Skipped, saying
why, without `.venv-vllm` and `make vllm`'s .models/tiny (token-id prompts: no tokenizer needed).
Every process here gets a temporary folder of its own as TMPDIR and VLLM_RPC_BASE_PATH (vLLM's
ipc sockets, its `vllm_dist_*` rendezvous files, `tsukimi compat exec`'s shim), removed at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integrations.vllm.conftest import needs_vllm
from tsukimi.errors import PeerError
from tsukimi.netio import free_port
from tsukimi.testing.processes import wait_until
from tsukimi.testing.vllm_server import VllmServer, VllmServerConfig

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TSUKIMI = ROOT / ".venv" / "bin" / "tsukimi"
DRIVER = Path(__file__).with_name("mooncake_driver.py")
BLOCK_SIZE = 128
PREFIX_TOKENS = 640
MAX_TOKENS = 16
START_S = 420.0  # vLLM starts in 40-90 s alone; far slower beside other vLLM processes


def _missing() -> str:
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is missing (make vllm)"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, timeout=120)
    return "" if probe.returncode == 0 else f"vLLM does not import in .venv-vllm: {probe.stderr[-300:]!r}"


SKIP = _missing()
pytestmark = [needs_vllm, pytest.mark.skipif(bool(SKIP), reason=SKIP or "vLLM is here"), pytest.mark.timeout(1200)]


def _prompts() -> tuple[list[int], list[int]]:
    """A and B: a shared 640-token prefix (5 blocks), then 40 tokens of their own."""
    rng = random.Random(1)
    prefix = [rng.randrange(100, 30000) for _ in range(PREFIX_TOKENS)]
    return tuple(prefix + [rng.randrange(100, 30000) for _ in range(40)] for _ in range(2))  # type: ignore[return-value]


A, B = _prompts()


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        **extra,
    }


class _Group:
    """Processes started in sessions of their own, all SIGKILLed at the end, their temporary
    folders removed."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs, self.temps = logs, list[subprocess.Popen[bytes]](), list[str]()

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        # NOTE: SIGKILLed, vLLM and `tsukimi compat exec` leave what they made in $TMPDIR and
        # $VLLM_RPC_BASE_PATH (default /tmp): a short folder of their own (ipc paths are limited)
        temp = tempfile.mkdtemp(prefix=f"tsukimi-vllm-{name}-")
        self.temps.append(temp)
        log = (self.logs / f"{name}.log").open("wb")
        env = {**env, "TMPDIR": temp, "VLLM_RPC_BASE_PATH": temp}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        proc = self.start(name, cmd, env)
        if proc.wait(timeout=START_S + 300) != 0:
            raise AssertionError(f"{name} exited {proc.returncode}: {self.tail(name)}")

    def tail(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Group]:
    procs = _Group(tmp_path_factory.mktemp("logs"))
    yield procs
    procs.kill()


@pytest.fixture(scope="module")
def model() -> Path:
    """The plain server's model (`make vllm`'s tiny)."""
    return VllmServerConfig().model


@pytest.fixture(scope="module")
def master(group: _Group) -> dict[str, str]:
    """A tsukimi master with Mooncake's flags, its HTTP metadata server and admin HTTP port."""
    rpc, meta, http = free_port(), free_port(), free_port()
    flags = [
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={http}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={meta}",
        "--http_metadata_server_host=127.0.0.1",
    ]
    group.start("master", [str(TSUKIMI), "compat", "mooncake-master", *flags], dict(os.environ))
    wait_until(lambda: httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200, 30)
    return {
        "rpc": f"127.0.0.1:{rpc}",
        "metadata": f"http://127.0.0.1:{meta}/metadata",
        "http": f"http://127.0.0.1:{http}",
    }


def _drive(group: _Group, name: str, args: dict[str, object], env: dict[str, str]) -> dict[str, Any]:
    out = group.logs / f"{name}.json"
    cmd = [str(TSUKIMI), "compat", "exec", "--", str(VLLM_PYTHON), str(DRIVER), json.dumps({**args, "out": str(out)})]
    group.run(name, cmd, env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _baseline(plain_server: Future[VllmServer]) -> list[list[int]]:
    """vLLM's greedy tokens for A and B without a connector."""
    server = plain_server.result()
    return [server.complete(prompt, MAX_TOKENS).token_ids for prompt in (A, B)]


def test_under_the_hook_mooncake_is_tsukimi_even_beside_the_real_wheel(plain_server: Future[VllmServer]) -> None:
    """`tsukimi compat exec` wins over a real wheel in .venv-vllm (`tsukimi bench vllm`'s (c)
    installs one there), so these tests run tsukimi's Mooncake either way. (It asks for the
    plain server only to start it early.)"""
    probe = (
        "import mooncake.engine, mooncake.store; "
        "print(mooncake.engine.TransferEngine.__module__, mooncake.store.MooncakeDistributedStore.__module__)"
    )
    out = subprocess.run(
        [str(TSUKIMI), "compat", "exec", "--", str(VLLM_PYTHON), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split() == ["tsukimi.compat.mooncake.engine", "tsukimi.compat.mooncake.store"], out.stderr[-2000:]


def test_mooncake_store_connector_loads_the_prefix_from_tsukimis_pool(
    group: _Group, model: Path, master: dict[str, str], plain_server: Future[VllmServer]
) -> None:
    config = group.logs / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "metadata_server": master["metadata"],
                "master_server_address": master["rpc"],
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "256MB",
                "local_buffer_size": "64MB",
            }
        )
    )
    num_blocks = PREFIX_TOKENS // BLOCK_SIZE  # A's full blocks; its 40-token tail is never saved
    args = {
        "model": str(model),
        "connector": True,
        "prompts": [A, B, A],
        "max_tokens": MAX_TOKENS,
        "master_http": master["http"],
        "min_keys": num_blocks,
    }
    result = _drive(group, "store", args, _env(MOONCAKE_CONFIG_PATH=str(config)))
    runs, baseline = result["runs"], _baseline(plain_server)
    assert result["store_module"] == "tsukimi.compat.mooncake.store"
    assert [r["num_cached_tokens"] for r in runs] == [0, PREFIX_TOKENS, PREFIX_TOKENS]
    assert [r["keys"] for r in runs] == [num_blocks] * 3  # B's prefix blocks exist already: not put again
    assert [r["tokens"] for r in runs] == [baseline[0], baseline[1], baseline[0]]


# NOTE: vLLM 0.32's MooncakeConnector worker asks torch.accelerator.current_device_index(),
# which raises on a CPU-only torch before any Mooncake call (so it fails the same with the real
# wheel). The PD servers get this sitecustomize (on PYTHONPATH): the connector stays unchanged.
CPU_ACCELERATOR_SHIM = """import torch
if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
"""


def _server(group: _Group, name: str, model: Path, role: str, bootstrap_port: int, cpu: str) -> str:
    """Start an API server; its URL once it answers /health (AssertionError with its log
    when it exits first or takes longer than START_S)."""
    port = free_port()
    shim = group.logs / "cpu-shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(CPU_ACCELERATOR_SHIM)
    kv = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    cmd = [
        str(TSUKIMI),
        "compat",
        "exec",
        "--",
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    # NOTE: the prefill's worker serves the bootstrap registry on this port (the decode asks it
    # where the prefill's workers are); setting bootstrap_server_address instead expects one
    # run by the proxy.
    path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
    # NOTE: a core each: a prefill waiting for the decode to pull steps (and its worker spins)
    # without pause; on the decode's core it starves the decode, which never asks for the KV
    env = _env(PYTHONPATH=path, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bootstrap_port), VLLM_CPU_OMP_THREADS_BIND=cpu)
    proc = group.start(name, cmd, env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited {proc.returncode}: {group.tail(name)}")
        return httpx.get(url + "/health", timeout=2).status_code == 200

    try:
        wait_until(healthy, START_S, 1.0)
    except PeerError as exc:
        raise AssertionError(f"{name} did not start in {START_S} s: {group.tail(name)}") from exc
    return url


def _complete(url: str, model: Path, prompt: list[int], max_tokens: int, params: dict[str, object]) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def test_mooncake_connector_pd_hands_kv_over_with_tsukimis_transfer_engine(
    group: _Group, model: Path, plain_server: Future[VllmServer]
) -> None:
    baseline = _baseline(plain_server)
    bootstrap_port = free_port()
    bootstrap = f"127.0.0.1:{bootstrap_port}"
    with ThreadPoolExecutor(2) as pool:  # NOTE: the two start side by side
        starting = [
            pool.submit(_server, group, "prefill", model, "kv_producer", bootstrap_port, "0"),
            pool.submit(_server, group, "decode", model, "kv_consumer", bootstrap_port, "1"),
        ]
        prefill, decode = (future.result() for future in starting)
    engines = httpx.get(f"http://{bootstrap}/query", timeout=10).json()
    engine_id = next(iter(engines.values()))["engine_id"]
    for prompt, expected in ((A, baseline[0]), (B, baseline[1])):
        transfer_id = uuid.uuid4().hex
        _complete(
            prefill,
            model,
            prompt,
            1,
            {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
        )
        got = _complete(
            decode,
            model,
            prompt,
            MAX_TOKENS,
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": transfer_id,
                "remote_engine_id": engine_id,
                "remote_bootstrap_addr": f"http://{bootstrap}",
            },
        )
        choice = got["choices"][0]
        assert choice["token_ids"] == expected, group.tail("decode")
        # the decode computed none of the prompt: every token's KV came from the prefill
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt), got["usage"]
