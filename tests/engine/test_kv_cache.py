"""The KV cache's block pool: a Hypothesis state machine against a model, with
`check_invariants()` after every step; and the byte views the KV pool moves."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tsukimi.engine.kv_cache import BlockPool, KVLayout, PagedKVCache, SequenceKV
from tsukimi.scheduler.block_hash import BlockHash

NUM_BLOCKS = 6


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.held: list[int] = []  # one entry per reference we hold
        self.cached: dict[int, int] = {}  # hash -> block, as the model remembers it

    @rule()
    def allocate(self) -> None:
        block = self.pool.allocate()
        in_use = len(set(self.held))
        if block is None:
            assert in_use == NUM_BLOCKS
            return
        assert block not in self.held
        for block_hash, cached in list(self.cached.items()):
            if cached == block:  # a recycled cached block forgets its hash
                del self.cached[block_hash]
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=st.integers(0, 5))
    def cache(self, data: st.DataObject, block_hash: int) -> None:
        block = data.draw(st.sampled_from(self.held))
        if block_hash not in self.cached and block not in self.cached.values():
            self.cached[block_hash] = block
        self.pool.cache(block, BlockHash(block_hash))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.held))
        self.held.remove(block)
        self.pool.release([block])

    @rule(hashes=st.lists(st.integers(0, 5), max_size=4))
    def lookup(self, hashes: list[int]) -> None:
        expected = []
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            expected.append(self.cached[block_hash])
        assert self.pool.lookup([BlockHash(h) for h in hashes]) == expected
        self.held += expected

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free == NUM_BLOCKS - len(set(self.held))


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_block_views_are_the_cache_memory() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=2)
    cache = PagedKVCache(layout, num_blocks=3)
    assert layout.block_bytes == 2 * 2 * 2 * 1 * 4 * 4 and layout.layer_bytes == layout.block_bytes // 2
    cache.kv[1, 1, 0, 0, 0, 0] = 2.5
    view = cache.layer_bytes(1, 1)
    assert torch.frombuffer(bytearray(view[:4]), dtype=torch.float32).item() == 2.5
    for layer in range(2):
        cache.slot(2, layer)[:] = cache.slot(1, layer)
    assert torch.equal(cache.kv[2], cache.kv[1])
    assert len(cache.slot(0, 0)) == layout.layer_bytes + 64  # K/V, then the KV pool's trailer
    seq = SequenceKV()
    assert cache.reserve(seq, 5) and len(seq.block_table) == 3
    seq.num_tokens = 5
    assert not cache.reserve(seq, 5)  # would need 2 more blocks: nothing taken
    assert len(seq.block_table) == 3 and cache.pool.num_free == 0
