"""Hot-key replication in the master (Mooncake's Conductor "identifies hot-spot blocks and
replicates them proactively"): objects read often get extra replicas on more holders, so
no single holder serves every read of a popular prefix; the extras go when it cools down.

    read rate >= hot_threshold --copy task--> extra replicas (up to hot_max_replicas in all)
    rate < hot_cool_ratio * hot_threshold for hot_cool_down_s --> extras dropped (hysteresis)
    eviction pressure --> extras of objects no longer hot go first (before any whole object)

The read rate is an exponentially decaying counter per key (time constant `hot_window_s`):
O(1) per read, with no timer: the decay is applied when the counter is next read. A hot
key's extra replicas are made by the master's ordinary copy tasks (tasks.py, admin.py): the
master places a block on each new holder, a holder copies, and `tick` records the targets
as *extras* once the task succeeded. Only extras are ever dropped by this module, and never
below the replicas the put asked for.

Part of the pure state machine (`MasterState.hot`): no sockets, no threads, time passed
in. Extras are not in the HA log: after a failover they are ordinary replicas.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from tsukimi.clock import Clock
from tsukimi.config import MasterConfig
from tsukimi.errors import OutOfSpace, TaskInFlight
from tsukimi.store.master import task_start
from tsukimi.store.master.records import ObjectRecord
from tsukimi.store.master.segments import Placement, SegmentRegistry
from tsukimi.store.master.tasks import TaskTable

logger = logging.getLogger(__name__)


class HotHost(Protocol):
    """What hot-key replication reads and changes of its state machine (`MasterState`)."""

    config: MasterConfig
    clock: Clock
    registry: SegmentRegistry

    @property
    def objects(self) -> dict[str, ObjectRecord]: ...  # NOTE: read-only here: the table is MasterState's

    counters: Counter[str]
    retired: list[tuple[float, Placement]]
    tasks: TaskTable


@dataclass(slots=True)
class _Heat:
    """One key's decaying read count (`value` as of `at`), and its extra replicas."""

    value: float = 0.0
    at: float = 0.0
    put_id: int = 0  # the version the extras belong to
    extras: list[Placement] = field(default_factory=list)
    task_id: int = 0  # a copy task of ours in flight
    cool_since: float = math.inf  # when the rate fell below the cool threshold (inf: it has not)


class HotReplication:
    """The hot-key policy of one `MasterState` (which it reads and changes). Not thread-safe."""

    def __init__(self, state: HotHost) -> None:
        self.state = state
        self.config = state.config
        self.heat: dict[str, _Heat] = {}
        self._candidates: set[str] = set()  # keys that crossed the threshold since the last tick

    @property
    def enabled(self) -> bool:
        return self.config.hot_threshold > 0

    def rate(self, key: str, now: float) -> float:
        """Reads per second of `key` lately (pure)."""
        heat = self.heat.get(key)
        return 0.0 if heat is None else self._decayed(heat, now) / self.config.hot_window_s

    def on_read(self, key: str, now: float) -> None:
        """A get of `key` (O(1); mutates): count it, and queue it for replication when hot."""
        if not self.enabled:
            return
        heat = self.heat.get(key)
        if heat is None:
            heat = self.heat[key] = _Heat(at=now)
        heat.value, heat.at = self._decayed(heat, now) + 1.0, now
        if heat.value >= self.config.hot_threshold * self.config.hot_window_s:
            self._candidates.add(key)

    def extras_of(self, key: str) -> list[Placement]:
        """The extra replicas this module made of `key` that it still has (pure)."""
        heat, record = self.heat.get(key), self.state.objects.get(key)
        if heat is None or record is None or record.put_id != heat.put_id:
            return []
        return [p for p in heat.extras if p in record.replicas]

    def tick(self, now: float) -> None:
        """Record finished copies, replicate the keys that became hot, drop the extras of
        those that stayed cool for `hot_cool_down_s`. Mutates."""
        if not self.enabled:
            return
        for key in [k for k, h in self.heat.items() if h.task_id or h.extras]:
            self._settle(key, now)
        for key in sorted(self._candidates):
            self._replicate(key, now)
        self._candidates.clear()
        if len(self.heat) > 2 * len(self.state.objects) + 1024:  # NOTE: forget keys gone, amortised
            self.heat = {k: h for k, h in self.heat.items() if k in self.state.objects}

    def shed(self, target_bytes: int, now: float) -> int:
        """Eviction pressure: free the extras of objects that are no longer hot, coldest
        first, until `target_bytes` are freed (mutates). Returns the bytes freed now (the
        blocks of leased objects are freed when their lease ends)."""
        threshold = self.config.hot_threshold * self.config.hot_window_s
        cold = [(self._decayed(h, now), k) for k, h in self.heat.items() if h.extras]
        freed = 0
        for value, key in sorted(cold):
            if value >= threshold or freed >= target_bytes:
                break
            freed += self._drop_extras(key, now, "hot_sheds")
        return freed

    # -- internals -----------------------------------------------------------------------

    def _decayed(self, heat: _Heat, now: float) -> float:
        return heat.value * math.exp(-max(0.0, now - heat.at) / self.config.hot_window_s)

    def _settle(self, key: str, now: float) -> None:
        """Adopt the targets of our finished copy; forget extras no longer there; drop them
        after a cool-down."""
        heat, record = self.heat[key], self.state.objects.get(key)
        if record is None or record.put_id != heat.put_id:
            heat.extras, heat.task_id = [], 0
            return
        if heat.task_id:
            task = self.state.tasks.get(heat.task_id)
            if task.in_flight:
                return
            heat.task_id = 0
            if task.status == "succeeded":
                heat.extras += task.targets
                self.state.counters["hot_replications"] += len(task.targets)
        heat.extras = [p for p in heat.extras if p in record.replicas]
        if (
            self._decayed(heat, now)
            >= self.config.hot_cool_ratio * self.config.hot_threshold * self.config.hot_window_s
        ):
            heat.cool_since = math.inf
        elif heat.cool_since == math.inf:
            heat.cool_since = now
        # NOTE: the deadline as a sum, as the model test states it (a difference rounds the other way)
        elif heat.cool_since + self.config.hot_cool_down_s <= now:
            self._drop_extras(key, now, "hot_drops")

    def _replicate(self, key: str, now: float) -> None:
        """Start one copy task for `key` onto the emptiest healthy holders lacking it."""
        heat, record = self.heat[key], self.state.objects.get(key)
        if record is None or heat.task_id or not record.replicas:
            return
        if heat.put_id != record.put_id:
            heat.put_id, heat.extras = record.put_id, []
        want = self.config.hot_max_replicas - len(record.replicas)
        targets = self._targets(record, now)[: max(0, want)]
        if not targets:
            return
        try:
            heat.task_id = task_start.start(self.state, "copy", record, "", targets, 0)
        except (OutOfSpace, TaskInFlight):
            return
        heat.cool_since = math.inf
        logger.debug("replicating hot key %r to %s", key, targets)

    def _targets(self, record: ObjectRecord, now: float) -> list[str]:
        """Holders (TE segment names) with a healthy segment that has room for `record` and
        no replica of it, the emptiest first (pure)."""
        registry = self.state.registry
        holding = {registry.segments[p.segment_id].te_segment for p in record.replicas}
        room: dict[str, int] = {}
        for seg in registry.segments.values():
            if seg.te_segment in holding or not registry.healthy(seg.client_id, now):
                continue
            if seg.allocator.free_bytes >= record.size:
                room[seg.te_segment] = max(room.get(seg.te_segment, 0), seg.allocator.free_bytes)
        return sorted(room, key=lambda name: (-room[name], name))

    def _drop_extras(self, key: str, now: float, counter: str) -> int:
        """Drop `key`'s extras, keeping at least the replicas its put asked for (extras kept
        for that, after a holder was lost, become ordinary replicas). Returns the bytes freed
        now (a leased object's blocks wait for its lease: readers may use them)."""
        heat, record = self.heat[key], self.state.objects[key]
        spare = max(0, len(record.replicas) - record.config.replicas)
        gone = heat.extras[:spare]
        heat.extras, heat.cool_since = [], math.inf
        if not gone:
            return 0
        record.replicas = [p for p in record.replicas if p not in gone]
        self.state.objects[key] = record  # NOTE: marks the row changed for the HA log
        self.state.counters[counter] += len(gone)
        if record.lease_until > now:
            self.state.retired.extend((record.lease_until, p) for p in gone)
            return 0
        for placement in gone:
            self.state.registry.free(placement)
        return record.size * len(gone)

    def check_invariants(self) -> None:
        """Extras are replicas of their object's version, on distinct segments."""
        for key, heat in self.heat.items():
            record = self.state.objects.get(key)
            if not heat.extras or record is None or record.put_id != heat.put_id:
                continue
            assert len(set(heat.extras)) == len(heat.extras), f"{key}: an extra twice"
