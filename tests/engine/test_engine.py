"""The paged, continuously batched engine against the slow reference (greedy, the tiny model):
batching, chunked prefill, prefix caching, preemption, sampling and stopping."""

from __future__ import annotations

import pytest

from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.model import generate_greedy_reference
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel
from tsukimi.errors import InvalidArgument

PROMPTS = [[1, 5, 9, 200, 3000] * 7, [1, 7, 7, 100], [1, 5, 9, 200, 3000] * 7 + [42, 43], [1, *range(300, 360)]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny: LoadedModel) -> list[list[int]]:
    return [list(generate_greedy_reference(tiny.model, p, GREEDY.max_tokens)) for p in PROMPTS]


def _engine(tiny: LoadedModel, block_tokens: int = 16, num_blocks: int = 256, batch: int = 512) -> LLMEngine:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_tokens)
    return LLMEngine(tiny.model, layout, num_blocks, cfg.eos_token_ids, max_batched_tokens=batch)


@pytest.mark.parametrize(("block_tokens", "batch"), [(16, 512), (16, 24), (1, 512), (7, 10)])
def test_batched_paged_and_chunked_equal_the_reference(
    tiny: LoadedModel, expected: list[list[int]], block_tokens: int, batch: int
) -> None:
    engine = _engine(tiny, block_tokens, batch=batch)
    assert engine.generate(PROMPTS, GREEDY) == expected
    engine.cache.pool.check_invariants()


def test_a_shared_prefix_is_computed_once(tiny: LoadedModel, expected: list[list[int]]) -> None:
    engine = _engine(tiny)
    assert engine.generate(PROMPTS[:1], GREEDY) == expected[:1]
    engine.add_request("again", PROMPTS[2], GREEDY)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [t for o in outputs for t in o.token_ids] == expected[2]
    assert outputs[0].cached_tokens == 32  # two full 16-token blocks of the 35-token shared prefix
    engine.cache.pool.check_invariants()


def test_a_full_cache_preempts_and_still_gives_the_same_tokens(tiny: LoadedModel, expected: list[list[int]]) -> None:
    engine = _engine(tiny, block_tokens=4, num_blocks=24)  # not enough for all four at once
    assert engine.generate(PROMPTS, GREEDY) == expected
    engine.cache.pool.check_invariants()


def test_sampling_is_reproducible_and_stops(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    hot = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first, second = engine.generate([PROMPTS[1], PROMPTS[1]], hot)
    assert first == second and len(first) == 12
    greedy = engine.generate([PROMPTS[1]], GREEDY)[0]
    stop_at = greedy[3]
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=10, stop_token_ids=(stop_at,)))[0]
    assert stopped == greedy[: greedy.index(stop_at)]  # the stop token itself is not emitted


def test_bad_requests_are_refused(tiny: LoadedModel) -> None:
    engine = _engine(tiny, num_blocks=4)
    with pytest.raises(InvalidArgument):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidArgument, match="exceed the KV cache"):
        engine.add_request("huge", list(range(1, 100)), GREEDY)
    engine.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidArgument, match="already running"):
        engine.add_request("a", [1, 2, 3], GREEDY)
    engine.abort("a")
    assert not engine.has_work()
    engine.cache.pool.check_invariants()
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        with pytest.raises(InvalidArgument):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_prefix_caching_off_computes_every_prompt(tiny: LoadedModel, expected: list[list[int]]) -> None:
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16)
    engine = LLMEngine(tiny.model, layout, 256, cfg.eos_token_ids, prefix_caching=False)
    assert engine.generate(PROMPTS[:1], GREEDY) == expected[:1]
    engine.add_request("again", PROMPTS[0], GREEDY)
    first = engine.step()
    assert first[0].cached_tokens == 0
    while engine.has_work():
        engine.step()
    engine.cache.pool.check_invariants()


def test_regression_a_waiting_request_never_holds_blocks_a_running_one_needs(tiny: LoadedModel) -> None:
    """The review's livelock: a waiting request admitted with cached blocks, then unable to
    reserve more, kept them while the only running request waited for a block for ever."""
    engine = _engine(tiny, block_tokens=4, num_blocks=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    engine.generate([prompt], SamplingParams(max_tokens=1))  # 2 cached blocks left idle
    engine.add_request("a", [9, 10, 11, 12, 13], SamplingParams(max_tokens=11, ignore_eos=True))
    engine.step()
    engine.add_request("b", [*prompt, 99], SamplingParams(max_tokens=2, ignore_eos=True))
    produced = {"a": 0, "b": 0}
    for _ in range(200):
        if not engine.has_work():
            break
        for out in engine.step():
            produced[out.request_id] += len(out.token_ids)
    assert produced == {"a": 10, "b": 2} and not engine.has_work()
    engine.cache.pool.check_invariants()


def test_blocks_are_released_tail_first(tiny: LoadedModel) -> None:
    """Evicting one idle block must cost a chain its tail, not its head."""
    engine = _engine(tiny, block_tokens=4, num_blocks=6)
    prompt = list(range(1, 22))  # 5 full blocks + 1 token
    engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.generate([[500, 501, 502, 503, 504]], SamplingParams(max_tokens=1))  # takes 2 blocks: 1 evicted
    engine.add_request("again", prompt, SamplingParams(max_tokens=1))
    assert engine.step()[0].cached_tokens == 16  # 4 of the 5 blocks are still reachable


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 1e-9}, {"temperature": -0.1}, {"top_p": 1e-9}, {"top_p": 0.0}, {"seed": 2**63}, {"seed": -1}],
)
def test_sampling_params_refuse_values_that_would_fail_on_the_engine_thread(fields: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**fields)  # type: ignore[arg-type]
    SamplingParams(temperature=1e-6, top_p=1e-6, seed=2**63 - 1)  # the edges are fine
