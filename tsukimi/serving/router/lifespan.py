"""Parts of the router app's lifespan beyond the router's own: `add(app, part)` runs `part`
inside the lifespan the app has so far (the router started before it, closed after it), e.g. the
shedder's lag probe (load_shedding.py) and the health port (health_port.py); `running` keeps a
background task alive for the span of a part."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

Part = Callable[[], AbstractAsyncContextManager[None]]


def add(app: FastAPI, part: Part) -> None:
    """Wraps `app`'s lifespan so that `part()` is entered once the lifespan before it is, and
    left before it is (mutates `app`; call before it serves)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        context: AbstractAsyncContextManager[None] = inner(a)  # type: ignore[assignment]
        async with context, part():
            yield

    app.router.lifespan_context = lifespan


@asynccontextmanager
async def running(work: Coroutine[object, object, None], name: str) -> AsyncIterator[None]:
    """Runs `work` as a task named `name` while inside; cancels it and waits for it on leaving."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
