"""The router's tests' fakes, shared by the files of tests/serving: `FakeWorker` (a tiny FastAPI
app implementing the worker API deterministically, on a real port), `router_app` (the whole
router app over fakes, as `tsukimi router` builds it), and the helpers to drive a `Router`
(`request`, `collect`, `run_with`, `tokens`, `close_all`, `dead_url`). The `workers` fixture
that closes the fakes a test made is in conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from tsukimi import httpd
from tsukimi.config import ROUTER_CONDUCTOR, ConductorConfig, RouterAppConfig, RouterConfig
from tsukimi.errors import (
    DuplicateRequest,
    InvalidArgument,
    TsukimiError,
    WorkerError,
    WorkerUnavailable,
)
from tsukimi.netio import free_port
from tsukimi.serving.protocol import ErrorReply, GenerateRequest, error_reply
from tsukimi.serving.router.app import build_router_app
from tsukimi.serving.router.router import Router, TokenEvent
from tsukimi.serving.router.workers import WorkerSpec

T = TypeVar("T")
SCRIPTED: dict[int, Callable[[str], TsukimiError]] = {
    400: InvalidArgument,
    409: DuplicateRequest,
    500: TsukimiError,
    502: WorkerError,
    503: WorkerUnavailable,
}
BLOCK_TOKENS = 4
FAST = RouterConfig(
    poll_interval_s=0.05, connect_timeout_s=1.0, read_timeout_s=5.0, startup_timeout_s=3.0, overhead_probe=False
)


class FakeWorker:
    """The worker API, deterministic: each token is the one before plus 1 (or the ids of
    `reply`, when given), `cached_tokens` = `cached`; a prefill worker makes one token.

    Knobs: `load` for /load, `status` to refuse /generate with the protocol's error of that
    status (`raw` to refuse with a plain-text body instead, as a proxy would), `hang` to never
    answer, `gate` to pause after the first token, `delay_s` between tokens, `abort` to end
    with an engine failure, `cpp` (a dict of `CppHealth`) to say it is a CPP group, `cost` (a
    dict of `CostProfile`) to report a start-up profile. Records
    request bodies in `calls`; `disconnected` is set when a client left before the stream's end.
    """

    def __init__(self, name: str, role: str = "colocated", **knobs: object) -> None:
        self.name, self.role = name, role
        self.configure(**knobs)
        self.handle: httpd.AppHandle = httpd.start_in_thread(self._app())

    def configure(self, **knobs: object) -> None:
        """Sets the knobs (the rest to their defaults) and forgets the calls."""
        self.calls: list[dict[str, object]] = []
        self.load: dict[str, object] = {"waiting": 0, "running": 0, "free_blocks": 100, "total_blocks": 100}
        self.load.update(knobs.pop("load", {}))  # type: ignore[call-overload]
        self.reply: list[int] | None = knobs.pop("reply", None)  # type: ignore[assignment]
        self.status: int | None = knobs.pop("status", None)  # type: ignore[assignment]
        self.raw = bool(knobs.pop("raw", False))
        self.hang = bool(knobs.pop("hang", False))
        self.abort = bool(knobs.pop("abort", False))
        self.delay_s = float(knobs.pop("delay_s", 0.0))  # type: ignore[arg-type]
        self.cached = int(knobs.pop("cached", 0))  # type: ignore[call-overload]
        self.reported_role = str(knobs.pop("reported_role", self.role))
        self.cpp: dict[str, object] | None = knobs.pop("cpp", None)  # type: ignore[assignment]
        self.cost: dict[str, object] | None = knobs.pop("cost", None)  # type: ignore[assignment]
        assert not knobs, knobs
        self.gate = threading.Event()
        self.gated = False
        self.released = threading.Event()
        self.disconnected = threading.Event()

    @property
    def spec(self) -> WorkerSpec:
        return WorkerSpec(self.name, self.role, self.handle.base_url)  # type: ignore[arg-type]

    def close(self) -> None:
        self.released.set()
        self.gate.set()
        self.handle.stop(timeout_s=2.0)

    def tokens(self, body: dict[str, object]) -> list[int]:
        prompt: list[int] = body["prompt_ids"]  # type: ignore[assignment]
        count = 1 if self.role == "prefill" else int(body["max_tokens"])  # type: ignore[call-overload]
        if self.reply is not None:
            return self.reply[:count]
        return [prompt[-1] + 1 + i for i in range(count)]

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> dict[str, object]:
            return {
                "status": "ok",
                "name": self.name,
                "role": self.reported_role,
                "model": "tiny",
                "block_tokens": BLOCK_TOKENS,
                **({"cpp": self.cpp} if self.cpp else {}),
                **({"cost": self.cost} if self.cost else {}),
            }

        @app.get("/load")
        def load() -> dict[str, object]:
            return self.load

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = json.loads(await request.body())
            self.calls.append(body)
            if self.status is not None and self.raw:
                return Response(f"scripted {self.status}", status_code=self.status, media_type="text/plain")
            if self.status is not None:
                status, reply = error_reply(SCRIPTED[self.status](f"scripted {self.status}"))
                assert status == self.status
                return Response(reply, status_code=status, media_type="application/json")
            while self.hang and not self.released.is_set():
                await asyncio.sleep(0.01)
            return StreamingResponse(self._lines(body), media_type="application/x-ndjson")

        return app

    async def _lines(self, body: dict[str, object]) -> AsyncIterator[bytes]:
        tokens, stops = self.tokens(body), body.get("stop_token_ids") or []
        finished = False
        try:
            for i, token in enumerate(tokens):
                if i == 1 and self.gated:
                    while not self.gate.is_set():
                        await asyncio.sleep(0.005)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                stop = token in stops  # type: ignore[operator]
                last = stop or i == len(tokens) - 1
                reason = ("stop" if stop else "length") if last and not self.abort else None
                line: dict[str, object] = {
                    "token_ids": [] if stop else [token],
                    "finish_reason": reason,
                    "cached_tokens": self.cached,
                    "pool_tokens": self.cached // 2,
                }
                if last and self.abort:
                    line["error"] = msgspec.structs.asdict(ErrorReply("worker_error", "the engine failed: scripted"))
                yield json.dumps(line).encode() + b"\n"
                if last:
                    break
            finished = True
        finally:
            if not finished:
                self.disconnected.set()


def close_all(closers: Sequence[Callable[[], None]]) -> None:
    """Runs the closers in parallel threads (each server takes ~0.2 s to stop)."""
    threads = [threading.Thread(target=close) for close in closers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def dead_url() -> str:
    """A loopback URL on which nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


def router_app(
    *specs: WorkerSpec, router: RouterConfig = FAST, conductor: ConductorConfig | None = None, **keys: object
) -> FastAPI:
    """`build_router_app` over `specs` as `tsukimi router` runs it (the tiny model's byte
    tokenizer; no load shedding unless `keys` says: a loaded CI host must not shed tests)."""
    workers = ",".join(f"{s.name}={s.role}@{s.url}" for s in specs)
    settings = {"shed_lag_ms": 0.0, **keys}
    config = RouterAppConfig(workers, router=router, conductor=conductor or ROUTER_CONDUCTOR, **settings)  # type: ignore[arg-type]
    return build_router_app(config)


def request(prompt: Sequence[int], max_tokens: int, rid: str = "r", **extra: object) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), max_tokens, 0.0, **extra)  # type: ignore[arg-type]


async def collect(router: Router, req: GenerateRequest, client_id: str = "") -> list[TokenEvent]:
    return [event async for event in router.generate(req, client_id)]


def run_with(router: Router, body: Callable[[Router], Awaitable[T]]) -> T:
    """Runs coroutine function `body(router)` on a fresh loop, closing the router after."""

    async def main() -> T:
        try:
            return await body(router)
        finally:
            await router.close()

    return asyncio.run(main())


def tokens(events: Sequence[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


PROMPT = list(range(100, 110))  # two full blocks of 4 and a partial one
