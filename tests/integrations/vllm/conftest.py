"""Shared pieces of the vLLM tests: the skip condition, a store cluster, prompts, servers.

They run vLLM's API server from `.venv-vllm` (built by `make vllm`, with the models) in
subprocesses; without it they are skipped, saying so. One store cluster and at most two vLLM
processes per test file (module-scoped: vLLM takes 40-90 s to start on two CPUs), besides
`plain_server`: vLLM without a connector, the greedy reference of every file here, started once
for the package, in the background (its start overlaps the first test that asks for it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.vllm_server import VllmServer, VllmServerConfig, missing_reason

SKIP_REASON = missing_reason("tiny")
needs_vllm = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "vLLM is here")
BLOCK_SIZE = 128


def prompt(seed: int, num_tokens: int) -> list[int]:
    """A deterministic prompt of ordinary token ids (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(num_tokens)]


def loadable_tokens(num_tokens: int) -> int:
    """What the connector may load of a prompt: full blocks, never the last token."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def store_cluster() -> Iterator[TsukimiCluster]:
    """A master and one 256 MiB holder in processes (the test may kill the master)."""
    with TsukimiCluster(256 << 20, num_holders=1) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this package's vLLM servers log (pytest's temporary folders, kept for post-mortems
    as pytest keeps them, not left in /tmp)."""
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="package")
def plain_server(vllm_logs: Path) -> Iterator[Future[VllmServer]]:
    """Plain vLLM (no connector, local prefix caching off, CPU 1), starting in a thread: ask
    `.result()` for the running server (PeerError when it did not start); closed after the last
    test of the package. Its greedy tokens are what the connectors must reproduce."""
    starter = ThreadPoolExecutor(1, thread_name_prefix="plain-vllm")
    future = starter.submit(VllmServer, VllmServerConfig(connector=None, cpus="1", log_dir=vllm_logs))
    try:
        yield future
    finally:
        starter.shutdown(wait=True)  # NOTE: a start still under way finishes first
        if future.exception() is None:
            future.result().close()
