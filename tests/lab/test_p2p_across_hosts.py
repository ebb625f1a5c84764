"""The P2P store with a reader on every host: the metadata server on one emulated host, the
origin on another, a reader on each of four more (tsukimi/testing/p2p_peer.py, each serving
its copy on its own host's address), every byte over tcp between hosts. Readers one after the
other: each is byte-exact, the first pulls the origin's copy, the later ones pull only from
earlier readers, and the origin's link carried the payload once. Then all four at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tsukimi.lab import Lab, Topology
from tsukimi.lab.counters import nic_bytes
from tsukimi.testing.lab_services import start_metadata_server, worker_in
from tsukimi.testing.p2p_peer import digest, payload_bytes
from tsukimi.testing.processes import JsonWorker, gather

from .conftest import needs_namespaces

pytestmark = [needs_namespaces, pytest.mark.timeout(120)]

CHECKOUT = Path(__file__).resolve().parents[2]  # NOTE: first on the peers' path: they run the code under test
READERS = ("r1", "r2", "r3", "r4")
MIB = 1 << 20
SIZE = 16 * MIB  # 16 shards of 1 MiB
FETCH_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(Topology.of("meta", "origin", *READERS)) as made:
        yield made


@pytest.fixture(scope="module")
def peers(lab: Lab) -> Iterator[dict[str, JsonWorker]]:
    url = start_metadata_server(lab, "meta")
    started: dict[str, JsonWorker] = {}
    try:
        for host in ("origin", *READERS):
            args = ["tsukimi.testing.p2p_peer", url, "--transport", "tcp", "--bind-host", lab.address(host)]
            started[host] = worker_in(lab, host, "p2p store", [*args, "--shard-bytes", str(MIB)], pythonpath=[CHECKOUT])
        yield started
    finally:
        for worker in started.values():
            worker.stop()


def _stats(worker: JsonWorker) -> dict[str, int]:
    """A P2P store's counters now (they add up over the store's life)."""
    stats: dict[str, int] = worker.call(FETCH_TIMEOUT_S, cmd="stats")["stats"]
    return stats


def _since(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: now[name] - before[name] for name in before}


def test_every_store_serves_on_its_own_host(lab: Lab, peers: dict[str, JsonWorker]) -> None:
    assert {host: str(w.ready["segment"]).rsplit(":", 1)[0] for host, w in peers.items()} == {
        host: lab.address(host) for host in peers
    }


def test_readers_one_after_another_pull_from_the_earlier_ones(lab: Lab, peers: dict[str, JsonWorker]) -> None:
    expected = digest(payload_bytes(SIZE, 11))
    assert peers["origin"].call(FETCH_TIMEOUT_S, cmd="register", name="ckpt-seq", size=SIZE, seed=11)["shards"] == 16
    before = nic_bytes(lab, "origin")
    stats = {}
    for host in READERS:
        counted = _stats(peers[host])
        reply = peers[host].call(FETCH_TIMEOUT_S, cmd="fetch", name="ckpt-seq", size=SIZE)
        assert reply["sha256"] == expected, f"{host}'s copy differs"
        stats[host] = _since(reply["stats"], counted)
    origin_sent = (nic_bytes(lab, "origin") - before).tx_bytes
    assert stats["r1"]["bytes_from_gold"] == SIZE, stats
    for host in READERS[1:]:
        assert (stats[host]["bytes_from_gold"], stats[host]["bytes_from_replicas"]) == (0, SIZE), (host, stats)
    assert SIZE <= origin_sent < 1.1 * SIZE, f"the origin sent {origin_sent / SIZE:.2f}x the payload"


def test_readers_all_at_once_are_byte_exact_and_spare_the_origin(lab: Lab, peers: dict[str, JsonWorker]) -> None:
    """Four readers start together: each is byte-exact, and the origin's link carries less
    than the naive four copies (the readers deal the origin's shards out among themselves)."""
    expected = digest(payload_bytes(SIZE, 12))
    peers["origin"].call(FETCH_TIMEOUT_S, cmd="register", name="ckpt-all", size=SIZE, seed=12)
    readers = [peers[h] for h in READERS]
    counted = [_stats(w) for w in readers]
    before = nic_bytes(lab, "origin")
    replies = gather(readers, FETCH_TIMEOUT_S, cmd="fetch", name="ckpt-all", size=SIZE)
    origin_sent = (nic_bytes(lab, "origin") - before).tx_bytes
    assert [r["sha256"] for r in replies] == [expected] * len(READERS)
    moved = [_since(r["stats"], c) for r, c in zip(replies, counted, strict=True)]
    from_gold = sum(m["bytes_from_gold"] for m in moved)
    assert sum(m["bytes_from_replicas"] for m in moved) == len(READERS) * SIZE - from_gold, moved
    assert from_gold <= origin_sent < 3 * SIZE, f"the origin sent {origin_sent / SIZE:.2f}x the payload"
