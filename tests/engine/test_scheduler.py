"""The engine's scheduler and block bookkeeping with a tiny float64 model (fast, no weights):
the exact batches a step computes (chunks, filled and published blocks, sampling), the exact
preemption choice, and a Hypothesis state machine of adds, aborts and steps that checks the
queues, the blocks and the hash chains after every step and every finished request's tokens
against a dense, cache-free reference."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tsukimi.engine.block_manager import FilledBlock
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout, PagedKVCache
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.scheduler import ScheduledRequest
from tsukimi.errors import InvalidArgument
from tsukimi.scheduler.block_hash import BlockHash, hash_blocks

VOCAB, LAYERS, DIM = 32, 2, 4
BASES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [3, 1, 4, 1, 6, 6, 6, 6, 6, 6]]


class TinyModel:
    """Two layers of one-head attention over random embeddings (float64: no near-ties)."""

    def __init__(self) -> None:
        self.embed = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.batch_tokens: list[int] = []  # tokens per forward

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: object) -> torch.Tensor:
        assert callable(attend)
        self.batch_tokens.append(len(token_ids))
        x = self.embed[token_ids] + 0.1 * positions[:, None].double()
        for layer in range(LAYERS):
            q = x[:, None, :]
            x = x + attend(layer, q, q * (layer + 1), torch.tanh(q))[:, 0, :]
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.embed.T


def _dense(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def reference(prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens, the whole sequence recomputed for each one (no KV cache)."""
    model, tokens = TinyModel(), list(prompt)
    for _ in range(num_tokens):
        hidden = model.forward(torch.tensor(tokens), torch.arange(len(tokens)), _dense)
        tokens.append(int(model.logits(hidden[-1]).argmax()))
    return tokens[len(prompt) :]


class DictPool:
    """A `KVConnector` over a dict: hash -> the block's KV (all layers), kept at the last layer."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, torch.Tensor] = {}
        self.saves: list[tuple[int, list[BlockHash], list[int]]] = []

    def load(self, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> int:
        loaded = 0
        for block_hash, block in zip(hashes, blocks, strict=False):
            if block_hash not in self.blocks:
                break
            cache.kv[block] = self.blocks[block_hash]
            loaded += 1
        return loaded

    def save_layer(self, layer: int, hashes: Sequence[BlockHash], blocks: Sequence[int], cache: PagedKVCache) -> None:
        self.saves.append((layer, list(hashes), list(blocks)))
        if layer == LAYERS - 1:
            for block_hash, block in zip(hashes, blocks, strict=True):
                self.blocks.setdefault(block_hash, cache.kv[block].clone())

    def flush(self) -> None:
        pass


def _engine(block_tokens: int, num_blocks: int, budget: int, pool: DictPool | None = None) -> LLMEngine:
    layout = KVLayout(LAYERS, 1, DIM, block_tokens, dtype=torch.float64)
    return LLMEngine(TinyModel(), layout, num_blocks, (), budget, pool)


def _step(engine: LLMEngine) -> tuple[list[ScheduledRequest], list[int | None]]:
    """One step, by hand: schedule -> run -> postprocess; the batch and its tokens."""
    batch = engine.scheduler.schedule()
    tokens = engine.runner.run(batch)
    engine.scheduler.postprocess(batch, tokens)
    return list(batch.requests), tokens


def test_a_chunked_prompt_fills_caches_and_publishes_exactly_its_full_prompt_blocks() -> None:
    pool = DictPool()
    engine = _engine(block_tokens=4, num_blocks=8, budget=6, pool=pool)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    out = reference(prompt, 3)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    h0, h1, h2 = hash_blocks([*prompt, out[0], out[1]], 4)
    request = engine.scheduler.waiting[0]
    steps = [_step(engine) for _ in range(4)]
    # NOTE: admission took blocks 0 and 1 for the pool's copies, found none and gave them back in
    # order, so the free list hands them out as 1, 0
    expected = [  # (start, tokens, filled, published, samples), then the sampled token
        ((0, (1, 2, 3, 4, 5, 6), (FilledBlock(h0, 1),), 1, False), None),
        ((6, (7, 8, 9, 10), (FilledBlock(h1, 0),), 1, True), out[0]),
        ((10, (out[0],), (), 0, True), out[1]),
        ((11, (out[1],), (FilledBlock(h2, 2),), 0, True), out[2]),  # an output block: cached, not published
    ]
    for (entries, tokens), (fields, token) in zip(steps, expected, strict=True):
        assert [(e.start, e.token_ids, e.filled, e.num_published, e.samples) for e in entries] == [fields]
        assert entries[0].request is request and tokens == [token]
    assert engine.model.batch_tokens == [6, 4, 1, 1]  # type: ignore[attr-defined]
    assert [(layer, hashes, blocks) for layer, hashes, blocks in pool.saves] == [
        (0, [h0], [1]),
        (1, [h0], [1]),
        (0, [h1], [0]),
        (1, [h1], [0]),
    ]
    assert not engine.has_work() and engine.cache.pool.lookup([h0, h1, h2]) == [1, 0, 2]


def test_a_full_cache_preempts_the_newest_running_request_to_the_front_of_the_queue() -> None:
    engine = _engine(block_tokens=2, num_blocks=4, budget=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    for _ in range(2):  # prefill both, then one decode each: 2 blocks each, all 4 in use
        assert [e.request.request_id for e in _step(engine)[0]] == ["a", "b"]
    engine.add_request("c", [7], params)
    entries, _ = _step(engine)  # a needs a 3rd block: b gives its blocks back and waits first
    scheduler = engine.scheduler
    assert [(e.request.request_id, e.start, e.num_tokens) for e in entries] == [("a", 4, 1)]
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    # b released tail first: its idle tail block 3 was recycled for a, its head block 2 stays cached
    assert scheduler.running[0].seq.block_table == [0, 1, 3]
    assert engine.cache.pool.lookup(hash_blocks([4, 5], 2)) == [2]
    engine.cache.pool.release([2])
    results: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    while engine.has_work():
        for out in engine.step():
            results[out.request_id] += out.token_ids
    assert results == {"a": reference([1, 2, 3], 4)[3:], "b": reference([4, 5, 6], 4)[2:], "c": reference([7], 4)}
    engine.cache.pool.check_invariants()
    scheduler.check_invariants()


REQUESTS = st.tuples(  # (shared base, its tokens kept, a tail, max_tokens)
    st.sampled_from(BASES), st.integers(1, 10), st.lists(st.integers(0, VOCAB - 1), max_size=2), st.integers(1, 5)
)


class EngineMachine(RuleBasedStateMachine):
    """Random adds, aborts and steps; exact state checked after each."""

    @initialize(
        block_tokens=st.integers(1, 4),
        num_blocks=st.integers(4, 16),
        budget=st.integers(1, 12),
        pool=st.booleans(),
        prefix_caching=st.booleans(),
    )
    def start(self, block_tokens: int, num_blocks: int, budget: int, pool: bool, prefix_caching: bool) -> None:
        layout = KVLayout(LAYERS, 1, DIM, block_tokens, dtype=torch.float64)
        self.model, self.budget = TinyModel(), budget
        connector = DictPool() if pool else None
        self.engine = LLMEngine(self.model, layout, num_blocks, (), budget, connector, prefix_caching=prefix_caching)
        self.expected: dict[str, list[int]] = {}  # live requests' full greedy outputs
        self.produced: dict[str, list[int]] = {}
        self.num_added = 0

    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=3))
    def add(self, requests: list[tuple[list[int], int, list[int], int]]) -> None:
        for base, length, tail, max_tokens in requests:
            prompt, name = base[:length] + tail, f"r{self.num_added}"
            self.num_added += 1
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            num_blocks = -(-(len(prompt) + max_tokens) // self.engine.cache.layout.block_tokens)
            if num_blocks > self.engine.cache.pool.num_blocks:
                with pytest.raises(InvalidArgument, match="exceed the KV cache"):
                    self.engine.add_request(name, prompt, params)
                continue
            self.engine.add_request(name, prompt, params)
            self.expected[name], self.produced[name] = reference(prompt, max_tokens), []

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.expected)))
        self.engine.abort(name)
        del self.expected[name], self.produced[name]
        assert name not in self.engine.scheduler

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._step()

    def _step(self) -> None:
        forwards = len(self.model.batch_tokens)
        had_work = self.engine.has_work()
        outputs = self.engine.step()
        assert len(self.model.batch_tokens) == forwards + had_work  # work always makes progress
        assert not had_work or 1 <= self.model.batch_tokens[-1] <= self.budget
        for out in outputs:
            self.produced[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                assert out.finish_reason == "length"
                assert self.produced.pop(out.request_id) == self.expected.pop(out.request_id)
        assert set(self.expected) == {
            r.request_id for r in [*self.engine.scheduler.waiting, *self.engine.scheduler.running]
        }

    @invariant()
    def consistent(self) -> None:
        engine, scheduler = self.engine, self.engine.scheduler
        engine.cache.pool.check_invariants()
        scheduler.check_invariants()
        held = {block for r in scheduler.running for block in r.seq.block_table}
        assert engine.cache.pool.num_free == engine.cache.pool.num_blocks - len(held)  # nobody else holds blocks
        bt = engine.cache.layout.block_tokens
        for request in scheduler.running:
            assert request.output == self.produced[request.request_id]
            full = request.seq.num_tokens // bt if engine.prefix_caching else 0
            assert request.hashes == hash_blocks(request.tokens[: full * bt], bt)


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None, derandomize=True)
