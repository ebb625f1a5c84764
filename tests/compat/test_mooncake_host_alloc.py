"""`mooncake.store.MooncakeHostMemAllocator` on tsukimi: the wheel's answers (probed on
mooncake-transfer-engine-non-cuda 0.3.13.post1), and memory the store reads and writes."""

from __future__ import annotations

import ctypes

import pytest

from tsukimi.compat.mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
from tsukimi.store.master.server import MasterServer

MIB = 1 << 20


def test_alloc_and_free_answer_as_the_wheel() -> None:
    allocator = MooncakeHostMemAllocator()
    address = allocator.alloc(10)
    assert address % 4096 == 0
    ctypes.memset(address, 7, 10)  # writable
    assert ctypes.string_at(address, 10) == b"\x07" * 10
    assert allocator.free(address) == 0
    assert allocator.free(address) == -1  # freed already
    assert allocator.free(12345) == -1  # never handed out
    with pytest.raises(RuntimeError):
        allocator.alloc(0)
    with pytest.raises(TypeError):
        allocator.alloc(-1)


@pytest.mark.timeout(60)
def test_the_store_puts_from_and_gets_into_allocated_memory(master: MasterServer) -> None:
    allocator = MooncakeHostMemAllocator()
    source, target = allocator.alloc(MIB), allocator.alloc(MIB)
    ctypes.memset(source, 3, MIB)
    store = MooncakeDistributedStore()
    address = master.endpoint.removeprefix("tcp://")
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 4 * MIB, "tcp", "", address) == 0
    try:
        assert store.register_buffer(source, MIB) == 0 and store.register_buffer(target, MIB) == 0
        assert store.put_from("page", source, MIB) == 0
        assert store.get_into("page", target, MIB) == MIB
        assert ctypes.string_at(target, MIB) == b"\x03" * MIB
        assert store.unregister_buffer(source) == 0 and store.unregister_buffer(target) == 0
    finally:
        store.close()
        assert allocator.free(source) == 0 and allocator.free(target) == 0
