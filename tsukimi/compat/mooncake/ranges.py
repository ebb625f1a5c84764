"""`MooncakeDistributedStore.get_into_ranges`: byte ranges of several objects into several
registered buffers, on tsukimi's `StoreClient.get_ranges`. `RangeReads` is given the store's
registered buffers (buffers.py) and refuses a range that leaves its buffer.

The arguments are buffer-major: for buffer b, keys[b] lists the objects read into it and,
per key, parallel lists of destination offsets (in the buffer), source offsets (in the
object) and sizes. The result has the same shape: per range the bytes read, or a negative
code (-600 for a range that does not fit its object or its buffer, or lists that do not line
up; -704 for a missing key).

    buffer 0 (registered, 32 B):  |key1[1:5]|...|key2[2:7]|...|key1[30:33]|
                                  0         4   8        13  20          23
"""

from __future__ import annotations

import logging

from tsukimi.compat.mooncake.buffers import RegisteredBuffers
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_NOT_FOUND, RPC_FAIL, code_of
from tsukimi.compat.mooncake.connection import StoreConnection
from tsukimi.device import locate
from tsukimi.errors import InvalidBufferError, TsukimiError
from tsukimi.store.ranges import RangeRead

logger = logging.getLogger(__name__)

Ranges = list[list[list[int]]]


class RangeReads:
    """Range reads into the buffers registered with the store."""

    def __init__(self, connection: StoreConnection, buffers: RegisteredBuffers) -> None:
        self._connection = connection
        self._buffers = buffers

    def read(self, buffer_ptrs: list[int], keys: list[list[str]], dsts: Ranges, srcs: Ranges, sizes: Ranges) -> Ranges:
        """Per buffer, per key, per range: bytes read or a negative code (see the module)."""
        client = self._connection.ready()
        if not len(buffer_ptrs) == len(keys) == len(dsts) == len(srcs) == len(sizes):
            logger.error("get_into_ranges: %d buffers but %d key lists", len(buffer_ptrs), len(keys))
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        results: Ranges = []
        reads: list[RangeRead] = []
        slots: list[tuple[int, int, int]] = []  # (buffer, key, range) of each read
        for b, ptr in enumerate(buffer_ptrs):
            plan = (keys[b], dsts[b], srcs[b], sizes[b])
            results.append(self._plan_buffer(b, ptr, plan, reads, slots))
        if client is None:
            return [[[RPC_FAIL] * len(r) for r in per_key] for per_key in results]
        try:
            got = client.get_ranges(reads)
        except TsukimiError as exc:
            logger.error("get_into_ranges failed: %s", exc)
            for b, k, r in slots:
                results[b][k][r] = code_of(exc)
            return results
        for (b, k, r), result in zip(slots, got, strict=True):
            code = code_of(result.error) if result.error else OBJECT_NOT_FOUND
            results[b][k][r] = result.size if result.found else code
        return results

    def _plan_buffer(
        self,
        b: int,
        ptr: int,
        plan: tuple[list[str], list[list[int]], list[list[int]], list[list[int]]],
        reads: list[RangeRead],
        slots: list[tuple[int, int, int]],
    ) -> list[list[int]]:
        """Buffer `b`'s result lists, INVALID_PARAMS where a range is refused; the ranges to
        read are appended to `reads` (and their places to `slots`)."""
        keys, dsts, srcs, sizes = plan
        if not len(keys) == len(dsts) == len(srcs) == len(sizes):
            return [[INVALID_PARAMS] for _ in keys]
        try:
            capacity = self._buffers.size_at(ptr)
        except InvalidBufferError as exc:
            logger.error("get_into_ranges: %s", exc)
            return [[INVALID_PARAMS] * max(1, len(d)) for d in dsts]
        if locate(ptr, capacity) is not None:  # NOTE: range reads land in host memory only (no staging here)
            logger.error("get_into_ranges: the buffer at %#x is device memory; use batch_get_into", ptr)
            return [[INVALID_PARAMS] * max(1, len(d)) for d in dsts]
        out: list[list[int]] = []
        for k, key in enumerate(keys):
            dst, src, size = dsts[k], srcs[k], sizes[k]
            if not len(dst) == len(src) == len(size):
                out.append([INVALID_PARAMS] * max(1, len(dst)))
                continue
            out.append([INVALID_PARAMS] * len(dst))
            for r, (at, offset, length) in enumerate(zip(dst, src, size, strict=True)):
                if not (isinstance(at, int) and isinstance(length, int) and 0 <= at <= at + length <= capacity):
                    logger.error("get_into_ranges: [%s, +%s) is outside the %d-byte buffer", at, length, capacity)
                elif length == 0:
                    out[k][r] = 0
                else:
                    reads.append(RangeRead(key, offset, (ptr + at, length)))
                    slots.append((b, k, r))
        return out
