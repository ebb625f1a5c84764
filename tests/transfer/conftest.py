"""Fixtures for Transfer Engine tests: engine pairs per transport, and peer processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tsukimi.bench.workers import JsonWorker
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import RegisteredBuffer, TransferEngine

KIB, MIB = 1 << 10, 1 << 20
TARGET_BYTES = 4 * MIB

# The conformance suite runs once per transport setting: (name, TransferConfig overrides).
TRANSPORT_CASES: dict[str, dict[str, object]] = {
    "shm": {"transport": "shm"},
    "tcp-1": {"transport": "tcp", "num_connections": 1},
    "tcp-4": {"transport": "tcp", "num_connections": 4},
}


@dataclass
class EnginePair:
    """`initiator` moves bytes to and from `buf`, a shared-memory buffer of `target`."""

    case: str
    target: TransferEngine
    initiator: TransferEngine
    buf: RegisteredBuffer


def initiator_config(case: str, metadata_url: str = "p2p", **extra: object) -> Config:
    fields: dict[str, object] = {"slice_bytes": 64 * KIB, "timeout_s": 5.0, **TRANSPORT_CASES[case], **extra}
    return Config(transfer=TransferConfig(**fields), metadata=MetadataConfig(url=metadata_url))  # type: ignore[arg-type]


@pytest.fixture(params=list(TRANSPORT_CASES))
def pair(request: pytest.FixtureRequest) -> Iterator[EnginePair]:
    url = f"memory://{uuid.uuid4().hex}"
    target = TransferEngine("target", Config(metadata=MetadataConfig(url=url)))
    initiator = TransferEngine("initiator", initiator_config(request.param, url))
    try:
        yield EnginePair(request.param, target, initiator, target.allocate(TARGET_BYTES))
    finally:
        initiator.close()
        target.close()


@pytest.fixture
def target_process() -> Iterator[JsonWorker]:
    """A Transfer Engine in another process (p2p), owning a shared-memory buffer."""
    worker = JsonWorker("test target", ["tsukimi.bench.peer", "target", str(64 * MIB)])
    try:
        yield worker
    finally:
        worker.stop()
