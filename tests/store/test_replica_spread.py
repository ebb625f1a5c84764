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
