"""The `tsukimi router` command: the OpenAI-compatible front end over running workers.

    tsukimi router --model tiny --workers p0=prefill@http://127.0.0.1:9001,d0=decode@http://127.0.0.1:9002

`--config` reads a TOML file of `RouterFileConfig`: a `[router]` table (`RouterConfig`) and a
`[conductor]` table (`ConductorConfig`); `--set section.key=value` overrides either. The
router loads only the model's tokenizer, never its weights.

`--backend vllm` routes vLLM API servers instead (tsukimi/integrations/vllm/proxy.py): the
workers are vLLM instances, `--kv-events NAME=ENDPOINT[+REPLAY],...` their KV event publishers,
and no tokenizer is loaded (the instances' /tokenize is used)::

    tsukimi router --backend vllm --workers v0=colocated@http://127.0.0.1:8100 \
        --kv-events v0=tcp://127.0.0.1:5557+tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console

from tsukimi.config import RouterFileConfig, load
from tsukimi.errors import ConfigError
from tsukimi.serving.router.worker_client import WorkerSpec

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `tsukimi router` on the CLI's subparsers (mutates `sub`); the parser, for the
    backends' own flags (cli.py adds vLLM's: tsukimi/integrations/vllm/launch_args.py)."""
    p = sub.add_parser("router", help="serve the OpenAI-compatible API over running workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="tiny", help="model spec for the tokenizer: tiny, smollm2, PATH.gguf, HF_DIR")
    p.add_argument("--served-model-name", help="the model id /v1/models lists (default: --model)")
    p.add_argument("--workers", required=True, help="NAME=ROLE@URL,... with ROLE colocated, prefill or decode")
    p.add_argument("--mode", choices=("auto", "colocated", "pd"), help="default: router.mode (auto)")
    p.add_argument("--config", help="TOML file: [router] and [conductor] tables")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a setting")
    p.add_argument("--backend", choices=("tsukimi", "vllm"), default="tsukimi", help="the workers' engine")
    p.add_argument("--master", default="", help="the store master (tcp://HOST:PORT or etcd://...), for /dashboard")
    p.add_argument("--master-http", default="", help="the master's http://HOST:PORT: /dashboard counts its objects")
    p.add_argument(
        "--shed-lag-ms",
        type=float,
        default=250.0,
        help="answer new completions 429 overloaded while the router's event loop lags more than this "
        "on average (0: never)",
    )
    return p


def run(args: argparse.Namespace, console: Console) -> None:
    """Runs the router in the foreground until SIGINT/SIGTERM.

    Raises:
        ConfigError: bad workers, settings or model spec.
    """
    from tsukimi import httpd
    from tsukimi.config import SecurityConfig
    from tsukimi.engine.tokenizer import load_tokenizer
    from tsukimi.serving.dashboard import app as dashboard
    from tsukimi.serving.dashboard.store_probe import StoreProbe
    from tsukimi.serving.openai.app import create_app
    from tsukimi.serving.openai.validation import model_context_tokens
    from tsukimi.serving.router import load_shedding
    from tsukimi.serving.router.router import Router

    workers = parse_workers(args.workers)
    overrides = [*args.set, *([f"router.mode={args.mode}"] if args.mode else [])]
    settings = load(RouterFileConfig, args.config, overrides)
    tokenizer = load_tokenizer(args.model)
    router = Router(workers, settings.router, settings.conductor)
    name = args.served_model_name or args.model
    app = create_app(router, tokenizer, name, max_context_tokens=model_context_tokens(args.model))
    dashboard.mount(app, StoreProbe(args.master, args.master_http, SecurityConfig().secret()))
    shed = app.state.server.metrics.rejections.labels("overloaded").inc
    load_shedding.install(app, max(0.0, args.shed_lag_ms) / 1000, shed)
    roles = ", ".join(f"{w.name} ({w.role})" for w in workers)
    console.print(
        f"router ({router.mode}) for {name} on http://{args.host}:{args.port} over {roles}; "
        f"dashboard: http://{args.host}:{args.port}/dashboard",
        highlight=False,
    )
    httpd.serve(app, args.host, args.port, log_level="warning")


def parse_workers(text: str) -> list[WorkerSpec]:
    """Parses "NAME=ROLE@URL,..." (e.g. "p0=prefill@http://127.0.0.1:9001"). Pure.

    Raises:
        ConfigError: a malformed item, a bad role or URL, no worker, or a duplicate name.
    """
    specs: list[WorkerSpec] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = item.partition("=")
        role, at, url = rest.partition("@")
        if not (eq and at):
            raise ConfigError(f"a worker must look like NAME=ROLE@URL, got {item!r}")
        specs.append(WorkerSpec(name.strip(), role.strip(), url.strip().rstrip("/")))  # type: ignore[arg-type]
    if not specs:
        raise ConfigError("--workers names no worker")
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError(f"duplicate worker names in {text!r}")
    return specs
