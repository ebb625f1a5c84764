"""The `tsukimi` command line. Logging is configured here and nowhere else."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from rich.console import Console
from rich.markup import escape

from tsukimi import extras, lifeline
from tsukimi.bench import commands as bench_commands
from tsukimi.bench import runners as bench_runners
from tsukimi.bench.commands import parse_sizes
from tsukimi.compat import commands as compat_commands
from tsukimi.errors import TsukimiError
from tsukimi.integrations.vllm import launch as vllm_launch
from tsukimi.integrations.vllm import launch_args as vllm_launch_args
from tsukimi.lab import commands as lab_commands
from tsukimi.p2p import commands as p2p_commands
from tsukimi.serving.cluster import up as cluster
from tsukimi.serving.dashboard import top
from tsukimi.serving.prefill_group import commands as prefill_group_commands
from tsukimi.serving.router import commands as router_commands
from tsukimi.serving.worker import commands as worker_commands
from tsukimi.sim import commands as sim_commands

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tsukimi", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug")
    sub = parser.add_subparsers(dest="command", required=True)

    meta = sub.add_parser("metadata-server", help="run the embedded HTTP metadata server")
    meta.add_argument("--host", default="127.0.0.1")
    meta.add_argument("--port", type=int, default=8080)
    meta.add_argument("--config", help="a TOML file (the [security] section: the cluster secret)")
    meta.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")

    master = sub.add_parser("master", help="run the store master (RPC + HTTP) until interrupted")
    holder = sub.add_parser("holder", help="run a store client that contributes memory, until interrupted")
    for cmd in (master, holder):
        cmd.add_argument("--config", help="a TOML file (sections: transfer, metadata, master, client)")
        cmd.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")
    holder.add_argument("--master", help="the master's RPC endpoint, tcp://HOST:PORT")
    holder.add_argument("--segment-bytes", type=parse_sizes, help="memory to contribute, e.g. 1G")

    demo = sub.add_parser("demo", help="two processes move data both ways over each transport")
    demo.add_argument("--seconds", type=float, default=1.0, help="measuring time per cell")
    bench_commands.add_parser(sub)
    prof = sub.add_parser("profile", help="time this engine's prefill and decode steps; fit the cost model")
    prof.add_argument("--model", default="tiny", help="tiny, tiny:SEED, smollm2, a .gguf file or an HF directory")
    prof.add_argument("--block-tokens", type=int, default=16)
    prof.add_argument("--threads", type=int, default=1)
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--json", action="store_true")
    sim_commands.add_parser(sub)
    worker_commands.add_parser(sub)
    prefill_group_commands.add_parser(sub)
    vllm_launch.add_vllm_up_arguments(cluster.add_parser(sub))
    compat_commands.add_parser(sub)
    p2p_commands.add_parser(sub)
    lab_commands.add_parser(sub)
    vllm_launch_args.add_vllm_arguments(router_commands.add_parser(sub))
    top.add_parser(sub)
    return parser


def _profile(args: argparse.Namespace, console: Console) -> None:
    import torch

    from tsukimi.engine.kv_cache import KVLayout
    from tsukimi.engine.profile import profile
    from tsukimi.engine.weights import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    cfg = loaded.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_tokens, cfg.torch_dtype)
    result = profile(loaded.model, layout, repeats=args.repeats).as_dict()
    if args.json:
        print(json.dumps({"model": loaded.source, **result}))
        return
    console.print(f"{loaded.source}: prefill_s = {result['prefill_coef']} . [1, new, attention pairs]")
    console.print(f"decode step_s = {result['decode_coef']} . [1, batch, context tokens]")
    console.print(f"worst relative error of the fit: {result['max_relative_error']}")


def _run_until_signalled(args: argparse.Namespace, console: Console) -> None:
    """`tsukimi master` / `tsukimi holder`: serve until SIGINT or SIGTERM, then clean up."""
    from tsukimi.config import Config, load

    overrides = list(args.set)
    if args.command == "holder":
        if args.master:
            overrides.append(f'client.master="{args.master}"')
        if args.segment_bytes:
            overrides.append(f"client.segment_bytes={args.segment_bytes[0]}")
    config = load(Config, args.config, overrides)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.command == "master":
        from tsukimi.store.master.server import MasterServer

        with MasterServer(config.master, secret=config.security.secret()) as server:
            console.print(f"master: RPC {server.endpoint}, HTTP {server.http.base_url}", highlight=False)
            stop.wait()
    else:
        from tsukimi.store.client import StoreClient

        with StoreClient(config) as client:
            console.print(f"holder {client.engine.name}: {config.client.segment_bytes} bytes mounted", highlight=False)
            stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))  # NOTE: a line per request otherwise
    console = Console(stderr=bool(getattr(args, "json", False) or getattr(args, "markdown", False)))
    lifeline.watch_from_env()  # NOTE: started by `tsukimi up`: stop when it dies (tsukimi/lifeline.py)
    try:
        if args.command == "metadata-server":
            from tsukimi.config import Config, load
            from tsukimi.transfer.metadata import http

            http.serve(args.host, args.port, secret=load(Config, args.config, args.set).security.secret())
        elif args.command in ("master", "holder"):
            _run_until_signalled(args, console)
        elif args.command == "demo":
            from tsukimi import demo

            demo.run(console, args.seconds)
        elif args.command == "bench":
            extras.require("bench", "tsukimi bench")
            bench_runners.run(args, console)
        elif args.command == "profile":
            _profile(args, console)
        elif args.command == "worker":
            worker_commands.run(args, console)
        elif args.command == "prefill-stage":
            prefill_group_commands.run(args, console)
        elif args.command == "up":
            (vllm_launch.run_vllm_cluster if args.engine == "vllm" else cluster.run)(args, console)
        elif args.command == "router":
            (vllm_launch_args.run_vllm if args.backend == "vllm" else router_commands.run)(args, console)
        elif args.command == "top":
            top.run(args, console)
        elif args.command == "sim":
            sim_commands.run(args, console)
        elif args.command == "compat":
            return compat_commands.run(args, console)
        elif args.command == "p2p":
            return p2p_commands.run(args, console)
        elif args.command == "lab":
            return lab_commands.run(args, console)
    except TsukimiError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")  # NOTE: not markup: "tsukimi[plots]" stays
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
