"""Tensors through a live master and client: exact round trips, caller buffers (zero-copy),
TP shards, and the parallel layouts of tensor_parallel.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument, InvalidBufferError, KVFormatError, ObjectExists
from tsukimi.store import tensor_parallel as tp
from tsukimi.store import tensors as t
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.store.tensor_format import HEADER_BYTES, ShardPlacement, TensorHeader

pytestmark = pytest.mark.timeout(60)
_ids = itertools.count()


@pytest.fixture(scope="module")
def client() -> Iterator[StoreClient]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0))
    store = StoreClient.connect(master.endpoint, segment_bytes=16 << 20)
    yield store
    store.close()
    master.close()


def fresh(name: str) -> str:
    return f"{name}-{next(_ids)}"


def same(got: torch.Tensor | None, expected: torch.Tensor) -> bool:
    """Exactly equal: values, dtype and shape (None, a miss, is never equal)."""
    return got is not None and got.dtype == expected.dtype and torch.equal(got, expected)


TENSORS = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(6, dtype=torch.bfloat16).reshape(1, 2, 3),
    torch.tensor([True, False, True]),
    torch.arange(-5, 5, dtype=torch.int64),
    torch.tensor(2.5, dtype=torch.float64),
    torch.empty((0, 4), dtype=torch.float16),
]


def test_exact_round_trips(client: StoreClient) -> None:
    keys = [fresh("rt") for _ in TENSORS]
    for key, tensor in zip(keys[:2], TENSORS[:2], strict=True):
        t.put_tensor(client, key, tensor)
    assert t.batch_put_tensors(client, keys[2:], TENSORS[2:]) == [None] * (len(TENSORS) - 2)
    for tensor, result in zip(TENSORS, t.batch_get_tensors(client, keys), strict=True):
        got = result.value()
        assert got is not None and got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)
    assert t.get_tensor(client, fresh("missing")) is None


def test_put_keeps_the_first_value_and_upsert_replaces_it(client: StoreClient) -> None:
    key = fresh("up")
    t.put_tensor(client, key, torch.ones(3))
    with pytest.raises(ObjectExists):
        t.put_tensor(client, key, torch.zeros(3))
    t.put_tensor(client, key, torch.full((2, 2), 7, dtype=torch.int32), t.PutOptions(upsert=True))
    assert same(t.get_tensor(client, key), torch.full((2, 2), 7, dtype=torch.int32))


def test_batch_put_reports_each_bad_item(client: StoreClient) -> None:
    keys = [fresh("bad"), fresh("good")]
    errors = t.batch_put_tensors(client, keys, ["not a tensor", torch.ones(2)])  # type: ignore[list-item]
    assert isinstance(errors[0], InvalidArgument) and errors[1] is None
    assert t.get_tensor(client, keys[0]) is None
    with pytest.raises(InvalidArgument):
        t.batch_put_tensors(client, keys, [torch.ones(2)])


def test_get_into_reads_straight_into_the_callers_buffer(client: StoreClient) -> None:
    key, copy_key = fresh("into"), fresh("into-copy")
    tensor = torch.arange(10, dtype=torch.float32)
    t.put_tensor(client, key, tensor)
    buffer = bytearray(HEADER_BYTES + 40 + 24)  # room to spare
    got = t.get_tensor_into(client, key, buffer)
    assert got is not None and torch.equal(got, tensor)
    got.fill_(3.0)  # a view of `buffer`: the layout the serialized put takes back
    assert TensorHeader.unpack(memoryview(buffer)).shape == (10,)
    assert t.batch_put_serialized(client, [copy_key], [buffer]) == [None]
    assert same(t.get_tensor(client, copy_key), torch.full((10,), 3.0))
    assert client.size_of(copy_key) == HEADER_BYTES + 40  # the spare bytes are not stored


def test_a_buffer_too_small_is_refused(client: StoreClient) -> None:
    key = fresh("small")
    t.put_tensor(client, key, torch.zeros(8))
    with pytest.raises(InvalidBufferError):
        t.get_tensor_into(client, key, bytearray(HEADER_BYTES + 31))
    result = t.batch_get_tensors(client, [key], [bytearray(10)])[0]
    assert isinstance(result.error, InvalidBufferError) and result.tensor is None


def test_bytes_that_are_not_a_tensor_are_a_format_error(client: StoreClient) -> None:
    raw = fresh("raw")
    client.put(raw, b"plain bytes, no header" * 20)
    with pytest.raises(KVFormatError):
        t.get_tensor(client, raw)
    errors = t.batch_put_serialized(client, [fresh("junk")], [bytearray(HEADER_BYTES + 8)])
    assert isinstance(errors[0], KVFormatError)


def test_tp_shards_are_equal_chunks_under_key_tp_rank(client: StoreClient) -> None:
    key = fresh("tp")
    tensor = torch.arange(24, dtype=torch.int32).reshape(2, 12)
    t.put_tensor_with_tp(client, key, tensor, tp_size=3, split_dim=1)
    for rank, expected in enumerate(tensor.chunk(3, dim=1)):
        assert same(t.get_tensor_with_tp(client, key, rank, 3), expected)
        stored = client.get(t.tp_key(key, rank))
        assert stored is not None and TensorHeader.unpack(memoryview(stored)).shard == ShardPlacement(rank, 3, 1)
    with pytest.raises(KVFormatError):  # stored 3-way, read 2-way
        t.get_tensor_with_tp(client, key, 1, 2)
    with pytest.raises(InvalidArgument):
        t.get_tensor_with_tp(client, key, 3, 3)
    assert client.exists(key) is False


def test_tp_refuses_uneven_splits_and_size_one_is_the_plain_key(client: StoreClient) -> None:
    uneven, plain = fresh("uneven"), fresh("plain")
    errors = t.batch_put_tensors_with_tp(client, [uneven, plain], [torch.zeros(2, 3), torch.ones(2, 4)], 2, 1)
    assert isinstance(errors[0], InvalidArgument) and errors[1] is None
    assert not any(client.batch_exists([t.tp_key(uneven, 0), t.tp_key(uneven, 1)]))
    t.put_tensor_with_tp(client, plain + "1", torch.ones(2, 3), tp_size=1)
    assert same(t.get_tensor_with_tp(client, plain + "1", 0, 1), torch.ones(2, 3))


def test_tp_shards_read_into_buffers(client: StoreClient) -> None:
    key = fresh("tp-into")
    tensor = torch.arange(8, dtype=torch.float64).reshape(4, 2)
    t.put_tensor_with_tp(client, key, tensor, tp_size=2, split_dim=0)
    buffers = [bytearray(HEADER_BYTES + 32)]
    got = t.batch_get_tensors_with_tp(client, [key], 1, 2, buffers)[0].value()
    assert got is not None and torch.equal(got, tensor[2:]) and got.data_ptr() > 0


def _axis(kind: tp.AxisKind, rank: int, size: int, split_dim: int | None = None) -> tp.ParallelAxis:
    return tp.ParallelAxis(kind, rank, size, split_dim)


def _shard(*axes: tp.ParallelAxis) -> tp.ReadTarget:
    return tp.ReadTarget("shard", tp.TensorParallelism(axes))


def test_one_tp_axis_stores_the_writers_own_shard(client: StoreClient) -> None:
    key = fresh("single")
    shard = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # 3 columns: not cut again
    layout = tp.TensorParallelism((_axis("tp", 1, 2, 1),))
    assert tp.put_with_parallelism(client, [tp.ParallelPut(key, shard, layout)], t.PutOptions()) == [None]
    got = tp.get_with_parallelism(client, [key], [tp.ReadTarget("shard", layout)])[0].value()
    assert got is not None and torch.equal(got, shard)
    assert same(t.get_tensor(client, t.tp_key(key, 1)), shard)
    four_way = tp.get_with_parallelism(client, [key], [_shard(_axis("tp", 1, 4, 1))])[0]
    assert isinstance(four_way.error, KVFormatError)  # stored for 2 ranks: never handed out as 1 of 4


def test_multi_axis_layouts_cut_the_whole_tensor(client: StoreClient) -> None:
    key, uneven = fresh("multi"), fresh("multi-uneven")
    whole = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    puts = [
        tp.ParallelPut(key, whole, tp.TensorParallelism((_axis("dp", 1, 2), _axis("tp", r, 2, 1)))) for r in range(2)
    ]
    puts.append(tp.ParallelPut(uneven, whole, tp.TensorParallelism((_axis("dp", 0, 2), _axis("tp", 0, 3, 1)))))
    errors = tp.put_with_parallelism(client, puts, t.PutOptions())
    assert errors[:2] == [None, None] and isinstance(errors[2], InvalidArgument)
    targets = [_shard(_axis("dp", 1, 2), _axis("tp", r, 2, 1)) for r in range(2)]
    got = tp.get_with_parallelism(client, [key, key], targets)
    assert [same(g.value(), w) for g, w in zip(got, whole.chunk(2, 1), strict=True)] == [True, True]
    assert tp.get_with_parallelism(client, [key], [tp.ReadTarget("full")])[0].tensor is None


def test_writer_partitions_rebuild_the_full_tensor(client: StoreClient) -> None:
    key, partial = fresh("wp"), fresh("wp-partial")
    whole = torch.arange(16, dtype=torch.int64).reshape(4, 4)
    puts = [tp.ParallelPut(key, whole, writer_partition=tp.WriterPartition(r, 4, 0)) for r in range(4)]
    puts.append(tp.ParallelPut(partial, whole, writer_partition=tp.WriterPartition(0, 2, 1)))
    assert tp.put_with_parallelism(client, puts, t.PutOptions()) == [None] * 5
    full, shard, missing = tp.get_with_parallelism(
        client, [key, key, partial], [tp.ReadTarget("full"), _shard(_axis("tp", 2, 4, 0)), tp.ReadTarget("full")]
    )
    assert same(full.value(), whole) and same(shard.value(), whole[2:3])
    assert missing.tensor is None and missing.error is None  # one of two partitions: a miss
    assert tp.get_with_parallelism(client, [key], [tp.AS_STORED])[0].tensor is None


def test_a_shard_is_cut_from_the_full_tensor_into_a_buffer(client: StoreClient) -> None:
    key = fresh("cut")
    whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t.put_tensor(client, key, whole)
    buffer = bytearray(HEADER_BYTES + 24)
    got = tp.get_with_parallelism(client, [key], [_shard(_axis("tp", 1, 2, 1))], [buffer])[0].value()
    assert got is not None and torch.equal(got, whole[:, 2:])
    got.fill_(-1.0)  # the shard was written into `buffer` as an object: `got` is a view of it
    assert torch.equal(t.tensor_in(buffer), torch.full((3, 2), -1.0))


def test_layout_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        tp.ParallelAxis("xp", 0, 2)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        tp.ParallelAxis("tp", 2, 2)
    with pytest.raises(InvalidArgument):
        tp.ReadTarget("shard")
    with pytest.raises(InvalidArgument):
        tp.ReadTarget("sideways")  # type: ignore[arg-type]
    both = tp.ParallelPut(
        "k", torch.ones(2), tp.TensorParallelism((_axis("tp", 0, 2, 0),)), tp.WriterPartition(0, 2, 0)
    )
    assert isinstance(tp.put_with_parallelism(None, [both], t.PutOptions())[0], InvalidArgument)  # type: ignore[arg-type]
