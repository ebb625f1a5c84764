"""The cma transport's own properties (the conformance suite covers what every transport
shares): any registered memory goes over it, a range the owner released is refused even
when its memory is still mapped, a recycled pid is never attached, and a kernel that refuses
cross-memory attach makes `auto` fall back to tcp, said once in the log."""

from __future__ import annotations

import ctypes
import errno
import logging
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from tsukimi.clock import WallClock
from tsukimi.config import Config, MetadataConfig
from tsukimi.errors import OutOfBounds
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.batch import OpCode as Op
from tsukimi.transfer.transports import cma


@pytest.fixture
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    cfg = Config(metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}"))
    with TransferEngine("owner", cfg) as owner, TransferEngine("user", cfg) as user:
        yield owner, user


def test_numpy_and_torch_memory_go_over_cma_byte_exact(engines: tuple[TransferEngine, TransferEngine]) -> None:
    owner, user = engines
    array, tensor = np.zeros(1 << 20, np.uint8), torch.zeros(1 << 18, dtype=torch.float32)
    a, t = owner.register(array), owner.register(tensor)
    assert user.transport_for("owner", a) == user.transport_for("owner", t) == "cma"  # shm cannot reach them
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    statuses = user.transfer(
        [
            TransferRequest(OpCode.WRITE, "owner", a + i * (1 << 18), data[i * (1 << 18) : (i + 1) * (1 << 18)])
            for i in range(4)
        ]
        + [TransferRequest(OpCode.WRITE, "owner", t, data)]
    )
    assert [s.state for s in statuses] == [RequestState.COMPLETED] * 5
    assert np.array_equal(array, data) and np.array_equal(tensor.numpy().view(np.uint8), data)
    back = np.zeros(1 << 20, np.uint8)
    user.read("owner", t, back)
    assert np.array_equal(back, data)


def test_a_released_range_is_refused_though_still_mapped(engines: tuple[TransferEngine, TransferEngine]) -> None:
    """The numpy array stays alive (mapped) after unregister: only the owner's registration
    version tells the initiator that the range is gone."""
    owner, user = engines
    array = np.zeros(4096, np.uint8)
    base = owner.register(array)
    user.write("owner", base, b"before")
    owner.unregister(base)
    with pytest.raises(OutOfBounds, match="released"):
        user.write("owner", base, b"after")
    assert bytes(array[:6]) == b"before"
    other = owner.register(np.zeros(4096, np.uint8))  # registrations change again: others still work
    user.write("owner", other, b"fine")


def test_a_recycled_pid_is_not_attached(engines: tuple[TransferEngine, TransferEngine]) -> None:
    """Same pid, another start time: another process that got the owner's pid after it died."""
    owner, user = engines
    base = owner.register(np.zeros(4096, np.uint8))
    assert user.transport_for("owner", base) == "cma"
    desc = owner.describe()
    impostor = msgspec.structs.replace(desc, name="impostor", pid_start=desc.pid_start + 1)
    transport = cma.CmaTransport(user.config, desc.host_id, WallClock(), lambda name: impostor)
    try:
        assert not transport.can_serve(impostor, impostor.buffers[0])
        assert transport.can_serve(desc, desc.buffers[0])
    finally:
        transport.close()


def test_a_refusing_kernel_falls_back_to_tcp_and_says_so_once(
    engines: tuple[TransferEngine, TransferEngine], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*_: object) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setitem(cma._CALLS, Op.READ, refuse)
    owner, user = engines
    array = np.zeros(4096, np.uint8)
    base = owner.register(array)
    with caplog.at_level(logging.WARNING, logger=cma.__name__):
        for _ in range(3):
            assert user.transport_for("owner", base) == "tcp"
            user.write("owner", base, b"by tcp")
    assert bytes(array[:6]) == b"by tcp"
    assert sum("refuses cross-memory attach" in r.message for r in caplog.records) == 1
