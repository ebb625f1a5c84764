"""The `tsukimi router` command: `build_router_app` (tsukimi/serving/router/app.py) served in the
foreground, its `RouterAppConfig` read from `--config FILE` with the flags mapped onto its keys:

    tsukimi router --model tiny --workers p0=prefill@http://127.0.0.1:9001,d0=decode@http://127.0.0.1:9002

Precedence: the defaults, then the file, then `--set section.key=value` (or `key=value` for a
top-level key), then the flags. The router loads only the model's tokenizer, never its weights.

`--backend vllm` routes vLLM API servers instead (tsukimi/integrations/vllm/backend.py, which
passes its backend in through the parser's defaults): the workers are vLLM instances, `--model`
the served model's folder (its tokenizer), `--kv-events NAME=ENDPOINT[+REPLAY],...` their KV
event publishers::

    tsukimi router --backend vllm --model .models/tiny --served-model-name tiny \
        --workers v0=colocated@http://127.0.0.1:8100 --kv-events v0=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping

from rich.console import Console

from tsukimi.config import BACKEND_KINDS, POLICY_NAMES, VLLM_HASH_ALGOS, RouterAppConfig, load

logger = logging.getLogger(__name__)

# NOTE: (argparse dest, config key): each flag given overrides its key
FLAG_KEYS: tuple[tuple[str, str], ...] = (
    ("workers", "workers"),
    ("backend", "backend"),
    ("model", "model"),
    ("served_model_name", "served_model_name"),
    ("host", "host"),
    ("port", "port"),
    ("master", "master"),
    ("master_http", "master_http"),
    ("shed_lag_ms", "shed_lag_ms"),
    ("mode", "router.mode"),
    ("policy", "router.policy"),
    ("max_waiting", "router.max_waiting_requests"),
    ("kv_events", "vllm.kv_events"),
    ("kv_events_topic", "vllm.kv_events_topic"),
    ("vllm_block_size", "vllm.block_size"),
    ("vllm_hash_algo", "vllm.hash_algo"),
    ("pool", "vllm.pool"),
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `tsukimi router` on the CLI's subparsers (mutates `sub`); the parser, for the
    backends' own defaults (cli.py lets the vLLM backend add itself:
    tsukimi/integrations/vllm/launch_args.py). Every flag defaults to its config key's value."""
    d = RouterAppConfig()
    p = sub.add_parser("router", help="serve the OpenAI-compatible API over running workers")
    p.add_argument("--config", help="TOML file: top-level keys and [router], [router.cost], [conductor], [vllm]")
    p.add_argument("--set", action="append", default=[], metavar="[SECTION.]KEY=VALUE", help="override a setting")
    p.add_argument("--workers", help="NAME=ROLE@URL,... with ROLE colocated, prefill or decode")
    p.add_argument("--backend", choices=BACKEND_KINDS, help=f"the workers' engine (default: {d.backend})")
    p.add_argument("--host", help=f"default: {d.host}")
    p.add_argument("--port", type=int, help=f"default: {d.port}")
    p.add_argument("--model", help="model spec for the tokenizer: tiny, smollm2, PATH.gguf, HF_DIR (vllm: its folder)")
    p.add_argument("--served-model-name", help="the model id /v1/models lists (default: --model)")
    p.add_argument("--mode", choices=("auto", "colocated", "pd"), help="default: router.mode (auto)")
    p.add_argument("--policy", choices=POLICY_NAMES, help="placement (default: router.policy, auto)")
    p.add_argument("--max-waiting", type=int, help="429 when every worker has more waiting (0: off)")
    p.add_argument("--master", help="the store master (tcp://HOST:PORT or etcd://...), for /dashboard")
    p.add_argument("--master-http", help="the master's http://HOST:PORT: /dashboard counts its objects")
    p.add_argument(
        "--shed-lag-ms",
        type=float,
        help="answer new completions 429 overloaded while the router's event loop lags more than this "
        f"on average (0: never; default {d.shed_lag_ms:g})",
    )
    g = p.add_argument_group("--backend vllm")
    g.add_argument("--kv-events", help="NAME=ENDPOINT[+REPLAY],... per instance (tcp:// or ipc://)")
    g.add_argument(
        "--kv-events-topic", help=f"the topic of the instances' KV events (default: {d.vllm.kv_events_topic})"
    )
    g.add_argument("--vllm-block-size", type=int, help=f"the instances' KV block size (default: {d.vllm.block_size})")
    g.add_argument("--vllm-hash-algo", choices=VLLM_HASH_ALGOS, help="--prefix-caching-hash-algo (default: sha256)")
    g.add_argument("--pool", action="store_true", default=None, help="the instances share tsukimi's KV pool")
    return p


def settings(args: argparse.Namespace) -> RouterAppConfig:
    """The config the flags describe: the file, `--set`, then each flag given (pure but for
    reading the file). Raises ConfigError."""
    flags = [
        f"{key}={json.dumps(value)}" for dest, key in FLAG_KEYS if (value := getattr(args, dest, None)) is not None
    ]
    return load(RouterAppConfig, args.config, [*args.set, *flags])


def run(args: argparse.Namespace, console: Console) -> None:
    """Runs the router in the foreground until SIGINT/SIGTERM.

    Raises:
        ConfigError: bad workers, settings or model spec.
    """
    from tsukimi import httpd
    from tsukimi.serving.router.app import BackendFactory, build_router_app

    config = settings(args)
    backends: Mapping[str, BackendFactory] = getattr(args, "backends", {})
    app = build_router_app(config, backends)
    router = app.state.server.router
    roles = ", ".join(f"{w.name} ({w.role})" for w in router.workers())
    name = config.served_model_name or config.model
    console.print(
        f"router ({config.backend}, {router.mode}, {router.policy}) for {name} on "
        f"http://{config.host}:{config.port} over {roles}; dashboard: http://{config.host}:{config.port}/dashboard",
        highlight=False,
    )
    httpd.serve(app, config.host, config.port, log_level="warning")
