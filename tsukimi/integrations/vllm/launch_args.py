"""`tsukimi router --backend vllm`: the vLLM backend offered to `tsukimi router`, whose flags
(`--kv-events`, `--vllm-block-size`, `--pool`, ...) are config keys of the router's
(`RouterAppConfig.vllm`, tsukimi/serving/router/commands.py). The router itself is the one
`build_router_app` serves; only the backend is vLLM's (tsukimi/integrations/vllm/backend.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console

from tsukimi.clock import Clock
from tsukimi.config import RouterAppConfig
from tsukimi.serving.router import commands
from tsukimi.serving.router.backend import RouterBackend
from tsukimi.serving.router.workers import WorkerSpec


def vllm_backend(config: RouterAppConfig, workers: Sequence[WorkerSpec], clock: Clock) -> RouterBackend:
    """The "vllm" `BackendFactory`, importing the backend only when a router uses it. Raises ConfigError."""
    from tsukimi.integrations.vllm.backend import vllm_backend as build

    return build(config, workers, clock)


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """Offers the vLLM backend to `tsukimi router` (mutates `p`'s defaults: `args.backends`)."""
    p.set_defaults(backends={"vllm": vllm_backend})


def run_vllm(args: argparse.Namespace, console: Console) -> None:
    """`tsukimi router --backend vllm`: the one router command (commands.run). Raises ConfigError."""
    commands.run(args, console)
