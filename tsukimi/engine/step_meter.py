"""How much slower the engine's steps run than its start-up profile predicts, measured online.

A worker fits a `LinearCostModel` to itself when it starts (tsukimi/engine/profile.py), on
however busy the machine was then. `MeteredRunner` times every forward of the engine and
`StepMeter` keeps, per kind of step, the ratio of the measured seconds to the predicted ones,
both summed over the recent steps with a decay of DECAY per step (so long steps weigh by their
length: a short one's fixed overheads do not swing it), from a prior of PRIOR_S at ratio 1:

    prefill_slowdown   steps computing at least MIN_PREFILL_TOKENS prompt tokens
    decode_slowdown    steps computing decode tokens only

The worker reports both in GET /load; the router scales its Conductor's cost model with them,
so its estimates follow a machine that got busier (or quieter) since the profile. The cost on
the engine's hot path: two clock reads and one pass over the step's entries.
"""

from __future__ import annotations

import time

from tsukimi.engine.block_manager import KVConnector
from tsukimi.engine.device import synchronize
from tsukimi.engine.kv_cache import PagedKVCache
from tsukimi.engine.layer_loading import LayerLoader
from tsukimi.engine.model_runner import Model, ModelRunner
from tsukimi.engine.scheduler import ScheduledBatch
from tsukimi.scheduler.cost_model import LinearCostModel, attention_pairs

MIN_PREFILL_TOKENS = 32  # NOTE: shorter chunks are dominated by the fixed per-step cost
DECAY = 0.8  # per step: the last ~5 steps count
PRIOR_S = 0.1  # predicted seconds of steps "seen" at ratio 1 before any is measured
RATIO_BOUNDS = (0.1, 10.0)  # one odd step (a GC pause, a page fault storm) counts as this much at most


class StepMeter:
    """The running slowdowns of one engine against `model` (written by the engine thread, read
    by the HTTP side: each is one float, replaced whole)."""

    def __init__(self, model: LinearCostModel) -> None:
        self.model = model
        self.prefill_slowdown = 1.0
        self.decode_slowdown = 1.0
        self._sums = {"prefill": [PRIOR_S, PRIOR_S], "decode": [PRIOR_S, PRIOR_S]}  # decayed measured, predicted

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """Account one step of `batch` that took `seconds` (mutates)."""
        new = pairs = decodes = context = 0
        for entry in batch.requests:
            if entry.num_tokens == 1 and entry.start >= len(entry.request.prompt):
                decodes, context = decodes + 1, context + entry.start + 1
            else:
                new += entry.num_tokens
                pairs += int(attention_pairs(entry.num_tokens, entry.start))
        predicted = self.predict(new, pairs, decodes, context)
        if predicted <= 0:
            return
        seconds = min(max(seconds, RATIO_BOUNDS[0] * predicted), RATIO_BOUNDS[1] * predicted)
        kind = "prefill" if new >= MIN_PREFILL_TOKENS else "decode" if new == 0 else ""
        if kind:
            sums = self._sums[kind]
            sums[0], sums[1] = DECAY * sums[0] + seconds, DECAY * sums[1] + predicted
            if kind == "prefill":
                self.prefill_slowdown = sums[0] / sums[1]
            else:
                self.decode_slowdown = sums[0] / sums[1]

    def predict(self, new_tokens: int, pairs: int, batch: int, context_tokens: int) -> float:
        """The fitted model's seconds for a step of `new_tokens` prompt tokens making `pairs`
        attention pairs and `batch` decodes over `context_tokens` (pure)."""
        (p0, p1, p2), (d0, d1, d2) = self.model.prefill_coef, self.model.decode_coef
        seconds = p0 + p1 * new_tokens + p2 * pairs if new_tokens else 0.0
        if batch:
            seconds += d0 + d1 * batch + d2 * context_tokens - (min(p0, d0) if new_tokens else 0.0)
        return seconds


class MeteredRunner(ModelRunner):
    """A `ModelRunner` whose every step is timed into a `StepMeter`."""

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        connector: KVConnector | None,
        loader: LayerLoader | None,
        meter: StepMeter,
    ) -> None:
        super().__init__(model, cache, connector, loader)
        self.meter = meter

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        synchronize(self.cache.device)  # NOTE: on a GPU, nothing queued before counts (a no-op on CPU)
        start = time.perf_counter()
        tokens = super().run(batch)
        synchronize(self.cache.device)
        self.meter.observe(batch, time.perf_counter() - start)
        return tokens
