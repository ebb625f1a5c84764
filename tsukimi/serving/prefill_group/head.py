"""The head of a prefill group as the router sees it: stage 0 behind the prefill worker's
internal HTTP API (`POST /generate` answers one NDJSON `TokenChunk` with the first token,
`GET /health` says role "prefill" and, in `cpp`, what the router's Conductor needs to price the
group: stages, chunk, hop costs; `GET /load`), and `run_stage`, the `tsukimi prefill-stage`
process (head or a later stage) until SIGINT or SIGTERM.

Only greedy requests (temperature 0) are served: the group computes an argmax.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

import msgspec
from fastapi import FastAPI, Request, Response

from tsukimi import httpd
from tsukimi.config.pipeline import PrefillStageConfig
from tsukimi.errors import InvalidArgument, TsukimiError
from tsukimi.scheduler.cpp import hop_s_per_token
from tsukimi.serving.prefill_group.stage import StageProcess
from tsukimi.serving.protocol import CppHealth, GenerateRequest, Health, Load, TokenChunk, error_reply

logger = logging.getLogger(__name__)


def head_app(process: StageProcess) -> FastAPI:
    """The HTTP API of a started head stage (see the module)."""
    cfg, loaded = process.config, process.loaded
    assert loaded is not None
    mc = loaded.config
    app = FastAPI(title=f"tsukimi prefill group {cfg.name}")
    in_flight = [0]
    hop_token_s = hop_s_per_token(mc.hidden_size, mc.torch_dtype.itemsize, cfg.link_bytes_s)
    cpp = CppHealth(cfg.num_stages, cfg.chunk_tokens, hop_token_s, cfg.hop_latency_s)

    @app.get("/health")
    def get_health() -> Response:
        health = Health("ok", cfg.name, "prefill", mc.identity, mc.name, cfg.block_tokens, cpp=cpp)
        return Response(msgspec.json.encode(health), media_type="application/json")

    @app.get("/load")
    def get_load() -> Response:
        load = Load(in_flight[0], 0, 0, cfg.num_blocks)
        return Response(msgspec.json.encode(load), media_type="application/json")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=GenerateRequest)
            _check(body, mc.vocab_size, mc.max_position)
            in_flight[0] += 1
            try:
                token = await asyncio.to_thread(process.prefill, body.prompt_ids)
            finally:
                in_flight[0] -= 1
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            return _error(InvalidArgument(f"invalid request body: {exc}"))
        except TsukimiError as exc:
            return _error(exc)
        stops = {*body.stop_token_ids, *(() if body.ignore_eos else mc.eos_token_ids)}
        chunk = TokenChunk([token], "stop" if token in stops else "length", weights_version="initial")
        return Response(msgspec.json.encode(chunk) + b"\n", media_type="application/x-ndjson")

    return app


def _check(body: GenerateRequest, vocab_size: int, max_position: int) -> None:
    if body.temperature > 0:
        raise InvalidArgument("a CPP prefill group serves greedy requests only (temperature 0)")
    if body.weights_version not in ("", "initial"):
        raise InvalidArgument(f"a CPP prefill group runs the initial weights, not {body.weights_version!r}")
    if not all(0 <= t < vocab_size for t in body.prompt_ids):
        raise InvalidArgument(f"prompt token ids must be in 0..{vocab_size - 1}")
    if len(body.prompt_ids) + 1 > max_position:
        raise InvalidArgument(f"the prompt exceeds the model's context of {max_position} tokens")


def _error(error: TsukimiError) -> Response:
    status, body = error_reply(error)
    return Response(body, status_code=status, media_type="application/json")


def run_stage(config: PrefillStageConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Run one stage until SIGINT or SIGTERM (call from the main thread), then shut it down.

    Args:
        config: the stage.
        on_ready: called once it serves, with its address (the head's URL, a later stage's
            link HOST:PORT).
    """
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    process = StageProcess(config)
    http: httpd.AppHandle | None = None
    address: str
    try:
        process.start()
        if config.stage == 0:
            http = httpd.start_in_thread(head_app(process), config.host, config.port)
            address = http.base_url
        else:
            address = f"{config.host}:{process.listen_port}"
        if on_ready is not None:
            on_ready(address)
        stop.wait()
        logger.info("CPP stage %s stopping", config.name)
    finally:
        if http is not None:
            http.stop()
        process.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
