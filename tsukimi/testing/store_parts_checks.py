"""Store semantics checks of objects made of several buffers (part of the store semantics
suite: store_checks.py runs them): `batch_put_parts` / `batch_get_parts` round trips in any
split, their per-key errors, that every part moves straight between its own buffer and the
replica (no staging copy), the crc32c of a multi-part put, and a parts get served by a
holder's disk copy.

Same contract as store_checks: a DeploymentMaker with deployments.MASTER's timeouts and two
holders; each check removes what it stored.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tsukimi.errors import ChecksumMismatch, InvalidArgument, InvalidBufferError, ObjectExists
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient
from tsukimi.store.replica_io import PartsResult
from tsukimi.testing.deployments import Deployment, DeploymentMaker
from tsukimi.testing.processes import wait_until
from tsukimi.transfer import OpCode, TransferRequest
from tsukimi.transfer.segment import byte_view

MIB = 1 << 20


@contextlib.contextmanager
def _client(dep: Deployment, **client_cfg: object) -> Iterator[StoreClient]:
    client = dep.client(**client_cfg)  # type: ignore[arg-type]
    try:
        yield client
    finally:
        client.remove_all(force=True)


def _address(buffer: object) -> int:
    return byte_view(buffer, writable=False)[1]


def parts_round_trip_in_any_split(make_deployment: DeploymentMaker) -> None:
    """An object put from three buffers (numpy, bytearray, an address) reads back into any
    split adding up to its size, from both replicas; each key fails alone."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, 1000, dtype=np.uint8), bytearray(rng.bytes(24))
    c = np.frombuffer(bytearray(rng.bytes(300)), dtype=np.uint8)
    whole = a.tobytes() + bytes(b) + c.tobytes()
    with make_deployment() as dep, _client(dep) as client:
        errors = client.batch_put_parts(
            [("k", [a, b, (_address(c), 300)]), ("bad", [a, "text"]), ("none", []), ("", [a])],
            p.ReplicaConfig(replicas=2),
        )
        assert errors[0] is None and isinstance(errors[1], InvalidBufferError)
        assert isinstance(errors[2], InvalidBufferError) and isinstance(errors[3], InvalidArgument), errors
        assert client.get("k") == bytearray(whole) and client.batch_exists(["bad", "none"]) == [False, False]
        assert isinstance(client.batch_put_parts([("k", [b])])[0], ObjectExists)
        left, right = np.zeros(1100, dtype=np.uint8), bytearray(224)
        too_big, missing = [bytearray(1000), bytearray(400)], [bytearray(4)]
        got = client.batch_get_parts(["k", "k", "nope", ""], [[left, right], too_big, missing, [bytearray(1)]])
        assert got[0] == PartsResult(True, 1324) and left.tobytes() + bytes(right) == whole
        assert isinstance(got[1].error, InvalidBufferError) and too_big == [bytearray(1000), bytearray(400)]
        assert got[2] == PartsResult() and isinstance(got[3].error, InvalidArgument), got
        assert client.batch_put_parts([("k", [b, b])], upsert=True) == [None]
        assert client.get("k") == b + b


def parts_move_straight_between_buffers_and_replicas(make_deployment: DeploymentMaker) -> None:
    """Every part is one Transfer Engine request on the caller's own memory, at its offset
    in each replica: no part is gathered into (or scattered from) a staging copy."""
    parts = [np.full(4096, i, dtype=np.uint8) for i in range(3)]
    dests = [np.zeros(2048, dtype=np.uint8) for _ in range(6)]
    with make_deployment() as dep, _client(dep) as client:
        seen: list[TransferRequest] = []
        transfer = client.engine.transfer

        def recording(requests: list[TransferRequest], **kw: float) -> list[object]:
            seen.extend(requests)
            return transfer(requests, **kw)  # type: ignore[return-value]

        client.engine.transfer = recording  # type: ignore[assignment, method-assign]
        assert client.batch_put_parts([("z", parts)], p.ReplicaConfig(replicas=2)) == [None]
        writes = [(r.op, _address(r.local), r.remote_offset) for r in seen]
        info = client.describe(["z"])[0]
        assert info is not None and len(info.replicas) == 2
        bases = [r.address for r in info.replicas]
        expected = [(OpCode.WRITE, _address(part), base + 4096 * i) for base in bases for i, part in enumerate(parts)]
        assert sorted(writes) == sorted(expected)
        seen.clear()
        assert client.batch_get_parts(["z"], [dests]) == [PartsResult(True, 3 * 4096)]
        assert [(r.op, _address(r.local)) for r in seen] == [(OpCode.READ, _address(d)) for d in dests]
        assert [r.remote_offset - seen[0].remote_offset for r in seen] == [2048 * i for i in range(6)]
        assert np.concatenate(dests).tobytes() == np.concatenate(parts).tobytes()


def a_multi_part_put_carries_the_crc32c_of_the_whole(make_deployment: DeploymentMaker) -> None:
    """With checksums on, a whole-object get accepts a multi-part put's crc32c; a replica
    corrupted behind the store's back fails a parts get with ChecksumMismatch."""
    with make_deployment() as dep, _client(dep, checksum=True) as client:
        client.put_parts("c", [b"x" * 5000, bytearray(b"y" * 3000)])
        assert client.get("c") == bytearray(b"x" * 5000 + b"y" * 3000)
        info = client.describe(["c"])[0]
        assert info is not None
        replica = info.replicas[0]
        client.engine.transfer([TransferRequest(OpCode.WRITE, replica.te_segment, replica.address + 10, b"!")])
        got = client.batch_get_parts(["c"], [[bytearray(4000), bytearray(4000)]])
        assert isinstance(got[0].error, ChecksumMismatch), got


def a_parts_get_reads_a_disk_copy(make_deployment: DeploymentMaker) -> None:
    """An object whose only copy is on a holder's disk is read into parts, byte-exact."""
    value = os.urandom(100_000)
    with make_deployment() as dep, tempfile.TemporaryDirectory(prefix="tsukimi-ssd-") as directory:
        holder = dep.client(MIB, ssd_dir=str(Path(directory) / "ssd"), ssd_bytes=64 * MIB)
        with _client(dep) as client:
            client.put_parts("cold", [value[:60_000], value[60_000:]], preferred=(holder.engine.name,))
            for i in range(48):  # 12 MiB: more than the pool
                client.put(f"hot{i}", bytes(256 << 10), upsert=True)
            wait_until(lambda: dep.copies("cold") == (0, 1))
            dests = [bytearray(30_000), bytearray(70_000)]
            assert client.batch_get_parts(["cold"], [dests]) == [PartsResult(True, 100_000)]
            assert dests[0] + dests[1] == value and client.disk_reads == 1
        holder.close()


PARTS_CHECKS: tuple[Callable[[DeploymentMaker], None], ...] = (
    parts_round_trip_in_any_split,
    parts_move_straight_between_buffers_and_replicas,
    a_multi_part_put_carries_the_crc32c_of_the_whole,
    a_parts_get_reads_a_disk_copy,
)
