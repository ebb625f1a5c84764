"""One reader of `tsukimi bench hot-lab` (tsukimi/bench/hot_lab.py): a stand-in for a prefill
instance on its own emulated host. It reads its plan (`ReaderPlan`, JSON) from stdin, serves
its requests one at a time in arrival order, and prints one `ReaderResult` (JSON) per line.

It connects, prints "ready", then reads the run's wall-clock start (time.time(): every host
shares this machine's clock) as one line. A request waits for its arrival (and for the
reader to be free: queueing), fetches its prefix objects from the pool (one batch get over
the shaped links, `transfer.transport=tcp`), then sleeps `compute_s`: the bench's stated
prefill time of what it did not fetch (the engine is not in this bench). TTFT = arrival -> done.

    python -m tsukimi.bench.hot_lab_reader < plan.json      (started inside a lab host)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import msgspec

from tsukimi.config import Config
from tsukimi.errors import PeerError
from tsukimi.store.client import StoreClient


class ReaderRequest(msgspec.Struct, frozen=True):
    """One request: its index in the workload, arrival (seconds after the plan's `start_at`),
    the pool keys of its prefix (empty: nothing to fetch) and the compute time after them."""

    index: int
    at_s: float
    keys: list[str]
    compute_s: float


class ReaderPlan(msgspec.Struct, frozen=True):
    """What a reader does: its master, its host's address (its Transfer Engine binds there),
    its requests in arrival order."""

    master: str
    transfer_host: str
    requests: list[ReaderRequest]


class ReaderResult(msgspec.Struct, frozen=True):
    """One request's outcome: TTFT (arrival -> done), the fetch's seconds and bytes."""

    index: int
    ttft_s: float
    fetch_s: float
    fetched_bytes: int


def tcp_client(master: str, host: str) -> StoreClient:
    """A store client of `master` whose Transfer Engine binds `host` and moves bytes over tcp."""
    config = Config()
    return StoreClient.connect(master, 0, replace(config, transfer=replace(config.transfer, transport="tcp")), host)


def serve(plan: ReaderPlan, start: Callable[[], float]) -> list[ReaderResult]:
    """Connect, then serve the plan's requests one at a time from `start()` on (see the module).

    Raises:
        PeerError: a prefix object was missing or unreadable (the bench wrote them all).
    """
    results = []
    with tcp_client(plan.master, plan.transfer_host) as client:
        start_at = start()
        for request in plan.requests:
            arrival = start_at + request.at_s
            time.sleep(max(0.0, arrival - time.time()))
            began = time.time()
            got = client.batch_get(request.keys) if request.keys else []
            fetched = time.time()
            for key, result in zip(request.keys, got, strict=True):
                if result.error is not None or not result.found:
                    raise PeerError(f"request {request.index}: {key!r} not read: {result.error}")
            time.sleep(request.compute_s)
            done = time.time()
            results.append(ReaderResult(request.index, done - arrival, fetched - began, sum(r.size for r in got)))
    return results


def main() -> None:
    plan = msgspec.json.decode(sys.stdin.buffer.readline(), type=ReaderPlan)

    def start() -> float:
        print("ready", flush=True)
        return float(sys.stdin.readline())

    for result in serve(plan, start):
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
