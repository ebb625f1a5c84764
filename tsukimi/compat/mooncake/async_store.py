"""`mooncake.async_store`: `MooncakeDistributedStoreAsync`, the store whose every method also
exists as a coroutine: `await store.async_put(key, value)` runs `store.put(key, value)` on the
event loop's default executor (a thread), as the wheel's does; the coroutine function is made
on first use and kept on the instance. A name without the `async_` prefix, or one whose
method does not exist, is an AttributeError naming both.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine

from tsukimi.compat.mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]

AsyncMethod = Callable[..., Coroutine[object, object, object]]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """`MooncakeDistributedStore` with `async_<method>` coroutines (see the module)."""

    def __getattr__(self, name: str) -> AsyncMethod:
        if not name.startswith("async_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        method = getattr(self, name.removeprefix("async_"), None)
        if method is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} (nor {name.removeprefix('async_')!r})"
            )
        if not callable(method):
            raise AttributeError(f"{name.removeprefix('async_')!r} is not callable")
        coroutine = _in_executor(method)
        setattr(self, name, coroutine)  # NOTE: made once per instance and name
        return coroutine


def _in_executor(method: Callable[..., object]) -> AsyncMethod:
    @functools.wraps(method)
    async def call(*args: object, **kwargs: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(method, *args, **kwargs))

    return call
