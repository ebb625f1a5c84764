"""`tsukimi profile`: measure this engine's prefill and decode step times on this machine and
fit the Conductor's cost model to them (tsukimi/scheduler/cost_model.py: `fit_linear`).

Prefill: forwards of `new` prompt tokens after `cached` tokens already in the cache; decode:
steps of `batch` sequences holding `context` tokens in total. Each point is the median of
`repeats` runs after one warm-up. The fitted coefficients (and the fit's worst relative error)
are what a router gives its Conductor for this model.

`startup_profile` is the short version a worker runs on itself before it reports healthy
(tsukimi/serving/worker.py): a few prefill sizes within its `max_batched_tokens` (one after as
many cached tokens, for the attention term) and a few decode batches, one warm-up forward in
all, so that the router's Conductor estimates with this machine's numbers (GET /health).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tsukimi.engine.engine import Model
from tsukimi.engine.kv_cache import BatchAttention, KVLayout, PagedKVCache, SequenceKV
from tsukimi.scheduler.cost_model import DecodeSample, LinearCostModel, PrefillSample, fit_linear


@dataclass(frozen=True, slots=True)
class ProfileResult:
    model: LinearCostModel
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    max_relative_error: float

    def as_dict(self) -> dict[str, object]:
        return {
            "prefill_coef": list(self.model.prefill_coef),
            "decode_coef": list(self.model.decode_coef),
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "max_relative_error": round(self.max_relative_error, 4),
            "prefill_samples": [asdict(s) for s in self.prefill],
            "decode_samples": [asdict(s) for s in self.decode],
        }


def profile(
    model: Model,
    layout: KVLayout,
    prefill_points: tuple[tuple[int, int], ...] = ((16, 0), (64, 0), (256, 0), (64, 256), (256, 256), (512, 0)),
    decode_points: tuple[tuple[int, int], ...] = ((1, 128), (4, 512), (8, 2048), (16, 1024), (16, 4096)),
    repeats: int = 3,
    warm_each: bool = True,
) -> ProfileResult:
    """Time the points and fit (see the module). `warm_each`: a warm-up run before each point
    (else none: the caller warmed up). Needs room for the largest point in the cache."""
    prefill = tuple(
        PrefillSample(new, cached, _median(lambda n=new, c=cached: _prefill_s(model, layout, n, c), repeats, warm_each))
        for new, cached in prefill_points
    )
    decode = tuple(
        DecodeSample(
            batch, context, _median(lambda b=batch, t=context: _decode_s(model, layout, b, t), repeats, warm_each)
        )
        for batch, context in decode_points
    )
    fitted = fit_linear(prefill, decode, layout.block_bytes // layout.block_tokens)
    errors = [abs(fitted.prefill_s(s.new_tokens, s.cached_tokens) - s.seconds) / s.seconds for s in prefill]
    errors += [abs(fitted.decode_step_s(s.batch, s.context_tokens) - s.seconds) / s.seconds for s in decode]
    return ProfileResult(fitted, prefill, decode, max(errors))


def startup_profile(
    model: Model, layout: KVLayout, max_batched_tokens: int, repeats: int = 2, budget_s: float = 2.0
) -> ProfileResult:
    """The worker's start-up profile (see the module): prefills of 1/8, 1/2 and all of `top`
    tokens (and 1/2 after as many cached), decode steps of 1 to 16 sequences; the median of
    `repeats` each. `top` is `max_batched_tokens`, or less (and one run per point) where a
    64-token warm-up says the prefills would take over `budget_s`: about 0.4 s for the tiny model
    at 512 tokens, 3-4 s for SmolLM2 on one thread of this machine."""
    _prefill_s(model, layout, 64, 0)  # NOTE: the warm-up, and the per-token time at hand
    per_token_s = _prefill_s(model, layout, 64, 0) / 64
    top = max(8, max_batched_tokens)
    if 2.5 * top * repeats * per_token_s > budget_s:  # NOTE: the points below hold ~2.1 x top tokens
        repeats = 1
        top = max(64, min(top, int(budget_s / (2.5 * per_token_s))))
    half = max(4, top // 2)
    prefill = ((max(2, top // 8), 0), (half, 0), (top, 0), (half, half))
    decode = ((1, 64), (4, 512), (8, 2048), (16, 1024))
    return profile(model, layout, prefill, decode, repeats, warm_each=False)


def _median(run: object, repeats: int, warm: bool = True) -> float:
    assert callable(run)
    if warm:
        run()
    return statistics.median(float(run()) for _ in range(repeats))


def _cache(layout: KVLayout, tokens: int) -> PagedKVCache:
    return PagedKVCache(layout, -(-tokens // layout.block_tokens) + 2)


def _prefill_s(model: Model, layout: KVLayout, new: int, cached: int) -> float:
    cache = _cache(layout, new + cached)
    seq = SequenceKV()
    assert cache.reserve(seq, new + cached)
    seq.num_tokens = cached  # the cached part's values do not matter for timing
    ids = torch.randint(3, 200, (new,), generator=torch.Generator().manual_seed(new))
    attend = BatchAttention(cache, [(seq, new)])
    start = time.perf_counter()
    with torch.inference_mode():
        model.logits(model.forward(ids, torch.arange(cached, cached + new), attend)[-1:])
    return time.perf_counter() - start


def _decode_s(model: Model, layout: KVLayout, batch: int, context: int) -> float:
    per_seq = max(1, context // batch)
    cache = _cache(layout, batch * (per_seq + 1) + batch * layout.block_tokens)
    seqs = []
    for _ in range(batch):
        seq = SequenceKV()
        assert cache.reserve(seq, per_seq + 1)
        seq.num_tokens = per_seq
        seqs.append(seq)
    attend = BatchAttention(cache, [(seq, 1) for seq in seqs])
    ids = torch.full((batch,), 5, dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        model.logits(model.forward(ids, torch.full((batch,), per_seq, dtype=torch.long), attend))
    return time.perf_counter() - start
