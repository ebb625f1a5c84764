"""Fixtures for Transfer Engine tests: engine pairs per transport (and with the cluster
secret; see tsukimi.testing.engine_pairs), and peer processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tsukimi.testing.engine_pairs import MIB, TRANSPORT_CASES, EnginePair, engine_pair
from tsukimi.testing.processes import JsonWorker


@pytest.fixture(autouse=True)
def _no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TSUKIMI_CLUSTER_SECRET would override every engine's security config."""
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)


@pytest.fixture(params=list(TRANSPORT_CASES))
def pair(request: pytest.FixtureRequest) -> Iterator[EnginePair]:
    with engine_pair(request.param) as made:
        yield made


@pytest.fixture
def target_process() -> Iterator[JsonWorker]:
    """A Transfer Engine in another process (p2p), owning a shared-memory buffer."""
    worker = JsonWorker("test target", ["tsukimi.bench.peer", "target", str(64 * MIB)])
    try:
        yield worker
    finally:
        worker.stop()
