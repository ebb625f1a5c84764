"""Mooncake's zero-copy store calls with DEVICE pointers (what SGLang's and vLLM's Mooncake
store connectors pass): register_buffer, put_from / get_into, their batches and the
multi-buffer calls, on the emulated device (its copies counted: staged, never a host view over
device memory) and, with `pytest -m gpu`, on CUDA memory."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tsukimi.compat.mooncake.store import MooncakeDistributedStore
from tsukimi.device import EMULATED, EmulatedDevice, EmulatedMemory
from tsukimi.store.master.server import MasterServer

pytestmark = [pytest.mark.timeout(60)]
MIB = 1 << 20
BLOCK = 16 << 10


@pytest.fixture
def store(master: MasterServer) -> Iterator[MooncakeDistributedStore]:
    facade = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert facade.setup("localhost", "P2PHANDSHAKE", 64 * MIB, 4 * MIB, "tcp", "", address) == 0
    yield facade
    facade.close()


@pytest.fixture
def device() -> Iterator[EmulatedMemory]:
    with EmulatedDevice(0).alloc(64 * BLOCK) as memory:
        yield memory


def test_put_from_and_get_into_with_device_pointers(store: MooncakeDistributedStore, device: EmulatedMemory) -> None:
    base = device.range.address
    data = random.Random(1).randbytes(64 * BLOCK)
    device.write(0, data)
    assert store.register_buffer(base, 64 * BLOCK) == 0
    assert store.put_from("one", base + 3 * BLOCK, BLOCK) == 0
    assert store.get("one") == data[3 * BLOCK : 4 * BLOCK]
    blocks = [7, 1, 30, 2]
    keys = [f"b{b}" for b in blocks]
    before = EMULATED.stats["to_host"]
    assert store.batch_put_from(keys, [base + b * BLOCK for b in blocks], [BLOCK] * 4) == [0] * 4
    assert EMULATED.stats["to_host"] == before + 1  # the batch crossed in one copy
    with EmulatedDevice(0).alloc(8 * BLOCK) as out:
        ptrs = [out.range.address + i * BLOCK for i in range(4)]
        before = EMULATED.stats["from_host"]
        assert store.batch_get_into(keys, ptrs, [BLOCK] * 4) == [BLOCK] * 4
        assert EMULATED.stats["from_host"] == before + 1
        for i, b in enumerate(blocks):
            assert out.read(i * BLOCK, BLOCK) == data[b * BLOCK : (b + 1) * BLOCK]
        assert store.get_into("one", out.range.address + 4 * BLOCK, BLOCK) == BLOCK
        assert out.read(4 * BLOCK, BLOCK) == data[3 * BLOCK : 4 * BLOCK]
        assert store.get_into("missing", out.range.address, BLOCK) == -704
        assert store.get_into("one", out.range.address, BLOCK - 1) == -600  # too small
        assert out.read(0, BLOCK) == data[7 * BLOCK : 8 * BLOCK]  # untouched by both
        # a range that runs past its device allocation is refused, not read past
        assert store.get_into("one", out.range.address + 7 * BLOCK + 1, BLOCK) == -600
    assert store.unregister_buffer(base) == 0


def test_multi_buffer_calls_with_device_pointers(store: MooncakeDistributedStore, device: EmulatedMemory) -> None:
    base = device.range.address
    device.write(0, bytes(range(256)) * (64 * BLOCK // 256))
    host = bytearray(b"h" * 100)
    import ctypes

    host_ptr = ctypes.addressof((ctypes.c_char * 100).from_buffer(host))
    assert store.batch_put_from_multi_buffers(["m"], [[host_ptr, base + BLOCK]], [[100, BLOCK]]) == [0]
    assert store.get("m") == b"h" * 100 + device.read(BLOCK, BLOCK)
    with EmulatedDevice(0).alloc(BLOCK) as out:
        back = bytearray(100)
        back_ptr = ctypes.addressof((ctypes.c_char * 100).from_buffer(back))
        got = store.batch_get_into_multi_buffers(["m"], [[back_ptr, out.range.address]], [[100, BLOCK]])
        assert got == [100 + BLOCK]
        assert back == host and out.read(0, BLOCK) == device.read(BLOCK, BLOCK)


@pytest.mark.gpu
def test_cuda_pointers(store: MooncakeDistributedStore) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cache = torch.randint(0, 255, (64, BLOCK), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # NOTE: the backend's copies are not ordered after torch's kernels
    base = cache.data_ptr()
    assert store.register_buffer(base, cache.numel()) == 0
    keys = [f"c{i}" for i in range(0, 64, 3)]
    ptrs = [base + i * BLOCK for i in range(0, 64, 3)]
    assert store.batch_put_from(keys, ptrs, [BLOCK] * len(keys)) == [0] * len(keys)
    out = torch.zeros_like(cache)
    torch.cuda.synchronize()
    got = store.batch_get_into(keys, [out.data_ptr() + i * BLOCK for i in range(0, 64, 3)], [BLOCK] * len(keys))
    assert got == [BLOCK] * len(keys)
    assert torch.equal(out[::3], cache[::3])


def test_range_reads_into_a_device_buffer_are_refused(store: MooncakeDistributedStore, device: EmulatedMemory) -> None:
    assert store.put("r", b"abcdef") == 0
    base = device.range.address
    assert store.register_buffer(base, 64 * BLOCK) == 0
    before = dict(EMULATED.stats)
    assert store.get_into_ranges([base], [["r"]], [[[0]]], [[[1]]], [[[3]]]) == [[[-600]]]
    assert dict(EMULATED.stats) == before and device.read(0, 3) == bytes(3)
