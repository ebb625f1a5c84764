"""`assemble` puts equal shards back together only when each is marked for its place, and
`Manifest` reads back what it wrote and nothing else."""

from __future__ import annotations

import torch

from tsukimi.errors import KVFormatError, MasterUnavailable
from tsukimi.store.replica_io import GetResult
from tsukimi.store.shard_rebuild import Manifest, assemble, stored_count
from tsukimi.store.tensor_format import ShardPlacement, serialize

WHOLE = torch.arange(24, dtype=torch.int32).reshape(4, 6)


def shards(count: int, dim: int, marks: list[ShardPlacement] | None = None) -> list[GetResult]:
    chunks = WHOLE.chunk(count, dim)
    marks = marks or [ShardPlacement(r, count, dim) for r in range(count)]
    return [GetResult(serialize(c.contiguous(), m)) for c, m in zip(chunks, marks, strict=True)]


def test_shards_marked_for_their_place_make_the_whole_tensor() -> None:
    manifest = Manifest(3, 1, (4, 6))
    got = assemble("k", shards(3, 1), 1, manifest, asked=2).value()
    assert got is not None and torch.equal(got, WHOLE)
    assert stored_count(shards(3, 1)[0]) == 3 and stored_count(shards(3, 1)[1]) == 0


def test_a_missing_shard_is_a_miss_and_a_failed_read_its_error() -> None:
    found = shards(2, 0)
    assert assemble("k", [found[0], GetResult()], 0) == assemble("k", [], 0)
    assert assemble("k", [found[0], GetResult()], 0).error is None
    failed = assemble("k", [found[0], GetResult(error=MasterUnavailable("down"))], 0)
    assert isinstance(failed.error, MasterUnavailable)


def test_shards_that_do_not_make_one_tensor_are_refused() -> None:
    wrong_rank = shards(2, 0, [ShardPlacement(0, 2, 0), ShardPlacement(0, 2, 0)])
    wrong_dim = shards(2, 0)
    plain = [GetResult(serialize(c.contiguous())) for c in WHOLE.chunk(2, 0)]
    uneven = [GetResult(serialize(WHOLE[:1], ShardPlacement(0, 2, 0))), shards(2, 0)[1]]
    for found, dim in ((wrong_rank, 0), (wrong_dim, 1), (plain, 0), (uneven, 0)):
        assert isinstance(assemble("k", found, dim).error, KVFormatError)
    assert isinstance(assemble("k", shards(2, 0), 0, Manifest(2, 0, (8, 6))).error, KVFormatError)
    assert isinstance(assemble("k", shards(2, 0), 0, asked=3).error, KVFormatError)  # 4 rows, 3 ways
    assert isinstance(assemble("k", [GetResult(bytearray(b"junk"))], 0).error, KVFormatError)


def test_a_manifest_reads_back_and_garbage_is_ignored() -> None:
    manifest = Manifest.of(torch.zeros(2, 3, 5), 4, 1)
    assert manifest == Manifest(4, 1, (2, 12, 5))
    assert Manifest.parse(manifest.pack()) == manifest
    assert Manifest.parse(manifest.pack()[:-1]) is None
    assert Manifest.parse(b"junk") is None
    assert Manifest.parse(Manifest(2, 3, (4, 4)).pack()) is None  # split_dim past the last dim
