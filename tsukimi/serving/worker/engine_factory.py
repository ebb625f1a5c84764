"""How a worker builds its engines: `WorkerConfig.engine_factory` (`tsukimi worker
--engine-factory MODULE:CALLABLE`) names a callable taking `LLMEngine`'s arguments and returning
an `LLMEngine`; "" is `LLMEngine` itself.

The worker resolves it once, before it loads the model, and its engine thread calls it for its
first engine and for each fresh one after a failed step (tsukimi/serving/worker/step_isolation.py).
Another factory is how a test gives a real worker process an engine that fails on purpose
(tests/serving/faulty_engine.py): the product's engine carries no test hook.
"""

from __future__ import annotations

import importlib
from typing import Protocol, cast

import torch

from tsukimi.engine.block_manager import KVConnector
from tsukimi.engine.engine import LLMEngine
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.model_runner import Model
from tsukimi.errors import ConfigError


class EngineFactory(Protocol):
    """Builds an engine from `LLMEngine`'s arguments (`LLMEngine` and its subclasses are ones)."""

    def __call__(
        self,
        model: Model,
        layout: KVLayout,
        num_blocks: int,
        eos_ids: tuple[int, ...] = (),
        max_batched_tokens: int = 512,
        connector: KVConnector | None = None,
        storage: memoryview | None = None,
        prefix_caching: bool = True,
        layerwise_loading: bool = False,
        device: torch.device | str = "cpu",
    ) -> LLMEngine: ...


def load_engine_factory(spec: str) -> EngineFactory:
    """The factory `spec` names (imports its module; no other side effect).

    Args:
        spec: "MODULE:CALLABLE", or "" for `LLMEngine`.
    Returns:
        the callable.
    Raises:
        ConfigError: malformed, the module does not import, it has no such name, or the name is
            not callable or is a class other than an `LLMEngine`; the message names the problem.
    """
    if not spec:
        return LLMEngine
    module_name, colon, name = spec.partition(":")
    if not (colon and module_name and name):
        raise ConfigError(f"worker engine_factory must be MODULE:CALLABLE, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"worker engine_factory {spec!r}: module {module_name} does not import: {exc}") from exc
    found: object = module
    for part in name.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"worker engine_factory {spec!r}: {module_name} has no {name}")
        found = getattr(found, part)
    if isinstance(found, type) and not issubclass(found, LLMEngine):
        raise ConfigError(f"worker engine_factory {spec!r}: {name} is a class but not an LLMEngine")
    if not callable(found):
        raise ConfigError(f"worker engine_factory {spec!r}: {name} is not callable")
    return cast(EngineFactory, found)
