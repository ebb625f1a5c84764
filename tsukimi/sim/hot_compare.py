"""`python -m tsukimi.sim.hot_compare`: the skewed workload of tsukimi/sim/hotspots.py through
the simulator with hot-prefix replication off and on; prints the p90 TTFT of both as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict

from tsukimi.config import ConductorConfig, SimConfig
from tsukimi.scheduler.hotspots import HotSpotConfig
from tsukimi.sim.hotspots import SkewedWorkload, p90_ttft_s, skewed_trace
from tsukimi.sim.simulator import simulate


def compare(
    workload: SkewedWorkload, sim: SimConfig, conductor: ConductorConfig, hot: HotSpotConfig
) -> dict[str, object]:
    """p90 TTFT of `workload` with hot-prefix replication off and on (pure; deterministic)."""
    trace = skewed_trace(workload)
    off, on = simulate(trace, sim, conductor), simulate(trace, sim, conductor, hot=hot)
    return {"workload": asdict(workload), "p90_ttft_s": {"off": round(p90_ttft_s(off.jobs), 4),
            "on": round(p90_ttft_s(on.jobs), 4)}}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tsukimi.sim.hot_compare`: the skewed workload, replication off vs on (JSON)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--reuse", choices=("global", "local"), default="global")
    parser.add_argument("--kv-bandwidth", type=float, default=100e9, help="bytes per second")
    args = parser.parse_args(argv)
    workload = SkewedWorkload(rate_rps=args.rate, prefix_blocks=args.prefix_blocks, phase_s=args.phase_s)
    sim = SimConfig(num_prefill=args.prefill, num_decode=args.prefill)
    conductor = ConductorConfig(rejection="none", reuse=args.reuse, kv_bandwidth_bytes_s=args.kv_bandwidth)
    print(json.dumps(compare(workload, sim, conductor, HotSpotConfig())))


if __name__ == "__main__":
    main()
