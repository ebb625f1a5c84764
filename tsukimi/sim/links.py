"""Contention on the links KV leaves from, in the simulator: a fair-share fluid model.

Every source of KV (a location in the prefix index: an instance's DRAM stands for its NIC,
an SSD tier for the SSD) has a bandwidth, and the transfers in flight from it share it
equally (processor sharing): with n in flight, each moves at bandwidth / n, so two
transfers that start together take twice as long as one alone, and a transfer's finish
time depends on every transfer that overlaps it on its source.

Implemented with the usual virtual-service trick: `served` is the bytes each in-flight
transfer of a source has received since the source was created; it grows at bandwidth / n.
A transfer of b bytes that starts when `served` is s finishes when `served` reaches s + b,
so a source keeps a heap of those levels and one pending simulator event, for the first of
them (an event superseded by a later start carries an old version and is ignored). A start
or a finish costs O(log n).

Not modelled: the destination's link (a transfer is limited by its source only), per-flow
limits below the fair share, latency, and the NIC of an instance serving another's SSD
(an SSD source is limited by the SSD's bandwidth alone). Deterministic: no randomness;
transfers finishing at the same level finish in the order they started.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

LINK_DONE = 4  # the simulator's event kind of a source's next transfer finishing

_EPSILON_BYTES = 1e-3  # NOTE: float slack when comparing levels; far below one token's KV


@dataclass(slots=True)
class _Source:
    bandwidth_bytes_s: float
    served: float = 0.0  # bytes each in-flight transfer has received (cumulative)
    at_s: float = 0.0  # when `served` was last brought up to date
    version: int = 0  # bumped whenever the pending finish event is superseded
    flows: list[tuple[float, int, Callable[[float], None]]] = field(default_factory=list)  # (level, seq, done)

    def advance(self, now: float) -> None:
        if self.flows:
            self.served += (now - self.at_s) * self.bandwidth_bytes_s / len(self.flows)
        self.at_s = now


class SourceLinks:
    """The sources' links and the transfers in flight on them (see the module).

    Args:
        bandwidth_bytes_s: a source's bandwidth, asked once per source (when first used).
        push: `push(at, kind, payload)` schedules a simulator event; the simulator hands
            events of kind LINK_DONE back to `fire`.
    """

    def __init__(self, bandwidth_bytes_s: Callable[[str], float], push: Callable[[float, int, object], None]) -> None:
        self._bandwidth, self._push = bandwidth_bytes_s, push
        self._sources: dict[str, _Source] = {}
        self._seq = itertools.count()
        self.num_transfers = 0
        self.max_concurrent = 0  # the most transfers ever in flight on one source

    def active(self, source: str) -> int:
        """Transfers in flight from `source` now (pure). O(1)."""
        link = self._sources.get(source)
        return len(link.flows) if link is not None else 0

    def start(self, source: str, num_bytes: float, now: float, done: Callable[[float], None]) -> None:
        """Start moving `num_bytes` from `source` at `now`; `done(t)` is called when the last
        byte has left, at simulated time t (immediately for nothing to move). Mutates."""
        if num_bytes <= 0:
            done(now)
            return
        link = self._sources.get(source)
        if link is None:
            link = self._sources[source] = _Source(self._bandwidth(source), at_s=now)
        link.advance(now)
        heapq.heappush(link.flows, (link.served + num_bytes, next(self._seq), done))
        self.num_transfers += 1
        self.max_concurrent = max(self.max_concurrent, len(link.flows))
        self._schedule(source, link, now)

    def fire(self, payload: object, now: float) -> None:
        """A LINK_DONE event: finish the transfers of its source that are done by `now`
        (calling their `done`), unless the event was superseded. Mutates."""
        assert isinstance(payload, tuple)
        source, version = payload
        link = self._sources[source]
        if version != link.version:
            return
        link.advance(now)
        finished = []
        while link.flows:
            left = link.flows[0][0] - link.served
            # NOTE: also done when the rest takes less than the clock can resolve at `now`:
            # its finish event would fall at `now` again, forever.
            if left > _EPSILON_BYTES and now + left * len(link.flows) / link.bandwidth_bytes_s > now:
                break
            finished.append(heapq.heappop(link.flows)[2])
        self._schedule(source, link, now)
        for done in finished:
            done(now)

    def _schedule(self, source: str, link: _Source, now: float) -> None:
        """Book the event of `link`'s next finish (superseding the pending one)."""
        link.version += 1
        if link.flows:
            left = max(0.0, link.flows[0][0] - link.served)
            self._push(now + left * len(link.flows) / link.bandwidth_bytes_s, LINK_DONE, (source, link.version))
