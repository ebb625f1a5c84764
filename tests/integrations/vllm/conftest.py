"""Shared pieces of the vLLM tests: the skip condition, a store cluster, prompts, servers.

They run vLLM's API server from `.venv-vllm` (built by `make vllm`, with the models) in
subprocesses; without it they are skipped, saying so. One store cluster and at most two vLLM
processes per test file (module-scoped: vLLM takes 40-90 s to start on two CPUs).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tsukimi.testing.deployments import TsukimiCluster
from tsukimi.testing.vllm_server import missing_reason

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
