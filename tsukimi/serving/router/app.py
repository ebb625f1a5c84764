"""The router's whole application, from one typed config: `build_router_app(config)` is what
`tsukimi router` serves, and what any other caller (tests, benchmarks) builds to get the same
router.

    RouterAppConfig --> workers ("NAME=ROLE@URL,...")
                    --> backend (config.backend: "tsukimi" here; another kind from `backends`,
                        e.g. "vllm", built by tsukimi/integrations/vllm/backend.py)
                    --> Router(workers, [router], [conductor], backend)
                    --> the OpenAI front (tsukimi/serving/openai/app.py) with the model's tokenizer,
                        context and generation defaults
                    --> the dashboard (tsukimi/serving/dashboard/app.py) with its store probe
                        (master, master_http)
                    --> load shedding (shed_lag_ms; a shed request is logged as rejected
                        "overloaded" and counted in the rejections metric)
                    --> the arrival stamp, outermost (arrivals.py: each request's admission
                        latency, into its decision record and the admission metric)
                    --> the health port (health_port > 0: /health and /metrics answered by a
                        process beside the router, from what its loop publishes; health_port.py)

The app's lifespan starts and closes the router, the dashboard, the shedder's lag probe and the
health port; once they run, it freezes the heap the start-up made (`gc.freeze()`: the modules,
the tokenizer) out of the garbage collector's way. NOTE: a full collection traverses every
tracked object while it holds the GIL: with the start-up heap in it, one took 0.36-0.53 s under
overload (`tsukimi bench serve --workload overload`), stalling the loop and the health port's
threads alike.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tsukimi.clock import Clock, WallClock
from tsukimi.config import RouterAppConfig, SecurityConfig
from tsukimi.engine.generation_defaults import generation_defaults
from tsukimi.engine.tokenizer import Tokenizer, load_tokenizer
from tsukimi.errors import ConfigError, Rejected
from tsukimi.serving.dashboard import app as dashboard
from tsukimi.serving.dashboard.store_probe import StoreProbe
from tsukimi.serving.openai.app import OpenAIServer, create_app
from tsukimi.serving.openai.validation import model_context_tokens
from tsukimi.serving.router import health_port, lifespan, load_shedding
from tsukimi.serving.router.arrivals import ArrivalStamp
from tsukimi.serving.router.backend import RouterBackend
from tsukimi.serving.router.health_port import HealthPort
from tsukimi.serving.router.router import Router
from tsukimi.serving.router.worker_client import WorkerClient
from tsukimi.serving.router.workers import WorkerSpec, parse_workers

logger = logging.getLogger(__name__)

BackendFactory = Callable[[RouterAppConfig, Sequence[WorkerSpec], Clock], RouterBackend]
"""Builds a kind of backend from the config, over the declared workers, on the router's clock.
Raises ConfigError."""


def tsukimi_backend(config: RouterAppConfig, workers: Sequence[WorkerSpec], clock: Clock) -> RouterBackend:
    """The backend of tsukimi workers (`WorkerClient`), with the router's timeouts."""
    r = config.router
    return WorkerClient(clock, r.connect_timeout_s, r.read_timeout_s, r.poll_interval_s)


def build_router_app(
    config: RouterAppConfig,
    backends: Mapping[str, BackendFactory] | None = None,
    tokenizer: Tokenizer | None = None,
    clock: Clock | None = None,
) -> FastAPI:
    """The router's app per `config` (see the module).

    Args:
        config: everything (`tsukimi router --config` reads it; its flags map onto it).
        backends: backend kinds beyond "tsukimi", by name (the vLLM backend lives above the
            serving layer: its command passes it in).
        tokenizer: the model's tokenizer (None: loaded from `config.model`).
        clock: the router's clock (None: the wall clock).

    Returns:
        The app; `app.state.server` is its `OpenAIServer` (`.router`, `.metrics`),
        `app.state.dashboard` its dashboard.

    Raises:
        ConfigError: bad workers, an unknown backend kind, a model spec without a tokenizer or
            context length.
    """
    clock = clock or WallClock()
    workers = parse_workers(config.workers)
    factories: dict[str, BackendFactory] = {"tsukimi": tsukimi_backend, **(backends or {})}
    if config.backend not in factories:
        raise ConfigError(f"backend {config.backend!r} is not available here (known: {', '.join(factories)})")
    backend = factories[config.backend](config, workers, clock)
    router = Router(workers, config.router, config.conductor, clock, backend)
    name = config.served_model_name or config.model
    tokens = tokenizer or load_tokenizer(config.model)
    context, defaults = model_context_tokens(config.model), generation_defaults(config.model)
    app = create_app(router, tokens, name, max_context_tokens=context, defaults=defaults)
    secret = SecurityConfig().secret()  # NOTE: the workers' and the master's secret (docs/security.md)
    dashboard.mount(app, StoreProbe(config.master, config.master_http, secret))
    server: OpenAIServer = app.state.server
    lag = load_shedding.install(app, config.shed_lag_ms / 1000, _log_shed(server))
    admission = server.metrics.admission.observe
    app.add_middleware(ArrivalStamp, decisions=router.decisions, clock=clock, on_admission=admission)
    lifespan.add(app, _frozen_start_up_heap)
    if config.health_port:
        port = app.state.health_port = HealthPort(server, lag, config.host, config.health_port)
        lifespan.add(app, lambda: health_port.serving(port))
    return app


@asynccontextmanager
async def _frozen_start_up_heap() -> AsyncIterator[None]:
    """Moves every object alive now to the collector's permanent generation while the app
    serves (see the module), and back when it stops (an app served in a test's process)."""
    gc.collect()
    gc.freeze()
    logger.info("%d start-up objects frozen out of the garbage collector's way", gc.get_freeze_count())
    try:
        yield
    finally:
        gc.unfreeze()


def _log_shed(server: OpenAIServer) -> load_shedding.OnShed:
    """What a shed request leaves: a rejection in the metrics and in the decision log."""
    router = server.router

    def shed(request_id: str, rejection: Rejected) -> None:
        server.metrics.rejections.labels(rejection.reason).inc()
        record = router.decisions.open(request_id, router.clock.now(), router.mode, 0)
        record.rejected(rejection.reason, rejection.detail)

    return shed
