"""The `tsukimi prefill-stage` command (registered by tsukimi/cli.py): one stage process of a
CPP prefill group (tsukimi/serving/prefill_group/stage.py). Start the last stage first:

    tsukimi prefill-stage --stage 1 --num-stages 2 --model tiny --port 9102 --master tcp://127.0.0.1:50051
    tsukimi prefill-stage --stage 0 --num-stages 2 --model tiny --port 9101 --downstream 127.0.0.1:9102 \\
        --master tcp://127.0.0.1:50051          # the head: a prefill worker's HTTP API on 9101

`stage_args` (`PrefillStageConfig` -> flags) is the inverse of `stage_config`. Importing this
module is cheap: torch and the engine load only when a stage runs.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from tsukimi.config import DTYPE_NAMES
from tsukimi.config.pipeline import PrefillStageConfig

_FLAGS = (
    "name",
    "stage",
    "num_stages",
    "model",
    "dtype",
    "host",
    "port",
    "downstream",
    "master",
    "segment_bytes",
    "block_tokens",
    "num_blocks",
    "chunk_tokens",
    "threads",
    "link_bytes_s",
    "hop_latency_s",
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi prefill-stage` on the CLI's subparsers (mutates `sub`)."""
    p = sub.add_parser("prefill-stage", help="run one stage of a chunked-pipeline-parallel prefill group")
    d = PrefillStageConfig()
    for flag in _FLAGS:
        default = getattr(d, flag)
        kind = type(default)
        extra = {"choices": DTYPE_NAMES} if flag == "dtype" else {}
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=default, **extra)  # type: ignore[arg-type]


def stage_config(args: argparse.Namespace) -> PrefillStageConfig:
    """The config parsed flags describe (pure). Raises ConfigError."""
    return PrefillStageConfig(**{flag: getattr(args, flag) for flag in _FLAGS})


def stage_args(config: PrefillStageConfig) -> tuple[str, ...]:
    """The `tsukimi prefill-stage ...` arguments of `config` (pure)."""
    return (
        "prefill-stage",
        *(part for flag in _FLAGS for part in ("--" + flag.replace("_", "-"), str(getattr(config, flag)))),
    )


def run(args: argparse.Namespace, console: Console) -> None:
    """Run the stage in the foreground until SIGINT or SIGTERM (prints its address once ready)."""
    from tsukimi.serving.prefill_group.head import run_stage

    config = stage_config(args)
    run_stage(config, lambda address: console.print(f"prefill stage {config.stage} on {address}", highlight=False))
