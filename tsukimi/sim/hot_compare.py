"""`python -m tsukimi.sim.hot_compare`: the skewed workload of tsukimi/sim/hotspots.py through
the simulator with hot-prefix replication off and on; prints the p90 TTFT of both as JSON, and
the p90 of the requests sharing a prompt, the requests that fetched a prefix on their way to the
first token, and the replicas made. `--contention`: KV transfers share their source's link."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict

from tsukimi.config import SIMULATOR_CONDUCTOR, ConductorConfig, SimConfig
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.sim.hotspots import SkewedWorkload, p90_ttft_s, skewed_trace
from tsukimi.sim.simulator import SimResult, simulate


def compare(
    workload: SkewedWorkload, sim: SimConfig, conductor: ConductorConfig, hot: HotSpotConfig, contention: bool = False
) -> dict[str, object]:
    """p90 TTFT of `workload` with hot-prefix replication off and on (pure; deterministic)."""
    trace = skewed_trace(workload)
    off = simulate(trace, sim, conductor, contention=contention)
    on = simulate(trace, sim, conductor, hot=hot, contention=contention)
    shared_tokens = (workload.prefix_blocks + workload.suffix_blocks) * 512
    return {
        "workload": asdict(workload),
        "contention": contention,
        "kv_bandwidth_bytes_s": conductor.kv_bandwidth_bytes_s,
        "p90_ttft_s": {"off": round(p90_ttft_s(off.jobs), 4), "on": round(p90_ttft_s(on.jobs), 4)},
        "p90_ttft_shared_s": {name: _shared_p90(run, shared_tokens) for name, run in (("off", off), ("on", on))},
        "prefix_recomputed": {name: _recomputed(run, workload) for name, run in (("off", off), ("on", on))},
        "fetching_requests": {
            name: sum(j.fetch_tokens > 0 for j in run.jobs) for name, run in (("off", off), ("on", on))
        },
    }


def _recomputed(run: SimResult, workload: SkewedWorkload) -> int:
    """Shared-prompt requests that computed part of the system prompt (it was not cached)."""
    shared_tokens = (workload.prefix_blocks + workload.suffix_blocks) * 512
    prefix_tokens = workload.prefix_blocks * 512
    return sum(j.input_tokens == shared_tokens and 0 <= j.cached_tokens < prefix_tokens for j in run.jobs)


def _shared_p90(run: SimResult, shared_tokens: int) -> float:
    return round(p90_ttft_s([j for j in run.jobs if j.input_tokens == shared_tokens]), 4)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tsukimi.sim.hot_compare`: the skewed workload, replication off vs on (JSON)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--reuse", choices=("global", "local"), default="global")
    parser.add_argument("--kv-bandwidth", type=float, default=100e9, help="bytes per second (per instance's NIC)")
    parser.add_argument("--shared", type=float, default=0.9, help="fraction of requests sharing the prompt")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="a new prompt's popularity ramps up over this")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contention", action="store_true", help="KV transfers share their source's link")
    parser.add_argument("--cache-blocks", type=int, default=6000, help="each prefill instance's DRAM cache")
    parser.add_argument("--no-evict-hot-last", action="store_true", help="replicas are plain LRU entries")
    parser.add_argument("--prompts", type=int, default=1, help="hot system prompts in use at once")
    args = parser.parse_args(argv)
    workload = SkewedWorkload(
        requests=args.requests,
        rate_rps=args.rate,
        shared=args.shared,
        prefix_blocks=args.prefix_blocks,
        phase_s=args.phase_s,
        seed=args.seed,
        ramp_s=args.ramp_s,
        prompts=args.prompts,
    )
    sim = SimConfig(num_prefill=args.prefill, num_decode=args.prefill, cache_blocks=args.cache_blocks)
    conductor = dataclasses.replace(
        SIMULATOR_CONDUCTOR, rejection="none", reuse=args.reuse, kv_bandwidth_bytes_s=args.kv_bandwidth
    )
    hot = HotSpotConfig(evict_hot_last=not args.no_evict_hot_last)
    print(json.dumps(compare(workload, sim, conductor, hot, args.contention)))


if __name__ == "__main__":
    main()
