"""`VllmBackend`: vLLM API servers as the router's workers (tsukimi/serving/router/backend.py),
behind `tsukimi router --backend vllm`: tsukimi's own router (placement, the Conductor, the
decision log) and OpenAI front (tokenizing with the served model's tokenizer) in front of them.

    stream  POST /v1/completions with the prompt's token ids, the request's sampling
            parameters, `return_token_ids` and `stream` (usage with the cached prompt tokens
            at the end: vLLM's `--enable-prompt-tokens-details`); SSE chunks -> TokenChunks
            pd prefill stage: max_tokens 1, not streamed, kv_transfer_params
                {"do_remote_decode": true}; its answer's kv_transfer_params are the hand-over
            pd decode stage: the router's decode request (prompt + first token) with the
                prefill's kv_transfer_params (vLLM's disaggregated-serving protocol)
    poll    GET /metrics: requests running and waiting, KV cache blocks (cache_config_info's
            num_gpu_blocks, kv_cache_usage_perc)
    health  GET /health (vLLM answers 200 once its engine runs); the role is the declared one,
            the block size the config's (vLLM's `--block-size`)
    keys    vLLM's own block hashes (VllmBlockHasher), the index keys its KV events use
    events  each instance's ZMQ publisher, as `vllm.kv_events` names it (kv_events.py), into
            the index tier "hbm" (vLLM's medium "GPU"); with `vllm.pool`, every stored block
            counts as in tsukimi's KV pool (TsukimiConnector saves every full block there)

vLLM reports one count of reused prompt tokens: a stage's `cached_tokens`; at a pd decode stage
every one came over the connector (`pool_tokens`). A stop token (or EOS) ends vLLM's output
ids; tsukimi's workers do not emit it, so it is dropped here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import cast

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tsukimi.clock import Clock
from tsukimi.config import RouterAppConfig, VllmBackendConfig
from tsukimi.errors import ConfigError, InvalidArgument, TsukimiError, WorkerError, WorkerUnavailable
from tsukimi.integrations.vllm.block_hash import VllmBlockHasher, VllmHashConfig
from tsukimi.integrations.vllm.kv_events import EventSource
from tsukimi.scheduler.block_hash import BlockHash
from tsukimi.scheduler.prefix_index import Tier
from tsukimi.serving.protocol import FinishReason, GenerateRequest, Health, Load, TokenChunk
from tsukimi.serving.router.backend import Handover, RouterBackend, Stage, StageChunk
from tsukimi.serving.router.worker_http import open_stream, probe, stream_error
from tsukimi.serving.router.workers import WorkerHandle, WorkerSpec

logger = logging.getLogger(__name__)

REMOTE_DECODE: dict[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
_USAGE = "vllm:kv_cache_usage_perc"
_CACHE_INFO = "vllm:cache_config_info"


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Error(msgspec.Struct):
    message: str = ""


class _Answer(msgspec.Struct):
    """A completion's JSON body, one SSE chunk of it, or an error body (`error`, or vLLM's
    older `{"object": "error", "message": ...}`), as far as the router reads them."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    kv_transfer_params: dict[str, object] | None = None
    error: _Error | None = None
    kind: str = msgspec.field(name="object", default="")
    message: str = ""

    def error_message(self) -> str | None:
        """What went wrong, when this is an error (pure)."""
        if self.error is not None:
            return self.error.message
        return self.message if self.kind == "error" else None


def parse_event_sources(text: str, topic: str) -> dict[str, EventSource]:
    """Parses "NAME=ENDPOINT[+REPLAY],..."; pure. Raises ConfigError on a malformed item."""
    out: dict[str, EventSource] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        endpoint, _, replay = rest.partition("+")
        schemes = ("tcp://", "ipc://")
        if not eq or not endpoint.startswith(schemes) or (replay and not replay.startswith(schemes)):
            raise ConfigError(
                f"a KV event source must look like NAME=ENDPOINT[+REPLAY_ENDPOINT] with tcp:// or "
                f"ipc:// endpoints, got {item!r}"
            )
        out[name.strip()] = EventSource(endpoint.strip(), topic, replay.strip() or None)
    return out


def vllm_backend(config: RouterAppConfig, workers: Sequence[WorkerSpec], clock: Clock) -> RouterBackend:
    """The `BackendFactory` of "vllm" (tsukimi/serving/router/app.py): its instances' hashing and
    event sources from `config.vllm`.

    Raises:
        ConfigError: the model is not the served model's folder (the router needs its tokenizer),
            or `vllm.kv_events` is malformed or names an instance `workers` does not.
    """
    if not Path(config.model).is_dir():
        raise ConfigError(f"the vllm backend needs --model, the served model's folder (its tokenizer): {config.model}")
    sources = parse_event_sources(config.vllm.kv_events, config.vllm.kv_events_topic)
    unknown = set(sources) - {w.name for w in workers}
    if unknown:
        raise ConfigError(f"vllm.kv_events names instances that the workers do not: {sorted(unknown)}")
    r = config.router
    return VllmBackend(config.vllm, sources, clock, r.connect_timeout_s, config.vllm.read_timeout_s)


class VllmBackend:
    """vLLM API servers as workers (see the module). Implements `RouterBackend`.

    Args:
        config: their hashing, events and pool. sources: each instance's KV event publisher.
        clock: times the connect retries. connect_timeout_s / read_timeout_s: per call.
    """

    kind = "vllm"
    tier: Tier = "hbm"
    colocated_conductor = True  # NOTE: their KV events feed the index: "auto" places by cache

    def __init__(
        self,
        config: VllmBackendConfig,
        sources: Mapping[str, EventSource],
        clock: Clock,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 300.0,
    ) -> None:
        self.config, self.pooled, self._sources, self._clock = config, config.pool, dict(sources), clock
        self.hasher = VllmBlockHasher(VllmHashConfig(block_size=config.block_size, algo=config.hash_algo))
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._probe_timeout_s = connect_timeout_s + 1
        self._read_timeout_s = read_timeout_s
        self._client: httpx.AsyncClient | None = None

    @property
    def _http(self) -> httpx.AsyncClient:
        """The connection pool, opened on first use (again after `aclose`)."""
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=httpx.Limits(max_connections=None))
        return self._client

    async def aclose(self) -> None:
        """Closes the connections (idempotent; a later call opens new ones)."""
        if self._client is not None:
            await self._client.aclose()

    def block_keys(self, prompt: Sequence[int], block_tokens: int) -> list[BlockHash]:
        """vLLM's keys of the prompt's full blocks (its own block size; pure)."""
        return cast(list[BlockHash], self.hasher.keys(prompt))

    def events(self, worker: WorkerHandle, health: Health | None) -> EventSource | None:
        """The instance's publisher as the config names it (None: none)."""
        return self._sources.get(worker.spec.name)

    async def health(self, worker: WorkerHandle) -> Health:
        """GET /health: up once it answers 200. Raises RpcTimeout (late) or WorkerError."""
        await probe(self._http, worker, "/health", self._probe_timeout_s)
        return Health("ok", worker.spec.name, worker.spec.role, block_tokens=self.hasher.block_size)

    async def poll(self, worker: WorkerHandle) -> Load:
        """GET /metrics: its requests and KV cache blocks. Raises RpcTimeout (late) or WorkerError."""
        text = (await probe(self._http, worker, "/metrics", self._probe_timeout_s)).text
        values, usage, total = {"running": 0.0, "waiting": 0.0}, 0.0, 0
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in _GAUGES:
                        values[_GAUGES[sample.name]] += sample.value
                    elif sample.name == _USAGE:
                        usage = max(usage, sample.value)
                    elif sample.name == _CACHE_INFO and sample.labels.get("num_gpu_blocks", "").isdigit():
                        total = int(sample.labels["num_gpu_blocks"])
        except ValueError as exc:
            raise WorkerError(f"vLLM instance {worker.spec.name} answered /metrics with garbage: {exc}") from exc
        free = round(total * (1 - min(1.0, usage)))
        return Load(int(values["waiting"]), int(values["running"]), free, total)

    async def stream(
        self, worker: WorkerHandle, request: GenerateRequest, stage: Stage, handover: Handover | None = None
    ) -> AsyncGenerator[StageChunk, None]:
        """POST /v1/completions for one stage (see the module); its chunks, the last with a
        finish reason (a prefill stage's with the hand-over).

        Raises (from the iterator): InvalidArgument (vLLM refused the request, 400);
            WorkerUnavailable (unreachable, or 503); WorkerError (anything else).
        """
        body = _body(request, stage, handover)
        built = self._http.build_request("POST", f"{worker.spec.url}/v1/completions", json=body)
        try:
            response = await open_stream(self._http, built, worker, self._clock)
            try:
                if response.status_code != 200:
                    raise _refusal(worker, response.status_code, await response.aread())
                if stage == "prefill":
                    yield _prefilled(worker, await response.aread())
                    return
                async for chunk in _relay(worker, response, pooled=stage == "decode"):
                    yield chunk
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise stream_error(worker, exc, self._read_timeout_s) from exc


def _body(request: GenerateRequest, stage: Stage, handover: Handover | None) -> dict[str, object]:
    """The /v1/completions body of one stage of `request` (pure)."""
    body: dict[str, object] = {
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop_token_ids": list(request.stop_token_ids),
        "ignore_eos": request.ignore_eos,
        "return_token_ids": True,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    if stage == "prefill":  # NOTE: vLLM's instance does not know it is one: the one token is asked here
        return {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(REMOTE_DECODE)}
    if stage == "decode":
        params = dict(handover or {})
        # NOTE: vLLM would report the prefill's cache hits as the decode's cached tokens;
        # without the key the decode reports its own (what it loaded)
        params.pop("remote_prefill_cached_tokens", None)
        body["kv_transfer_params"] = params
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _prefilled(worker: WorkerHandle, raw: bytes) -> StageChunk:
    """A prefill stage's answer (one JSON body) as its one chunk and hand-over."""
    answer = _decode(worker, raw)
    if not answer.choices:
        raise WorkerError(f"vLLM instance {worker.spec.name} answered the prefill without a choice")
    choice = answer.choices[0]
    finish = _finish(worker, choice.finish_reason) or "length"
    ids = _output(choice, finish)
    cached = _cached(answer)
    return StageChunk(TokenChunk(ids, finish, cached), handover=dict(answer.kv_transfer_params or {}))


async def _relay(worker: WorkerHandle, response: httpx.Response, pooled: bool) -> AsyncGenerator[StageChunk, None]:
    """The SSE chunks as TokenChunks; the finishing one held back until the usage chunk after
    it says what was cached. `pooled`: the cached tokens came over the connector."""
    last: TokenChunk | None = None
    cached = 0
    async for line in response.aiter_lines():
        data = line.removeprefix("data: ").strip() if line.startswith("data: ") else ""
        if not data or data == "[DONE]":
            continue
        answer = _decode(worker, data.encode())
        cached = _cached(answer) or cached
        for choice in answer.choices:
            finish = _finish(worker, choice.finish_reason)
            chunk = TokenChunk(_output(choice, finish), finish)
            if finish is not None:
                last = chunk
            elif chunk.token_ids:
                yield StageChunk(chunk)
    if last is None:
        raise WorkerError(f"vLLM instance {worker.spec.name} ended the stream before the request finished")
    last.cached_tokens, last.pool_tokens = cached, cached if pooled else 0
    yield StageChunk(last)


def _decode(worker: WorkerHandle, raw: bytes) -> _Answer:
    try:
        answer = msgspec.json.decode(raw, type=_Answer)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WorkerError(f"vLLM instance {worker.spec.name} sent garbage: {exc}") from exc
    if (message := answer.error_message()) is not None:
        raise WorkerError(f"vLLM instance {worker.spec.name}: {message}")
    return answer


def _finish(worker: WorkerHandle, reason: str | None) -> FinishReason | None:
    if reason in (None, "stop", "length"):
        return reason  # type: ignore[return-value]
    raise WorkerError(f"vLLM instance {worker.spec.name} ended the request: {reason}")


def _output(choice: _Choice, finish: FinishReason | None) -> list[int]:
    """The choice's token ids, without the stop token (or EOS) that ended it."""
    ids = list(choice.token_ids or [])
    stopped_by_token = finish == "stop" and not isinstance(choice.stop_reason, str)
    return ids[:-1] if stopped_by_token and ids else ids


def _cached(answer: _Answer) -> int:
    details = answer.usage.prompt_tokens_details if answer.usage is not None else None
    return (details.cached_tokens or 0) if details is not None else 0


def _refusal(worker: WorkerHandle, status: int, raw: bytes) -> TsukimiError:
    """The error a non-200 answer stands for: a 400 is the request's fault, a 503 the instance's
    being unavailable, anything else its failure."""
    try:
        message = msgspec.json.decode(raw, type=_Answer).error_message()
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        message = None
    text = message if message is not None else raw[:200].decode(errors="replace")
    if status == 400:
        return InvalidArgument(f"vLLM instance {worker.spec.name}: {text}")
    if status == 503:
        return WorkerUnavailable(f"vLLM instance {worker.spec.name} answered HTTP 503: {text}")
    return WorkerError(f"vLLM instance {worker.spec.name} answered HTTP {status}: {text}")
