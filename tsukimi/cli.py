"""The `tsukimi` command line. Logging is configured here and nowhere else."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from rich.console import Console

from tsukimi.compat import commands as compat_commands
from tsukimi.errors import TsukimiError
from tsukimi.integrations.vllm import launch as vllm_launch
from tsukimi.integrations.vllm import launch_args as vllm_launch_args
from tsukimi.p2p import commands as p2p_commands
from tsukimi.serving import cluster, router_commands, worker_commands
from tsukimi.sim import commands as sim_commands

logger = logging.getLogger(__name__)
KIB = 1 << 10


def _sizes(text: str) -> tuple[int, ...]:
    """'64K,1M,4M' -> bytes."""
    units = {"K": KIB, "M": KIB * KIB, "G": KIB * KIB * KIB}
    out = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("IB").removesuffix("B")
        scale = units.get(item[-1:], 1)
        digits = item[:-1] if item[-1:] in units else item
        if not digits.isdigit():
            raise argparse.ArgumentTypeError(f"not a size: {item!r} (use e.g. 64K,1M,4M)")
        out.append(int(digits) * scale)
    return tuple(out)


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


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
    holder.add_argument("--segment-bytes", type=_sizes, help="memory to contribute, e.g. 1G")

    demo = sub.add_parser("demo", help="two processes move data both ways over each transport")
    demo.add_argument("--seconds", type=float, default=1.0, help="measuring time per cell")
    _add_bench_parsers(sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True))
    prof = sub.add_parser("profile", help="time this engine's prefill and decode steps; fit the cost model")
    prof.add_argument("--model", default="tiny", help="tiny, tiny:SEED, smollm2, a .gguf file or an HF directory")
    prof.add_argument("--block-tokens", type=int, default=16)
    prof.add_argument("--threads", type=int, default=1)
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--json", action="store_true")
    sim_commands.add_parser(sub)
    worker_commands.add_parser(sub)
    vllm_launch.add_vllm_up_arguments(cluster.add_parser(sub))
    compat_commands.add_parser(sub)
    p2p_commands.add_parser(sub)
    vllm_launch_args.add_vllm_arguments(router_commands.add_parser(sub))
    return parser


def _add_bench_parsers(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench transfer | store | scheduler | layerwise | serve | vllm` (mutates `bench`)."""
    tr = bench.add_parser("transfer", help="Transfer Engine throughput between two processes")
    tr.add_argument(
        "--transport",
        type=_names,
        default=("auto", "shm", "cma", "cma+prepared", "tcp"),
        help="auto,shm,cma,cma+prepared,tcp[,nixl]",
    )
    tr.add_argument("--op", type=_names, default=("write", "read"), help="write,read")
    tr.add_argument("--block-sizes", type=_sizes, default=(64 * KIB, KIB * KIB, 4 * KIB * KIB, 16 * KIB * KIB))
    tr.add_argument("--batch", type=int, default=4, help="requests per batch")
    tr.add_argument("--connections", type=_ints, default=(1, 4), help="tcp connections per peer, e.g. 1,4")
    tr.add_argument("--duration", type=float, default=2.0, help="seconds measured per cell and round")
    tr.add_argument("--warmup", type=float, default=0.5)
    tr.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians")
    tr.add_argument("--compare-mooncake", action="store_true", help="also run the real Mooncake TE (tcp)")
    tr.add_argument("--compare-nixl", action="store_true", help="also run NIXL itself (make nixl)")
    tr.add_argument("--quick", action="store_true", help="a small grid for CI smoke runs")
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    tr.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/benchmarks.md)")
    st = bench.add_parser("store", help="store put/get throughput and latency (vs Mooncake's store)")
    st.add_argument("--value-sizes", type=_sizes, default=(4 * KIB, 64 * KIB, KIB * KIB, 4 * KIB * KIB, 16 * KIB * KIB))
    st.add_argument("--replicas", type=_ints, default=(1, 2))
    st.add_argument("--api", type=_names, default=("single", "batch"), help="single,batch")
    st.add_argument("--batch", type=int, default=16)
    st.add_argument("--holder-bytes", type=_sizes, default=(1 << 30,), help="memory per holder, e.g. 1G")
    st.add_argument("--duration", type=float, default=0.5, help="seconds of puts, then of gets, per cell")
    st.add_argument("--repeats", type=int, default=3)
    st.add_argument("--force-tcp", action="store_true", help="every process uses tcp (not shared memory)")
    st.add_argument("--compare-mooncake", action="store_true", help="also run the real Mooncake store")
    st.add_argument("--tiers", type=_names, default=("memory", "disk"), help="memory,disk: where the objects read live")
    st.add_argument("--disk-holder-bytes", type=_sizes, default=(64 << 20,), help="memory per holder, disk tier")
    st.add_argument("--quick", action="store_true", help="a small grid for CI")
    st.add_argument("--json", action="store_true")
    st.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/benchmarks.md)")
    _add_model_bench_parsers(bench)


def _add_model_bench_parsers(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench scheduler | layerwise | serve | vllm` (mutates `bench`)."""
    sc = bench.add_parser("scheduler", help="Conductor decision latency and whole-trace simulation time")
    sc.add_argument("--trace", default=sim_commands.DEFAULT_TRACE)
    sc.add_argument("--prefill", type=int, default=32)
    sc.add_argument("--decode", type=int, default=32)
    sc.add_argument("--indexed-blocks", type=int, default=100_000)
    sc.add_argument("--decisions", type=int, default=5000)
    sc.add_argument("--no-simulate", action="store_true", help="skip the whole-trace simulations")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--markdown", action="store_true")
    lw = bench.add_parser("layerwise", help="TTFT with a pooled prefix: layer-wise loading vs loading it whole first")
    lw.add_argument("--model", default="tiny")
    lw.add_argument("--prefix-tokens", type=int, default=2048)
    lw.add_argument("--new-tokens", type=int, default=16)
    lw.add_argument("--repeats", type=int, default=5)
    lw.add_argument("--json", action="store_true")
    sv = bench.add_parser("serve", help="drive the OpenAI API with a workload (TTFT, TBT, reuse)")
    sv.add_argument("--url", default="", help="a running API; default: start `tsukimi up` per run")
    sv.add_argument("--model", default="tiny")
    sv.add_argument("--mode", choices=("pd", "colocated"), default="pd")
    sv.add_argument("--workload", choices=("chat", "trace"), default="chat")
    sv.add_argument("--conversations", type=int, default=8)
    sv.add_argument("--turns", type=int, default=4)
    sv.add_argument("--prefix-tokens", type=int, default=2000)
    sv.add_argument("--rate", type=float, default=2.0, help="chat: first turns per second")
    sv.add_argument("--trace", default=sim_commands.DEFAULT_TRACE)
    sv.add_argument("--speed", type=float, default=1.0, help="trace: replay this many times faster")
    sv.add_argument("--trace-limit", type=int, default=200)
    sv.add_argument("--no-compare", action="store_true", help="one run with reuse only")
    sv.add_argument("--json", action="store_true")
    sv.add_argument("--markdown", action="store_true")
    vl = bench.add_parser("vllm", help="two vLLM instances: round-robin vs tsukimi (pool + Conductor) vs Mooncake")
    vl.add_argument("--model", default="tiny", help="tiny, smollm2 (under .models/) or a Hugging Face folder")
    vl.add_argument("--systems", default="vllm_rr,tsukimi,mooncake_store", help="comma-separated, in run order")
    vl.add_argument("--conversations", type=int, default=8)
    vl.add_argument("--turns", type=int, default=4)
    vl.add_argument("--prefix-tokens", type=int, default=2000)
    vl.add_argument("--rate", type=float, default=2.0, help="first turns per second")
    vl.add_argument("--quick", action="store_true", help="a smoke run: 2 conversations of 2 turns")
    vl.add_argument("--json", action="store_true")


def _bench_store(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import store

    quick = args.quick
    cfg = store.StoreBenchConfig(
        value_bytes=(64 * KIB, KIB * KIB) if quick else args.value_sizes,
        apis=args.api,
        replicas=(1,) if quick else args.replicas,
        batch=4 if quick else args.batch,
        holder_bytes=(128 << 20) if quick else args.holder_bytes[0],
        duration_s=0.2 if quick else args.duration,
        repeats=1 if quick else args.repeats,
        force_tcp=args.force_tcp,
        compare_mooncake=args.compare_mooncake,
        tiers=args.tiers,
        disk_holder_bytes=(32 << 20) if quick else args.disk_holder_bytes[0],
    )
    with console.status("benchmarking the store") as status:
        report = store.run(cfg, progress=lambda text: status.update(text))
    if args.json:
        print(json.dumps(report))
    elif args.markdown:
        print(store.render_markdown(report))
    else:
        console.print(store.render_table(report))


def _bench_serve(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import serve

    chat = serve.ChatWorkload(args.conversations, args.turns, args.prefix_tokens, rate=args.rate)
    cfg = serve.ServeBenchConfig(
        args.url,
        args.model,
        args.mode,
        args.workload,
        chat,
        args.trace,
        args.speed,
        args.trace_limit,
        not args.no_compare,
    )
    result = serve.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(json.dumps(result) if args.json else serve.markdown(result))


def _bench_vllm(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import vllm

    size = (2, 2) if args.quick else (args.conversations, args.turns)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    cfg = vllm.VllmBenchConfig(args.model, systems, size[0], size[1], args.prefix_tokens, rate=args.rate)
    result = vllm.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(json.dumps(result) if args.json else vllm.markdown(result))


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


def _bench_layerwise(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import layerwise

    cfg = layerwise.LayerwiseBenchConfig(args.model, args.prefix_tokens, args.new_tokens, repeats=args.repeats)
    result = layerwise.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(layerwise.dumps(result) if args.json else layerwise.markdown(result))


def _bench_scheduler(args: argparse.Namespace) -> None:
    from tsukimi.bench import scheduler

    cfg = scheduler.SchedulerBenchConfig(
        args.trace, args.prefill, args.decode, args.indexed_blocks, args.decisions, not args.no_simulate
    )
    result = scheduler.run(cfg)
    print(scheduler.dumps(result) if args.json else scheduler.markdown(result))


def _bench_transfer(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import transfer

    cfg = transfer.TransferBenchConfig(
        transports=args.transport,
        ops=args.op,
        block_bytes=(64 * KIB, 4 * KIB * KIB) if args.quick else args.block_sizes,
        batch=args.batch,
        connections=args.connections,
        duration_s=0.3 if args.quick else args.duration,
        warmup_s=0.1 if args.quick else args.warmup,
        repeats=1 if args.quick else args.repeats,
        compare_mooncake=args.compare_mooncake,
        compare_nixl=args.compare_nixl,
    )
    with console.status("benchmarking") as status:
        result = transfer.run(cfg, progress=lambda text: status.update(text))
    if args.json:
        print(json.dumps(transfer.to_json(result)))
    elif args.markdown:
        print(transfer.render_markdown(transfer.to_json(result)))
    else:
        console.print(transfer.render_table(result))


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
        elif args.command == "bench" and args.bench == "transfer":
            _bench_transfer(args, console)
        elif args.command == "bench" and args.bench == "store":
            _bench_store(args, console)
        elif args.command == "bench" and args.bench == "serve":
            _bench_serve(args, console)
        elif args.command == "bench" and args.bench == "vllm":
            _bench_vllm(args, console)
        elif args.command == "bench" and args.bench == "scheduler":
            _bench_scheduler(args)
        elif args.command == "bench" and args.bench == "layerwise":
            _bench_layerwise(args, console)
        elif args.command == "profile":
            _profile(args, console)
        elif args.command == "worker":
            worker_commands.run(args, console)
        elif args.command == "up":
            (vllm_launch.run_vllm_cluster if args.engine == "vllm" else cluster.run)(args, console)
        elif args.command == "router":
            (vllm_launch_args.run_vllm if args.backend == "vllm" else router_commands.run)(args, console)
        elif args.command == "sim":
            sim_commands.run(args, console)
        elif args.command == "compat":
            return compat_commands.run(args, console)
        elif args.command == "p2p":
            return p2p_commands.run(args, console)
    except TsukimiError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
