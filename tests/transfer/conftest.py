"""Fixtures for Transfer Engine tests: engine pairs per transport (and with the cluster
secret; see tsukimi.testing.engine_pairs), peer processes, and the metadata services (a real
etcd, an embedded HTTP metadata server), one per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdProcess, run_etcd
from tsukimi.testing.engine_pairs import MIB, TRANSPORT_CASES, EnginePair, engine_pair
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer.metadata.http import ServerHandle, start_in_thread

CHECKOUT = Path(__file__).resolve().parents[2]  # NOTE: first on the peers' path: they run the code under test


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
    worker = JsonWorker(
        "test target", ["tsukimi.bench.child", "transfer-peer", "target", str(64 * MIB)], pythonpath=[CHECKOUT]
    )
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def etcd_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """A real etcd (tests/etcd_server.py) for this test module."""
    with run_etcd(tmp_path_factory.mktemp("etcd")) as proc:
        yield proc


@pytest.fixture(scope="module")
def http_server() -> Iterator[ServerHandle]:
    """An embedded HTTP metadata server (over a private MemoryMetadata) for this test module."""
    handle, _ = start_in_thread()
    yield handle
    handle.stop()
