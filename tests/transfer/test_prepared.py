"""Prepared transfers (TransferEngine.prepare): the same statuses and bytes as `transfer`, run
after run; every transport's prepared call (cma, shm, and tcp for a small list) is taken
where it can serve, and a change on the owner's side (a released range) makes a run fall
back to the ordinary path, which says why."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

KIB = 1 << 10


@pytest.fixture(params=["cma", "shm", "tcp"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine, str]]:
    url = f"memory://{uuid.uuid4().hex}"
    owner_cfg = Config(metadata=MetadataConfig(url))
    user_cfg = Config(TransferConfig(transport=request.param), MetadataConfig(url))
    with TransferEngine("owner", owner_cfg) as owner, TransferEngine("user", user_cfg) as user:
        yield owner, user, request.param


def test_runs_move_the_bytes_and_report_like_transfer(engines: tuple[TransferEngine, TransferEngine, str]) -> None:
    owner, user, transport = engines
    target = np.zeros(256 * KIB, np.uint8) if transport != "shm" else None
    base = owner.register(target) if target is not None else owner.allocate(256 * KIB).base
    data = np.zeros(64 * KIB, np.uint8)
    back = np.zeros(64 * KIB, np.uint8)
    step = 16 * KIB
    writes = user.prepare(
        [TransferRequest(OpCode.WRITE, "owner", base + i * step, data[i * step : (i + 1) * step]) for i in range(4)]
    )
    reads = user.prepare([TransferRequest(OpCode.READ, "owner", base + 128 * KIB, back)])
    assert writes.fast and reads.fast
    for round_no in range(3):
        data[:] = round_no + 1
        assert [(s.state, s.transferred_bytes) for s in writes.run()] == [(RequestState.COMPLETED, 16 * KIB)] * 4
        user.write("owner", base + 128 * KIB, data)
        assert reads.run()[0].state is RequestState.COMPLETED and np.array_equal(back, data)


def test_a_released_range_falls_back_and_fails_as_out_of_bounds() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    user_cfg = Config(TransferConfig(transport="cma"), MetadataConfig(url))
    with (
        TransferEngine("owner", Config(metadata=MetadataConfig(url))) as owner,
        TransferEngine("user", user_cfg) as user,
    ):
        target = np.zeros(4096, np.uint8)
        base = owner.register(target)
        prepared = user.prepare([TransferRequest(OpCode.WRITE, "owner", base, b"prepared")])
        assert prepared.fast and prepared.run()[0].state is RequestState.COMPLETED
        owner.unregister(base)
        (status,) = prepared.run()
        assert status.state is RequestState.FAILED and status.error_code == "out_of_bounds", status
        assert bytes(target[:8]) == b"prepared"
