"""When each completion request reached the router's door, and so how long its admission
decision took: the outermost ASGI wrapper of the router app.

    request in    arrived = the router's clock as the app is called (its headers read, before
                  its body, the shedder and the OpenAI front); a request without X-Request-Id
                  gets one here (a new hex id, as the front would give it), so that it is known
    answer out    at the answer's start, its decision record (the decision log, keyed by that id)
                  takes `arrived_s`; the record's `time_s` is when the router took it to the
                  Conductor, whose decision (accept, queue, reject) follows in the same step of
                  the loop, so `time_s - arrived_s` is the admission decision's latency:
                  `on_admission` gets it (the router's `tsukimi_router_admission_seconds`)

A request that gets no record (a 400 before the router saw it) or whose id names another
request's record (409: that one is running) is not counted. Pure ASGI: streamed answers pass
through unbuffered; O(1) per request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from tsukimi.clock import Clock
from tsukimi.serving.router.decision_log import DecisionLog
from tsukimi.serving.router.load_shedding import ID_HEADER_KEY, SHED_PATHS, Asgi, Message, Receive, Scope, Send

OnAdmission = Callable[[float], None]  # seconds from the door to the decision


def _ignore(seconds: float) -> None:
    """The default `OnAdmission`: nothing."""


class ArrivalStamp:
    """The ASGI wrapper (see the module).

    Args:
        app: the wrapped application. decisions: the router's decision log. clock: the
            router's. on_admission: called with each request's admission latency.
    """

    def __init__(self, app: Asgi, decisions: DecisionLog, clock: Clock, on_admission: OnAdmission = _ignore) -> None:
        self.app, self.decisions, self.clock, self._on_admission = app, decisions, clock, on_admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in SHED_PATHS):
            await self.app(scope, receive, send)
            return
        arrived_s = self.clock.now()
        request_id = next((v for k, v in scope["headers"] if k == ID_HEADER_KEY), b"").decode("latin-1")
        if not request_id:
            request_id = uuid.uuid4().hex
            scope = {**scope, "headers": [*scope["headers"], (ID_HEADER_KEY, request_id.encode("latin-1"))]}
        stamped = False

        async def stamping(message: Message) -> None:
            nonlocal stamped
            if not stamped and message["type"] == "http.response.start":
                stamped = True
                self._stamp(request_id, arrived_s)
            await send(message)

        await self.app(scope, receive, stamping)

    def _stamp(self, request_id: str, arrived_s: float) -> None:
        found = self.decisions.get([request_id])
        if not found or found[0].arrived_s is not None or found[0].time_s < arrived_s:
            return  # NOTE: none (a 400), or another request's (a 409)
        record = found[0]
        record.arrived_s = arrived_s
        self._on_admission(record.time_s - arrived_s)
