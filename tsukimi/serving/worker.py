"""One inference worker: an `LLMEngine` owned by one engine thread, behind the internal HTTP
API that the router calls (`tsukimi worker`).

    uvicorn's event loop                      engine thread (tsukimi/serving/engine_thread.py)
    POST /generate -> AddCommand ---> inbox --> engine.add_request -> Verdict (200/400/409)
    NDJSON lines   <- asyncio.Queue <---------- engine.step() outputs (call_soon_threadsafe)
    client gone    -> AbortCommand -> inbox --> engine.abort
    GET /load      <- LoadSnapshot, published by the engine thread after every iteration

Roles: "colocated" generates with the local prefix cache only; "prefill" generates exactly one
token, and its engine loads the prompt's full blocks from the KV pool and publishes the ones it
computes; "decode" generates in full and loads the prompt's blocks from the pool (the router
sends the original prompt plus the first token from prefill).

`POST /generate` streams NDJSON lines `{"token_ids", "finish_reason", "cached_tokens",
"pool_tokens"}`; the last has a finish_reason ("stop", "length" or "abort"). A request that
fails inside the worker (engine error, shutdown) ends with finish_reason "abort" and an
"error" message. Bad input is 400 `{"error": ...}`, a request id already running 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from tsukimi import httpd
from tsukimi.config import WorkerConfig
from tsukimi.engine.engine import LLMEngine, StepOutput
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.kv_pool import KVFormat, StoreKVConnector
from tsukimi.engine.sampling import SamplingParams
from tsukimi.engine.weights import LoadedModel, load_model
from tsukimi.errors import ClosedError, InvalidArgument
from tsukimi.serving.engine_thread import (
    AbortCommand,
    AddCommand,
    EngineThread,
    LoadSnapshot,
    RequestStream,
    Verdict,
    WorkerMetrics,
)
from tsukimi.store.client import StoreClient

__all__ = [  # NOTE: the engine thread's types live in engine_thread.py; re-exported for callers
    "EngineThread",
    "GenerateChunk",
    "GenerateRequest",
    "LoadSnapshot",
    "Worker",
    "WorkerMetrics",
    "run_worker",
]

logger = logging.getLogger(__name__)


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The body of POST /generate."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class GenerateChunk(msgspec.Struct, omit_defaults=True):
    """One NDJSON line of the /generate stream."""

    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    pool_tokens: int
    error: str | None = None


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


async def _lines(stream: RequestStream) -> AsyncIterator[bytes]:
    """Engine events as NDJSON lines; events already queued are merged into one line."""
    while not stream.finished:
        events = [await stream.queue.get()]
        while not stream.queue.empty():
            events.append(stream.queue.get_nowait())
        chunk = GenerateChunk([], None, 0, 0)
        for event in events:
            if isinstance(event, StepOutput):
                chunk.token_ids += event.token_ids
                chunk.finish_reason, chunk.cached_tokens = event.finish_reason, event.cached_tokens
                chunk.pool_tokens = event.pool_tokens
            else:
                chunk.finish_reason, chunk.error = "abort", event.message
        stream.finished = chunk.finish_reason is not None
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
        self._streams: dict[str, RequestStream] = {}  # requests with an open response (event loop only)

    @property
    def base_url(self) -> str:
        if self._http is None:
            raise ClosedError(f"worker {self.config.name} is not serving")
        return self._http.base_url

    def start(self) -> Worker:
        """Raises ConfigError (model spec, dtype), PeerError/RpcTimeout (store), OSError (port)."""
        cfg = self.config
        try:
            if self._loaded is None:
                self._loaded = load_model(cfg.model, cfg.dtype)
            mc = self._loaded.config
            layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_tokens, mc.torch_dtype)
            connector = None
            if cfg.role != "colocated":
                self._store = StoreClient.connect(cfg.master, cfg.segment_bytes)
                connector = self._connector = StoreKVConnector(self._store, KVFormat.of(mc.identity, layout))
            model = self._loaded.model

            def make_engine() -> LLMEngine:
                return LLMEngine(
                    model, layout, cfg.num_blocks, mc.eos_token_ids, cfg.max_batched_tokens, connector,
                    prefix_caching=cfg.prefix_caching,
                )  # fmt: skip

            self._engine = EngineThread(make_engine, self.metrics, cfg.threads, cfg.name)
            self._engine.start()
            self._http = httpd.start_in_thread(self._app(self._engine), cfg.host, cfg.port)
        except BaseException:
            self.close()
            raise
        logger.info("worker %s (%s, %s) serving on %s", cfg.name, cfg.role, mc.name, self._http.base_url)
        return self

    def close(self) -> None:
        """Fail unfinished requests, stop serving, leave the store. Idempotent."""
        if self._engine is not None:
            self._engine.close()
        if self._http is not None:
            self._http.stop()
        if self._connector is not None:
            self._connector.close()  # NOTE: before the store: it may still be publishing
        if self._store is not None:
            self._store.close()
        self._engine = self._http = self._store = self._connector = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sampling_params(self, body: GenerateRequest) -> SamplingParams:
        """The engine's parameters for a request (a prefill worker makes one token). Raises
        InvalidArgument for bad values or token ids outside the vocabulary."""
        assert self._loaded is not None
        mc = self._loaded.config
        if not body.request_id:
            raise InvalidArgument("request_id must not be empty")
        if not all(0 <= t < mc.vocab_size for t in body.prompt_ids):
            raise InvalidArgument(f"prompt_ids must be token ids in 0..{mc.vocab_size - 1}")
        max_tokens = 1 if self.config.role == "prefill" else body.max_tokens
        params = SamplingParams(max_tokens, body.temperature, body.top_p, tuple(body.stop_token_ids),
                                body.ignore_eos, body.seed)  # fmt: skip
        if len(body.prompt_ids) + params.max_tokens > mc.max_position:
            raise InvalidArgument(f"prompt + max_tokens exceed the model's context of {mc.max_position} tokens")
        return params

    def _app(self, engine: EngineThread) -> FastAPI:
        app = FastAPI(title=f"tsukimi worker {self.config.name}")
        assert self._loaded is not None
        health = {"status": "ok", "name": self.config.name, "role": self.config.role,
                  "model": self._loaded.config.identity, "model_name": self._loaded.config.name,
                  "block_tokens": self.config.block_tokens}  # fmt: skip

        @app.get("/health")
        def get_health() -> dict[str, object]:
            return health

        @app.get("/load")
        def get_load() -> dict[str, int]:
            return dataclasses.asdict(engine.load)

        @app.get("/metrics")
        def get_metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            return await self._generate(engine, await request.body())

        return app

    async def _generate(self, engine: EngineThread, raw: bytes) -> Response:
        try:
            body = msgspec.json.decode(raw, type=GenerateRequest)
            params = self.sampling_params(body)
        # NOTE: ValidationError is a DecodeError; msgspec raises UnicodeDecodeError itself for a
        # string that is not UTF-8 (found by tests/fuzz: a 500)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, InvalidArgument) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        rid = body.request_id
        if rid in self._streams:
            return JSONResponse({"error": f"request {rid!r} is already running"}, status_code=409)
        stream = RequestStream(rid, asyncio.get_running_loop(), asyncio.Queue(), len(body.prompt_ids))
        self._streams[rid] = stream
        try:
            engine.submit(AddCommand(tuple(body.prompt_ids), params, stream))
            verdict = await stream.queue.get()
        except ClosedError as exc:
            self._streams.pop(rid, None)
            return JSONResponse({"error": str(exc)}, status_code=503)
        except BaseException:  # cancelled while waiting: the request must not run on
            self._close_stream(engine, stream)
            raise
        assert isinstance(verdict, Verdict)
        if verdict.status != 200:
            self._streams.pop(rid, None)
            return JSONResponse({"error": verdict.message}, status_code=verdict.status)
        logger.debug("streaming %s", rid)
        return _TokenStream(_lines(stream), lambda: self._close_stream(engine, stream))

    def _close_stream(self, engine: EngineThread, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.finished:
            logger.debug("aborting %s: its client went away", stream.request_id)
            with contextlib.suppress(ClosedError):
                engine.submit(AbortCommand(stream))


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
