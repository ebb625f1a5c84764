"""`AsyncStoreClient`: a `StoreClient` for asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tsukimi.errors import TsukimiError
from tsukimi.store.client import PinName, StoreClient
from tsukimi.store.replica_io import GetResult


class AsyncStoreClient:
    """A `StoreClient` for asyncio: the same calls, awaitable; each runs on a worker thread,
    so none blocks the event loop. Closing it closes the client."""

    def __init__(self, client: StoreClient) -> None:
        self.sync = client

    async def put(self, key: str, data: object, replicas: int = 1, pin: PinName = "", *, upsert: bool = False) -> None:
        await asyncio.to_thread(self.sync.put, key, data, replicas, pin, upsert=upsert)

    async def batch_put(self, items: Sequence[tuple[str, object]], replicas: int = 1) -> list[TsukimiError | None]:
        return await asyncio.to_thread(self.sync.batch_put, items, replicas)

    async def get(self, key: str) -> bytearray | None:
        return await asyncio.to_thread(self.sync.get, key)

    async def batch_get(self, keys: Sequence[str], into: Sequence[object] | None = None) -> list[GetResult]:
        return await asyncio.to_thread(self.sync.batch_get, keys, into)

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self.sync.exists, key)

    async def remove(self, key: str, force: bool = False) -> bool:
        return await asyncio.to_thread(self.sync.remove, key, force)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.sync.close)
