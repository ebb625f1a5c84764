"""Full reads under a parallelism (`get_tensor_with_parallelism` with a "full" `ReadTarget`)
put the tensor back from its TP shards, as Mooncake's store_py.cpp does; a "shard" read of
another TP size is cut from that whole tensor.

The expectations are Mooncake's (store_py_parallel_read.h, and what the real 0.3.13.post1
wheel answers): shards r = 0..n-1 under "{key}_tp_{r}" for one TP axis, or under the
layout's canonical key "{key}__dp_{d}of{D}__tp_{r}of{n}_sd{dim}" with the DP rank kept;
"{key}__parallelism_manifest" lets a reader ask with another TP size; a missing shard, a
shard marked for another place, or a size that does not divide evenly reads as None. One
script runs on tsukimi's facade and, when the wheel and its master are installed, on the
real Mooncake (skipped otherwise, as in CI).
"""

from __future__ import annotations

import ctypes
import itertools
from types import ModuleType
from typing import Protocol

import pytest
import torch

from tests.compat.test_mooncake_tensors import same, store
from tsukimi.compat import mooncake as compat
from tsukimi.compat.mooncake import store as store_module
from tsukimi.store.tensor_format import HEADER_BYTES

pytestmark = pytest.mark.timeout(120)
_ids = itertools.count()
__all__ = ["store"]  # the module-scoped facade fixture, shared with test_mooncake_tensors
_BUFFER_BYTES = 1 << 16


class ParallelStore(Protocol):
    """The part of `MooncakeDistributedStore` the script calls (the facade's or the wheel's)."""

    def put_tensor(self, key: str, tensor: torch.Tensor) -> int: ...
    def put_tensor_with_tp(self, key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int, split_dim: int) -> int: ...
    def put_tensor_with_parallelism(self, key: str, tensor: torch.Tensor, parallelism: object = None) -> int: ...
    def upsert_tensor_with_parallelism(self, key: str, tensor: torch.Tensor, parallelism: object = None) -> int: ...
    def get_tensor_with_parallelism(self, key: str, target: object = None) -> torch.Tensor | None: ...
    def batch_get_tensor_with_parallelism(
        self, keys: list[str], targets: object = None
    ) -> list[torch.Tensor | None]: ...
    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: object = None
    ) -> torch.Tensor | None: ...
    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: object = None
    ) -> list[torch.Tensor | None]: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def is_exist(self, key: str, /) -> int: ...


class Layouts:
    """Builds the module's (Mooncake's or the facade's) ParallelAxis / TensorParallelism / ReadTarget."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def axis(self, kind: str, rank: int, size: int, split_dim: int | None = None) -> object:
        axis = self._module.ParallelAxis()
        axis.kind, axis.rank, axis.size, axis.split_dim = kind, rank, size, split_dim
        return axis

    def layout(self, *axes: object) -> object:
        parallelism = self._module.TensorParallelism()
        parallelism.axes = list(axes)
        return parallelism

    def full(self, *axes: object) -> object:
        return self._target("full", axes)

    def shard(self, *axes: object) -> object:
        return self._target("shard", axes)

    def _target(self, mode: str, axes: tuple[object, ...]) -> object:
        target = self._module.ReadTarget()
        target.mode = mode
        target.parallelism = self.layout(*axes) if axes else None
        return target


def full_reads_script(store: ParallelStore, module: ModuleType) -> None:
    """Mooncake's full-read rules, asserted; the store is set up and holds memory."""
    lay, run = Layouts(module), next(_ids)
    whole = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)

    # TP=4: each rank puts its own shard; read back whole with 4, and re-sharded with 2 and 8
    key = f"tp4-{run}"
    for rank, shard in enumerate(whole.chunk(4, 0)):
        assert store.put_tensor_with_parallelism(key, shard.contiguous(), lay.layout(lay.axis("tp", rank, 4, 0))) == 0
    assert store.is_exist(f"{key}_tp_3") == 1 and store.is_exist(f"{key}__parallelism_manifest") == 1
    for size in (4, 2, 8, 1):
        assert same(store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 1 % size, size, 0))), whole)
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 3, 0))) is None  # 8 rows, 3 ways
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 4, 1))) is None  # another split_dim
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 4))) is None  # no split_dim
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("dp", 0, 4))) is None  # no TP axis
    assert store.get_tensor_with_parallelism(key, lay.full()) is None  # no writer partitions, no plain key
    for rank, size in ((1, 4), (1, 2), (3, 8)):  # a shard of another TP size is cut from the whole
        got = store.get_tensor_with_parallelism(key, lay.shard(lay.axis("tp", rank, size, 0)))
        assert same(got, whole.chunk(size, 0)[rank])

    # DP2 x TP2: each writer puts its DP group's whole tensor; each DP rank reads its own back
    key = f"dp2tp2-{run}"
    groups = [whole, whole + 100]
    for dp, tp in itertools.product(range(2), range(2)):
        layout = lay.layout(lay.axis("dp", dp, 2), lay.axis("tp", tp, 2, 1))
        assert store.put_tensor_with_parallelism(key, groups[dp], layout) == 0
    assert store.is_exist(f"{key}__dp_1of2__tp_0of2_sd1") == 1
    for dp, size in itertools.product(range(2), (2, 3, 1)):
        got = store.get_tensor_with_parallelism(key, lay.full(lay.axis("dp", dp, 2), lay.axis("tp", 0, size, 1)))
        assert same(got, groups[dp])
        reordered = lay.full(lay.axis("tp", size - 1, size, 1), lay.axis("dp", dp, 2))  # axes in any order
        assert same(store.get_tensor_with_parallelism(key, reordered), groups[dp])
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("dp", 0, 4), lay.axis("tp", 0, 2, 1))) is None
    for rank, size in ((1, 2), (2, 3)):
        got = store.get_tensor_with_parallelism(key, lay.shard(lay.axis("dp", 1, 2), lay.axis("tp", rank, size, 1)))
        assert same(got, groups[1].chunk(size, 1)[rank])
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 2, 1))) is None  # the DP axis is part

    # a missing shard, and shards whose metadata does not match their key: None
    missing, plain_shard, other_dim = f"missing-{run}", f"plain-{run}", f"other-dim-{run}"
    rows = [h.contiguous() for h in whole.chunk(2, 0)]
    assert store.put_tensor_with_parallelism(missing, rows[0], lay.layout(lay.axis("tp", 0, 2, 0))) == 0
    assert store.put_tensor_with_parallelism(plain_shard, rows[0], lay.layout(lay.axis("tp", 0, 2, 0))) == 0
    assert store.put_tensor(f"{plain_shard}_tp_1", rows[1]) == 0  # the right bytes, but no shard metadata
    assert store.put_tensor_with_tp(other_dim, whole, tp_rank=0, tp_size=2, split_dim=1) == 0
    tp_1_of_rows = lay.layout(lay.axis("tp", 1, 2, 0))
    assert store.upsert_tensor_with_parallelism(other_dim, rows[1], tp_1_of_rows) == 0  # shard 0 is cut by columns
    for key in (missing, plain_shard, other_dim):
        assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 2, 0))) is None
    assert store.get_tensor_with_parallelism(other_dim, lay.full(lay.axis("tp", 0, 2, 1))) is None

    # with_tp puts every shard and no manifest: read with its own TP size or another one
    key = f"with-tp-{run}"
    assert store.put_tensor_with_tp(key, whole, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert same(store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 2, 1))), whole)
    assert same(store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 3, 1))), whole)
    assert same(store.get_tensor_with_parallelism(key, lay.shard(lay.axis("tp", 1, 3, 1))), whole.chunk(3, 1)[1])

    # a plain object: a full read without a parallelism is the object, with one it is not
    key = f"plain-{run}"
    assert store.put_tensor(key, whole) == 0
    assert same(store.get_tensor_with_parallelism(key, lay.full()), whole)
    assert store.get_tensor_with_parallelism(key, lay.full(lay.axis("tp", 0, 2, 0))) is None

    # batches: targets None or one per key (None entries read as stored); anything else: all None
    tp4, dp2 = f"tp4-{run}", f"dp2tp2-{run}"
    targets = [lay.full(lay.axis("tp", 0, 4, 0)), lay.full(lay.axis("dp", 1, 2), lay.axis("tp", 0, 2, 1)), None]
    got = store.batch_get_tensor_with_parallelism([tp4, dp2, key], targets)
    assert same(got[0], whole) and same(got[1], groups[1]) and same(got[2], whole)
    assert store.batch_get_tensor_with_parallelism([tp4, missing], [targets[0], targets[0]])[1] is None
    assert store.batch_get_tensor_with_parallelism([tp4], targets[0]) == [None]
    assert store.batch_get_tensor_with_parallelism([tp4, dp2], targets[:1]) == [None, None]

    # into a registered buffer: the tensor is a view of it, past its 304-byte header
    buffer = (ctypes.c_char * _BUFFER_BYTES)()
    ptr = ctypes.addressof(buffer)
    assert store.register_buffer(ptr, _BUFFER_BYTES) == 0
    try:
        got = store.get_tensor_with_parallelism_into(tp4, ptr, _BUFFER_BYTES, targets[0])
        assert same(got, whole) and got is not None and got.data_ptr() == ptr + HEADER_BYTES
        assert store.get_tensor_with_parallelism_into(tp4, ptr, HEADER_BYTES + 100, targets[0]) is None  # too small
        half = _BUFFER_BYTES // 2
        got = store.batch_get_tensor_with_parallelism_into(
            [tp4, dp2, missing], [ptr, ptr + half, ptr + half + 4096], [half, 4096, 4096], [*targets[:2], targets[0]]
        )
        assert same(got[0], whole) and same(got[1], groups[1]) and got[2] is None
        assert got[1] is not None and got[1].data_ptr() == ptr + half + HEADER_BYTES
    finally:
        assert store.unregister_buffer(ptr) == 0


def test_full_reads_on_tsukimi(store: compat.MooncakeDistributedStore) -> None:
    full_reads_script(store, store_module)


def test_a_single_target_for_a_batch_is_refused_but_one_per_key_is_not(
    store: compat.MooncakeDistributedStore,
) -> None:
    lay = Layouts(store_module)
    assert store.batch_get_tensor_with_parallelism(["a", "b"], (None, None)) == [None, None]
    assert store.batch_get_tensor_with_parallelism(["a", "b"], lay.full()) == [None, None]


def test_the_same_script_passes_on_the_real_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the expectations honest: they are the real wheel's answers."""
    from tsukimi.bench.mooncake_cluster import (
        LOCAL_BUFFER_BYTES,
        METADATA,
        MooncakeCluster,
        mooncake_store_available,
        unique_hostname,
    )
    from tsukimi.bench.mooncake_te import MOONCAKE_ENV

    if not mooncake_store_available():
        pytest.skip("the real Mooncake store is not installed (make mooncake)")
    for name, value in MOONCAKE_ENV.items():
        monkeypatch.setenv(name, value)
    import mooncake.store as real

    with MooncakeCluster(64 << 20, num_holders=1) as cluster:
        wheel = real.MooncakeDistributedStore()
        assert wheel.setup(unique_hostname(), METADATA, 0, LOCAL_BUFFER_BYTES, "tcp", "", cluster.master_addr) == 0
        try:
            full_reads_script(wheel, real)
        finally:
            wheel.close()
