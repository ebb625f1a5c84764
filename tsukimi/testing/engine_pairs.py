"""Pairs of Transfer Engines in one process, one pair per transport setting: what the transport
conformance suite (`transport_checks`) runs against.

A pair is a target engine that owns a registered shared-memory buffer of TARGET_BYTES and an
initiator engine that moves bytes to and from it, both on one private in-memory metadata
backend. TRANSPORT_CASES names the settings the suite runs under; SECRET_CASES are those where
both engines share a cluster secret (every connection then authenticates).

NOTE: TSUKIMI_CLUSTER_SECRET in the environment overrides every engine's security config;
unset it before building pairs (the test suite's conftest does).
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tsukimi.config import Config, MetadataConfig, SecurityConfig, TransferConfig
from tsukimi.transfer import Notification, RegisteredBuffer, TransferEngine

KIB, MIB = 1 << 10, 1 << 20
TARGET_BYTES = 4 * MIB

# The conformance suite runs once per transport setting: (name, TransferConfig overrides).
TRANSPORT_CASES: dict[str, dict[str, object]] = {
    "shm": {"transport": "shm"},
    "cma": {"transport": "cma"},
    "nixl": {"transport": "nixl", "nixl": True},  # needs `make nixl`; both engines run an agent
    "tcp-1": {"transport": "tcp", "num_connections": 1},
    "tcp-4": {"transport": "tcp", "num_connections": 4},
    "tcp-secret": {"transport": "tcp", "num_connections": 2},  # both engines share a cluster secret
}
SECRET_CASES = frozenset({"tcp-secret"})


@dataclass
class EnginePair:
    """`initiator` moves bytes to and from `buf`, a shared-memory buffer of `target` (whose
    segment is named "target"); `case` names the transport setting."""

    case: str
    target: TransferEngine
    initiator: TransferEngine
    buf: RegisteredBuffer


class PairTarget(Protocol):
    """What the checks ask of a pair's target: a TransferEngine, or a stand-in for one that
    runs in another process (tsukimi/testing/host_pairs.py)."""

    def allocate(self, nbytes: int) -> RegisteredBuffer: ...
    def unregister(self, base: int) -> None: ...
    def notifications(self, max_count: int | None = None, timeout_s: float = 0.0) -> list[Notification]: ...


class Pair(Protocol):
    """What a transport check is given (EnginePair has it): `initiator` moves bytes to and
    from `buf` ("target"'s buffer; its `view` shows the owner's memory) of `target`."""

    @property
    def case(self) -> str: ...
    @property
    def target(self) -> PairTarget: ...
    @property
    def initiator(self) -> TransferEngine: ...
    @property
    def buf(self) -> RegisteredBuffer: ...


PairMaker = Callable[[], AbstractContextManager[Pair]]
"""What a transport check is given: each call makes a fresh pair, closed on leaving the `with`."""


def secret_file(directory: Path, secret: bytes, name: str = "secret") -> SecurityConfig:
    """Write `secret` to a 0600 file `name` under `directory` (creates the file).

    Returns:
        the SecurityConfig that reads it.
    """
    path = directory / name
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return SecurityConfig(secret_file=str(path))


def initiator_config(
    case: str, metadata_url: str = "p2p", security: SecurityConfig | None = None, **extra: object
) -> Config:
    """The initiator's config under transport setting `case` (64 KiB slices, 5 s timeout),
    with `extra` TransferConfig fields on top.

    Raises:
        KeyError: `case` is not in TRANSPORT_CASES.
    """
    fields: dict[str, object] = {"slice_bytes": 64 * KIB, "timeout_s": 5.0, **TRANSPORT_CASES[case], **extra}
    return Config(
        transfer=TransferConfig(**fields),  # type: ignore[arg-type]
        metadata=MetadataConfig(url=metadata_url),
        security=security or SecurityConfig(),
    )


@contextlib.contextmanager
def engine_pair(case: str) -> Iterator[EnginePair]:
    """A fresh pair under transport setting `case` (see TRANSPORT_CASES); both engines and
    the secret file (in a temporary directory) are closed and removed on exit.

    Raises:
        KeyError: `case` is not in TRANSPORT_CASES.
    """
    with contextlib.ExitStack() as stack:
        url = f"memory://{uuid.uuid4().hex}"
        security = SecurityConfig()
        if case in SECRET_CASES:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tsukimi-pair-")))
            security = secret_file(directory, b"conformance-secret-" + uuid.uuid4().hex.encode())
        target_transfer = TransferConfig(nixl=bool(TRANSPORT_CASES[case].get("nixl")))
        target = stack.enter_context(
            TransferEngine("target", Config(target_transfer, MetadataConfig(url=url), security=security))
        )
        initiator = stack.enter_context(TransferEngine("initiator", initiator_config(case, url, security)))
        yield EnginePair(case, target, initiator, target.allocate(TARGET_BYTES))


def pair_maker(case: str) -> PairMaker:
    """The PairMaker for transport setting `case`: `check_transport(pair_maker("tcp-4"))`."""
    return lambda: engine_pair(case)
