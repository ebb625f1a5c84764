"""The router's Conductor cost model, from the workers or from the config (`router.cost_model`).

    "config"   a `LinearCostModel` of the config's coefficients (`router.cost`, a `LinearCostConfig`)
    "workers"  the coefficients the workers fitted to themselves at start-up (GET /health
               `Health.cost`: prefill from the prefill workers, decode from the decode workers,
               averaged over those that report), each part scaled by the slowdown those workers
               measured over their recent steps (GET /load); the config's coefficients for a
               part no worker reports, with a warning (vLLM instances report none)

`WorkerCostModel` is one mutable object the Conductor (and its KV ledger and placement) holds
for good: `refresh` swaps in a new fitted model as the polls arrive, on the router's one event
loop, so it never changes in the middle of a decision.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import cast

from tsukimi.config import LinearCostConfig, RouterConfig
from tsukimi.scheduler.cost_model import CostModel, LinearCostModel
from tsukimi.serving.router.workers import WorkerHandle

logger = logging.getLogger(__name__)

SLOWDOWN_BOUNDS = (0.25, 8.0)  # NOTE: how far the online factor may move the profile's estimates
Coef = tuple[float, float, float]


class WorkerCostModel:
    """The workers' fitted cost model as a `CostModel` (see the module). `model`: the scaled
    `LinearCostModel` estimates come from now; `source`: what each part came from."""

    def __init__(self, config: LinearCostConfig) -> None:
        self.config = config
        self.model = LinearCostModel.from_config(config)
        self.kv_bytes_per_token = self.model.kv_bytes_per_token
        self.source = {"prefill": "config", "decode": "config"}

    def refresh(self, workers: Iterable[WorkerHandle], warn: bool = False) -> None:
        """Rebuild `model` from what the workers last reported (mutates). `warn`: log a
        warning for each part that falls back to the config."""
        fallback, handles = LinearCostModel.from_config(self.config), list(workers)
        prefill = self._part("prefill", handles, fallback.prefill_coef, warn)
        decode = self._part("decode", handles, fallback.decode_coef, warn)
        sizes = [w.cost.kv_bytes_per_token for w in handles if w.cost is not None]
        self.kv_bytes_per_token = max(sizes) if sizes else fallback.kv_bytes_per_token
        self.model = LinearCostModel(prefill, decode, self.kv_bytes_per_token)

    def _part(self, role: str, handles: list[WorkerHandle], fallback: Coef, warn: bool) -> Coef:
        """The mean coefficients of `role`'s workers that report a profile, times
        their mean slowdown; `fallback` when none does (mutates `source`)."""
        coefs, factors, silent = [], [], []
        for w in (w for w in handles if w.spec.role == role):
            if w.cost is None:
                silent += [w.spec.name] if w.cpp is None else []  # NOTE: a CPP group's head profiles nothing
            else:  # NOTE: one marked down keeps its last profile: it is still this machine's
                coefs.append(w.cost.prefill_coef if role == "prefill" else w.cost.decode_coef)
                factors.append(w.load.prefill_slowdown if role == "prefill" else w.load.decode_slowdown)
        if warn and silent:
            logger.warning(
                "%s workers %s report no cost profile: using %s",
                role,
                ", ".join(silent),
                "the others'" if coefs else f"router.cost.{role}_* of the config",
            )
        if not coefs:
            self.source[role] = "config"
            return fallback
        factor = min(max(sum(factors) / len(factors), SLOWDOWN_BOUNDS[0]), SLOWDOWN_BOUNDS[1])
        self.source[role] = f"{len(coefs)} workers' profiles x {factor:.2f}"
        mean = [factor * sum(c[i] for c in coefs) / len(coefs) for i in range(3)]
        return mean[0], mean[1], mean[2]

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.model.prefill_s(new_tokens, cached_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.model.decode_step_s(batch, context_tokens)

    def mixed_step_s(self, prefill_tokens: int, prefill_context: int, batch: int, context_tokens: int) -> float:
        return self.model.mixed_step_s(prefill_tokens, prefill_context, batch, context_tokens)

    def transfer_s(self, tokens: int, bandwidth_bytes_s: float) -> float:
        return self.model.transfer_s(tokens, bandwidth_bytes_s)


def conductor_cost(config: RouterConfig, workers: Iterable[WorkerHandle]) -> CostModel:
    """The Conductor's cost model per `config.cost_model` (see the module); "workers" logs a
    warning for each part no worker reports."""
    if config.cost_model == "config":
        return cast(CostModel, LinearCostModel.from_config(config.cost))
    cost = WorkerCostModel(config.cost)
    cost.refresh(workers, warn=True)
    logger.info(
        "the Conductor's cost model: prefill from %s, decode from %s: %s",
        cost.source["prefill"],
        cost.source["decode"],
        cost.model,
    )
    return cost
