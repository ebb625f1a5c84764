"""Several NICs: an engine given several bind addresses serves on each and publishes them all;
a tcp peer stripes its connections over them and, when one path dies, retries the broken
slices on another and keeps new ones off it (loopback: 127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

MIB = 1 << 20


def test_two_paths_are_striped_and_one_dying_costs_nothing() -> None:
    url = f"memory://{uuid.uuid4().hex}"
    owner_cfg = Config(TransferConfig(bind_host="127.0.0.1,127.0.0.2"), MetadataConfig(url=url))
    user_cfg = Config(TransferConfig(transport="tcp", num_connections=4, slice_bytes=256 << 10), MetadataConfig(url))
    with TransferEngine("owner", owner_cfg) as owner, TransferEngine("user", user_cfg) as user:
        buf = owner.allocate(16 * MIB)
        endpoints = owner.describe().endpoints
        assert [e.host for e in endpoints] == ["127.0.0.1", "127.0.0.2"] and endpoints[0].port != endpoints[1].port
        data = np.random.default_rng(3).integers(0, 256, 8 * MIB, dtype=np.uint8)
        user.write("owner", buf.base, data)  # 32 slices over 4 connections, 2 per path
        served = [len(server._conns) for server in owner._servers]
        assert served == [2, 2], served
        owner._servers[1].close()
        for round_no in range(5):
            data[:] = round_no
            statuses = user.transfer([TransferRequest(OpCode.WRITE, "owner", buf.base + 8 * MIB, data)])
            assert statuses[0].state is RequestState.COMPLETED, statuses
            assert np.array_equal(np.frombuffer(buf.view, np.uint8)[8 * MIB :], data)
        back = np.zeros(8 * MIB, np.uint8)
        user.read("owner", buf.base + 8 * MIB, back)
        assert np.array_equal(back, data)


@pytest.mark.parametrize("bad", ["a,a", "a,,b", ""])
def test_bind_hosts_parse_and_refuse_duplicates(bad: str) -> None:
    assert TransferConfig(bind_host="10.0.0.5, 10.0.1.5").bind_hosts == ("10.0.0.5", "10.0.1.5")
    with pytest.raises(ConfigError, match="bind_host"):
        TransferConfig(bind_host=bad)
