"""The Conductor's cost model from the workers: a worker profiles itself at start-up and reports
the fit in GET /health, its steps' slowdown against the fit in GET /load (tsukimi/engine/
step_meter.py); the router builds its Conductor's cost model from them, falls back to the
config's, and follows the slowdowns as polls arrive (tsukimi/serving/router/worker_costs.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.serving.fakes import FAST, FakeWorker, run_with
from tsukimi.config import ROUTER_CONDUCTOR, LinearCostConfig, RouterConfig, WorkerConfig
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.scheduler import ScheduledBatch
from tsukimi.engine.step_meter import MeteredRunner, StepMeter
from tsukimi.engine.weights import LoadedModel
from tsukimi.scheduler.cost_model import LinearCostModel
from tsukimi.serving.protocol import CostProfile, Health, Load
from tsukimi.serving.router.router import Router
from tsukimi.serving.router.worker_costs import WorkerCostModel, conductor_cost
from tsukimi.serving.router.workers import WorkerHandle, WorkerSpec
from tsukimi.serving.worker.server import Worker
from tsukimi.testing.processes import wait_until

PREFILL = {"prefill_coef": [0.001, 0.0002, 0.0], "decode_coef": [1.0, 1.0, 1.0], "kv_bytes_per_token": 4096}
DECODE = {"prefill_coef": [1.0, 1.0, 1.0], "decode_coef": [0.004, 0.0005, 0.0], "kv_bytes_per_token": 4096}


# -- the worker's side --------------------------------------------------------------------------


def _entry(tokens: int, start: int, prompt: int) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=tokens, start=start, request=SimpleNamespace(prompt=[0] * prompt))


def test_step_meter_weighs_measured_over_predicted_by_step_length() -> None:
    meter = StepMeter(LinearCostModel((0.0, 0.001, 0.0), (0.01, 0.0, 0.0), 1))
    prefill = ScheduledBatch((_entry(100, 0, 100),))  # type: ignore[arg-type]  # predicted 0.1 s
    meter.observe(prefill, 0.3)
    assert meter.prefill_slowdown == pytest.approx((0.8 * 0.1 + 0.3) / (0.8 * 0.1 + 0.1))
    assert meter.decode_slowdown == 1.0
    for _ in range(40):
        meter.observe(prefill, 0.3)
    assert meter.prefill_slowdown == pytest.approx(3.0, rel=1e-3)
    short, long = StepMeter(meter.model), StepMeter(meter.model)  # NOTE: a short step moves it less
    short.observe(ScheduledBatch((_entry(40, 0, 100),)), 0.4)  # type: ignore[arg-type]  # predicted 0.04 s
    long.observe(ScheduledBatch((_entry(400, 0, 400),)), 4.0)  # type: ignore[arg-type]  # predicted 0.4 s
    assert 1.0 < short.prefill_slowdown < 4.0 < long.prefill_slowdown
    decodes = ScheduledBatch((_entry(1, 100, 100), _entry(1, 50, 40)))  # type: ignore[arg-type]  # 0.01 s
    for _ in range(60):
        meter.observe(decodes, 0.005)
    assert meter.decode_slowdown == pytest.approx(0.5, rel=1e-2)
    meter.observe(ScheduledBatch((_entry(100, 0, 100),)), 1e3)  # type: ignore[arg-type]  # bounded
    assert meter.prefill_slowdown < 10.0


def test_metered_runner_times_the_engines_steps(tiny: LoadedModel) -> None:
    torch.set_num_threads(1)
    c = tiny.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, 16, c.torch_dtype)
    engine = LLMEngine(tiny.model, layout, 64, c.eos_token_ids)
    meter = StepMeter(LinearCostModel((0.0, 1e-12, 0.0), (1e-12, 0.0, 0.0), 1))  # NOTE: predicts ~nothing
    engine.runner = MeteredRunner(tiny.model, engine.cache, None, None, meter)
    engine.generate([list(range(100, 164))], SamplingParams(max_tokens=4))
    assert meter.prefill_slowdown > 1.0 and meter.decode_slowdown > 1.0


def test_worker_reports_its_profile_in_health_and_slowdowns_in_load(tiny: LoadedModel) -> None:
    cfg = WorkerConfig(name="w", role="colocated", model="tiny", num_blocks=256, max_batched_tokens=128)
    with Worker(cfg, tiny).start() as worker:
        health = Health(**httpx.get(worker.base_url + "/health", timeout=10).json())
        assert isinstance(health.cost, dict)  # NOTE: decoded as JSON here; the router decodes the struct
        cost = CostProfile(**health.cost)
        assert len(cost.prefill_coef) == 3 and min(cost.prefill_coef) >= 0 and cost.seconds > 0
        assert sum(cost.prefill_coef) > 0 and cost.kv_bytes_per_token == layout_bytes(tiny)
        body = {"request_id": "r", "prompt_ids": list(range(100, 164)), "max_tokens": 4}
        assert httpx.post(worker.base_url + "/generate", json=body, timeout=30).status_code == 200
        load = Load(**httpx.get(worker.base_url + "/load", timeout=10).json())
        assert load.prefill_slowdown > 0 and load.decode_slowdown > 0
        assert load.prefill_slowdown != 1.0  # NOTE: a 64-token prefill was timed
    quiet = WorkerConfig(name="q", role="colocated", model="tiny", num_blocks=64, profile_on_start=False)
    with Worker(quiet, tiny).start() as worker:
        assert httpx.get(worker.base_url + "/health", timeout=10).json().get("cost") is None
        assert httpx.get(worker.base_url + "/load", timeout=10).json()["prefill_slowdown"] == 1.0


def layout_bytes(tiny: LoadedModel) -> int:
    c = tiny.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


# -- the router's side ---------------------------------------------------------------------------


def _handle(name: str, role: str, cost: dict[str, object] | None, slowdown: float = 1.0) -> WorkerHandle:
    profile = CostProfile(**cost) if cost is not None else None  # type: ignore[arg-type]
    load = Load(0, 0, prefill_slowdown=slowdown, decode_slowdown=slowdown)
    return WorkerHandle(WorkerSpec(name, role, "http://127.0.0.1:1"), load=load, cost=profile)  # type: ignore[arg-type]


def test_cost_comes_from_the_prefill_and_decode_workers_profiles() -> None:
    cost = conductor_cost(RouterConfig(), [_handle("p", "prefill", PREFILL), _handle("d", "decode", DECODE)])
    assert isinstance(cost, WorkerCostModel)
    assert cost.prefill_s(1000) == pytest.approx(0.001 + 0.2)
    assert cost.decode_step_s(2, 100) == pytest.approx(0.004 + 0.001)
    assert cost.kv_bytes_per_token == 4096


def test_cost_falls_back_to_the_config_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = RouterConfig(cost=LinearCostConfig(prefill_token_s=0.003))
    cost = conductor_cost(config, [_handle("p", "prefill", None), _handle("d", "decode", DECODE)])
    assert cost.prefill_s(100) == pytest.approx(config.cost.prefill_base_s + 0.3)
    assert cost.decode_step_s(1, 0) == pytest.approx(0.0045)
    assert "prefill workers p report no cost profile" in caplog.text
    explicit = conductor_cost(RouterConfig(cost_model="config"), [_handle("p", "prefill", PREFILL)])
    assert not isinstance(explicit, WorkerCostModel) and explicit.prefill_s(1000) == pytest.approx(0.505)


def test_the_online_slowdown_scales_the_estimate() -> None:
    prefill = _handle("p", "prefill", PREFILL)
    cost = WorkerCostModel(LinearCostConfig())
    cost.refresh([prefill])
    before = cost.prefill_s(1500)
    prefill.load = Load(0, 0, prefill_slowdown=2.5)
    cost.refresh([prefill])
    assert cost.prefill_s(1500) == pytest.approx(2.5 * before)
    prefill.load = Load(0, 0, prefill_slowdown=1000.0)
    cost.refresh([prefill])
    assert cost.prefill_s(1500) == pytest.approx(8.0 * before)  # bounded


def test_router_builds_the_conductor_from_workers_and_follows_their_polls(workers: list[FakeWorker]) -> None:
    workers += [FakeWorker("p0", "prefill", cost=PREFILL), FakeWorker("d0", "decode", cost=DECODE)]
    router = Router([w.spec for w in workers], FAST, dataclasses.replace(ROUTER_CONDUCTOR, rejection="none"))

    async def body(router: Router) -> tuple[float, float]:
        await router.start()
        assert router.conductor is not None
        before = router.conductor.cost.prefill_s(1000)
        workers[0].load["prefill_slowdown"] = 3.0
        await asyncio.to_thread(wait_until, lambda: router.conductor.cost.prefill_s(1000) > before, 10)  # type: ignore[union-attr]
        return before, router.conductor.cost.prefill_s(1000)

    before, after = run_with(router, body)
    assert before == pytest.approx(0.201) and after == pytest.approx(3 * 0.201)
