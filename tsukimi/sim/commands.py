"""The `tsukimi sim ...` commands: `cache` (one global pool, the issue's exact semantics),
`run` (one simulation of the whole cluster) and `experiment` (the paper's experiments).

`--trace` defaults to the 1,000-request sample kept in a tsukimi checkout
(data/traces/conversation_sample.jsonl, relative to the current directory); the wheel does not
ship it, so elsewhere a command without `--trace` is an error that says to give one
(`checked_trace`). Plots need matplotlib (the `plots` extra): a command asked to draw checks
for it before it simulates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tsukimi import extras
from tsukimi.config import REJECTION_NAMES, RESERVATION_NAMES, SIMULATOR_CONDUCTOR, SimConfig
from tsukimi.errors import ConfigError
from tsukimi.eviction import POLICY_NAMES
from tsukimi.sim.cache_replay import parse_capacities, run_cache_command
from tsukimi.sim.report import Slo, decode_load, summarize, table
from tsukimi.sim.simulator import simulate
from tsukimi.sim.trace import load_trace

DEFAULT_TRACE = "data/traces/conversation_sample.jsonl"  # NOTE: in a checkout, relative to the current directory
_EXPERIMENTS = {"1": "cache_policies", "2": "global_vs_local", "3": "effective_capacity", "4": "overload"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = sub.add_parser("sim", help="trace-driven simulation").add_subparsers(dest="sim", required=True)
    cache = sim.add_parser("cache", help="replay a trace through one global pool: hit ratio vs capacity")
    cache.add_argument("--trace", default=DEFAULT_TRACE)
    cache.add_argument("--policy", default="lru", help="lru, lfu, length-aware (comma-separated for several)")
    cache.add_argument("--capacity-blocks", default="1000,5000,10000,50000,inf")
    cache.add_argument("--json", action="store_true")
    run = sim.add_parser("run", help="simulate the cluster on a trace")
    run.add_argument("--trace", default=DEFAULT_TRACE)
    run.add_argument("--shape", choices=("pd", "colocated"), default="pd")
    run.add_argument("--prefill", type=int, default=8)
    run.add_argument("--decode", type=int, default=8)
    run.add_argument("--colocated", type=int, default=16)
    run.add_argument("--router", choices=("round_robin", "least_load"), default="least_load")
    run.add_argument("--speed", type=float, default=1.0, help="replay this many times faster")
    run.add_argument("--rejection", choices=REJECTION_NAMES, default="predicted")
    run.add_argument("--reuse", choices=("global", "local"), default="global")
    run.add_argument("--policy", choices=[p.replace("_", "-") for p in POLICY_NAMES], default="lru")
    run.add_argument("--cache-blocks", default="6000", help="per instance; inf = unbounded")
    run.add_argument("--ssd-blocks", type=int, default=0, help="SSD tier per prefill instance (0: none)")
    run.add_argument("--reservation", choices=RESERVATION_NAMES, default="p90", help="decode KV reserved per output")
    run.add_argument("--ttft-slo", type=float, default=30.0)
    run.add_argument("--tbt-slo", type=float, default=0.1)
    run.add_argument(
        "--no-kv-wait", action="store_true", help="reject when decode KV lacks (default: wait if the TTFT SLO allows)"
    )
    run.add_argument("--json", action="store_true")
    run.add_argument("--plot", help="write decode load over time to this PNG")
    cpp = sim.add_parser("cpp", help="long-prompt TTFT with and without chunked pipeline parallelism")
    cpp.add_argument("--trace", default=DEFAULT_TRACE)
    cpp.add_argument("--prefill", type=int, default=8, help="prefill nodes")
    cpp.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="group sizes (1 = no CPP)")
    cpp.add_argument("--speed", type=float, default=1.0, help="replay this many times faster")
    cpp.add_argument("--min-tokens", type=int, default=32768, help="the shortest prompt offered a group")
    cpp.add_argument("--plot", help="write the TTFT curve to this PNG")
    cpp.add_argument("--json", action="store_true")
    exp = sim.add_parser("experiment", help="run one of the paper's experiments (docs/reproduction.md)")
    exp.add_argument("number", choices=(*_EXPERIMENTS, "all"))
    exp.add_argument("--trace", default=DEFAULT_TRACE)
    exp.add_argument("--plots", default="docs/img", help="directory for the PNG plots")
    exp.add_argument("--json", action="store_true", help="print the figures as JSON instead of Markdown")


def checked_trace(path: str) -> str:
    """`path`, unless it is the default trace and that is not here (see the module).

    Raises:
        ConfigError: the default trace is missing; the message says to give `--trace FILE`.
    """
    if path == DEFAULT_TRACE and not Path(path).is_file():
        raise ConfigError(
            f"the default trace {DEFAULT_TRACE} is not here (it is relative to a tsukimi checkout): "
            "give one with --trace FILE (a Mooncake JSONL trace)"
        )
    return path


def run(args: argparse.Namespace, console: Console) -> None:
    """Run `tsukimi sim ...` (prints its report).

    Raises:
        ConfigError: bad flags, the default trace missing, or a plot asked for without matplotlib.
        InvalidArgument: the trace cannot be read or is malformed.
    """
    args.trace = checked_trace(args.trace)
    if args.sim == "experiment":  # NOTE: before it simulates: minutes lost otherwise
        extras.require("plots", "tsukimi sim experiment (it draws the paper's figures)")
    elif getattr(args, "plot", None):
        extras.require("plots", f"tsukimi sim {args.sim} --plot")
    if args.sim == "cache":
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        text = run_cache_command(args.trace, policies, parse_capacities(args.capacity_blocks), args.json)
        print(text)
    elif args.sim == "run":
        _run(args, console)
    elif args.sim == "cpp":
        _cpp(args)
    else:
        _experiment(args, console)


def _run(args: argparse.Namespace, console: Console) -> None:
    trace = load_trace(args.trace)
    cache = parse_capacities(args.cache_blocks)
    if len(cache) != 1:
        raise ConfigError("--cache-blocks takes one value")
    sim = SimConfig(
        shape=args.shape,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_colocated=args.colocated,
        router=args.router,
        speed=args.speed,
        policy=args.policy,
        cache_blocks=cache[0],
        ssd_blocks=args.ssd_blocks,
        reservation=args.reservation,
    )
    conductor = dataclasses.replace(
        SIMULATOR_CONDUCTOR,
        rejection=args.rejection,
        reuse=args.reuse,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        kv_wait=not args.no_kv_wait,
    )
    with _progress(console, not args.json) as bar:
        task = bar.add_task("simulating", total=len(trace))
        result = simulate(trace, sim, conductor, progress=lambda n: bar.update(task, completed=n))
    report = summarize(result, Slo(args.ttft_slo, args.tbt_slo))
    if args.plot:
        from tsukimi.sim import plots

        every_s = sim.sample_every_s * max(1, int(result.end_s / sim.sample_every_s / 500))
        plots.decode_load({args.shape: decode_load(result, every_s)}, Path(args.plot), Path(args.trace).name)
    if args.json:
        print(json.dumps({"trace": Path(args.trace).name, "sim": _plain(sim), "report": report}))
    else:
        # NOTE: pre-rendered at its own width: print() does not wrap it again
        print(table(f"{Path(args.trace).name} x{args.speed}", [(args.shape, report)]), end="")


def _cpp(args: argparse.Namespace) -> None:
    from tsukimi.sim import cpp

    cfg = cpp.CppSimConfig(args.prefill, tuple(args.stages), speed=args.speed, min_tokens=args.min_tokens)
    curve = cpp.ttft_curve(load_trace(args.trace), cfg)
    if args.plot:
        cpp.plot(curve, Path(args.plot), Path(args.trace).name)
    print(json.dumps(curve) if args.json else cpp.markdown(curve))


def _experiment(args: argparse.Namespace, console: Console) -> None:
    from tsukimi.sim import experiments

    trace = load_trace(args.trace)
    numbers = list(_EXPERIMENTS) if args.number == "all" else [args.number]
    outcomes = []
    with _progress(console, True) as bar:
        task = bar.add_task("experiments", total=None)
        for number in numbers:
            function = getattr(experiments, _EXPERIMENTS[number])
            outcome = function(trace, Path(args.plots), lambda text: bar.update(task, description=text))
            outcomes.append(outcome)
    if args.json:
        print(json.dumps({o.name: o.data for o in outcomes}))
        return
    for outcome in outcomes:
        print(f"### {outcome.name} ({Path(args.trace).name})\n\n{outcome.markdown}\n")
        for plot in outcome.plots:
            print(f"![{outcome.name}]({plot})\n")


def _progress(console: Console, visible: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not visible,
        transient=True,
    )


def _plain(sim: SimConfig) -> dict[str, object]:
    return {f: getattr(sim, f) for f in sim.__dataclass_fields__}
