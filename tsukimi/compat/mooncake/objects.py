"""Whole objects through a `MooncakeDistributedStore`: puts and upserts (of Python bytes, of
parts, from caller buffers), gets (as bytes, into a `BufferHandle`, into caller buffers),
sizes, existence and removal, on tsukimi's `StoreClient`, in Mooncake's return conventions.

`ObjectCalls` owns the local buffer: the limit setup's `local_buffer_size` puts on copying
calls (buffers.py says why tsukimi keeps it). The facade makes a new `ObjectCalls` with each
setup's size; the calls that move bytes by address (`put_buffers`, `get_into`) ignore it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tsukimi.compat.mooncake.buffers import BufferHandle, LocalBuffer, memory_at
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, OK, RPC_FAIL, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.compat.mooncake.replicate import ReplicateConfig
from tsukimi.device import DeviceRange
from tsukimi.errors import ObjectExists, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.device_io import as_part

logger = logging.getLogger(__name__)


class ObjectCalls:
    """Puts, gets, exists and removes of whole objects (never raises for a store failure:
    answers Mooncake's codes, logged)."""

    def __init__(self, connection: StoreConnection, local: LocalBuffer) -> None:
        self._connection = connection
        self._local = local

    # -- puts --------------------------------------------------------------------------

    def put(
        self, items: Sequence[tuple[str, object]], config: ReplicateConfig | None, upsert: bool, copy: bool
    ) -> list[int]:
        """Each item's code: 0 (also for an existing key on a put: the old value stays, as
        Mooncake) or negative. `copy`: the values are Python's bytes, held to the local buffer.
        `config`'s per-key ids (group_ids, session_ids) have one entry per item, else every
        item fails with -600.

        Raises:
            TypeError: `config` is not a ReplicateConfig (as Mooncake's bindings).
        """
        return self._put(items, self._configs(config, len(items)), upsert, copy)

    def _configs(self, config: ReplicateConfig | None, num_keys: int) -> list[p.ReplicaConfig] | int:
        """tsukimi's config per key, or the code every key fails with (logged)."""
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        try:
            return (config or ReplicateConfig()).per_key(num_keys, self._connection.hostname)
        except TsukimiError as exc:
            logger.error("put failed: %s", exc)
            return code_of(exc)

    def _put(
        self, items: Sequence[tuple[str, object]], configs: list[p.ReplicaConfig] | int, upsert: bool, copy: bool
    ) -> list[int]:
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(items)
        if isinstance(configs, int):
            return [configs] * len(items)
        codes = [OK] * len(items)
        views: list[tuple[str, object]] = []
        slots: list[int] = []
        try:
            for i, (key, value) in enumerate(items):
                try:
                    view = as_part(value)
                    if copy:
                        self._local.check(key, view.length if isinstance(view, DeviceRange) else len(view))
                except TsukimiError as exc:
                    logger.error("put %r: %s", key, exc)
                    codes[i] = code_of(exc)
                    continue
                views.append((key, view))
                slots.append(i)
            errors = client.batch_put(views, upsert=upsert, configs=[configs[i] for i in slots])
        except TsukimiError as exc:
            logger.error("put failed: %s", exc)
            return [code_of(exc)] * len(items)
        for i, error in zip(slots, errors, strict=True):
            # NOTE: Mooncake answers a put of an existing key with success and keeps the old value
            codes[i] = OK if isinstance(error, ObjectExists) else code_of(error)
        return codes

    def put_batch(self, keys: list[str], values: list[object], config: ReplicateConfig | None, upsert: bool) -> int:
        """Copies of `values` under `keys`: 0 when every one was stored, else the first
        failure's code (-600 for lists of different lengths)."""
        if len(keys) != len(values):
            logger.error("%d keys but %d values", len(keys), len(values))
            return INVALID_PARAMS
        codes = self.put(list(zip(keys, values, strict=True)), config, upsert, copy=True)
        return next((c for c in codes if c != OK), OK)

    def put_buffers(
        self, keys: list[str], ptrs: list[int], sizes: list[int], config: ReplicateConfig | None, upsert: bool
    ) -> list[int]:
        """Each key's value from its caller buffer (zero-copy; device memory staged): a code per key."""
        if not len(keys) == len(ptrs) == len(sizes):
            logger.error("%d keys, %d buffers, %d sizes", len(keys), len(ptrs), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        configs = self._configs(config, len(keys))
        if isinstance(configs, int):
            return [configs] * len(keys)
        items: list[tuple[str, object]] = []
        item_configs: list[p.ReplicaConfig] = []
        codes: list[int | None] = []
        for key, ptr, n, replica in zip(keys, ptrs, sizes, configs, strict=True):
            try:
                items.append((key, memory_at(ptr, n)))
                item_configs.append(replica)
                codes.append(None)
            except TsukimiError as exc:
                logger.error("put %r: %s", key, exc)
                codes.append(code_of(exc))
        stored = iter(self._put(items, item_configs, upsert, False))
        return [next(stored) if code is None else code for code in codes]

    # -- gets --------------------------------------------------------------------------

    def get_bytes(self, keys: list[str]) -> list[bytes]:
        """Each value, b"" when missing or unreadable."""
        return [b"" if data is None else bytes(data) for data in self._copies(keys, bytearray)]

    def get_handles(self, keys: list[str]) -> list[BufferHandle | None]:
        """Each value in a new `BufferHandle`, None when missing or unreadable."""
        return [data if isinstance(data, BufferHandle) else None for data in self._copies(keys, BufferHandle)]

    def _copies(self, keys: list[str], allocate: type[bytearray]) -> list[bytearray | memoryview | None]:
        """Each value read into a new `allocate(size)` (None: missing, unreadable, or larger
        than the local buffer copies are staged in)."""
        client = self._connection.ready()
        if client is None:
            return [None] * len(keys)
        try:
            results = client.batch_get(keys, allocate=allocate)
        except TsukimiError as exc:
            logger.error("get failed: %s", exc)
            return [None] * len(keys)
        out: list[bytearray | memoryview | None] = []
        for key, result in zip(keys, results, strict=True):
            try:
                data = result.value()
                if data is not None:
                    self._local.check(key, len(data))
            except TsukimiError as exc:
                logger.error("get %r: %s", key, exc)
                data = None
            out.append(data)
        return out

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read per key into its caller buffer (device memory staged), or a negative code
        (-704 missing, -800 unreadable, -600 too small)."""
        client = self._connection.ready()
        if client is None or not len(keys) == len(ptrs) == len(sizes):
            return [RPC_FAIL if client is None else INVALID_PARAMS] * len(keys)
        try:
            buffers = [memory_at(ptr, n) for ptr, n in zip(ptrs, sizes, strict=True)]
            results = client.batch_get(keys, buffers)
        except TsukimiError as exc:
            logger.error("get failed: %s", exc)
            return [code_of(exc)] * len(keys)
        return [code_of(r.error) if r.error else r.size if r.found else OBJECT_NOT_FOUND for r in results]

    def size_of(self, key: str) -> int:
        """The object's size in bytes, or a negative code (-704 missing)."""
        client = self._connection.ready()
        if client is None:
            return RPC_FAIL
        try:
            size = client.size_of(key)
        except TsukimiError as exc:
            return code_of(exc)
        return size if size is not None else OBJECT_NOT_FOUND

    # -- existence and removal -----------------------------------------------------------

    def exist(self, keys: list[str]) -> list[int]:
        """Per key 1 if it exists, 0 if not; a negative code for every key on error."""
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        try:
            return [int(found) for found in client.batch_exists(keys)]
        except TsukimiError as exc:
            return [code_of(exc)] * len(keys)

    def remove(self, keys: list[str], force: bool) -> list[int]:
        """Remove each key: 0, -704 (missing), -706 (leased to readers, without `force`) ..."""
        client = self._connection.ready()
        if client is None:
            return [RPC_FAIL] * len(keys)
        codes = []
        for key in keys:
            try:
                codes.append(OK if client.remove(key, force) else OBJECT_NOT_FOUND)
            except TsukimiError as exc:
                codes.append(code_of(exc))
        return codes

    def remove_all(self, force: bool) -> int:
        """How many objects were removed, or a negative code."""
        client = self._connection.ready()
        if client is None:
            return RPC_FAIL
        try:
            return client.remove_all(force)
        except TsukimiError as exc:
            return code_of(exc)


def joined(parts: Sequence[object]) -> object:
    """The parts as one buffer (one copy), or the offending part itself (refused by `put`)."""
    try:
        return bytearray().join(parts)  # type: ignore[arg-type]
    except TypeError:
        return next((p for p in parts if not isinstance(p, bytes | bytearray | memoryview)), b"")
