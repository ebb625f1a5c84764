"""Shared pieces of the SGLang tests: the skip, one `tsukimi compat mooncake-master` for the
whole session, and running a driver in the SGLang venv under `tsukimi compat exec`.

SGLang runs from `.venv-sglang` (`make sglang`; $TSUKIMI_SGLANG_VENV names another) in child
processes; without it every test here is skipped, saying so. Each child has this checkout first
on PYTHONPATH, so it imports this tsukimi (the venv's editable install points elsewhere), and
`tsukimi compat exec` makes `import mooncake.*` in SGLang's code tsukimi's facade.

NOTE: the drivers run one after another, never side by side: the master may place an object in
any mounted segment, and a driver's objects must not land in a process that exits first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tsukimi.integrations.sglang import paths
from tsukimi.netio import free_port
from tsukimi.testing.processes import stop_processes, wait_until

ROOT = Path(__file__).resolve().parents[3]
SGLANG_VENV = Path(os.environ.get(paths.VENV_ENV) or ROOT / paths.DEFAULT_VENV).absolute()
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
SITE_PACKAGES = next(SGLANG_VENV.glob("lib/python3*/site-packages"), SGLANG_VENV / "lib" / "site-packages")
TSUKIMI = Path(sys.executable).with_name("tsukimi")
SEGMENT_BYTES = 64 << 20  # per store (SGLang divides it by tp_size); only "gb" or plain bytes parse
DRIVER_TIMEOUT_S = 600.0

SKIP_REASON = "" if os.access(SGLANG_PYTHON, os.X_OK) else f"no SGLang venv at {SGLANG_VENV}: run `make sglang`"
needs_sglang = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "SGLang is here")


@dataclass(frozen=True, slots=True)
class Master:
    """Where the session's master listens: Mooncake's RPC address (host:port), its admin HTTP
    (/get_all_keys, /get_all_segments) and its HTTP metadata server."""

    rpc: str
    http_port: int
    metadata: str

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def env(self) -> dict[str, str]:
        """SGLang's Mooncake settings for this master (its `load_from_env`)."""
        return {
            "MOONCAKE_MASTER": self.rpc,
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(SEGMENT_BYTES),
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_MASTER_METRICS_PORT": str(self.http_port),
        }


@pytest.fixture(scope="session")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    """One `tsukimi compat mooncake-master` (Mooncake's flags, its HTTP metadata server, ephemeral
    ports) for every SGLang test."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    rpc, meta, http = free_port(), free_port(), free_port()
    flags = [
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        f"--metrics_port={http}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={meta}",
        "--http_metadata_server_host=127.0.0.1",
    ]
    log = (tmp_path_factory.mktemp("master") / "master.log").open("wb")
    proc = subprocess.Popen([str(TSUKIMI), "compat", "mooncake-master", *flags], stdout=log, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            assert proc.poll() is None, f"the master exited {proc.returncode} (see {log.name})"
            try:
                return httpx.get(f"http://127.0.0.1:{http}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30)
        yield Master(f"127.0.0.1:{rpc}", http, f"http://127.0.0.1:{meta}/metadata")
    finally:
        stop_processes([proc], timeout_s=15)
        log.close()


@dataclass(frozen=True, slots=True)
class Run:
    """A finished child: its exit status and its output (stdout and stderr together)."""

    returncode: int
    output: str


def run_in_sglang(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> Run:
    """Run `cmd` (its first word: the SGLang venv's python) under `tsukimi compat exec`, with
    this checkout first on PYTHONPATH and `env` added to the environment."""
    child_env = {
        **os.environ,
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [str(TSUKIMI), "compat", "exec", "--", *cmd],
        env=child_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
    )
    return Run(done.returncode, done.stdout)


def run_driver(driver: str, args: dict[str, object], env: dict[str, str], out: Path) -> dict[str, Any]:
    """Run tests/integrations/sglang/`driver` in the SGLang venv with `args` (JSON, plus "out");
    the JSON it wrote. Raises AssertionError (with the output's tail) when it failed."""
    script = Path(__file__).with_name(driver)
    run = run_in_sglang([str(SGLANG_PYTHON), str(script), json.dumps({**args, "out": str(out)})], env)
    assert run.returncode == 0 and out.exists(), f"{driver} exited {run.returncode}:\n{run.output[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    result["output"] = run.output
    return result
