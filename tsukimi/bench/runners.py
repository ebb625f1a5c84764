"""Running `tsukimi bench ...` (its arguments are in commands.py): one function per benchmark,
each building the bench's config from the arguments, running it into the one report type
(tsukimi/bench/report.py) and printing that as JSON (`--json`), Markdown (`--markdown`) or a
rich table, with the bench's own view of its figures."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console

from tsukimi.bench.commands import KIB
from tsukimi.bench.report import BenchReport, FigureViews, output_format, print_report
from tsukimi.errors import ConfigError

if TYPE_CHECKING:
    from tsukimi.bench.overload import OverloadConfig
    from tsukimi.bench.serve import ServeBenchConfig

Runner = Callable[[argparse.Namespace, Console], tuple[BenchReport, FigureViews]]


def run(args: argparse.Namespace, console: Console) -> None:
    """Run the benchmark `args.bench` names and print its report. Raises TsukimiError from it."""
    runners: dict[str, Runner] = {
        "transfer": _bench_transfer,
        "store": _bench_store,
        "p2p": _bench_p2p,
        "hot-lab": _bench_hot_lab,
        "serve": _bench_serve,
        "vllm": _bench_vllm,
        "vllm-pd": _bench_vllm_pd,
        "sglang": _bench_sglang,
        "scheduler": _bench_scheduler,
        "cpp": _bench_cpp,
        "layerwise": _bench_layerwise,
        "prefix-link": _bench_prefix_link,
        "kv-burst": _bench_kv_burst,
        "gpu": _bench_gpu,
    }
    if args.bench not in runners:
        raise ConfigError(f"unknown benchmark {args.bench!r}")
    report, views = runners[args.bench](args, console)
    print_report(report, output_format(args.json, args.markdown), console, views)


def _say(console: Console) -> Callable[[str], None]:
    return lambda text: console.print(text, highlight=False)


def _bench_transfer(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import transfer

    if args.lab:
        return _bench_transfer_lab(args, console)
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
        return transfer.run_report(cfg, progress=lambda text: status.update(text)), transfer.VIEWS


def _bench_transfer_lab(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import transfer_lab, transfer_lab_report

    cfg = transfer_lab.TransferLabConfig(
        nic_rate="200mbit" if args.quick else args.nic_rate,
        block_bytes=4 * KIB * KIB if args.quick else 16 * KIB * KIB,
        rounds=1 if args.quick else args.repeats,
        failure_batches=4 if args.quick else 8,
        cut_after_s=0.5 if args.quick else 1.4,
        connections=max(args.connections),
    )
    with console.status("benchmarking tcp over two shaped NICs") as status:
        return transfer_lab.run_report(cfg, progress=lambda text: status.update(text)), transfer_lab_report.VIEWS


def _bench_store(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
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
        return store.run_report(cfg, progress=lambda text: status.update(text)), store.VIEWS


def _bench_p2p(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import p2p, p2p_report

    if args.lab:
        return _bench_p2p_lab(args, console)
    cfg = p2p.P2PBenchConfig(
        receivers=(1, 4) if args.quick else args.receivers or (1, 2, 4, 8),
        checkpoint_bytes=256 * KIB * KIB if args.quick else (args.size or (512 * KIB * KIB,))[0],
        shard_bytes=(args.shard or (64 * KIB * KIB,))[0],
        transports=args.transport,
        systems=args.systems,
        timeout_s=args.timeout,
        repeats=1 if args.quick else args.repeats,
    )
    with console.status("benchmarking the p2p store") as status:
        return p2p.run_report(cfg, progress=lambda text: status.update(text)), p2p_report.VIEWS


def _bench_p2p_lab(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import p2p_lab, p2p_lab_report

    if args.transport != ("tcp",):
        raise ConfigError("--lab runs transport tcp only (the hosts' identities differ: auto would pick it too)")
    receivers = args.receivers or (3 if args.quick else 8,)
    if len(receivers) != 1:
        raise ConfigError(f"--lab takes one receiver count (one host each), got {','.join(map(str, receivers))}")
    default_size = 8 if args.quick else 256
    cfg = p2p_lab.P2PLabConfig(
        receivers=receivers[0],
        link_rate="100mbit" if args.quick else args.link_rate,
        checkpoint_bytes=(args.size or (default_size * KIB * KIB,))[0],
        shard_bytes=(args.shard or ((1 if args.quick else 8) * KIB * KIB,))[0],
        systems=args.systems,
        timeout_s=args.timeout,
        repeats=1 if args.quick else args.repeats,
    )
    with console.status("benchmarking the p2p store across emulated hosts") as status:
        return p2p_lab.run_report(cfg, progress=lambda text: status.update(text)), p2p_lab_report.VIEWS


def _bench_hot_lab(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import hot_lab, hot_lab_report
    from tsukimi.bench.skewed import SkewedWorkload

    quick = args.quick
    workload = SkewedWorkload(
        requests=30 if quick else args.requests,
        shared=args.shared,
        prefix_tokens=256 if quick else args.prefix_tokens,
        rate=args.rate or (4.0 if quick else 1.6),
        seed=args.seed,
    )
    cfg = hot_lab.HotLabConfig(
        holders=3 if quick else args.holders,
        readers=4 if quick else args.readers,
        link_rate=args.link_rate,
        workload=workload,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        hot_threshold=args.hot_threshold,
        timeout_s=args.timeout,
    )
    with console.status("benchmarking hot-key replication across emulated hosts") as status:
        return hot_lab.run_report(cfg, progress=lambda text: status.update(text)), hot_lab_report.VIEWS


def _bench_serve(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import overload, overload_report, serve

    if args.workload == "overload":
        return overload.run_report(overload_config(args), _say(console)), overload_report.VIEWS
    return serve.run_report(serve_config(args), _say(console)), serve.VIEWS


def serve_config(args: argparse.Namespace) -> ServeBenchConfig:
    """`tsukimi bench serve`'s config (not overload) from its arguments; `--quick` shrinks each
    workload (tsukimi/bench/serve.py). Pure."""
    from tsukimi.bench import serve
    from tsukimi.bench.pool_workload import QUICK_POOL, PoolWorkload
    from tsukimi.bench.skewed import SkewedWorkload

    rate = args.rate or 2.0
    chat = serve.ChatWorkload(args.conversations, args.turns, args.prefix_tokens, rate=rate)
    skewed = SkewedWorkload(args.requests, args.shared, args.prefix_tokens, rate=rate, seed=args.seed)
    if args.quick:  # NOTE: the quick sizes keep the other flags (rate, seed, shared)
        chat = dataclasses.replace(serve.QUICK_CHAT, rate=rate)
        quick = serve.QUICK_SKEWED
        skewed = dataclasses.replace(skewed, requests=quick.requests, prefix_tokens=quick.prefix_tokens)
    pool = PoolWorkload(
        args.families,
        args.turns,
        trace_block_tokens=args.trace_block_tokens,
        rate=args.rate or PoolWorkload().rate,
        cache_fraction=args.cache_fraction,
        num_blocks=args.num_blocks,
    )
    if args.quick:
        rate = args.rate or QUICK_POOL.rate
        pool = dataclasses.replace(
            QUICK_POOL, rate=rate, cache_fraction=args.cache_fraction, num_blocks=args.num_blocks
        )
    return serve.ServeBenchConfig(
        args.url,
        args.model,
        args.mode,
        args.workload,
        chat,
        args.trace,
        args.speed,
        serve.QUICK_TRACE_LIMIT if args.quick else args.trace_limit,
        not args.no_compare,
        args.num_blocks or 4096,
        skewed,
        args.prefill,
        args.compare_hot > 0,
        args.compare_hot,
        pool,
    )


def overload_config(args: argparse.Namespace) -> OverloadConfig:
    """`tsukimi bench serve --workload overload`'s config from its arguments (pure)."""
    from tsukimi.bench import overload

    return overload.OverloadConfig(
        args.url,
        args.model,
        args.mode,
        duration_s=10.0 if args.quick else args.duration,
        factor=args.factor,
        calibrate_s=6.0 if args.quick else 16.0,
        num_blocks=args.num_blocks or 512,
        seed=args.seed,
    )


def _bench_vllm(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import vllm

    size = (2, 2) if args.quick else (args.conversations, args.turns)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    cfg = vllm.VllmBenchConfig(args.model, systems, size[0], size[1], args.prefix_tokens, rate=args.rate)
    return vllm.run_report(cfg, _say(console)), vllm.VIEWS


def _bench_vllm_pd(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import vllm_pd

    base = (
        vllm_pd.QUICK
        if args.quick
        else vllm_pd.VllmPdBenchConfig(num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens)
    )
    cfg = dataclasses.replace(base, model=args.model or base.model, save_per_layer=args.save_per_layer)
    return vllm_pd.run_report(cfg, _say(console)), vllm_pd.VIEWS


def _bench_sglang(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import sglang

    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if args.quick:
        cfg = dataclasses.replace(sglang.QUICK, systems=systems)
    else:
        cfg = sglang.SglangBenchConfig(pages=args.pages, tps=tuple(args.tp), systems=systems, repeats=args.repeats)
    return sglang.run_report(cfg, _say(console)), sglang.VIEWS


def _bench_layerwise(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import layerwise

    cfg = layerwise.LayerwiseBenchConfig(args.model, args.prefix_tokens, args.new_tokens, repeats=args.repeats)
    return layerwise.run_report(cfg, _say(console)), layerwise.VIEWS


def _bench_prefix_link(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import prefix_link, prefix_link_report

    cfg = prefix_link.QUICK if args.quick else prefix_link.PrefixLinkConfig()
    cfg = dataclasses.replace(
        cfg,
        **({} if args.quick else {"model": args.model, "link_rates": args.link_rates, "repeats": args.repeats}),
        prefix_tokens=args.prefix_tokens,
        new_tokens=args.new_tokens,
    )
    return prefix_link.run_report(cfg, _say(console)), prefix_link_report.VIEWS


def _bench_scheduler(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import scheduler

    cfg = scheduler.SchedulerBenchConfig(
        args.trace, args.prefill, args.decode, args.indexed_blocks, args.decisions, not args.no_simulate
    )
    with console.status("timing the Conductor"):
        return scheduler.run_report(cfg), scheduler.VIEWS


def _bench_cpp(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import cpp

    cfg = cpp.CppBenchConfig(args.prompt_tokens, args.chunk_tokens, tuple(args.stages), args.repeats)
    with console.status("timing one worker and CPP groups"):
        return cpp.run_report(cfg), cpp.VIEWS


def _bench_kv_burst(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    from tsukimi.bench import kv_burst

    cfg = kv_burst.BurstConfig(
        args.requests,
        args.prompt_tokens,
        args.max_tokens,
        args.ttft_slo,
        args.tbt_slo,
        args.kv_cache_memory,
        args.decode_num_blocks,
        prompts=args.prompts,
        stream=not args.no_stream,
        kv_wait=not args.no_kv_wait,
        warm_up=args.warm_up,
        prefill_token_s=args.prefill_token_s,
    )
    return kv_burst.run_report(cfg, _say(console)), kv_burst.VIEWS


def _bench_gpu(args: argparse.Namespace, console: Console) -> tuple[BenchReport, FigureViews]:
    import torch

    from tsukimi.bench import gpu

    cfg = gpu.GpuBenchConfig.for_device(torch.cuda.is_available(), args.quick, args.shape, args.repeats)
    return gpu.run_report(cfg, _say(console)), gpu.VIEWS
