"""The OpenAI-compatible front end over a `Router`: /v1/models (each model with the
`generation_defaults` a request that omits temperature / top_p runs at), /v1/completions and
/v1/chat/completions (server-sent events when `stream`, one JSON body otherwise), /health,
/metrics (Prometheus, in the app's own registry), /stats (the router's prefix index, KV events
and Conductor counters: `RouterStats`) and /decisions (the router's decision log).

Per request: check the body and tokenize the prompt (chat: messages -> the model's chat
template -> tokens) in tsukimi/serving/openai/validation.py: anything wrong is a 400 with an
OpenAI error body naming the `param` at fault, before any worker is contacted. Then wait for the
first token from the router *before* answering, so that a rejection (429, the Conductor's
reason as the error code) or a dead worker (502/503) is a status code even for streams. Token
events become text through `StopText`: detokenized incrementally (never half a UTF-8
character) and cut at the first stop string, after which the worker stream is closed (the
worker aborts the request). An error after a stream has started arrives as a `data: {"error"}`
event before `data: [DONE]`. An error's HTTP status comes from the serving protocol's one
table (`protocol.http_status`), its OpenAI `code` is the error's own (the Conductor's reason
for a 429). A request id in `X-Request-Id` is used, as vLLM does (one already running: 409);
every answer to a completion, error or not, carries the request's id in `X-Request-Id` (the
client's, else a new one), the key of its record in the decision log:

    GET /decisions?request_id=ID[&request_id=ID2...]   {"decisions": [RECORD, ...]}: the records
                                                       of the ids asked that the log still
                                                       holds, in the order asked
    GET /decisions                                     the newest records (at most 64)

`return_token_ids` (vLLM's extension) adds each choice's token ids to the answer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from tsukimi import auth, httpd
from tsukimi.config import SecurityConfig
from tsukimi.engine.generation_defaults import GenerationDefaults, generation_defaults
from tsukimi.engine.tokenizer import StreamDecoder, Tokenizer
from tsukimi.errors import InvalidArgument, Rejected, TsukimiError, WorkerUnavailable
from tsukimi.serving.dashboard.series import SampledHistogram
from tsukimi.serving.openai.protocol import (
    REQUEST_ID_HEADER,
    Usage,
    delta_choice,
    error_body,
    json_response,
    outcome_of,
    sse_event,
)
from tsukimi.serving.openai.validation import ModelLimits, RequestChecker, model_context_tokens
from tsukimi.serving.protocol import (
    ErrorReply,
    GenerateRequest,
    UpdateWeightsReply,
    UpdateWeightsRequest,
    error_reply,
    http_status,
)
from tsukimi.serving.router.decision_log import RECENT
from tsukimi.serving.router.router import Router, TokenEvent
from tsukimi.serving.router.workers import WorkerStatus

logger = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 256
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ApiMetrics:
    """The router's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"tsukimi_router_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tsukimi_router_worker_{name}", doc, ("worker", "role"), registry=r)

        def histogram(name: str, doc: str) -> SampledHistogram:  # NOTE: raw samples too, for the dashboard
            return SampledHistogram(f"tsukimi_router_{name}_seconds", doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.requests = counter("requests", "Requests by endpoint and outcome", "endpoint", "outcome")
        self.rejections = counter("rejections", "Requests the Conductor rejected, by reason", "reason")
        self.ttft, self.tbt = histogram("ttft", "Time to first token"), histogram("tbt", "Time between tokens")
        # NOTE: observed by the router's door (tsukimi/serving/router/arrivals.py)
        self.admission = histogram("admission", "Time from a request's arrival to its admission decision")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens")
        self.completion_tokens = counter("completion_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_prompt_tokens", "Prompt tokens whose KV was reused")
        self.pool_tokens = counter("pool_prompt_tokens", "Prompt tokens whose KV the first worker loaded from the pool")
        self.waiting = gauge("waiting", "Requests queued at each worker (polled)")
        self.running = gauge("running", "Requests running at each worker (polled)")
        self.in_flight = gauge("in_flight", "This router's requests at each worker")
        self.up = gauge("up", "1 while the worker answers its polls")

    def render(self, workers: Sequence[WorkerStatus]) -> bytes:
        """The exposition text, with the workers' gauges set from `workers` (mutates them)."""
        for w in workers:
            self.waiting.labels(w.name, w.role).set(w.waiting)
            self.running.labels(w.name, w.role).set(w.running)
            self.in_flight.labels(w.name, w.role).set(w.in_flight)
            self.up.labels(w.name, w.role).set(1 if w.healthy else 0)
        return generate_latest(self.registry)


class StopText:
    """Token ids in, text out: incremental detokenization cut at the first stop string.

    A tail of the text that could be the start of a stop string is held back until the next
    tokens decide it. Mutable, one per request.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """The text that `ids` complete and that is certainly before any stop string."""
        return self._scan(self._decoder.push(ids), final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the output."""
        return self._scan(self._decoder.flush(), final=True)

    def _scan(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = (
            0
            if final
            else max((k for s in self._stops for k in range(len(s) - 1, 0, -1) if buf.endswith(s[:k])), default=0)
        )
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]


@dataclass(frozen=True, slots=True)
class _Job:
    """A checked request: what to generate and how to answer."""

    chat: bool
    request_id: str  # the client's (X-Request-Id), else the router's: the decision log's key
    response_id: str
    created: int
    request: GenerateRequest
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    arrival_s: float


class OpenAIServer:
    """The endpoints' logic over `router`; `create_app` wires it into FastAPI.

    Args:
        router: places the requests. tokenizer: the served model's (text, chat template).
        model_name: the id /v1/models lists; requests naming another model get 404.
        default_max_tokens: for chat requests without max_tokens.
        max_context_tokens: the served model's context (prompt + output tokens).
        defaults: the served model's generation defaults, for what a request omits.
    """

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        model_name: str,
        default_max_tokens: int,
        max_context_tokens: int,
        defaults: GenerationDefaults,
    ) -> None:
        self.router, self.tokenizer, self.model_name = router, tokenizer, model_name
        limits = ModelLimits(tokenizer.vocab_size, max_context_tokens)
        self.checker = RequestChecker(tokenizer, model_name, limits, default_max_tokens, defaults)
        self.metrics = ApiMetrics()
        self._created = int(time.time())  # NOTE: calendar seconds for "created"; the Clock is monotonic

    def models(self) -> dict[str, object]:
        model = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "tsukimi"}
        model["generation_defaults"] = self.checker.defaults.body()  # NOTE: an extension, as vLLM's max_model_len
        return {"object": "list", "data": [model]}

    def health(self) -> dict[str, object]:
        workers = self.router.workers()
        return {
            "status": "ok" if all(w.healthy for w in workers) else "degraded",
            "mode": self.router.mode,
            "model": self.model_name,
            "workers": [dataclasses.asdict(w) for w in workers],
        }

    async def complete(self, raw: bytes, chat: bool, request_id: str | None = None) -> Response:
        """Answers one (chat) completion request; never raises a TsukimiError (error bodies).
        `request_id`: the client's (X-Request-Id, as vLLM takes it), else a random one; the
        answer carries it in X-Request-Id."""
        endpoint, rid = "chat" if chat else "completions", request_id or uuid.uuid4().hex
        headers = {REQUEST_ID_HEADER: rid}
        try:
            await self.router.start()
        except TsukimiError as exc:  # NOTE: the deployment's fault (e.g. a role mismatch), not the client's
            return self._error(endpoint, WorkerUnavailable(f"the router cannot start: {exc}"), headers)
        try:
            job = self._parse(raw, chat, rid)
            self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
            events = self.router.generate(job.request, rid)
            first = await anext(events)  # NOTE: before answering, so that failures are status codes
            if job.stream:
                stream = self._sse(job, endpoint, events, first)
                return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
            async with aclosing(events):
                usage, parts, finish = Usage(len(job.request.prompt_ids)), [], "length"
                ids: list[int] = []
                async for delta, reason, tokens in self._texts(job, events, first, usage):
                    parts.append(delta)
                    ids.extend(tokens)
                    finish = reason or finish
        except TsukimiError as exc:
            return self._error(endpoint, exc, headers)
        self.metrics.requests.labels(endpoint, "ok").inc()
        text = "".join(parts)
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        choice.update({"token_ids": ids} if job.return_token_ids else {})
        kind = "chat.completion" if chat else "text_completion"
        return json_response({**self._head(job, kind), "choices": [choice], "usage": usage.body()}, headers=headers)

    def _parse(self, raw: bytes, chat: bool, request_id: str) -> _Job:
        """Checks the body and tokenizes the prompt (pure; tsukimi/serving/openai/validation.py).

        Raises:
            InvalidArgument: a malformed or invalid request (`param`: the field at fault);
            ModelNotFound: another model.
        """
        c = self.checker.check(raw, chat)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        request = GenerateRequest(
            response_id, c.prompt_ids, c.max_tokens, c.temperature, c.top_p, c.seed, c.stop_token_ids, c.ignore_eos
        )
        return _Job(
            chat,
            request_id,
            response_id,
            int(time.time()),
            request,
            c.stops,
            c.stream,
            c.include_usage,
            c.return_token_ids,
            self.router.clock.now(),
        )

    async def _texts(
        self, job: _Job, events: AsyncIterator[TokenEvent], first: TokenEvent, usage: Usage
    ) -> AsyncIterator[tuple[str, str | None, tuple[int, ...]]]:
        """(text, None, token ids) pieces, then (text, finish reason, token ids); records the
        token metrics and `usage`."""
        m = self.metrics
        m.ttft.observe(max(0.0, first.time_s - job.arrival_s))
        _reuse(m, usage, first)
        text, event, previous = StopText(self.tokenizer, job.stops), first, first.time_s
        while True:
            usage.completion_tokens += len(event.token_ids)
            m.completion_tokens.inc(len(event.token_ids))
            delta = text.push(event.token_ids)
            if event.finish_reason is not None and not text.stopped:
                delta += text.flush()
            if text.stopped or event.finish_reason is not None:
                yield delta, "stop" if text.stopped else event.finish_reason, event.token_ids
                return
            if delta or (job.return_token_ids and event.token_ids):  # NOTE: text held back: no chunk
                yield delta, None, event.token_ids
            event = await anext(events)
            _reuse(m, usage, event)
            count = max(1, len(event.token_ids))
            for _ in range(count):
                m.tbt.observe(max(0.0, event.time_s - previous) / count)
            previous = event.time_s

    async def _sse(
        self, job: _Job, endpoint: str, events: AsyncGenerator[TokenEvent, None], first: TokenEvent
    ) -> AsyncIterator[bytes]:
        usage, outcome = Usage(len(job.request.prompt_ids)), "cancelled"
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        head = self._head(job, kind)
        try:
            async with aclosing(events):
                if job.chat:
                    yield sse_event({**head, "choices": [delta_choice({"role": "assistant", "content": ""}, None)]})
                async for delta, finish, ids in self._texts(job, events, first, usage):
                    tokens = {"token_ids": list(ids)} if job.return_token_ids else {}
                    if not job.chat:
                        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, **tokens}
                        yield sse_event({**head, "choices": [choice]})
                        continue
                    if delta or tokens:
                        yield sse_event({**head, "choices": [{**delta_choice({"content": delta}, None), **tokens}]})
                    if finish is not None:
                        yield sse_event({**head, "choices": [delta_choice({}, finish)]})
            if job.include_usage:
                yield sse_event({**head, "choices": [], "usage": usage.body()})
            outcome = "ok"
        except TsukimiError as exc:
            status, body = error_body(exc)
            outcome = outcome_of(status)
            logger.debug("stream %s failed after it started: %s", job.response_id, exc)
            yield sse_event(body)
        finally:
            self.metrics.requests.labels(endpoint, outcome).inc()
        yield b"data: [DONE]\n\n"

    def _head(self, job: _Job, kind: str) -> dict[str, object]:
        return {"id": job.response_id, "object": kind, "created": job.created, "model": self.model_name}

    def _error(self, endpoint: str, exc: TsukimiError, headers: dict[str, str]) -> Response:
        status, body = error_body(exc)
        if isinstance(exc, Rejected):
            self.metrics.rejections.labels(exc.reason).inc()
        self.metrics.requests.labels(endpoint, outcome_of(status)).inc()
        logger.debug("%s request failed with %d: %s", endpoint, status, exc)
        return json_response(body, status, headers)

    def decisions(self, request_ids: list[str]) -> dict[str, object]:
        """The decision log's records of `request_ids` (none: the newest; pure)."""
        log = self.router.decisions
        return {"decisions": log.get(request_ids) if request_ids else log.recent(RECENT)}


def _reuse(metrics: ApiMetrics, usage: Usage, event: TokenEvent) -> None:
    """Takes the request's reuse counts so far (the router's) into `usage` and the metrics."""
    metrics.cached_tokens.inc(max(0, event.cached_tokens - usage.cached_tokens))
    metrics.pool_tokens.inc(max(0, event.pool_tokens - usage.pool_tokens))
    usage.cached_tokens, usage.pool_tokens = event.cached_tokens, event.pool_tokens


def create_app(
    router: Router,
    tokenizer: Tokenizer,
    model_name: str,
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    max_context_tokens: int | None = None,
    defaults: GenerationDefaults | None = None,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts and closes `router`; served without a lifespan
    (httpd.start_in_thread), the router starts on the first request instead.
    `max_context_tokens`: the model's context; None reads it from the model spec `model_name`
    (openai_validation.model_context_tokens; ConfigError if it names no model).
    `defaults`: the model's generation defaults; None reads them from the model spec
    `model_name` (generation_defaults.generation_defaults; ConfigError likewise). Logs them once.

    Returns:
        The app; `app.state.server` is its `OpenAIServer` (metrics, for tests).
    """
    context = model_context_tokens(model_name) if max_context_tokens is None else max_context_tokens
    defaults = generation_defaults(model_name) if defaults is None else defaults
    logger.info("%s: requests without temperature / top_p take %s", model_name, defaults)
    server = OpenAIServer(router, tokenizer, model_name, default_max_tokens, context, defaults)
    secret, seen = SecurityConfig().secret(), auth.ReplayCache()  # NOTE: the workers' secret (docs/security.md)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="tsukimi router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(server.models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.complete(await request.body(), False, request.headers.get("x-request-id"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.complete(await request.body(), True, request.headers.get("x-request-id"))

    @app.get("/health")
    async def health() -> Response:
        return json_response(server.health())

    @app.post("/admin/update_weights")
    async def update_weights(request: Request) -> Response:
        raw = await request.body()
        httpd.check_signature(request, raw, secret, seen)
        try:
            body = msgspec.json.decode(raw, type=UpdateWeightsRequest)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _reply(*error_reply(InvalidArgument(f"invalid request body: {exc}")))
        try:
            outcome = await router.update_weights(body, secret)
        except InvalidArgument as exc:  # NOTE: the backend's workers take none (vLLM)
            return _reply(*error_reply(exc))
        failed = [http_status(r) for r in outcome.values() if isinstance(r, TsukimiError)]
        workers = {
            name: r if isinstance(r, UpdateWeightsReply) else ErrorReply(r.code, str(r)) for name, r in outcome.items()
        }
        return _reply(max(failed, default=200), msgspec.json.encode({"workers": workers}))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(router.workers()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> Response:
        return Response(msgspec.json.encode(router.stats()), media_type="application/json")

    @app.get("/decisions")
    async def decisions(request: Request) -> Response:
        return Response(
            msgspec.json.encode(server.decisions(request.query_params.getlist("request_id"))),
            media_type="application/json",
        )

    return app


def _reply(status: int, body: bytes) -> Response:
    return Response(body, status_code=status, media_type="application/json")
