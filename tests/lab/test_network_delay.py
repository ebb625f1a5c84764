"""A slow network under PD serving (issue 24, item 3): 50 ms of delay each way on the decode
worker's link (a delay line, tsukimi/lab/delay_line.py; this kernel has no netem), added at run
time under the cluster's open connections. Every request ends within REQUEST_BOUND_S with one
host's greedy tokens or a clear 5xx, never wrong tokens or a hang; the latencies, with a
baseline of the same requests before the delay, print with `-s` (docs/reliability.md).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from .conftest import needs_namespaces
from .pd_over_hosts import pd_over_hosts

pytestmark = [needs_namespaces, pytest.mark.timeout(240)]

REQUEST_BOUND_S = 30.0


def test_50ms_delay_on_a_workers_link_keeps_greedy_tokens(tmp_path: Path) -> None:
    """PD serving spread over five hosts (as test_cluster.py); after a baseline round, the
    decode worker's link gets 50 ms each way: every request still ends with the right tokens
    or a clear error within REQUEST_BOUND_S, at least one succeeds, and each pays the delay."""
    with pd_over_hosts(tmp_path) as pd:
        base_outcomes, base_s = pd.serve(REQUEST_BOUND_S)
        pd.lab.set_link("d", 0, delay="50ms")
        outcomes, latencies_s = pd.serve(REQUEST_BOUND_S)
    print(
        f"\n50 ms delay on the decode link: {outcomes}, median {statistics.median(latencies_s):.2f} s,"
        f" slowest {max(latencies_s):.2f} s; before the delay: {base_outcomes},"
        f" median {statistics.median(base_s):.2f} s, slowest {max(base_s):.2f} s"
    )
    assert "ok" in outcomes, outcomes
    assert min(latencies_s) >= 0.1, "a request crossed the decode link without its 2 x 50 ms round trip"
