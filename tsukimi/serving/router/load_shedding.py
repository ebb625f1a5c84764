"""Load shedding at the router's door, on its own event loop's lag.

Everything the router does runs on one asyncio loop: the Conductor, every stream it relays,
/health, /metrics and the dashboard. Under overload that loop falls behind, and a health check
waits behind thousands of relayed tokens (`tsukimi bench serve --workload overload`: /health
p99 1.2 s at 4x the sustainable rate, while the router got a third of a core of a busy host).
Requests the Conductor queues or rejects still cost the loop their parsing and bookkeeping, so
the Conductor alone cannot keep the loop responsive.

`LoopLag` measures the lag: a task sleeps `interval_s` again and again and records how late it
woke (an exponentially weighted mean with a half-life of `halflife_s`). While that mean is over
`threshold_s`, `Shedder` answers new completion requests at once with 429 `overloaded` (the
OpenAI error body, `Retry-After: 1`, the request's `X-Request-Id`: the client's, else a new
one) before their bodies are read, so that the requests in flight, /health and the dashboard
get the loop back. Requests already admitted are never cut. It is a pure ASGI wrapper (no
buffering of streamed responses) in front of the app.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from fastapi import FastAPI

from tsukimi.errors import Rejected
from tsukimi.serving.openai.protocol import REQUEST_ID_HEADER, error_body
from tsukimi.serving.router import lifespan

logger = logging.getLogger(__name__)

SHED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DEFAULT_THRESHOLD_S = 0.25

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]
OnShed = Callable[[str, Rejected], None]  # (the request's id, its rejection): metrics, the decision log
ID_HEADER_KEY = REQUEST_ID_HEADER.lower().encode()  # X-Request-Id as ASGI names it


def _ignore(request_id: str, rejection: Rejected) -> None:
    """The default `OnShed`: nothing."""


class LoopLag:
    """How late this event loop runs (see the module). Mutable; `run` on the loop it measures."""

    def __init__(self, interval_s: float = 0.05, halflife_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._keep = math.exp(-math.log(2) * interval_s / halflife_s)  # weight of the mean per sample
        self.mean_s = 0.0
        self.max_s = 0.0  # the largest lag seen

    def observe(self, lag_s: float) -> None:
        """Takes one sample (also how tests drive it; mutates)."""
        self.mean_s = self._keep * self.mean_s + (1 - self._keep) * lag_s
        self.max_s = max(self.max_s, lag_s)

    async def run(self) -> None:
        """Samples until cancelled."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.observe(max(0.0, time.monotonic() - start - self.interval_s))


class Shedder:
    """The ASGI wrapper: 429 `overloaded` for new completion requests while the loop lags.

    Args:
        app: the wrapped application. lag: the loop's lag. threshold_s: the mean lag from which
            requests are shed (0: never). on_shed: called once per shed request.
    """

    def __init__(self, app: Asgi, lag: LoopLag, threshold_s: float, on_shed: OnShed = _ignore) -> None:
        self.app, self.lag, self.threshold_s, self._on_shed = app, lag, threshold_s, on_shed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lagging = 0 < self.threshold_s < self.lag.mean_s
        if not (lagging and scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in SHED_PATHS):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == ID_HEADER_KEY), b"")
        request_id = given.decode("latin-1") or uuid.uuid4().hex
        detail = f"the router is {self.lag.mean_s:.2f} s behind (over {self.threshold_s} s); retry in 1 s"
        rejection = Rejected("overloaded", detail)
        self._on_shed(request_id, rejection)
        status, body = error_body(rejection)
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (ID_HEADER_KEY, request_id.encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": msgspec.json.encode(body)})


def install(app: FastAPI, threshold_s: float = DEFAULT_THRESHOLD_S, on_shed: OnShed = _ignore) -> LoopLag:
    """Puts a `Shedder` in front of `app` and runs its `LoopLag` with the app's lifespan
    (mutates `app`; call before it serves). threshold_s 0 turns shedding off (the lag is still
    measured: `app.state.loop_lag`)."""
    lag = app.state.loop_lag = LoopLag()
    app.add_middleware(Shedder, lag=lag, threshold_s=threshold_s, on_shed=on_shed)

    lifespan.add(app, lambda: lifespan.running(lag.run(), "router-loop-lag"))
    return lag
