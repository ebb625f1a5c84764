"""Fixtures for Transfer Engine tests: engine pairs per transport (and with the cluster
secret), and peer processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tsukimi.config import Config, MetadataConfig, SecurityConfig, TransferConfig
from tsukimi.testing.processes import JsonWorker
from tsukimi.transfer import RegisteredBuffer, TransferEngine

KIB, MIB = 1 << 10, 1 << 20
TARGET_BYTES = 4 * MIB

# The conformance suite runs once per transport setting: (name, TransferConfig overrides).
TRANSPORT_CASES: dict[str, dict[str, object]] = {
    "shm": {"transport": "shm"},
    "tcp-1": {"transport": "tcp", "num_connections": 1},
    "tcp-4": {"transport": "tcp", "num_connections": 4},
    "tcp-secret": {"transport": "tcp", "num_connections": 2},  # both engines share a cluster secret
}
SECRET_CASES = frozenset({"tcp-secret"})


def secret_file(directory: Path, secret: bytes, name: str = "secret") -> SecurityConfig:
    """Write `secret` to a 0600 file under `directory`; the SecurityConfig that reads it."""
    path = directory / name
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return SecurityConfig(secret_file=str(path))


@pytest.fixture(autouse=True)
def _no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TSUKIMI_CLUSTER_SECRET would override every engine's security config."""
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)


@dataclass
class EnginePair:
    """`initiator` moves bytes to and from `buf`, a shared-memory buffer of `target`."""

    case: str
    target: TransferEngine
    initiator: TransferEngine
    buf: RegisteredBuffer


def initiator_config(
    case: str, metadata_url: str = "p2p", security: SecurityConfig | None = None, **extra: object
) -> Config:
    fields: dict[str, object] = {"slice_bytes": 64 * KIB, "timeout_s": 5.0, **TRANSPORT_CASES[case], **extra}
    return Config(
        transfer=TransferConfig(**fields),  # type: ignore[arg-type]
        metadata=MetadataConfig(url=metadata_url),
        security=security or SecurityConfig(),
    )


@pytest.fixture(params=list(TRANSPORT_CASES))
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EnginePair]:
    url = f"memory://{uuid.uuid4().hex}"
    security = secret_file(tmp_path, b"conformance-secret-" + uuid.uuid4().hex.encode())
    if request.param not in SECRET_CASES:
        security = SecurityConfig()
    target = TransferEngine("target", Config(metadata=MetadataConfig(url=url), security=security))
    initiator = TransferEngine("initiator", initiator_config(request.param, url, security))
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
