"""`tsukimi profile`: measure this engine's prefill and decode step times on this machine and
fit the Conductor's cost model to them (tsukimi/scheduler/cost_model.py: `fit_linear`).

Prefill: forwards of `new` prompt tokens after `cached` tokens already in the cache; decode:
steps of `batch` sequences holding `context` tokens in total. Each point is the median of
`repeats` runs after one warm-up. The fitted coefficients (and the fit's worst relative error)
are what a router gives its Conductor for this model.

`startup_profile` is the short version a worker runs on itself before it reports healthy
(tsukimi/serving/worker/server.py): a few prefill sizes within its `max_batched_tokens` (one after as
many cached tokens, for the attention term) and a few decode batches, one warm-up forward in
all, so that the router's Conductor estimates with this machine's numbers (GET /health).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tsukimi.engine.device import CPU, synchronize
from tsukimi.engine.engine import Model
from tsukimi.engine.kv_cache import BatchAttention, KVLayout, PagedKVCache, SequenceKV
from tsukimi.scheduler.cost_model import DecodeSample, LinearCostModel, PrefillSample, fit_linear

Timer = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Timing:
    """How each point is timed: `warm_each`: one warm-up run before it (else none: the caller
    warmed up); `best_of`: its fastest run, not the median (other jobs only ever add time);
    `cpu`: by the calling thread's CPU time (time.thread_time), not the wall clock: what the
    engine itself costs, whatever else this machine runs meanwhile (right for one torch thread,
    whose forward runs on the calling thread)."""

    warm_each: bool = True
    best_of: bool = False
    cpu: bool = False

    def seconds(self, run: Callable[[Timer], float], repeats: int) -> float:
        timer = time.thread_time if self.cpu else time.perf_counter
        if self.warm_each:
            run(timer)
        times = [run(timer) for _ in range(repeats)]
        return min(times) if self.best_of else statistics.median(times)


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
    timing: Timing = Timing(),
    device: torch.device = CPU,
) -> ProfileResult:
    """Time the points and fit (see the module and `Timing`). Needs room for the largest point
    in the cache, on `device` (the model's)."""
    prefill = tuple(
        PrefillSample(
            new,
            cached,
            timing.seconds(functools.partial(_prefill_s, model, layout, new, cached, device=device), repeats),
        )
        for new, cached in prefill_points
    )
    decode = tuple(
        DecodeSample(
            batch,
            context,
            timing.seconds(functools.partial(_decode_s, model, layout, batch, context, device=device), repeats),
        )
        for batch, context in decode_points
    )
    fitted = fit_linear(prefill, decode, layout.block_bytes // layout.block_tokens)
    errors = [abs(fitted.prefill_s(s.new_tokens, s.cached_tokens) - s.seconds) / s.seconds for s in prefill]
    errors += [abs(fitted.decode_step_s(s.batch, s.context_tokens) - s.seconds) / s.seconds for s in decode]
    return ProfileResult(fitted, prefill, decode, max(errors))


def startup_profile(
    model: Model,
    layout: KVLayout,
    max_batched_tokens: int,
    repeats: int = 3,
    budget_s: float = 2.0,
    cpu: bool = True,
    device: torch.device = CPU,
) -> ProfileResult:
    """The worker's start-up profile (see the module): prefills of 1/8, 1/2 and all of `top`
    tokens, and of 1/2 and all after `top` and 2 x `top` cached (a long prompt's later chunks),
    decode steps of 1 to 16 sequences over up to 8k tokens; each point's fastest of `repeats`.
    `top` is `max_batched_tokens`, with fewer repeats (down to 1) and then a smaller `top` where
    a 64-token warm-up says the prefills would take over `budget_s`: about 1 s for the tiny
    model at 512 tokens, 3-4 s for SmolLM2 on one thread of this machine. `cpu`: time by CPU
    time (`Timing`; the worker does with one torch thread): the engine's own cost, while the
    worker's online slowdown (tsukimi/engine/step_meter.py) measures what the machine's load
    adds; never on a GPU, whose kernels run off this thread. `device`: the model's."""
    timer = time.thread_time if cpu else time.perf_counter
    _prefill_s(model, layout, 64, 0, timer, device)  # NOTE: the warm-up, and the per-token time at hand
    per_token_s = _prefill_s(model, layout, 64, 0, timer, device) / 64
    top = max(8, max_batched_tokens)
    pass_s = 4.0 * top * per_token_s  # NOTE: the points hold 3.1 x top tokens, and attention on top
    repeats = max(1, min(repeats, int(budget_s / pass_s)))
    if repeats * pass_s > budget_s:
        top = max(64, int(top * budget_s / pass_s))
    half = max(4, top // 2)
    prefill = ((max(2, top // 8), 0), (half, 0), (top, 0), (half, top), (top, 2 * top))
    decode = ((1, 64), (4, 512), (8, 2048), (16, 1024), (8, 8192))
    return profile(model, layout, prefill, decode, repeats, Timing(warm_each=False, best_of=True, cpu=cpu), device)


def _cache(layout: KVLayout, tokens: int, device: torch.device) -> PagedKVCache:
    return PagedKVCache(layout, -(-tokens // layout.block_tokens) + 2, device=device)


def _timed(model: Model, ids: torch.Tensor, positions: torch.Tensor, attend: BatchAttention, timer: Timer) -> float:
    """Seconds of one forward and its last row's logits, the device synchronized on both sides
    (a CUDA kernel returns before it runs)."""
    synchronize(ids.device)
    start = timer()
    with torch.inference_mode():
        model.logits(model.forward(ids, positions, attend)[-1:])
    synchronize(ids.device)
    return timer() - start


def _prefill_s(
    model: Model,
    layout: KVLayout,
    new: int,
    cached: int,
    timer: Timer = time.perf_counter,
    device: torch.device = CPU,
) -> float:
    cache = _cache(layout, new + cached, device)
    seq = SequenceKV()
    assert cache.reserve(seq, new + cached)
    seq.num_tokens = cached  # the cached part's values do not matter for timing
    ids = torch.randint(3, 200, (new,), generator=torch.Generator().manual_seed(new)).to(device)
    attend = BatchAttention(cache, [(seq, new)])
    return _timed(model, ids, torch.arange(cached, cached + new, device=device), attend, timer)


def _decode_s(
    model: Model,
    layout: KVLayout,
    batch: int,
    context: int,
    timer: Timer = time.perf_counter,
    device: torch.device = CPU,
) -> float:
    per_seq = max(1, context // batch)
    cache = _cache(layout, batch * (per_seq + 1) + batch * layout.block_tokens, device)
    seqs = []
    for _ in range(batch):
        seq = SequenceKV()
        assert cache.reserve(seq, per_seq + 1)
        seq.num_tokens = per_seq
        seqs.append(seq)
    attend = BatchAttention(cache, [(seq, 1) for seq in seqs])
    ids = torch.full((batch,), 5, dtype=torch.long, device=device)
    return _timed(model, ids, torch.full((batch,), per_seq, dtype=torch.long, device=device), attend, timer)
