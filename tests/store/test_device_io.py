"""The store with device memory (device_io.py) through a live master and client, on the emulated
device (copies counted: one per direction plus one gather/scatter per batch, never one per
block) and, with `pytest -m gpu`, on CUDA tensors."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from tsukimi.config import MasterConfig
from tsukimi.device import EMULATED, DeviceRange, EmulatedDevice, EmulatedMemory
from tsukimi.errors import InvalidBufferError
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer

pytestmark = pytest.mark.timeout(90)
_ids = itertools.count()
BLOCK = 32 << 10


@pytest.fixture(scope="module")
def client() -> Iterator[StoreClient]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0))
    store = StoreClient.connect(master.endpoint, segment_bytes=320 << 20)
    yield store
    store.close()
    master.close()


@pytest.fixture
def emu() -> Iterator[list[EmulatedMemory]]:
    memories: list[EmulatedMemory] = []
    yield memories
    for memory in memories:
        memory.close()


def alloc(memories: list[EmulatedMemory], nbytes: int) -> EmulatedMemory:
    memory = EmulatedDevice(0).alloc(nbytes)
    memories.append(memory)
    return memory


def fresh(name: str) -> str:
    return f"{name}-{next(_ids)}"


def counts() -> dict[str, int]:
    return {k: EMULATED.stats[k] for k in ("copy", "gather", "scatter", "to_host", "from_host")}


def delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in counts().items() if v != before[k]}


@pytest.mark.parametrize("nbytes", [1, 4097, 3 << 20])
def test_one_object_round_trips_device_pool_device(client: StoreClient, emu: list[EmulatedMemory], nbytes: int) -> None:
    data = random.Random(nbytes).randbytes(nbytes)
    src, dst = alloc(emu, nbytes), alloc(emu, nbytes + 10)
    src.write(0, data)
    key = fresh("one")
    before = counts()
    client.put(key, src)
    assert delta(before) == {"to_host": 1}  # one range: no gather, one copy
    assert client.get(key) == data  # the pool holds the bytes
    before = counts()
    assert client.get_into(key, dst) == nbytes
    assert delta(before) == {"from_host": 1}
    assert dst.read(0, nbytes) == data and dst.read(nbytes, 10) == bytes(10)
    [result] = client.batch_get([key], [dst.range])
    assert result.found and result.size == nbytes and result.device == dst.range.sub(0, nbytes)
    assert result.value() is None  # not in host memory


def test_a_paged_cache_fills_in_one_copy_and_one_scatter(client: StoreClient, emu: list[EmulatedMemory]) -> None:
    num_blocks = 4096
    cache = alloc(emu, num_blocks * BLOCK)
    data = random.Random(5).randbytes(num_blocks * BLOCK)
    cache.write(0, data)
    picked = random.Random(6).sample(range(num_blocks), num_blocks)  # every block, shuffled
    keys = [fresh("blk") for _ in picked]
    blocks = [cache.range.sub(b * BLOCK, BLOCK) for b in picked]
    before = counts()
    assert client.batch_put(list(zip(keys, blocks, strict=True))) == [None] * num_blocks
    assert delta(before) == {"gather": 1, "to_host": 1}
    other = alloc(emu, num_blocks * BLOCK)
    targets = [other.range.sub(b * BLOCK, BLOCK) for b in picked]
    before = counts()
    results = client.batch_get(keys, targets)
    assert delta(before) == {"from_host": 1, "scatter": 1}
    assert all(r.found and r.size == BLOCK and r.error is None for r in results)
    assert other.read(0, num_blocks * BLOCK) == data


def test_mixed_host_and_device_batches(client: StoreClient, emu: list[EmulatedMemory]) -> None:
    cache = alloc(emu, 8 * BLOCK)
    cache.write(0, bytes(range(256)) * (8 * BLOCK // 256))
    host_value = b"host bytes" * 100
    keys = [fresh("mix") for _ in range(4)]
    items: list[tuple[str, object]] = [
        (keys[0], cache.range.sub(3 * BLOCK, BLOCK)),
        (keys[1], host_value),
        (keys[2], cache.range.sub(0, BLOCK)),
        (keys[3], cache.range.sub(5 * BLOCK, 100)),
    ]
    assert client.batch_put(items) == [None] * 4
    out = alloc(emu, 3 * BLOCK)
    host_out = bytearray(2000)
    dests: list[object] = [
        out.range.sub(0, BLOCK),
        host_out,
        out.range.sub(BLOCK, BLOCK),
        out.range.sub(2 * BLOCK, BLOCK),
    ]
    results = client.batch_get(keys, dests)
    assert [r.size for r in results] == [BLOCK, len(host_value), BLOCK, 100]
    assert bytes(host_out[: len(host_value)]) == host_value and results[1].device is None
    assert out.read(0, BLOCK) == cache.read(3 * BLOCK, BLOCK)
    assert out.read(BLOCK, BLOCK) == cache.read(0, BLOCK)
    assert out.read(2 * BLOCK, 100) == cache.read(5 * BLOCK, 100)
    assert out.read(2 * BLOCK + 100, 100) == bytes(100)  # past the object: untouched


def test_a_miss_and_a_destination_too_small_leave_the_device_untouched(
    client: StoreClient, emu: list[EmulatedMemory]
) -> None:
    key = fresh("small")
    client.put(key, b"x" * 1000)
    out = alloc(emu, 3000)
    out.write(0, b"\xee" * 3000)
    results = client.batch_get(
        [fresh("missing"), key, key], [out.range.sub(0, 1000), out.range.sub(1000, 999), out.range.sub(2000, 1000)]
    )
    assert not results[0].found and results[0].error is None
    assert isinstance(results[1].error, InvalidBufferError) and not results[1].found
    assert results[2].size == 1000
    assert out.read(0, 2000) == b"\xee" * 2000 and out.read(2000, 1000) == b"x" * 1000
    with pytest.raises(InvalidBufferError):
        client.get_into(key, out.range.sub(0, 10))


def test_batches_larger_than_the_staging_limit_are_cut(client: StoreClient, emu: list[EmulatedMemory]) -> None:
    from tsukimi.store.device_io import DeviceIO

    cache = alloc(emu, 16 * BLOCK)
    cache.write(0, random.Random(9).randbytes(16 * BLOCK))
    blocks = [cache.range.sub(i * BLOCK, BLOCK) for i in range(16)]
    keys = [fresh("cut") for _ in blocks]
    original = client.device
    client.device = DeviceIO(client._staging, max_staged_bytes=5 * BLOCK)
    try:
        before = counts()
        assert client.batch_put(list(zip(keys, blocks, strict=True))) == [None] * 16
        # 4 groups (5+5+5+1); the rows of each are one range: one copy each, no scratch
        assert delta(before) == {"to_host": 4}
        out = alloc(emu, 16 * BLOCK)
        results = client.batch_get(keys, [out.range.sub(i * BLOCK, BLOCK) for i in range(16)])
        assert all(r.size == BLOCK for r in results)
        assert out.read(0, 16 * BLOCK) == cache.read(0, 16 * BLOCK)
    finally:
        client.device = original


def test_device_ranges_are_taken_as_they_are(client: StoreClient, emu: list[EmulatedMemory]) -> None:
    memory = alloc(emu, 64)
    memory.write(0, b"r" * 64)
    key = fresh("range")
    client.put(key, DeviceRange(memory.device, memory.range.address, 64))
    assert client.get(key) == b"r" * 64


# -- CUDA (pytest -m gpu) -----------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_tensors_round_trip(client: StoreClient) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cache = torch.randint(0, 255, (512, BLOCK), dtype=torch.uint8, device="cuda")
    picked = random.Random(1).sample(range(512), 300)
    keys = [fresh("cuda") for _ in picked]
    assert client.batch_put([(k, cache[b]) for k, b in zip(keys, picked, strict=True)]) == [None] * 300
    out = torch.zeros_like(cache)
    results = client.batch_get(keys, [out[b] for b in picked])
    assert all(r.size == BLOCK for r in results)
    torch.cuda.synchronize()
    assert torch.equal(out[picked], cache[picked])
    one = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()  # NOTE: one range goes straight to the backend's copy: not ordered after torch
    key = fresh("cuda-one")
    client.put(key, one)
    back = torch.empty_like(one)
    assert client.get_into(key, back) == one.numel() * 4
    assert torch.equal(back, one)


def test_objects_in_parts_mix_host_headers_and_device_payloads(client: StoreClient, emu: list[EmulatedMemory]) -> None:
    payloads = alloc(emu, 4 * BLOCK)
    payloads.write(0, random.Random(11).randbytes(4 * BLOCK))
    keys = [fresh("parts") for _ in range(4)]
    items = [(k, [f"header-{i}".encode(), payloads.range.sub(i * BLOCK, BLOCK)]) for i, k in enumerate(keys)]
    before = counts()
    assert client.batch_put_parts(items) == [None] * 4
    assert delta(before) == {"to_host": 1}  # the payloads are adjacent: one range, one copy
    assert client.get(keys[2]) == b"header-2" + payloads.read(2 * BLOCK, BLOCK)
    out = alloc(emu, 4 * BLOCK)
    heads = [bytearray(8) for _ in keys]
    order = [3, 0, 2, 1]
    before = counts()
    results = client.batch_get_parts(keys, [[heads[i], out.range.sub(order[i] * BLOCK, BLOCK)] for i in range(4)])
    assert delta(before) == {"from_host": 1, "scatter": 1}
    assert all(r.found and r.size == 8 + BLOCK for r in results)
    assert [bytes(h) for h in heads] == [f"header-{i}".encode() for i in range(4)]
    for i in range(4):
        assert out.read(order[i] * BLOCK, BLOCK) == payloads.read(i * BLOCK, BLOCK)
    wrong = client.batch_get_parts(keys[:1], [[bytearray(8), out.range.sub(0, BLOCK - 1)]])
    assert isinstance(wrong[0].error, InvalidBufferError)


@pytest.mark.gpu
def test_cuda_tensors_through_the_tensor_api(client: StoreClient) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tsukimi.store import tensors as t

    values = [torch.randn(64, 128, device="cuda", dtype=torch.bfloat16), torch.arange(10, device="cuda")]
    values.append(torch.randn(16, 8, device="cuda").t())  # not contiguous: copied on the GPU first
    torch.cuda.synchronize()  # NOTE: the backend's copies are not ordered after torch's kernels
    keys = [fresh("tcuda") for _ in values]
    t.put_tensor(client, keys[0], values[0])
    assert t.batch_put_tensors(client, keys[1:], values[1:]) == [None, None]
    host = t.get_tensor(client, keys[0])
    assert host is not None and torch.equal(host, values[0].cpu())
    moved = t.get_tensor(client, keys[1], device="cuda")
    assert moved is not None and moved.device.type == "cuda" and torch.equal(moved, values[1])
    into = [torch.empty(v.shape, dtype=v.dtype, device="cuda") for v in values]
    got = [r.value() for r in t.batch_get_tensors(client, keys, into)]
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))
    flat = torch.empty(64 * 128 * 2, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    back = t.get_tensor_into(client, keys[0], flat)
    assert back is not None and back.shape == (64, 128) and torch.equal(back, values[0])


@pytest.mark.gpu
def test_cuda_vllm_layout_blocks_round_trip(client: StoreClient) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # vLLM's per-layer layout: [blocks, 2 (K|V), block_tokens, kv_heads, head_dim]; bf16 16x8x64x2x2 = 32 KiB
    layers = [torch.randn(256, 2, 16, 8, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    blocks = random.Random(3).sample(range(256), 100)
    keys = [fresh(f"vllm-{layer}-{b}") for b in blocks for layer in range(4)]
    views = [layers[layer][b] for b in blocks for layer in range(4)]
    assert client.batch_put(list(zip(keys, views, strict=True))) == [None] * len(keys)
    fresh_layers = [torch.zeros_like(layer) for layer in layers]
    torch.cuda.synchronize()
    dests = [fresh_layers[layer][b] for b in blocks for layer in range(4)]
    assert all(r.size == BLOCK for r in client.batch_get(keys, dests))
    for layer, back in zip(layers, fresh_layers, strict=True):
        assert torch.equal(back[blocks], layer[blocks])


def test_a_holders_segment_is_pinned_when_a_gpu_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    from tsukimi.device import CUDA
    from tsukimi.errors import DeviceError

    events: list[tuple[str, int]] = []

    def pin(view: memoryview) -> object:
        events.append(("pin", len(view)))
        return lambda: events.append(("unpin", len(view)))

    monkeypatch.setattr(CUDA, "available", lambda: True)
    monkeypatch.setattr(CUDA, "pin", pin)
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as master:
        with StoreClient.connect(master.endpoint, segment_bytes=4 << 20):
            assert events == [("pin", 4 << 20)]
        assert events == [("pin", 4 << 20), ("unpin", 4 << 20)]

        def refuse(view: memoryview) -> object:
            raise DeviceError("cuMemHostRegister failed: CUDA_ERROR_NOT_PERMITTED")

        monkeypatch.setattr(CUDA, "pin", refuse)
        with StoreClient.connect(master.endpoint, segment_bytes=4 << 20) as holder:
            holder.put(fresh("after-a-refused-pin"), b"still works")
