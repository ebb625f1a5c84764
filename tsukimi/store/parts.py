"""`PartsIO`: objects made of several buffers (`batch_put_parts` / `batch_get_parts`), a part
of client.py's `StoreClient` (which delegates to it): an object's bytes are the concatenation
of its parts, each part written straight from its buffer into every replica at its offset
(through the client's put path, puts.py), and read straight from a replica into its buffer.
Nothing is gathered into a staging copy.

    key "block-7", parts (layer 0 K|V, layer 1 K|V):  [buf_a: 100 B] [buf_b: 50 B]
    replica at A:  | buf_a's bytes | buf_b's bytes |
                   A               A + 100         A + 150

    errors = client.batch_put_parts([("block-7", [buf_a, buf_b])])
    results = client.batch_get_parts(["block-7"], [[dst_a, dst_b]])   # PartsResult each

A get's split need not be the put's: any parts whose sizes add up to the object's size read
it, in order. Parts adding up to more or less are refused (InvalidBufferError) rather than
leaving a part unfilled or bytes unread. The one copy made: an object whose only readable copy
is on a holder's disk is read whole into a staging buffer, then scattered into the parts.
Parts may be device memory (a CUDA tensor's bytes): those cross through the client's host
staging (device_io.py), the batch's device parts in one copy each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tsukimi.clock import Clock
from tsukimi.errors import InvalidBufferError, TransferError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.device_io import DeviceIO, DevicePut, Part, as_part, has_device
from tsukimi.store.disk_server import DiskReader
from tsukimi.store.master_batch import call_batch
from tsukimi.store.master_link import MasterLink
from tsukimi.store.puts import PutPath
from tsukimi.store.replica_io import GetResult, PartsResult, PutItem, read_disk_copies, read_parts
from tsukimi.transfer import TransferEngine

PartsPut = tuple[str, Sequence[object]]  # a key and its buffers, in order


class PartsIO:
    """Puts through the client's put path, gets with its master link, engine and disk reader;
    keeps no state of its own between calls (thread-safe)."""

    def __init__(
        self,
        puts: PutPath,
        device: DeviceIO,
        link: MasterLink,
        engine: TransferEngine,
        clock: Clock,
        disk_reader: DiskReader,
        checksum: bool,
    ) -> None:
        """`checksum`: verify each object read against the crc32c its writer stored."""
        self._puts = puts
        self._device = device
        self._link = link
        self._engine = engine
        self._clock = clock
        self._disk_reader = disk_reader
        self._checksum = checksum

    def batch_put_parts(
        self,
        items: Sequence[PartsPut],
        config: p.ReplicaConfig | None = None,
        *,
        upsert: bool = False,
        configs: Sequence[p.ReplicaConfig] | None = None,
    ) -> list[TsukimiError | None]:
        """Put each key as the concatenation of its buffers (any buffers `byte_view` takes:
        bytes-like objects, CPU tensors, (address, length) tuples), zero-copy; `config`
        defaults to one replica, no pins; `configs` (one per item, the same length), when
        given, is each item's own. Mutates the store.

        Returns:
            Each key's error, or None where it was stored: InvalidBufferError (a part that is
            no buffer or is empty, no parts at all), else as `StoreClient.batch_put`.
        Raises:
            Only for the whole call: RpcTimeout / MasterUnavailable.
        """
        each = list(configs) if configs is not None else [config or p.ReplicaConfig()] * len(items)
        assert len(each) == len(items), "one config per item"
        errors: list[TsukimiError | None] = [None] * len(items)
        puts: list[DevicePut] = []
        slots: list[int] = []
        for i, (key, parts) in enumerate(items):
            try:
                puts.append(DevicePut(key, _parts(key, parts, writable=False), each[i], upsert))
            except TsukimiError as exc:
                errors[i] = exc
                continue
            slots.append(i)
        if any(has_device(put.parts) for put in puts):
            stored = self._device.put(puts, self._puts.put)
        else:
            stored = self._puts.put(
                [PutItem(u.key, cast(tuple[memoryview, ...], u.parts), u.config, upsert) for u in puts]
            )
        for i, error in zip(slots, stored, strict=True):
            errors[i] = error
        return errors

    def batch_get_parts(self, keys: Sequence[str], into: Sequence[Sequence[object]]) -> list[PartsResult]:
        """Read each object into its writable buffers `into[i]`, in order (see the module);
        one master round trip and one Transfer Engine batch per replica rank (per MAX_BATCH
        keys). Mutates only the buffers.

        Returns:
            Each key's `PartsResult`: found with the bytes read, a miss (`PartsResult()`), or
            an error: InvalidBufferError (parts that are no buffers, or whose sizes do not add
            up to the object's), InvalidArgument (a bad key), TransferError / ChecksumMismatch
            (no copy was readable).
        Raises:
            InvalidBufferError for a list of buffers per key that does not match `keys`;
            RpcTimeout / MasterUnavailable.
        """
        if len(into) != len(keys):
            raise InvalidBufferError(f"{len(keys)} keys but {len(into)} lists of buffers")
        results: list[PartsResult] = []
        for start in range(0, len(keys), p.MAX_BATCH):
            results += self._get_chunk(keys[start : start + p.MAX_BATCH], into[start : start + p.MAX_BATCH])
        return results

    def _get_chunk(self, keys: Sequence[str], into: Sequence[Sequence[object]]) -> list[PartsResult]:
        results = [PartsResult()] * len(keys)
        slots: list[int] = []
        dests: list[tuple[Part, ...]] = []
        for i, (key, parts) in enumerate(zip(keys, into, strict=True)):
            try:
                p.check_key(key)
                dests.append(_parts(key, parts, writable=True))
            except TsukimiError as exc:
                results[i] = PartsResult(error=exc)
                continue
            slots.append(i)
        chunk = [keys[i] for i in slots]
        if any(has_device(parts) for parts in dests):
            got = self._device.get(
                dests,
                lambda group, views: self._read([chunk[j] for j in group], views),
                lambda r: r.size if r.found else None,
            )
        else:
            got = self._read(chunk, cast(list[tuple[memoryview, ...]], dests))
        for i, result in zip(slots, got, strict=True):
            results[i] = result
        return results

    def _read(self, chunk: list[str], views: list[tuple[memoryview, ...]]) -> list[PartsResult]:
        """Read `chunk`'s objects into their host parts (replicas, else a disk copy)."""
        found = call_batch(self._link, [p.GetReplicas(k) for k in chunk])
        got = read_parts(self._engine, self._clock, chunk, found, views, self._checksum)
        for j, (result, located) in enumerate(zip(got, found, strict=True)):
            if _needs_disk(result, located):
                got[j] = self._from_disk(chunk[j], located, views[j])
        return got

    def _from_disk(self, key: str, located: p.BatchResultItem, parts: tuple[memoryview, ...]) -> PartsResult:
        """Read a disk copy into a staging buffer, then scatter it into `parts`."""
        assert isinstance(located, p.GetReplicasResult)
        total = sum(map(len, parts))
        if total != located.size:
            return PartsResult(error=InvalidBufferError(f"{key!r} is {located.size} bytes; its buffers hold {total}"))
        staging = bytearray(located.size)
        views = [memoryview(staging)]
        result = read_disk_copies(self._disk_reader, [key], [located], views, [GetResult()], self._checksum)
        if result[0].error is not None or not result[0].found:
            return PartsResult(error=result[0].error)
        offset = 0
        for part in parts:
            part[:] = staging[offset : offset + len(part)]
            offset += len(part)
        return PartsResult(True, total)


def _needs_disk(result: PartsResult, located: p.BatchResultItem) -> bool:
    """Whether a holder's disk copy may still serve this key (no memory replica served it)."""
    if not isinstance(located, p.GetReplicasResult) or not located.disk or result.found:
        return False
    return result.error is None or isinstance(result.error, TransferError)


def _parts(key: str, parts: Sequence[object], writable: bool) -> tuple[Part, ...]:
    """Byte views or device ranges of `parts`. Raises InvalidBufferError: no parts, or a part
    that is no buffer."""
    if isinstance(parts, str | bytes | bytearray | memoryview) or not parts:
        raise InvalidBufferError(f"{key!r} needs a list of one or more buffers")
    return tuple(as_part(part, writable=writable) for part in parts)
