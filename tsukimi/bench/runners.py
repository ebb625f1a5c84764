"""Running `tsukimi bench ...` (its arguments are in commands.py): one function per benchmark,
each building its config from the arguments and printing JSON, Markdown or a rich table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from rich.console import Console

from tsukimi.bench.commands import KIB
from tsukimi.errors import ConfigError


def run(args: argparse.Namespace, console: Console) -> None:
    """Run the benchmark `args.bench` names. Raises TsukimiError from it."""
    runners: dict[str, Callable[[argparse.Namespace, Console], None]] = {
        "transfer": _bench_transfer,
        "store": _bench_store,
        "p2p": _bench_p2p,
        "serve": _bench_serve,
        "vllm": _bench_vllm,
        "scheduler": _bench_scheduler,
        "cpp": _bench_cpp,
        "layerwise": _bench_layerwise,
    }
    if args.bench not in runners:
        raise ConfigError(f"unknown benchmark {args.bench!r}")
    runners[args.bench](args, console)


def _bench_cpp(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import cpp

    cfg = cpp.CppBenchConfig(args.prompt_tokens, args.chunk_tokens, tuple(args.stages), args.repeats)
    result = cpp.run(cfg)
    print(cpp.dumps(result) if args.json else cpp.markdown(result))


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
    _print_report(args, console, report, store.render_markdown, store.render_table)


Report = dict[str, object]


def _print_report(
    args: argparse.Namespace,
    console: Console,
    report: Report,
    markdown: Callable[[Report], str],
    table: Callable[[Report], object],
) -> None:
    """A bench's report as JSON (--json), Markdown (--markdown) or a rich table."""
    if args.json:
        print(json.dumps(report))
    elif args.markdown:
        print(markdown(report))
    else:
        console.print(table(report))


def _bench_p2p(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import p2p, p2p_report

    cfg = p2p.P2PBenchConfig(
        receivers=(1, 4) if args.quick else args.receivers,
        checkpoint_bytes=256 * KIB * KIB if args.quick else args.size[0],
        shard_bytes=args.shard[0],
        transports=args.transport,
        systems=args.systems,
        timeout_s=args.timeout,
        repeats=1 if args.quick else args.repeats,
    )
    with console.status("benchmarking the p2p store") as status:
        report = p2p.run(cfg, progress=lambda text: status.update(text))
    _print_report(args, console, report, p2p_report.render_markdown, p2p_report.render_table)


def _bench_serve(args: argparse.Namespace, console: Console) -> None:
    if args.workload == "overload":
        return _bench_overload(args, console)
    from tsukimi.bench import serve
    from tsukimi.bench.skewed import SkewedWorkload

    chat = serve.ChatWorkload(args.conversations, args.turns, args.prefix_tokens, rate=args.rate)
    skewed = SkewedWorkload(args.requests, args.shared, args.prefix_tokens, rate=args.rate, seed=args.seed)
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
        args.num_blocks or 4096,
        skewed,
        args.prefill,
        args.compare_hot > 0,
        args.compare_hot,
    )
    result = serve.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(json.dumps(result) if args.json else serve.markdown(result))


def _bench_overload(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import overload, overload_report

    cfg = overload.OverloadConfig(
        args.url,
        args.model,
        args.mode,
        duration_s=10.0 if args.quick else args.duration,
        factor=args.factor,
        calibrate_s=6.0 if args.quick else 16.0,
        num_blocks=args.num_blocks or 512,
        seed=args.seed,
    )
    report = overload.run_bench(cfg, lambda text: console.print(text, highlight=False))
    _print_report(args, console, report, overload_report.render_markdown, overload_report.render_table)


def _bench_vllm(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import vllm

    size = (2, 2) if args.quick else (args.conversations, args.turns)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    cfg = vllm.VllmBenchConfig(args.model, systems, size[0], size[1], args.prefix_tokens, rate=args.rate)
    result = vllm.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(json.dumps(result) if args.json else vllm.markdown(result))


def _bench_layerwise(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.bench import layerwise

    cfg = layerwise.LayerwiseBenchConfig(args.model, args.prefix_tokens, args.new_tokens, repeats=args.repeats)
    result = layerwise.run_bench(cfg, lambda text: console.print(text, highlight=False))
    print(layerwise.dumps(result) if args.json else layerwise.markdown(result))


def _bench_scheduler(args: argparse.Namespace, console: Console) -> None:
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
