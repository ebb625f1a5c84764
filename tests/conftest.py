"""Suite-wide fixtures and guards.

- every test ends in the directory it started in (a test, or a library it calls, that changes
  the working directory would break every later test that uses a relative path; the culprit is
  named);
- `tiny`: the seeded random tiny model (`load_model("tiny")`, torch on one thread), one per
  module;
- `master`: a store master on ephemeral ports, closed after the test; a module or test marked
  `@pytest.mark.master(lease_ttl_s=0.2, ...)` gets those `MasterConfig` fields;
- `@pytest.mark.gpu`: skipped, saying "needs a CUDA GPU", where torch sees no CUDA device (CI);
  `make gpu-check` runs them (`pytest -m gpu`) on a GPU machine;
- every vLLM process the suite starts (directly, through `tsukimi up --engine vllm` or a bench)
  caches its compiled model the way that works with this torch: VLLM_USE_AOT_COMPILE=0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tsukimi.engine.weights import LoadedModel
    from tsukimi.store.master.server import MasterServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the `gpu` tests without CUDA. NOTE: torch is imported only when some are collected."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _same_working_directory(request: pytest.FixtureRequest) -> Iterator[None]:
    before = os.getcwd()
    yield
    after = os.getcwd()
    if after != before:
        os.chdir(before)
        pytest.fail(f"{request.node.nodeid} changed the working directory to {after!r}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _vllm_compile_cache() -> Iterator[None]:
    """VLLM_USE_AOT_COMPILE=0 in the environment the suite's processes inherit (unless set).

    NOTE: vLLM 0.32 on torch 2.13 saves its AOT-compiled model but fails to load it ("'function'
    object has no attribute 'finalize_loading'"), so every server compiled again (C++ included:
    10-30 s of a 40-90 s start on two CPUs); its older cache loads. Same graph, same tokens."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_USE_AOT_COMPILE", os.environ.get("VLLM_USE_AOT_COMPILE", "0"))
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    import torch

    from tsukimi.engine.weights import load_model

    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture
def master(request: pytest.FixtureRequest) -> Iterator[MasterServer]:
    from tsukimi.config import MasterConfig
    from tsukimi.store.master.server import MasterServer

    marker = request.node.get_closest_marker("master")
    fields = dict(marker.kwargs) if marker is not None else {}
    with MasterServer(MasterConfig(rpc_port=0, http_port=0, **fields)) as server:
        yield server


FAKE_CUDA_SOURCE = Path(__file__).parent / "device" / "fake_cuda" / "fake_cuda.c"


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The stand-in libcuda, compiled once per session; at the end, the shared-memory files
    of its "device memory" that exited processes never freed are removed (a worker killed
    or ended by the test leaves them, ~6 MiB each, in /dev/shm).

    Raises (as a test error, not a skip): no C compiler (`make test` installs gcc)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler to build the stand-in CUDA driver: install gcc (make system-deps)")
    library = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    build = [cc, "-shared", "-fPIC", "-O1", "-o", str(library), str(FAKE_CUDA_SOURCE), "-lpthread", "-lrt"]
    subprocess.run(build, check=True, timeout=120)
    yield library
    for leftover in Path("/dev/shm").glob("fakecuda-*-*"):  # NOTE: named /fakecuda-PID-N by fake_cuda.c
        pid = leftover.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leftover.unlink(missing_ok=True)
