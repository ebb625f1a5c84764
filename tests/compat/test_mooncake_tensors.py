"""The facade's tensor family keeps Mooncake's conventions: 0 or a negative code per put,
a tensor or None per get, tensors read into a caller's buffer are views of it."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tsukimi.compat import mooncake as compat
from tsukimi.compat.mooncake import store as store_module
from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OK, RPC_FAIL
from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument
from tsukimi.store.master.server import MasterServer
from tsukimi.store.tensor_format import HEADER_BYTES

pytestmark = pytest.mark.timeout(60)
_ids = itertools.count()


@pytest.fixture(scope="module")
def store() -> Iterator[compat.MooncakeDistributedStore]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0))
    facade = compat.MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert facade.setup("localhost", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", address) == 0
    yield facade
    facade.close()
    master.close()


def fresh(name: str) -> str:
    return f"{name}-{next(_ids)}"


def same(got: torch.Tensor | None, expected: torch.Tensor) -> bool:
    return (
        got is not None and got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    )


def test_put_get_and_return_codes(store: compat.MooncakeDistributedStore) -> None:
    key, other = fresh("t"), fresh("t")
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert store.put_tensor(key, tensor) == OK
    assert store.put_tensor(key, torch.zeros(1)) == OK and same(store.get_tensor(key), tensor)  # kept, as Mooncake
    assert store.upsert_tensor(other, torch.ones(3)) == OK and store.upsert_tensor(other, torch.zeros(2)) == OK
    assert same(store.get_tensor(other), torch.zeros(2))
    assert store.put_tensor(fresh("t"), [1, 2, 3]) == INVALID_PARAMS  # type: ignore[arg-type]
    assert store.get_tensor(fresh("missing")) is None
    assert store.batch_put_tensor([fresh("b"), fresh("b")], [torch.ones(1)]) == [INVALID_PARAMS] * 2
    got = store.batch_get_tensor([key, fresh("missing")])
    assert same(got[0], tensor) and got[1] is None


def test_pub_tensor_takes_a_replicate_config(store: compat.MooncakeDistributedStore) -> None:
    config = compat.ReplicateConfig()
    config.replica_num = 1
    config.with_soft_pin = True
    keys = [fresh("pub"), fresh("pub")]
    assert store.batch_pub_tensor(keys, [torch.ones(2), torch.ones(3)], config) == [OK, OK]
    assert store.upsert_pub_tensor(keys[0], torch.full((2,), 5.0), config) == OK
    assert same(store.get_tensor(keys[0]), torch.full((2,), 5.0))


def test_into_and_from_caller_buffers(store: compat.MooncakeDistributedStore) -> None:
    key, back = fresh("into"), fresh("from")
    tensor = torch.arange(25, dtype=torch.float32)
    assert store.put_tensor(key, tensor) == OK
    size = store.get_size(key)
    assert size == HEADER_BYTES + 100
    buffer = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buffer)
    got = store.get_tensor_into(key, ptr, size)
    assert same(got, tensor) and got is not None and ptr <= got.data_ptr() < ptr + size  # a view of the buffer
    got.fill_(2.0)
    assert store.put_tensor_from(back, ptr, size) == OK and same(store.get_tensor(back), torch.full((25,), 2.0))
    assert store.get_tensor_into(key, ptr, size - 1) is None  # too small
    assert store.put_tensor_from(fresh("from"), ptr, 10) == INVALID_PARAMS  # holds no header
    assert store.batch_get_tensor_into([key, fresh("x")], [ptr], [size]) == [INVALID_PARAMS] * 2  # as Mooncake


def test_with_tp_writes_every_shard(store: compat.MooncakeDistributedStore) -> None:
    key = fresh("tp")
    tensor = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert store.put_tensor_with_tp(key, tensor, tp_rank=0, tp_size=2, split_dim=1) == OK
    for rank, chunk in enumerate(tensor.chunk(2, 1)):
        assert same(store.get_tensor_with_tp(key, tp_rank=rank, tp_size=2), chunk)
        assert same(store.get_tensor(f"{key}_tp_{rank}"), chunk)
    assert store.get_tensor_with_tp(key, tp_rank=1, tp_size=4) is None  # stored 2-way
    assert store.put_tensor_with_tp(fresh("tp"), tensor, tp_size=3, split_dim=1) == INVALID_PARAMS  # uneven
    assert store.put_tensor_with_tp(fresh("tp"), tensor, tp_rank=2, tp_size=2) == INVALID_PARAMS
    buffer = ctypes.create_string_buffer(HEADER_BYTES + 48)
    ptr = ctypes.addressof(buffer)
    assert same(store.batch_get_tensor_with_tp_into([key], [ptr], [len(buffer)], 1, 2)[0], tensor[:, 2:])


def test_with_tp_from_a_buffer(store: compat.MooncakeDistributedStore) -> None:
    seed, key = fresh("seed"), fresh("tp-from")
    tensor = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    store.put_tensor(seed, tensor)
    buffer = ctypes.create_string_buffer(HEADER_BYTES + 32)
    ptr = ctypes.addressof(buffer)
    assert store.get_tensor_into(seed, ptr, len(buffer)) is not None
    assert store.put_tensor_with_tp_from(key, ptr, len(buffer), tp_size=2, split_dim=0) == OK
    assert same(store.get_tensor_with_tp(key, 1, 2), tensor[2:])


@dataclass
class Partition:
    rank: int
    size: int
    split_dim: int


def _axis(kind: str, rank: int, size: int, split_dim: int | None = None) -> store_module.ParallelAxis:
    axis = store_module.ParallelAxis()
    axis.kind, axis.rank, axis.size, axis.split_dim = kind, rank, size, split_dim
    return axis


def _target(mode: str, *axes: object) -> store_module.ReadTarget:
    target = store_module.ReadTarget()
    target.mode = mode
    if axes:
        target.parallelism = store_module.TensorParallelism()
        target.parallelism.axes = list(axes)  # type: ignore[arg-type]
    return target


def test_with_parallelism_and_writer_partitions(store: compat.MooncakeDistributedStore) -> None:
    key, wp = fresh("par"), fresh("wp")
    whole = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    for rank in range(2):
        layout = _target("shard", _axis("dp", 0, 2), _axis("tp", rank, 2, 1)).parallelism
        assert store.put_tensor_with_parallelism(key, whole, layout) == OK
        assert store.upsert_tensor_with_parallelism(wp, whole, writer_partition=Partition(rank, 2, 1)) == OK
    rank_1 = _target("shard", _axis("dp", 0, 2), _axis("tp", 1, 2, 1))
    got = store.batch_get_tensor_with_parallelism([key, wp], [rank_1, _target("full")])
    assert same(got[0], whole[:, 2:]) and same(got[1], whole)
    tp_0 = _target("shard", _axis("tp", 0, 2, 1)).parallelism
    both = store.put_tensor_with_parallelism(fresh("x"), whole, tp_0, writer_partition=Partition(0, 2, 1))
    assert both == INVALID_PARAMS
    assert store.get_tensor_with_parallelism(fresh("missing"), _target("full")) is None


def test_read_target_mode_is_checked_when_set() -> None:
    target = store_module.ReadTarget()
    assert target.mode == "as_stored" and target.parallelism is None
    target.mode = "FULL"
    assert target.mode == "full"
    with pytest.raises(InvalidArgument):
        target.mode = "sideways"


def test_without_setup_every_call_fails_cleanly() -> None:
    facade = compat.MooncakeDistributedStore()
    assert facade.put_tensor("k", torch.ones(1)) == RPC_FAIL
    assert facade.get_tensor("k") is None
    assert facade.batch_get_tensor_with_parallelism(["a", "b"]) == [None, None]
