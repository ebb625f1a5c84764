"""The `tsukimi worker` and `tsukimi up` commands (registered by tsukimi/cli.py).

    tsukimi worker --role prefill --model smollm2 --port 9001 --master tcp://127.0.0.1:50051
    tsukimi up [--config cluster.toml] [--model tiny] [--mode colocated] [--set workers.decode=2]

`worker_config` (flags -> `WorkerConfig`) and `worker_args` (`WorkerConfig` -> flags) are the
one mapping between the two; `tsukimi up` starts its workers with `worker_args`. Importing this
module is cheap: torch and the engine load only when a worker runs.
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console

from tsukimi.config import ROLES, WORKER_DTYPE_NAMES, WorkerConfig

logger = logging.getLogger(__name__)

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """'256M' -> bytes (K, M, G are powers of 1024; plain digits are bytes)."""
    item = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _UNITS.get(item[-1:], 1)
    digits = item[:-1] if item[-1:] in _UNITS else item
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256M or 1G)")
    return int(digits) * scale


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi worker` on the CLI's subparsers (mutates `sub`)."""
    worker = sub.add_parser("worker", help="run one inference worker (the router's internal HTTP API)")
    d = WorkerConfig()
    worker.add_argument("--name", default=d.name, help="the worker's name (in /health and the router)")
    worker.add_argument("--role", choices=ROLES, default=d.role)
    worker.add_argument(
        "--model",
        default=d.model,
        help="tiny, tiny:SEED, smollm2, random:PRESET[:SEED] (llama3-8b, smollm2-135m), PATH.gguf or a HF directory",
    )
    worker.add_argument(
        "--device", default=d.device, help="auto (cuda when a GPU is present, else cpu), cpu, cuda or cuda:N"
    )
    worker.add_argument(
        "--dtype", choices=WORKER_DTYPE_NAMES, default=d.dtype, help="auto: bfloat16 on cuda, float32 on cpu"
    )
    worker.add_argument("--host", default=d.host)
    worker.add_argument("--port", type=int, default=d.port, help="0 = an ephemeral port (printed once serving)")
    worker.add_argument("--block-tokens", type=int, default=d.block_tokens, help="tokens per KV block")
    worker.add_argument(
        "--num-blocks", type=int, default=d.num_blocks, help="KV cache size in blocks (0 = from --kv-cache-memory)"
    )
    worker.add_argument(
        "--kv-cache-memory",
        default=d.kv_cache_memory,  # NOTE: a share: e.g. 0.1
        help="KV cache memory: bytes (512MiB, 1G) or a share of memory available (0.1)",
    )
    worker.add_argument(
        "--max-batched-tokens", type=int, default=d.max_batched_tokens, help="tokens per forward at most"
    )
    worker.add_argument(
        "--master", default=d.master, help="the store master, tcp://HOST:PORT (prefill and decode roles)"
    )
    worker.add_argument(
        "--segment-bytes", type=_size, default=d.segment_bytes, help="memory given to the KV pool, e.g. 1G"
    )
    worker.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads")
    worker.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    worker.add_argument(
        "--layerwise-loading",
        action="store_true",
        help="load pooled KV layer by layer during the forward, not whole before it",
    )
    worker.add_argument(
        "--no-profile-on-start",
        action="store_true",
        help="skip the start-up profile (the router then uses its configured cost model)",
    )
    worker.add_argument(
        "--metadata-url", default=d.metadata_url, help="the P2P store's metadata service, for live weight updates"
    )
    worker.add_argument(
        "--engine-factory",
        default=d.engine_factory,
        metavar="MODULE:CALLABLE",
        help="builds the engines from LLMEngine's arguments (default: LLMEngine; e.g. a test's faulty engine)",
    )


def run(args: argparse.Namespace, console: Console) -> None:
    """Run `tsukimi worker` in the foreground until SIGINT or SIGTERM.

    Raises:
        ConfigError: bad settings or model spec. PeerError: the store failed.
    """
    _worker(args, console)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The `WorkerConfig` that parsed `tsukimi worker` flags describe (pure).

    Raises:
        ConfigError: an invalid combination (e.g. a prefill worker without --master).
    """
    return WorkerConfig(
        name=args.name,
        role=args.role,
        model=args.model,
        host=args.host,
        port=args.port,
        block_tokens=args.block_tokens,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_batched_tokens=args.max_batched_tokens,
        master=args.master,
        segment_bytes=args.segment_bytes,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        prefix_caching=not args.no_prefix_caching,
        metadata_url=args.metadata_url,
        layerwise_loading=args.layerwise_loading,
        profile_on_start=not args.no_profile_on_start,
        engine_factory=args.engine_factory,
    )


def worker_args(config: WorkerConfig) -> tuple[str, ...]:
    """The `tsukimi worker ...` arguments that start a worker of `config` (pure; the inverse of
    `worker_config`): name, role and port first, --master only when set."""
    return (
        "worker",
        "--name",
        config.name,
        "--role",
        config.role,
        "--port",
        str(config.port),
        "--model",
        config.model,
        "--device",
        config.device,
        "--dtype",
        config.dtype,
        "--host",
        config.host,
        "--threads",
        str(config.threads),
        "--block-tokens",
        str(config.block_tokens),
        "--num-blocks",
        str(config.num_blocks),
        "--kv-cache-memory",
        config.kv_cache_memory,
        "--max-batched-tokens",
        str(config.max_batched_tokens),
        "--segment-bytes",
        str(config.segment_bytes),
        *(("--master", config.master) if config.master else ()),
        *(() if config.prefix_caching else ("--no-prefix-caching",)),
        *(("--layerwise-loading",) if config.layerwise_loading else ()),
        *(() if config.profile_on_start else ("--no-profile-on-start",)),
        *(("--metadata-url", config.metadata_url) if config.metadata_url else ()),
        *(("--engine-factory", config.engine_factory) if config.engine_factory else ()),
    )


def _worker(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.serving.worker.server import Worker, run_worker

    config = worker_config(args)

    def ready(worker: Worker) -> None:
        console.print(f"worker {config.name} ({config.role}, {config.model}) on {worker.base_url}", highlight=False)

    run_worker(config, ready)
