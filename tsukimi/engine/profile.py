"""`tsukimi profile`: measure this engine's prefill and decode step times on this machine and
fit the Conductor's cost model to them (tsukimi/scheduler/cost_model.py: `fit_linear`).

Prefill: forwards of `new` prompt tokens after `cached` tokens already in the cache; decode:
steps of `batch` sequences holding `context` tokens in total. Each point is the median of
`repeats` runs after one warm-up. The fitted coefficients (and the fit's worst relative error)
are what a router gives its Conductor for this model.
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
) -> ProfileResult:
    """Time the points and fit (see the module). Needs room for the largest point in the cache."""
    prefill = tuple(
        PrefillSample(new, cached, _median(lambda n=new, c=cached: _prefill_s(model, layout, n, c), repeats))
        for new, cached in prefill_points
    )
    decode = tuple(
        DecodeSample(batch, context, _median(lambda b=batch, t=context: _decode_s(model, layout, b, t), repeats))
        for batch, context in decode_points
    )
    fitted = fit_linear(prefill, decode, layout.block_bytes // layout.block_tokens)
    errors = [abs(fitted.prefill_s(s.new_tokens, s.cached_tokens) - s.seconds) / s.seconds for s in prefill]
    errors += [abs(fitted.decode_step_s(s.batch, s.context_tokens) - s.seconds) / s.seconds for s in decode]
    return ProfileResult(fitted, prefill, decode, max(errors))


def _median(run: object, repeats: int) -> float:
    assert callable(run)
    run()  # warm-up
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
