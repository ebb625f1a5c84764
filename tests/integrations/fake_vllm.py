"""A fake vLLM API server for the router's tests: /v1/completions (token-id prompts, JSON or SSE
with `return_token_ids`, slow on purpose, usage with the cached prompt tokens at the end),
/health and /metrics as vLLM 0.32 answers them, recording every body it gets. Each token is
the one before plus 1; a stop token ends the output and, as vLLM's, is among the ids. It caches
every full block of the prompts it served and publishes them as vLLM-shaped KV events
(BlockStored, hashed as vLLM does) on a ZMQ PUB socket; a later prompt reuses its cached
leading blocks (all but the last token's). It answers vLLM's PD protocol: a request with
kv_transfer_params.do_remote_decode gets back kv_transfer_params naming it, one with
do_remote_prefill "loads" every full block of its prompt."""

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
        self.cached: set[int] = set()
        self.pub = context.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._seq = itertools.count()
        self.app = self._build()

    def publish(self, tokens: list[int]) -> None:
        keys = self.hasher.keys(tokens)
        self.cached.update(keys)
        if keys:
            stored = _Stored(keys, None, tokens[: len(keys) * BLOCK_SIZE], BLOCK_SIZE, None, "GPU", None)
            payload = msgspec.msgpack.encode(_Batch(0.0, [stored]))
            self.pub.send_multipart([b"kv", next(self._seq).to_bytes(8, "big"), payload])

    def reused(self, tokens: list[int], remote: bool) -> int:
        """The prompt tokens whose KV it reuses: its cached leading blocks (or, handed over by
        a prefill instance, every one), never the last token's."""
        usable = self.hasher.keys(tokens)[: (len(tokens) - 1) // BLOCK_SIZE]
        hits = len(usable) if remote else next((i for i, k in enumerate(usable) if k not in self.cached), len(usable))
        return hits * BLOCK_SIZE

    @staticmethod
    def output(body: dict[str, Any]) -> tuple[list[int], str]:
        """The token ids it generates for `body` (a stop token included) and why it ended (pure)."""
        prompt, stops = body["prompt"], set(body.get("stop_token_ids") or ())
        out: list[int] = []
        for i in range(int(body.get("max_tokens") or 16)):
            out.append(prompt[-1] + 1 + i)
            if out[-1] in stops:
                return out, "stop"
        return out, "length"

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            prompt: list[int] = body["prompt"]
            params = body.get("kv_transfer_params") or {}
            cached = self.reused(prompt, bool(params.get("do_remote_prefill")))
            ids, finish = self.output(body)
            usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}
            self.publish(prompt)
            if not body.get("stream"):
                reply: dict[str, Any] = {
                    "id": "cmpl-1",
                    "choices": [{"index": 0, "text": "?", "token_ids": ids, "finish_reason": finish}],
                    "usage": usage,
                }
                if params.get("do_remote_decode"):
                    reply["kv_transfer_params"] = {
                        "do_remote_prefill": True,
                        "remote_engine_id": self.name,
                        "remote_block_ids": [1, 2],
                        "remote_host": "127.0.0.1",
                    }
                return JSONResponse(reply)

            async def sse() -> AsyncIterator[bytes]:
                for i, token in enumerate(ids):
                    await asyncio.sleep(CHUNK_DELAY_S)
                    last = i == len(ids) - 1
                    choice = {"index": 0, "text": "?", "token_ids": [token], "finish_reason": finish if last else None}
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [choice]})}\n\n".encode()
                yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        @app.get("/health")
        async def health() -> Response:
            return Response(b"", status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="m"}} 0.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {float(self.waiting)}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.25\n'
                f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0",num_gpu_blocks="1000"}} 1.0\n'
            )
            return Response(text, media_type="text/plain")

        return app
