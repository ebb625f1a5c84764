"""A get's first replica is picked at random (replica_io.spread), so a hot key's extra
replicas share its reads; the others follow in the master's order (healthy holders first)."""

from __future__ import annotations

import random
from collections import Counter

from tsukimi.store.protocol import ReplicaLocation
from tsukimi.store.replica_io import spread

REPLICAS = [ReplicaLocation(f"h{i}:1", 4096 * i, 100) for i in range(3)]


def test_a_lone_replica_is_read_as_listed() -> None:
    assert spread([]) == [] and spread(REPLICAS[:1]) == REPLICAS[:1]


def test_reads_start_on_every_replica_and_fail_over_in_the_masters_order() -> None:
    rng = random.Random(7)
    firsts: Counter[str] = Counter()
    for _ in range(3000):
        order = spread(REPLICAS, rng)
        assert sorted(order, key=REPLICAS.index) == REPLICAS  # each replica once
        rest = order[1:]
        assert rest == [r for r in REPLICAS if r != order[0]]  # the master's order after the pick
        firsts[order[0].te_segment] += 1
    assert set(firsts) == {"h0:1", "h1:1", "h2:1"}
    assert all(800 <= n <= 1200 for n in firsts.values()), firsts


def test_replicas_on_this_host_come_first_in_the_masters_order() -> None:
    rng = random.Random(3)
    here = {"h2:1", "h0:1"}
    for _ in range(200):
        order = spread(REPLICAS, rng, on_this_host=here.__contains__)
        assert [r.te_segment for r in order[:2]] == ["h0:1", "h2:1"]
        assert order[2:] == [REPLICAS[1]]
    everywhere = spread(REPLICAS, rng, on_this_host=lambda _: True)
    assert everywhere == REPLICAS  # all local: the master's order


def test_the_readers_own_segment_comes_before_the_rest_of_its_host() -> None:
    rng = random.Random(5)
    here = {"h2:1", "h0:1"}
    order = spread(REPLICAS, rng, on_this_host=here.__contains__, mine="h2:1")
    assert [r.te_segment for r in order] == ["h2:1", "h0:1", "h1:1"]
    assert spread(REPLICAS, rng, on_this_host=lambda _: True, mine="h1:1")[0] == REPLICAS[1]
