"""Hot-spot identification for the Conductor: which prefixes are read often across the
cluster, and which prefill instances should get a replica of one (the paper's Conductor
"identifies hot-spot blocks and replicates them proactively").

`HotSpots` keeps an exponentially decaying count of the requests that used each block
(time constant `window_s`, so count / window_s is a rate per second) and names a request's
*hot prefix*: its longest prefix whose blocks are all read at `threshold_rps` or more.
Blocks are chained hashes, so a block's count never exceeds its predecessor's and the walk
stops at the first cold block. `targets` picks the instances that should hold a replica of a
hot prefix: up to `max_replicas` holders in all, those with the shortest queues first, so
that Algorithm 1 (which already prefers the cheapest of the instances holding a prefix)
spreads the prefix's requests over them instead of piling them on the first holder.

Pure and not thread-safe, like the Conductor; time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tsukimi.errors import ConfigError
from tsukimi.scheduler.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class HotSpotConfig:
    """threshold_rps: a block read this often (decaying average over `window_s`) is hot;
    max_replicas: prefill instances that should hold a hot prefix (the first holder
    included); min_blocks: shorter hot prefixes are not worth replicating; evict_hot_last:
    a cache holding hot blocks evicts its cold blocks first (the simulator's prefill caches)."""

    threshold_rps: float = 2.0
    window_s: float = 10.0
    max_replicas: int = 4
    min_blocks: int = 2
    evict_hot_last: bool = True

    def __post_init__(self) -> None:
        if self.threshold_rps <= 0 or self.window_s <= 0:
            raise ConfigError("hot spots: threshold_rps and window_s must be > 0")
        if self.max_replicas < 2 or self.min_blocks < 1:
            raise ConfigError("hot spots: max_replicas must be >= 2 and min_blocks >= 1")


class HotSpots:
    """Decaying per-block read counts and the replica targets of hot prefixes."""

    def __init__(self, config: HotSpotConfig) -> None:
        self.config = config
        self._counts: dict[int, tuple[float, float]] = {}  # block -> (count, as of time)
        self._hot_at = config.threshold_rps * config.window_s

    def observe(self, blocks: Sequence[int], now: float) -> int:
        """Count one use of `blocks` at `now` (mutates). O(len(blocks)).

        Returns:
            The length of the request's hot prefix (0: none, or shorter than min_blocks).
        """
        counts, window, hot = self._counts, self.config.window_s, 0
        for i, block in enumerate(blocks):
            count, at = counts.get(block, (0.0, now))
            count = count * math.exp(-(now - at) / window) + 1.0
            counts[block] = (count, now)
            if count >= self._hot_at and hot == i:  # NOTE: the hot run must be a prefix
                hot += 1
        if len(counts) > 1 << 20:  # NOTE: forget the cold blocks now and then, amortised
            self._forget(now)
        return hot if hot >= self.config.min_blocks else 0

    def is_hot(self, block: int, now: float) -> bool:
        """Whether `block` is read at `threshold_rps` or more lately (pure)."""
        return self.rate(block, now) >= self.config.threshold_rps

    def rate(self, block: int, now: float) -> float:
        """Reads per second of `block` lately (pure)."""
        count, at = self._counts.get(block, (0.0, now))
        return count * math.exp(-(now - at) / self.config.window_s) / self.config.window_s

    def targets(
        self, index: PrefixIndex, hot_blocks: Sequence[int], locations: dict[str, str], queue_s: Callable[[str], float]
    ) -> list[str]:
        """The instances that should get a replica of `hot_blocks` now (pure).

        Args:
            index: where blocks are; locations: instance name -> its cache's location.
            queue_s: an instance's estimated queue (the Conductor's `prefill_queue_s`).

        Returns:
            Instances lacking the whole prefix, shortest queue first (ties by name), as many
            as bring its holders up to `max_replicas`; [] when it has no holder yet.
        """
        held = {name for name, loc in locations.items() if index.match_at(loc, hot_blocks) == len(hot_blocks)}
        if not held:
            return []
        room = self.config.max_replicas - len(held)
        lacking = sorted((queue_s(name), name) for name in locations if name not in held)
        return [name for _, name in lacking[: max(0, room)]]

    def _forget(self, now: float) -> None:
        floor = 0.01 * self._hot_at
        window = self.config.window_s
        self._counts = {b: (c, t) for b, (c, t) in self._counts.items() if c * math.exp(-(now - t) / window) >= floor}
