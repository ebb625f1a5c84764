"""The Conductor's side of `tsukimi bench prefix-link` (prefix_link.py): what it estimates for
a request whose prefix is in the pool, made as live serving makes it.

    startup_profile (CPU time)  --fit-->  LinearCostModel          as a worker profiles itself
    MeteredRunner -> StepMeter  --x slowdown-->  the model now      as GET /load and the router
    Conductor(kv_bandwidth)     --decision-->  pick, estimates      its `_best_prefill`, queue 0

The worker's way (tsukimi/serving/worker/server.py): its start-up profile by the engine thread's
CPU time, then every step timed against it (tsukimi/engine/step_meter.py); the router scales the
profile by the prefill and decode slowdowns (tsukimi/serving/router/worker_costs.py), so its
estimates follow the machine's load. Here the bench's engines carry the meter, and each request
is estimated just before it runs, as a router would place it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

from tsukimi.config import ROUTER_CONDUCTOR
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.model_runner import Model
from tsukimi.engine.profile import ProfileResult, startup_profile
from tsukimi.engine.step_meter import MeteredRunner, StepMeter
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.conductor import Conductor, ScheduleRequest
from tsukimi.scheduler.cost_model import CostModel, LinearCostModel, chunked_prefill_s
from tsukimi.scheduler.prefix_index import PrefixIndex, location
from tsukimi.serving.router.worker_costs import SLOWDOWN_BOUNDS

POOL_LOCATION = location("pool", "dram")  # NOTE: where the router's index puts pooled blocks
PREFILL = "prefill"


@dataclasses.dataclass(frozen=True, slots=True)
class RequestShape:
    """A request: `prefix_tokens` held in the pool (whole blocks, `hashes`), then `new_tokens`;
    prefill runs `chunk_tokens` per step."""

    prefix_tokens: int
    new_tokens: int
    block_tokens: int
    chunk_tokens: int
    hashes: tuple[BlockHash, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """The Conductor's decision for one request: `pick` ("fetch" / "recompute") and its TTFT
    estimate of each option (seconds; queue 0), `transfer_s` inside `fetch_s`, and the prefill
    slowdown its cost model was scaled by."""

    pick: str
    fetch_s: float
    transfer_s: float
    recompute_s: float
    slowdown: float

    def of(self, mode: str) -> float:
        """The estimate of option `mode` ("fetch" / "recompute")."""
        return self.fetch_s if mode == "fetch" else self.recompute_s


class WorkerEstimates:
    """A prefill worker's profile and step meter, and the Conductor's estimates from them.

    Args:
        model / layout: the engine's model and KV layout.
        chunk_tokens: its `max_batched_tokens` (the profile's largest point).
    """

    def __init__(self, model: Model, layout: KVLayout, chunk_tokens: int) -> None:
        self.model, self.layout = model, layout
        self.profile: ProfileResult = startup_profile(model, layout, chunk_tokens, cpu=True)
        self.meter = StepMeter(self.profile.model)

    def metered(self, engine: LLMEngine) -> LLMEngine:
        """`engine` with its steps timed into the meter, as a worker's (mutates it)."""
        engine.runner = MeteredRunner(self.model, engine.cache, engine.connector, engine.loader, self.meter)
        return engine

    def cost_now(self) -> CostModel:
        """The profile scaled by the meter's slowdowns, bounded as the router bounds them (pure)."""
        fitted = self.profile.model

        def scaled(coef: tuple[float, float, float], slowdown: float) -> tuple[float, float, float]:
            factor = min(max(slowdown, SLOWDOWN_BOUNDS[0]), SLOWDOWN_BOUNDS[1])
            return coef[0] * factor, coef[1] * factor, coef[2] * factor

        prefill = scaled(fitted.prefill_coef, self.meter.prefill_slowdown)
        decode = scaled(fitted.decode_coef, self.meter.decode_slowdown)
        return cast(CostModel, LinearCostModel(prefill, decode, fitted.kv_bytes_per_token))

    def estimate(self, shape: RequestShape, bandwidth_bytes_s: float) -> Estimate:
        """The Conductor's decision for `shape` now, at `bandwidth_bytes_s` (pure)."""
        return conductor_estimate(shape, self.cost_now(), bandwidth_bytes_s, self.meter.prefill_slowdown)


def conductor_estimate(
    shape: RequestShape, cost: CostModel, bandwidth_bytes_s: float, slowdown: float = 1.0
) -> Estimate:
    """A Conductor of one prefill instance, the prefix in its index at the pool, places the
    request: its pick and TTFT estimate; the other option's estimate from the same arithmetic
    (`Conductor._best_prefill`: transfer + the rest's chunked prefill, vs the whole prompt's).

    Raises:
        AssertionError: the Conductor's estimate is not that arithmetic (a changed Conductor).
    """
    config = dataclasses.replace(
        ROUTER_CONDUCTOR,
        block_tokens=shape.block_tokens,
        prefill_chunk_tokens=shape.chunk_tokens,
        kv_bandwidth_bytes_s=bandwidth_bytes_s,
        rejection="none",
        reuse="global",
        balancing_threshold=1.0,
    )
    index = PrefixIndex()
    index.stored(POOL_LOCATION, shape.hashes)
    conductor = Conductor(config, cost, index, [PREFILL], ["decode"], 1 << 30)
    tokens = shape.prefix_tokens + shape.new_tokens
    decision = conductor.schedule(ScheduleRequest(1, tokens, shape.hashes, max_tokens=1), now=0.0)
    transfer_s = cost.transfer_s(shape.prefix_tokens, bandwidth_bytes_s)
    fetch_s = transfer_s + chunked_prefill_s(cost, shape.new_tokens, shape.prefix_tokens, shape.chunk_tokens)
    recompute_s = chunked_prefill_s(cost, tokens, 0, shape.chunk_tokens)
    pick = "fetch" if decision.fetch_from == POOL_LOCATION else "recompute"
    same = math.isclose(decision.ttft_s, fetch_s if pick == "fetch" else recompute_s)
    assert same and decision.queue_s == 0, f"the Conductor's decision {decision} is not its own arithmetic"
    return Estimate(pick, fetch_s, transfer_s, recompute_s, slowdown)
