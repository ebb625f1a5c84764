"""`mooncake.async_store.MooncakeDistributedStoreAsync` on tsukimi: every store method as an
`async_` coroutine run in the loop's executor, the same answers as the sync calls."""

from __future__ import annotations

import asyncio

import pytest

from tsukimi.compat.mooncake.async_store import MooncakeDistributedStoreAsync
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def test_async_calls_answer_as_the_sync_ones(master: MasterServer) -> None:
    store = MooncakeDistributedStoreAsync()
    address = master.endpoint.removeprefix("tcp://")

    async def session() -> None:
        assert await store.async_setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 4 * MIB, "tcp", "", address) == 0
        puts = await asyncio.gather(*(store.async_put(f"k{i}", bytes([i]) * 1000) for i in range(8)))
        assert puts == [0] * 8
        assert await store.async_get("k3") == bytes([3]) * 1000
        assert await store.async_is_exist("k7") == 1 and store.is_exist("nope") == 0
        assert await store.async_close() == 0

    asyncio.run(session())
    assert store.async_put is store.async_put  # made once, kept
    with pytest.raises(AttributeError, match="nor 'frobnicate'"):
        _ = store.async_frobnicate
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        _ = store.frobnicate  # type: ignore[attr-defined]
