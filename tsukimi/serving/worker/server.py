"""One inference worker: an `LLMEngine` owned by one engine thread, behind the internal HTTP
API that the router calls (`tsukimi worker`).

    uvicorn's event loop                      engine thread (tsukimi/serving/worker/engine_thread.py)
    POST /generate -> AddCommand ---> inbox --> engine.add_request -> Verdict (accepted / error)
    NDJSON lines   <- asyncio.Queue <---------- engine.step() outputs (call_soon_threadsafe)
    client gone    -> AbortCommand -> inbox --> engine.abort
    GET /load      <- Load, published by the engine thread after every iteration, with the
                      slowdowns its steps measure against the start-up profile
    POST /admin/update_weights -> WeightUpdater: fetch, then PauseCommand -> drain, swap, resume

Roles: "colocated" generates with the local prefix cache only; "prefill" generates exactly one
token, and its engine loads the prompt's full blocks from the KV pool and publishes the ones it
computes; "decode" generates in full and loads the prompt's blocks from the pool (the router
sends the original prompt plus the first token from prefill).

Before it serves, a worker profiles its own engine on this machine (`profile_on_start`;
tsukimi/engine/profile.py `startup_profile`, at the worker's `threads`) and reports the fitted
cost model in GET /health (`Health.cost`); its engine's steps are then timed against that model
(tsukimi/engine/step_meter.py) and GET /load carries the slowdowns, so the router's Conductor
estimates with this machine's numbers as it is loaded now (tsukimi/serving/router/worker_costs.py).

The API's types are in tsukimi/serving/protocol.py: `POST /generate` takes a GenerateRequest
and streams TokenChunk lines, the last with a finish_reason ("stop" or "length"); a request
that fails inside the worker after it was accepted (engine error, shutdown) ends with a line
whose `error` is (code, message). A refused request is answered with an ErrorReply and the
status of its error class: bad input 400, a request id already running 409 (the engine's
check), a worker shutting down 503.

`POST /admin/update_weights {"name": N}` swaps in the weights published as N in the P2P store
(tsukimi/serving/worker/weight_update.py): unknown N 404, another model's tensors 400, a body without
a name 400. With the cluster secret (docs/security.md) it must be signed as the metadata
server's requests are (401 otherwise): it changes what every later request computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from tsukimi import auth, httpd
from tsukimi.config import SecurityConfig, WorkerConfig
from tsukimi.engine.device import resolve_device, resolve_dtype
from tsukimi.engine.engine import LLMEngine, StepOutput
from tsukimi.engine.kv_budget import kv_cache_blocks
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.model_runner import Model
from tsukimi.engine.profile import startup_profile
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.step_meter import MeteredRunner, StepMeter
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.errors import ClosedError, InvalidArgument, TsukimiError, WorkerUnavailable
from tsukimi.serving.kv_events import KvEventPublisher
from tsukimi.serving.protocol import (
    CostProfile,
    ErrorReply,
    GenerateRequest,
    Health,
    TokenChunk,
    UpdateWeightsReply,
    UpdateWeightsRequest,
    error_reply,
)
from tsukimi.serving.worker.engine_factory import load_engine_factory
from tsukimi.serving.worker.engine_thread import (
    AbortCommand,
    AddCommand,
    EngineThread,
    RequestStream,
    Verdict,
    WorkerMetrics,
)
from tsukimi.serving.worker.weight_update import WeightUpdater
from tsukimi.store.client import StoreClient

logger = logging.getLogger(__name__)


class _TokenStream(StreamingResponse):
    """One request's NDJSON stream; `on_close` runs however it ends (done, client gone, shutdown)."""

    def __init__(self, lines: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(lines, media_type="application/x-ndjson")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _lines(stream: RequestStream, weights_version: str) -> AsyncIterator[bytes]:
    """Engine events as NDJSON lines; events already queued are merged into one line."""
    while not stream.finished:
        events = [await stream.queue.get()]
        while not stream.queue.empty():
            events.append(stream.queue.get_nowait())
        chunk = TokenChunk([], weights_version=weights_version)
        for event in events:
            if isinstance(event, StepOutput):
                chunk.token_ids += event.token_ids
                chunk.finish_reason = event.finish_reason  # type: ignore[assignment]  # stop / length
                chunk.cached_tokens, chunk.pool_tokens = event.cached_tokens, event.pool_tokens
            elif event.error is not None:
                chunk.error = ErrorReply(event.error.code, str(event.error))
        stream.finished = chunk.finish_reason is not None or chunk.error is not None
        yield msgspec.json.encode(chunk) + b"\n"


class Worker:
    """A worker in this process: `start()` loads the model (unless `loaded` is given), joins the
    store (prefill and decode roles), starts the engine thread and serves HTTP; `close()` undoes it."""

    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config, self._loaded = config, loaded
        self.metrics = WorkerMetrics()
        self._store: StoreClient | None = None
        self._connector: StoreKVConnector | None = None
        self._engine: EngineThread | None = None
        self._http: httpd.AppHandle | None = None
        self._updater: WeightUpdater | None = None
        self._events: KvEventPublisher | None = None
        self._secret = SecurityConfig().secret()  # NOTE: from TSUKIMI_CLUSTER_SECRET, as the store client's
        self._seen = auth.ReplayCache()
        self.cost: CostProfile | None = None  # the start-up profile (None: off)
        self._meter: StepMeter | None = None

    @property
    def base_url(self) -> str:
        if self._http is None:
            raise ClosedError(f"worker {self.config.name} is not serving")
        return self._http.base_url

    def start(self) -> Worker:
        """Raises ConfigError (model spec, dtype, engine factory), PeerError/RpcTimeout (store),
        OSError (port)."""
        cfg = self.config
        try:
            factory = load_engine_factory(cfg.engine_factory)  # NOTE: before the model loads: fail fast
            device = resolve_device(cfg.device)  # NOTE: cuda without a GPU: ConfigError, before any work
            if self._loaded is None:
                self._loaded = load_model(cfg.model, resolve_dtype(cfg.dtype, device), device)
            mc = self._loaded.config
            layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_tokens, mc.torch_dtype)
            num_blocks = kv_cache_blocks(
                cfg, layout, device=device
            )  # NOTE: from kv_cache_memory unless num_blocks is set
            connector = None
            if cfg.role != "colocated":
                # NOTE: its TE serves on the worker's own address: peers on other hosts read its KV
                self._store = StoreClient.connect(cfg.master, cfg.segment_bytes, transfer_host=cfg.host)
                connector = self._connector = StoreKVConnector(self._store, KVFormat.of(mc.identity, layout))
            model = self._loaded.model
            updater = self._updater = WeightUpdater(model, connector, cfg.metadata_url)
            if cfg.profile_on_start:
                self._profile(model, layout, device)

            def make_engine() -> LLMEngine:
                engine = factory(
                    model,
                    layout,
                    num_blocks,
                    mc.eos_token_ids,
                    cfg.max_batched_tokens,
                    connector,
                    prefix_caching=cfg.prefix_caching,
                    layerwise_loading=cfg.layerwise_loading,
                    device=device,
                )
                if self._meter is not None:  # NOTE: time its steps against the profile (GET /load)
                    engine.runner = MeteredRunner(model, engine.cache, connector, engine.loader, self._meter)
                return updater.prepare(engine)

            if cfg.prefix_caching:  # NOTE: the router's prefix index follows this cache (GET /health: the ports)
                self._events = KvEventPublisher(cfg.host, block_tokens=cfg.block_tokens).start()
            self._engine = EngineThread(make_engine, self.metrics, cfg.threads, cfg.name, self._events)
            self._engine.start()
            self._http = httpd.start_in_thread(self._app(self._engine), cfg.host, cfg.port)
        except BaseException:
            self.close()
            raise
        logger.info("worker %s (%s, %s) serving on %s", cfg.name, cfg.role, mc.name, self._http.base_url)
        return self

    def _profile(self, model: Model, layout: KVLayout, device: torch.device) -> None:
        """Fit the cost model to this engine on this machine (see the module; mutates)."""
        torch.set_num_threads(self.config.threads)  # NOTE: process-wide: as the engine thread will run
        start = time.perf_counter()
        # NOTE: by CPU time with one thread: the engine's own cost; GET /load's slowdown adds the machine's load
        cpu_time = self.config.threads == 1 and device.type == "cpu"  # NOTE: a GPU's work is not this thread's
        result = startup_profile(model, layout, self.config.max_batched_tokens, cpu=cpu_time, device=device)
        fitted, seconds = result.model, time.perf_counter() - start
        self.cost = CostProfile(
            fitted.prefill_coef, fitted.decode_coef, fitted.kv_bytes_per_token, result.max_relative_error, seconds
        )
        self._meter = StepMeter(fitted)
        logger.info(
            "worker %s profiled in %.2f s: %.3f ms per prompt token, %.2f ms per decode step (fit within %.0f%%)",
            self.config.name,
            seconds,
            1e3 * fitted.prefill_s(512) / 512,
            1e3 * fitted.decode_step_s(1, 64),
            100 * result.max_relative_error,
        )

    def close(self) -> None:
        """Fail unfinished requests, stop serving, leave the store. Idempotent."""
        if self._engine is not None:
            self._engine.close()
        if self._http is not None:
            self._http.stop()
        if self._events is not None:
            self._events.close()
        if self._updater is not None:
            self._updater.close()
        if self._connector is not None:
            self._connector.close()  # NOTE: before the store: it may still be publishing
        if self._store is not None:
            self._store.close()
        self._engine = self._http = self._store = self._connector = self._updater = self._events = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sampling_params(self, body: GenerateRequest) -> SamplingParams:
        """The engine's parameters for a request (a prefill worker makes one token). Raises
        InvalidArgument for bad values or token ids outside the vocabulary."""
        assert self._loaded is not None
        mc = self._loaded.config
        if not all(0 <= t < mc.vocab_size for t in body.prompt_ids):
            raise InvalidArgument(f"prompt token ids must be in 0..{mc.vocab_size - 1}")
        # NOTE: the one place a tsukimi prefill is cut to its first token: the router sends the
        # request as it is, the role decides (a CPP group's head, too, computes one token)
        max_tokens = 1 if self.config.role == "prefill" else body.max_tokens
        params = SamplingParams(
            max_tokens, body.temperature, body.top_p, tuple(body.stop_token_ids), body.ignore_eos, body.seed
        )
        if len(body.prompt_ids) + params.max_tokens > mc.max_position:
            raise InvalidArgument(f"prompt + max_tokens exceed the model's context of {mc.max_position} tokens")
        return params

    def _app(self, engine: EngineThread) -> FastAPI:
        app = FastAPI(title=f"tsukimi worker {self.config.name}")
        assert self._loaded is not None and self._updater is not None
        updater, cfg, mc = self._updater, self.config, self._loaded.config

        @app.get("/health")
        def get_health() -> Response:
            ports = (self._events.port, self._events.snapshot_port) if self._events is not None else (0, 0)
            health = Health(
                "ok",
                cfg.name,
                cfg.role,
                mc.identity,
                mc.name,
                cfg.block_tokens,
                updater.weights_version,
                *ports,
                cost=self.cost,
            )
            return Response(msgspec.json.encode(health), media_type="application/json")

        @app.get("/load")
        def get_load() -> Response:
            load, meter = engine.load, self._meter
            if meter is not None:
                load = msgspec.structs.replace(
                    load,
                    prefill_slowdown=round(meter.prefill_slowdown, 4),
                    decode_slowdown=round(meter.decode_slowdown, 4),
                )
            return Response(msgspec.json.encode(load), media_type="application/json")

        @app.get("/metrics")
        def get_metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            return await self._generate(engine, await request.body())

        @app.post("/admin/update_weights")
        async def update_weights(request: Request) -> Response:
            raw = await request.body()
            httpd.check_signature(request, raw, self._secret, self._seen)
            return await self._update_weights(engine, updater, raw)

        return app

    @staticmethod
    async def _update_weights(engine: EngineThread, updater: WeightUpdater, raw: bytes) -> Response:
        try:
            body = msgspec.json.decode(raw, type=UpdateWeightsRequest)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _error(InvalidArgument(f"invalid request body: {exc}"))
        try:
            result = await asyncio.to_thread(updater.update, engine, body.name, body.drain_timeout_s)
        except ClosedError as exc:
            return _error(WorkerUnavailable(str(exc)))
        except TsukimiError as exc:
            logger.warning("weight update to %r failed: %s", body.name, exc)
            return _error(exc)
        reply = UpdateWeightsReply(result.weights_version, result.seconds)
        return Response(msgspec.json.encode(reply), media_type="application/json")

    async def _generate(self, engine: EngineThread, raw: bytes) -> Response:
        try:
            body = msgspec.json.decode(raw, type=GenerateRequest)
            params = self.sampling_params(body)
        # NOTE: ValidationError is a DecodeError; msgspec raises UnicodeDecodeError itself for a
        # string that is not UTF-8 (found by tests/fuzz: a 500)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _error(InvalidArgument(f"invalid request body: {exc}"))
        except InvalidArgument as exc:
            return _error(exc)
        stream = RequestStream(body.request_id, asyncio.get_running_loop(), asyncio.Queue(), len(body.prompt_ids))
        try:
            engine.submit(AddCommand(body.prompt_ids, params, stream, body.weights_version))
            verdict = await stream.queue.get()
        except ClosedError as exc:
            return _error(WorkerUnavailable(str(exc)))
        except BaseException:  # cancelled while waiting: the request must not run on
            self._close_stream(engine, stream)
            raise
        assert isinstance(verdict, Verdict)
        if verdict.error is not None:
            return _error(verdict.error)
        logger.debug("streaming %s", body.request_id)
        return _TokenStream(_lines(stream, verdict.weights_version), lambda: self._close_stream(engine, stream))

    @staticmethod
    def _close_stream(engine: EngineThread, stream: RequestStream) -> None:
        if not stream.finished:
            logger.debug("aborting %s: its client went away", stream.request_id)
            with contextlib.suppress(ClosedError):
                engine.submit(AbortCommand(stream))


def _error(error: TsukimiError) -> Response:
    status, body = error_reply(error)
    return Response(body, status_code=status, media_type="application/json")


def run_worker(config: WorkerConfig, on_ready: Callable[[Worker], None] | None = None) -> None:
    """Run a worker until SIGINT or SIGTERM (call from the main thread), then shut it down.

    Args:
        config: the worker.
        on_ready: called once it serves (e.g. to print its address).
    """
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Worker(config).start() as worker:
            if on_ready is not None:
                on_ready(worker)
            stop.wait()
            logger.info("worker %s stopping", config.name)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
