"""The fetch policy's choices (tsukimi/p2p/fetch.py), on a record held in memory: found by
`tsukimi bench p2p --lab` (docs/benchmarks.md, "P2P across hosts"), where 8 readers each
pulling their whole origin share at once finished every shard at the end, and reads piled onto
one holder's link while the others idled."""

from __future__ import annotations

import threading
from typing import cast

from tsukimi.config import P2PConfig
from tsukimi.p2p.fetch import P2PStats, RecordView, ShardFetch
from tsukimi.p2p.records import Extent, HolderRecord, Location, PayloadRecord, Shard
from tsukimi.transfer import TransferEngine

ME, ORIGIN = "reader-0", "origin"
OTHERS = [f"reader-{i}" for i in range(1, 8)]


def _at(segment: str, index: int) -> Location:
    return Location(segment, (Extent(index * 4096, 4096),))


class _View:
    """A RecordView stand-in: one record, every reader fetching it, all alive."""

    def __init__(self, num_shards: int) -> None:
        shards = [Shard(i * 4096, 4096, 0, _at(ORIGIN, i)) for i in range(num_shards)]
        self.record = PayloadRecord(name="ckpt", registration="r", origin=ORIGIN, total_bytes=0, shards=shards)
        self.live = {seg: HolderRecord(pid=1, fetching=["ckpt"]) for seg in [ME, *OTHERS]}
        self.live[ORIGIN] = HolderRecord(pid=1, holding=["ckpt"])
        self.name = "ckpt"

    def current(self, *, fresh: bool = False) -> tuple[PayloadRecord, dict[str, HolderRecord]]:
        return self.record, self.live


class _Engine:
    name = ME


def _fetch(view: _View, max_inflight: int = 4) -> ShardFetch:
    return ShardFetch(
        cast(TransferEngine, _Engine()),
        P2PConfig(max_inflight=max_inflight),
        cast(RecordView, view),
        (Extent(0, 4096 * len(view.record.shards)),),
        lambda index: None,
        P2PStats(),
    )


def test_eight_readers_pull_their_origin_share_one_shard_at_a_time() -> None:
    view = _View(num_shards=32)  # NOTE: 8 fetchers: this reader owns shards 0, 8, 16, 24
    fetch = _fetch(view, max_inflight=4)
    index, from_gold = fetch._next() or (-1, False)
    assert from_gold and index % 8 == 0
    got: list[tuple[int, bool] | None] = []
    second = threading.Thread(target=lambda: got.append(fetch._next()))
    second.start()
    second.join(0.3)
    assert second.is_alive(), f"took a second origin shard while one is in flight: {got}"
    view.record.shards[5].replicas.append(_at(OTHERS[0], 5))  # another reader relays shard 5
    second.join(2.0)
    assert got == [(5, False)]


def test_a_lone_reader_keeps_max_inflight_origin_pulls() -> None:
    view = _View(num_shards=8)
    view.live = {ORIGIN: view.live[ORIGIN]}
    fetch = _fetch(view, max_inflight=4)
    picked = [fetch._next() for _ in range(4)]
    assert all(p is not None and p[1] for p in picked) and len({p[0] for p in picked if p}) == 4


def test_reads_go_to_holders_this_reader_is_not_reading_from() -> None:
    view = _View(num_shards=3)
    for index, holder in ((0, OTHERS[0]), (1, OTHERS[0]), (2, OTHERS[1])):
        view.record.shards[index].replicas.append(_at(holder, index))
    fetch = _fetch(view)
    fetch._reading[OTHERS[0]] = 1
    assert fetch._next() == (2, False)
    shard = view.record.shards[0]
    shard.replicas.append(_at(OTHERS[1], 0))
    assert ShardFetch._choose(shard.gold, shard.replicas, set(), {OTHERS[0]: 1}) == _at(OTHERS[1], 0)
    assert ShardFetch._choose(shard.gold, shard.replicas, {OTHERS[1]}, {OTHERS[0]: 1}) == _at(OTHERS[0], 0)
    assert ShardFetch._choose(shard.gold, shard.replicas, {OTHERS[0], OTHERS[1]}, {}) == shard.gold
    assert ShardFetch._choose(shard.gold, shard.replicas, {OTHERS[0], OTHERS[1], ORIGIN}, {}) is None
