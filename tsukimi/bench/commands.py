"""`tsukimi bench ...`: the benchmarks' command-line arguments (runners.py runs them). Every
one prints the one report type (tsukimi/bench/report.py): `--json`, `--markdown`, else a table.

transfer, store, p2p      the Transfer Engine, the store, the P2P store (processes on this host)
scheduler, cpp, layerwise the Conductor's decisions, chunked pipeline prefill, layer-wise loading
prefix-link               a pooled prefix across a shaped lab link vs recomputing it, and the Conductor's estimate
serve, kv-burst           the serving stack end to end (`tsukimi up`'s plan, launched here)
vllm, vllm-pd             vLLM instances: three ways of serving them; the PD hand-over
sglang                    SGLang's HiCache L3 calls: MooncakeStore (real, under compat) vs tsukimi's backend
gpu                       the raw host<->GPU copies and prefill/reuse limits (issue 23)
"""

from __future__ import annotations

import argparse

from tsukimi.sim import commands as sim_commands

KIB = 1 << 10


def parse_sizes(text: str) -> tuple[int, ...]:
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


def _add_output(parser: argparse.ArgumentParser) -> None:
    """--json / --markdown: how the report is printed (a rich table without either)."""
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--markdown", action="store_true", help="print the report as Markdown (docs/benchmarks.md)")


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi bench` on the CLI's subparsers (mutates `sub`)."""
    _add_io_parsers(sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True))


def _add_io_parsers(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Every `tsukimi bench ...` subcommand (mutates `bench`)."""
    tr = bench.add_parser("transfer", help="Transfer Engine throughput between two processes")
    tr.add_argument(
        "--transport",
        type=parse_names,
        default=("auto", "shm", "cma", "cma+prepared", "tcp"),
        help="auto,shm,cma,cma+prepared,tcp[,nixl]",
    )
    tr.add_argument("--op", type=parse_names, default=("write", "read"), help="write,read")
    tr.add_argument("--block-sizes", type=parse_sizes, default=(64 * KIB, KIB * KIB, 4 * KIB * KIB, 16 * KIB * KIB))
    tr.add_argument("--batch", type=int, default=4, help="requests per batch")
    tr.add_argument("--connections", type=parse_ints, default=(1, 4), help="tcp connections per peer, e.g. 1,4")
    tr.add_argument("--duration", type=float, default=2.0, help="seconds measured per cell and round")
    tr.add_argument("--warmup", type=float, default=0.5)
    tr.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians")
    tr.add_argument("--compare-mooncake", action="store_true", help="also run the real Mooncake TE (tcp)")
    tr.add_argument("--compare-nixl", action="store_true", help="also run NIXL itself (make nixl)")
    tr.add_argument("--quick", action="store_true", help="a small grid for CI smoke runs (--lab: 200mbit, 16 MiB)")
    tr.add_argument("--lab", action="store_true", help="tcp over two shaped NICs between two emulated hosts (root)")
    tr.add_argument("--nic-rate", default="300mbit", help="--lab: every NIC's link, each way (tbf), e.g. 300mbit")
    _add_output(tr)
    st = bench.add_parser("store", help="store put/get throughput and latency (vs Mooncake's store)")
    st.add_argument(
        "--value-sizes", type=parse_sizes, default=(4 * KIB, 64 * KIB, KIB * KIB, 4 * KIB * KIB, 16 * KIB * KIB)
    )
    st.add_argument("--replicas", type=parse_ints, default=(1, 2))
    st.add_argument("--api", type=parse_names, default=("single", "batch"), help="single,batch")
    st.add_argument("--batch", type=int, default=16)
    st.add_argument("--holder-bytes", type=parse_sizes, default=(1 << 30,), help="memory per holder, e.g. 1G")
    st.add_argument("--duration", type=float, default=0.5, help="seconds of puts, then of gets, per cell")
    st.add_argument("--repeats", type=int, default=3)
    st.add_argument("--force-tcp", action="store_true", help="every process uses tcp (not shared memory)")
    st.add_argument("--compare-mooncake", action="store_true", help="also run the real Mooncake store")
    st.add_argument(
        "--tiers", type=parse_names, default=("memory", "disk"), help="memory,disk: where the objects read live"
    )
    st.add_argument("--disk-holder-bytes", type=parse_sizes, default=(64 << 20,), help="memory per holder, disk tier")
    st.add_argument("--quick", action="store_true", help="a small grid for CI")
    _add_output(st)
    _add_p2p_bench_parser(bench)
    _add_hot_lab_parser(bench)
    _add_model_bench_parsers(bench)


def _add_p2p_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench p2p` (mutates `bench`)."""
    pp = bench.add_parser("p2p", help="one origin to N receivers: P2P store vs origin-only reads vs gloo broadcast")
    pp.add_argument(
        "--receivers", type=parse_ints, default=None, help="receiver counts, e.g. 1,2,4,8 (--lab: one count, default 8)"
    )
    pp.add_argument(
        "--size", type=parse_sizes, default=None, help="checkpoint bytes, e.g. 512MiB (default; --lab: 256MiB)"
    )
    pp.add_argument("--shard", type=parse_sizes, default=None, help="shard bytes, e.g. 64MiB (default; --lab: 8MiB)")
    pp.add_argument(
        "--lab",
        action="store_true",
        help="across emulated hosts (root): the origin, each receiver and the metadata server on hosts of their own",
    )
    pp.add_argument("--link-rate", default="1gbit", help="--lab: every host's link, each way (tbf), e.g. 1gbit")
    pp.add_argument("--transport", type=parse_names, default=("tcp",), help="tcp (as gloo), auto (cma here), or both")
    pp.add_argument("--systems", type=parse_names, default=("tsukimi", "naive", "gloo"), help="tsukimi,naive,gloo")
    pp.add_argument("--timeout", type=float, default=300.0, help="seconds any one step may take")
    pp.add_argument("--repeats", type=int, default=3, help="rounds per cell; figures are the median round's")
    pp.add_argument(
        "--quick", action="store_true", help="N = 1, 4 with a 256 MiB checkpoint (--lab: N = 3, 8 MiB, 100mbit links)"
    )
    _add_output(pp)


def _add_hot_lab_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench hot-lab` (tsukimi/bench/hot_lab.py; mutates `bench`)."""
    hl = bench.add_parser(
        "hot-lab", help="hot-key replication off vs on: skewed pool reads across emulated hosts (root), links shaped"
    )
    hl.add_argument("--holders", type=int, default=4, help="holder hosts (the prompt starts on the first)")
    hl.add_argument("--readers", type=int, default=6, help="reader hosts (stand-ins for prefill instances)")
    hl.add_argument("--link-rate", default="100mbit", help="every host's link, each way (tbf)")
    hl.add_argument("--requests", type=int, default=120)
    hl.add_argument("--rate", type=float, default=None, help="requests per second (Poisson; default 1.6, --quick 4)")
    hl.add_argument("--shared", type=float, default=0.9, help="fraction sharing the system prompt")
    hl.add_argument("--prefix-tokens", type=int, default=512)
    hl.add_argument("--prefill-tokens-per-s", type=float, default=1000.0, help="the stated compute rate (a sleep)")
    hl.add_argument("--hot-threshold", type=float, default=1.0, help="the on run's master.hot_threshold (reads/s)")
    hl.add_argument("--seed", type=int, default=0)
    hl.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    hl.add_argument("--quick", action="store_true", help="3 holders, 4 readers, 30 requests, a 256-token prompt, 4/s")
    _add_output(hl)


def _add_model_bench_parsers(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench scheduler | cpp | layerwise | serve | vllm | vllm-pd` (mutates `bench`)."""
    sc = bench.add_parser("scheduler", help="Conductor decision latency and whole-trace simulation time")
    sc.add_argument("--trace", default=sim_commands.DEFAULT_TRACE)
    sc.add_argument("--prefill", type=int, default=32)
    sc.add_argument("--decode", type=int, default=32)
    sc.add_argument("--indexed-blocks", type=int, default=100_000)
    sc.add_argument("--decisions", type=int, default=5000)
    sc.add_argument("--no-simulate", action="store_true", help="skip the whole-trace simulations")
    _add_output(sc)
    cpp = bench.add_parser("cpp", help="TTFT of a long prompt: one worker vs CPP prefill groups of k stages")
    cpp.add_argument("--prompt-tokens", type=int, default=4095)
    cpp.add_argument("--chunk-tokens", type=int, default=512)
    cpp.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    cpp.add_argument("--repeats", type=int, default=3)
    _add_output(cpp)
    pl = bench.add_parser("prefix-link", help="a pooled prefix read across a shaped link vs recomputing it (lab)")
    pl.add_argument("--model", default="random:smollm2-135m")
    pl.add_argument("--prefix-tokens", type=int, default=2048, help="whole 512-token blocks")
    pl.add_argument("--new-tokens", type=int, default=64)
    pl.add_argument(
        "--link-rates", type=parse_names, default=("25mbit", "400mbit"), help="each way, e.g. 25mbit,400mbit"
    )
    pl.add_argument("--repeats", type=int, default=3)
    pl.add_argument("--quick", action="store_true", help="the tiny model, links 20mbit,400mbit, one round")
    _add_output(pl)
    lw = bench.add_parser("layerwise", help="TTFT with a pooled prefix: layer-wise loading vs loading it whole first")
    lw.add_argument("--model", default="tiny")
    lw.add_argument("--prefix-tokens", type=int, default=2048)
    lw.add_argument("--new-tokens", type=int, default=16)
    lw.add_argument("--repeats", type=int, default=5)
    _add_output(lw)
    sv = bench.add_parser("serve", help="drive the OpenAI API with a workload (TTFT, TBT, reuse)")
    sv.add_argument("--url", default="", help="a running API; default: start `tsukimi up` per run")
    sv.add_argument("--model", default="tiny")
    sv.add_argument("--mode", choices=("pd", "colocated"), default="pd")
    sv.add_argument("--workload", choices=("chat", "trace", "skewed", "pool", "overload"), default="chat")
    sv.add_argument("--conversations", type=int, default=8)
    sv.add_argument("--turns", type=int, default=4, help="chat: turns each; pool: at most, per family")
    sv.add_argument("--families", type=int, default=24, help="pool: conversations / documents from the trace")
    sv.add_argument(
        "--trace-block-tokens", type=int, default=128, help="pool: tokens standing for one 512-token trace block"
    )
    sv.add_argument(
        "--cache-fraction", type=float, default=0.25, help="pool: each worker's KV cache, a share of the working set"
    )
    sv.add_argument("--prefix-tokens", type=int, default=2000)
    sv.add_argument(
        "--rate", type=float, default=None, help="chat: first turns per second (2); skewed, pool: requests/s (2, 1)"
    )
    sv.add_argument("--requests", type=int, default=60, help="skewed: how many requests")
    sv.add_argument("--shared", type=float, default=0.9, help="skewed: the fraction sharing the system prompt")
    sv.add_argument("--seed", type=int, default=0, help="skewed: prompts and arrival times")
    sv.add_argument("--prefill", type=int, default=1, help="prefill workers of each `tsukimi up` (mode pd)")
    sv.add_argument(
        "--compare-hot",
        type=float,
        default=0.0,
        metavar="THRESHOLD",
        help="run with the master's hot-key replication off, then on at THRESHOLD reads/s",
    )
    sv.add_argument("--trace", default=sim_commands.DEFAULT_TRACE)
    sv.add_argument("--speed", type=float, default=1.0, help="trace: replay this many times faster")
    sv.add_argument("--trace-limit", type=int, default=200)
    sv.add_argument("--no-compare", action="store_true", help="one run with reuse only")
    sv.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="each worker's KV cache, in blocks (default 4096; overload: 512, as tsukimi up; pool: sized)",
    )
    sv.add_argument("--duration", type=float, default=60.0, help="overload: seconds of load at --factor x")
    sv.add_argument("--factor", type=float, default=4.0, help="overload: times the measured sustainable rate")
    sv.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: chat 4 x 2 turns, 1000-token prefix; skewed 20 requests, 500-token prefix; "
        "trace 20 requests; pool 4 families x 2 turns; overload 10 s of load after a 6 s calibration",
    )
    _add_output(sv)
    vl = bench.add_parser("vllm", help="two vLLM instances: round-robin vs tsukimi (pool + Conductor) vs Mooncake")
    vl.add_argument("--model", default="tiny", help="tiny, smollm2 (under .models/) or a Hugging Face folder")
    vl.add_argument("--systems", default="vllm_rr,tsukimi,mooncake_store", help="comma-separated, in run order")
    vl.add_argument("--conversations", type=int, default=8)
    vl.add_argument("--turns", type=int, default=4)
    vl.add_argument("--prefix-tokens", type=int, default=2000)
    vl.add_argument("--rate", type=float, default=2.0, help="first turns per second")
    vl.add_argument("--quick", action="store_true", help="a smoke run: 2 conversations of 2 turns")
    _add_output(vl)
    vp = bench.add_parser("vllm-pd", help="a vLLM decode instance's KV through tsukimi: PD direct vs pool vs recompute")
    vp.add_argument("--model", default="", help="a model folder (default: .models/tiny)")
    vp.add_argument("--num-prompts", type=int, default=8)
    vp.add_argument("--prompt-tokens", type=int, default=1024)
    vp.add_argument("--no-save-per-layer", dest="save_per_layer", action="store_false")
    vp.add_argument("--quick", action="store_true", help="a smoke run: 1 prompt of 512 tokens")
    _add_output(vp)
    sg = bench.add_parser("sglang", help="SGLang HiCache L3 calls: MooncakeStore (real / compat) vs tsukimi's backend")
    sg.add_argument("--systems", default="mooncake,compat,tsukimi", help="comma-separated, in run order")
    sg.add_argument("--pages", type=int, default=1000, help="pages per rank (64 KiB each)")
    sg.add_argument("--tp", type=parse_ints, default=(1, 4), help="TP sizes, e.g. 1,4")
    sg.add_argument("--repeats", type=int, default=3, help="rounds of set/exists/get (fresh keys each); medians")
    sg.add_argument("--quick", action="store_true", help="a smoke run: 128 pages, TP 1, one round")
    _add_output(sg)
    _add_kv_burst_parser(bench)
    _add_gpu_parser(bench)


def _add_kv_burst_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench kv-burst` (mutates `bench`)."""
    kb = bench.add_parser("kv-burst", help="a burst of long prompts on a PD cluster: queue, then reject")
    kb.add_argument("--requests", type=int, default=64)
    kb.add_argument("--prompt-tokens", type=int, default=1500)
    kb.add_argument("--max-tokens", type=int, default=16)
    kb.add_argument("--prompts", choices=("distinct", "identical", "mixed"), default="distinct")
    kb.add_argument("--no-stream", action="store_true", help="non-streaming completions")
    kb.add_argument("--ttft-slo", type=float, default=30.0, help="the Conductor's TTFT SLO, seconds")
    kb.add_argument("--tbt-slo", type=float, default=0.0, help="the Conductor's TBT SLO, seconds (0: the router's)")
    kb.add_argument("--kv-cache-memory", default="512MiB", help="each worker's KV cache")
    kb.add_argument("--decode-num-blocks", type=int, default=0, help="the decode worker's KV blocks (0: from memory)")
    kb.add_argument("--no-kv-wait", action="store_true", help="reject at once what lacks decode KV memory")
    kb.add_argument("--warm-up", action="store_true", help="one short request before the burst")
    kb.add_argument(
        "--prefill-token-s",
        type=float,
        default=0.0,
        help="the router's config cost model: s per prompt token (0: the workers' own profiles)",
    )
    _add_output(kb)


def _add_gpu_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tsukimi bench gpu` (mutates `bench`)."""
    gp = bench.add_parser("gpu", help="raw host<->GPU copies, KV block scatter, prefill and reuse (issue 23)")
    gp.add_argument("--shape", default="", help="llama3-8b (default with CUDA), smollm2-135m, tiny (default without)")
    gp.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median), after one warm-up")
    gp.add_argument("--quick", action="store_true", help="no 1 GiB copy; prompts 4k, 16k (CPU: 128, 512 tokens)")
    _add_output(gp)
