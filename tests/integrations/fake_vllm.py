"""A fake vLLM API server for the router's tests: /v1/completions (JSON or SSE, slow on
purpose), /tokenize, /metrics and /v1/models as vLLM 0.32 answers them, recording every body
it gets; it publishes vLLM-shaped KV events (BlockStored of the prompt's full blocks, hashed
as vLLM does) on a ZMQ PUB socket after each completion, and answers vLLM's PD protocol: a
request with kv_transfer_params.do_remote_decode gets back kv_transfer_params naming it."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tsukimi.integrations.vllm.block_hash import VllmBlockHasher, VllmHashConfig

BLOCK_SIZE = 4
CHUNK_DELAY_S = 0.15


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored]
    data_parallel_rank: int | None = 0


class FakeVllm:
    """One fake instance: `app` to serve, `bodies` it received, `endpoint` of its events."""

    def __init__(self, name: str, context: zmq.Context[zmq.Socket[bytes]], waiting: int = 0) -> None:
        self.name, self.waiting = name, waiting
        self.bodies: list[dict[str, Any]] = []
        self.hasher = VllmBlockHasher(VllmHashConfig(block_size=BLOCK_SIZE))
        self.pub = context.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._seq = itertools.count()
        self.app = self._build()

    def publish(self, tokens: list[int]) -> None:
        keys = self.hasher.keys(tokens)
        if keys:
            stored = _Stored(keys, None, tokens[: len(keys) * BLOCK_SIZE], BLOCK_SIZE, None, "GPU", None)
            payload = msgspec.msgpack.encode(_Batch(0.0, [stored]))
            self.pub.send_multipart([b"kv", next(self._seq).to_bytes(8, "big"), payload])

    def chunks(self, body: dict[str, Any]) -> list[bytes]:
        """The SSE chunks a streamed answer to `body` consists of (pure)."""
        count = int(body.get("max_tokens") or 16)
        out = [{"id": "cmpl-1", "choices": [{"index": 0, "text": f"{self.name}-{i}"}]} for i in range(count)]
        return [f"data: {json.dumps(c)}\n\n".encode() for c in out] + [b"data: [DONE]\n\n"]

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            prompt = body.get("prompt")
            tokens = prompt if isinstance(prompt, list) else [ord(c) for c in str(prompt or body.get("messages"))]
            reply: dict[str, Any] = {"id": "cmpl-1", "choices": [{"index": 0, "text": self.name}]}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                reply["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "remote_engine_id": self.name,
                    "remote_block_ids": [1, 2],
                    "remote_host": "127.0.0.1",
                }
            self.publish(tokens)
            if not body.get("stream"):
                return JSONResponse(reply)

            async def sse() -> AsyncIterator[bytes]:
                for chunk in self.chunks(body):
                    await asyncio.sleep(CHUNK_DELAY_S)
                    yield chunk

            return StreamingResponse(sse(), media_type="text/event-stream")

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            body = await request.json()
            text = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
            tokens = [ord(c) for c in str(text)]
            return JSONResponse({"count": len(tokens), "max_model_len": 8192, "tokens": tokens})

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="m"}} 0.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {float(self.waiting)}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.25\n'
            )
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

        return app
