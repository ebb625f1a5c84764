"""`tsukimi router --backend vllm`: its extra flags and how they become a `VllmBackend`."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from rich.console import Console

from tsukimi.config import RouterFileConfig, load
from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.block_hash import HASH_ALGOS, VllmHashConfig

if TYPE_CHECKING:  # NOTE: the backend needs pyzmq; plain `tsukimi` commands must not import it
    from tsukimi.integrations.vllm.backend import VllmBackend
    from tsukimi.integrations.vllm.kv_events import EventSource

logger = logging.getLogger(__name__)


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The flags only `--backend vllm` reads (mutates `p`)."""
    g = p.add_argument_group("--backend vllm")
    g.add_argument("--kv-events", default="", help="NAME=ENDPOINT[+REPLAY],... per instance (tcp:// or ipc://)")
    g.add_argument("--kv-events-topic", default="kv", help="the topic of the instances' KV events")
    g.add_argument("--vllm-block-size", type=int, default=128, help="the instances' KV block size in tokens")
    g.add_argument("--vllm-hash-algo", choices=HASH_ALGOS, default="sha256", help="--prefix-caching-hash-algo")
    g.add_argument("--pool", action="store_true", help="the instances share tsukimi's KV pool (TsukimiConnector)")
    g.add_argument("--policy", choices=("conductor", "round_robin"), default="conductor", help="placement")
    g.add_argument("--max-waiting", type=int, default=0, help="429 when every instance has more waiting (0: off)")


def parse_event_sources(text: str, topic: str) -> dict[str, EventSource]:
    """Parses "NAME=ENDPOINT[+REPLAY],..."; pure. Raises ConfigError on a malformed item."""
    from tsukimi.integrations.vllm.kv_events import EventSource

    out: dict[str, EventSource] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        endpoint, _, replay = rest.partition("+")
        schemes = ("tcp://", "ipc://")
        if not eq or not endpoint.startswith(schemes) or (replay and not replay.startswith(schemes)):
            raise ConfigError(
                f"a KV event source must look like NAME=ENDPOINT[+REPLAY_ENDPOINT] with tcp:// or "
                f"ipc:// endpoints, got {item!r}"
            )
        out[name.strip()] = EventSource(endpoint.strip(), topic, replay.strip() or None)
    return out


def backend_from_args(args: argparse.Namespace) -> VllmBackend:
    """The `VllmBackend` the flags describe. Raises ConfigError."""
    from tsukimi.integrations.vllm.backend import VllmBackend, VllmInstance, VllmRouterConfig
    from tsukimi.serving.router.commands import parse_workers

    workers = parse_workers(args.workers)
    sources = parse_event_sources(args.kv_events, args.kv_events_topic)
    unknown = set(sources) - {w.name for w in workers}
    if unknown:
        raise ConfigError(f"--kv-events names instances that --workers does not: {sorted(unknown)}")
    settings = load(RouterFileConfig, args.config, list(args.set))
    config = VllmRouterConfig(
        hash=VllmHashConfig(block_size=args.vllm_block_size, algo=args.vllm_hash_algo),
        pool=args.pool,
        policy=args.policy,
        max_waiting_requests=args.max_waiting,
        poll_interval_s=settings.router.poll_interval_s,
        connect_timeout_s=settings.router.connect_timeout_s,
    )
    instances = [VllmInstance(w.name, w.role, w.url, sources.get(w.name)) for w in workers]
    return VllmBackend(instances, config, settings.router, settings.conductor)


def run_vllm(args: argparse.Namespace, console: Console) -> None:
    """Serves the vLLM backend's API in the foreground until SIGINT/SIGTERM. Raises ConfigError."""
    from tsukimi import httpd
    from tsukimi.integrations.vllm.proxy import create_app

    backend = backend_from_args(args)
    roles = ", ".join(f"{s.spec.name} ({s.spec.role})" for s in backend.instances.values())
    console.print(
        f"router (vllm, {backend.mode}, {args.policy}) on http://{args.host}:{args.port} over {roles}", highlight=False
    )
    httpd.serve(create_app(backend), args.host, args.port, log_level="warning")
