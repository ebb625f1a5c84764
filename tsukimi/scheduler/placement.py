"""The Conductor's pure placement arithmetic (tsukimi/scheduler/conductor.py): which decode
instance a request's TBT is best on, and the rates and token counts of prefix reuse. No
state of its own: the Conductor passes its books in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tsukimi.config import ConductorConfig
from tsukimi.scheduler.cost_model import CostModel
from tsukimi.scheduler.load_prediction import DecodeLoad, DecodeStagePredictor, expected_load, uniform_load


@dataclass(frozen=True, slots=True)
class DecodeForecast:
    """What a decode choice is judged with: the stage lengths seen, the cost model, the TBT
    SLO and the mean output length assumed."""

    stages: DecodeStagePredictor
    cost: CostModel
    tbt_slo_s: float
    mean_out: float


def best_decode(
    loads: Mapping[str, DecodeLoad], forecast: DecodeForecast, input_tokens: int, now: float, at: float, mode: str
) -> tuple[str, float, str]:
    """(the instance with the lowest TBT among those with room in their KV memory, or with
    the most room when none has enough; that TBT; "" when it meets the SLO, else why not:
    "tbt_slo" / "kv_memory") for the load now (`mode` "now") or the load predicted for time
    `at` ("predicted": survival; "predicted_uniform": the paper's, where the SLO test is on the
    average TBT ratio over the instances); pure. `loads` must not be empty."""
    mean_out, cost = forecast.mean_out, forecast.cost
    best: tuple[float, float, str, float] | None = None  # (no room, tbt, name, tbt without it): lowest wins
    stage_s = forecast.stages.mean_s
    total_s, instances = 0.0, 0
    for name, load in loads.items():
        without_s = 0.0
        if mode == "now":
            count, context = float(len(load.active)), float(load.active_tokens)
        elif mode == "predicted":
            count, context = expected_load(load, forecast.stages, now, at)
        else:
            count, context = uniform_load(load, at, stage_s)
            without_s = cost.decode_step_s(round(count), int(context + count * mean_out / 2))
            total_s, instances = total_s + without_s, instances + 1
        context += count * mean_out / 2
        overflow = max(0.0, context + input_tokens + mean_out - load.capacity_tokens)
        tbt_s = cost.decode_step_s(round(count) + 1, int(context + input_tokens + mean_out / 2))
        if best is None or (overflow, tbt_s) < best[:2]:
            best = (overflow, tbt_s, name, without_s)
    assert best is not None
    overflow, tbt_s, name, without_s = best
    # NOTE: predicted_uniform tests the system's average, with the request on its instance.
    system_s = (total_s - without_s + tbt_s) / instances if mode == "predicted_uniform" else tbt_s
    over = system_s > forecast.tbt_slo_s
    return name, tbt_s, "kv_memory" if overflow else ("tbt_slo" if over else "")


def fetch_bandwidth_bytes_s(config: ConductorConfig, source: str, own_ssd: str) -> float:
    """The rate at which a prefill instance whose SSD tier is `own_ssd` loads KV held at
    `source`: its own SSD's read bandwidth, another instance's SSD at the lower of that and the
    network's, any DRAM at the network's; pure."""
    if source == own_ssd:
        return config.ssd_read_bytes_s
    if source.endswith("/ssd"):
        return min(config.ssd_read_bytes_s, config.kv_bandwidth_bytes_s)
    return config.kv_bandwidth_bytes_s


def no_load(source: str) -> int:
    """No transfers in flight anywhere (the Conductor's default `links`)."""
    return 0


def cached_tokens(blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Tokens covered by `blocks` prefix blocks; at least one token is always computed."""
    return max(0, min(blocks * block_tokens, input_tokens - 1))
