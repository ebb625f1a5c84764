"""The HTTP side of `tsukimi router --backend vllm`: an OpenAI-compatible front end that places
each request with `VllmBackend` and proxies it to the chosen vLLM API server unchanged.

    POST /v1/completions | /v1/chat/completions
        prompt token ids (given, or from an instance's /tokenize) -> VllmBackend.place
        colocated: forward the body to the instance; stream its bytes back as they come
        pd:        1. the prefill instance: the body with max_tokens=1, stream off and
                      kv_transfer_params {"do_remote_decode": true}
                   2. the decode instance the Conductor admits: the body with the
                      kv_transfer_params the prefill answered (vLLM's disagg proxy protocol)
    GET /v1/models (an instance's), /health ({"status": "ok"} once every instance answered
    its /metrics), /stats (the backend's loads, event counts, index size; JSON)

A rejection is a 429 with an OpenAI error body whose code is the Conductor's reason (as the
built-in router answers); an unreachable instance is a 503 and the instance is marked down.
An instance's own error status and body are passed through.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tsukimi.errors import InvalidArgument, TsukimiError, WorkerUnavailable
from tsukimi.integrations.vllm.backend import InstanceState, Placement, VllmBackend
from tsukimi.serving.openai.protocol import error_body

logger = logging.getLogger(__name__)

Body = dict[str, Any]
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _error(exc: TsukimiError) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)


async def prompt_tokens(backend: VllmBackend, body: Body, chat: bool) -> list[int]:
    """The prompt's token ids: given ones as they are, text through an instance's /tokenize
    (chat: with the model's template). [] when no instance can tokenize it (the request is
    then placed without prefix knowledge). Raises InvalidArgument for a malformed prompt."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # NOTE: a batch is placed by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt must be a string, a list of token ids, or a list of either")
        query: Body = {"model": body.get("model"), "prompt": prompt}
    else:
        if not isinstance(body.get("messages"), list):
            raise InvalidArgument("messages must be a list")
        query = {
            "model": body.get("model"),
            "messages": body["messages"],
            "add_generation_prompt": body.get("add_generation_prompt", True),
        }
    for state in backend.instances.values():
        if not state.healthy:
            continue
        try:
            response = await backend.client.post(f"{state.spec.url}/tokenize", json=query)
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            return list(response.json().get("tokens", []))
    logger.debug("no instance tokenized the prompt: placing it without prefix knowledge")
    return []


async def forward(
    backend: VllmBackend,
    state: InstanceState,
    path: str,
    body: Body,
    placement: Placement,
    on_first: Callable[[], object],
) -> Response:
    """POSTs `body` to `state` and relays the answer (streamed as it comes when `stream`);
    `on_first` runs when the first bytes arrive (or the answer is complete), and the
    placement is finished when the relay ends, normally or not."""
    client, fired = backend.client, False

    def first() -> None:
        nonlocal fired
        if not fired:
            fired = True
            on_first()

    state.in_flight += 1
    try:
        upstream = await client.send(client.build_request("POST", f"{state.spec.url}{path}", json=body), stream=True)
    except httpx.HTTPError as exc:
        state.in_flight -= 1
        state.healthy = False
        backend.finished(placement, 0)
        return _error(WorkerUnavailable(f"vLLM instance {state.spec.name} is unreachable: {exc}"))
    media = upstream.headers.get("content-type", "application/json")
    if not body.get("stream") or upstream.status_code != 200:
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
            state.in_flight -= 1
            first()
            backend.finished(placement, int(body.get("max_tokens") or 0))
        return Response(content, status_code=upstream.status_code, media_type=media)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                first()
                yield chunk
        finally:
            await upstream.aclose()
            state.in_flight -= 1
            first()
            backend.finished(placement, int(body.get("max_tokens") or 0))

    return StreamingResponse(relay(), status_code=200, media_type=media)


async def _disaggregated(backend: VllmBackend, path: str, body: Body, placement: Placement) -> Response:
    """vLLM's PD protocol: a one-token prefill that keeps the KV for remote decode, then the
    decode instance with the kv_transfer_params the prefill returned."""
    prefill = placement.prefill
    first_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(REMOTE_DECODE)}
    first_body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        first_body["max_completion_tokens"] = 1
    prefill.in_flight += 1
    try:
        response = await backend.client.post(f"{prefill.spec.url}{path}", json=first_body)
    except httpx.HTTPError as exc:
        prefill.healthy = False
        backend.finished(placement, 0)
        return _error(WorkerUnavailable(f"vLLM prefill instance {prefill.spec.name} is unreachable: {exc}"))
    finally:
        prefill.in_flight -= 1
    if response.status_code != 200:
        backend.finished(placement, 0)
        return Response(response.content, status_code=response.status_code, media_type="application/json")
    try:
        decode = backend.prefill_done(placement)
    except TsukimiError as exc:
        return _error(exc)
    assert decode is not None
    params = response.json().get("kv_transfer_params")
    if isinstance(params, dict):
        # NOTE: vLLM would report the prefill's cache hits as the decode's cached tokens;
        # without the key the decode reports its own (what it loaded), as tsukimi's PD tests do
        params.pop("remote_prefill_cached_tokens", None)
    return await forward(backend, decode, path, {**body, "kv_transfer_params": params}, placement, lambda: None)


async def _generate(backend: VllmBackend, request: Request, path: str, chat: bool) -> Response:
    await backend.start()  # NOTE: idempotent; an app served without its lifespan starts here
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object")
        tokens = await prompt_tokens(backend, body, chat)
        placement = backend.place(tokens)
    except ValueError as exc:  # NOTE: bad JSON, and InvalidArgument, a ValueError too
        return _error(exc if isinstance(exc, InvalidArgument) else InvalidArgument(f"bad JSON: {exc}"))
    except TsukimiError as exc:
        return _error(exc)
    if backend.mode == "pd":
        return await _disaggregated(backend, path, body, placement)
    return await forward(backend, placement.prefill, path, body, placement, lambda: backend.prefill_done(placement))


def create_app(backend: VllmBackend) -> FastAPI:
    """The FastAPI app over `backend`; starts and closes it with the app."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="tsukimi router (vLLM backend)", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(backend, request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(backend, request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        for state in backend.instances.values():
            try:
                response = await backend.client.get(f"{state.spec.url}/v1/models")
            except httpx.HTTPError:
                continue
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        return _error(WorkerUnavailable("no vLLM instance is reachable"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = all(s.polled and s.healthy for s in backend.instances.values())
        return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(backend.stats())

    return app
